"""The report page in headless Chromium: loads clean, filters and sorts, runs no injected code.

One browser for the whole session (the ``browser`` fixture of conftest.py, from tests/browser.py:
Debian's ``chromium`` through ``playwright``; without them the tests fail rather than skip).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture fails with the reason
    expect = None

from browser import VIEWPORT, Page
from report_fixtures import HOSTILE, Case, build_case
from regress.report import write_candidate_report, write_index

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
