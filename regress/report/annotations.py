"""junit.xml's failures as GitHub Actions annotations, a few per candidate.

Published by the workflow itself (``regress gate --annotate``), so no third-party action and no
``checks: write`` permission are needed. GitHub shows about ten annotations per step, so each
candidate gets at most :data:`ANNOTATIONS_PER_CANDIDATE`: its failed run-level verdicts first, then
its gating prompts, each titled with what it is (``regression``, ``input drift``, ``fidelity FAIL``)
and pointing at the prompt's file and line; one more line says how many were left out (they are
all in the job summary, which the workflow fills from summary.md). Prompt ids and reasons are data:
every value is escaped the way workflow commands require, so a newline in them cannot start a
command of its own.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from regress.untrusted import without_controls

ANNOTATIONS_PER_CANDIDATE = 5
"""Failures annotated per candidate; the rest are counted in one more line."""

_TITLES = {"fidelity": "fidelity FAIL", "quality": "quality FAIL", "latency": "latency FAIL",
           "regression": "regression", "input_drift": "input drift"}


def _escape_data(value: str) -> str:
    # ESC and the other control characters are shown, not sent: a log viewer would run them.
    value = without_controls(value, keep="\t\n\r")
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(value: str) -> str:
    return _escape_data(value).replace(":", "%3A").replace(",", "%2C")


def _file_for_github(file: str, project: Path | None) -> str:
    """The prompt set's path as GitHub wants it: relative to the checkout ($GITHUB_WORKSPACE)
    when the project lies inside it, else as junit.xml has it (relative to the project)."""
    path = Path(file)
    if project is None:
        return file
    absolute = path if path.is_absolute() else (project / path)
    workspace = os.environ.get("GITHUB_WORKSPACE")
    for base in ([Path(workspace)] if workspace else []) + [Path.cwd()]:
        try:
            return absolute.resolve().relative_to(base.resolve()).as_posix()
        except (ValueError, OSError):
            continue
    return file


def junit_annotations(junit_file: str | Path, *, limit: int = ANNOTATIONS_PER_CANDIDATE,
                      project: Path | None = None) -> list[str]:
    """``::error`` lines for the failures of one JUnit file: at most ``limit`` of them, then one
    line counting the rest. ``project``: the directory paths in the file are relative to."""
    root = ET.parse(junit_file).getroot()
    failed = [(case, case.find("failure")) for case in root.iter("testcase") if case.find("failure") is not None]
    lines = []
    for case, failure in failed[:limit]:
        kind = failure.get("type") or "regression"
        suite = case.get("classname", "")
        name = case.get("name", "")
        title = f"{_TITLES.get(kind, kind)}: {suite}" + ("" if name in _TITLES else f" / {name}")
        message = failure.get("message") or (failure.text or "").strip() or kind
        where = ""
        if case.get("file") and (case.get("line") or "").isdigit():
            where = f"file={_escape_property(_file_for_github(case.get('file'), project))},line={case.get('line')},"
        lines.append(f"::error {where}title={_escape_property(title)}::{_escape_data(message)}")
    if len(failed) > limit:
        suite = failed[0][0].get("classname", "")
        lines.append(f"::error title={_escape_property(f'{suite}: {len(failed) - limit} more')}::"
                     + _escape_data(f"{len(failed) - limit} more failure(s) not annotated: every one is in the job "
                                    "summary and in the candidate's junit.xml"))
    return lines
