"""The one exception tree of regress.

Errors from outside (pip, vLLM, the filesystem, YAML, JSON) are caught where they enter
and re-raised as one of these, with the original chained as ``__cause__``. The CLI turns
them into a one-paragraph message and an exit code; users never see a traceback for
their own mistakes.

::

    RegressError                      any failure regress knows how to explain
    ├── InputError          exit 2    the user's input is wrong; fix it and run again
    │   ├── ConfigError               params.yaml / candidate spec: file, field, allowed, given
    │   ├── DatasetError              prompt set or golden file: file, line, field
    │   └── UnknownPluginError        a backend or metric name nobody registered
    ├── RunError            exit 3    the check could not run; retrying may help
    │   ├── CandidateEnvError         creating a candidate's virtual environment failed
    │   ├── EngineError               the engine failed to start or died (names the candidate)
    │   └── MissingDependencyError    an optional package is not installed (names it)
    └── StorageError        exit 2    a results directory is missing, incomplete or corrupt

Exit code 1 is reserved for "a regression was found": it is a verdict, not an error.
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_INPUT = 2
EXIT_RUN_FAILED = 3


class RegressError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code: int = EXIT_RUN_FAILED


class InputError(RegressError):
    """The user's input (command line, configuration, data) is wrong."""

    exit_code = EXIT_INPUT


class ConfigError(InputError):
    """A configuration value is wrong: says which file and field, what is allowed, what was given."""

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        line: int | None = None,
        field: str | None = None,
    ):
        self.file = str(file) if file is not None else None
        self.line = line
        self.field = field
        self.message = message
        where = (self.file or "") + (f":{line}" if self.file and line is not None else "")
        if field:
            where += (": " if where else "") + f"field '{field}'"
        super().__init__(f"{where}: {message}" if where else message)


class DatasetError(InputError):
    """A prompt set or golden file is malformed: says which file, line and field."""

    def __init__(
        self,
        message: str,
        *,
        file: str | Path,
        line: int | None = None,
        field: str | None = None,
    ):
        self.file = str(file)
        self.line = line
        self.field = field
        self.message = message
        where = self.file + (f":{line}" if line is not None else "")
        if field:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")


class UnknownPluginError(InputError):
    """A plugin name that is not registered; the message lists the known ones."""

    def __init__(self, kind: str, name: str, known: list[str]):
        self.kind, self.name, self.known = kind, name, known
        super().__init__(f"unknown {kind} '{name}'; known {kind}s: {', '.join(sorted(known))}")


class RunError(RegressError):
    """The check could not be carried out; the input may be fine and a retry may help."""

    exit_code = EXIT_RUN_FAILED


class CandidateEnvError(RunError):
    """Creating or using a candidate's virtual environment failed."""


class EngineError(RunError):
    """The engine failed to start, rejected a request, or died. Names the candidate."""

    def __init__(self, message: str, *, candidate: str, retryable: bool = True, log: str | None = None):
        self.candidate = candidate
        self.retryable = retryable
        self.log = log
        super().__init__(f"candidate '{candidate}': {message}")


class MissingDependencyError(RunError):
    """An optional dependency is missing; the message names the package to install."""


class StorageError(RegressError):
    """A results directory is missing, incomplete or does not parse."""

    exit_code = EXIT_INPUT
