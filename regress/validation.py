"""Turn pydantic validation errors into messages a user can act on, and read YAML safely.

A message says which field, what is allowed, what was given. Every user YAML (params.yaml, a
prompt set's card) is read by :func:`load_yaml`: bounded alias expansion, and no key twice in
one mapping, no key that is not a string (YAML's "last one wins" would silently drop the first).
:func:`value_problems` finds what no schema should have to refuse field by field: infinities and
NaN (they switch a bound off) and lone surrogates (text no file can hold)."""

from __future__ import annotations

import math
import re
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ValidationError

MAX_YAML_ALIASES = 100
"""Aliases (``*name``) one YAML document may hold: plenty for anchors shared between candidates."""
MAX_YAML_NODES = 100_000
"""Nodes a YAML document may hold with every alias expanded (a params.yaml has hundreds): nine
lines of nine aliases each would otherwise expand to 9**9 ("billion laughs")."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases while composing (composing shares an aliased node, so it
    is cheap; constructing copies it, and that is where a bomb explodes)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise yaml.constructor.ConstructorError(
                    None, None, f"more than {MAX_YAML_ALIASES} aliases; regress refuses documents that big in "
                    "aliases (YAML alias bombs)", self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        # A scalar Python refuses to build (a 5000-digit int, 2001-13-45) is a YAML error at its line.
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:
            text = node.value if isinstance(node, yaml.ScalarNode) else node.tag
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read the value {str(text)[:40]!r}: {str(exc)[:160]}", node.start_mark) from None


def _key_error(message: str, mark: Any, field: str) -> yaml.constructor.ConstructorError:
    """A key twice in one mapping, or a key that is not a string; its ``field`` attribute is the
    key's dotted path (:func:`yaml_error_field`)."""
    error = yaml.constructor.ConstructorError(None, None, message, mark)
    error.field = field  # type: ignore[attr-defined]
    return error


def yaml_error_field(exc: BaseException) -> str | None:
    """The dotted key a YAML error is about, where :func:`load_yaml` knows it."""
    field = getattr(exc, "field", None)
    return field if isinstance(field, str) else None


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_keys(loader: _BoundedLoader, root: yaml.Node) -> None:
    """Refuse a key that appears twice in one mapping (naming the second one's line) and a key
    that is not a string. Keys brought in by a merge (``<<: *anchor``) may be overridden, as
    YAML says; each mapping node is checked once (aliases share them)."""
    checked: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, prefix = stack.pop()
        if id(node) in checked:
            continue
        checked.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{prefix}[{i}]") for i, child in enumerate(node.value))
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                stack.append((value_node, prefix))
                continue
            text = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            path = f"{prefix}.{text}" if prefix else str(text)
            key = loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                shown = "null" if key is None else (str(key).lower() if isinstance(key, bool) else repr(key))
                raise _key_error(f"the key {shown} is not a string: names and fields are text (quote it: "
                                   f"'{text}')", key_node.start_mark, path)
            if key in first:
                raise _key_error(f"the key '{key}' appears twice in the same mapping (first on line {first[key]}); "
                                   "YAML would keep the last one silently", key_node.start_mark, path)
            first[key] = key_node.start_mark.line + 1
            stack.append((value_node, path))

def _check_expansion(root: yaml.Node) -> None:
    """Refuse a composed document whose expansion (every alias copied out) exceeds
    :data:`MAX_YAML_NODES`, or that refers to itself; measured on the shared graph, so in time
    proportional to the text, not to the expansion. The error names the innermost collection
    whose expansion crosses the limit."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise yaml.constructor.ConstructorError(None, None, "an alias refers to a collection that contains it",
                                                    node.start_mark)
        total = 1
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            open_nodes.add(key)
            children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
            for child in children:
                total += size(child)
                if total > MAX_YAML_NODES:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"expands to more than {MAX_YAML_NODES} values through its aliases; regress "
                        "refuses such documents (YAML alias bombs)", node.start_mark)
            open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


def _compose(loader: _BoundedLoader) -> yaml.Node | None:
    try:
        node = loader.get_single_node()
    except RecursionError as exc:  # nesting deeper than the composer's recursion allows
        raise yaml.YAMLError("nested too deeply") from exc
    if node is not None:
        _check_expansion(node)
        _check_keys(loader, node)
    return node


def compose_yaml(text: str) -> yaml.Node | None:
    """The YAML document's node graph, bounded as :func:`load_yaml` says."""
    loader = _BoundedLoader(text)
    try:
        return _compose(loader)
    finally:
        loader.dispose()


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses alias bombs before constructing anything: more than
    :data:`MAX_YAML_ALIASES` aliases, an expansion beyond :data:`MAX_YAML_NODES` values, or an
    alias inside what it names; and a key twice in one mapping or a key that is not a string
    (:func:`yaml_error_field` names the key). Raises ``yaml.YAMLError`` (a ``MarkedYAMLError`` with the line
    where it can), as ``safe_load`` does, so callers' messages name file and line."""
    loader = _BoundedLoader(text)
    try:
        node = _compose(loader)
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def yaml_error_line(exc: BaseException) -> int | None:
    """The 1-based line a YAML error points at, if it points anywhere."""
    mark = getattr(exc, "problem_mark", None)
    return mark.line + 1 if mark is not None else None


