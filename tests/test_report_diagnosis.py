"""A candidate's diagnosis (``regress diagnose``, diagnosis.json) in its report: the prompt table's
cause column, the "Why it drifted" card, summary.md's section, junit.xml's failure messages; and
the hint to run ``regress diagnose`` when a failed candidate has none. Synthetic runs, no engine.
"""

from __future__ import annotations

import html
import inspect
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterator

import pytest

from browser import Page
from report_fixtures import HOSTILE, Case, build_case, build_diagnosis
from regress.diagnosis.record import Diagnosis
from regress.report import JUNIT_FILE, SUMMARY_FILE, write_candidate_report
from regress.report.junit import junit_xml
from regress.report.render import render_candidate
from regress.report.summary import summary_markdown
from regress.storage import atomic_write_text

HINT = "run <code>regress diagnose candidate</code> to see why"


def write_report(case: Case, out: Path, diagnosis: Diagnosis | None) -> Path:
    """The candidate's report with ``diagnosis``, through write_candidate_report once it takes one;
    until then (regress/report/__init__.py passes it on) the same three files from their renderers."""
    if "diagnosis" in inspect.signature(write_candidate_report).parameters:
        return write_candidate_report(case.score, case.golden, case.run, case.prompt_set, out, diagnosis=diagnosis)
    page = write_candidate_report(case.score, case.golden, case.run, case.prompt_set, out)
    atomic_write_text(page, render_candidate(case.score, case.golden, case.run, case.prompt_set,
                                             index_link="../index.html", diagnosis=diagnosis))
    atomic_write_text(out / SUMMARY_FILE, summary_markdown(case.score, diagnosis=diagnosis))
    atomic_write_text(out / JUNIT_FILE, junit_xml(case.score, diagnosis=diagnosis))
    return page


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("diagnosis"), 40)


@pytest.fixture(scope="module")
def diagnosis(case: Case) -> Diagnosis:
    return build_diagnosis(case)


@pytest.fixture(scope="module")
def written(case: Case, diagnosis: Diagnosis) -> Path:
    out = case.root / "reports" / "diagnosed"
    write_report(case, out, diagnosis)
    return out


@pytest.fixture(scope="module")
def page(written: Path) -> str:
    return (written / "index.html").read_text(encoding="utf-8")


def _data(page: str) -> dict:
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S)
    assert block, "no data block"
    return json.loads(block.group(1))


def _card(page: str) -> str:
    found = re.search(r'<section class="card diagnosis" id="diagnosis">(.*?)</section>', page, flags=re.S)
    assert found, "no diagnosis card"
    return found.group(1)


# ------------------------------------------------------------------ page


def test_card_shows_causes_probes_differences_and_left_out(page: str, diagnosis: Diagnosis, case: Case) -> None:
    card = _card(page)
    text = html.unescape(re.sub(r"<[^>]+>", "", card))
    assert "Why it drifted" in text
    for cause, n in diagnosis.by_cause.items():
        assert re.search(rf'data-cause="{re.escape(cause)}"[^>]*>{re.escape(cause)}</button></th>\s*<td class="num">{n}<', card)
    assert "float32), the same KV-cache dtype" in text  # the field guide's mitigation of kernels and precision
    for probe in diagnosis.probes:
        assert probe.name in text and probe.changed in text
    assert "skipped: the engine does not support it" in text
    assert "30.2" in text and "12.5" in text  # seconds
    assert "env EVIL" in text and "bfloat16" in text
    assert f"{len(diagnosis.left_out)} drifted prompts not diagnosed" in text
    for pid in case.ids_of("input_drift"):
        assert f'data-id="{pid}"' in card
    assert HINT not in page
    # the card sits right after the verdict and the worst prompts
    assert page.index('class="card worst"') < page.index('id="diagnosis"') < page.index('id="prompts"')


def test_untrusted_diagnosis_text_is_escaped(page: str, case: Case, diagnosis: Diagnosis) -> None:
    card = _card(page)
    for hostile in (HOSTILE[1], HOSTILE[2]):  # a setting's value, a skipped reason
        assert hostile not in card or "<" not in hostile
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in card
    assert "<img" not in page
    assert len(re.findall(r"<script", page)) == 2  # the data block and the report's own script
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S).group(1)
    assert "<" not in block and ">" not in block  # the why "<script>...": \u003c in the JSON, text in the page
    data = _data(page)
    regression = diagnosis.prompts[0]
    entry = next(p for p in data["prompts"] if p["id"] == regression.prompt_id)
    assert entry["dx"]["y"] == HOSTILE[0] == regression.why
    assert entry["dx"]["c"] == ["kernels and precision"]
    assert entry["dx"]["mi"] == regression.mitigation
    assert entry["dx"]["o"] == [["rerun", False, 3], ["float32", True, None]]


