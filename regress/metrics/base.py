"""What a metric is: a small pure function from a (golden, candidate) pair to named values.

A metric is registered by a *factory*: called once with its options, it returns the function
that scores pairs. No I/O inside. Batched metrics (semantic similarity: one embedding call
for all texts) take the whole list of pairs at once.

Adding a metric is adding one decorated factory to a module listed in
``regress.metrics._BUILTIN`` (or an entry point in the ``regress.metrics`` group).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Union

import numpy as np

from regress.records import Generation

Value = Union[float, int, bool, str, None]
Values = dict[str, Value]


@dataclass(frozen=True)
class Pair:
    """One prompt: the golden's generation and the candidate's."""

    golden: Generation
    candidate: Generation

    @property
    def prompt_id(self) -> str:
        return self.golden.prompt_id

    @cached_property
    def divergence(self) -> int | None:
        """First differing output position (None when identical); computed once per pair."""
        return first_divergence(self.golden.output_token_ids, self.candidate.output_token_ids)


PairMetric = Callable[[Pair], Values]
BatchMetric = Callable[[list[Pair]], list[Values]]


@dataclass(frozen=True)
class MetricInfo:
    """Registration data of a metric factory."""

    name: str
    outputs: dict[str, str]
    batched: bool
    factory: Callable[..., Any]


def metric(name: str, *, outputs: dict[str, str], batched: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a factory as the metric ``name``; ``outputs`` documents every value it returns."""

    def mark(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.metric_info = MetricInfo(name, outputs, batched, factory)  # type: ignore[attr-defined]
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
