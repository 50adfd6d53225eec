"""Token-level metrics: exact match, first divergence, the divergence point, free-run logprob drift."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from regress.metrics.base import (CONFIDENT_MARGIN, NEAR_TIE_MARGIN, Aggregate, Bound, Chart, Output, Pair, Rule,
                                  Setting, Values, metric)


@metric(
    "exact_tokens",
    outputs=[
        Output("input_drift", "prompt token ids differ (tokenizer or chat template changed): outputs not comparable token by token"),
        Output("identical", "output token ids are exactly the golden's"),
        Output("first_divergence", "position of the first differing output token (None when identical)",
               label="first div.", better="higher", headline=10, column=True,
               aggregate=Aggregate("mean", key="mean_first_divergence", label="first divergence",
                                   doc="mean token position of the first difference", rank=40),
               chart=Chart("First divergence", "token position of the first difference", scale="position",
                           noun="diverged prompt", empty="no prompt diverged")),
        Output("golden_tokens", "number of golden output tokens"),
        Output("candidate_tokens", "number of candidate output tokens"),
    ],
)
def exact_tokens() -> "callable":
    def score(pair: Pair) -> Values:
        g, c = pair.golden, pair.candidate
        d = pair.divergence
        return {
            "input_drift": not np.array_equal(g.prompt_token_ids, c.prompt_token_ids),
            "identical": d is None,
            "first_divergence": d,
            "golden_tokens": int(len(g.output_token_ids)),
            "candidate_tokens": int(len(c.output_token_ids)),
        }

    return score


REQUIRE_TOPK_AGREEMENT = Setting(
    "require_topk_agreement", True, type=bool,
    doc="Count a first divergence where one side's token is outside the other's top-k as a regression "
        "(vLLM's own HF-vs-vLLM rule).")


def topk_agreement(values: Mapping[str, Any], t: Any) -> tuple[list[str], list[str]]:
    """vLLM's rule: at the first divergence each side's token must be in the other's top-k."""
    if not getattr(t, REQUIRE_TOPK_AGREEMENT.name):
        return [], []
    d = values.get("first_divergence")
    regression = []
    if values.get("candidate_token_in_golden_topk") is False:
        regression.append(f"at token {d} the candidate chose a token outside the golden's top-k")
    if values.get("golden_token_in_candidate_topk") is False:
        regression.append(f"at token {d} the golden's token is outside the candidate's top-k")
    return regression, []


@metric(
    "divergence_point",
    outputs=[
        Output("golden_margin", "golden top-1 minus top-2 logprob at the first divergence (nat); small = near-tie",
               label="golden margin", better="lower", headline=20, column=True,
               benign=Bound(NEAR_TIE_MARGIN, inclusive=True,
                            reason="first divergence at token {first_divergence} was not a near-tie (margin {value:.2f} nat)"),
               regression=Bound(CONFIDENT_MARGIN, inclusive=True,
                                reason="first divergence at token {first_divergence} where the golden was confident "
                                       "(margin {value:.2f} nat >= {bound})")),
        Output("candidate_margin", "candidate top-1 minus top-2 logprob at the first divergence (nat)",
               nonfinite="regression"),
        Output("golden_token_in_candidate_topk", "the golden's token is in the candidate's top-k there (vLLM's check)"),
        Output("candidate_token_in_golden_topk", "the candidate's token is in the golden's top-k there (vLLM's check)"),
    ],
    rules=[Rule("topk_agreement", "each side's token is in the other's top-k at the first divergence",
                topk_agreement, (REQUIRE_TOPK_AGREEMENT,), categorical=True)],
)
def divergence_point() -> "callable":
    """At the first divergence both sides saw the same context, so this is where the two models
    disagree on equal terms. vLLM's own HF-vs-vLLM test accepts a divergence when each side's
    token is in the other's top-k; the golden's margin says how close the call was."""

    def score(pair: Pair) -> Values:
        g, c = pair.golden, pair.candidate
        d = pair.divergence
        empty: Values = {"golden_margin": None, "candidate_margin": None,
                         "golden_token_in_candidate_topk": None, "candidate_token_in_golden_topk": None}
        if d is None or d >= len(g.output_token_ids) or d >= len(c.output_token_ids):
            return empty
        gt, ct = g.free_run, c.free_run
        return {
            "golden_margin": _margin(gt.top_logprobs[d]),
            "candidate_margin": _margin(ct.top_logprobs[d]),
            "golden_token_in_candidate_topk": bool(g.output_token_ids[d] in ct.top_ids[d]),
            "candidate_token_in_golden_topk": bool(c.output_token_ids[d] in gt.top_ids[d]),
        }

    return score


def _margin(row: np.ndarray) -> float | None:
    if len(row) < 2 or not np.isfinite(row[1]):
        return None
    return float(row[0] - row[1])


@metric(
    "prefix_logprobs",
    outputs=[
        # Not a number here: the candidate's logprobs are (the golden is the blessed reference).
        Output("prefix_max_abs_delta", "largest |logprob difference| of the chosen tokens before the first divergence",
               better="lower", nonfinite="regression"),
        Output("prefix_mean_abs_delta", "mean |logprob difference| of the chosen tokens before the first divergence",
               better="lower", nonfinite="regression"),
    ],
)
def prefix_logprobs() -> "callable":
    """Free-running logprob drift where both outputs still agree (the shared prefix)."""

    def score(pair: Pair) -> Values:
        g, c = pair.golden, pair.candidate
        d = pair.divergence
        n = len(g.output_token_ids) if d is None else d
        if n == 0:
            return {"prefix_max_abs_delta": None, "prefix_mean_abs_delta": None}
        delta = np.abs(g.free_run.token_logprobs[:n].astype(np.float64) - c.free_run.token_logprobs[:n])
        return {"prefix_max_abs_delta": float(delta.max()), "prefix_mean_abs_delta": float(delta.mean())}

    return score
