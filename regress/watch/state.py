"""What the watcher remembers: per package, every version it has seen, claimed or checked.

Two stores with one interface:

- :class:`FileState` (default): ``$REGRESS_HOME/watch/state.json``, rewritten atomically under
  a file lock, and the history ``watch.jsonl`` beside it (one line per checked version).
- :class:`RedisState` (``state: redis://host:6379/1``): a hash per package, a set of watched
  packages and a list for the history, for watchers and Celery workers on several machines.

"Exactly one check per new version" rests on :meth:`WatchState.claim`: it records the version
as ``claimed`` only if nobody has (a compare-and-set under the file lock, or a Redis
transaction), and only the watcher whose claim succeeded starts the check. A check that could
not be started is released again, so the next tick retries it. A check started but never
finished (its watcher or worker died, its task was lost) is claimed again after
``claim_timeout_s``.

Statuses of a version::

    seen        on the index when the package was first watched; not checked (first_run: record)
    claimed     a watcher is starting its check
    queued      sent to a Celery worker (the worker records the verdict)
    dispatched  sent to the GitHub workflow (the verdict is in the workflow run)
    pass, fail  the check's verdict
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from pydantic import ValidationError

from regress.errors import StorageError, WatchStateError
from regress.storage import atomic_write_text, read_record
from regress.worker.settings import REDIS_SCHEMES
from regress.watch.state_records import (  # noqa: F401 (re-exported: the state's interface)
    FINISHED, FUTURE_SLACK_S, IN_FLIGHT, STATE_FORMAT_VERSION, Status, VersionRecord, _expected, _PackageState,
    _StateFile, check_keys, claimable, is_relative_report, stale_time)

logger = logging.getLogger("regress.watch")


class WatchState(ABC):
    """The interface both stores implement. Every method is atomic on its own."""

    @abstractmethod
    def describe(self) -> str:
        """Where the state lives, for messages (never a password)."""

    @abstractmethod
    def spec(self) -> str:
        """What opens this state again (:func:`open_state`), e.g. in a Celery worker."""

    @abstractmethod
    def known(self, package: str) -> dict[str, VersionRecord] | None:
        """The versions recorded for ``package``; ``None`` if it was never watched."""

    @abstractmethod
    def initialise(self, package: str, seen: list[str]) -> bool:
        """First watch of ``package``: record ``seen`` as seen. ``False`` (and no change) if
        another watcher initialised it first."""

    @abstractmethod
    def _put_if(self, record: VersionRecord, allowed: Callable[[VersionRecord | None], bool]) -> bool:
        """Atomically: store ``record`` if ``allowed`` says yes to the version's current record
        (``None`` when there is none). ``True`` if it was stored."""

    def claim(self, record: VersionRecord, stale_after_s: float) -> bool:
        """Record ``record`` (status ``claimed``) unless the version is already recorded (see
        :func:`claimable`); ``True`` if this call claimed it."""
        return self._put_if(record, lambda current: claimable(current, time.time(), stale_after_s))

    def transition(self, record: VersionRecord, expected: frozenset[str] | None = IN_FLIGHT) -> bool:
        """Replace the version's record if its status is one of ``expected`` (``None``: whatever
        it is, or if it is missing). ``False`` (and no change) otherwise: a Celery worker that
        already recorded the verdict is not overwritten by the watcher's late "queued", and a
        redelivered check does not record a second verdict."""
        return self._put_if(record, lambda current: _expected(current, expected))

    @abstractmethod
    def release(self, package: str, version: str, statuses: frozenset[str] = IN_FLIGHT) -> bool:
        """Forget the version if its status is one of ``statuses`` (its check did not start or
        failed), so the next tick tries again. ``True`` if something was removed."""

    @abstractmethod
    def append_history(self, record: VersionRecord) -> None:
        """Add one line to the history."""

    @abstractmethod
    def history(self) -> list[VersionRecord]:
        """Every history line, oldest first."""

    def get(self, package: str, version: str) -> VersionRecord | None:
        return (self.known(package) or {}).get(version)

    def close(self) -> None:
        """Release connections."""


# --------------------------------------------------------------------------------------
# File
# --------------------------------------------------------------------------------------


class FileState(WatchState):
    """state.json (rewritten atomically under an exclusive lock) and watch.jsonl beside it."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()
        self.history_path = self.path.parent / "watch.jsonl"
        self.skipped_lines: list[int] = []
        """Lines the last :meth:`history` skipped as torn (1-based)."""
        self._lock_path = self.path.parent / (self.path.name + ".lock")

    def describe(self) -> str:
        return str(self.path)

    def spec(self) -> str:
        return str(self.path)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _open_no_follow(self._lock_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> _StateFile:
        state = read_record(self.path, _StateFile, what="a watch state file", missing=_StateFile(),
                            unreadable=lambda exc: f"cannot read the watch state ({exc})",
                            invalid=lambda exc: f"not a watch state file ({exc.errors()[0]['msg']}); "
                                                "fix or remove it (the watcher then starts afresh)")
        if state.format_version > STATE_FORMAT_VERSION:
            raise StorageError(f"{self.path}: state format {state.format_version} is newer than this "
                               f"regress understands ({STATE_FORMAT_VERSION})")
        return state

    def _write(self, state: _StateFile) -> None:
        atomic_write_text(self.path, state.model_dump_json(indent=1) + "\n")

    def known(self, package: str) -> dict[str, VersionRecord] | None:
        # No lock: the file is replaced atomically, so a reader sees a whole old or new state
        # (and a dry run creates nothing).
        entry = self._read().packages.get(package)
        return None if entry is None else dict(entry.versions)

    def initialise(self, package: str, seen: list[str]) -> bool:
        with self._locked():
            state = self._read()
            if package in state.packages:
                return False
            now = time.time()
            state.packages[package] = _PackageState(
                first_watched=now,
                versions={v: VersionRecord(package=package, version=v, status="seen", time=now) for v in seen})
            self._write(state)
            return True

    def _put_if(self, record: VersionRecord, allowed: Callable[[VersionRecord | None], bool]) -> bool:
        with self._locked():
            state = self._read()
            entry = state.packages.setdefault(record.package, _PackageState(first_watched=time.time()))
            if not allowed(entry.versions.get(record.version)):
                return False
            entry.versions[record.version] = record
            self._write(state)
            return True

    def release(self, package: str, version: str, statuses: frozenset[str] = IN_FLIGHT) -> bool:
        with self._locked():
            state = self._read()
            entry = state.packages.get(package)
            current = entry.versions.get(version) if entry else None
            if entry is None or current is None or current.status not in statuses:
                return False
            del entry.versions[version]
            self._write(state)
            return True

    def append_history(self, record: VersionRecord) -> None:
        with self._locked():
            with _open_no_follow(self.history_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, "a+b") as out:
                # A writer that died mid-line left a torn tail: end it first, so this record
                # starts a line of its own instead of being glued to the fragment.
                out.seek(0, os.SEEK_END)
                torn = out.tell() > 0 and not _ends_with_newline(out)
                out.write((b"\n" if torn else b"") + record.model_dump_json().encode("utf-8") + b"\n")
                out.flush()
                os.fsync(out.fileno())

    def history(self) -> list[VersionRecord]:
        """Every history line, oldest first. A line that is not JSON at all is what a writer
        that died mid-append leaves (the append after it ends it with a newline): it is skipped
        with a warning naming file and line. A JSON line that is not a history record is a
        :class:`StorageError` (not ours to skip)."""
        if not self.history_path.exists():
            return []
        with self._locked():  # never half a line that is being appended
            try:
                # Lines end in "\n" only: splitlines() would also cut at U+2028 inside a record.
                with _open_no_follow(self.history_path, os.O_RDONLY, "rb") as fh:
                    lines = fh.read().decode("utf-8", "replace").split("\n")
            except OSError as exc:
                raise StorageError(f"{self.history_path}: cannot read the watch history ({exc})") from exc
        records = []
        self.skipped_lines = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError:
                self.skipped_lines.append(number)
                logger.warning("%s:%d: skipped a torn history line (a write was cut off)", self.history_path, number)
                continue
            try:
                records.append(VersionRecord.model_validate_json(line))
            except ValidationError as exc:
                raise StorageError(f"{self.history_path}:{number}: not a history line") from exc
        return records


def _open_no_follow(path: Path, flags: int, mode: str) -> Any:
    """``path`` opened without following a symlink at its last component: the state directory
    may be shared, and a link there must not make the watcher write (or read) a file elsewhere."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        if path.is_symlink():
            raise StorageError(f"{path}: is a symbolic link; the watcher writes only its own files "
                               "(remove the link)") from exc
        raise StorageError(f"{path}: cannot open it ({exc})") from exc
    return os.fdopen(fd, mode)


def _ends_with_newline(fh: Any) -> bool:
    fh.seek(-1, os.SEEK_END)
    last = fh.read(1)
    fh.seek(0, os.SEEK_END)
    return bool(last == b"\n")


# --------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------


class RedisState(WatchState):
    """Keys under ``prefix``: ``:packages`` (set of watched packages), ``:versions:<package>``
    (hash version -> record JSON) and ``:history`` (list of record JSON)."""

    def __init__(self, url: str, *, prefix: str = "regress:watch", timeout_s: float = 10):
        try:
            import redis
        except ImportError as exc:
            from regress.errors import MissingDependencyError

            raise MissingDependencyError("a Redis state needs the 'redis' package: pip install redis") from exc
        from regress.redact import redact

        self.url = url
        self.prefix = prefix
        self._shown = redact(url)
        self._redis = redis
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        except ValueError as exc:  # redis-py's own URL parsing: a bad port, scheme or database
            from regress.errors import ConfigError

            raise ConfigError(f"not a usable Redis URL {self._shown!r}: {exc}", field="watch.state") from exc

    def describe(self) -> str:
        return self._shown

    def spec(self) -> str:
        return self.url

    def _versions_key(self, package: str) -> str:
        return f"{self.prefix}:versions:{package}"

    @property
    def _packages_key(self) -> str:
        return f"{self.prefix}:packages"

    @contextmanager
    def _translating(self) -> Iterator[None]:
        try:
            yield
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            raise WatchStateError(f"the watch state at {self._shown} is unreachable ({exc})") from exc
        except self._redis.ResponseError as exc:
            raise WatchStateError(f"the watch state at {self._shown} refused a command ({exc})") from exc

    def _transaction(self, keys: list[str], body: Any) -> Any:
        """Run ``body(pipe)`` as an optimistic transaction over ``keys``: read after
        ``pipe.watch``, then ``pipe.multi()`` and write; retried if another client wrote first."""
        with self._translating(), self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*keys)
                    result = body(pipe)
                    if pipe.explicit_transaction:
                        pipe.execute()
                    else:
                        pipe.unwatch()
                    return result
                except self._redis.WatchError:
                    continue

    def _parse(self, where: str, raw: bytes | str) -> VersionRecord:
        """A stored record, or :class:`WatchStateError` naming where it is (key, and hash field
        or list index) when it does not parse: someone or something else wrote there, and
        guessing is worse than stopping (the tick exits 3; fix or delete the record)."""
        try:
            return VersionRecord.model_validate_json(raw)
        except ValidationError as exc:
            problem = exc.errors()[0]
            at = ".".join(map(str, problem["loc"]))
            raise WatchStateError(
                f"the watch state at {self._shown} holds a malformed record in {where}: {problem['msg']}"
                + (f" at {at}" if at else "") + "; fix or delete that record (the state is left as it is)"
            ) from exc

    def _record(self, key: str, version: str, raw: bytes | str | None) -> VersionRecord | None:
        return None if raw is None else self._parse(f"{key} field {version!r}", raw)

    def known(self, package: str) -> dict[str, VersionRecord] | None:
        with self._translating():
            pipe = self.client.pipeline()
            pipe.sismember(self._packages_key, package)
            pipe.hgetall(self._versions_key(package))
            watched, raw = pipe.execute()
        if not watched:
            return None
        key = self._versions_key(package)
        versions = {_text(k): self._parse(f"{key} field {_text(k)!r}", v) for k, v in raw.items()}
        why = check_keys(package, versions)
        if why:
            raise WatchStateError(f"the watch state at {self._shown} holds a record in {key} that does not agree "
                                  f"with its key: {why}; fix or delete that record (the state is left as it is)")
        return versions

    def initialise(self, package: str, seen: list[str]) -> bool:
        key = self._versions_key(package)

        def body(pipe: Any) -> bool:
            if pipe.sismember(self._packages_key, package):
                return False
            pipe.multi()
            now = time.time()
            for version in seen:
                pipe.hsetnx(key, version, VersionRecord(package=package, version=version, status="seen",
                                                        time=now).model_dump_json())
            pipe.sadd(self._packages_key, package)
            return True

        return self._transaction([self._packages_key, key], body)

    def _put_if(self, record: VersionRecord, allowed: Callable[[VersionRecord | None], bool]) -> bool:
        key = self._versions_key(record.package)

        def body(pipe: Any) -> bool:
            if not allowed(self._record(key, record.version, pipe.hget(key, record.version))):
                return False
            pipe.multi()
            pipe.hset(key, record.version, record.model_dump_json())
            pipe.sadd(self._packages_key, record.package)
            return True

        return self._transaction([key], body)

    def release(self, package: str, version: str, statuses: frozenset[str] = IN_FLIGHT) -> bool:
        key = self._versions_key(package)

        def body(pipe: Any) -> bool:
            current = self._record(key, version, pipe.hget(key, version))
            if current is None or current.status not in statuses:
                return False
            pipe.multi()
            pipe.hdel(key, version)
            return True

        return self._transaction([key], body)

    def append_history(self, record: VersionRecord) -> None:
        with self._translating():
            self.client.rpush(f"{self.prefix}:history", record.model_dump_json())

    def history(self) -> list[VersionRecord]:
        key = f"{self.prefix}:history"
        with self._translating():
            raw = self.client.lrange(key, 0, -1)
        return [self._parse(f"{key}[{number}]", line) for number, line in enumerate(raw)]

    def close(self) -> None:
        self.client.close()


def _text(raw: bytes | str) -> str:
    """A Redis key or field as text; bytes that are not UTF-8 are shown escaped, not fatal."""
    return raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw


def default_state_path() -> Path:
    from regress.home import regress_home

    return regress_home() / "watch" / "state.json"


def open_state(spec: str | None) -> WatchState:
    """The state a ``watch.state`` value names: a Redis URL, a file path, or (``None``) the
    default file."""
    if spec is None:
        return FileState(default_state_path())
    scheme = urlsplit(spec).scheme if "://" in spec else ""
    if scheme in REDIS_SCHEMES:
        return RedisState(spec)
    if scheme == "file":
        return FileState(urlsplit(spec).path)
    return FileState(Path(spec).expanduser())
