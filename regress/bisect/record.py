"""The state of one bisect: ``bisect/<package>-<good>-<bad>.json`` under the project root.

Written atomically after every check, so an interrupted bisect (Ctrl-C, a dead machine, a CI job
that ran out of time) continues from its finished checks: a version with an outcome here is not
checked again. The file is the bisect's record too: every check with its verdict, report and
flipped prompts, and the answer once there is one.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from regress.errors import StorageError
from regress.records import _Record
from regress.storage import atomic_write_text, read_record

BISECT_FORMAT = 1
"""Version of the bisect state file."""

Outcome = Literal["pass", "fail", "skipped"]
Status = Literal["running", "found", "no-regression"]


class BisectCheck(_Record):
    """One version checked against the golden."""

    version: str
    candidate: str
    """The candidate the version ran as (runs/<candidate>, scores/<candidate>, reports/<candidate>)."""
    outcome: Outcome
    """``pass`` or ``fail`` (the check's gating verdict), or ``skipped``: the version could not be
    installed (its environment failed to build); the search goes around it."""
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
    """Why it was skipped."""
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

    def outcome(self, version: str) -> BisectCheck | None:
        return next((c for c in self.checks if c.version == version), None)

    @property
    def checked(self) -> int:
        """Checks that ran (passed or failed; skipped versions count too: pip was asked)."""
        return len(self.checks)


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
        if isinstance(data, dict) and data.get("format_version") != BISECT_FORMAT:
            raise StorageError(f"{path}: bisect state format {data.get('format_version')!r}, this regress reads "
                               f"{BISECT_FORMAT}; run with --restart")

    def invalid(exc: Any) -> str:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"field '{where}': {first['msg']}; delete it or run with --restart"

    return read_record(path, BisectState, what="a bisect state", missing=None, check=check, invalid=invalid,
                       unreadable=lambda exc: f"not a bisect state ({exc}); delete it or run with --restart")


def save_state(path: Path, state: BisectState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, state.model_dump_json(indent=2) + "\n")
