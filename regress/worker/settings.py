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
"""

from __future__ import annotations

import os
import re
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from regress.errors import ConfigError
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


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = re.sub(r":[^:@]*@", ":***@", parts.netloc, count=1)
    return urlunsplit(parts._replace(netloc=netloc))
