"""The watcher's settings: the ``watch:`` section of params.yaml, command-line options on top.

The section's schema (with an example) is :mod:`regress.watch.settings`.

Validation errors name params.yaml, the line and the field (``watch.interval_s``); a bad
command-line value names the option instead, a bad environment value its variable.

Secrets (a password in the state's Redis URL, credentials in the index URL, the webhook URL
whose path is its secret) can come from the environment instead of params.yaml or a flag
(flags are visible to every user in ``ps``): :data:`SECRET_SETTINGS` maps each setting to its
variable, and ``<VARIABLE>_FILE`` names a file holding the value. Precedence: flag, then
environment, then params.yaml. Values are never echoed in errors unredacted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from pydantic import ValidationError

from regress.errors import ConfigError
from regress.redact import redact, secret_from_environment
from regress.validation import first_error, line_for, yaml_key_lines
from regress.watch.settings import WatchSettings

if TYPE_CHECKING:
    from regress.config import Params

# Settings whose command-line option is not simply --<field-name>.
_OPTIONS = {"packages": "--package", "interval_s": "--interval", "first_run": "--check-existing"}

SECRET_SETTINGS = {
    "state": "REGRESS_WATCH_STATE_URL",
    "index_url": "REGRESS_INDEX_URL",
    "webhook": "REGRESS_WEBHOOK_URL",
}
"""Settings that may hold a secret, and the environment variable (or ``<VARIABLE>_FILE``)
that sets each one without a flag or a line in params.yaml."""


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
