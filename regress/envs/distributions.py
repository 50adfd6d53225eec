"""The distributions an engine ran with (name -> version), for a run's manifest: validated, bounded.

A candidate environment's marker lists every distribution its interpreter sees (``distributions``,
recorded when it was built); for ``package: current`` the engine runs in regress's own
interpreter, whose distributions :mod:`importlib.metadata` lists. The marker sits in a shared
cache, so what is read from it is checked as any input: a mapping of at most
:data:`MAX_DISTRIBUTIONS` entries, names and versions strings of bounded length and plain
characters (they are printed by ``regress diff``), names in canonical form (PEP 503).

A listing is recorded only when it agrees with the versions the engine itself reported
(``EngineBackend.versions``): a marker read on this machine for a run whose engine ran on a
Celery worker elsewhere, or this process's packages for an engine that did not run in it, would
otherwise be recorded as the engine's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from packaging.utils import canonicalize_name

from regress.envs.spec import ENV_MARKER
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec

MAX_DISTRIBUTIONS = 5000
MAX_NAME = 200
MAX_VERSION = 100
MAX_MARKER_BYTES = 8 << 20
"""A vLLM environment's marker is about 5 kB; a bigger one is not one regress wrote."""

_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]*")


def valid_distributions(listing: Any) -> dict[str, str] | None:
    """``listing`` (name -> version) with canonical names, sorted; an entry whose name or version
    is not a plain string of bounded length is left out. None when ``listing`` is not a mapping or
    holds more than :data:`MAX_DISTRIBUTIONS` entries."""
    if not isinstance(listing, Mapping) or len(listing) > MAX_DISTRIBUTIONS:
        return None
    found: dict[str, str] = {}
    for name, version in listing.items():
        if (isinstance(name, str) and isinstance(version, str) and len(name) <= MAX_NAME
                and len(version) <= MAX_VERSION and _NAME.fullmatch(name) and _VERSION.fullmatch(version)):
            found[canonicalize_name(name)] = version
    return dict(sorted(found.items()))


def marker_distributions(environment: str | Path) -> dict[str, str] | None:
    """The distributions the marker of the environment at ``environment`` lists (validated);
    None when there is no readable marker or it lists none."""
    marker = Path(environment) / ENV_MARKER
    try:
        with open(marker, "rb") as fh:
            data = fh.read(MAX_MARKER_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_MARKER_BYTES:
        return None
    try:
        info = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    found = valid_distributions(info.get("distributions")) if isinstance(info, dict) else None
    return found or None


def current_distributions() -> dict[str, str] | None:
    """The distributions this interpreter sees (validated; the first of a name on ``sys.path``
    wins, as for imports)."""
    import importlib.metadata

    listing: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if isinstance(name, str) and name not in listing:  # a broken dist-info has no Name
            listing[name] = dist.version
        if len(listing) > MAX_DISTRIBUTIONS:
            return None
    return valid_distributions(listing) or None


def agrees(listing: Mapping[str, str], reported: Mapping[str, Any]) -> bool:
    """Whether ``listing`` holds the version of every distribution the engine reported (and none
    it reported missing); entries that are not distribution names (``python``) are not compared."""
    for name, version in reported.items():
        if name == "python" or not isinstance(name, str) or not _NAME.fullmatch(name):
            continue
        if listing.get(canonicalize_name(name)) != version:
            return False
    return True


def engine_distributions(candidate: CandidateSpec, environment: str | None,
                         reported: Mapping[str, Any]) -> dict[str, str] | None:
    """The distributions ``candidate``'s engine ran with: its environment's marker's listing
    (``environment``: the environment's directory), this process's for ``package: current``.
    None when not known: no listing, a served candidate's own server (``server.url``: it runs
    elsewhere), or a listing that disagrees with the versions the engine ``reported``."""
    if candidate.server is not None and candidate.server.url is not None:
        return None
    if environment is not None:
        listing = marker_distributions(environment)
    elif candidate.package == CURRENT_ENVIRONMENT:
        listing = current_distributions()
    else:
        listing = None
    if listing is None or not agrees(listing, reported):
        return None
    return listing
