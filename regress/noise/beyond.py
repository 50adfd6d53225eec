"""Is the run as a whole beyond the baseline's own noise? The run-level fidelity test.

Per-prompt rules with fixed thresholds judge one prompt at a time, so a run verdict built on them
alone hangs on whether some single prompt happens to overturn a confident choice: a small change
can fail while one ten times larger passes. This test looks at the whole run instead.

For every comparable prompt, each measure of the candidate (teacher-forced KL, top-1 disagreement,
the largest golden margin it overturned) is paired with the same measure's *envelope* on the same
prompt: the worst any noise arm did there (``golden/noise.json``, :mod:`regress.noise.floor`). The
one-sided Wilcoxon signed-rank test (``scipy.stats.wilcoxon``) asks whether the candidate's excess
over the envelope is positive more consistently than chance allows; the three p-values are
Holm-corrected. A measure is *beyond the noise* when its corrected p-value is below ``alpha`` and
the candidate's mean is at least ``min_ratio`` times the envelope's: significant and material.
Paired by prompt, the test sees a change the size of the noise on easy and hard prompts alike,
where a comparison of pooled values would drown it in the prompts' own spread.

A signed-rank test over the whole run cannot see damage on a minority of prompts: 10 of 100
prompts that each overturn a 2.5-nat choice the baseline never overturned leave 90 exact zeros,
and the run reads "within". So a fourth test counts the *regressed prompts*: the prompts the
candidate regressed on where no noise arm regressed (``PromptNoise.regressed``) against the
prompts some arm regressed on where the candidate did not, one-sided exact McNemar (a binomial
test of the discordant prompts). All four p-values are Holm-corrected together. The count is beyond
the noise only when it is significant, material (at least ``min_ratio`` times the prompts the
noise regressed on) and more than ``max_regressions`` prompts regressed where no arm did.

The envelope is the worst of every arm, so a candidate that is itself another draw of the noise
sits below it on most prompts and passes (each arm scored against the others' envelope, as
``regress power`` does, shows the margin). How the test combines with the per-prompt classes into
the run verdict: :func:`regress.verdict.run_verdict`; the measured figures: docs/verdicts.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from regress.noise.floor import NoiseFloor, PromptNoise
from regress.noise.record import MeasureTest, NoiseTest, min_testable
from regress.stats import holm

@dataclass(frozen=True)
class Measure:
    """A per-prompt measure the test compares: higher is further from the golden on both sides.
    Both readers take the thresholds in force (the resolutions below which a difference is none)."""

    name: str
    label: str
    candidate: Callable[[Mapping[str, Any], Any], float | None]
    """From a prompt's metric values."""
    envelope: Callable[[PromptNoise, Any], float | None]
    """From the prompt's noise envelope."""
    shown: Callable[[float], str]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _kl(value: Any, t: Any) -> float | None:
    # Below the resolution a KL is no difference at all: a float32 baseline's own noise is ~1e-13
    # nat, and a change of 1e-12 is not a change any output can show.
    v = _number(value)
    return None if v is None else max(v, t.noise_kl_resolution)


def _beyond_tie(margin: Any, t: Any) -> bool:
    """Some overturned golden choice was not a coin toss (its margin at least ``near_tie_margin``)."""
    v = _number(margin)
    return v is not None and v >= t.near_tie_margin


def _disagreement(same: Any, margin: Any, t: Any) -> float | None:
    # Flips at near-ties only are coin tosses, whichever side makes them: no disagreement.
    v = _number(same)
    if v is None:
        return None
    return 1.0 - v if _beyond_tie(margin, t) else 0.0


def _flipped(row: Mapping[str, Any], t: Any) -> float | None:
    # None means no position flipped: nothing overturned, a margin of 0. Scored prompts only.
    if not row.get("tf_positions"):
        return None
    v = row.get("tf_max_flipped_margin")
    return _number(v) if _beyond_tie(v, t) else 0.0


def _flipped_envelope(p: PromptNoise, t: Any) -> float | None:
    if p.tf_kl_mean is None:  # the arms did not teacher-force it
        return None
    return p.tf_max_flipped_margin if _beyond_tie(p.tf_max_flipped_margin, t) else 0.0


MEASURES: tuple[Measure, ...] = (
    Measure("tf_kl_mean", "teacher-forced KL", lambda row, t: _kl(row.get("tf_kl_mean"), t),
            lambda p, t: _kl(p.tf_kl_mean, t), lambda v: f"{v:.3g} nat"),
    Measure("tf_disagreement", "top-1 disagreement beyond near-ties",
            lambda row, t: _disagreement(row.get("tf_same_top1_rate"), row.get("tf_max_flipped_margin"), t),
            lambda p, t: _disagreement(p.tf_same_top1_rate, p.tf_max_flipped_margin, t), lambda v: f"{v:.2%}"),
    Measure("tf_max_flipped_margin", "largest overturned golden margin beyond near-ties", _flipped, _flipped_envelope,
            lambda v: f"{v:.3g} nat"),
)


EXACT_UP_TO = 50
"""Set sizes whose signed-rank p-value is exact (scipy's own bound for its exact method)."""


