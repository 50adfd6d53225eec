"""Signed broker messages: a worker runs only what a key holder sent, exactly as it was sent.

Senders (the orchestrator, the watcher, beat) put an HMAC-SHA256 in a message header,
``regress_signature = {"ts": <unix time>, "hmac": <hex>}``, over the canonical JSON (sorted keys,
no spaces) of the *whole* message as sent: task, id, args, kwargs, ``ts``, every header (eta,
expires, group, retries, time limits, ...; only the transport's own ``redelivered`` and
``compression`` are left out), the embedded callbacks, errbacks, chain and chord, and the
``correlation_id`` and ``reply_to`` properties. Change any of them and the signature fails.

Workers check every message before Celery does anything with it (:func:`signed_strategy`, the
task class's strategy: before an ETA is scheduled, an expiry handled, a result stored or a
callback published), and refuse, besides unsigned, tampered, wrong-key, stale and malformed
messages (:func:`message_refusal`):

- any message that carries callbacks, errbacks, a chain or a chord, signed or not: regress
  sends none, and a worker must never publish work on a message's behalf;
- Celery's built-in tasks (``celery.*``: group, chain, chord_unlock, ...), which exist to
  publish or call other tasks;
- protocol 1 messages (the task and its callbacks in the body), which regress never sends.

A refused message is logged, stored as a FAILURE (:class:`~regress.errors.MessageRefused`; no
errback, chain or chord is followed), acknowledged and dropped, never retried. A task body runs
only behind a message this check let through (:class:`SignedTask`).

Who signs: only a sending app (:func:`publishing`, which ``regress.worker.app``'s client apps
enter for each ``send_task``) and a beat process. A worker's own app signs nothing: what Celery
publishes from a worker for a message (callbacks, errbacks, chains, retries, replaced tasks)
goes out unsigned and is refused like any stranger's message.

Why HMAC and not Celery's ``auth`` serializer: that one needs an X.509 key pair per sender and a
certificate store on every worker; one shared secret is enough here (senders and workers are
the same team's machines) and keeps the wire format JSON.

The key: ``REGRESS_BROKER_KEY`` (the secret itself, at least 16 characters) or a key file named
by ``REGRESS_BROKER_KEY_FILE`` / ``celery.broker_key_file``; never on a command line, never in
a message. One key per process: a process talks to one fleet.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from celery import Task, states
from celery.signals import beat_init, before_task_publish, worker_init

from regress.errors import ConfigError, MessageRefused
from regress.worker.settings import CelerySettings

logger = logging.getLogger(__name__)

HEADER = "regress_signature"
KEY_VARIABLE = "REGRESS_BROKER_KEY"
KEY_FILE_VARIABLE = "REGRESS_BROKER_KEY_FILE"
MIN_KEY_LENGTH = 16
FUTURE_SKEW_S = 300.0
"""A message stamped this far in the future is refused too (clocks of a fleet agree closer)."""
SIGNATURE_FORMAT = 2
"""Version of what is signed (1: task, id, args, kwargs and ts only; refused now)."""
TASK_PREFIX = "regress."
"""Names of the tasks a worker runs: regress's own, never Celery's built-in ``celery.*``."""
WORKFLOW_FIELDS = ("callbacks", "errbacks", "chain", "chord")
"""What a message embeds for Celery to publish after (or instead of) the task: always refused."""
TRANSPORT_HEADERS = frozenset({"redelivered", "compression"})
"""Headers the transport writes on the way (kombu's Redis transport marks a message it hands out
again; compression is undone before the body is read): not part of what the sender sent."""
SIGNED_PROPERTIES = ("correlation_id", "reply_to")
VERIFIED = "regress_verified"
"""Header the worker's check adds to a message it let through, for :class:`SignedTask`."""

_key: bytes | None = None
_max_age_s: float = 24 * 3600.0
_allow_unsigned: bool = False
_publishing: contextvars.ContextVar[bool] = contextvars.ContextVar("regress_publishing", default=False)
_beat_process = False
_worker_pid: int | None = None
_process_secret = secrets.token_bytes(32)
"""Binds the worker's check to the task call it let through (never leaves the process)."""
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


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


# --------------------------------------------------------------------------------------
# What is signed
# --------------------------------------------------------------------------------------


def _present(mapping: Mapping[str, Any] | None) -> dict[str, Any]:
    # Celery reads an absent field and a None one alike: sign them alike.
    return {str(k): v for k, v in (mapping or {}).items() if v is not None}


def canonical(task: str, task_id: str, args: Any, kwargs: Any, ts: float, *,
              headers: Mapping[str, Any] | None = None, embed: Mapping[str, Any] | None = None,
              properties: Mapping[str, Any] | None = None) -> bytes:
    """The bytes that are signed: the whole message as sent, and when it was sent."""
    extra = {k: v for k, v in _present(headers).items()
             if k not in ("task", "id", HEADER) and k not in TRANSPORT_HEADERS}
    body = {"format": SIGNATURE_FORMAT, "task": task, "id": task_id, "args": list(args or []),
            "kwargs": dict(kwargs or {}), "ts": ts, "headers": extra, "embed": _present(embed),
            "properties": _present({k: (properties or {}).get(k) for k in SIGNED_PROPERTIES})}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


