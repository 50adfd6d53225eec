"""Per-prompt classes and the run verdict, from metric values and thresholds.

Classes, checked in this order:

``input_drift``
    The prompt's token ids changed (tokenizer or chat template): outputs are not comparable
    token by token, so the prompt is set apart rather than called a regression.
``identical``
    Exactly the golden's tokens.
``regression``
    Any regression signal: a confident flip at the first divergence, a divergence that fails
    vLLM's own top-k check, or teacher-forced / semantic measures beyond their regression
    thresholds.
``benign``
    Diverged at a near-tie of the golden and stayed close by every teacher-forced and
    semantic measure: the numerical noise that kernels, batching and dtypes produce.
``drift``
    Everything else: beyond noise, within tolerance. Worth a look, not a reason to stop.

A single flipped token at a near-tie changes everything after it, so the free-running output
alone cannot tell noise from damage; the teacher-forced measures (scored on the golden's own
completion, no cascade) carry most of the decision. See docs/verdicts.md for how the default
thresholds were measured.

Prompts with an expected answer (``expected`` in the prompt set) are also checked for it in both
outputs (:mod:`regress.metrics.answers`); that does not change their class. A lost answer (golden
correct, candidate not) is reported per prompt and per run, and fails the run only when
``max_answer_flips_lost`` is set and exceeded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from regress.errors import ConfigError
from regress.records import MetricValue, PromptClass
from regress.validation import first_error


class Thresholds(BaseModel):
    """Verdict thresholds (``thresholds:`` in params.yaml). Defaults and their reasons below."""

    model_config = ConfigDict(extra="forbid")

    near_tie_margin: float = Field(0.3, ge=0)
    """Golden top-1/top-2 gap (nat) below which a flip is a coin toss: p1/p2 < 1.35. bf16 logits
    come on a grid of 0.0625-0.125 nat at a real model's logit sizes; every noise arm measured on
    SmolLM2-135M diverged at a margin of at most 0.25 nat (two steps), so 0.3 (docs/verdicts.md)."""
    confident_margin: float = Field(1.0, ge=0)
    """Golden gap (nat) above which overturning the golden's choice is a regression signal:
    the golden's top-1 was at least e (2.7) times as likely as its runner-up."""
    benign_kl: float = Field(0.02, ge=0)
    """Mean teacher-forced KL per position (nat) at most this for ``benign``."""
    regression_kl: float = Field(0.1, ge=0)
    """Mean teacher-forced KL per position (nat) above this is a regression."""
    benign_same_top1: float = Field(0.95, ge=0, le=1)
    """Teacher-forced same-top-1 rate at least this for ``benign``."""
    regression_same_top1: float = Field(0.8, ge=0, le=1)
    """Teacher-forced same-top-1 rate below this is a regression."""
    benign_semantic: float = Field(0.8, ge=-1, le=1)
    """Semantic similarity at least this for ``benign``."""
    regression_semantic: float = Field(0.3, ge=-1, le=1)
    """Semantic similarity below this is a regression."""
    require_topk_agreement: bool = True
    """Count a first divergence where one side's token is outside the other's top-k as a
    regression (vLLM's own HF-vs-vLLM rule)."""
    max_regressions: int = Field(0, ge=0)
    """The run fails when more prompts than this are regressions."""
    max_answer_flips_lost: int | None = Field(None, ge=0)
    """The run fails when more prompts than this lose their expected answer (golden correct,
    candidate not). None (the default): lost answers are reported, never gating."""
    semantic_model: str | None = None
    """sentence-transformers model for the semantic metric (default: bundled all-MiniLM-L6-v2)."""
    semantic_precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Embedding precision: auto = bfloat16 on CPUs with AMX (2.3x faster, cosines within 0.006)."""
    metrics: list[str] | None = None
    """Metrics to compute (default: all built in). Drop 'semantic' to skip embeddings."""

    @classmethod
    def from_params(cls, data: dict[str, Any], *, file: str | None = None) -> "Thresholds":
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            where, message = first_error(exc, cls)
            raise ConfigError(message, file=file, field=f"thresholds.{where}" if where else "thresholds") from exc


def _get(values: dict[str, MetricValue], name: str) -> Any:
    return values.get(name)


def classify(values: dict[str, MetricValue], t: Thresholds) -> tuple[PromptClass, list[str]]:
    """Class of one prompt from its metric values, with the reasons."""
    if _get(values, "input_drift"):
        return "input_drift", ["prompt token ids differ from the golden's (tokenizer or chat template changed)"]
    if _get(values, "identical"):
        return "identical", []

    regression: list[str] = []
    not_benign: list[str] = []
    d = _get(values, "first_divergence")
    margin = _get(values, "golden_margin")
    if margin is not None:
        if margin >= t.confident_margin:
            regression.append(f"first divergence at token {d} where the golden was confident "
                              f"(margin {margin:.2f} nat >= {t.confident_margin})")
        elif margin >= t.near_tie_margin:
            not_benign.append(f"first divergence at token {d} was not a near-tie (margin {margin:.2f} nat)")
    if t.require_topk_agreement:
        if _get(values, "candidate_token_in_golden_topk") is False:
            regression.append(f"at token {d} the candidate chose a token outside the golden's top-k")
        if _get(values, "golden_token_in_candidate_topk") is False:
            regression.append(f"at token {d} the golden's token is outside the candidate's top-k")

    kl = _get(values, "tf_kl_mean")
    if kl is not None:
        if kl > t.regression_kl:
            regression.append(f"teacher-forced KL {kl:.3f} > {t.regression_kl}")
        elif kl > t.benign_kl:
            not_benign.append(f"teacher-forced KL {kl:.3f} > {t.benign_kl}")
    same = _get(values, "tf_same_top1_rate")
    if same is not None:
        if same < t.regression_same_top1:
            regression.append(f"same top-1 on {same:.0%} of golden positions < {t.regression_same_top1:.0%}")
        elif same < t.benign_same_top1:
            not_benign.append(f"same top-1 on {same:.0%} of golden positions < {t.benign_same_top1:.0%}")
    flipped = _get(values, "tf_max_flipped_margin")
    if flipped is not None:
        if flipped >= t.confident_margin:
            regression.append(f"teacher-forced, the candidate overturned a confident golden choice "
                              f"(margin {flipped:.2f} nat)")
        elif flipped >= t.near_tie_margin:
            not_benign.append(f"teacher-forced, a golden choice with margin {flipped:.2f} nat flipped")
    semantic = _get(values, "semantic_similarity")
    if semantic is not None:
        # After a coin-toss flip the rest of the output may differ in meaning without anything
        # being broken (the teacher-forced measures judge the model there), so low similarity
        # counts as a regression only when the divergence itself was not a near-tie.
        coin_toss = margin is not None and margin < t.near_tie_margin
        if semantic < t.regression_semantic and not coin_toss:
            regression.append(f"semantic similarity {semantic:.2f} < {t.regression_semantic}")
        elif semantic < t.benign_semantic:
            not_benign.append(f"semantic similarity {semantic:.2f} < {t.benign_semantic}")

    if regression:
        return "regression", regression
    if not_benign:
        return "drift", not_benign
    return "benign", [f"diverged at token {d} at a near-tie and stayed close by every measure"]


def run_verdict(counts: dict[str, int], t: Thresholds, *,
                answers: Mapping[str, Any] | None = None) -> tuple[str, list[str]]:
    """``pass`` or ``fail`` for the run, with reasons.

    ``answers`` holds the expected-answer counts under their RunMetrics names
    (``answer_prompts``, ``golden_answers_correct``, ``answers_correct``, ``answer_flips_lost``,
    ``answer_flips_gained``); without prompts that have an expected answer the verdict and its
    reasons are those of the classes alone.
    """
    regressions = counts.get("regression", 0)
    failures = []
    if regressions > t.max_regressions:
        failures.append(f"{regressions} prompt(s) regressed (allowed: {t.max_regressions})")
    answer_failure = _answers_fail(answers, t)
    if answer_failure:
        failures.append(answer_failure)
    notes = _answer_notes(answers, t, failed=bool(answer_failure))
    if failures:
        return "fail", failures + notes
    reasons = [f"{regressions} regression(s), allowed {t.max_regressions}"]
    if counts.get("input_drift"):
        reasons.append(f"{counts['input_drift']} prompt(s) changed their input tokens: check the tokenizer / chat template")
    return "pass", reasons + notes


def _answers_fail(answers: Mapping[str, Any] | None, t: Thresholds) -> str | None:
    lost = (answers or {}).get("answer_flips_lost", 0)
    if t.max_answer_flips_lost is not None and lost > t.max_answer_flips_lost:
        return f"{lost} prompt(s) lost their expected answer (allowed: {t.max_answer_flips_lost})"
    return None


def _answer_notes(answers: Mapping[str, Any] | None, t: Thresholds, *, failed: bool) -> list[str]:
    n = (answers or {}).get("answer_prompts", 0)
    if not answers or not n:
        return []
    lost, gained = answers.get("answer_flips_lost", 0), answers.get("answer_flips_gained", 0)
    note = (f"expected answers: golden {answers.get('golden_answers_correct', 0)}/{n} correct, "
            f"candidate {answers.get('answers_correct', 0)}/{n}; {lost} lost, {gained} gained")
    if failed:  # the failure reason already says how many were lost and allowed
        return [note]
    if t.max_answer_flips_lost is not None:
        note += f" (allowed lost: {t.max_answer_flips_lost})"
    elif lost:
        note += " (reported, not gating: thresholds.max_answer_flips_lost is not set)"
    return [note]
