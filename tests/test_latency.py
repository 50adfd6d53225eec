"""Latency as a measured output (issue 16): per-request times of server runs read from shard meta,
per-run percentiles, candidate against golden, the latency verdict apart from the output verdict,
and where it is shown (metrics.json, the page, summary.md, JUnit). Synthetic runs, no engine."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from report_fixtures import NO_SEMANTIC, Case, add_timings, build_case, rescore
from regress.errors import StorageError
from regress.latency import compare, latency_stats, output_token_counts, percentiles
from regress.records import LatencyStats, RunMetrics
from regress.report import METRICS_SCHEMA
from regress.report.junit import junit_xml
from regress.report.payload import build_payload
from regress.report.render import render_candidate
from regress.report.summary import summary_markdown
from regress.runs import load_run
from regress.latency import latency_verdict
from regress.verdict import Thresholds

PROMPTS = 12


def _times(seed: int, n: int = PROMPTS, scale: float = 1.0) -> tuple[list[float | None], list[float | None]]:
    rng = np.random.default_rng(seed)
    ttft = (rng.uniform(0.02, 0.2, n) * scale).tolist()
    decode = (rng.uniform(0.3, 1.5, n) * scale).tolist()
    return ttft, [a + b for a, b in zip(ttft, decode)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Case:
    """An offline case (no per-request times), shards of 5 prompts."""
    return build_case(tmp_path_factory.mktemp("latency"), PROMPTS, tokens=16, shard_size=5, semantic=False)


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Case, dict]:
    """A server-like case: the candidate 1.5x slower per request, same throughput; one unknown time."""
    case = build_case(tmp_path_factory.mktemp("latency-timed"), PROMPTS, tokens=16, shard_size=5, semantic=False)
    g_ttft, g_lat = _times(1)
    c_ttft, c_lat = _times(1, scale=1.5)
    c_ttft[4] = None  # a request whose first token was not seen
    golden = add_timings(case.root / "golden", g_ttft, g_lat, concurrency=4)
    run = add_timings(case.root / "run", c_ttft, c_lat, concurrency=4)
    times = {"g_ttft": g_ttft, "g_lat": g_lat, "c_ttft": c_ttft, "c_lat": c_lat}
    return rescore(case, golden=golden, run=run), times


# ------------------------------------------------------------------ reading


def test_old_runs_load_without_timings(base: Case) -> None:
    assert base.golden.ttft_s is None and base.golden.latency_s is None and base.golden.concurrency is None
    assert base.run.ttft_s is None and base.run.concurrency is None


def test_timings_are_read_across_shards(timed: tuple[Case, dict]) -> None:
    case, times = timed
    assert len(case.golden.manifest.layout.shards) == 3
    assert case.golden.ttft_s == pytest.approx(times["g_ttft"])
    assert case.golden.latency_s == pytest.approx(times["g_lat"])
    assert case.run.ttft_s[4] is None and case.run.latency_s[4] is not None
    assert case.golden.concurrency == 4 == case.run.concurrency


def test_a_shard_without_timings_gives_none_entries(tmp_path: Path) -> None:
    case = build_case(tmp_path, PROMPTS, tokens=16, shard_size=5, semantic=False)
    # timings in the first shard only: the others' prompts are unknown, not zero
    ttft = [0.1] * 5 + [None] * 7
    lat = [1.0] * 5 + [None] * 7
    run = add_timings(case.root / "run", ttft, lat, concurrency=None)
    assert run.ttft_s == ttft and run.latency_s == lat and run.concurrency is None
    stats = latency_stats(run)
    assert stats.requests == 5 and stats.ttft_p50_s == pytest.approx(0.1)


def test_inconsistent_timings_are_a_storage_error(tmp_path: Path) -> None:
    case = build_case(tmp_path, 6, tokens=16, shard_size=6, semantic=False)
    with pytest.raises(StorageError, match="latency_s"):
        add_timings(case.root / "run", [0.1] * 6, [1.0] * 5)  # one short
    with pytest.raises(StorageError, match="ttft_s"):
        add_timings(case.root / "golden", [0.1] * 5 + ["soon"], [1.0] * 6)  # type: ignore[list-item]


# ------------------------------------------------------------------ statistics


def test_percentiles_match_numpy(timed: tuple[Case, dict]) -> None:
    case, times = timed
    stats = latency_stats(case.golden)
    assert stats.requests == PROMPTS
    assert [stats.ttft_p50_s, stats.ttft_p95_s, stats.ttft_p99_s] == \
        pytest.approx(np.percentile(times["g_ttft"], [50, 95, 99]).tolist())
    assert [stats.latency_p50_s, stats.latency_p95_s, stats.latency_p99_s] == \
        pytest.approx(np.percentile(times["g_lat"], [50, 95, 99]).tolist())
    tokens = output_token_counts(case.golden)
    assert tokens.tolist() == [len(case.golden.output_token_ids(i)) for i in range(PROMPTS)]
    tpot = [(lat - first) / max(1, int(k) - 1) for first, lat, k in zip(times["g_ttft"], times["g_lat"], tokens)]
    assert [stats.tpot_p50_s, stats.tpot_p95_s, stats.tpot_p99_s] == \
        pytest.approx(np.percentile(tpot, [50, 95, 99]).tolist())
    t = case.golden.manifest.timings
    assert stats.throughput_tokens_per_s == pytest.approx(t.output_tokens / t.generation_s)
    assert stats.concurrency == 4
    # the candidate: requests with a total time; TTFT and TPOT only where both are known
    cand = latency_stats(case.run)
    assert cand.requests == PROMPTS
    known = [x for x in times["c_ttft"] if x is not None]
    assert cand.ttft_p95_s == pytest.approx(float(np.percentile(known, 95)))


def test_percentiles_of_nothing() -> None:
    assert percentiles([]) == (None, None, None)
    assert percentiles([2.0]) == (2.0, 2.0, 2.0)


def test_offline_runs_have_throughput_only(base: Case) -> None:
    stats = latency_stats(base.golden)
    assert stats.requests == 0 and stats.throughput_tokens_per_s is not None
    assert all(getattr(stats, f) is None for f in LatencyStats.model_fields
               if f not in ("requests", "throughput_tokens_per_s"))


def test_ratios() -> None:
    g = LatencyStats(requests=3, ttft_p50_s=0.1, ttft_p95_s=0.2, tpot_p95_s=0.01, latency_p95_s=1.0,
                     throughput_tokens_per_s=100.0)
    c = LatencyStats(requests=3, ttft_p50_s=0.15, ttft_p95_s=0.2, tpot_p95_s=0.02, latency_p95_s=None,
                     throughput_tokens_per_s=80.0)
    cmp = compare(g, c)
    assert cmp.ttft_p50_ratio == pytest.approx(1.5) and cmp.ttft_p95_ratio == pytest.approx(1.0)
    assert cmp.tpot_p95_ratio == pytest.approx(2.0) and cmp.latency_p95_ratio is None
    assert cmp.throughput_ratio == pytest.approx(0.8)
    assert compare(LatencyStats(throughput_tokens_per_s=0.0), c).throughput_ratio is None


# ------------------------------------------------------------------ scoring and verdict


def test_old_runs_score_as_before(base: Case) -> None:
    m = base.score.metrics
    assert m.latency is not None and m.latency.golden.requests == 0
    assert m.latency.throughput_ratio == pytest.approx(1.0)
    assert m.latency.ttft_p95_ratio is None and m.latency.latency_p95_ratio is None
    assert m.latency_verdict is None and m.latency_reasons == [] and m.latency_gates is False
    assert m.gating_failed == (m.verdict == "fail")
    data = json.loads(m.model_dump_json())
    numbers = {k for side in ("golden", "candidate") for k, v in data["latency"][side].items() if v}
    assert numbers == {"throughput_tokens_per_s"}


def test_old_metrics_json_still_loads(base: Case) -> None:
    data = json.loads(base.score.metrics.model_dump_json())
    old = {k: v for k, v in data.items() if not k.startswith("latency")}
    m = RunMetrics.model_validate(old)
    assert m.latency is None and m.latency_verdict is None and m.latency_reasons == [] and not m.latency_gates


def test_timed_case_compares(timed: tuple[Case, dict]) -> None:
    case, _ = timed
    lat = case.score.metrics.latency
    assert lat is not None and lat.golden.requests == PROMPTS
    assert lat.latency_p95_ratio == pytest.approx(1.5)
    assert lat.tpot_p95_ratio == pytest.approx(1.5, rel=0.05)
    assert case.score.metrics.latency_verdict is None  # no latency threshold set


def test_latency_verdict_with_thresholds(timed: tuple[Case, dict]) -> None:
    case, _ = timed
    output_verdict = case.score.metrics.verdict
    slow = rescore(case, Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2), golden=case.golden, run=case.run)
    m = slow.score.metrics
    assert m.latency_verdict == "fail" and m.verdict == output_verdict  # the output verdict does not move
    assert any("p95 total time" in r and "max_latency_ratio" in r for r in m.latency_reasons)
    assert not m.latency_gates and m.gating_failed == (output_verdict == "fail")
    lenient = rescore(case, Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.6, min_throughput_ratio=0.8),
                      golden=case.golden, run=case.run)
    assert lenient.score.metrics.latency_verdict == "pass"
    assert any("throughput" in r for r in lenient.score.metrics.latency_reasons)


def test_throughput_gate_on_offline_runs(tmp_path: Path) -> None:
    case = build_case(tmp_path, PROMPTS, tokens=16, shard_size=5, semantic=False)
    golden = add_timings(case.root / "golden", [None] * PROMPTS, [None] * PROMPTS, concurrency=None)
    run = add_timings(case.root / "run", [None] * PROMPTS, [None] * PROMPTS, concurrency=None,
                      generation_s=case.run.manifest.timings.generation_s * 2)  # half the throughput
    assert run.ttft_s is None  # all null: no timing at all
    t = Thresholds(metrics=NO_SEMANTIC, min_throughput_ratio=0.8, max_latency_ratio=1.2, gate_latency=True)
    m = rescore(case, t, golden=golden, run=run).score.metrics
    assert m.latency is not None and m.latency.throughput_ratio == pytest.approx(0.5)
    assert m.latency_verdict == "fail" and m.latency_gates and m.gating_failed
    assert any("not compared" in r for r in m.latency_reasons)


def test_latency_verdict_unset_and_nothing_to_compare() -> None:
    t = Thresholds()
    assert latency_verdict(None, t) == (None, [])
    verdict, reasons = latency_verdict(None, Thresholds(max_latency_ratio=1.2))
    assert verdict is None and reasons
    empty = compare(LatencyStats(), LatencyStats())
    assert latency_verdict(empty, Thresholds(max_latency_ratio=1.2))[0] is None


def test_thresholds_validate() -> None:
    from regress.errors import ConfigError

    assert Thresholds().max_latency_ratio is None and Thresholds().gate_latency is False
    with pytest.raises(ConfigError):
        Thresholds.from_params({"max_latency_ratio": 0})
    with pytest.raises(ConfigError):
        Thresholds.from_params({"min_throughput_ratio": -1})


def test_gate_latency(timed: tuple[Case, dict]) -> None:
    case, _ = timed
    gated = rescore(case, Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2, gate_latency=True),
                    golden=case.golden, run=case.run).score
    m = gated.metrics
    assert m.latency_verdict == "fail" and m.latency_gates and m.gating_failed
    passing = m.model_copy(update={"verdict": "pass"})
    assert passing.gating_failed
    assert not passing.model_copy(update={"latency_gates": False}).gating_failed
    assert gated.thresholds["gate_latency"] is True


# ------------------------------------------------------------------ shown


def test_metrics_json_matches_the_schema(timed: tuple[Case, dict], base: Case) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(METRICS_SCHEMA.read_text(encoding="utf-8"))
    case, _ = timed
    gated = rescore(case, Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2, gate_latency=True),
                    golden=case.golden, run=case.run).score.metrics
    for m in (gated, base.score.metrics, case.score.metrics):
        data = json.loads(m.model_dump_json())
        jsonschema.validate(data, schema)
    data = json.loads(gated.model_dump_json())
    for broken in ({**data, "latency_verdict": "maybe"},
                   {**data, "latency": {**data["latency"], "golden": {**data["latency"]["golden"], "surprise": 1}}},
                   {**data, "latency": {**data["latency"], "ttft_p95_ratio": "fast"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
    props = schema["$defs"]["LatencyStats"]["properties"]
    assert "time to first token" in props["ttft_p95_s"]["description"]


def test_page_shows_latency_rows(timed: tuple[Case, dict]) -> None:
    case, _ = timed
    gated = rescore(case, Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2, gate_latency=True),
                    golden=case.golden, run=case.run)
    page = render_candidate(gated.score, gated.golden, gated.run, gated.prompt_set)
    for label in ("TTFT p50", "TTFT p95", "TTFT p99", "TPOT p95", "total p95", "concurrency"):
        assert f"<th>{label}</th>" in page, label
    assert "latency FAIL" in page and "gates the check" in page and "max_latency_ratio" in page
    assert "1.50×" in page
    data = build_payload(gated.score, gated.golden, gated.run, gated.prompt_set)
    assert data["latency"]["verdict"] == "fail" and data["latency"]["gates"] is True


def test_offline_page_has_no_latency_rows(base: Case) -> None:
    page = render_candidate(base.score, base.golden, base.run, base.prompt_set)
    assert "<th>TTFT p95</th>" not in page and "latency FAIL" not in page and "latency PASS" not in page
    assert "<th>throughput</th>" in page


def test_summary_latency_line(timed: tuple[Case, dict], base: Case) -> None:
    case, _ = timed
    md = summary_markdown(case.score)
    assert "**Latency**" in md and "TTFT p95" in md and "concurrency 4" in md
    assert "Latency pass" not in md and "Latency fail" not in md
    slow = rescore(case, Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2), golden=case.golden, run=case.run)
    md = summary_markdown(slow.score)
    assert "**Latency fail** (reported, not gating)" in md
    assert "**Latency**" not in summary_markdown(base.score)


def test_junit_latency_case_only_when_gating(timed: tuple[Case, dict]) -> None:
    case, _ = timed

    def parsed(thresholds: Thresholds) -> ET.Element:
        score = rescore(case, thresholds, golden=case.golden, run=case.run).score
        return ET.fromstring(junit_xml(score).split("\n", 1)[1])

    reported = parsed(Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2))
    suite = reported.find("testsuite")
    assert suite is not None and suite.find("testcase[@name='latency']") is None
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["latency_verdict"] == "fail" and props["latency_gates"] == "false"
    assert float(props["candidate_latency_p95_s"]) > float(props["golden_latency_p95_s"])
    assert props["golden_concurrency"] == "4"

    gated = parsed(Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2, gate_latency=True))
    suite = gated.find("testsuite")
    case_el = suite.find("testcase[@name='latency']")
    assert case_el is not None and case_el.find("failure").get("type") == "latency"
    assert int(suite.get("tests")) == PROMPTS + 2  # the prompts, the fidelity verdict and the latency case
    failures = sum(1 for c in suite.iter("testcase") if c.find("failure") is not None)
    assert int(suite.get("failures")) == failures

    plain = ET.fromstring(junit_xml(rescore(case, golden=case.golden, run=case.run).score).split("\n", 1)[1])
    props = {p.get("name") for p in plain.iter("property")}
    assert "latency_verdict" not in props and "golden_ttft_p95_s" in props


def test_reloaded_run_is_unchanged(base: Case) -> None:
    again = load_run(base.golden.path)
    assert again.prompt_ids == base.golden.prompt_ids and again.ttft_s is None


def test_summary_heading_when_latency_gates(timed: tuple[Case, dict]) -> None:
    case, _ = timed
    gated = rescore(case, Thresholds(metrics=NO_SEMANTIC, max_latency_ratio=1.2, gate_latency=True),
                    golden=case.golden, run=case.run).score
    passing = gated.model_copy(update={"metrics": gated.metrics.model_copy(update={"verdict": "pass"})})
    assert summary_markdown(passing).startswith("## ❌ regress: `candidate` fails on latency")
    assert "**Latency fail** (gates the check)" in summary_markdown(passing)


@pytest.mark.parametrize("gates, code", [(False, 0), (True, 1)])
def test_regress_gate_fails_on_latency_only_when_it_gates(base: Case, tmp_path: Path, gates: bool, code: int) -> None:
    """The exit code follows ``gating_failed``: a failed latency verdict with passing outputs exits
    1 only with ``gate_latency: true``, and the line says so either way."""
    from conftest import run_cli

    metrics = base.score.metrics.model_copy(update={
        "candidate": "c", "verdict": "pass", "latency_verdict": "fail", "latency_gates": gates,
        "latency_reasons": ["p95 time to first token 1.50x the golden's > 1.2x"]})
    (tmp_path / "scores" / "c").mkdir(parents=True)
    (tmp_path / "scores" / "c" / "metrics.json").write_text(metrics.model_dump_json())
    # Thresholds under which the base run's outputs pass (the gate refuses a pass its counts contradict).
    (tmp_path / "params.yaml").write_text("dataset: p.jsonl\nbaseline: {model: m}\ncandidates: {c: {allow_input_drift: true}}\n"
                                          f"thresholds: {{max_regressions: {PROMPTS}}}\n")
    gate = run_cli("gate", "c", cwd=tmp_path)
    assert gate.returncode == code, gate.stdout + gate.stderr
    shown = "latency FAIL (gating)" if gates else "latency FAIL (reported, not gating)"
    assert shown in gate.stdout and gate.stdout.startswith("FAIL" if gates else "PASS")
