"""The report's Answers section in headless Chromium: links open the prompt's details, nothing
injected runs; at 900 and 1600 px the answer tables, and the index with its answers columns,
stay inside their cards.

The browser is the session fixture of conftest.py (tests/browser.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture fails with the reason
    expect = None

from browser import VIEWPORT, WIDTHS, Page
from report_fixtures import HOSTILE, Case, build_case
from regress.records import AnswerCheck
from regress.report import write_candidate_report, write_index
from test_answers import _score, answer_plan


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("answers-browser"), 40)


@pytest.fixture(scope="module")
def report(case: Case) -> tuple[Path, Any]:
    score = _score(case, answer_plan(case))
    first = score.scores[0]  # a hostile expected answer on an identical prompt: shown as text only
    hostile = first.model_copy(update={"answer": AnswerCheck(expected=[HOSTILE[0], HOSTILE[1]], golden_correct=True,
                                                             candidate_correct=True, golden_match=HOSTILE[0],
                                                             candidate_match=HOSTILE[0])})
    score = score.model_copy(update={"scores": [hostile, *score.scores[1:]]})
    return write_candidate_report(score, case.golden, case.run, case.prompt_set, case.root / "reports" / "c"), score


@pytest.fixture(scope="module")
def index(case: Case, report: tuple[Path, Any]) -> Path:
    """The index listing the candidate with answers and the same candidate without: both answers columns."""
    return write_index([(report[1], "c/index.html"), (case.score, "plain/index.html")], case.root / "reports")


@pytest.fixture
def page(browser: Any, report: tuple[Path, Any]) -> Iterator[Page]:
    p = Page(browser, report[0].as_uri())
    p.page.wait_for_selector("body[data-ready='1']")
    assert p.page.viewport_size == VIEWPORT
    yield p
    p.close()


def test_answer_links_open_the_prompt(page: Page, report: tuple[Path, Any]) -> None:
    pg = page.page
    score = report[1]
    lost = score.metrics.answer_flips_lost_ids
    links = pg.locator("#answers a.open-prompt")
    assert links.count() == len(lost) + len(score.metrics.answer_flips_gained_ids)
    links.first.click()
    assert not pg.locator("#detail").is_hidden()
    assert lost[0] in pg.locator("#detail-title").inner_text()
    block = pg.locator("#detail-body .answer")
    assert "answer lost" in block.inner_text()
    assert pg.locator("#detail-body .answer-side.ok").inner_text().startswith("golden")
    assert pg.locator("#detail-body .answer-side.no").inner_text().startswith("candidate")
    assert pg.url.endswith(f"#prompt={lost[0]}")
    pg.wait_for_timeout(100)
    assert page.errors == [] and [m for m in page.console if not m.startswith("log:")] == []


def test_hostile_expected_answers_show_as_text(page: Page, report: tuple[Path, Any]) -> None:
    pg = page.page
    first = report[1].scores[0].prompt_id
    pg.fill("#search", first)
    expect(pg.locator("#prompt-rows tr")).to_have_count(1)  # the search waits 120 ms for more typing
    pg.locator("#prompt-rows tr").click()
    text = pg.locator("#detail-body .answer").inner_text()
    assert HOSTILE[0] in text and HOSTILE[1] in text
    pg.wait_for_timeout(200)
    assert page.dialogs == [] and page.errors == []
    assert pg.locator("img").count() == 0 and pg.locator("script").count() == 2


@pytest.mark.parametrize("width", WIDTHS)
def test_answer_tables_and_the_index_fit_at_both_widths(browser: Any, report: tuple[Path, Any], index: Path,
                                                         width: int) -> None:
    p = Page(browser, report[0].as_uri(), width=width)
    try:
        p.page.wait_for_selector("body[data-ready='1']")
        assert p.page.locator("#answers table.answer-table").count() == 2
        assert p.tables_off_their_cards() == []
        assert p.page_scrolls_sideways() == 0
    finally:
        p.close()
    p = Page(browser, index.as_uri(), width=width)
    try:
        pg = p.page
        assert p.tables_off_their_cards() == [] and p.page_scrolls_sideways() == 0
        assert p.hidden_by_scrolling("table.index") == 0
        assert pg.locator("table.index thead th").count() == 12  # with answers and lost / gained
        m = report[1].metrics
        row = pg.locator("table.index tbody tr").first
        answers = row.locator("td.answers")
        assert answers.inner_text().split() == [str(m.golden_answers_correct), "→", str(m.answers_correct), "/",
                                                str(m.answer_prompts)]
        lost = row.locator("td.lost")
        assert lost.inner_text() == f"{m.answer_flips_lost} / {m.answer_flips_gained}"
        card = pg.locator("table.index").evaluate(  # the right edge of the card's content box
            "t => { const c = t.closest('.card'), cs = getComputedStyle(c); "
            "return c.getBoundingClientRect().right - parseFloat(cs.paddingRight) - parseFloat(cs.borderRightWidth); }")
        for cell in (answers, lost, row.locator("td.when")):  # the last columns, in sight
            box = cell.bounding_box()
            assert box["x"] + box["width"] <= card + 0.5
        p.screenshot(f"index-answers-{width}")
    finally:
        p.close()

