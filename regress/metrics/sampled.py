"""Sampled prompts: golden and candidate compared as distributions, not token by token.

A prompt with ``samples: N`` (temperature > 0) is run N times on each side, sample k with a seed
derived from the prompt id (:func:`regress.replay.plan.sample_seed`). Two samples of a sampling
model are not meant to be equal, so this metric looks at the N samples of each side together:

- **How likely the samples are.** vLLM reports the *raw* model logprob of every sampled token
  (before temperature, top-p and penalties: ``logprobs_mode`` ``raw_logprobs``), so the mean
  logprob per token of a side's samples says how far into the model's tail its sampling reaches.
  A hotter temperature or a wider top-p lowers it, a narrower top-p raises it, and a changed model
  moves it too. Each sample's mean is one observation; the two sides' N observations are compared
  with a two-sided Mann-Whitney U test (scipy), so a shift counts only when it is beyond what N
  samples of the same distribution show (``sampled_alpha``) *and* larger than a size that matters
  (``sampled_benign_shift`` / ``sampled_regression_shift``, nat per token).

  The candidate's samples are judged by the *golden's* model: after the candidate's replay, the
  baseline is fed each candidate sample teacher-forced (``<run>/golden-scored/``,
  :func:`regress.replay.plan.plan_golden_scoring`), so both sides' samples are scored by the same
  model and a shift is the sampler's doing or the candidate model's, never a scorer's. A replay
  without those scores (made by hand without the baseline) falls back to the candidate's own
  logprobs, which is the same thing when both run the same weights; ``sample_scored_by`` says which.
  ``sample_likely_share`` is the share of candidate samples at least as likely per token as the
  golden's least likely one.
- **How varied they are**: distinct outputs among the N on each side.
- **What they say**: the mean embedding cosine between golden and candidate samples (all N x N
  pairs) against the mean between two golden samples; the gap (golden-golden minus
  golden-candidate) is near 0 when both sides say the same kind of thing.

The teacher-forced measures (mean over the golden's N samples) and expected answers (success rate
on each side with an interval for the difference) are added when the samples are put together
into one row per prompt (:func:`regress.scoring.score_runs`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from regress.metrics.base import SEMANTIC_MODEL, Aggregate, Output, Pair, Rule, Setting, Values, metric
from regress.metrics.spec import Findings
from regress.records import prompt_of_sample

SAMPLED_BENIGN_SHIFT = Setting(
    "sampled_benign_shift", 0.15, ge=0,
    doc="Sampled prompts: a shift of the samples' mean logprob per token (nat) at most this is benign, and so "
        "is a larger one that the Mann-Whitney test does not find (p >= sampled_drift_alpha). Reseeded "
        "SmolLM2-135M samples at temperature 0.8 (8 per prompt) shifted by up to 0.6 nat with p >= 0.005 "
        "(docs/verdicts.md).")
SAMPLED_REGRESSION_SHIFT = Setting(
    "sampled_regression_shift", 0.4, ge=0,
    doc="Sampled prompts: a shift of the samples' mean logprob per token (nat) above this with Mann-Whitney "
        "p below sampled_alpha is a regression. Temperature 1.3 against 0.8 on SmolLM2-135M: -3 to -5 nat.")
SAMPLED_ALPHA = Setting(
    "sampled_alpha", 0.001, ge=0, le=1,
    doc="Sampled prompts: a logprob shift is a regression only with a two-sided Mann-Whitney U p-value below "
        "this (8 samples a side reach 0.00016 at best; a one-in-a-thousand chance per prompt under no change).")
SAMPLED_DRIFT_ALPHA = Setting(
    "sampled_drift_alpha", 0.05, ge=0, le=1,
    doc="Sampled prompts: a logprob shift above sampled_benign_shift with p below this is drift (worth a look).")
SAMPLED_BENIGN_SEMANTIC_GAP = Setting(
    "sampled_benign_semantic_gap", 0.15, ge=0, le=2,
    doc="Sampled prompts: golden-golden minus golden-candidate mean embedding cosine at most this is benign "
        "(reseeded SmolLM2 samples: -0.13 to 0.13).")
SAMPLED_REGRESSION_SEMANTIC_GAP = Setting(
    "sampled_regression_semantic_gap", 0.3, ge=0, le=2,
    doc="Sampled prompts: golden-golden minus golden-candidate mean embedding cosine above this is a regression "
        "(temperature 1.3 against 0.8 on SmolLM2: 0.15 to 0.51).")

_OUTPUTS = [
    Output("samples", "samples per side of a sampled prompt (temperature > 0, `samples:`)", label="samples",
           format="int"),
    Output("distinct_golden", "distinct outputs among the golden's samples", label="distinct golden", format="int"),
    Output("distinct_candidate", "distinct outputs among the candidate's samples", label="distinct candidate",
           format="int"),
    Output("sample_logprob_golden", "mean raw logprob per token of the golden's samples (golden engine)",
           label="golden logprob/token"),
    Output("sample_logprob_candidate", "mean raw logprob per token of the candidate's samples, as the golden's model "
           "scores them (else the candidate's own engine: sample_scored_by)", label="candidate logprob/token"),
    Output("sample_likely_share", "share of the candidate's samples at least as likely per token as the golden's "
           "least likely sample", label="likely share", format="pct", better="higher"),
    Output("sample_scored_by", "whose model scored the candidate's samples: 'golden' (the baseline fed them "
           "teacher-forced, golden-scored/) or 'candidate' (its own logprobs, when the replay has no golden scores)"),
    Output("sample_logprob_shift", "candidate minus golden mean logprob per token of their samples: below 0, the "
           "candidate samples less likely tokens (hotter, wider top-p); above 0, likelier ones",
           label="logprob shift", headline=20,
           aggregate=Aggregate("mean", key="mean_sample_logprob_shift", label="sampled logprob shift", rank=80,
                               doc="mean over sampled prompts of the candidate-minus-golden logprob per token",
                               shown_empty=False)),
    Output("sample_logprob_p", "two-sided Mann-Whitney U p-value of the two sides' per-sample mean logprobs",
           label="shift p", format="num"),
    Output("sample_semantic_golden", "mean embedding cosine between two golden samples", label="golden-golden cosine"),
    Output("sample_semantic_cross", "mean embedding cosine between a golden and a candidate sample",
           label="golden-candidate cosine"),
    Output("sample_semantic_gap", "golden-golden minus golden-candidate mean cosine: about 0 when both sides say "
           "the same kind of thing", label="semantic gap", format="num", better="lower", headline=25),
]
_NAMES = [o.name for o in _OUTPUTS]
GROUP_VALUES = tuple(_NAMES)
"""The values this metric gives a sampled prompt (the same on each of its samples' rows)."""


def _distribution(values: Mapping[str, Any], t: Any) -> Findings:
    """Regression and not-benign reasons of a sampled prompt's distribution measures."""
    regression: list[str] = []
    not_benign: list[str] = []
    shift, p = values.get("sample_logprob_shift"), values.get("sample_logprob_p")
    if isinstance(shift, (int, float)) and isinstance(p, (int, float)):
        size = abs(shift)
        way = "less" if shift < 0 else "more"
        text = (f"candidate samples are {way} likely: logprob per token {shift:+.3f} nat against the golden's "
                f"samples (Mann-Whitney p = {p:.2g})")
        if size > t.sampled_regression_shift and p < t.sampled_alpha:
            regression.append(f"{text}: beyond {t.sampled_regression_shift} at p < {t.sampled_alpha}")
        elif size > t.sampled_benign_shift and p < t.sampled_drift_alpha:
            not_benign.append(f"{text}: beyond {t.sampled_benign_shift} at p < {t.sampled_drift_alpha}")
    gap = values.get("sample_semantic_gap")
    if isinstance(gap, (int, float)):
        text = (f"candidate samples mean something else: golden-candidate cosine "
                f"{values.get('sample_semantic_cross', float('nan')):.2f} against golden-golden "
                f"{values.get('sample_semantic_golden', float('nan')):.2f}")
        if gap > t.sampled_regression_semantic_gap:
            regression.append(f"{text} (gap {gap:.2f} > {t.sampled_regression_semantic_gap})")
        elif gap > t.sampled_benign_semantic_gap:
            not_benign.append(f"{text} (gap {gap:.2f} > {t.sampled_benign_semantic_gap})")
    return regression, not_benign


DISTRIBUTION_RULE = Rule(
    "sampled_distribution",
    "sampled prompts: a significant shift of how likely the samples are, or of what they mean",
    _distribution,
    settings=(SAMPLED_BENIGN_SHIFT, SAMPLED_REGRESSION_SHIFT, SAMPLED_ALPHA, SAMPLED_DRIFT_ALPHA,
              SAMPLED_BENIGN_SEMANTIC_GAP, SAMPLED_REGRESSION_SEMANTIC_GAP),
)


def sample_of(pair: Pair) -> tuple[int, int] | None:
    """(sample number, samples) of a pair's golden entry; None for a prompt run once."""
    data = pair.golden.sampling_data
    n = data.get("samples")
    if not n:
        return None
    return int(data.get("sample") or 0), int(n)


def _mean_logprob(track: Any) -> float | None:
    lp = np.asarray(track.token_logprobs, dtype=np.float64)
    lp = lp[np.isfinite(lp)]
    return float(lp.mean()) if lp.size else None


def _mann_whitney(a: list[float], b: list[float]) -> float | None:
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy.stats import mannwhitneyu

    if len(set(a) | set(b)) == 1:
        return 1.0
    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


class _Texts:
    """A golden/candidate text pair in the shape the semantic metric scores (``.golden.text``)."""

    class _T:
        __slots__ = ("text",)

        def __init__(self, text: str):
            self.text = text

    def __init__(self, a: str, b: str):
        self.golden, self.candidate = self._T(a), self._T(b)


def _candidate_track(pair: Pair) -> tuple[Any, bool]:
    """The logprobs of a candidate sample to judge it by: the golden model's (teacher-forced,
    ``golden-scored``) when the replay made them, else the candidate's own; and which."""
    scored = pair.golden_scored
    if scored is not None and scored.teacher_forced is not None and \
            len(scored.teacher_forced.token_ids) == len(pair.candidate.output_token_ids):
        return scored.teacher_forced, True
    return pair.candidate.free_run, False


def group_values(group: list[Pair], similarity: Any) -> Values:
    """The distribution values of one sampled prompt from its samples' pairs (in sample order)."""
    tracks = [_candidate_track(p) for p in group]
    by_golden = all(found for _, found in tracks)
    cand_tracks = [t for t, _ in tracks] if by_golden else [p.candidate.free_run for p in group]
    golden_lp = [v for v in (_mean_logprob(p.golden.free_run) for p in group) if v is not None]
    cand_lp = [v for v in (_mean_logprob(t) for t in cand_tracks) if v is not None]

    def pooled(tracks: list[Any]) -> float | None:
        parts = [np.asarray(t.token_logprobs, dtype=np.float64) for t in tracks]
        lp = np.concatenate(parts) if parts else np.zeros(0)
        lp = lp[np.isfinite(lp)]
        return float(lp.mean()) if lp.size else None

    g_mean = pooled([p.golden.free_run for p in group])
    c_mean = pooled(cand_tracks)
    likely = None
    if golden_lp and cand_lp:
        least = min(golden_lp)
        likely = sum(1 for v in cand_lp if v >= least) / len(cand_lp)
    out: Values = {
        "samples": len(group),
        "distinct_golden": len({p.golden.output_token_ids.tobytes() for p in group}),
        "distinct_candidate": len({p.candidate.output_token_ids.tobytes() for p in group}),
        "sample_logprob_golden": g_mean,
        "sample_logprob_candidate": c_mean,
        "sample_logprob_shift": (c_mean - g_mean) if g_mean is not None and c_mean is not None else None,
        "sample_logprob_p": _mann_whitney(golden_lp, cand_lp),
        "sample_likely_share": likely,
        "sample_scored_by": "golden" if by_golden else "candidate",
        "sample_semantic_golden": None, "sample_semantic_cross": None, "sample_semantic_gap": None,
    }
    if similarity is not None:
        g = [p.golden.text for p in group]
        c = [p.candidate.text for p in group]
        within = [_Texts(g[i], g[j]) for i in range(len(g)) for j in range(i + 1, len(g))]
        cross = [_Texts(a, b) for a in g for b in c]
        sims = [v.get("semantic_similarity") for v in similarity(within + cross)]
        w, x = sims[: len(within)], sims[len(within):]
        if w and x and all(isinstance(v, float) for v in w + x):
            gw, gx = float(np.mean(w)), float(np.mean(x))
            out.update(sample_semantic_golden=gw, sample_semantic_cross=gx, sample_semantic_gap=gw - gx)
    for key, value in out.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
    return out


@metric("sampled", outputs=_OUTPUTS, batched=True, rules=[DISTRIBUTION_RULE],
        options={"model": SEMANTIC_MODEL})
def sampled(model: str | None = None, encoder: Any = None, cache_dir: Any = None) -> "callable":
    """Distribution measures of sampled prompts; prompts run once get nothing from it. The
    semantic part embeds with the semantic metric's own embedder (same model and caches)."""
    state: dict[str, Any] = {}

    def similarity(pairs: list[Any]) -> list[Values]:
        if "fn" not in state:
            from regress.metrics.semantic import semantic

            state["fn"] = semantic(model=model, encoder=encoder, cache_dir=cache_dir)
        return state["fn"](pairs)

    def score(pairs: list[Pair]) -> list[Values]:
        out: list[Values] = [{} for _ in pairs]
        groups: dict[str, list[int]] = {}
        for i, pair in enumerate(pairs):
            if sample_of(pair) is not None:
                groups.setdefault(prompt_of_sample(pair.prompt_id), []).append(i)
        for rows in groups.values():
            rows.sort(key=lambda i: sample_of(pairs[i])[0])  # type: ignore[index]
            values = group_values([pairs[i] for i in rows], similarity)
            for i in rows:
                out[i] = dict(values)
        return out

    return score


# --------------------------------------------------------------------------------------
# One row per prompt: a sampled prompt's samples put together
# --------------------------------------------------------------------------------------

CARRIED_METRICS = ("teacher_forced",)
"""Metrics whose per-sample values still mean something for a sampled prompt (each golden sample
fed to the candidate); the free-running comparisons of sample k with sample k do not."""


SUMMED = ("tf_positions", "tf_flips")
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
    from regress.scoring import aggregate

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


def _answers(unit: PromptUnit, expected: list[str]) -> tuple[int, int, str | None, str | None]:
    """(golden samples correct, candidate samples correct, first golden match, first candidate match)."""
    from regress.metrics.answers import matching_answer

    g = [matching_answer(p.golden.text, expected) for p in unit.pairs]
    c = [matching_answer(p.candidate.text, expected) for p in unit.pairs]
    return (sum(m is not None for m in g), sum(m is not None for m in c),
            next((m for m in g if m is not None), None), next((m for m in c if m is not None), None))


def sampled_class(unit: PromptUnit, klass: str, reasons: list[str], expected: list[str] | None,
                  t: Any) -> tuple[str, list[str], Any]:
    """A sampled prompt's class, reasons and answer check, from what :func:`~regress.verdict.classify`
    found on its row (teacher-forced bounds and the distribution rule).

    With ``expected`` answers, each side's success rate over its samples is compared with an
    interval for the difference (:func:`regress.stats.rate_difference`); a drop whose whole
    interval is below 0 is a regression. The answer check records the majority on each side (a
    prompt the golden mostly answers and the candidate mostly does not is a lost answer)."""
    from regress.records import AnswerCheck

    n = len(unit.pairs)
    row = unit.row
    answer = None
    if expected:
        from regress.stats import rate_difference

        k_golden, k_cand, g_match, c_match = _answers(unit, expected)
        diff, low, high = rate_difference(k_cand, n, k_golden, n, t.confidence)
        row.update(answer_rate_golden=k_golden / n, answer_rate_candidate=k_cand / n,
                   answer_rate_diff=diff, answer_rate_diff_low=low, answer_rate_diff_high=high)
        answer = AnswerCheck(expected=list(expected), golden_correct=2 * k_golden >= n, candidate_correct=2 * k_cand >= n,
                             golden_match=g_match, candidate_match=c_match)
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
                   f"semantic gap {_num(row.get('sample_semantic_gap'))}, distinct outputs "
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
    shifts = [float(v) for v in shifts if isinstance(v, (int, float))]
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
