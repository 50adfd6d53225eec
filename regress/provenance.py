"""How a run was produced: regress's own commit, and a fingerprint of the model files.

Model directories can be large, so their hash is cached by (path, size, mtime) in
``$REGRESS_HOME/file-hashes.json``; an unchanged model is hashed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

from regress.home import regress_home
from regress.storage import atomic_write_text

_CHUNK = 1 << 20


@lru_cache(maxsize=1)
def regress_git_commit() -> str | None:
    """Commit of the regress checkout, when regress runs from one (else None)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    commit = out.stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10)
    return commit + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cache_path() -> Path:
    return regress_home() / "file-hashes.json"


def _files(root: Path, skip_hidden: bool) -> list[Path]:
    """Every file under root, in path order (by components, as the hashes below need)."""
    return sorted(
        p for p in root.rglob("*")
        if p.is_file() and not (skip_hidden and any(part.startswith(".") for part in p.relative_to(root).parts))
    )


def file_hashes(directory: str | os.PathLike, *, skip_hidden: bool = False) -> dict[str, str]:
    """``{relative posix path: sha256 hex}`` of every file under a directory, hashed now.

    This is what provenance records list, and what tests compare builds with.
    """
    root = Path(directory)
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in _files(root, skip_hidden)}


def tree_digest(hashes: dict[str, str]) -> str:
    """One hash over a ``{relative path: sha256}`` listing: names and contents, in path order."""
    total = hashlib.sha256()
    for name in sorted(hashes, key=lambda n: n.split("/")):
        total.update(name.encode() + b"\0" + hashes[name].encode() + b"\n")
    return total.hexdigest()


def directory_sha256(directory: str | os.PathLike, *, trust_cache: bool = True) -> str | None:
    """One hash over every file of a directory (:func:`tree_digest`), hidden entries (``.cache``,
    ``.git``) skipped. Returns None if the directory is missing.

    With ``trust_cache`` a file whose (path, size, mtime) is in ``$REGRESS_HOME/file-hashes.json``
    is not read again (a model is hashed once per change). Pass ``trust_cache=False`` where the
    hash guards what gets loaded: a shared cache file could lie.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    if not trust_cache:
        return tree_digest(file_hashes(root, skip_hidden=True))
    cache_file = _cache_path()
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        cache = {}
    changed = False
    hashes: dict[str, str] = {}
    for path in _files(root, skip_hidden=True):
        real = path.resolve()
        stat = real.stat()
        key = str(real)
        entry = cache.get(key)
        if entry and entry["size"] == stat.st_size and entry["mtime_ns"] == stat.st_mtime_ns:
            digest = entry["sha256"]
        else:
            digest = file_sha256(real)
            cache[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
            changed = True
        hashes[path.relative_to(root).as_posix()] = digest
    if changed:
        try:
            atomic_write_text(cache_file, json.dumps(cache))
        except OSError:
            pass  # a read-only cache only costs time
    return tree_digest(hashes)