def test_payload_marks_diagnosed_prompts_only(page: str, diagnosis: Diagnosis) -> None:
    data = _data(page)
    diagnosed = {p.prompt_id for p in diagnosis.prompts}
    assert {p["id"] for p in data["prompts"] if "dx" in p} == diagnosed
    assert data["diagnosis"]["causes"][0] in diagnosis.by_cause
    assert set(data["diagnosis"]["causes"]) == set(diagnosis.by_cause)
    drift = next(p for p in data["prompts"] if p.get("dx", {}).get("b"))
    assert drift["dx"]["c"] == ["scheduling and batching", "unexplained"] and drift["dx"]["e"] is False
    assert 'id="cause-filter"' in page


def test_no_diagnosis_no_card_and_a_hint_when_failed(case: Case, tmp_path: Path) -> None:
    page = write_report(case, tmp_path / "plain", None).read_text(encoding="utf-8")
    assert case.score.metrics.verdict == "fail"
    assert 'id="diagnosis"' not in page and 'id="cause-filter"' not in page
    assert HINT in page
    assert _data(page)["diagnosis"] is None
    assert all("dx" not in p for p in _data(page)["prompts"])
    passed = case.score.model_copy(update={"metrics": case.score.metrics.model_copy(update={"verdict": "pass"}),
                                           "verdict_reasons": []})
    passed_page = render_candidate(passed, case.golden, case.run, case.prompt_set)
    assert "diagnose-hint" not in passed_page.split("<body>", 1)[1].split("<script")[0]


def test_a_diagnosis_of_another_run_is_not_shown(case: Case, diagnosis: Diagnosis) -> None:
    stale = diagnosis.model_copy(update={"run_id": "an-earlier-run"})
    page = render_candidate(case.score, case.golden, case.run, case.prompt_set, diagnosis=stale)
    assert 'id="diagnosis"' not in page and HINT in page
    assert "Why it drifted" not in summary_markdown(case.score, diagnosis=stale)
    assert "why it drifted" not in junit_xml(case.score, diagnosis=stale)


def test_diagnosis_with_no_prompts_renders(case: Case, diagnosis: Diagnosis) -> None:
    empty = diagnosis.model_copy(update={"prompts": [], "by_cause": {}, "differences": [], "left_out": []})
    page = render_candidate(case.score, case.golden, case.run, case.prompt_set, diagnosis=empty)
    assert "No prompt was diagnosed." in _card(page)
    assert "No prompt was diagnosed." in summary_markdown(case.score, diagnosis=empty)


# ------------------------------------------------------------------ summary.md and junit.xml


def test_summary_has_a_why_section(written: Path, diagnosis: Diagnosis) -> None:
    summary = (written / SUMMARY_FILE).read_text(encoding="utf-8")
    assert "**Why it drifted**" in summary
    section = summary[summary.index("**Why it drifted**"):]
    assert "| cause | prompts | mitigation |" in section
    for cause, n in diagnosis.by_cause.items():
        assert re.search(rf"^\| {re.escape(cause)} \| {n} \| .+ \|$", section, flags=re.M), cause
    assert "float32\\), the same KV-cache dtype" in section  # escaped Markdown
    assert f"Not diagnosed ({len(diagnosis.left_out)})" in section
    assert "<img" not in section and "<script" not in section
    assert "regress diagnose candidate" not in summary  # no hint: there is a diagnosis


def test_summary_hint_without_diagnosis(case: Case) -> None:
    summary = summary_markdown(case.score, "reports/candidate/index.html")
    assert "Why it drifted" not in summary
    assert "Run `regress diagnose candidate` to see why." in summary
    assert summary.rstrip().endswith("`reports/candidate/index.html`")  # the link stays last


def test_junit_failures_carry_causes_and_why(written: Path, diagnosis: Diagnosis, case: Case) -> None:
    root = ET.fromstring((written / JUNIT_FILE).read_bytes())
    cases = {c.get("name"): c for c in root.iter("testcase")}
    by_id = {p.prompt_id: p for p in diagnosis.prompts}
    for pid in case.ids_of("regression"):
        failure = cases[pid].find("failure")
        assert failure is not None
        dx = by_id[pid]
        assert failure.get("message").endswith(f"; why it drifted: kernels and precision: {dx.why}")
        assert f"mitigation: {dx.mitigation}" in failure.text
    first = cases[diagnosis.prompts[0].prompt_id].find("failure").get("message")
    assert HOSTILE[0] in first  # as text: the XML parser gave it back, the file holds it escaped
    assert HOSTILE[0] not in (written / JUNIT_FILE).read_text(encoding="utf-8")
    drift = case.ids_of("drift")[0]
    assert "why it drifted: scheduling and batching, unexplained" in cases[drift].find("system-out").text
    plain = ET.fromstring(junit_xml(case.score).encode())
    assert all("why it drifted" not in (f.get("message") or "") for f in plain.iter("failure"))


