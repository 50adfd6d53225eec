"""What a metric is: a small pure function from a (golden, candidate) pair to named values.

A metric is registered by a *factory*: called once with its options, it returns the function
that scores pairs. No I/O inside. Batched metrics (semantic similarity: one embedding call
for all texts) take the whole list of pairs at once.

The factory's :func:`metric` declaration carries a spec per value (:class:`~regress.metrics.spec.Output`):
what it means, how it is aggregated and shown, and its thresholds. Adding a metric is adding one
decorated factory to a module listed in ``regress.metrics.BUILTIN`` or, from another package, an
entry point in the ``regress.metrics`` group; nothing else in regress changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Optional, Union

import numpy as np

from regress.metrics.spec import Aggregate, Bound, Chart, Output, Rule, Setting
from regress.records import Generation

__all__ = ["Aggregate", "BatchMetric", "Bound", "CONFIDENT_MARGIN", "Chart", "MetricInfo", "NEAR_TIE_MARGIN", "Output", "SEMANTIC_MODEL",
           "Pair", "PairMetric", "Rule", "Setting", "Value", "Values", "first_divergence", "logprob_of", "metric"]

Value = Union[float, int, bool, str, None]
Values = dict[str, Value]


@dataclass(frozen=True)
class Pair:
    """One prompt: the golden's generation and the candidate's."""

    golden: Generation
    candidate: Generation
    golden_scored: Generation | None = None
    """Sampled prompts: the baseline fed this candidate sample teacher-forced (its
    ``teacher_forced`` track holds the golden model's logprobs of the candidate's tokens), when
    the replay made it (``<run>/golden-scored/``)."""

    @property
    def prompt_id(self) -> str:
        return self.golden.prompt_id

    @cached_property
    def divergence(self) -> int | None:
        """First differing output position (None when identical); computed once per pair."""
        return first_divergence(self.golden.output_token_ids, self.candidate.output_token_ids)


PairMetric = Callable[[Pair], Values]
BatchMetric = Callable[[list[Pair]], list[Values]]

# The golden's top-1/top-2 margin judges a flip wherever one happens (at the first divergence,
# teacher-forced along the golden's completion), so the metrics that gate on it share these.
NEAR_TIE_MARGIN = Setting(
    "near_tie_margin", 0.3, ge=0,
    doc="Golden top-1/top-2 gap (nat) below which a flip is a coin toss: p1/p2 < 1.35. bf16 logits come on a "
        "grid of 0.0625-0.125 nat at a real model's logit sizes; every noise arm measured on SmolLM2-135M "
        "diverged at a margin of at most 0.25 nat (two steps), so 0.3 (docs/verdicts.md).")
CONFIDENT_MARGIN = Setting(
    "confident_margin", 1.0, ge=0,
    doc="Golden gap (nat) above which overturning the golden's choice is a regression signal: the golden's "
        "top-1 was at least e (2.7) times as likely as its runner-up.")


SEMANTIC_MODEL = Setting(
    "semantic_model", None, type=Optional[str],
    doc="sentence-transformers model for the semantic metric (default: bundled all-MiniLM-L6-v2).")


@dataclass(frozen=True)
class MetricInfo:
    """Registration data of a metric factory: its name, the spec of every value it returns, the
    rules over several values, and the ``thresholds:`` fields passed to the factory as options."""

    name: str
    values: tuple[Output, ...]
    batched: bool
    factory: Callable[..., Any]
    rules: tuple[Rule, ...] = ()
    options: Mapping[str, Setting] = field(default_factory=dict)
    """Factory keyword -> the threshold setting whose value it receives."""

    @property
    def outputs(self) -> dict[str, str]:
        """What each value means, by name."""
        return {v.name: v.doc for v in self.values}


def metric(name: str, *, outputs: Mapping[str, str] | Sequence[Output], batched: bool = False,
           rules: Sequence[Rule] = (), options: Mapping[str, Setting] | None = None,
           ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a factory as the metric ``name``.

    ``outputs``: the spec of every value it returns (a plain ``{name: doc}`` mapping declares
    values that are only shown). ``rules``: verdict rules over several of them. ``options``:
    factory keyword -> ``thresholds:`` setting, passed when the metric is built.
    """
    values = tuple(Output(k, doc) for k, doc in outputs.items()) if isinstance(outputs, Mapping) else tuple(outputs)
    for v in values:
        if (v.benign or v.regression) and v.better is None:
            raise TypeError(f"metric {name!r}: value {v.name!r} has bounds but no direction (better=)")

    def mark(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.metric_info = MetricInfo(name, values, batched, factory, tuple(rules),  # type: ignore[attr-defined]
                                         dict(options or {}))
        return factory

    return mark


def first_divergence(golden: np.ndarray, candidate: np.ndarray) -> int | None:
    """Index of the first position where two token sequences differ; None if they are equal.

    When one is a strict prefix of the other, the divergence is at the shorter length.
    """
    n = min(len(golden), len(candidate))
    differ = np.flatnonzero(golden[:n] != candidate[:n])
    if differ.size:
        return int(differ[0])
    return None if len(golden) == len(candidate) else n


def logprob_of(top_ids: np.ndarray, top_logprobs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Per row, the logprob of ``tokens[i]`` if it is in row i's top-k, else NaN."""
    hit = top_ids == tokens[:, None]
    found = hit.any(axis=1)
    picked = np.where(found, top_logprobs[np.arange(len(tokens)), hit.argmax(axis=1)], np.nan)
    return picked.astype(np.float64)
