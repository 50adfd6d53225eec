"""Phase deadlines: a phase that runs past its limit stops the command with exit 3 naming it.

A command arms a :class:`Watchdog` (:func:`armed`) with a limit per phase; the code of each phase
says where it starts and ends (:func:`phase`); child processes that must not outlive the
command register themselves (:func:`child_process`). Without an armed watchdog (a Celery
worker, a library caller) :func:`phase` and :func:`child_process` do nothing.

When a phase runs past its limit, the watchdog's thread

1. records a :class:`~regress.errors.PhaseDeadlineExceeded` naming the phase and the limit;
2. sends the main thread a signal (:data:`SIGNAL`) whose handler raises that error where the
   main thread is: a wait on the engine's pipe, a sleep, a read of pip's output. The command
   unwinds as from any other error: engines closed, a run left as its resumable ``.partial``,
   files written only whole (atomically), the error printed, exit 3;
3. kills the registered child processes (an engine's whole process group, pip), so that a wait
   on them ends and nothing keeps running after the command;
4. waits ``grace_s`` for the command to end. A main thread stuck inside C code (a native
   deadlock: two OpenVINO infer requests meeting a new shape, a mutex) never runs the signal's
   Python handler; then the watchdog writes the error to stderr, every thread's stack to
   ``<log_dir>/hang-<time>-<pid>.log`` (:mod:`faulthandler`), and ends the process with
   ``os._exit(3)``: no clean-up runs, but runs, scores and reports are only ever renamed into
   place whole, so none is half-written.

A hang that holds the GIL (none of the known ones does) stops the watchdog's thread too; only a
supervisor outside the process (CI's own time-out) ends that.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from regress.errors import EXIT_RUN_FAILED, PhaseDeadlineExceeded

SIGNAL = signal.SIGALRM
"""Sent to the main thread when a phase expires (nothing else in regress uses it)."""

Describe = Callable[[str, "str | None", float], str]
"""(phase, detail, limit in seconds) -> the error's message."""


@dataclass
class _Entry:
    phase: str
    detail: str | None
    limit_s: float
    deadline: float
    """On the monotonic clock."""