def signature(key: bytes, task: str, task_id: str, args: Any, kwargs: Any, ts: float, **message: Any) -> str:
    return hmac.new(key, canonical(task, task_id, args, kwargs, ts, **message), hashlib.sha256).hexdigest()


def sign(task: str, task_id: str, args: Any, kwargs: Any, *, key: bytes | None = None, ts: float | None = None,
         headers: Mapping[str, Any] | None = None, embed: Mapping[str, Any] | None = None,
         properties: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The signature header value for one message (this process's key unless ``key``)."""
    key = key if key is not None else _key
    if key is None:
        raise ConfigError(f"no broker signing key: set {KEY_VARIABLE}", field=KEY_VARIABLE)
    ts = float(time.time() if ts is None else ts)
    return {"ts": ts, "hmac": signature(key, task, task_id, args, kwargs, ts, headers=headers, embed=embed,
                                        properties=properties)}


def _stamp_time(stamp: Any) -> float | None:
    """The stamp's time, if the stamp is well formed (a finite number and a hex digest)."""
    if not isinstance(stamp, dict):
        return None
    ts, given = stamp.get("ts"), stamp.get("hmac")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return None
    if not isinstance(given, str) or not _HEX_DIGEST.fullmatch(given):  # fullmatch on [0-9a-f]: ASCII only
        return None
    try:
        value = float(ts)
    except OverflowError:  # an integer beyond any float
        return None
    return value if math.isfinite(value) else None


def refusal(task: str, task_id: str, args: Any, kwargs: Any, stamp: Any, *, now: float | None = None,
            headers: Mapping[str, Any] | None = None, embed: Mapping[str, Any] | None = None,
            properties: Mapping[str, Any] | None = None) -> str | None:
    """Why a message's signature does not let it run (``None``: it does). Never raises."""
    if _key is None:
        if _allow_unsigned:
            return None
        return "this worker has no signing key, so it accepts no message"
    if not isinstance(stamp, dict) or "hmac" not in stamp or "ts" not in stamp:
        return "unsigned message"
    ts = _stamp_time(stamp)
    if ts is None:
        return "malformed signature"
    expected = signature(_key, task, task_id, args, kwargs, ts, headers=headers, embed=embed, properties=properties)
    if not hmac.compare_digest(expected, stamp["hmac"]):
        return "bad signature (the message was changed, or signed with another key)"
    now = time.time() if now is None else now
    if now - ts > _max_age_s:
        return (f"stale message: signed {now - ts:.0f} s ago, more than celery.message_max_age_s "
                f"({_max_age_s:.0f} s)")
    if ts - now > FUTURE_SKEW_S:
        return f"message signed {ts - now:.0f} s in the future"
    return None


def message_refusal(headers: Any, payload: Any, properties: Any) -> str | None:
    """Why a message as received (headers, decoded body, properties) must not run (``None``: it
    may): the one check a worker makes before Celery acts on a message."""
    if not isinstance(headers, dict) or "task" not in headers:
        return "not a protocol 2 task message (regress sends no other)"
    task, task_id = headers.get("task"), headers.get("id")
    if not isinstance(task, str) or not isinstance(task_id, str) or not task_id:
        return "malformed message: no task name or id"
    if not task.startswith(TASK_PREFIX):
        return (f"task {task!r} is not one of regress's tasks (Celery's built-in tasks exist to publish and "
                "call other tasks; a worker runs none of them)")
    if not (isinstance(payload, (list, tuple)) and len(payload) == 3 and isinstance(payload[0], list)
            and isinstance(payload[1], dict) and (payload[2] is None or isinstance(payload[2], dict))):
        return "malformed message: the body is not [args, kwargs, options]"
    args, kwargs, embed = payload
    reason = refusal(task, task_id, args, kwargs, headers.get(HEADER), headers=headers, embed=embed,
                     properties=properties if isinstance(properties, dict) else {})
    if reason is not None:
        return reason
    flow = [field for field in WORKFLOW_FIELDS if (embed or {}).get(field)]
    if flow:  # signed, or a worker that allows unsigned messages
        return (f"the message carries {', '.join(flow)}: regress sends none, and a worker never publishes or "
                "runs work on a message's behalf")
    return None


# --------------------------------------------------------------------------------------
# Senders
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def publishing() -> Iterator[None]:
    """Sign the task messages published inside (a sending app's ``send_task``)."""
    token = _publishing.set(True)
    try:
        yield
    finally:
        _publishing.reset(token)


def _wire(value: Any) -> Any:
    """``value`` as the worker will decode it (kombu's JSON: tuples become lists, and so on)."""
    from kombu.utils.json import dumps, loads

    return loads(dumps(value))


@before_task_publish.connect
def _sign_outgoing(sender: str | None = None, body: Any = None, headers: dict[str, Any] | None = None,
                   properties: dict[str, Any] | None = None, **_: Any) -> None:
    """Sign what a sending app or beat publishes; nothing else (a worker's callbacks, retries)."""
    if not (_publishing.get() or _beat_process) or _key is None or headers is None:
        return
    if not isinstance(body, (tuple, list)) or len(body) != 3:
        return  # not protocol 2: workers refuse it anyway
    task, task_id = headers.get("task"), headers.get("id")
    if task and task_id:
        wire = _wire({"args": body[0], "kwargs": body[1], "embed": body[2],
                      "headers": {k: v for k, v in headers.items() if k != HEADER}})
        headers[HEADER] = sign(task, task_id, wire["args"], wire["kwargs"], headers=wire["headers"],
                               embed=wire["embed"], properties=properties)


@worker_init.connect
def _a_worker_signs_nothing(**_: Any) -> None:
    global _worker_pid, _beat_process
    _worker_pid, _beat_process = os.getpid(), False


@beat_init.connect
def _beat_signs_its_ticks(**_: Any) -> None:
    global _beat_process
    if os.getpid() == _worker_pid:
        # Beat as a thread of a worker (``-B`` where there is no fork) would make the worker's
        # own publishing signed: it stays unsigned, and workers refuse its ticks.
        logger.error("beat runs inside a worker process: its ticks are not signed; run beat on its own "
                     "(regress watch --beat)")
        return
    _beat_process = True


# --------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------


def _verified_token(task: str, task_id: str, args: Any, kwargs: Any) -> str:
    return hmac.new(_process_secret, canonical(task, task_id, args, kwargs, 0.0), hashlib.sha256).hexdigest()


def _refuse(task: Task, consumer: Any, message: Any, task_id: Any, name: Any, reason: str) -> None:
    logger.error("refused task %s[%s]: %s; nothing was run (acknowledged and dropped)", name, task_id, reason)
    if isinstance(task_id, str) and 0 < len(task_id) <= 255:
        try:
            # The result alone: no errback, chain or chord of the message is looked at.
            task.backend.store_result(task_id, MessageRefused(f"task {name}[{task_id}] refused: {reason}"),
                                      states.FAILURE)
        except Exception:  # noqa: BLE001 - the result backend down: the message is still dropped
            logger.exception("could not record the refusal of %s[%s]", name, task_id)
    message.ack_log_error(logger, consumer.connection_errors)


def signed_strategy(task: Task, app: Any, consumer: Any, **options: Any) -> Any:
    """The strategy of every task (:attr:`SignedTask.Strategy`): Celery's own, behind
    :func:`message_refusal`, so a refused message never becomes a request."""
    from celery.worker.strategy import default

    handle = default(task, app, consumer, **options)

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **more: Any) -> Any:
        headers = message.headers
        if body is not None or not isinstance(headers, dict) or "task" not in headers:
            # Protocol 1: Celery decoded the body to find the task; nothing is taken from it.
            payload = body if isinstance(body, dict) else {}
            _refuse(task, consumer, message, payload.get("id"), payload.get("task", task.name),
                    "not a protocol 2 task message (regress sends no other)")
            return None
        # Decoding here raises ContentDisallowed (pickle) or DecodeError for Celery's consumer to
        # log and reject, as before.
        payload = message.payload
        reason = message_refusal(headers, payload, message.properties)
        if reason is not None:
            _refuse(task, consumer, message, headers.get("id"), headers.get("task"), reason)
            return None
        headers[VERIFIED] = _verified_token(headers["task"], headers["id"], payload[0], payload[1])
        return handle(message, body, ack, reject, callbacks, **more)

    return on_message


class SignedTask(Task):
    """The app's task class: Celery's strategy behind the message check, and a body that runs
    only for the call that check let through."""

    Strategy = "regress.worker.signing:signed_strategy"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        task_id = getattr(request, "id", None) or ""
        given = getattr(request, VERIFIED, None)
        verified = (isinstance(given, str) and given.isascii()
                    and hmac.compare_digest(given, _verified_token(self.name, task_id, args, kwargs)))
        flow = [field for field in WORKFLOW_FIELDS if getattr(request, field, None)]
        if not verified or flow:
            # A direct call, an eager apply or an old-style errback has no checked message
            # behind it. Whatever it carries is dropped, so nothing is published after it either.
            for field in WORKFLOW_FIELDS:
                setattr(request, field, None)
            reason = "no checked message behind this call" if not verified else f"it carries {', '.join(flow)}"
            logger.error("refused task %s[%s]: %s; nothing was run", self.name, task_id, reason)
            raise MessageRefused(f"task {self.name}[{task_id}] refused: {reason}")
        # Not super().__call__: that pushes a fresh request without the message's fields
        # (hostname), which bound tasks read.
        return self.run(*args, **kwargs)