def signed_rank(excess: Sequence[float]) -> tuple[float, float, float]:
    """(W+, one-sided p-value, rank-biserial effect) of the excesses (candidate - envelope), testing
    whether they lean positive. Zeros are split between the signs (``zero_method="zsplit"``), so
    prompts where both sides are exactly alike pull the test towards "within"."""
    if not any(d > 0 for d in excess):
        return 0.0, 1.0, -1.0 if any(d < 0 for d in excess) else 0.0
    from scipy.stats import rankdata, wilcoxon

    # One method per set size, never one chosen by the data: scipy's "auto" is exact without
    # zeros and the normal approximation with one, so a prompt's excess rising to exactly 0
    # raised p (a candidate with more damage could pass where one with less failed). Exact up to
    # EXACT_UP_TO prompts (its cost grows as n^3: 0.1 s at 476, 12 s at 2,000), the approximation
    # above, where the two agree to a few in a thousand.
    method = "exact" if len(excess) <= EXACT_UP_TO else "asymptotic"
    result = wilcoxon(excess, alternative="greater", zero_method="zsplit", method=method)
    ranks = rankdata([abs(d) for d in excess])
    plus = float(sum(r for r, d in zip(ranks, excess) if d > 0))
    minus = float(sum(r for r, d in zip(ranks, excess) if d < 0))
    effect = (plus - minus) / (plus + minus) if plus + minus else 0.0
    return float(result.statistic), float(result.pvalue), effect


def paired(rows: Mapping[str, Mapping[str, Any]], envelopes: Mapping[str, PromptNoise],
           measure: Measure, t: Any) -> tuple[list[str], list[float], list[float]]:
    """(prompt ids, candidate values, envelope values) of the prompts where both sides have ``measure``."""
    ids, cand, noise = [], [], []
    for pid, row in rows.items():
        env = envelopes.get(pid)
        c = measure.candidate(row, t)
        e = measure.envelope(env, t) if env is not None else None
        if c is not None and e is not None:
            ids.append(pid)
            cand.append(c)
            noise.append(e)
    return ids, cand, noise


def _ratio(candidate_mean: float, noise_mean: float) -> float | None:
    return candidate_mean / noise_mean if noise_mean > 0 else None


REGRESSED = "regressed_prompts"
"""The fourth measure: the share of prompts that regressed (:func:`regressed_prompts`)."""
REGRESSED_LABEL = "prompts regressed where no noise arm did"


def envelope_regresses(p: PromptNoise, t: Any) -> bool:
    """Whether the prompt's envelope, judged by the thresholds in force now, is a regression by
    the rules it holds the values of (teacher-forced KL and same-top-1, an overturned golden margin
    teacher-forced or at the first divergence). The arms' own classes (``PromptNoise.regressed``)
    were decided by the thresholds of the day the floor was measured: tightened since, the noise
    would look cleaner than it is and a candidate that is that noise again would fail."""
    def over(value: float | None, bound: float) -> bool:
        return value is not None and value > bound

    return (over(p.tf_kl_mean, t.regression_kl)
            or (p.tf_same_top1_rate is not None and p.tf_same_top1_rate < t.regression_same_top1)
            or (p.tf_max_flipped_margin is not None and p.tf_max_flipped_margin >= t.confident_margin)
            or (p.golden_margin is not None and p.golden_margin >= t.confident_margin))


def regressed_prompts(ids: Collection[str], regressed: Collection[str],
                      envelopes: Mapping[str, PromptNoise], t: Any) -> tuple[int, int, int, int]:
    """(candidate regressed, noise regressed, only the candidate, only the noise) over ``ids``:
    the prompts the candidate regressed on (``regressed``) and those some arm regressed on, as
    it was scored or as its envelope reads under ``t`` (:func:`envelope_regresses`)."""
    mine = {pid for pid in ids if pid in regressed}
    noise = {pid for pid in ids if pid in envelopes
             and (envelopes[pid].regressed or envelope_regresses(envelopes[pid], t))}
    return len(mine), len(noise), len(mine - noise), len(noise - mine)


def mcnemar_greater(only_candidate: int, only_noise: int) -> float:
    """One-sided exact McNemar p: how likely this many discordant prompts lean the candidate's way
    if a regression were as likely on either side (1.0 when none does). Pairing against the union
    of the arms makes it conservative: the noise side regresses wherever any arm did."""
    if only_candidate == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(only_candidate, only_candidate + only_noise, 0.5, alternative="greater").pvalue)


