"""Teacher-forced metrics: the candidate scored on the golden's own completion, position by position.

The candidate was fed prompt + golden completion and reported, at every completion position, the
logprob of the golden's token and its own top-k. Contexts are identical on both sides at every
position, so these compare the two models without the cascade that follows a flipped token
(the measures llama.cpp's KL-divergence tool reports for quantizations).

KL is computed over the golden's top-k plus one "rest" bucket (the probability mass outside the
top-k), since only top-k logprobs are stored. A golden top-k token missing from the candidate's
top-k gets the candidate's k-th logprob, an upper bound on its true value; the estimate therefore
leans low when the two top-k sets differ a lot.

Every value is computed from the candidate's logprobs of the golden's tokens, so one that is NaN
or infinite means the candidate answered logprobs that are not numbers: a regression
(``nonfinite="regression"``), never noise. A prompt the pass could not score at all (prompt +
golden completion longer than the candidate's ``max_model_len``: the engine scores no position)
has no teacher-forced measure; the ``teacher_forcing_ran`` rule keeps it from being benign and
scoring names it (``RunMetrics.not_teacher_forced_ids``), so it is never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from regress.records.generation import NOT_GENERATED
from regress.metrics.base import (CONFIDENT_MARGIN, NEAR_TIE_MARGIN, Aggregate, Bound, Chart, Output, Pair, Rule,
                                  Setting, Values, logprob_of, metric)

_EPS = 1e-12


def _kl_topk(golden_lp: np.ndarray, golden_ids: np.ndarray, cand_lp: np.ndarray, cand_ids: np.ndarray) -> np.ndarray:
    """Per position KL(golden || candidate) over the golden's top-k plus a rest bucket."""
    # hit[i, j, m]: the golden's j-th token is the candidate's m-th at position i.
    hit = golden_ids[:, :, None] == cand_ids[:, None, :]
    found = hit.any(axis=2)
    q_lp = np.take_along_axis(cand_lp, hit.argmax(axis=2), axis=1).astype(np.float64)
    q_lp = np.where(found, q_lp, cand_lp[:, -1:].astype(np.float64))
    p = np.exp(golden_lp.astype(np.float64))  # padding (-inf) gives p = 0
    q = np.exp(q_lp)
    valid = p > 0
    terms = np.where(valid, p * (np.log(np.maximum(p, _EPS)) - np.log(np.maximum(q, _EPS))), 0.0)
    p_rest = np.clip(1.0 - p.sum(axis=1), _EPS, 1.0)
    q_rest = np.clip(1.0 - np.where(valid, q, 0.0).sum(axis=1), _EPS, 1.0)
    kl = terms.sum(axis=1) + p_rest * (np.log(p_rest) - np.log(q_rest))
    return np.maximum(kl, 0.0)


_KL_REASON = "teacher-forced KL {value:.3f} > {bound}"
_SAME_REASON = "same top-1 on {value:.0%} of golden positions < {bound:.0%}"

