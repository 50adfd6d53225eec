"""regress: catch output regressions from LLM inference upgrades before rollout.

Importing regress is cheap: it never imports torch or vllm. The public API is loaded on first
use::

    from regress import load_prompt_set, load_params, load_run, replay
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "load_prompt_set": "regress.datasets",
    "load_params": "regress.config",
    "load_run": "regress.runs",
    "RunResult": "regress.runs",
    "replay": "regress.replay",
    "CandidateSpec": "regress.records",
    "RunManifest": "regress.records",
    "Generation": "regress.records",
    "PromptRecord": "regress.records",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'regress' has no attribute {name!r}")
