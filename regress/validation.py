"""Turn pydantic validation errors into messages a user can act on: which field, what is
allowed, what was given."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ValidationError


def yaml_key_lines(text: str) -> dict[str, int]:
    """Dotted key path -> 1-based line of every mapping key in a YAML document (for messages)."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def line_for(lines: dict[str, int], dotted: str) -> int | None:
    """The line of ``dotted`` in :func:`yaml_key_lines` output, else of its nearest parent key."""
    parts = dotted.split(".")
    while parts:
        found = lines.get(".".join(parts))
        if found is not None:
            return found
        parts.pop()
    return None


def field_path(loc: tuple[Any, ...]) -> str:
    """``("sampling", "temperature")`` -> ``sampling.temperature``; list indexes as ``[i]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def describe(error: dict[str, Any], model: type[BaseModel] | None = None) -> tuple[str | None, str]:
    """(field path, message) for one pydantic error."""
    loc = tuple(p for p in error.get("loc", ()) if p not in ("function-after",))
    path = field_path(loc) or None
    kind = error.get("type", "")
    given = error.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_fields(model, loc[:-1]) if model else []
        hint = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return path, f"unknown field{hint}"
    if kind == "missing":
        return path, "required field is missing"
    message = error.get("msg", "invalid value")
    message = message.removeprefix("Value error, ")
    if kind not in ("value_error", "assertion_error") and given is not None and not isinstance(given, (dict, list)):
        message += f" (given: {given!r})"
    return path, message


def _allowed_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(getattr(current, "model_fields", {}))


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def first_error(exc: ValidationError, model: type[BaseModel]) -> tuple[str | None, str]:
    """The first problem of a ValidationError, described."""
    return describe(exc.errors()[0], model)


def all_errors(exc: ValidationError, model: type[BaseModel]) -> list[tuple[str | None, str]]:
    """Every problem of a ValidationError, described."""
    return [describe(e, model) for e in exc.errors()]
