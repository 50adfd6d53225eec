"""Broker settings for the Celery executor, from params.yaml's ``celery:`` section and the environment.

Kept free of Celery imports: params.yaml is validated by code that must not need a broker.
The environment wins over the file, so a secret (a password in the broker URL) can stay out
of the repository::

    REGRESS_BROKER_URL        redis://[:password@]host:6379/0  or  rediss://... (TLS)
    REGRESS_RESULT_BACKEND    defaults to the broker URL
    REGRESS_QUEUE             the queue shards go to (default ``regress``)
    REGRESS_VISIBILITY_TIMEOUT_S
    REGRESS_REDIS_CA_CERTS    CA bundle for rediss:// (default: the system's)
    REGRESS_STALL_TIMEOUT_S
    REGRESS_RESULTS_DIR       the only directory tree a worker writes results into (default: its cwd)
    REGRESS_BROKER_KEY_FILE   file holding the message signing key (or REGRESS_BROKER_KEY: the key)
    REGRESS_MESSAGE_MAX_AGE_S older signed messages are refused (replay protection)
    REGRESS_ALLOW_INSECURE_BROKER=1, REGRESS_ALLOW_UNSIGNED=1   see worker/security in docs/celery.md
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from regress.errors import ConfigError
from regress.redact import redact  # the one redaction function; re-exported for older callers
from regress.validation import first_error

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
REDIS_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes that name a Redis server (redis-py's ``from_url``)."""
DEFAULT_QUEUE = "regress"

_ENV = {
    "broker_url": "REGRESS_BROKER_URL",
    "result_backend": "REGRESS_RESULT_BACKEND",
    "queue": "REGRESS_QUEUE",
    "visibility_timeout_s": "REGRESS_VISIBILITY_TIMEOUT_S",
    "ssl_ca_certs": "REGRESS_REDIS_CA_CERTS",
    "stall_timeout_s": "REGRESS_STALL_TIMEOUT_S",
    "results_dir": "REGRESS_RESULTS_DIR",
    "broker_key_file": "REGRESS_BROKER_KEY_FILE",
    "message_max_age_s": "REGRESS_MESSAGE_MAX_AGE_S",
    "allow_insecure_broker": "REGRESS_ALLOW_INSECURE_BROKER",
    "allow_unsigned": "REGRESS_ALLOW_UNSIGNED",
}


