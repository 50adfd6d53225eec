"""Headless Chromium for the report tests: one browser per test session, and a page that records
everything it said (console messages, uncaught errors, dialogs).

Needs the Python package ``playwright`` and Debian's ``chromium`` (scripts/test installs both);
without them the tests fail rather than skip, so a machine without a browser cannot pass them
silently. conftest.py exposes :func:`launch_browser` as the session fixture ``browser``.
"""

from __future__ import annotations

import shutil
from typing import Any, Iterator

import pytest

VIEWPORT = {"width": 1366, "height": 768}
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


class Page:
    """A page plus everything it said: console messages, uncaught errors, dialogs."""

    def __init__(self, browser: Any, url: str):
        self.context = browser.new_context(viewport=VIEWPORT)
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
