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
  model and a shift is the sampler's doing or the candidate model's, never a scorer's. That costs a
  second engine, so it is skipped where it can tell nothing: when the candidate's decode logprobs
  match the golden's on every entry, wherever both had the same context
  (:mod:`regress.metrics.sample_scorer`), its own logprobs of its samples are the baseline's and
  stand in. A replay without those scores
  (``--golden-scoring never``, or made by hand without the baseline) falls back to the
  candidate's own logprobs too; ``sample_scored_by`` says which, and the run's
  ``sample_scoring`` why.
  ``sample_likely_share`` is the share of candidate samples at least as likely per token as the
  golden's least likely one.
- **How varied they are**: distinct outputs among the N on each side.
- **What they say**: the mean embedding cosine between golden and candidate samples (all N x N
  pairs) against the mean between two golden samples; the gap (golden-golden minus
  golden-candidate) is near 0 when both sides say the same kind of thing. Like the logprob shift
  it counts only beyond chance: a permutation test over the splits of both sides' 2N samples
  into two groups of N (:func:`semantic_gap_p`).

The teacher-forced measures (mean over the golden's N samples) and expected answers (success rate
on each side with an interval for the difference) are added when the samples are put together
into one row per prompt; that, and the classes these measures lead to, is
:mod:`regress.metrics.sampled_policy`'s (called by :func:`regress.scoring.score_runs`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
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
    doc="Sampled prompts: golden-golden minus golden-candidate mean embedding cosine at most this is benign, "
        "and so is a larger one that the permutation test does not find (p >= sampled_drift_alpha; reseeded "
        "SmolLM2 samples: -0.13 to 0.13).")
SAMPLED_REGRESSION_SEMANTIC_GAP = Setting(
    "sampled_regression_semantic_gap", 0.3, ge=0, le=2,
    doc="Sampled prompts: golden-golden minus golden-candidate mean embedding cosine above this with a "
        "permutation p below sampled_alpha is a regression (temperature 1.3 against 0.8 on SmolLM2: 0.15 to 0.52).")