class Watchdog:
    """Watches the phases entered while it is armed; see the module docstring for what expiry does."""

    def __init__(self, limits: Mapping[str, float], *, grace_s: float, describe: Describe,
                 log_dir: Path | None = None):
        self.limits = dict(limits)
        self.grace_s = grace_s
        self.describe = describe
        self.log_dir = log_dir
        self.expired: PhaseDeadlineExceeded | None = None
        self._cond = threading.Condition()
        self._entries: list[_Entry] = []
        self._children: dict[int, bool] = {}
        self._stopped = False
        self._raised = False
        self._thread: threading.Thread | None = None
        self._handler_installed = False
        self._previous: Any = None

    # -- arming ------------------------------------------------------------------------

    def start(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(SIGNAL, self._on_signal)
            self._handler_installed = True
        self._thread = threading.Thread(target=self._watch, name="regress-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._handler_installed:
            signal.signal(SIGNAL, self._previous if self._previous is not None else signal.SIG_DFL)
            self._handler_installed = False
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.expired is not None and not self._stopped and not self._raised:
            self._raised = True
            raise self.expired

    # -- phases and children -----------------------------------------------------------

    def enter(self, phase: str, detail: str | None) -> _Entry | None:
        limit = self.limits.get(phase)
        if limit is None:
            return None
        entry = _Entry(phase, detail, limit, time.monotonic() + limit)
        with self._cond:
            self._entries.append(entry)
            self._cond.notify_all()
        return entry

    def leave(self, entry: _Entry | None) -> None:
        if entry is None:
            return
        with self._cond:
            if entry in self._entries:
                self._entries.remove(entry)
            self._cond.notify_all()

    def add_child(self, pid: int, group: bool) -> None:
        with self._cond:
            self._children[pid] = group

    def remove_child(self, pid: int) -> None:
        with self._cond:
            self._children.pop(pid, None)

    # -- the watchdog's thread ---------------------------------------------------------

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._stopped:
                    return
                now = time.monotonic()
                due = [e for e in self._entries if e.deadline <= now]
                if due:
                    entry = min(due, key=lambda e: e.deadline)
                    break
                nearest = min((e.deadline for e in self._entries), default=None)
                self._cond.wait(None if nearest is None else nearest - now)
        self._expire(entry)

    def _expire(self, entry: _Entry) -> None:
        error = PhaseDeadlineExceeded(self.describe(entry.phase, entry.detail, entry.limit_s),
                                      phase=entry.phase, limit_s=entry.limit_s)
        with self._cond:
            if self._stopped:
                return
            self.expired = error
        if self._handler_installed:
            # Signal first: the main thread then raises the deadline's error before it can see
            # the killed engine's closed pipe as an engine that died.
            signal.pthread_kill(threading.main_thread().ident, SIGNAL)  # type: ignore[arg-type]
        self._kill_children()
        with self._cond:
            if self._cond.wait_for(lambda: self._stopped, timeout=self.grace_s):
                return
        self._hard_exit(error)

    def _kill_children(self) -> None:
        with self._cond:
            children = list(self._children.items())
        for pid, group in children:
            try:
                if group:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _hard_exit(self, error: PhaseDeadlineExceeded) -> None:
        log = self._dump_stacks()
        where = f"every thread's stack is in {log}" if log else "no stack dump could be written"
        text = (f"error: {error}\n  (the command did not stop within {self.grace_s:g} s of the deadline: stuck "
                f"outside Python, so it was ended; {where})\n")
        try:
            os.write(2, text.encode("utf-8", "replace"))
        except OSError:
            pass
        self._kill_children()
        os._exit(EXIT_RUN_FAILED)

    def _dump_stacks(self) -> Path | None:
        if self.log_dir is None:
            return None
        now = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = self.log_dir / f"hang-{now}-{os.getpid()}.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(f"{self.expired}\n\n")
                fh.flush()
                faulthandler.dump_traceback(file=fh, all_threads=True)
        except OSError:
            return None
        return path


_active: Watchdog | None = None


@contextmanager
def armed(limits: Mapping[str, float], *, grace_s: float, describe: Describe,
          log_dir: Path | None = None) -> Iterator[Watchdog]:
    """Watch the phases entered inside the block (one watchdog per process: an inner call
    shares the outer one). When a phase expired, the block ends with its
    :class:`~regress.errors.PhaseDeadlineExceeded` whatever else happened meanwhile (code that
    caught it, a verdict reached after it): a command past its deadline exits 3."""
    global _active
    if _active is not None:
        yield _active
        return
    dog = Watchdog(limits, grace_s=grace_s, describe=describe, log_dir=log_dir)
    dog.start()
    _active = dog
    try:
        yield dog
    except BaseException as exc:
        if dog.expired is not None and exc is not dog.expired:
            raise dog.expired from exc
        raise
    finally:
        _active = None
        dog.stop()
    if dog.expired is not None:
        raise dog.expired


class Phase:
    """A phase being watched (or not, without an armed watchdog); :meth:`switch` moves on to the
    next phase of the same piece of work (a shard's generation to its teacher forcing)."""

    def __init__(self, dog: Watchdog | None, name: str, detail: str | None):
        self._dog, self.name, self.detail = dog, name, detail
        self._entry = dog.enter(name, detail) if dog is not None else None

    def switch(self, name: str) -> None:
        """End this phase and start ``name`` (its own deadline starts now); same name: nothing."""
        if name == self.name:
            return
        self.name = name
        if self._dog is not None:
            self._dog.leave(self._entry)
            self._entry = self._dog.enter(name, self.detail)

    def close(self) -> None:
        if self._dog is not None:
            self._dog.leave(self._entry)
            self._entry = None


@contextmanager
def phase(name: str, detail: str | None = None) -> Iterator[Phase]:
    """The block is phase ``name`` (``detail``: which part, e.g. ``shard 3 of 8``) of the armed
    watchdog's command; a no-op without one, or for a phase it has no limit for."""
    current = Phase(_active, name, detail)
    try:
        yield current
    finally:
        current.close()


@contextmanager
def child_process(pid: int, *, group: bool = False) -> Iterator[None]:
    """Kill process ``pid`` (with ``group``, its process group) when a deadline expires inside
    the block."""
    dog = _active
    if dog is not None:
        dog.add_child(pid, group)
    try:
        yield
    finally:
        if dog is not None:
            dog.remove_child(pid)


def register_child(pid: int, *, group: bool = False) -> None:
    """:func:`child_process` for a process whose life is not one block (an engine kept warm)."""
    if _active is not None:
        _active.add_child(pid, group)


def unregister_child(pid: int) -> None:
    if _active is not None:
        _active.remove_child(pid)


def kill_group(process: Any, wait_s: float | None = None) -> None:
    """Kill the process group a child started with ``start_new_session=True`` leads (the child
    and all it started), then reap the child: waiting at most ``wait_s`` (None: until it is gone;
    a child in uninterruptible sleep can take a while to go)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
