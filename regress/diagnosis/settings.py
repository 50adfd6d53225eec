"""``diagnose:`` in params.yaml: diagnose a candidate that fails inside ``regress check``.

Opt-in. ``diagnose: true`` takes the defaults; a mapping sets them::

    diagnose:
      max_prompts: 10          # the drifted prompts diagnosed (regressions first)
      probes: auto             # or a list: [reference, control, revert, float32, alone, rerun, ...]

Only pydantic here: :mod:`regress.config` imports it while loading params.yaml.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

REVERT_GROUPS = ("input", "input-defaults", "kv-cache", "dtype", "compile", "scheduling", "sampling", "model",
                 "engine")
"""The setting groups a ``revert-<group>`` probe puts back, in order (what each holds:
regress.diagnosis.probes.GROUPS)."""
AUTO = ("reference", "control", "rerun", "alone", "revert", "float32", "prefix-caching-off",
        "chunked-prefill-off", "concurrency")
"""What ``probes: auto`` runs (``revert`` stands for every revert that applies; ``concurrency``
only for a candidate served over HTTP)."""
OPT_IN = ("eager", "batch-invariant")
"""Probes run only when asked for: ``eager`` flips the candidate's compile mode (torch.compile
starts in about a minute on CPUs), ``batch-invariant`` needs an engine that supports it."""
KNOWN = (*AUTO, *OPT_IN, *(f"revert-{name}" for name in REVERT_GROUPS))
"""Every probe name ``probes:`` (and ``regress diagnose --probes``) accepts."""


class DiagnoseSettings(BaseModel):
    """The ``diagnose:`` section."""

    model_config = ConfigDict(extra="forbid")

    max_prompts: int = Field(10, ge=1, le=1000)
    """How many drifted prompts are diagnosed (regressions first, then input drift, then drift)."""
    probes: list[str] | None = None
    """The probes to run (None or ``auto``: those that apply; see regress.diagnosis.probes)."""

    @field_validator("probes", mode="before")
    @classmethod
    def _auto(cls, value: Any) -> Any:
        if value == "auto":
            return None
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("probes")
    @classmethod
    def _known(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name not in KNOWN:
                raise ValueError(f"unknown probe '{name}'; known: {', '.join(KNOWN)}")
        return value


def parse_diagnose(value: Any) -> DiagnoseSettings | None:
    """``diagnose:``'s value: true (defaults), false/None (off), or a mapping."""
    if value is None or value is False:
        return None
    if value is True:
        return DiagnoseSettings()
    return DiagnoseSettings.model_validate(value)