_OUTPUTS = [
    Output("samples", "samples per side of a sampled prompt (temperature > 0, `samples:`)", label="samples",
           format="int"),
    Output("distinct_golden", "distinct outputs among the golden's samples", label="distinct golden", format="int"),
    Output("distinct_candidate", "distinct outputs among the candidate's samples", label="distinct candidate",
           format="int"),
    Output("sample_logprob_golden", "mean raw logprob per token of the golden's samples (golden engine)",
           label="golden logprob/token"),
    Output("sample_logprob_candidate", "mean raw logprob per token of the candidate's samples, as the golden's model "
           "scores them (else the candidate's own engine: sample_scored_by)", label="candidate logprob/token",
           nonfinite="regression"),
    Output("sample_likely_share", "share of the candidate's samples at least as likely per token as the golden's "
           "least likely sample", label="likely share", format="pct", better="higher", nonfinite="regression"),
    Output("sample_scored_by", "whose model scored the candidate's samples: 'golden' (the baseline fed them "
           "teacher-forced, golden-scored/) or 'candidate' (its own logprobs: they matched the golden's, or the "
           "replay has no golden scores; the run's sample_scoring says which)"),
    Output("sample_logprob_shift", "candidate minus golden mean logprob per token of their samples: below 0, the "
           "candidate samples less likely tokens (hotter, wider top-p); above 0, likelier ones",
           label="logprob shift", headline=20, nonfinite="regression",
           aggregate=Aggregate("mean", key="mean_sample_logprob_shift", label="sampled logprob shift", rank=80,
                               doc="mean over sampled prompts of the candidate-minus-golden logprob per token",
                               shown_empty=False)),
    Output("sample_logprob_p", "two-sided Mann-Whitney U p-value of the two sides' per-sample mean logprobs",
           label="shift p", format="num", nonfinite="regression"),
    Output("sample_semantic_golden", "mean embedding cosine between two golden samples", label="golden-golden cosine"),
    Output("sample_semantic_cross", "mean embedding cosine between a golden and a candidate sample",
           label="golden-candidate cosine"),
    Output("sample_semantic_gap", "golden-golden minus golden-candidate mean cosine: about 0 when both sides say "
           "the same kind of thing", label="semantic gap", format="num", better="lower", headline=25),
    Output("sample_semantic_p", "permutation p-value of the semantic gap: the share of the ways to split both "
           "sides' samples into two groups of N whose gap is at least the observed one",
           label="gap p", format="num"),
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
    gap, gap_p = values.get("sample_semantic_gap"), values.get("sample_semantic_p")
    if isinstance(gap, (int, float)) and isinstance(gap_p, (int, float)):  # given together (group_values)
        text = (f"candidate samples mean something else: golden-candidate cosine "
                f"{values.get('sample_semantic_cross', float('nan')):.2f} against golden-golden "
                f"{values.get('sample_semantic_golden', float('nan')):.2f}")
        # As the logprob shift: a gap counts only when it is large *and* beyond what the same
        # distribution's samples show, split at random. A golden whose few samples happen to say
        # one thing ("Rome." four times) reads a large gap against any other draw of the same
        # model; the split test sees that its samples are no more alike than the two sides are.
        if gap > t.sampled_regression_semantic_gap and gap_p < t.sampled_alpha:
            regression.append(f"{text} (gap {gap:.2f} > {t.sampled_regression_semantic_gap}, "
                              f"permutation p = {gap_p:.2g} < {t.sampled_alpha})")
        elif gap > t.sampled_benign_semantic_gap and gap_p < t.sampled_drift_alpha:
            not_benign.append(f"{text} (gap {gap:.2f} > {t.sampled_benign_semantic_gap}, "
                              f"permutation p = {gap_p:.2g} < {t.sampled_drift_alpha})")
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


def _usable(lp: np.ndarray) -> np.ndarray:
    """Logprobs to average: -inf left out (a token reported as impossible), NaN kept, so that a
    broken logprob makes the measure NaN (a regression, :func:`regress.verdict.classify`) and is
    never averaged away."""
    return lp[~np.isneginf(lp)]


def _mean_logprob(track: Any) -> float | None:
    lp = _usable(np.asarray(track.token_logprobs, dtype=np.float64))
    return float(lp.mean()) if lp.size else None


def _mann_whitney(a: list[float], b: list[float]) -> float | None:
    if len(a) < 2 or len(b) < 2:
        return None
    if not all(math.isfinite(v) for v in a + b):
        return math.nan
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


def candidate_track(pair: Pair) -> tuple[Any, bool]:
    """The logprobs of a candidate sample to judge it by, and whether they are the golden model's:
    its teacher-forced scores (``golden-scored``) when the replay made them; the golden's own free
    run when the sample is the golden's (same prompt ids and tokens: the replay then skips
    scoring it); else the candidate's own."""
    scored = pair.golden_scored
    if scored is not None and scored.teacher_forced is not None and \
            len(scored.teacher_forced.token_ids) == len(pair.candidate.output_token_ids):
        return scored.teacher_forced, True
    g, c = pair.golden, pair.candidate
    if np.array_equal(g.prompt_token_ids, c.prompt_token_ids) and np.array_equal(g.output_token_ids,
                                                                                  c.output_token_ids):
        return g.free_run, True
    return pair.candidate.free_run, False


def group_values(group: list[Pair], similarity: Any) -> Values:
    """The distribution values of one sampled prompt from its samples' pairs (in sample order)."""
    tracks = [candidate_track(p) for p in group]
    by_golden = all(found for _, found in tracks)
    cand_tracks = [t for t, _ in tracks] if by_golden else [p.candidate.free_run for p in group]
    golden_lp = [v for v in (_mean_logprob(p.golden.free_run) for p in group) if v is not None]
    cand_lp = [v for v in (_mean_logprob(t) for t in cand_tracks) if v is not None]

    def pooled(tracks: list[Any]) -> float | None:
        parts = [np.asarray(t.token_logprobs, dtype=np.float64) for t in tracks]
        lp = _usable(np.concatenate(parts) if parts else np.zeros(0))
        return float(lp.mean()) if lp.size else None

    g_mean = pooled([p.golden.free_run for p in group])
    c_mean = pooled(cand_tracks)
    likely = None
    if golden_lp and cand_lp:
        if all(math.isfinite(v) for v in golden_lp + cand_lp):
            least = min(golden_lp)
            likely = sum(1 for v in cand_lp if v >= least) / len(cand_lp)
        else:
            likely = math.nan  # comparisons with NaN are false: a share of them would look like a number
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
        "sample_semantic_p": None,
    }
    if similarity is not None:
        texts = [p.golden.text for p in group] + [p.candidate.text for p in group]
        pairs = [(i, j) for i in range(len(texts)) for j in range(i + 1, len(texts))]
        sims = [v.get("semantic_similarity") for v in similarity([_Texts(texts[i], texts[j]) for i, j in pairs])]
        if len(group) >= 2 and all(isinstance(v, float) for v in sims):
            matrix = np.eye(len(texts))
            for (i, j), v in zip(pairs, sims):
                matrix[i, j] = matrix[j, i] = v
            within, cross = _within_cross(matrix, _observed(len(group)), len(group))
            gw, gx = float(within[0]), float(cross[0])
            out.update(sample_semantic_golden=gw, sample_semantic_cross=gx, sample_semantic_gap=gw - gx,
                       sample_semantic_p=semantic_gap_p(matrix, len(group)))
    return out


