"""Where regress keeps its caches: ``$REGRESS_HOME``, else ``~/.cache/regress``.

The data part of vLLM's own cache for each candidate environment lives there too
(:func:`vllm_cache_root`); its code part never does (:mod:`regress.engine.caches`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def regress_home() -> Path:
    """Root of regress's caches: ``$REGRESS_HOME`` or ``~/.cache/regress``."""
    return Path(os.environ.get("REGRESS_HOME") or Path.home() / ".cache" / "regress")


def vllm_cache_root(python: Path) -> Path:
    """The shared part of vLLM's cache for the environment of ``python``: one per environment,
    holding only ``modelinfos/`` (JSON); the engine's ``VLLM_CACHE_ROOT`` links to it.

    vLLM caches what it learns of a model class (``modelinfos/<class>.json``) under one name per
    class, stamped with the hash of the model's source file. Two vLLM versions with different
    sources, sharing the default ``~/.cache/vllm``, overwrite each other's entry, and each miss
    imports vLLM again in a subprocess: 7-8 s of every engine start in the demo, which alternates
    0.31.0 (the golden) and 0.32.0 (the candidates). What vLLM keeps there beside it (compiled
    code, pickles) is not shared (:mod:`regress.engine.caches`). A candidate's own ``env`` or the
    user's ``VLLM_CACHE_ROOT`` still wins."""
    prefix = Path(os.path.abspath(python)).parent.parent
    digest = hashlib.sha256(str(prefix).encode()).hexdigest()[:12]
    return regress_home() / "vllm-cache" / f"{prefix.name}-{digest}"
