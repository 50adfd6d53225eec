"""Headless Chromium for the report tests: one browser per test session, and a page that records
everything it said (console messages, uncaught errors, dialogs).

Needs the Python package ``playwright`` and Debian's ``chromium`` (scripts/test installs both);
without them the tests fail rather than skip, so a machine without a browser cannot pass them
silently. conftest.py exposes :func:`launch_browser` as the session fixture ``browser``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

VIEWPORT = {"width": 1366, "height": 768}
WIDTHS = (900, 1600)
"""Window widths the layout tests check: a narrow laptop window and a wide screen."""
SHOTS_ENV = "REGRESS_SCREENSHOTS"
"""A directory in this variable: layout tests save full-page screenshots there, for a person to look at."""
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def _missing(reason: str) -> None:
    pytest.fail(f"{reason}: run the suite with scripts/test, which installs what it needs")


def launch_browser() -> Iterator[Any]:
    """Start Debian's chromium through playwright; yields the browser, closes it after."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        _missing("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


# For every table in a .card: the box it must stay inside is its card's content box; a table in a
# scroll box (overflow-x auto or scroll) between it and the card may be wider, as long as the scroll
# box stays inside. Tables with no layout (in a closed <details>, a hidden drawer) are left out.
_OFF_CARD_JS = """() => {
    const out = [];
    const edge = (el) => { const r = el.getBoundingClientRect(), cs = getComputedStyle(el);
        return { left: r.left + parseFloat(cs.borderLeftWidth) + parseFloat(cs.paddingLeft),
                 right: r.right - parseFloat(cs.borderRightWidth) - parseFloat(cs.paddingRight) }; };
    const name = (t) => (t.id ? '#' + t.id : 'table.' + (t.className || '?').split(' ').join('.'));
    for (const t of document.querySelectorAll('main table')) {
        if (!t.getClientRects().length) continue;
        const card = t.closest('.card');
        if (!card) { out.push(name(t) + ': in no card'); continue; }
        let box = t, scroller = null;
        for (let e = t.parentElement; e && e !== card; e = e.parentElement) {
            if (['auto', 'scroll'].includes(getComputedStyle(e).overflowX)) { scroller = e; break; }
        }
        if (scroller) box = scroller;
        const r = box.getBoundingClientRect(), c = edge(card);
        if (r.right > c.right + 0.5 || r.left < c.left - 0.5)
            out.push(`${name(t)}${scroller ? ' (its scroll box)' : ''}: ${Math.round(r.left)}..${Math.round(r.right)} ` +
                     `outside its card's ${Math.round(c.left)}..${Math.round(c.right)}`);
    }
    return out;
}"""

_SCROLL_JS = """(sel) => { const t = document.querySelector(sel);
    let e = t.parentElement;
    while (e && !['auto', 'scroll'].includes(getComputedStyle(e).overflowX)) e = e.parentElement;
    return e ? e.scrollWidth - e.clientWidth : 0; }"""

# Every <text> of every SVG matched, whose box is not inside its SVG's box: "label: why".
_SVG_TEXT_OUTSIDE_JS = """(sel) => {
    const out = [];
    for (const svg of document.querySelectorAll(sel)) {
        const s = svg.getBoundingClientRect();
        for (const t of svg.querySelectorAll('text')) {
            const r = t.getBoundingClientRect();
            if (r.left < s.left - 0.5 || r.right > s.right + 0.5 || r.top < s.top - 0.5 || r.bottom > s.bottom + 0.5)
                out.push(`${t.textContent}: ${Math.round(r.left - s.left)}..${Math.round(r.right - s.left)} x ` +
                         `${Math.round(r.top - s.top)}..${Math.round(r.bottom - s.top)} in ${Math.round(s.width)} x ${Math.round(s.height)}`);
        }
    }
    return out;
}"""


class Page:
    """A page plus everything it said: console messages, uncaught errors, dialogs. ``width``: the
    window's width (VIEWPORT's height), VIEWPORT without."""

    def __init__(self, browser: Any, url: str, width: int | None = None):
        viewport = VIEWPORT if width is None else {"width": width, "height": VIEWPORT["height"]}
        self.context = browser.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.console: list[str] = []
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.goto(url)

    def close(self) -> None:
        self.context.close()

    def rows(self) -> list[dict[str, str]]:
        """The visible table rows as {column label: cell text}."""
        return self.page.evaluate("""() => {
            const heads = [...document.querySelectorAll('#prompt-head th')].map(th => th.textContent.replace(/ [▲▼]$/, ''));
            return [...document.querySelectorAll('#prompt-rows tr')].filter(tr => tr.dataset.idx).map(tr =>
                Object.fromEntries([...tr.children].map((td, i) => [heads[i], td.textContent])));
        }""")

    def tables_off_their_cards(self) -> list[str]:
        """The tables that run past their card's content box (or whose scroll box does), and tables
        outside any card: one line each, empty when every table fits."""
        return self.page.evaluate(_OFF_CARD_JS)

    def hidden_by_scrolling(self, table: str) -> float:
        """Pixels of the table ``table`` (a selector) that its scroll box hides (0: all of it shows)."""
        return self.page.evaluate(_SCROLL_JS, table)

    def page_scrolls_sideways(self) -> float:
        """Pixels the whole page is wider than the window."""
        return self.page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")

    def svg_text_outside(self, svgs: str) -> list[str]:
        """The <text> elements of the SVGs ``svgs`` (a selector) not wholly inside their SVG's box."""
        return self.page.evaluate(_SVG_TEXT_OUTSIDE_JS, svgs)

    def screenshot(self, name: str) -> Path | None:
        """A full-page screenshot ``<name>.png`` into $REGRESS_SCREENSHOTS, when it names a directory."""
        where = os.environ.get(SHOTS_ENV)
        if not where:
            return None
        path = Path(where) / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=True)
        return path