_EXACT_SPLITS = 20_000
"""Up to this many splits of the 2N samples the permutation test counts them all (N = 8: 12,870);
beyond, that many drawn at random with a fixed seed (the same scores give the same p)."""


def _observed(n: int) -> np.ndarray:
    """The split the scores hold: the golden's n samples (first) against the candidate's."""
    return (np.arange(2 * n) < n)[None, :].astype(np.float64)


def _within_cross(matrix: np.ndarray, splits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per split (0/1 rows of 2n, n ones): the mean cosine between two samples of the chosen
    group, and between a chosen sample and one of the rest."""
    off_diagonal = matrix - np.diag(np.diag(matrix))
    within = np.einsum("ki,ij,kj->k", splits, off_diagonal, splits) / (n * (n - 1))
    cross = np.einsum("ki,ij,kj->k", splits, matrix, 1.0 - splits) / (n * n)
    return within, cross


@functools.lru_cache(maxsize=8)
def _splits(n: int) -> np.ndarray:
    """Every way to pick n of 2n samples as one group (as 0/1 rows), or :data:`_EXACT_SPLITS` of
    them drawn with a fixed seed, the first n (the observed split) among them."""
    from itertools import combinations
    from math import comb

    size = 2 * n
    if comb(size, n) <= _EXACT_SPLITS:
        splits = np.zeros((comb(size, n), size))
        for row, chosen in enumerate(combinations(range(size), n)):
            splits[row, list(chosen)] = 1.0
        return splits
    order = np.random.default_rng(0).random((_EXACT_SPLITS, size)).argsort(axis=1)[:, :n]
    splits = np.zeros((_EXACT_SPLITS, size))
    np.put_along_axis(splits, order, 1.0, axis=1)
    splits[-1] = _observed(n)[0]
    return splits


def semantic_gap_p(matrix: np.ndarray, n: int) -> float:
    """Permutation p-value of the semantic gap: ``matrix`` holds the pairwise cosines of the 2n
    samples, the golden's first. Under no change the two sides' samples are one distribution's,
    so any n of them are as good a "golden" as the golden's own: p is the share of the splits
    (the observed one among them) whose gap is at least the observed gap."""
    if not np.isfinite(matrix).all():
        return math.nan  # a broken similarity (the embedder's, not the candidate's): no p from it
    within, cross = _within_cross(matrix, _splits(n), n)
    observed_within, observed_cross = _within_cross(matrix, _observed(n), n)
    gaps, observed = within - cross, float(observed_within[0] - observed_cross[0])
    return float(np.mean(gaps >= observed - 1e-12))


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
