"""The verdict on sampled prompts: per-prompt rows, each prompt's class, the run-level shift rule.

A prompt's samples are put together into one row per prompt; its class judges expected answers
as success rates.

The measures these rules read are :mod:`regress.metrics.sampled`'s; scoring
(:func:`regress.scoring.score_runs`) calls :func:`prompt_units`, :func:`sampled_class` and
:func:`run_shift`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from regress.metrics.aggregate import aggregate
from regress.metrics.base import Pair
from regress.metrics.sampled import GROUP_VALUES, sample_of
from regress.records import prompt_of_sample

CARRIED_METRICS = ("teacher_forced",)
"""Metrics whose per-sample values still mean something for a sampled prompt (each golden sample
fed to the candidate); the free-running comparisons of sample k with sample k do not."""


SUMMED = ("tf_positions", "tf_unscored", "tf_flips")
"""Counts, added up over the samples."""


@dataclass(frozen=True)
class PromptUnit:
    """What one prompt score is made of: one pair, or every sample's pair of a sampled prompt."""

    prompt_id: str
    pairs: list[Pair]
    row: dict[str, Any]

    @property
    def sampled(self) -> bool:
        return len(self.pairs) > 1 or sample_of(self.pairs[0]) is not None


def _together(specs: list[Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One sampled prompt's row from its samples' rows: the distribution values as they are, each
    carried value reduced over the samples as its spec aggregates it over prompts (a mean stays a
    mean, a position-weighted rate stays weighted), else the worst sample by its direction."""
    first = rows[0]
    row: dict[str, Any] = {name: first.get(name) for name in GROUP_VALUES}
    row["identical"] = all(r.get("identical") for r in rows)
    row["input_drift"] = any(r.get("input_drift") for r in rows)
    for spec in specs:
        if spec.name in SUMMED:
            row[spec.name] = sum(int(r.get(spec.name) or 0) for r in rows)
            continue
        if spec.aggregate is not None and spec.aggregate.how != "none":
            row[spec.name] = aggregate(spec, rows)
            continue
        values = [r.get(spec.name) for r in rows if isinstance(r.get(spec.name), (int, float))]
        if not values:
            row[spec.name] = None
        elif any(v != v for v in values):  # a NaN sample: min() and max() would answer by its place
            row[spec.name] = float("nan")
        elif spec.better == "higher":
            row[spec.name] = min(values)
        elif spec.better == "lower":
            row[spec.name] = max(values)
        else:
            row[spec.name] = float(np.mean(values))
    return row


def prompt_units(pairs: list[Pair], values: list[dict[str, Any]]) -> list[PromptUnit]:
    """Pairs and their metric rows as prompts, in order: a prompt run once is one pair; a sampled
    prompt's samples become one unit whose row is :func:`_together`'s."""
    from regress.metrics import get_metric

    carried = [spec for name in CARRIED_METRICS for spec in get_metric(name).values]
    units: list[PromptUnit] = []
    open_groups: dict[str, int] = {}
    members: dict[str, list[int]] = {}
    for i, pair in enumerate(pairs):
        if sample_of(pair) is None:
            units.append(PromptUnit(pair.prompt_id, [pair], values[i]))
            continue
        pid = prompt_of_sample(pair.prompt_id)
        if pid not in open_groups:
            open_groups[pid] = len(units)
            units.append(PromptUnit(pid, [], {}))
        members.setdefault(pid, []).append(i)
    for pid, at in open_groups.items():
        idx = sorted(members[pid], key=lambda i: sample_of(pairs[i])[0])  # type: ignore[index]
        units[at] = PromptUnit(pid, [pairs[i] for i in idx], _together(carried, [values[i] for i in idx]))
    return units


@dataclass(frozen=True)
class _SideAnswers:
    """One side's samples against the answer key."""

    correct: int
    """Samples that hold an accepted answer and no rejected one."""
    match: str | None
    """The first accepted answer found in a correct sample."""
    rejected: str | None
    """The first rejected answer found in any sample."""


def _side_answers(texts: list[str], key: Any) -> _SideAnswers:
    from regress.metrics.answers import answers_in

    found = [answers_in(text, key) for text in texts]
    matches = [m for m, _ in found if m is not None]
    return _SideAnswers(len(matches), matches[0] if matches else None,
                        next((r for _, r in found if r is not None), None))


def sampled_class(unit: PromptUnit, klass: str, reasons: list[str], expected: Any,
                  t: Any) -> tuple[str, list[str], Any]:
    """A sampled prompt's class, reasons and answer check, from what :func:`~regress.verdict.classify`
    found on its row (teacher-forced bounds and the distribution rule).

    With ``expected`` (an :class:`~regress.metrics.answers.AnswerKey`, or a list of accepted
    answers), each side's success rate over its samples is compared with an
    interval for the difference (:func:`regress.stats.rate_difference`); a drop whose whole
    interval is below 0 is a regression. The answer check records the majority on each side (a
    prompt the golden mostly answers and the candidate mostly does not is a lost answer)."""
    from regress.records import AnswerCheck

    n = len(unit.pairs)
    row = unit.row
    answer = None
    if expected:
        from regress.metrics.answers import AnswerKey
        from regress.stats import rate_difference

        key = AnswerKey.of(expected)
        golden = _side_answers([p.golden.text for p in unit.pairs], key)
        candidate = _side_answers([p.candidate.text for p in unit.pairs], key)
        k_golden, k_cand = golden.correct, candidate.correct
        diff, low, high = rate_difference(k_cand, n, k_golden, n, t.confidence)
        row.update(answer_rate_golden=k_golden / n, answer_rate_candidate=k_cand / n,
                   answer_rate_diff=diff, answer_rate_diff_low=low, answer_rate_diff_high=high)
        answer = AnswerCheck(expected=list(key.accepted), golden_correct=2 * k_golden >= n,
                             candidate_correct=2 * k_cand >= n, golden_match=golden.match,
                             candidate_match=candidate.match, golden_rejected=golden.rejected,
                             candidate_rejected=candidate.rejected, golden_rate=k_golden / n,
                             candidate_rate=k_cand / n)
        if high < 0 and klass not in ("input_drift", "regression"):
            # Drift, not a regression: with a handful of samples per prompt, one prompt in twenty
            # shows such a drop by chance at 95 %; the run's answers as a whole judge the model.
            text = (f"expected answer in {k_cand}/{n} candidate samples against {k_golden}/{n} golden ones: "
                    f"{diff:+.0%} ({t.confidence:.0%} CI {low:+.0%} to {high:+.0%})")
            reasons = [text] + (reasons if klass == "drift" else [])
            klass = "drift"
    if klass == "benign":
        reasons = [f"{n} samples each, same distribution by every measure: logprob per token "
                   f"{_signed(row.get('sample_logprob_shift'))} nat (p = {_num(row.get('sample_logprob_p'))}), "
                   f"semantic gap {_num(row.get('sample_semantic_gap'))} (p = {_num(row.get('sample_semantic_p'))}), "
                   f"distinct outputs "
                   f"{row.get('distinct_golden')} golden / {row.get('distinct_candidate')} candidate"]
    return klass, reasons, answer


def _num(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:.2g}"


def _signed(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:+.3f}"


def run_shift(scores: list[Any], t: Any) -> tuple[str | None, str | None]:
    """The sampled prompts as a whole: (failure reason, note), either None.

    Each sampled prompt's logprob shift is one observation; a two-sided Wilcoxon signed-rank test
    (scipy) asks whether they lean one way. Few samples per prompt make each prompt's own test
    weak, but a candidate that samples hotter or narrower moves every prompt the same way, which
    this sees: the run fails when the mean shift is beyond ``sampled_regression_shift`` with p
    below ``sampled_alpha``."""
    shifts = [s.metrics.get("sample_logprob_shift") for s in scores if s.metrics.get("samples")]
    # A NaN or infinite shift is its prompt's regression already (verdict.classify); the test
    # takes the numbers, which a NaN would turn into a p-value that passes every comparison.
    shifts = [float(v) for v in shifts if isinstance(v, (int, float)) and np.isfinite(v)]
    if not shifts:
        return None, None
    mean = float(np.mean(shifts))
    p: float | None = None
    if len(shifts) >= 2 and any(v != 0 for v in shifts):
        from scipy.stats import wilcoxon

        p = float(wilcoxon(shifts, alternative="two-sided").pvalue)
    shown = "n/a" if p is None else f"{p:.2g}"
    text = (f"{len(shifts)} sampled prompt(s): candidate samples' logprob per token {mean:+.3f} nat against the "
            f"golden's on average (Wilcoxon signed-rank p = {shown})")
    if p is not None and p < t.sampled_alpha and abs(mean) > t.sampled_regression_shift:
        return f"{text}: beyond {t.sampled_regression_shift} at p < {t.sampled_alpha}", None
    return None, text
