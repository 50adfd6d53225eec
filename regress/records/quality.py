"""The quality verdict's record (``RunMetrics.quality``): did answers hold, not did tokens.

Only pydantic here: :mod:`regress.records.scores` imports it; :mod:`regress.quality` computes it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from regress.records.base import _Record

Gate = Literal["fidelity", "quality", "both"]
"""Which verdict gates a candidate (``gate:`` on a candidate; ``auto`` resolves to one of these)."""
QualityOutcome = Literal["pass", "fail", "inconclusive"]


class QualitySlice(_Record):
    """Accuracy of one tag's answered prompts, golden against candidate, paired."""

    tag: str
    """The tag, or for an automatic slice the kind of prompt (``kind: multiple choice``, ...)."""
    automatic: bool = False
    """A slice by kind of prompt (free text, multiple choice, sampled), made whatever the tags say."""
    prompts: int
    """Answered prompts with this tag."""
    golden_correct: float
    candidate_correct: float
    """Answers right on each side (a sampled prompt counts its share of right samples)."""
    lost: int
    """Prompts the candidate does worse on (golden right, candidate wrong; sampled: a lower share)."""
    gained: int
    """Prompts the candidate does better on."""
    difference: float
    """Candidate accuracy minus golden accuracy (-0.05: five points worse)."""
    low: float
    high: float
    """The paired interval of the difference, at the scoring's confidence."""
    p_value: float
    """Exact sign test (binomial) that more prompts got worse than better, one-sided: exact McNemar
    when every prompt is answered once."""
    p_adjusted: float
    """Corrected for the slices tested by Tarone's rule (times K, the slices whose most extreme
    outcome could reach significance: :mod:`regress.quality_stats`); 1.0 for a slice not tested."""
    tested: bool = True
    """Counted in the correction: losing every answer the golden got right there would be significantly
    and materially worse. A slice that could never be is shown, not tested."""
    worse: bool
    """Significantly worse (p_adjusted below 1 - confidence) and by more than ``theta``: fails the verdict."""


class QualityVerdict(_Record):
    """Paired non-inferiority of the candidate's answers against the golden's (:mod:`regress.quality`)."""

    verdict: QualityOutcome
    """pass: the interval's lower bound is above -theta; fail: the candidate is significantly worse (the
    whole interval below 0 and not within theta, or a slice significantly worse); inconclusive: the
    interval is too wide to say, which gates like a fail."""
    theta: float
    """Non-inferiority margin, in accuracy (0.05: five points; ``thresholds.quality_theta``)."""
    confidence: float
    """Confidence of the intervals (``thresholds.confidence``)."""
    prompts: int
    """Answered prompts (free-text ``expected`` or ``choices``) compared."""
    sampled: int = 0
    """Of them, sampled prompts, each judged by its share of right samples on each side."""
    golden_accuracy: float | None
    candidate_accuracy: float | None
    lost: int = 0
    gained: int = 0
    difference: float | None = None
    """Candidate accuracy minus golden accuracy, on the same prompts."""
    low: float | None = None
    high: float | None = None
    """The paired interval of the difference (see ``method``)."""
    method: str = ""
    """How the interval was made, in words."""
    mcnemar_p: float | None = None
    prompts_needed: int | None = None
    """Answered prompts a check at this discordance and difference would need to conclude (power
    ``thresholds.quality_power``); None when concluded, or when no number would (the difference is past -theta)."""
    reasons: list[str] = Field(default_factory=list)
    slices: list[QualitySlice] = Field(default_factory=list)
    """Per tag with enough answered prompts (``thresholds.quality_min_slice``), in first-seen order."""
    worse_slices: list[str] = Field(default_factory=list)


def gate_fails(gate: Gate, fidelity: str, quality: QualityVerdict | None) -> bool:
    """Whether the verdicts that gate say stop: fidelity's ``fail``; quality's ``fail`` or
    ``inconclusive`` (or no answered prompt to judge it by)."""
    quality_fails = quality is None or quality.verdict != "pass"
    if gate == "fidelity":
        return fidelity == "fail"
    if gate == "quality":
        return quality_fails
    return fidelity == "fail" or quality_fails
