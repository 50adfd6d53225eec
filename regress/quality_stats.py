"""The quality verdict's statistics: an accuracy difference's interval, and which slices are worse.

Used by :mod:`regress.quality`.

**The interval.** Each answered prompt scores 1 or 0 on each side (a sampled prompt: its share of
right samples), and the candidate's accuracy minus the golden's is g - l, the rates of what it
gained and what it lost (per prompt, the positive and the negative part of its change). The
interval is MOVER (Zou and Donner's method of variance estimates recovery) on that difference,
with Wilson score limits for each rate and their multinomial correlation. It replaces the paired
t interval, which was not monotone: with no prompt changed it is plus or minus Wilson's bound,
and one lost answer switched it to a t interval that was *narrower* (a candidate that lost an
answer passed where the identical one was inconclusive); three sampled prompts each one sample
worse had a spread so small that the interval excluded 0 with certainty; and float rounding of
equal shares decided which of the two was used. Here the lower bound falls with every answer
lost and rises with every answer gained, whatever the set, and no change is plus or minus Wilson's
bound of 0 of n. Fractional scores enter the rates as fractional counts: a share varies less than
a right-or-wrong answer with the same mean, so the interval is, if anything, wide for them.

**The slices.** A tag's answered prompts are *significantly worse* when they lost answers beyond
chance and materially: a one-sided exact sign test of the prompts that got worse against those
that got better (exact McNemar when each prompt is answered once), and a difference past
-``theta`` (the margin the whole set is held to). The slices are corrected for multiplicity by
Tarone's rule: a slice whose most extreme outcome (every answer the golden got right lost) could
not reach significance at the corrected level, or could not be materially worse (the golden right
on at most ``theta`` of it), is not counted, and the rest are tested at level alpha / K (K of them,
the smallest K with at most K slices able to reach alpha / K). K depends on the golden alone, so one
slice's verdict never depends on what the candidate did in another: a slice that got better
cannot make another fail, untouched slices do not dilute the test, and more losses in a slice
only ever push it towards worse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def z_of(confidence: float) -> float:
    """The two-sided normal quantile of ``confidence``."""
    from scipy.stats import norm

    return float(norm.ppf((1 + confidence) / 2))


def wilson(count: float, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of a rate ``count`` / ``n`` (``count`` may be fractional), clipped to [0, 1]."""
    p = count / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def gains_and_losses(golden: Sequence[float], candidate: Sequence[float]) -> tuple[float, float]:
    """(gained, lost): the sums of the positive and of the negative per-prompt changes."""
    diffs = [c - g for g, c in zip(golden, candidate)]
    return sum(d for d in diffs if d > 0), -sum(d for d in diffs if d < 0)


def mover_interval(gained: float, lost: float, n: int, z: float) -> tuple[float, float, float]:
    """(difference, low, high) of (gained - lost) / n: MOVER with Wilson limits on both rates and
    their correlation as cells of one multinomial (negative: a prompt cannot be both)."""
    g, l = gained / n, lost / n
    g_low, g_high = wilson(gained, n, z)
    l_low, l_high = wilson(lost, n, z)
    r = -math.sqrt(g * l / ((1 - g) * (1 - l))) if 0 < g < 1 and 0 < l < 1 else 0.0
    d = g - l
    below = math.sqrt(max((g - g_low) ** 2 + (l_high - l) ** 2 - 2 * r * (g - g_low) * (l_high - l), 0.0))
    above = math.sqrt(max((g_high - g) ** 2 + (l - l_low) ** 2 - 2 * r * (g_high - g) * (l - l_low), 0.0))
    return d, max(-1.0, d - below), min(1.0, d + above)


METHOD = ("MOVER on the rates of answers gained and lost, each with its Wilson score interval "
          "(their multinomial correlation included)")


def paired_interval(golden: Sequence[float], candidate: Sequence[float],
                    confidence: float) -> tuple[float, float, float, str]:
    """(difference, low, high, method) of candidate accuracy minus golden accuracy on paired
    outcomes (1/0 per prompt, or a sampled prompt's share of right samples)."""
    gained, lost = gains_and_losses(golden, candidate)
    d, low, high = mover_interval(gained, lost, len(golden), z_of(confidence))
    return d, low, high, METHOD


def sign_test_worse(lost: int, gained: int) -> float:
    """One-sided exact sign test that prompts got worse more often than better (1.0 when none got worse)."""
    if lost == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(lost, lost + gained, 0.5, alternative="greater").pvalue)


@dataclass(frozen=True)
class SliceTest:
    """One slice's test: its one-sided p, the slices it is corrected for, and whether it is worse."""

    p_value: float
    p_adjusted: float
    tested: bool
    """Counted in the correction: its most extreme outcome could be significantly and materially worse."""
    worse: bool


def most_extreme_p(golden: Sequence[float], theta: float) -> float | None:
    """The smallest one-sided sign-test p the slice could give (every prompt the golden scored on
    lost, none gained); None when even that would not be materially worse (the golden's accuracy
    there at most ``theta``)."""
    if not golden or sum(golden) / len(golden) <= theta:
        return None
    return 0.5 ** sum(1 for g in golden if g > 0)


def tarone_count(smallest: Sequence[float | None], alpha: float) -> int:
    """Tarone's K: the smallest K >= 1 such that at most K slices could reach ``alpha`` / K."""
    possible = [p for p in smallest if p is not None]
    k = 1
    while sum(1 for p in possible if p < alpha / k) > k:
        k += 1
    return k


def slice_tests(slices: Sequence[tuple[Sequence[float], int, int, float]], theta: float,
                confidence: float) -> list[SliceTest]:
    """Each slice's test, from (golden scores, lost, gained, difference) per slice: worse when its
    Tarone-corrected one-sided p is below 1 - ``confidence`` and its difference is past -``theta``."""
    alpha = 1 - confidence
    smallest = [most_extreme_p(golden, theta) for golden, *_ in slices]
    k = tarone_count(smallest, alpha)
    tests = []
    for (golden, lost, gained, difference), p_min in zip(slices, smallest):
        p = sign_test_worse(lost, gained)
        tested = p_min is not None and p_min < alpha / k
        p_adj = min(1.0, p * k) if tested else 1.0
        tests.append(SliceTest(p_value=p, p_adjusted=p_adj, tested=tested,
                               worse=bool(tested and p_adj < alpha and difference < -theta)))
    return tests