def _count_test(ids: Collection[str], regressed: Collection[str], envelopes: Mapping[str, PromptNoise],
                t: Any) -> tuple[dict[str, Any], float, bool]:
    """The regressed-prompts test's fields, its raw p and whether its size is material (beyond
    the noise once its Holm-adjusted p is below ``noise_alpha``)."""
    n = len(ids)
    mine, noise, only_mine, only_noise = regressed_prompts(ids, regressed, envelopes, t)
    p = mcnemar_greater(only_mine, only_noise)
    c_mean, n_mean = (mine / n, noise / n) if n else (0.0, 0.0)
    ratio = _ratio(c_mean, n_mean)
    material = ((ratio is None and mine > 0) or (ratio is not None and ratio >= t.noise_min_ratio)) \
        and only_mine > t.max_regressions
    fields = dict(measure=REGRESSED, label=REGRESSED_LABEL, prompts=n, candidate_mean=c_mean, noise_mean=n_mean,
                  ratio=ratio, above=only_mine, statistic=float(only_mine),
                  effect=(only_mine - only_noise) / (only_mine + only_noise) if only_mine + only_noise else 0.0)
    return fields, p, bool(material)


def compare_to_noise(rows: Mapping[str, Mapping[str, Any]], floor: NoiseFloor, t: Any,
                     regressed: Collection[str] = ()) -> NoiseTest | None:
    """The run-level test of the candidate's comparable prompts (``rows``: prompt id -> metric
    values, input-drift prompts already left out) against ``floor``, at the thresholds ``t``
    (``noise_alpha``, ``noise_min_ratio``, ``noise_kl_resolution``, ``near_tie_margin``,
    ``max_regressions``); ``regressed``: the ids among ``rows`` the candidate regressed on (their
    class under the floor's bounds). None when fewer than :func:`min_testable` prompts pair on
    some measure."""
    alpha, min_ratio = t.noise_alpha, t.noise_min_ratio
    envelopes = floor.by_id()
    found = []
    unpaired: set[str] = set()
    for measure in MEASURES:
        ids, cand, noise = paired(rows, envelopes, measure, t)
        found.append((measure, cand, noise))
        unpaired |= set(rows) - set(ids)
    if min(len(c) for _, c, _ in found) < min_testable(alpha):
        return None
    raw = []
    for measure, cand, noise in found:
        excess = [c - e for c, e in zip(cand, noise)]
        statistic, p, effect = signed_rank(excess)
        raw.append((measure, cand, noise, excess, statistic, p, effect))
    count_fields, count_p, count_material = _count_test(list(rows), regressed, envelopes, t)
    adjusted = holm([p for *_, p, _ in raw] + [count_p])
    tests = []
    for (measure, cand, noise, excess, statistic, p, effect), p_adj in zip(raw, adjusted):
        c_mean, n_mean = sum(cand) / len(cand), sum(noise) / len(noise)
        ratio = _ratio(c_mean, n_mean)
        material = (ratio is None and c_mean > 0) or (ratio is not None and ratio >= min_ratio)
        tests.append(MeasureTest(
            measure=measure.name, label=measure.label, prompts=len(cand), candidate_mean=c_mean,
            noise_mean=n_mean, ratio=ratio, above=sum(1 for d in excess if d > 0), statistic=statistic,
            p_value=p, p_adjusted=p_adj, effect=effect, beyond=bool(p_adj < alpha and material)))
    tests.append(MeasureTest(**count_fields, p_value=count_p, p_adjusted=adjusted[-1],
                             beyond=bool(adjusted[-1] < alpha and count_material)))
    left_out = len(unpaired)
    beyond = any(t.beyond for t in tests)
    return NoiseTest(alpha=alpha, min_ratio=min_ratio, measures=tests, left_out=left_out, beyond=beyond,
                     summary=summary(tests, beyond, alpha, min_ratio))


def ratio_text(t: MeasureTest) -> str:
    """The candidate's mean against the envelope's, in words."""
    if t.measure == REGRESSED:
        mine, noise = round(t.candidate_mean * t.prompts), round(t.noise_mean * t.prompts)
        return f"{t.above} (the candidate regressed on {mine}, the noise arms on {noise})"
    shown = next(m.shown for m in MEASURES if m.name == t.measure)
    if t.ratio is None:
        if t.candidate_mean == 0:
            return f"{shown(0.0)}, as in the noise"
        return f"{shown(t.candidate_mean)} where the noise is exactly 0"
    return f"{t.ratio:.2g}x the noise ({shown(t.candidate_mean)} vs {shown(t.noise_mean)})"


def describe(t: MeasureTest) -> str:
    """One measure's result in words."""
    if t.measure == REGRESSED:
        return f"{t.label}: {ratio_text(t)} of {t.prompts}, effect {t.effect:+.2f}, p = {t.p_adjusted:.2g}"
    return (f"{t.label} {ratio_text(t)}, above the envelope on {t.above} of {t.prompts} prompts, "
            f"effect {t.effect:+.2f}, p = {t.p_adjusted:.2g}")


def summary(tests: Sequence[MeasureTest], beyond: bool, alpha: float, min_ratio: float) -> str:
    """The test in one line: the deciding measure (the most significant beyond one, else the
    closest to it)."""
    pool = [t for t in tests if t.beyond] if beyond else list(tests)
    lead = min(pool, key=lambda t: (t.p_adjusted, tests.index(t)))
    if beyond:
        return f"beyond the baseline's noise: {describe(lead)} (< {alpha:g}, at least {min_ratio:g}x)"
    return f"within the baseline's noise: {describe(lead)} (beyond needs p < {alpha:g} and at least {min_ratio:g}x)"
