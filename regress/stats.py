"""Interval statistics for the run verdict: how sure a regression or flip rate is, given the prompts.

Every interval is one of scipy's (``scipy.stats.binomtest(...).proportion_ci``, Wilson score) or a
combination of them (Newcombe's hybrid score interval for a difference of two rates); p-values are
scipy's exact binomial test. See docs/verdicts.md, "Statistics: intervals and how many prompts you
need", for the options that gate on them.

scipy is imported on first use: importing :mod:`regress` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

DEFAULT_CONFIDENCE = 0.95

STAT_FIELDS = ("confidence", "regression_rate", "regression_rate_low", "regression_rate_high", "flip_rate",
               "flip_rate_low", "flip_rate_high", "answer_flip_rate", "answer_flip_rate_low",
               "answer_flip_rate_high", "answer_mcnemar_p")
"""The :class:`~regress.records.RunMetrics` fields :func:`run_stats` returns."""


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")


def wilson(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float] | None:
    """Wilson score interval of the proportion ``k / n`` (two-sided, ``confidence``), from
    ``scipy.stats.binomtest(k, n).proportion_ci(confidence, method="wilson")``; None when ``n`` is 0."""
    if n == 0:
        return None
    _check_confidence(confidence)
    from scipy.stats import binomtest

    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` discordant pairs one way against ``c`` the other
    (answers lost against gained): ``binomtest(b, b + c, 0.5).pvalue``; 1.0 without discordant pairs."""
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(int(b), int(b + c), 0.5).pvalue)


def rate_difference(k1: int, n1: int, k2: int, n2: int,
                    confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float, float] | None:
    """``p1 - p2`` of two independent proportions ``p1 = k1/n1``, ``p2 = k2/n2`` with Newcombe's
    hybrid score interval (Newcombe 1998, method 10), built from scipy's Wilson intervals
    ``(l1, u1)`` of ``p1`` and ``(l2, u2)`` of ``p2`` at the same confidence::

        d     = p1 - p2
        low   = d - sqrt((p1 - l1)**2 + (u2 - p2)**2)
        high  = d + sqrt((u1 - p1)**2 + (p2 - l2)**2)

    Returns ``(d, low, high)``, or None when either ``n`` is 0."""
    a, b = wilson(k1, n1, confidence), wilson(k2, n2, confidence)
    if a is None or b is None:
        return None
    p1, p2 = k1 / n1, k2 / n2
    (l1, u1), (l2, u2) = a, b
    d = p1 - p2
    return d, d - math.hypot(p1 - l1, u2 - p2), d + math.hypot(u1 - p1, p2 - l2)


def fails_from(n: int, max_rate: float, confidence: float = DEFAULT_CONFIDENCE, *, start: int = 0) -> int | None:
    """The fewest of ``n`` prompts that, regressed, put the Wilson lower bound above ``max_rate``
    (what fails a run under ``max_regression_rate``); None when not even ``n`` of ``n`` do.
    ``start``: a count known not to be enough (the search begins there)."""
    for k in range(max(start, 0), n + 1):
        low = wilson(k, n, confidence)
        if low is not None and low[0] > max_rate:
            return k
    return None


def failure_probability(n: int, true_rate: float, max_rate: float, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """P(a run of ``n`` prompts fails ``max_regression_rate = max_rate``) when each prompt regresses
    independently with probability ``true_rate``: ``binom.sf(k - 1, n, true_rate)`` for the
    :func:`fails_from` count ``k`` (exact binomial, no simulation)."""
    from scipy.stats import binom

    k = fails_from(n, max_rate, confidence)
    return 0.0 if k is None else float(binom.sf(k - 1, n, true_rate))


def prompts_needed(max_rate: float, true_rate: float, *, power: float = 0.8,
                   confidence: float = DEFAULT_CONFIDENCE, limit: int = 100_000) -> int | None:
    """The fewest prompts at which a true regression rate ``true_rate`` fails a run gated on
    ``max_regression_rate = max_rate`` with probability ≥ ``power`` (:func:`failure_probability`,
    exact binomial). The probability is a saw-tooth in ``n`` (the failing count steps by whole
    prompts), so this is the smallest such ``n`` from which every larger one up to ``n + n // 4``
    also reaches ``power``. None when ``true_rate <= max_rate`` or beyond ``limit`` prompts."""
    if true_rate <= max_rate:
        return None
    from scipy.stats import binom

    k = 0
    ok: list[bool] = []
    first: int | None = None
    for n in range(1, limit + 1):
        found = fails_from(n, max_rate, confidence, start=k)
        if found is None:
            ok.append(False)
            continue
        k = found
        ok.append(float(binom.sf(k - 1, n, true_rate)) >= power)
        if ok[-1] and first is None:
            first = n
        if first is not None:
            if not ok[-1]:
                first = None
            elif n >= first + first // 4:
                return first
    return None


def run_stats(counts: Mapping[str, int], answers: Mapping[str, Any] | None = None,
              confidence: float = DEFAULT_CONFIDENCE) -> dict[str, Any]:
    """The interval fields of :class:`~regress.records.RunMetrics` (:data:`STAT_FIELDS`).

    ``counts``: prompts per class (``identical``, ``benign``, ``drift``, ``regression``,
    ``input_drift``) and optionally ``prompts`` (default: their sum). Comparable prompts are the
    prompts less the input drifts; the regression rate is regressions / comparable, the flip rate
    the comparable prompts whose output is not identical. ``answers``: the expected-answer counts
    under their RunMetrics names; the answer flip rate is (lost + gained) / answer prompts, and the
    McNemar p-value is the exact test of lost against gained. A rate without prompts is None.
    """
    classes = ("identical", "benign", "drift", "regression", "input_drift")
    prompts = counts.get("prompts")
    if prompts is None:
        prompts = sum(counts.get(k, 0) for k in classes)
    comparable = prompts - counts.get("input_drift", 0)
    regressions = counts.get("regression", 0)
    flips = comparable - counts.get("identical", 0)
    out: dict[str, Any] = {"confidence": confidence}

    def rate(name: str, k: int, n: int) -> None:
        ci = wilson(k, n, confidence) if n > 0 else None
        out[name] = k / n if n > 0 else None
        out[f"{name}_low"], out[f"{name}_high"] = ci if ci is not None else (None, None)

    rate("regression_rate", regressions, comparable)
    rate("flip_rate", flips, comparable)
    a = answers or {}
    n_answers = a.get("answer_prompts", 0)
    lost, gained = a.get("answer_flips_lost", 0), a.get("answer_flips_gained", 0)
    rate("answer_flip_rate", lost + gained, n_answers)
    out["answer_mcnemar_p"] = mcnemar_exact(lost, gained) if n_answers else None
    return out


def pct(value: float) -> str:
    """A rate as a percentage for reasons and pages: one decimal ('2.4'), more below 0.1 %."""
    x = value * 100
    if 0 < abs(x) < 0.1:
        return f"{x:.2g}"
    return f"{x:.1f}"


def interval_text(rate: float, low: float, high: float, confidence: float) -> str:
    """'2.4 % (95 % CI 1.6–3.6 %)'."""
    return f"{pct(rate)} % ({confidence * 100:g} % CI {pct(low)}–{pct(high)} %)"


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
