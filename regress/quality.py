"""The quality verdict: did the candidate's answers hold, on the same prompts, within a margin?

A change made on purpose (an FP8 KV cache, a W8A8 checkpoint, a faster kernel) is supposed to
compute differently: the fidelity verdict (:mod:`regress.verdict`, tokens against the baseline's
noise) fails it by construction and does not answer the question asked, *is it as good?* This one
does, from the prompts with a checkable answer (``expected`` text, or ``choices``): each such prompt
is right or wrong on each side (a sampled prompt, judged as a distribution, scores the share of its
samples that are right), and the verdict is a **paired non-inferiority test** of the accuracy
difference (candidate minus golden) against a margin ``theta``:

- the interval is MOVER on the rates of answers gained and lost, with Wilson score limits
  (:mod:`regress.quality_stats`: monotone in every answer lost or gained, never certain on a small
  set, plus or minus Wilson's bound of 0 of n when no answer changed);
- **pass** when the lower bound is above -theta; **fail** when the whole interval is below 0 and
  not above -theta (significantly worse, possibly by more than theta), or when a slice (a tag, or a
  kind of prompt) is significantly worse by more than theta (a one-sided exact sign test of the
  prompts that got worse against those that got better, exact McNemar when each prompt is answered
  once, Tarone-corrected over the slices that could be worse); **inconclusive** otherwise: the
  interval is too wide to say. It gates like a fail and says how many answered prompts would
  conclude at this discordance (:func:`prompts_needed`, power ``quality_power``).

Which verdict gates a candidate is its ``gate`` (:func:`resolve_gate`); both are always shown.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from regress.errors import MeasureError
from regress.quality_stats import gains_and_losses, paired_interval, slice_tests
from regress.records.quality import Gate, QualitySlice, QualityVerdict

__all__ = ["judge_quality", "paired_interval", "prompts_needed", "resolve_gate"]

ON_PURPOSE_FIELDS = ("model", "revision", "quantization", "dtype")
"""A candidate that differs from its baseline in one of these (or in the KV-cache dtype) changes the
numerics on purpose: ``gate: auto`` resolves to ``quality`` for it, else to ``fidelity``."""
ON_PURPOSE_ENGINE_ARGS = ("kv_cache_dtype", "quantization")


def resolve_gate(candidate: Any, baseline: Any | None) -> Gate:
    """The verdict that gates ``candidate``: its ``gate`` when set, else ``quality`` for a change made
    on purpose against ``baseline`` (weights, quantization, dtype, KV-cache dtype) and ``fidelity``
    for the rest (an engine release, a serving setting)."""
    gate = getattr(candidate, "gate", "auto")
    if gate != "auto":
        return gate
    if baseline is None:
        return "fidelity"
    for name in ON_PURPOSE_FIELDS:
        if getattr(candidate, name, None) != getattr(baseline, name, None):
            return "quality"
    mine, theirs = candidate.engine_args or {}, baseline.engine_args or {}
    if any(mine.get(k) != theirs.get(k) for k in ON_PURPOSE_ENGINE_ARGS):
        return "quality"
    return "fidelity"


def _z(p: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(p))


def prompts_needed(golden: Sequence[float], candidate: Sequence[float], theta: float, confidence: float,
                   power: float) -> int | None:
    """Answered prompts at which a check with these rates of answers gained and lost would show
    non-inferiority (the interval's lower bound above -theta) with probability about ``power``: the
    smallest m whose interval (:func:`regress.quality_stats.mover_interval`) at the same rates, with
    z_{(1+confidence)/2} + z_power in place of the confidence's z, has its lower bound above -theta.
    None when the difference is at or past -theta (no number of prompts shows a candidate that much
    worse to be within it). With no prompt changed, the smallest m whose Wilson bound of 0 of m is
    below theta (nothing random is left to have power over)."""
    from regress.quality_stats import mover_interval

    n = len(golden)
    gained, lost = gains_and_losses(golden, candidate)
    if theta + (gained - lost) / n <= 0:
        return None
    z = _z((1 + confidence) / 2)
    if gained == lost == 0:
        return math.floor(z * z * (1 - theta) / theta) + 1
    z += _z(power)

    def concludes(m: int) -> bool:
        return mover_interval(gained * m / n, lost * m / n, m, z)[1] > -theta

    high = 1
    while not concludes(high):
        high *= 2
        if high > 10 ** 9:
            return None
    low = high // 2  # concludes(high) and not concludes(low), or low is 0
    while high - low > 1:
        mid = (low + high) // 2
        if concludes(mid):
            high = mid
        else:
            low = mid
    return high


def _mcnemar(lost: int, gained: int) -> float:
    if lost + gained == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(lost, lost + gained, 0.5).pvalue)


def _pts(v: float) -> str:
    return f"{v * 100:+.1f}"


def _count(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}"


def _checked(answers: Sequence[tuple[str, list[str], float, float]]) -> None:
    # Scores are 1/0 or a share of samples; anything else (NaN from a broken share) must not
    # become a verdict: it would compare false with every bound.
    for pid, _, g, c in answers:
        for side, v in (("golden", g), ("candidate", c)):
            if isinstance(v, bool):
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
                raise MeasureError(f"prompt {pid}: the {side}'s answer score is {v!r}, not a share in [0, 1]: "
                                   "no quality verdict comes from it")


KIND_FREE_TEXT, KIND_CHOICE, KIND_SAMPLED = "kind: free text", "kind: multiple choice", "kind: sampled"
"""The automatic slices: damage confined to one kind of answered prompt is judged there even when no
tag says which prompts are of that kind."""


def judge_quality(answers: Sequence[tuple[str, list[str], float, float]], t: Any,
                  sampled_ids: Collection[str] = (), choice_ids: Collection[str] = ()) -> QualityVerdict | None:
    """The quality verdict of the answered prompts: (prompt id, tags, golden score, candidate score)
    each, in prompt set order; a score is 1 (right) or 0, or a sampled prompt's share of right
    samples (:attr:`regress.records.AnswerCheck.golden_score`; ``sampled_ids`` names those,
    ``choice_ids`` the multiple-choice prompts). None without any."""
    if not answers:
        return None
    _checked(answers)
    theta, conf = t.quality_theta, t.confidence
    g = [float(a[2]) for a in answers]
    c = [float(a[3]) for a in answers]
    n = len(answers)
    sampled = sum(1 for a in answers if a[0] in sampled_ids)
    diff, low, high, method = paired_interval(g, c, conf)
    lost = sum(1 for x, y in zip(g, c) if y < x)
    gained = sum(1 for x, y in zip(g, c) if y > x)
    slices = _slices(answers, t, set(sampled_ids), set(choice_ids))
    worse = [s.tag for s in slices if s.worse]
    shown = (f"accuracy {_count(sum(c))}/{n} against the golden's {_count(sum(g))}/{n}: {_pts(diff)} points "
             f"({conf:.0%} interval {_pts(low)} to {_pts(high)}; {lost} lost, {gained} gained)")
    needed = None
    if worse:
        verdict = "fail"
        reasons = [f"slice(s) significantly worse, by more than {theta * 100:g} points: " + ", ".join(
            f"'{s.tag}' {_pts(s.difference)} points ({s.lost} lost, {s.gained} gained, one-sided p = "
            f"{s.p_adjusted:.2g} corrected for the slices tested)"
            for s in slices if s.worse), shown]
    elif low > -theta:
        verdict, reasons = "pass", [f"{shown}: within {theta * 100:g} points (the lower bound is above -{theta * 100:g})"]
    elif high < 0:
        verdict, reasons = "fail", [f"{shown}: significantly worse, and not shown within {theta * 100:g} points"]
    else:
        verdict = "inconclusive"
        needed = prompts_needed(g, c, theta, conf, t.quality_power)
        more = (f"about {needed:,} answered prompts would conclude at this discordance (power {t.quality_power:.0%})"
                if needed is not None else "no number of prompts would show it within the margin at this difference")
        reasons = [f"{shown}: the interval includes -{theta * 100:g} points, too wide to say; {more}"]
    return QualityVerdict(verdict=verdict, theta=theta, confidence=conf, prompts=n, sampled=sampled,
                          golden_accuracy=sum(g) / n,
                          candidate_accuracy=sum(c) / n, lost=lost, gained=gained, difference=diff, low=low,
                          high=high, method=method, mcnemar_p=_mcnemar(lost, gained), prompts_needed=needed,
                          reasons=reasons, slices=slices, worse_slices=worse)


def _slice_members(answers: Sequence[tuple[str, list[str], float, float]], sampled: set[str],
                   choices: set[str], min_prompts: int) -> list[tuple[str, bool, list[int]]]:
    """(name, automatic, indices into ``answers``) of every slice: each tag with at least
    ``min_prompts`` answered prompts, in first-seen order, then the kinds of prompt. A slice holding
    exactly the prompts of the whole set or of an earlier slice is left out (it would only dilute the
    correction)."""
    tags: dict[str, list[int]] = {}
    for i, (_, prompt_tags, _, _) in enumerate(answers):
        for tag in dict.fromkeys(prompt_tags):
            tags.setdefault(tag, []).append(i)
    kinds: dict[str, list[int]] = {}
    for i, (pid, *_) in enumerate(answers):
        kind = KIND_SAMPLED if pid in sampled else KIND_CHOICE if pid in choices else KIND_FREE_TEXT
        kinds.setdefault(kind, []).append(i)
    seen = {tuple(range(len(answers)))}
    found = []
    for automatic, groups in ((False, tags), (True, kinds)):
        for name, members in groups.items():
            if len(members) >= min_prompts and tuple(members) not in seen:
                seen.add(tuple(members))
                found.append((name, automatic, members))
    return found


def _slices(answers: Sequence[tuple[str, list[str], float, float]], t: Any, sampled: set[str],
            choices: set[str]) -> list[QualitySlice]:
    rows = []
    for name, automatic, members in _slice_members(answers, sampled, choices, t.quality_min_slice):
        g = [float(answers[i][2]) for i in members]
        c = [float(answers[i][3]) for i in members]
        diff, low, high, _ = paired_interval(g, c, t.confidence)
        lost = sum(1 for x, y in zip(g, c) if y < x)
        gained = sum(1 for x, y in zip(g, c) if y > x)
        rows.append((name, automatic, g, c, diff, low, high, lost, gained))
    tests = slice_tests([(g, lost, gained, diff) for _, _, g, _, diff, _, _, lost, gained in rows],
                        t.quality_theta, t.confidence)
    return [QualitySlice(tag=name, automatic=automatic, prompts=len(g), golden_correct=sum(g), candidate_correct=sum(c),
                         lost=lost, gained=gained, difference=diff, low=low, high=high, p_value=test.p_value,
                         p_adjusted=test.p_adjusted, tested=test.tested, worse=test.worse)
            for (name, automatic, g, c, diff, low, high, lost, gained), test in zip(rows, tests)]
