"""``power/power.json`` and the figure a scoring shows of it (``RunMetrics.detection_power``).

Only pydantic here: :mod:`regress.records` imports it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

POWER_FILE = "power.json"
POWER_FORMAT_VERSION = 1


class _Stored(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PowerStep(_Stored):
    """One step of the ladder: the baseline's model with weight noise of ``scale`` x each tensor's std."""

    key: str
    """The step's directory under power/ (``weight-noise-2pct``)."""
    scale: float
    """Noise as a fraction of each weight tensor's standard deviation (0.02: 2 %)."""
    label: str
    """The step in words."""
    run_id: str
    prompts: int
    identical: int
    regressions: int
    severe_regressions: int | None = None
    """With a noise floor: the regressions that gate on their own."""
    mean_teacher_forced_kl: float | None = None
    kl_ratio: float | None = None
    """The run-level test's teacher-forced KL against the noise envelope (None: no test, or noise 0)."""
    p_value: float | None = None
    """The run-level test's smallest Holm-corrected p-value (None: no test)."""
    beyond_noise: bool | None = None
    """The run-level test's call (None: no test)."""
    verdict: Literal["pass", "fail"]
    reasons: list[str]
    """The verdict's first reasons."""


class ArmStep(_Stored):
    """One noise arm scored against the envelope of the other arms: the gate on a change that is noise."""

    arm: str
    verdict: Literal["pass", "fail"]
    kl_ratio: float | None = None
    p_value: float | None = None
    beyond_noise: bool | None = None
    summary: str


class DetectionPower(_Stored):
    """``power/power.json``: the gate's detection power on this golden and prompt set."""

    format_version: int = POWER_FORMAT_VERSION
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    golden_run_id: str
    """The golden the ladder was checked against; another golden makes the figure stale."""
    prompts: int
    seed: int
    """The noise's seed: every step is one direction at growing strength."""
    basis: Literal["noise", "per-prompt"]
    """What the gate rests on: the run-level test against the measured noise, or fixed per-prompt thresholds."""
    thresholds_sha256: str
    """Digest of the thresholds in force: other thresholds make another gate."""
    steps: list[PowerStep]
    arms: list[ArmStep] = Field(default_factory=list)
    """Empty with fewer than two noise arms (one arm has no other arm to be scored against)."""
    smallest_failing: str | None
    """The key of the smallest step the gate fails; None: it passes every step."""
    monotone: bool
    """Once a step fails, every larger step fails."""
    summary: str
    """The figure in one sentence."""


class PowerFigure(_Stored):
    """What a scoring shows of ``power/power.json`` (``RunMetrics.detection_power``)."""

    summary: str
    smallest_failing_scale: float | None
    """The smallest failing step's noise, as a fraction of std (None: no step failed)."""
    monotone: bool
    arms_pass: bool | None
    """Every noise arm passed against the others (None: fewer than two arms)."""
    measured_at: datetime
    current: bool
    """Measured with the thresholds in force now (False: re-run `regress power`; the figure is of another gate)."""
