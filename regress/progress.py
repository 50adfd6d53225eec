"""Progress on the terminal: rich progress bars on stderr for long work (stdout stays clean).

Errors, warnings and status lines may quote a remote answer (a server's error body, an engine's
log tail, pip's output, an index page): each goes through :func:`shown` (credentials redacted,
control characters and workflow commands neutralised) before it reaches the terminal.
"""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from regress.redact import redact
from regress.untrusted import printable

stderr_console = Console(stderr=True, highlight=False)


def shown(message: str) -> str:
    """``message`` as it may be printed: credentials redacted, then control characters and
    workflow-command prefixes neutralised (:func:`regress.untrusted.printable`), then rich markup
    escaped."""
    return escape(printable(redact(message)))


def print_error(message: str) -> None:
    """``error: message`` on stderr, never wrapped (CI logs and tests grep for file:line), and
    never with emoji codes replaced (a Redis key ``regress:watch:...`` must not become a watch)."""
    stderr_console.print(f"[red]error:[/red] {shown(message)}", soft_wrap=True, highlight=False, emoji=False)


def warn(message: str) -> None:
    """``warning: message`` on stderr, shown like :func:`print_error`: something the user should
    know that did not stop the command."""
    stderr_console.print(f"[yellow]warning:[/yellow] {shown(message)}", soft_wrap=True, highlight=False, emoji=False)


class _ShownFormatter(logging.Formatter):
    """A log record's line as :func:`print_error` would show it (without rich markup)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(redact(super().format(record)))


def guard_log_output() -> None:
    """Show log records like errors: what reaches stderr through Python's last-resort handler
    (no handler configured, as in the ``regress`` command) may quote a webhook's or a server's
    answer, so it is redacted and neutralised too. Called once by the command's boundary."""
    if logging.lastResort is not None:
        logging.lastResort.setFormatter(_ShownFormatter())


_PHASE_LABELS = {"generate": "generating", "teacher_force": "teacher forcing"}


class RichProgress:
    """A :class:`regress.replay.ProgressSink` drawing one bar per phase, counted in prompts."""

    def __init__(self, title: str, console: Console | None = None):
        self.title = title
        self.console = console or stderr_console
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("prompts"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._tasks: dict[str, Any] = {}
        self._last_status = ""

    def __enter__(self) -> "RichProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def status(self, message: str) -> None:
        # pip prints many lines; show them on one refreshing line rather than flooding the log.
        if message.startswith("pip: "):
            if "status" not in self._tasks:
                self._tasks["status"] = self._progress.add_task("", total=None)
            self._progress.update(self._tasks["status"], description=shown(message[:110]))
            return
        if "status" in self._tasks:
            self._progress.remove_task(self._tasks.pop("status"))
        if message != self._last_status:
            self._progress.console.print(f"[dim]{escape(self.title)}:[/dim] {shown(message)}", highlight=False)
            self._last_status = message

    def start(self, phase: str, total: int) -> None:
        label = escape(f"{self.title} {_PHASE_LABELS.get(phase, phase)}")
        self._tasks[phase] = self._progress.add_task(label, total=total)

    def advance(self, phase: str, done: int) -> None:
        if phase in self._tasks:
            self._progress.advance(self._tasks[phase], done)
