"""Signed broker messages: whoever can write to Redis must not be able to make a worker run.

Every task message regress sends (shards, watch ticks, release checks; beat's too) carries an
HMAC-SHA256 in a message header, ``regress_signature = {"ts": <unix time>, "hmac": <hex>}``,
over the canonical JSON of ``{"task", "id", "args", "kwargs", "ts"}`` (sorted keys, no spaces).
Workers verify it before a task body runs (:class:`SignedTask`, the app's task class, so
Celery's built-in tasks are covered too); an unsigned, tampered, wrong-key or stale message is
refused: logged with the reason, stored as a FAILURE (:class:`~regress.errors.MessageRefused`),
acknowledged and dropped, never retried.

Why HMAC and not Celery's ``auth`` serializer: that one needs an X.509 key pair per sender and a
certificate store on every worker; one shared secret is enough here (senders and workers are
the same team's machines) and keeps the wire format JSON. Why a header: the task arguments stay
what they were, so a task's signature is checked in one place for every task.

The key: ``REGRESS_BROKER_KEY`` (the secret itself, at least 16 characters) or a key file named
by ``REGRESS_BROKER_KEY_FILE`` / ``celery.broker_key_file``; never on a command line, never in
a message. One key per process: a process talks to one fleet.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from celery import Task
from celery.signals import before_task_publish

from regress.errors import ConfigError, MessageRefused
from regress.worker.settings import CelerySettings

logger = logging.getLogger(__name__)

HEADER = "regress_signature"
KEY_VARIABLE = "REGRESS_BROKER_KEY"
KEY_FILE_VARIABLE = "REGRESS_BROKER_KEY_FILE"
MIN_KEY_LENGTH = 16
FUTURE_SKEW_S = 300.0
"""A message stamped this far in the future is refused too (clocks of a fleet agree closer)."""

_key: bytes | None = None
_max_age_s: float = 24 * 3600.0
_allow_unsigned: bool = False


def load_key(settings: CelerySettings, environ: dict[str, str] | None = None) -> bytes | None:
    """The signing key from the environment or the settings' key file; ``None`` when none is set."""
    environ = dict(os.environ if environ is None else environ)
    text: str | None = environ.get(KEY_VARIABLE) or None
    where = KEY_VARIABLE
    if text is None:
        path = environ.get(KEY_FILE_VARIABLE) or settings.broker_key_file
        if not path:
            return None
        where = f"{KEY_FILE_VARIABLE} / celery.broker_key_file ({path})"
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read the broker signing key file: {exc.strerror or exc}",
                              field="celery.broker_key_file") from exc
    key = text.strip()
    if len(key) < MIN_KEY_LENGTH:
        raise ConfigError(f"the broker signing key ({where}) must be at least {MIN_KEY_LENGTH} characters; "
                          f"make one with: python -c 'import secrets; print(secrets.token_hex(32))'",
                          field=KEY_VARIABLE)
    return key.encode("utf-8")


def configure(settings: CelerySettings, environ: dict[str, str] | None = None) -> bytes | None:
    """Load this process's key and verification settings from ``settings`` (and the environment)."""
    global _key, _max_age_s, _allow_unsigned
    _key = load_key(settings, environ)
    _max_age_s = settings.message_max_age_s
    _allow_unsigned = settings.allow_unsigned
    return _key


def has_key() -> bool:
    return _key is not None


def require_key(settings: CelerySettings) -> None:
    """For senders: refuse to send unsigned messages (workers would refuse them anyway) unless
    the settings allow unsigned messages."""
    if _key is None and not settings.allow_unsigned:
        raise ConfigError(f"no broker signing key: set {KEY_VARIABLE} (or a key file in {KEY_FILE_VARIABLE} / "
                          "celery.broker_key_file) to the same secret the workers have; workers refuse "
                          "unsigned messages", field=KEY_VARIABLE)


def canonical(task: str, task_id: str, args: Any, kwargs: Any, ts: float) -> bytes:
    """The bytes that are signed: what the worker will run, and when it was sent."""
    body = {"task": task, "id": task_id, "args": list(args or []), "kwargs": dict(kwargs or {}), "ts": ts}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


def signature(key: bytes, task: str, task_id: str, args: Any, kwargs: Any, ts: float) -> str:
    return hmac.new(key, canonical(task, task_id, args, kwargs, ts), hashlib.sha256).hexdigest()


def sign(task: str, task_id: str, args: Any, kwargs: Any, *, key: bytes | None = None,
         ts: float | None = None) -> dict[str, Any]:
    """The signature header value for one message (this process's key unless ``key``)."""
    key = key if key is not None else _key
    if key is None:
        raise ConfigError(f"no broker signing key: set {KEY_VARIABLE}", field=KEY_VARIABLE)
    ts = time.time() if ts is None else ts
    return {"ts": ts, "hmac": signature(key, task, task_id, args, kwargs, ts)}


def refusal(task: str, task_id: str, args: Any, kwargs: Any, stamp: Any, *, now: float | None = None) -> str | None:
    """Why a message must not run (``None``: it may). Also what the tests check."""
    if _key is None:
        if _allow_unsigned:
            return None
        return "this worker has no signing key, so it accepts no message"
    if not isinstance(stamp, dict) or "hmac" not in stamp or "ts" not in stamp:
        return "unsigned message"
    ts, given = stamp.get("ts"), stamp.get("hmac")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(given, str):
        return "malformed signature"
    expected = signature(_key, task, task_id, args, kwargs, float(ts))
    if not hmac.compare_digest(expected, given):
        return "bad signature (the message was changed, or signed with another key)"
    now = time.time() if now is None else now
    if now - ts > _max_age_s:
        return (f"stale message: signed {now - ts:.0f} s ago, more than celery.message_max_age_s "
                f"({_max_age_s:.0f} s)")
    if ts - now > FUTURE_SKEW_S:
        return f"message signed {ts - now:.0f} s in the future"
    return None


@before_task_publish.connect
def _sign_outgoing(sender: str | None = None, body: Any = None, headers: dict[str, Any] | None = None,
                   **_: Any) -> None:
    """Sign every task message this process publishes (the orchestrator, the watcher, beat)."""
    if _key is None or headers is None or not isinstance(body, (tuple, list)) or len(body) < 2:
        return
    task, task_id = headers.get("task") or sender, headers.get("id")
    if task and task_id:
        headers[HEADER] = sign(task, task_id, body[0], body[1])


class SignedTask(Task):
    """The app's task class: a task body runs only for a message that passes :func:`refusal`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        # A direct call (a test, or one of Celery's built-in tasks calling this one) has no
        # message behind it: it is refused too, since a built-in task's arguments come from a
        # message as well.
        reason = refusal(self.name, getattr(request, "id", None) or "", args, kwargs, getattr(request, HEADER, None))
        if reason is not None:
            logger.error("refused task %s[%s]: %s; nothing was run (acknowledged and dropped)",
                         self.name, getattr(request, "id", None), reason)
            raise MessageRefused(f"task {self.name}[{getattr(request, 'id', None)}] refused: {reason}")
        # Not super().__call__: that pushes a fresh request without the message's fields
        # (hostname), which bound tasks read.
        return self.run(*args, **kwargs)