class CelerySettings(BaseModel):
    """How the Celery executor reaches its broker (params.yaml ``celery:``; environment wins)."""

    model_config = ConfigDict(extra="forbid")

    broker_url: str = DEFAULT_BROKER_URL
    """Redis URL of the broker: ``redis://`` or ``rediss://`` (TLS), password as ``:secret@host``."""
    result_backend: str | None = None
    """Redis URL of the result backend (default: the broker URL)."""
    queue: str = Field(DEFAULT_QUEUE, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    """The queue shards are sent to; workers listen on it (``regress worker --queue``).
    Use one queue per GPU kind or per candidate environment to route work."""
    candidate_queues: dict[str, str] = Field(default_factory=dict)
    """Queue per candidate name, for candidates that need other hardware or an environment only
    some workers have (``{fp8-kv: h100, next: l4}``); others go to ``queue``. ``--queue`` wins."""
    visibility_timeout_s: float = Field(3 * 3600, gt=0)
    """How long a taken but unacknowledged shard stays invisible before Redis hands it to another
    worker. Must exceed the longest shard, including creating the environment and loading the
    engine the first time; workers stop a shard before this runs out."""
    stall_timeout_s: float | None = Field(None, gt=0)
    """The orchestrator gives up (exit 3, naming the unfinished shards) when no shard finishes for
    this long. Default: the visibility timeout plus ten minutes."""
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    """Certificate check for rediss:// URLs."""
    ssl_ca_certs: str | None = None
    """CA bundle for rediss:// URLs (default: the system's)."""
    results_dir: str | None = None
    """Workers write only below this directory (resolved, symlinks included): a shard, vocabulary
    or run directory a message names outside it is refused before anything runs. Default: the
    worker's working directory. Point it at the shared results storage (``/mnt/regress``)."""
    broker_key_file: str | None = None
    """File holding the shared secret that signs broker messages (``REGRESS_BROKER_KEY`` holding
    the secret itself wins). Senders sign, workers refuse what is not signed with it."""
    message_max_age_s: float = Field(24 * 3600, gt=0)
    """Workers refuse a signed message older than this (replay protection). Must exceed the
    longest a shard can wait on the queue plus the visibility timeout."""
    allow_insecure_broker: bool = False
    """Let a worker use a password-less broker that is not on loopback (anyone on the network
    could then send it work, signed or not: only for isolated networks)."""
    allow_unsigned: bool = False
    """Send and accept unsigned messages when no key is set (a single-user machine, loopback
    Redis). Never on a shared broker."""

    @field_validator("candidate_queues")
    @classmethod
    def _queue_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, queue in value.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]*", queue):
                raise ValueError(f"queue of '{name}' must be letters, digits and _ . : -, got {queue!r}")
        return value

    def queue_for(self, candidate: str) -> str:
        """The queue a candidate's shards go to (without a --queue)."""
        return self.candidate_queues.get(candidate, self.queue)

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in REDIS_SCHEMES:
            raise ValueError(f"must be a redis://, rediss:// or unix:// URL, got {redact(value)!r}")
        return value

    @property
    def backend_url(self) -> str:
        return self.result_backend or self.broker_url

    def with_environment(self, environ: dict[str, str] | None = None) -> "CelerySettings":
        """These settings with any REGRESS_* variables applied on top."""
        environ = dict(os.environ if environ is None else environ)
        updates = {field: environ[var] for field, var in _ENV.items() if environ.get(var)}
        if not updates:
            return self
        return self.updated(updates, names={field: _ENV[field] for field in updates})

    def updated(self, updates: dict[str, object], *, names: dict[str, str]) -> "CelerySettings":
        """These settings with ``updates`` applied; a bad value is a :class:`ConfigError` naming
        where it came from (``names``: field -> environment variable or command-line option)."""
        try:
            return CelerySettings.model_validate({**self.model_dump(), **updates})
        except ValidationError as exc:
            where, message = first_error(exc, CelerySettings)
            top = (where or "").split(".")[0]
            raise ConfigError(message, field=names.get(top, f"celery.{where}" if where else "celery")) from exc

    def describe(self) -> str:
        """The broker, for messages and logs: never the password."""
        return redact(self.broker_url)


def is_loopback(url: str) -> bool:
    """Whether a Redis URL points at this machine (127.0.0.0/8, ::1, localhost, a unix socket)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_worker_security(settings: CelerySettings, *, has_key: bool) -> None:
    """Refuse to start a worker anyone could feed: a password-less broker off loopback (unless
    ``allow_insecure_broker``), or no signing key (unless ``allow_unsigned``)."""
    for url, field in ((settings.broker_url, "celery.broker_url"), (settings.backend_url, "celery.result_backend")):
        if urlsplit(url).password is None and not is_loopback(url) and not settings.allow_insecure_broker:
            raise ConfigError(f"refusing the password-less broker {redact(url)} that is not on this machine: "
                              "anyone who reaches it could queue work. Put a password in the URL "
                              "(redis://:secret@host...), or pass --allow-insecure-broker "
                              "(REGRESS_ALLOW_INSECURE_BROKER=1) on an isolated network", field=field)
    if not has_key and not settings.allow_unsigned:
        raise ConfigError("no broker signing key: set REGRESS_BROKER_KEY (or a key file in REGRESS_BROKER_KEY_FILE "
                          "/ celery.broker_key_file), the same secret the orchestrator and watcher use; "
                          "--allow-unsigned only for a single-user machine with Redis on loopback",
                          field="REGRESS_BROKER_KEY")


