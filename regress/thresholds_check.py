"""Every problem of params.yaml's ``thresholds:`` section, found when the file loads.

Types strictly (a YAML ``true`` is not ``max_regressions: 1``), every problem at once (pydantic
collects them), metric names against the registered metrics (else only ``regress score`` would
refuse ``metrics: [nope]``), and each value's benign bound on the benign side of its regression
bound (``benign_kl: 0.5`` with ``regression_kl: 0.1`` would make every drift benign and a benign
prompt impossible to tell from a regression). Infinities and NaN are refused for the whole file by
:func:`regress.validation.value_problems`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from regress.validation import all_errors


def threshold_problems(data: dict[str, Any], model: type[BaseModel]) -> list[tuple[str, str]]:
    """(dotted field, message) for every problem of ``thresholds:`` (``data``), ``model`` being
    :data:`regress.verdict.Thresholds`."""
    problems: list[tuple[str, str]] = []
    try:
        model.model_validate(data, strict=True)
    except ValidationError as exc:
        problems += [(f"thresholds.{where}" if where else "thresholds", message)
                     for where, message in all_errors(exc, model)]
    problems += _metric_problems(data.get("metrics"))
    problems += _band_problems(data, model)
    return problems


def _metric_problems(metrics: Any) -> list[tuple[str, str]]:
    if not isinstance(metrics, list):
        return []
    from regress.metrics import metric_names

    known = metric_names()
    return [(f"thresholds.metrics[{i}]", f"no metric named {name!r} is registered; known: {', '.join(known)}")
            for i, name in enumerate(metrics) if isinstance(name, str) and name not in known]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _band_problems(data: dict[str, Any], model: type[BaseModel]) -> list[tuple[str, str]]:
    from regress.verdict import gates
    from regress.metrics.spec import Output

    problems = []
    for spec in gates():
        if not isinstance(spec, Output) or spec.benign is None or spec.regression is None or spec.better is None:
            continue
        benign_name, regression_name = spec.benign.setting.name, spec.regression.setting.name
        if benign_name not in data and regression_name not in data:
            continue

        def value(name: str) -> float | None:
            field = model.model_fields.get(name)
            return _number(data[name]) if name in data else _number(field.default if field else None)

        benign, regression = value(benign_name), value(regression_name)
        if benign is None or regression is None:
            continue
        inverted = benign > regression if spec.better == "lower" else benign < regression
        if inverted:
            side = "above" if spec.better == "lower" else "below"
            where = benign_name if benign_name in data else regression_name
            problems.append((f"thresholds.{where}", (
                f"{benign_name} ({benign:g}) is {side} {regression_name} ({regression:g}): {spec.shown_label} is "
                f"{spec.better} when better, so the benign bound must lie on the good side of the regression "
                "bound (an inverted band calls regressions benign)")))
    return problems
