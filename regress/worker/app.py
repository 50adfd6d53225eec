"""The Celery app: Redis broker and result backend, JSON only, at-least-once delivery of shards.

Why each setting:

- JSON only (``accept_content``, ``result_accept_content``): a message in Python's own object
  serialization is code execution for whoever can write to the broker; workers refuse every
  content type but JSON, and results come back as JSON too.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a shard is acknowledged only after its
  result file is written, so a worker that dies mid-shard leaves it on the broker for another.
  Results are files keyed by (run, shard), so running a shard twice is harmless.
- prefetch multiplier 1: a worker holds only the shard it is running; the rest stay on the
  queue for other workers.
- visibility timeout longer than the longest shard: Redis gives an unacknowledged shard to
  another worker only after that long, so a slow shard is not run twice, and a dead worker's
  shard comes back after it (``unacked_restore_interval`` checks every few seconds).
- signed messages only (:mod:`regress.worker.signing`): JSON keeps a message from being code,
  the signature (over the whole message) keeps a stranger's message from being work. Every task
  is a :class:`~regress.worker.signing.SignedTask`, Celery's built-in ones included, and only a
  client app (:func:`make_app` with ``with_tasks=False``) or beat signs: the worker's own app,
  which Celery uses for what it publishes on a message's behalf, never does.
- the ``solo`` pool: tasks run in the worker's main process, one at a time, so the warm engine
  lives in one place. The engine itself always runs in its own subprocess (vLLM cannot run in a
  daemonic prefork child).
"""

from __future__ import annotations

import logging
import ssl
import sys
from typing import Any

import redis.exceptions
from celery import Celery
from celery.signals import worker_init
from kombu.exceptions import OperationalError

from regress.errors import BrokerError, RegressError
from regress.redact import redact
from regress.untrusted import printable
from regress.worker import signing
from regress.worker.settings import CelerySettings, check_worker_security

TASK_REPLAY_SHARD = "regress.replay_shard"
"""Run one shard of a replay plan (regress.worker.tasks)."""
TASK_TICK = "regress.watch.tick"
"""One tick of the release watcher (regress.watch.tasks)."""
TASK_CHECK = "regress.watch.check_release"
"""Check one new release (regress.watch.tasks; the celery trigger sends it)."""

TASK_MODULES = ["regress.worker.tasks", "regress.watch.tasks"]

BROKER_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,  # kombu wraps the transport's connection and channel errors in this
    redis.exceptions.ConnectionError,  # the result backend raises redis-py's own (also BusyLoading, Authentication)
    redis.exceptions.TimeoutError,
    OSError,  # sockets: refused, reset, unreachable host, DNS (ConnectionError and TimeoutError are OSErrors)
)
"""What the broker or result backend raise when Redis cannot be reached: a reason to wait or
to report :class:`~regress.errors.BrokerError`, never a bug."""

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def _ssl_options(url: str, settings: CelerySettings) -> dict[str, Any] | None:
    if not url.startswith("rediss://"):
        return None
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[settings.ssl_cert_reqs]}
    if settings.ssl_ca_certs:
        options["ssl_ca_certs"] = settings.ssl_ca_certs
    return options


