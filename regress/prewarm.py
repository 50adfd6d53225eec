"""Imports the scoring will need, made in a background thread while a replay waits on its engine.

A check's main thread sits in ``select()`` for the whole replay (the engine's load and every
shard: tens of seconds), and only after it does the scoring import what it uses. ``scipy.stats``
is most of that: 0.43 s of a ``regress check`` that costs 1.16x its bare replay (measured in
docs/benchmarks.md, "What a check costs"). Imported beside the engine instead, it is free.

Only third-party modules that nothing on the replay path imports, so the two threads never wait
on each other's module locks; a failed import here is ignored: the scoring's own import raises
it where errors are handled.
"""

from __future__ import annotations

import importlib
import threading

SCORING_IMPORTS: tuple[str, ...] = ("scipy.stats",)
"""What scoring imports after a replay and the replay never does (regress.stats, regress.quality,
regress.metrics.sampled, regress.noise.beyond)."""


def import_in_background(modules: tuple[str, ...] = SCORING_IMPORTS) -> threading.Thread:
    """Start importing ``modules`` in a daemon thread; returns the thread (tests join it)."""

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - see the module's docstring
                pass

    thread = threading.Thread(target=load, name="regress-prewarm", daemon=True)
    thread.start()
    return thread
