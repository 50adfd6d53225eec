"""Lock files: an environment's resolved package set, recorded when it is built, pinned when rebuilt.

A candidate environment resolves its dependencies when pip builds it: the same spec built a month
later may carry another transformers, which would then show as drift blamed on the engine. So
every build records what it resolved, ``name==version`` per line (pip itself left out), in
``$REGRESS_HOME/env-locks/<environment directory name>.txt``: outside the environment, so that
removing the environment keeps it. A layer's lock holds what the layer itself installed; its
base has a lock of its own. A later build of the same spec passes the lock to pip as a
constraints file (``pip install -c``), so the same versions come back.

The lock lives in a shared cache, so it is untrusted input: only ``name==version`` lines (a
valid name and a valid PEP 440 version, per ``packaging``), blank lines and whole-line ``#``
comments are accepted. Anything else (``--index-url``, ``-e``, a URL, a path, a ``@`` direct
reference, an extra, a marker, a wildcard) refuses the whole lock, naming the file and line.
pip never reads the file itself: it reads a copy written from the parsed pins, so no line of the
cache reaches pip, and the lock can never choose an index, a URL or a path.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from regress.envs.spec import EnvSpec
from regress.errors import CandidateEnvError
from regress.home import regress_home
from regress.storage import atomic_write_text
from regress.untrusted import printable

LOCKS_DIR = "env-locks"
MAX_LOCK_BYTES = 1 << 20
"""A vLLM environment's lock is about 3 kB (148 pins); a bigger file is not one regress wrote."""
MAX_PINS = 5000
UNLOCKED = frozenset({"pip"})
"""Distributions never pinned: the venv brings its own pip, and pinning it would fight that."""

# PEP 508's name, and the version as written between "==" and the end of the line.
_PIN = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==(?P<version>[A-Za-z0-9][A-Za-z0-9.+!_-]*)")
# How pip names a constraint that took part in a conflict it could not resolve.
_CONSTRAINT_CONFLICT = re.compile(r"The user requested \(constraint\) (?P<pin>\S+)")


def locks_root() -> Path:
    """Where lock files live (next to ``envs/``, not inside it)."""
    return regress_home() / LOCKS_DIR


def lock_path(spec: EnvSpec) -> Path:
    """The lock file of the environment for ``spec`` (whether or not it exists)."""
    return locks_root() / f"{spec.dirname()}.txt"


@dataclass(frozen=True)
class EnvLock:
    """A lock file, read and accepted."""

    path: Path
    sha256: str
    """Of the file's bytes as read."""
    pins: dict[str, str]
    """Canonical distribution name -> version (normalised, PEP 440)."""

    def constraints(self) -> str:
        """What pip reads: one ``name==version`` line per pin, written from the parsed values."""
        return "".join(f"{name}=={version}\n" for name, version in sorted(self.pins.items()))

    def record(self) -> dict[str, Any]:
        """How the environment's marker names it."""
        return {"path": str(self.path), "sha256": self.sha256, "pins": len(self.pins)}


def _refused(path: Path, line: int | None, why: str) -> CandidateEnvError:
    where = f"{path}:{line}" if line is not None else str(path)
    return CandidateEnvError(
        f"the lock file {where} is refused: {why}. A lock holds only 'name==version' lines (regress writes it "
        f"when it builds an environment); delete it, or rebuild with `regress env create --relock NAME`, "
        "to resolve the environment afresh")


