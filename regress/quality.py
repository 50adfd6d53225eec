"""The quality verdict: did the candidate's answers hold, on the same prompts, within a margin?

A change made on purpose (an FP8 KV cache, a W8A8 checkpoint, a faster kernel) is supposed to
compute differently: the fidelity verdict (:mod:`regress.verdict`, tokens against the baseline's
noise) fails it by construction and does not answer the question asked, *is it as good?* This one
does, from the prompts with a checkable answer (``expected`` text, or ``choices``): each such prompt
is right or wrong on each side (a sampled prompt, judged as a distribution, scores the share of its
samples that are right), and the verdict is a **paired non-inferiority test** of the accuracy
difference (candidate minus golden) against a margin ``theta``:

- the interval is the paired t interval of the per-prompt differences (``scipy.stats.ttest_rel``'s
  ``confidence_interval`` at ``confidence``: the paired difference of two proportions, as
  lm-evaluation-harness's paired comparison reports it); when no prompt changed its answer, the
  differences have no spread and the interval is plus or minus the Wilson upper bound of a
  discordance rate of 0 of n (``scipy.stats.binomtest``), so a small set is never certain;
- **pass** when the lower bound is above -theta; **fail** when the whole interval is below 0 and
  not above -theta (significantly worse, possibly by more than theta), or when a tag's slice is
  significantly worse (an exact sign test of the prompts that got worse against those that got better
  per slice, which is exact McNemar when each prompt is answered once; Holm-corrected over the
  slices); **inconclusive**
  otherwise: the interval is too wide to say. It gates like a fail and says how many answered
  prompts would conclude at this discordance (:func:`prompts_needed`, power ``quality_power``).

Which verdict gates a candidate is its ``gate`` (:func:`resolve_gate`); both are always shown.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from regress.records.quality import Gate, QualitySlice, QualityVerdict

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


def _wilson_high(k: int, n: int, confidence: float) -> float:
    from scipy.stats import binomtest

    return float(binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson").high)


def paired_interval(golden: Sequence[float], candidate: Sequence[float],
                    confidence: float) -> tuple[float, float, float, str]:
    """(difference, low, high, method) of candidate accuracy minus golden accuracy on paired
    outcomes (1/0 per prompt, or a sampled prompt's share of right samples)."""
    n = len(golden)
    diffs = [c - g for g, c in zip(golden, candidate)]
    mean = sum(diffs) / n
    if len(set(diffs)) == 1:
        # Every prompt moved by the same d (0: none changed): no spread to measure, yet n prompts
        # are not certainty. A prompt not seen may differ by anything in [-1, 1], and does with
        # probability at most Wilson's upper bound u of 0 of n: d - u(1 + d) to d + u(1 - d)
        # (plus or minus u when d = 0). Never a zero-width interval: one gained answer, or every
        # prompt one sample worse on a handful of prompts, is not a certain pass.
        u = _wilson_high(0, n, confidence)
        how = ("no prompt changed its answer" if mean == 0 else
               f"every answered prompt changed by the same {mean:+.3g}")
        return mean, mean - u * (1 + mean), mean + u * (1 - mean), (
            f"{how}: the Wilson upper bound of a differing prompt, 0 of {n} (scipy.stats.binomtest), "
            "times the furthest a prompt's difference could go")
    from scipy.stats import ttest_rel

    ci = ttest_rel(list(candidate), list(golden)).confidence_interval(confidence_level=confidence)
    return mean, float(ci.low), float(ci.high), "paired t interval of the per-prompt differences (scipy.stats.ttest_rel)"


def prompts_needed(golden: Sequence[float], candidate: Sequence[float], theta: float, confidence: float,
                   power: float) -> int | None:
    """Answered prompts at which a check with this discordance and difference would show
    non-inferiority (the interval's lower bound above -theta) with probability ``power``:
    n = ((z_{(1+confidence)/2} + z_power) x sd / (theta + difference))^2, sd the per-prompt
    differences' standard deviation. None when the difference is at or past -theta (no number of
    prompts shows a candidate that much worse to be within it). With no discordant prompt, the
    smallest n whose Wilson bound of 0 of n is below theta."""
    n = len(golden)
    diffs = [c - g for g, c in zip(golden, candidate)]
    mean = sum(diffs) / n
    if theta + mean <= 0:
        return None
    if len(set(diffs)) == 1:
        # paired_interval's bound mean - u(1 + mean) is above -theta when u < r = (theta + mean) / (1 + mean);
        # Wilson's upper bound of 0 of m is z^2 / (m + z^2): below r from m > z^2 (1 - r) / r.
        r = (theta + mean) / (1 + mean)
        z2 = _z((1 + confidence) / 2) ** 2
        return math.floor(z2 * (1 - r) / r) + 1
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 1.0
    z = _z((1 + confidence) / 2) + _z(power)
    return math.ceil((z * sd / (theta + mean)) ** 2)


def _mcnemar(lost: int, gained: int) -> float:
    if lost + gained == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(lost, lost + gained, 0.5).pvalue)


