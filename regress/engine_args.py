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
