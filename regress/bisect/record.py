"""The state of one bisect: ``bisect/<package>-<good>-<bad>.json`` under the project root.

Written atomically after every check, so an interrupted bisect (Ctrl-C, a dead machine, a CI job
that ran out of time) continues from its finished checks: a version with an outcome here is not
checked again, except one whose environment failed for a transient reason (``transient``: the
index down, the network, a full disk), which is tried again. The file is the bisect's record
too: every check with its verdict, report and flipped prompts, every failed install with its
kind and cause, and the answer once there is one.

Format 2 added the ``transient`` outcome and ``cause``. A format 1 file still loads: its
``skipped`` versions were recorded without telling the two kinds apart, so they become
``transient`` (tried once more on resume, and recorded for good if they fail for good).
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from regress.errors import StorageError
from regress.records import _Record
from regress.storage import atomic_write_text, read_record

BISECT_FORMAT = 2
"""Version of the bisect state file."""
READABLE_FORMATS = (1, 2)
"""Formats this regress loads (1 is upgraded as it is read)."""

Outcome = Literal["pass", "fail", "skipped", "transient"]
Status = Literal["running", "found", "no-regression"]


class BisectCheck(_Record):
    """One version checked against the golden."""

    version: str
    candidate: str
    """The candidate the version ran as (runs/<candidate>, scores/<candidate>, reports/<candidate>)."""
    outcome: Outcome
    """``pass`` or ``fail`` (the check's gating verdict); ``skipped``: the version cannot be
    installed (a permanent failure: no such release, it does not resolve, its build fails), and the
    search goes around it; ``transient``: its environment failed for a passing reason (the index
    unreachable, the network, a full disk, a time-out): not an outcome of the search, the
    version is tried again when the bisect resumes."""
    verdict: str | None = None
    run_id: str | None = None
    report: str | None = None
    """The check's report page, relative to the project root."""
    regressions: list[str] = Field(default_factory=list)
    """Prompts the check classed as regressions (flipped against the golden)."""
    identical: int | None = None
    prompts: int | None = None
    mean_teacher_forced_kl: float | None = None
    detail: str | None = None
    """Why it was skipped, or failed transiently: the error's first line."""
    cause: str | None = None
    """What kind of failure that was, in a few words (``disk full``, ``its requirements conflict``)."""
    seconds: float = 0.0
    finished_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


class BisectState(_Record):
    """Everything one bisect knows."""

    format_version: int = BISECT_FORMAT
    package: str
    """Normalized project name."""
    good: str
    bad: str
    template: str
    """The candidate each version is checked as (its other settings), by name."""
    template_sha256: str
    """Of the template candidate's stored form: another template is another bisect."""
    golden_run_id: str
    """The golden every check was scored against: another golden is another bisect."""
    index: str
    """The package index the versions came from (credentials redacted)."""
    versions: list[str]
    """The releases after ``good`` up to ``bad``, oldest first."""
    checks: list[BisectCheck] = Field(default_factory=list)
    """In the order they ran."""
    status: Status = "running"
    first_bad: str | None = None
    last_good: str | None = None
    """The newest version known good below ``first_bad`` (``good`` itself when no check passed)."""
    untested_before: list[str] = Field(default_factory=list)
    """Skipped versions between ``last_good`` and ``first_bad``: the first bad may be one of them."""
    started_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    updated_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("format_version") != 1:
            return data
        checks = [
            {**c, "outcome": "transient", "cause": "recorded by a regress that did not tell transient failures from "
                                                   "permanent ones (state format 1): tried again"}
            if isinstance(c, dict) and c.get("outcome") == "skipped" else c
            for c in data.get("checks") or []]
        return {**data, "format_version": BISECT_FORMAT, "checks": checks}

    def outcome(self, version: str) -> BisectCheck | None:
        """The check that decided ``version`` (else its latest transient failure, else None)."""
        mine = [c for c in self.checks if c.version == version]
        return next((c for c in reversed(mine) if c.outcome != "transient"), mine[-1] if mine else None)

    @property
    def outcomes(self) -> dict[str, str]:
        """Version -> pass, fail or skipped: what the search knows (transient failures are not known)."""
        return {c.version: c.outcome for c in self.checks if c.outcome != "transient"}

    @property
    def checked(self) -> int:
        """Versions with an outcome (passed, failed, or skipped: pip was asked and said never)."""
        return len(self.outcomes)

    @property
    def transient(self) -> list[BisectCheck]:
        """Transient failures of versions still without an outcome (tried again on resume)."""
        known = self.outcomes
        return [c for c in self.checks if c.outcome == "transient" and c.version not in known]


def state_path(root: Path, package: str, good: str, bad: str) -> Path:
    """``bisect/<package>-<good>-<bad>.json``: one file per question asked."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{package}-{good}-{bad}")[:150]
    return root / "bisect" / f"{safe}.json"


def load_state(path: Path) -> BisectState | None:
    """The state at ``path``; None when there is none. A file that is not a bisect state of this
    format is an error naming it (delete it, or run with --restart)."""
    if not path.is_file():
        return None

    def check(data: Any) -> None:
        if isinstance(data, dict) and data.get("format_version") not in READABLE_FORMATS:
            raise StorageError(f"{path}: bisect state format {data.get('format_version')!r}, this regress reads "
                               f"{' and '.join(map(str, READABLE_FORMATS))}; run with --restart")

    def invalid(exc: Any) -> str:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"field '{where}': {first['msg']}; delete it or run with --restart"

    return read_record(path, BisectState, what="a bisect state", missing=None, check=check, invalid=invalid,
                       unreadable=lambda exc: f"not a bisect state ({exc}); delete it or run with --restart")


def save_state(path: Path, state: BisectState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, state.model_dump_json(indent=2) + "\n")