_OUTPUTS = [
    Output("tf_positions", "golden completion positions scored teacher-forced"),
    Output("tf_unscored", "golden completion positions the teacher-forcing pass could not score (the context "
           "did not fit the candidate's max_model_len; a golden that filled it loses its last position)",
           format="int"),
    Output("tf_mean_abs_delta", "mean |logprob(golden token) under candidate - under golden|", better="lower"),
    Output("tf_max_abs_delta", "largest such difference", better="lower"),
    Output("tf_kl_mean", "mean KL(golden || candidate) per position over the top-k (+ rest bucket)",
           label="TF KL", format="kl", better="lower", headline=30, column=True,
           aggregate=Aggregate("mean", key="mean_teacher_forced_kl", label="teacher-forced KL", rank=10,
                               doc="mean per-position KL(golden || candidate) on the golden's completion, nat"),
           benign=Bound(Setting("benign_kl", 0.02, ge=0,
                                doc="Mean teacher-forced KL per position (nat) at most this for ``benign``."),
                        reason=_KL_REASON),
           regression=Bound(Setting("regression_kl", 0.1, ge=0,
                                    doc="Mean teacher-forced KL per position (nat) above this is a regression."),
                            reason=_KL_REASON),
           chart=Chart("Teacher-forced KL", "mean KL(golden ‖ candidate) per token, nat, log scale", scale="log",
                       empty="no teacher-forced scores")),
    Output("tf_kl_max", "largest per-position KL", format="kl", better="lower"),
    Output("tf_same_top1_rate", "share of positions where both pick the same top-1 (exact ties count as same)",
           label="same top-1", format="pct", better="higher", headline=40, column=True,
           # Over all scored positions, not prompts: a short output must not weigh like a long one.
           aggregate=Aggregate("mean", key="same_top1_rate", weight="tf_positions", label="same top-1", rank=20,
                               doc="teacher-forced positions where both pick the same token"),
           benign=Bound(Setting("benign_same_top1", 0.95, ge=0, le=1,
                                doc="Teacher-forced same-top-1 rate at least this for ``benign``."),
                        reason=_SAME_REASON),
           regression=Bound(Setting("regression_same_top1", 0.8, ge=0, le=1,
                                    doc="Teacher-forced same-top-1 rate below this is a regression."),
                            reason=_SAME_REASON)),
    Output("tf_topk_outside", "prefill only (a quick check, which has no free run to apply vLLM's top-k rule at its "
           "first divergence): positions where one side's top-1 is outside the other side's top-k", format="int",
           better="lower"),
    Output("tf_delta_p_mean", "mean of p_candidate(golden token) - p_golden(golden token)"),
    Output("tf_delta_p_rms", "root mean square of that probability difference", better="lower"),
    Output("tf_flips", "positions where the candidate's top-1 is not the golden's", better="lower"),
    Output("tf_max_flipped_margin", "the golden's largest top-1/top-2 margin (nat) among those flips: how confident "
           "a golden decision the candidate overturned", better="lower", headline=50,
           benign=Bound(NEAR_TIE_MARGIN, inclusive=True,
                        reason="teacher-forced, a golden choice with margin {value:.2f} nat flipped"),
           regression=Bound(CONFIDENT_MARGIN, inclusive=True,
                            reason="teacher-forced, the candidate overturned a confident golden choice "
                                   "(margin {value:.2f} nat)")),
]
# Every value here is made of the candidate's logprobs: one that is not a number is its answer broken.
_OUTPUTS = [dataclasses.replace(o, nonfinite="regression") for o in _OUTPUTS]
_NAMES = [o.name for o in _OUTPUTS]


def not_teacher_forced(values: Mapping[str, Any]) -> bool:
    """Whether the teacher-forcing pass ran for a prompt with a golden completion and scored none of it."""
    unscored = values.get("tf_unscored")
    return isinstance(unscored, int) and unscored > 0 and not values.get("tf_positions")


def _teacher_forcing_ran(values: Mapping[str, Any], t: Any) -> tuple[list[str], list[str]]:
    """Not benign without teacher-forced measures: "stayed close by every measure" would be untrue."""
    if not not_teacher_forced(values):
        return [], []
    n = values.get("tf_unscored")
    return [], [f"teacher forcing could not run: none of the golden's {n} token(s) was scored (prompt + golden "
                "completion do not fit the candidate's context, max_model_len), so no teacher-forced measure "
                "judged it"]


TEACHER_FORCING_RAN = Rule("teacher_forcing_ran", "a prompt the teacher-forcing pass could not score is not benign",
                           _teacher_forcing_ran)


def _topk_outside(values: Mapping[str, Any], t: Any) -> tuple[list[str], list[str]]:
    """vLLM's top-k rule where there is no free run (a quick check): a top-1 the other side did not
    even rank, at any position of the golden's completion, is a category, not a degree."""
    n = values.get("tf_topk_outside")
    if not getattr(t, "require_topk_agreement", True) or not isinstance(n, int) or n <= 0:
        return [], []
    return [f"teacher-forced, at {n} position(s) one side's top-1 is outside the other side's top-k"], []


TOPK_OUTSIDE = Rule("teacher_forced_topk_agreement", "prefill only: each side's top-1 is in the other's top-k at "
                    "every teacher-forced position", _topk_outside, categorical=True)