def celery_config(settings: CelerySettings, *, with_tasks: bool = True) -> dict[str, Any]:
    """The Celery configuration for these settings (also what the tests check).

    ``with_tasks=False`` is for clients (the orchestrator): they send tasks by name and need
    none of the task modules (nor what those import)."""
    visibility = int(settings.visibility_timeout_s)
    # Look for abandoned shards often enough that a dead worker's shard returns soon after the
    # visibility timeout; each look is one cheap Redis command.
    restore_interval = max(1, min(10, visibility // 4))
    transport = {
        "visibility_timeout": visibility,
        "unacked_restore_interval": restore_interval,
        "unacked_restore_throttle": 1,
    }
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.backend_url,
        "broker_use_ssl": _ssl_options(settings.broker_url, settings),
        "redis_backend_use_ssl": _ssl_options(settings.backend_url, settings),
        "broker_transport_options": transport,
        "result_backend_transport_options": {"visibility_timeout": visibility},
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        "worker_prefetch_multiplier": 1,
        "worker_pool": "solo",
        "worker_concurrency": 1,
        "task_default_queue": settings.queue,
        "result_expires": 7 * 24 * 3600,
        # Task arguments (prompts, golden token ids) are not kept in the result backend: the
        # orchestrator polls states, and results live in files.
        "result_extended": False,
        # A task running when the broker connection drops finishes and writes its file; if Redis
        # then hands the shard out again, the next worker finds the file and skips it.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "include": TASK_MODULES if with_tasks else [],
        "worker_hijack_root_logger": False,
    }


def ensure_broker(celery_app: Celery, described: str) -> None:
    """Fail in seconds, with a message that says what to check, when Redis is not there (sending
    would first wait out the result backend's reconnection attempts, then blame the backend)."""
    connection = celery_app.connection_for_write()
    try:
        connection.ensure_connection(max_retries=3, interval_start=1, interval_step=2, interval_max=4, timeout=5)
    except BROKER_CONNECTION_ERRORS as exc:
        raise BrokerError(f"cannot reach the broker {described}: {str(exc).rstrip('.')}; is Redis running, and is "
                          "the URL right (REGRESS_BROKER_URL or celery.broker_url in params.yaml)?") from exc
    finally:
        connection.release()


class SendingCelery(Celery):
    """A client's app: it signs what its own ``send_task`` publishes, and nothing else. Never the
    current app, so that Celery, publishing for a message in a worker, cannot pick it up."""

    def send_task(self, *args: Any, **kwargs: Any) -> Any:
        with signing.publishing():
            return super().send_task(*args, **kwargs)


def make_app(settings: CelerySettings | None = None, *, with_tasks: bool = True) -> Celery:
    """A Celery app for ``settings`` (default: the environment's REGRESS_* variables).

    ``with_tasks=False``: a client's app (:class:`SendingCelery`), which signs what it sends."""
    settings = (settings or CelerySettings()).with_environment()
    if with_tasks:
        celery_app = Celery("regress", task_cls="regress.worker.signing:SignedTask")
    else:
        celery_app = SendingCelery("regress", task_cls="regress.worker.signing:SignedTask", set_as_current=False)
    celery_app.conf.update(celery_config(settings, with_tasks=with_tasks))
    celery_app.conf.regress_settings = settings.model_dump()
    try:
        signing.configure(settings)
    except RegressError as exc:
        # The module's app is built at import (a worker, beat, a client): a bad key must not
        # make the import fail; senders and workers check the key again before they act.
        logging.getLogger(__name__).error("%s", exc)
    return celery_app


def sending_app(settings: CelerySettings) -> Celery:
    """A client app (the orchestrator, the watcher's celery trigger) that signs what it sends;
    a :class:`ConfigError` when there is no key (workers would refuse every message)."""
    celery_app = make_app(settings, with_tasks=False)
    signing.configure(settings.with_environment())
    signing.require_key(settings.with_environment())
    return celery_app


def configure(celery_app: Celery, settings: CelerySettings) -> None:
    """Point an existing app (the module's ``app``) at other settings."""
    celery_app.conf.update(celery_config(settings))
    celery_app.conf.regress_settings = settings.model_dump()
    signing.configure(settings)


_worker_checked = False


def check_worker(settings: CelerySettings) -> None:
    """The start-up checks of a worker (:func:`check_worker_security`), done once per process."""
    global _worker_checked
    key = signing.configure(settings)
    check_worker_security(settings, has_key=key is not None)
    _worker_checked = True


@worker_init.connect
def _check_on_start(**_: Any) -> None:
    # ``celery -A regress.worker.app worker`` skips ``regress worker``'s checks: do them here.
    # SystemExit, not an exception: Celery logs and ignores exceptions from signal handlers.
    if _worker_checked:
        return
    try:
        check_worker(CelerySettings(**app.conf.regress_settings).with_environment())
    except RegressError as exc:
        print(printable(redact(f"regress worker: {exc}")), file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None


app = make_app()
"""The app ``celery -A regress.worker.app`` and ``regress worker`` run; tasks register on it."""