def parse_lock(text: str, path: Path) -> dict[str, str]:
    """The pins of a lock file's ``text`` (canonical name -> normalised version); raises
    :class:`CandidateEnvError` naming ``path`` and the line of the first line that is not
    ``name==version``, a blank line or a whole-line comment."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        shown = printable(line[:120]) + ("…" if len(line) > 120 else "")
        found = _PIN.fullmatch(line)
        if found is None:
            raise _refused(path, number, f"{shown!r} is not 'name==version' (no options, URLs, paths, "
                                         "direct references, extras or markers)")
        try:
            version = str(Version(found["version"]))
        except InvalidVersion:
            raise _refused(path, number, f"{shown!r}: {found['version']!r} is not a valid version") from None
        name = canonicalize_name(found["name"])
        if pins.get(name, version) != version:
            raise _refused(path, number, f"{name} is pinned twice, to {pins[name]} and {version}")
        pins[name] = version
        if len(pins) > MAX_PINS:
            raise _refused(path, number, f"more than {MAX_PINS} pins")
    return pins


def read_lock(spec: EnvSpec) -> EnvLock | None:
    """The accepted lock of the environment for ``spec``; None when there is none. Raises
    :class:`CandidateEnvError` when it is refused (not a regular file, too big, not UTF-8, a line
    that is not ``name==version``), OSError when it cannot be read."""
    path = lock_path(spec)
    try:
        # O_NOFOLLOW: a link in the shared cache must not make regress read (and quote) another
        # file; O_NONBLOCK: a FIFO put there must not hang the build (it is refused below).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise _refused(path, None, "it is a symbolic link") from exc
        raise
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise _refused(path, None, "it is not a regular file")
        data = fh.read(MAX_LOCK_BYTES + 1)
    if len(data) > MAX_LOCK_BYTES:
        raise _refused(path, None, f"it is over {MAX_LOCK_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refused(path, None, f"it is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return EnvLock(path, hashlib.sha256(data).hexdigest(), parse_lock(text, path))


@contextmanager
def constraint_args(lock: EnvLock | None) -> Iterator[list[str]]:
    """pip's arguments that pin ``lock`` (``-c`` and a private copy of its pins, deleted after);
    none without a lock. The copy, not the cached file: pip reads exactly what was accepted,
    even if the cache changes meanwhile."""
    if lock is None:
        yield []
        return
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", prefix="regress-lock-", suffix=".txt") as fh:
        fh.write(lock.constraints())
        fh.flush()
        yield ["-c", fh.name]


def lockable(distributions: Mapping[str, Any]) -> dict[str, str]:
    """The pins a lock records of ``distributions`` (name -> version, as a marker lists them):
    canonical names, pip left out, and any entry that would not read back as ``name==version``
    (a broken distribution's metadata) left out rather than making the lock unreadable."""
    pins: dict[str, str] = {}
    for name, version in distributions.items():
        if not isinstance(name, str) or not isinstance(version, str) or _PIN.fullmatch(f"{name}=={version}") is None:
            continue
        try:
            normalised = str(Version(version))
        except InvalidVersion:
            continue
        canonical = canonicalize_name(name)
        if canonical not in UNLOCKED:
            pins[canonical] = normalised
    return pins


def write_lock(spec: EnvSpec, distributions: Mapping[str, Any], *, source: str) -> EnvLock:
    """Record ``distributions`` (filtered by :func:`lockable`) as the lock of ``spec``'s
    environment, atomically; ``source`` says in its header where the set came from."""
    pins = lockable(distributions)
    header = (f"# regress lock of {' '.join(spec.describe().split())[:200]} ({spec.dirname()})\n"
              f"# {source}, {datetime.now(timezone.utc).isoformat(timespec='seconds')}. `regress env create --relock` "
              "resolves afresh.\n")
    text = header + EnvLock(Path(), "", pins).constraints()
    path = lock_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return EnvLock(path, hashlib.sha256(text.encode("utf-8")).hexdigest(), pins)


def drop_lock(spec: EnvSpec) -> bool:
    """Delete the lock of ``spec``'s environment (``--relock``); returns whether there was one."""
    path = lock_path(spec)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def has_lock(spec: EnvSpec) -> bool:
    """Whether a lock file (or anything at its path) exists for ``spec``'s environment."""
    return os.path.lexists(lock_path(spec))


def locked_distributions(info: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """What an environment's lock holds, from its marker ``info``: a layer's own distributions
    (its base has its own lock), every distribution of a full environment, but those installed
    from a path or URL (``direct_distributions``); None when the marker lists none (made before
    it did, or its listing failed: a full environment lists pip at least; a layer may hold
    nothing of its own)."""
    if info.get("layered") is True:
        found = info.get("layer_distributions")
        if not isinstance(found, dict):
            return None
    else:
        found = info.get("distributions")
        if not isinstance(found, dict) or not found:
            return None
    direct = info.get("direct_distributions")
    skipped = {canonicalize_name(n) for n in direct if isinstance(n, str)} if isinstance(direct, list) else set()
    return {name: version for name, version in found.items()
            if not isinstance(name, str) or canonicalize_name(name) not in skipped}


def pins_in_conflict(pip_output: str, lock: EnvLock) -> list[str]:
    """The lock's pins that pip named as constraints of a conflict it could not resolve
    (``The user requested (constraint) name==version``), as ``name==version``."""
    named = []
    for found in _CONSTRAINT_CONFLICT.finditer(pip_output):
        pin = _PIN.fullmatch(found["pin"])
        if pin is None:
            continue
        name = canonicalize_name(pin["name"])
        if name in lock.pins:
            named.append(f"{name}=={lock.pins[name]}")
    return list(dict.fromkeys(named))


def relock_hint(spec: EnvSpec, candidate: str | None, lock: EnvLock) -> str:
    """How to resolve ``spec``'s environment afresh: the command, and the file to delete."""
    # A package alone names its environment exactly; with requirements only the candidate does.
    target = spec.package if not spec.requirements else candidate
    command = f"`regress env create --relock {shlex.quote(target)}` or " if target else ""
    return f"to resolve afresh: {command}delete {lock.path}"
