"""JUnit results as GitHub Actions annotations: one ``::error`` per failed test case.

Published by the workflow itself (``regress gate --annotate``), so no third-party action and no
``checks: write`` permission are needed. Prompt ids and reasons are data: every value is escaped
the way workflow commands require, so a newline in them cannot start a command of its own.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from regress.untrusted import without_controls


def _escape_data(value: str) -> str:
    # ESC and the other control characters are shown, not sent: a log viewer would run them.
    value = without_controls(value, keep="\t\n\r")
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(value: str) -> str:
    return _escape_data(value).replace(":", "%3A").replace(",", "%2C")


def junit_annotations(junit_file: str | Path) -> list[str]:
    """``::error title=...::message`` lines for the failures of one JUnit file."""
    root = ET.parse(junit_file).getroot()
    lines = []
    for case in root.iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            continue
        title = f"regression: {case.get('classname', '')} / {case.get('name', '')}"
        message = failure.get("message") or (failure.text or "").strip() or "regression"
        lines.append(f"::error title={_escape_property(title)}::{_escape_data(message)}")
    return lines