def utf8_error_line(raw: bytes, exc: UnicodeDecodeError) -> int:
    """The 1-based line of the first byte that is not UTF-8."""
    return raw.count(b"\n", 0, exc.start) + 1


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def value_problems(data: Any, prefix: str = "", *, finite: bool = True) -> list[tuple[str, str]]:
    """(dotted field, problem) for every infinite or NaN number (with ``finite``) and every
    string or key holding a lone surrogate (``"\\ud800"``: no UTF-8 file can hold it, so every
    later write of it fails), anywhere in ``data``."""
    problems: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(data, prefix)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, inner in value.items():
                inner_path = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and _has_surrogate(key):
                    problems.append((path or inner_path, f"the key {key!r} holds a lone surrogate, not valid Unicode text"))
                    continue
                stack.append((inner, inner_path))
        elif isinstance(value, list):
            stack.extend((inner, f"{path}[{i}]") for i, inner in enumerate(value))
        elif isinstance(value, str) and _has_surrogate(value):
            problems.append((path, f"{value[:40]!r} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                                   "not valid Unicode text"))
        elif finite and isinstance(value, float) and not math.isfinite(value):
            problems.append((path, f"must be a finite number, not {value!r} (an infinite or NaN bound switches its "
                                   "check off; leave the field out or set null for the default)"))
    problems.reverse()
    return problems


def yaml_key_lines(text: str) -> dict[str, int]:
    """Dotted key path -> 1-based line of every mapping key in a YAML document (for messages)."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str, seen: frozenset[int]) -> None:
        # ``seen``: an aliased mapping is walked once per path, never into itself.
        if isinstance(node, yaml.MappingNode) and id(node) not in seen:
            for key_node, value_node in node.value:
                path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path, seen | {id(node)})

    try:
        walk(compose_yaml(text), "", frozenset())
    except yaml.YAMLError:
        pass
    return lines


CANDIDATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
"""What a candidate name may be (as :class:`regress.records.CandidateSpec` checks it): a safe
path component, since names become directories (runs/<name>, scores/<name>, reports/<name>)."""


def check_candidate_name(name: str, *, what: str = "candidate name") -> str:
    """``name`` if it is a valid candidate name, else an :class:`~regress.errors.InputError`
    (exit 2): ``../../etc`` must never become a path under scores/ or reports/."""
    from regress.errors import InputError

    if not CANDIDATE_NAME.fullmatch(name):
        raise InputError(f"{what} {name!r} is not a candidate name: letters, digits, '-' and '_', "
                         "starting with a letter or digit, at most 100 characters")
    return name


def line_for(lines: dict[str, int], dotted: str) -> int | None:
    """The line of ``dotted`` in :func:`yaml_key_lines` output, else of its nearest parent key."""
    if dotted not in lines and "[" in dotted:  # noise.arms[0].name: the list's key, then its item's
        dotted = re.sub(r"\[\d+\]", "", dotted)
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
        from regress.engine_args import did_you_mean

        close = did_you_mean(str(loc[-1]), allowed) if allowed and loc else None
        if close is not None:  # a typo: the one name meant, not the whole list
            return path, f"unknown field: did you mean '{close}'?"
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


def url_problem(url: str) -> str | None:
    """Why ``url`` is no http(s) URL regress may ask, or None. Its authority must read as
    ``[user[:password]@]host[:port]``: a password holding an unencoded ``/``, ``?``, ``#`` or
    ``@`` would make the URL's host a piece of the password (``https://u:pa/ss@host`` asks a
    host named ``u``), so it must be percent-encoded (``%2F``, ``%3F``, ``%23``, ``%40``)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "not an http:// or https:// URL"
    try:
        parts.port
    except ValueError:
        return ("its host part is not host[:port] (a password holding '/', '?', '#' or '@' must be "
                "percent-encoded: %2F, %3F, %23, %40)")
    if not parts.hostname:
        return "it names no host"
    return None
