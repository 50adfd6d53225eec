"""What scoring applied of a measured noise floor: ``RunMetrics.noise_floor`` (metrics.json).

Only pydantic here: :mod:`regress.records` imports it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Stored(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoiseApplied(_Stored):
    """What scoring applied (``RunMetrics.noise_floor``)."""

    arms: list[str]
    """The arms behind the floor."""
    k: float
    quantile: float
    floor: dict[str, float | None]
    """The run-level floor per measure."""
    bounds: dict[str, float]
    """The run-level thresholds in force after the floor (``benign_kl``, ...)."""
    configured: dict[str, float]
    """The same thresholds as configured."""
    noisy_prompts: int
    """Prompts the baseline flipped itself under some arm."""
    noisy_ids: list[str] = Field(default_factory=list)
    """Their ids, in prompt set order."""
    made_benign: list[str] = Field(default_factory=list)
    """Prompts that are benign only because of their noise envelope."""
