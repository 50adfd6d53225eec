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


MIN_PROMPTS = 6
"""Never fewer paired prompts than this for the run-level test; the bound that decides is
:func:`min_testable` (9 at ``noise_alpha`` 0.01). Below it the verdict rests on the per-prompt rules."""
RUN_LEVEL_MEASURES = 4
"""How many tests the run-level test adjusts for (Holm): the three :data:`regress.noise.beyond.MEASURES`
and the count of regressed prompts."""


def min_testable(alpha: float) -> int:
    """The fewest paired prompts on which the run-level test can say "beyond" at ``alpha``: its
    smallest one-sided signed-rank p (every prompt above its envelope: 1/2^n, exact up to 50
    prompts) times Holm's factor for the four tests must be below it (9 prompts at 0.01: 4/512).
    Below that the test could only ever say "within", so it is not run and every regression counts
    on its own, as with no floor: a verdict must not pass 6 prompts that each regressed while it
    fails 5 or 9."""
    n = MIN_PROMPTS
    while RUN_LEVEL_MEASURES * 0.5 ** n >= alpha and n < 1_000:
        n += 1
    return n


class MeasureTest(_Stored):
    """One measure of the run-level test (:mod:`regress.noise.beyond`): the candidate's per-prompt
    values against the noise envelope's on the same prompts."""

    measure: str
    """``tf_kl_mean``, ``tf_disagreement`` (1 - same-top-1), ``tf_max_flipped_margin`` or
    ``regressed_prompts`` (the share of prompts that regressed; for it ``above`` counts the prompts
    the candidate regressed on where no arm did, ``statistic`` is that count, ``p_value`` the
    one-sided exact McNemar p and ``effect`` (only candidate - only noise) / (both))."""
    label: str
    """The measure in words."""
    prompts: int
    """Prompts paired (both sides have the measure)."""
    candidate_mean: float
    """The candidate's mean over those prompts."""
    noise_mean: float
    """The envelope's mean over the same prompts (the worst any arm did on each)."""
    ratio: float | None
    """candidate_mean / noise_mean; None when the noise is exactly 0 on every paired prompt."""
    above: int
    """Prompts where the candidate is beyond the prompt's envelope."""
    statistic: float
    """The one-sided Wilcoxon signed-rank statistic (sum of the ranks of the positive excesses)."""
    p_value: float
    """Its one-sided p-value: how likely an excess this consistent is if the candidate moved no more than
    the noise (1.0 when nothing is above the envelope)."""
    p_adjusted: float
    """The p-value after Holm's correction over the measures tested (what ``alpha`` is compared with)."""
    effect: float
    """Matched-pairs rank-biserial correlation, -1..1: 1 when every prompt is beyond its envelope."""
    beyond: bool
    """This measure says the run moved beyond the noise (p_adjusted < alpha and ratio >= min_ratio)."""


class NoiseTest(_Stored):
    """The run-level fidelity test against the measured noise (``RunMetrics.noise_test``)."""

    alpha: float
    """Significance level (``noise.alpha``)."""
    min_ratio: float
    """Smallest candidate/noise mean ratio that counts as beyond (``noise.min_ratio``)."""
    measures: list[MeasureTest]
    """One test per measure, in :data:`regress.noise.beyond.MEASURES` order, then the regressed prompts."""
    left_out: int
    """Comparable prompts not paired (no teacher-forced measure on one side, or a non-finite value)."""
    beyond: bool
    """Some measure is beyond the noise: the run as a whole moved more than the baseline's own noise."""
    summary: str
    """One line: within or beyond, with the deciding measure's ratio, effect and p-value."""
