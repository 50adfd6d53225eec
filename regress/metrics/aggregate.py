"""Aggregation: one number of the run from a value of every prompt, as the value's spec declares.

:func:`aggregate` reduces one value (:class:`regress.metrics.spec.Aggregate`: a mean, median,
extreme or rate, optionally weighted); :func:`aggregates` does it for every metric in force and
sorts the results into metrics.json's own fields and its ``extra``.

A NaN among the values makes :func:`aggregate`'s result NaN (never a mean of the others, which
would look within bounds): a sampled prompt's row, reduced over its samples, stays broken for
the verdict. The run's aggregates (:func:`aggregates`) leave such prompts out instead, so that
metrics.json holds numbers; the verdict has classed them already and names them
(``RunMetrics.nonfinite_ids``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from regress.metrics import output_specs
from regress.metrics.base import MetricInfo
from regress.metrics.spec import Output
from regress.records import RunMetrics


def _numbers(values: list[Any]) -> list[float]:
    """The real numbers among ``values`` (no flags, no missing values), NaN and infinities kept."""
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _finite(value: Any) -> bool:
    """Not a NaN or infinite number (missing values and flags count as finite)."""
    return isinstance(value, bool) or not isinstance(value, float) or math.isfinite(value)


def aggregate(spec: Output, rows: Sequence[dict[str, Any]]) -> float | None:
    """One number of the run from a value of every prompt, as its spec says (None: nothing to aggregate)."""
    a = spec.aggregate
    if a is None or a.how == "none":
        return None
    if a.how == "rate":
        flags = [v for v in (r.get(spec.name) for r in rows) if v is not None]
        return sum(1 for v in flags if v) / len(flags) if flags else None
    if a.weight:
        pairs = [(r.get(spec.name), r.get(a.weight)) for r in rows]
        total = sum(int(w or 0) for _, w in pairs)
        return sum((v or 0.0) * int(w or 0) for v, w in pairs) / total if total else None
    vals = _numbers([r.get(spec.name) for r in rows])
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return math.nan  # max()/min()/median with a NaN answer by its place in the list
    if a.how == "mean":
        return sum(vals) / len(vals)
    if a.how == "median":
        return float(statistics.median(vals))
    return float(max(vals) if a.how == "max" else min(vals))


def _own_field(key: str) -> bool:
    """Whether ``key`` is a RunMetrics field that holds an aggregate (a number that may be missing)."""
    field = RunMetrics.model_fields.get(key)
    if field is None:
        return False
    if field.annotation != (float | None):
        raise TypeError(f"a metric aggregates to {key!r}, a metrics.json field that holds something else")
    return True


def aggregates(infos: Sequence[MetricInfo], rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(RunMetrics fields, extra aggregates) of the metrics in force. A registered metric that did
    not run leaves its RunMetrics field None."""
    fields: dict[str, Any] = {key: None for key in (s.aggregate_key for s in output_specs()) if key and _own_field(key)}
    extra: dict[str, Any] = {}
    for info in infos:
        for spec in info.values:
            key = spec.aggregate_key
            if key is not None:
                weight = spec.aggregate.weight if spec.aggregate else None
                kept = [r for r in rows if _finite(r.get(spec.name)) and (weight is None or _finite(r.get(weight)))]
                (fields if _own_field(key) else extra)[key] = aggregate(spec, kept)
    return fields, extra
