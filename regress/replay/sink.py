"""Where a replay says what it is doing.

The CLI draws progress bars from it (:class:`regress.progress.RichProgress`); library callers
may pass nothing."""

from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    """Receives a replay's stages and counted progress."""

    def status(self, message: str) -> None:
        """A new stage began (creating an environment, loading the engine...)."""

    def start(self, phase: str, total: int) -> None:
        """A counted phase begins (``generate`` or ``teacher_force``, counted in prompts)."""

    def advance(self, phase: str, done: int) -> None:
        """``done`` more prompts finished in ``phase``."""


class SilentProgress:
    """A sink that shows nothing."""

    def status(self, message: str) -> None:
        pass

    def start(self, phase: str, total: int) -> None:
        pass

    def advance(self, phase: str, done: int) -> None:
        pass
