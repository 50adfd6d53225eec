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

from regress.envs import regress_home
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


def directory_sha256(directory: str | os.PathLike) -> str | None:
    """One hash over every file of a directory: relative names and contents, in sorted order.

    Hidden entries (``.cache``, ``.git``) are skipped. Returns None if the directory is missing.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    cache_file = _cache_path()
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        cache = {}
    changed = False
    total = hashlib.sha256()
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    for path in files:
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
        total.update(path.relative_to(root).as_posix().encode() + b"\0" + digest.encode() + b"\n")
    if changed:
        try:
            atomic_write_text(cache_file, json.dumps(cache))
        except OSError:
            pass  # a read-only cache only costs time
    return total.hexdigest()
