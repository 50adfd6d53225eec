"""Metrics, registered by name and imported when used.

Built in (in the order they run): ``exact_tokens``, ``divergence_point``, ``prefix_logprobs``,
``teacher_forced``, ``surface``, ``semantic``. Each is a factory in one module; see
:mod:`regress.metrics.base` for the contract. Other packages add metrics through the
``regress.metrics`` entry-point group.

Expected answers (:mod:`regress.metrics.answers`) are not a registered metric: a pair of outputs
does not know its prompt's accepted answers, so scoring checks them with the prompt set's
``expected`` (:func:`regress.scoring.score_runs`).
"""

from __future__ import annotations

import functools
import importlib
from importlib import metadata
from typing import Any, Callable

from regress.errors import UnknownPluginError
from regress.metrics.base import MetricInfo

_BUILTIN: dict[str, str] = {
    "exact_tokens": "regress.metrics.tokens:exact_tokens",
    "divergence_point": "regress.metrics.tokens:divergence_point",
    "prefix_logprobs": "regress.metrics.tokens:prefix_logprobs",
    "teacher_forced": "regress.metrics.teacher_forced:teacher_forced",
    "surface": "regress.metrics.surface:surface",
    "semantic": "regress.metrics.semantic:semantic",
}

DEFAULT_METRICS = tuple(_BUILTIN)


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, str]:
    found = dict(_BUILTIN)
    for entry in metadata.entry_points(group="regress.metrics"):
        found.setdefault(entry.name, entry.value)
    return found


def metric_names() -> list[str]:
    """Every registered metric name."""
    return sorted(_registry())


def get_metric(name: str) -> MetricInfo:
    """The registration of metric ``name`` (imports its module)."""
    registry = _registry()
    if name not in registry:
        raise UnknownPluginError("metric", name, sorted(registry))
    module_name, _, attr = registry[name].partition(":")
    factory: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    return factory.metric_info  # type: ignore[attr-defined]
