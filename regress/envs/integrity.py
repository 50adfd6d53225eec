"""Environment content records: hashing every file, and checking an environment against its record.

The quick check on every use, the full verification (``regress env verify``), the adoption of
environments made before digests were recorded, and the refusals naming the first difference
(see :mod:`regress.envs`, "Integrity").
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from regress.envs.lock import _lock
from regress.envs.spec import ENV_MANIFEST, ENV_MARKER, CandidateEnv, EnvCheck, EnvSpec, _read_marker, cached_env, env_path
from regress.errors import CandidateEnvError
from regress.storage import atomic_write_text

INTEGRITY_VERSION = 1


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
    """The quick check every use runs (see :mod:`regress.envs`, "Integrity"); raises
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
