"""vLLM's engine argument names, to catch a misspelt ``engine_args`` key when params.yaml loads.

A typo such as ``kv_cache_dtpye`` would otherwise pass validation, build an environment, start an
engine, and fail there (vLLM refuses unknown keywords), or, worse, be dropped by a layer that
filters keywords. The names come from ``EngineArgs`` of the releases regress is checked against
(``regress/data/vllm_engine_args.json``, written by ``scripts/list_engine_args.py``). A key is
refused only when it is not among them *and* one of them is close to it: a key no release knows
and nothing resembles may be a newer release's argument, and the engine decides.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

NAMES_FILE = Path(__file__).parent / "data" / "vllm_engine_args.json"


@lru_cache(maxsize=1)
def known_engine_args() -> tuple[tuple[str, ...], frozenset[str]]:
    """(the releases listed, every engine argument name any of them has)."""
    data = json.loads(NAMES_FILE.read_text(encoding="utf-8"))
    return tuple(data), frozenset(name for names in data.values() for name in names)


def did_you_mean(word: str, choices: Any) -> str | None:
    """The closest of ``choices`` to ``word`` when one is close (difflib's ratio at least 0.8)."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.8)
    return close[0] if close else None


def misspelt_engine_arg(engine_args: dict[str, Any]) -> str | None:
    """What is wrong with the first misspelt key of ``engine_args`` (None: nothing)."""
    releases, names = known_engine_args()
    for key in engine_args:
        if key in names:
            continue
        close = did_you_mean(key, names)
        if close is not None:
            return (f"'{key}' is not an engine argument of vLLM ({', '.join(releases)}): "
                    f"did you mean '{close}'?")
    return None


TYPES_FILE = Path(__file__).parent / "data" / "vllm_engine_arg_types.json"
"""JSON types (``bool``, ``int``, ``float``, ``str``, ``null``) of the engine arguments whose
annotation in ``EngineArgs`` is that plain, the union over the releases listed (also written by
``scripts/list_engine_args.py``); arguments of richer types are left to the engine."""


@lru_cache(maxsize=1)
def engine_arg_types() -> dict[str, frozenset[str]]:
    """Engine argument name -> the JSON types vLLM's annotation allows."""
    data = json.loads(TYPES_FILE.read_text(encoding="utf-8"))
    return {name: frozenset(types) for name, types in data.items()}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "list" if isinstance(value, list) else "mapping" if isinstance(value, dict) else type(value).__name__


_WORDS = {"bool": "a boolean (true or false)", "int": "an integer", "float": "a number", "str": "a string",
          "null": "null"}


def engine_arg_type_problems(engine_args: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for every value of ``engine_args`` whose type vLLM's annotation of that
    argument does not allow (``max_model_len: true``, ``enforce_eager: 'yes'``): strictly, as YAML
    gives it (a boolean is not an integer, a quoted number not a number; an integer is a number)."""
    types = engine_arg_types()
    problems = []
    for key, value in engine_args.items():
        allowed = types.get(key)
        if not allowed:
            continue
        given = _json_type(value)
        if given in allowed or (given == "int" and "float" in allowed):
            continue
        wanted = " or ".join(_WORDS[t] for t in sorted(allowed, key=list(_WORDS).index) if t in _WORDS)
        problems.append((key, f"vLLM takes {wanted} for '{key}', not {given} {value!r}"))
    return problems