def _pts(v: float) -> str:
    return f"{v * 100:+.1f}"


def _count(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}"


def judge_quality(answers: Sequence[tuple[str, list[str], float, float]], t: Any,
                  sampled_ids: Collection[str] = ()) -> QualityVerdict | None:
    """The quality verdict of the answered prompts: (prompt id, tags, golden score, candidate score)
    each, in prompt set order; a score is 1 (right) or 0, or a sampled prompt's share of right
    samples (:attr:`regress.records.AnswerCheck.golden_score`; ``sampled_ids`` names those). None
    without any."""
    if not answers:
        return None
    theta, conf = t.quality_theta, t.confidence
    g = [float(a[2]) for a in answers]
    c = [float(a[3]) for a in answers]
    n = len(answers)
    sampled = sum(1 for a in answers if a[0] in sampled_ids)
    diff, low, high, method = paired_interval(g, c, conf)
    lost = sum(1 for x, y in zip(g, c) if y < x)
    gained = sum(1 for x, y in zip(g, c) if y > x)
    slices = _slices(answers, t)
    worse = [s.tag for s in slices if s.worse]
    shown = (f"accuracy {_count(sum(c))}/{n} against the golden's {_count(sum(g))}/{n}: {_pts(diff)} points "
             f"({conf:.0%} interval {_pts(low)} to {_pts(high)}; {lost} lost, {gained} gained)")
    needed = None
    if worse:
        verdict = "fail"
        reasons = [f"slice(s) significantly worse: " + ", ".join(
            f"'{s.tag}' {_pts(s.difference)} points ({s.lost} lost, {s.gained} gained, Holm p = {s.p_adjusted:.2g})"
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


def _slices(answers: Sequence[tuple[str, list[str], float, float]], t: Any) -> list[QualitySlice]:
    from regress.stats import holm

    tags: dict[str, list[tuple[float, float]]] = {}
    for _, prompt_tags, g, c in answers:
        for tag in dict.fromkeys(prompt_tags):
            tags.setdefault(tag, []).append((float(g), float(c)))
    kept = {tag: rows for tag, rows in tags.items() if len(rows) >= t.quality_min_slice}
    raw = []
    for tag, rows in kept.items():
        g, c = [r[0] for r in rows], [r[1] for r in rows]
        diff, low, high, _ = paired_interval(g, c, t.confidence)
        lost = sum(1 for x, y in rows if y < x)
        gained = sum(1 for x, y in rows if y > x)
        raw.append((tag, rows, g, c, diff, low, high, lost, gained, _mcnemar(lost, gained)))
    adjusted = holm([r[-1] for r in raw]) if raw else []
    return [QualitySlice(tag=tag, prompts=len(rows), golden_correct=sum(g), candidate_correct=sum(c), lost=lost,
                         gained=gained, difference=diff, low=low, high=high, p_value=p, p_adjusted=p_adj,
                         worse=bool(p_adj < 1 - t.confidence and lost > gained))
            for (tag, rows, g, c, diff, low, high, lost, gained, p), p_adj in zip(raw, adjusted)]
