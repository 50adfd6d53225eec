"""The project lock: one regress command at a time writes a project's runs, scores, reports, bisects.

Two commands on one project (two bisects of one range, two replays of one candidate, a check
while ``dvc repro`` scores) would write the same run directories, scores and state files at
once. Every command that writes them (``golden``, ``noise``, ``replay``, ``score``, ``check``,
``diagnose``, ``report``, ``bisect``) holds the project's lock file while it runs: an exclusive
``flock`` taken without waiting. The file lives in regress's home (``locks/<digest of the project's
path>.lock``), not in the project: a command refused for bad input writes nothing there, and no
project needs a line in its .gitignore. The second command exits 2 naming the first (its pid,
host, command line and start), read from the lock file, where the holder writes them once it
holds the lock.

``flock`` belongs to the open file: the kernel releases it when the holder's process ends, however
it ends (SIGKILL, a lost machine's NFS lease aside), so a dead holder never blocks anyone; the
holder's lines left in the file are only read while someone holds the lock. The descriptor is
close-on-exec: engines and pip do not inherit it. The Celery workers that run a command's shards
do not take the lock: they write into the run the command holding it has prepared.
Within one process the lock is re-entrant (a bisect's checks run inside its command).
"""

from __future__ import annotations

import errno
import hashlib
import fcntl
import os
import socket
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from pydantic import ValidationError

from regress.errors import ProjectLocked
from regress.home import regress_home
from regress.records.base import _Record

LOCK_DIR = "locks"
"""Under regress's home (:func:`regress.home.regress_home`)."""

LOCK_FORMAT = 1


class LockHolder(_Record):
    """Who holds a project's lock (written into the lock file by the holder)."""

    format_version: int = LOCK_FORMAT
    pid: int
    host: str
    command: str
    """The holder's command line (credentials redacted)."""
    started_at: datetime


_held: dict[Path, int] = {}
"""Lock files this process holds -> how many blocks hold them."""


def lock_path(root: Path, home: Path | None = None) -> Path:
    """The lock file of the project at ``root`` (named by a digest of its resolved path)."""
    digest = hashlib.sha256(str(root.resolve()).encode("utf-8")).hexdigest()[:32]
    return (home or regress_home()) / LOCK_DIR / f"{digest}.lock"


def _holder(fd: int) -> LockHolder | None:
    try:
        return LockHolder.model_validate_json(os.pread(fd, 1 << 16, 0))
    except (OSError, ValidationError, ValueError):
        return None  # the holder is between taking the lock and writing its name


@contextmanager
def project_lock(root: Path, command: str) -> Iterator[None]:
    """Hold ``root``'s project lock for the block, as ``command``; raises
    :class:`~regress.errors.ProjectLocked` (exit 2) naming the holder when another process has it."""
    root = root.resolve()
    path = lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = path
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = _holder(fd)
            who = (f"pid {holder.pid} on {holder.host}, `{holder.command}`, running since "
                   f"{holder.started_at.isoformat(timespec='seconds')}" if holder is not None
                   else "a process that has not written its name yet")
            raise ProjectLocked(
                f"{root}: another regress command is writing this project ({who}; it holds {path}). "
                "Run this one once it has finished (a holder that died releases the lock)") from None
        me = LockHolder(pid=os.getpid(), host=socket.gethostname(), command=command,
                        started_at=datetime.now(timezone.utc))
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.model_dump_json().encode() + b"\n", 0)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
            os.ftruncate(fd, 0)  # before the unlock: nobody reads a finished holder's name
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
