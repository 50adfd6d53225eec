"""``deadlines:`` in params.yaml: how long each phase of a check may take before it counts as hung.

A phase past its deadline stops the command with exit 3 naming the phase (:mod:`regress.watchdog`),
instead of a CI job that waits for its own time-out. Example (seconds; these are the defaults)::

    deadlines:
      environment: 3600       # building a candidate's environment (pip; minutes for a new vLLM)
      engine_start: 1200      # an engine process loading (60 s and more for a real model on 2 cores)
      generation: 1800        # one shard (one engine batch) generating
      teacher_forcing: 1800   # one shard scored teacher-forced
      scoring: 1800           # scoring a run against the golden (embeddings included)
      report: 600             # writing the report
      grace: 30               # after a deadline, how long the command may take to stop cleanly

``REGRESS_DEADLINE_<NAME>`` (``REGRESS_DEADLINE_SCORING=600``, ``REGRESS_DEADLINE_GRACE=5``)
overrides a value for one run, as CI sets it; it is validated as the file is. Generation and
teacher forcing are bounded per shard, so their limits do not grow with the prompt set; the
others once per run (each environment and each engine start once).

Only pydantic here: :mod:`regress.config` imports it while loading params.yaml.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from regress.errors import ConfigError

PHASES: dict[str, str] = {
    "environment": "environment",
    "engine_start": "engine start",
    "generation": "generation",
    "teacher_forcing": "teacher forcing",
    "scoring": "scoring",
    "report": "report",
}
"""Phase keys (as :func:`regress.watchdog.phase` names them and params.yaml spells them) -> label."""

ENV_PREFIX = "REGRESS_DEADLINE_"
MAX_S = 7 * 24 * 3600.0
"""A week: longer is not a deadline."""


class DeadlineSettings(BaseModel):
    """Seconds each phase may take (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    environment: float = Field(3600.0, gt=0, le=MAX_S)
    """Building (or checking) a candidate's environment."""
    engine_start: float = Field(1200.0, gt=0, le=MAX_S)
    """An engine process starting and loading the model."""
    generation: float = Field(1800.0, gt=0, le=MAX_S)
    """One shard generating."""
    teacher_forcing: float = Field(1800.0, gt=0, le=MAX_S)
    """One shard scored teacher-forced."""
    scoring: float = Field(1800.0, gt=0, le=MAX_S)
    """Scoring a run against the golden."""
    report: float = Field(600.0, gt=0, le=MAX_S)
    """Writing a candidate's report (and the index)."""
    grace: float = Field(30.0, gt=0, le=3600)
    """After a deadline: how long the command may take to stop cleanly before it is ended."""

    def with_environment(self, environ: Mapping[str, str] | None = None) -> "DeadlineSettings":
        """These settings with ``REGRESS_DEADLINE_<NAME>`` variables applied; a bad value is a
        :class:`~regress.errors.ConfigError` naming the variable."""
        environ = os.environ if environ is None else environ
        data = self.model_dump()
        given = {name: environ[f"{ENV_PREFIX}{name.upper()}"] for name in data
                 if f"{ENV_PREFIX}{name.upper()}" in environ}
        if not given:
            return self
        try:
            return DeadlineSettings.model_validate({**data, **given})
        except ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0])
            variable = f"{ENV_PREFIX}{name.upper()}"
            raise ConfigError(f"{first['msg']} (seconds; given {given.get(name)!r})", field=variable) from exc

    def limits(self) -> dict[str, float]:
        """Phase key -> seconds."""
        return {name: getattr(self, name) for name in PHASES}

    def describe(self, phase: str, detail: str | None, limit_s: float) -> str:
        """The message of a phase past its deadline: which, the limit, and how to raise it."""
        where = f"phase '{PHASES.get(phase, phase)}'" + (f" ({detail})" if detail else "")
        return (f"{where} did not finish within its deadline of {limit_s:g} s, so the command was stopped "
                f"(a hang, or slower than allowed: raise it with deadlines.{phase} in params.yaml, "
                f"or {ENV_PREFIX}{phase.upper()}=SECONDS)")


@contextmanager
def watching(settings: DeadlineSettings, log_dir: Path | None = None) -> Iterator[None]:
    """Arm the phase deadlines of ``settings`` for the block (:func:`regress.watchdog.armed`);
    stack dumps of a hard exit go to ``log_dir``."""
    from regress.watchdog import armed

    with armed(settings.limits(), grace_s=settings.grace, describe=settings.describe, log_dir=log_dir):
        yield