def _positionwise(golden_lp, golden_top_ids, golden_top_lp, tf_lp, tf_top_ids, tf_top_lp) -> dict[str, np.ndarray]:
    """Per-position measures over any number of positions (rows)."""
    g_lp = golden_lp.astype(np.float64)
    c_lp = tf_lp.astype(np.float64)
    g1, c1 = golden_top_ids[:, 0], tf_top_ids[:, 0]
    # Exact ties are common with bf16 logits; a tie broken the other way is not a flip.
    cand_lp_of_g1 = logprob_of(tf_top_ids, tf_top_lp, g1)
    gold_lp_of_c1 = logprob_of(golden_top_ids, golden_top_lp, c1)
    same = (g1 == c1) | (cand_lp_of_g1 >= tf_top_lp[:, 0]) | (gold_lp_of_c1 >= golden_top_lp[:, 0])
    if golden_top_lp.shape[1] > 1:
        margin = (golden_top_lp[:, 0] - golden_top_lp[:, 1]).astype(np.float64)
    else:
        margin = np.full(len(g1), np.inf)
    dp = np.exp(c_lp) - np.exp(g_lp)
    outside = ~((tf_top_ids == g1[:, None]).any(axis=1) & (golden_top_ids == c1[:, None]).any(axis=1))
    return {
        "outside": outside,
        "delta": np.abs(c_lp - g_lp),
        "dp": dp,
        "kl": _kl_topk(golden_top_lp, golden_top_ids, tf_top_lp, tf_top_ids),
        "same": same,
        "flipped_margin": np.where(same, -np.inf, margin),
    }


@metric("teacher_forced", outputs=_OUTPUTS, batched=True, rules=[TEACHER_FORCING_RAN, TOPK_OUTSIDE])
def teacher_forced() -> "callable":
    """Vectorised over every position of every prompt at once, then reduced per prompt: scoring
    10,000 prompts costs a few array passes instead of 10,000 rounds of small numpy calls."""

    def score(pairs: list[Pair]) -> list[Values]:
        out: list[Values] = [{name: None for name in _NAMES} for _ in pairs]
        rows = []
        prefill_only: list[bool] = []
        for i, pair in enumerate(pairs):
            tf = pair.candidate.teacher_forced
            if tf is None:
                continue
            out[i]["tf_positions"] = len(tf.token_ids)
            out[i]["tf_unscored"] = max(0, len(pair.golden.output_token_ids) - len(tf.token_ids))
            if len(tf.token_ids):
                rows.append((i, pair.golden.free_run, tf))
                prefill_only.append(pair.candidate.finish_reason == NOT_GENERATED)
        if not rows:
            return out
        lengths = np.array([len(tf.token_ids) for _, _, tf in rows])
        k = max(max(g.top_ids.shape[1], tf.top_ids.shape[1]) for _, g, tf in rows)

        def stack(get, fill, dtype):
            parts = []
            for (_, g, tf), n in zip(rows, lengths):
                a = np.asarray(get(g, tf))[:n]
                if a.ndim == 2 and a.shape[1] < k:
                    a = np.concatenate([a, np.full((a.shape[0], k - a.shape[1]), fill, a.dtype)], axis=1)
                parts.append(a)
            return np.concatenate(parts).astype(dtype, copy=False)

        per = _positionwise(
            stack(lambda g, tf: g.token_logprobs, 0, np.float32),
            stack(lambda g, tf: g.top_ids, -1, np.int32),
            stack(lambda g, tf: g.top_logprobs, -np.inf, np.float32),
            stack(lambda g, tf: tf.token_logprobs, 0, np.float32),
            stack(lambda g, tf: tf.top_ids, -2, np.int32),
            stack(lambda g, tf: tf.top_logprobs, -np.inf, np.float32),
        )
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        sums = {name: np.add.reduceat(per[name], starts) for name in ("delta", "dp", "kl", "same", "outside")}
        sq = np.add.reduceat(per["dp"] ** 2, starts)
        maxes = {name: np.maximum.reduceat(per[name], starts) for name in ("delta", "kl", "flipped_margin")}
        for j, (i, _, _) in enumerate(rows):
            n = int(lengths[j])
            flips = n - int(sums["same"][j])
            out[i].update(
                tf_mean_abs_delta=float(sums["delta"][j] / n),
                tf_max_abs_delta=float(maxes["delta"][j]),
                tf_kl_mean=float(sums["kl"][j] / n),
                tf_kl_max=float(maxes["kl"][j]),
                tf_same_top1_rate=float(sums["same"][j] / n),
                tf_delta_p_mean=float(sums["dp"][j] / n),
                tf_delta_p_rms=float(np.sqrt(sq[j] / n)),
                tf_flips=flips,
                tf_max_flipped_margin=float(maxes["flipped_margin"][j]) if flips else None,
                tf_topk_outside=int(sums["outside"][j]) if prefill_only[j] else None,
            )
        return out

    return score