# ------------------------------------------------------------------ in the browser


@pytest.fixture
def browser_page(browser: Any, written: Path) -> Iterator[Page]:
    p = Page(browser, (written / "index.html").as_uri())
    p.page.wait_for_selector("body[data-ready='1']")
    yield p
    p.close()


def test_cause_column_in_the_browser(browser_page: Page, case: Case, diagnosis: Diagnosis) -> None:
    page = browser_page
    pg = page.page
    pg.wait_for_timeout(100)
    assert page.errors == []
    assert [m for m in page.console if not m.startswith("log:")] == []  # CSP violations are console errors
    rows = page.rows()
    by_id = {p.prompt_id: p for p in diagnosis.prompts}
    shown = {r["prompt"]: r["why it drifted"] for r in rows}
    regression = diagnosis.prompts[0].prompt_id
    assert shown[regression] == "kernels and precision"
    assert all(shown[pid] == ", ".join(by_id[pid].causes) for pid in shown if pid in by_id)
    assert all(cause == "" for pid, cause in shown.items() if pid not in by_id)
    cell = pg.locator(f"#prompt-rows tr:has(td.id[title='{regression}']) td.dx")
    title = cell.get_attribute("title")
    assert HOSTILE[0] in title and "mitigation: " in title  # the tooltip: why and mitigation, as text

    # filter by cause, from the select and from the card
    pg.select_option("#cause-filter", "scheduling and batching")
    assert {r["prompt"] for r in page.rows()} == {p.prompt_id for p in diagnosis.prompts
                                                  if "scheduling and batching" in p.causes}
    pg.click("#reset")
    pg.click("#diagnosis .dx-cause[data-cause='kernels and precision']")
    assert {r["prompt"] for r in page.rows()} == set(case.ids_of("regression"))
    pg.click("#reset")
    # sortable: diagnosed prompts first, by cause
    pg.click("#prompt-head th[data-key='dx']")
    causes = [r["why it drifted"] for r in page.rows()]
    filled = [c for c in causes if c]
    assert filled == sorted(filled) and causes[:len(filled)] == filled and len(filled) == len(diagnosis.prompts)

    # the prompt's detail: why and mitigation as text, nothing run
    pg.click(f"#prompt-rows tr:has(td.id[title='{regression}'])")
    detail = pg.locator("#detail-body .dx-detail")
    detail.wait_for()
    text = detail.inner_text()
    assert HOSTILE[0] in text and "float32" in text and "shown by a probe" in text
    pg.wait_for_timeout(100)
    assert page.dialogs == [] and page.errors == []
    assert pg.locator("img").count() == 0
    assert pg.locator("script").count() == 2
    assert [m for m in page.console if not m.startswith("log:")] == []


def test_regress_report_re_renders_every_stored_result(tmp_path: Path) -> None:
    """`regress report` (the DVC report stage) from stored scores gives the same files as the
    scoring that wrote them with the diagnosis: the "Why it drifted" card and junit.xml's causes
    are kept, not dropped."""
    import shutil

    import yaml

    from conftest import run_cli
    from regress.diagnosis.record import DIAGNOSIS_FILE
    from regress.report import INDEX_FILE, METRICS_FILE

    case = build_case(tmp_path, 24, tokens=16, shard_size=8, semantic=False)
    diagnosis = build_diagnosis(case)
    expected = tmp_path / "expected"
    write_candidate_report(case.score, case.golden, case.run, case.prompt_set, expected, diagnosis=diagnosis)
    (tmp_path / "runs").mkdir()
    shutil.move(str(tmp_path / "run"), str(tmp_path / "runs" / "candidate"))
    scores = tmp_path / "scores" / "candidate"
    scores.mkdir(parents=True)
    for name in ("scores.json", "metrics.json"):
        shutil.move(str(tmp_path / "scores" / name), str(scores / name))
    atomic_write_text(scores / DIAGNOSIS_FILE, diagnosis.model_dump_json(indent=1))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "dataset": "prompts.jsonl", "baseline": {"package": "current", "model": "m"},
        "candidates": {"candidate": {"dtype": "float16"}}}, sort_keys=False), encoding="utf-8")

    result = run_cli("report", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "reports" / "candidate"
    for name in (JUNIT_FILE, SUMMARY_FILE, METRICS_FILE, INDEX_FILE):
        # The prompt set is named as params.yaml gives it (relative), the fixture's by its full path.
        want = (expected / name).read_text(encoding="utf-8").replace(f"{tmp_path}/prompts.jsonl", "prompts.jsonl")
        assert (out / name).read_text(encoding="utf-8") == want, name
    page, junit = (out / INDEX_FILE).read_text(encoding="utf-8"), (out / JUNIT_FILE).read_text(encoding="utf-8")
    assert "Why it drifted" in page and "why it drifted: kernels and precision" in junit
