"""Metrics, registered by name and imported when used.

Built in (in the order they run): ``exact_tokens``, ``divergence_point``, ``prefix_logprobs``,
``teacher_forced``, ``surface``, ``semantic``, ``sampled`` (distributions of sampled prompts), ``choices``
(multiple-choice prompts scored by log-likelihood). Each is a factory in one module; see
:mod:`regress.metrics.base` for the contract and :mod:`regress.metrics.spec` for what a metric
declares about its values. Other packages add metrics through the ``regress.metrics``
entry-point group; they run when listed in ``thresholds.metrics``.

Expected answers (:mod:`regress.metrics.answers`) are not a registered metric: a pair of outputs
does not know its prompt's accepted answers, so scoring checks them with the prompt set's
``expected`` (:func:`regress.scoring.score_runs`). A multiple-choice prompt's answer does come
from a metric (``choices``: each side's stored choice scores know the right index), and scoring
turns its values into the answer check (:func:`regress.metrics.choices.answer_check`).
"""

from __future__ import annotations

import functools

from regress.metrics.base import MetricInfo
from regress.metrics.spec import Output, Rule
from regress.plugins import Registry

BUILTIN: dict[str, str] = {
    "exact_tokens": "regress.metrics.tokens:exact_tokens",
    "divergence_point": "regress.metrics.tokens:divergence_point",
    "prefix_logprobs": "regress.metrics.tokens:prefix_logprobs",
    "teacher_forced": "regress.metrics.teacher_forced:teacher_forced",
    "surface": "regress.metrics.surface:surface",
    "semantic": "regress.metrics.semantic:semantic",
    "sampled": "regress.metrics.sampled:sampled",
    "choices": "regress.metrics.choices:choices",
}

DEFAULT_METRICS = tuple(BUILTIN)

REGISTRY = Registry("metric", "regress.metrics", BUILTIN)


def metric_names() -> list[str]:
    """Every registered metric name, sorted."""
    return sorted(REGISTRY.names())


def get_metric(name: str) -> MetricInfo:
    """The registration of metric ``name`` (imports its module)."""
    factory = REGISTRY.get(name)
    info = getattr(factory, "metric_info", None)
    if not isinstance(info, MetricInfo):
        raise TypeError(f"metric {name!r} ({REGISTRY.target(name)}) is not declared with regress.metrics.base.metric")
    return info


@functools.lru_cache(maxsize=1)
def registered() -> tuple[MetricInfo, ...]:
    """Every registered metric, imported, built-ins first in the order they run: what the
    thresholds, the verdict and the report follow (and the order they check and show values in)."""
    return tuple(get_metric(name) for name in REGISTRY.names())


def output_specs() -> list[Output]:
    """The spec of every value of every registered metric, in metric order (first declaration of a name wins)."""
    seen: dict[str, Output] = {}
    for info in registered():
        for spec in info.values:
            seen.setdefault(spec.name, spec)
    return list(seen.values())


def rules() -> list[Rule]:
    """Every registered metric's rules over several values, in metric order."""
    return [rule for info in registered() for rule in info.rules]


__all__ = ["BUILTIN", "DEFAULT_METRICS", "REGISTRY", "get_metric", "metric_names", "output_specs", "registered", "rules"]
