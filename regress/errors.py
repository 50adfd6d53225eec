"""The one exception tree of regress.

Every exception regress raises on purpose is defined here, and only here. Errors from outside
(pip, vLLM, Redis, Celery, the package index, the filesystem, YAML, JSON, zlib, numpy) are
caught by type where they enter, never with a catch-all, and re-raised as one of these with
the original chained as ``__cause__``. The CLI turns them into a one-paragraph message and an
exit code; users never see a traceback for their own mistakes.

::

    RegressError                      any failure regress knows how to explain
    ├── InputError          exit 2    the user's input is wrong; fix it and run again
    │   ├── ConfigError               params.yaml / candidate spec: file, line, field, allowed, given
    │   │   └── ConfigProblems        several of them at once (params.yaml is validated whole)
    │   ├── DatasetError              prompt set or golden file: file, line, field
    │   ├── ChatTemplateMissing       a ``messages`` prompt for a tokenizer without a chat template
    │   └── UnknownPluginError        a backend, metric or trigger name nobody registered
    ├── RunError            exit 3    the check could not run; retrying may help
    │   ├── CandidateEnvError         creating a candidate's virtual environment failed
    │   │   ├── TransientEnvError     ... for a passing reason: a retry may succeed (index down, disk full)
    │   │   └── UnresolvableEnvError  ... because the requirement cannot be installed here at all
    │   ├── EngineError               the engine failed to start or died (names the candidate)
    │   ├── ProtocolError             a message between orchestrator and engine process broke the
    │   │                             protocol (internal: the client turns it into EngineError)
    │   ├── MissingDependencyError    an optional package is not installed (names it)
    │   ├── BrokerError               the Celery broker is unreachable, or shards stopped arriving
    │   ├── ShardsFailedError         shards of a run failed on the workers (names each)
    │   ├── ShardFailed               one shard failed on a worker (crosses the result backend)
    │   ├── ServerHTTPError           a served candidate's server answered with an error status (names the URL)
    │   ├── ServerReplyError          a served candidate's server answered something regress will not score
    │   ├── PackageIndexError         the package index is unreachable or answered nonsense (names the URL)
    │   ├── WatchStateError           the watcher's state store is unreachable or holds a malformed record
    │   ├── PostError                 a webhook or GitHub API POST failed (status and body when answered)
    │   ├── CheckCommandFailed        watch.check_command could not run or exited neither 0 nor 1
    │   ├── CheckFailed               a release's check could not run on a Celery worker
    │   └── MessageRefused            a worker refused a broker message (unsigned, forged, unsafe)
    │   └── PhaseDeadlineExceeded     a phase of a command ran past its deadline (names the phase)
    │   └── IntegrityError            a shard of a complete run is not what its manifest recorded
    │   └── MeasureError              a metric value is NaN or infinite where its spec says it cannot be judged
    ├── ProjectLocked       exit 2    another regress command is writing the project (names it)
    └── StorageError        exit 2    a results directory or state file is missing, incomplete or corrupt
        └── NoiseFloorError           golden/noise.json is not the one `regress noise` recorded for this golden

Exit code 1 is reserved for "a regression was found": it is a verdict, not an error. Any
exception that is *not* a :class:`RegressError` is a bug (in regress or a plugin) or a failure
nobody mapped yet: the CLI exits 3 with a one-line message naming its type, and writes the
full traceback to a crash log (``$REGRESS_HOME/logs/crash-<time>-<pid>.log``), so that CI never
reads a crash as a verdict.

``ShardFailed`` and ``CheckFailed`` take one plain string: Celery rebuilds a task's exception
from its class and arguments on the other side of the JSON result backend.
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


class ConfigProblems(ConfigError):
    """Several configuration problems found in one pass (params.yaml is validated whole, so the
    user fixes them all before running again). ``problems`` holds each one; the message lists
    them one per line. ``file``, ``line`` and ``field`` (and ``message``) are the first one's."""

    def __init__(self, problems: list[ConfigError]):
        if not problems:
            raise ValueError("ConfigProblems needs at least one problem")
        first = problems[0]
        super().__init__(first.message, file=first.file, line=first.line, field=first.field)
        self.problems = list(problems)
        # Each problem on its own line, whole (file:line: field ...), so CI logs can be grepped.
        self.args = (f"{len(problems)} problems in {first.file or 'the configuration'}:\n"
                     + "\n".join(f"  {problem}" for problem in problems),)

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (raised by the prompt-set reader's ``object_pairs_hook``
    and turned into a :class:`DatasetError` naming file, line and key before it leaves the reader)."""

    def __init__(self, key: str):
        self.key = key
        super().__init__(key)


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


class ChatTemplateMissing(InputError):
    """A ``messages`` prompt reached a tokenizer without a chat template (raised in the engine
    process, which answers it as an input error naming the prompt)."""


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


class TransientEnvError(CandidateEnvError):
    """Building a candidate's environment failed for a reason that says nothing about the
    requirement: the package index unreachable or answering errors, the network, a full disk, a
    timeout, pip killed. A retry may succeed (a bisect retries the version when resumed).
    ``cause`` says which, in a few words."""

    def __init__(self, message: str, cause: str = "a passing failure: a retry may succeed"):
        self.cause = cause
        super().__init__(message)


class UnresolvableEnvError(CandidateEnvError):
    """The requirement cannot be installed here, whenever it is tried: no such release, no
    distribution for this platform or Python, requirements that conflict, a build that fails, an
    install that cannot import what an engine needs. ``cause`` says which, in a few words."""

    def __init__(self, message: str, cause: str = "the requirement cannot be installed"):
        self.cause = cause
        super().__init__(message)


class EngineError(RunError):
    """The engine failed to start, rejected a request, or died. Names the candidate."""

    def __init__(self, message: str, *, candidate: str, retryable: bool = True, log: str | None = None):
        self.candidate = candidate
        self.retryable = retryable
        self.log = log
        super().__init__(f"candidate '{candidate}': {message}")


class ProtocolError(RunError):
    """A message between the orchestrator and the engine process does not follow
    :mod:`regress.engine.protocol` (not JSON, another version, a missing or mistyped field).

    Internal to the two processes: the orchestrator turns it into an :class:`EngineError`
    naming the candidate, the engine process into an error reply.
    """


class MissingDependencyError(RunError):
    """An optional dependency is missing; the message names the package to install."""


class BrokerError(RunError):
    """The Celery broker cannot be reached, or shards stopped arriving; names the broker (never
    its password)."""


class ShardsFailedError(RunError):
    """Shards of a run failed on the workers; the run is incomplete (finished shards are kept)."""


class ShardFailed(RunError):
    """One shard could not be run on a worker; the message names the candidate, shard and worker.

    One plain string argument, so that it crosses the JSON result backend intact."""


class ServerHTTPError(RunError):
    """A server replayed through (``backend: server``) answered a request with an error status.
    Raised in the engine process; the orchestrator gets it as an engine error naming the candidate."""

    def __init__(self, url: str, status: int, body: str):
        self.status = status
        super().__init__(f"{url} answered HTTP {status}: {body[:500]}")


class ServerReplyError(RunError):
    """A server replayed through (``backend: server``) answered something regress will not score:
    not JSON, past its size limit, a stream cut short, a logprob that is not a finite number <= 0,
    a token id outside the vocabulary, rows that do not match the tokens. Names the URL and, once
    known, the prompt: the backend knows only the request's place in its batch (``index``), the
    engine process names the prompt (:meth:`located`). Exit 3, never a score."""

    def __init__(self, problem: str, *, url: str | None = None, prompt: str | None = None,
                 index: int | None = None):
        self.problem, self.url, self.prompt, self.index = problem, url, prompt, index
        where = f"the server at {url}" if url else "the server"
        if prompt is not None:
            where += f", prompt '{prompt}'"
        elif index is not None:
            where += f", request {index} of the batch"
        super().__init__(f"{where}: {problem}")

    def located(self, *, url: str | None = None, prompt: str | None = None,
                index: int | None = None) -> "ServerReplyError":
        """The same problem with the URL, prompt or index filled in where still unknown."""
        return ServerReplyError(self.problem, url=self.url or url, prompt=self.prompt or prompt,
                                index=self.index if self.index is not None else index)


class PackageIndexError(RunError):
    """The package index could not be reached or gave an answer that is not a PEP 691 project
    page (or holds absurd values). Names the URL (without credentials). A retry (the next tick)
    may help."""

    def __init__(self, message: str, *, url: str):
        self.url = url
        super().__init__(f"{url}: {message}")


class WatchStateError(RunError):
    """The watcher's state store cannot be reached (Redis down) or holds a record that does not
    parse (names the key); nothing was changed. Retry, or repair the record."""


class PostError(RunError):
    """A JSON POST (webhook, GitHub API) failed: unreachable, or an answer outside 2xx
    (``status`` and ``body`` then set)."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        self.status = status
        self.body = body
        super().__init__(message)


class CheckCommandFailed(RunError):
    """``watch.check_command`` could not run or exited with neither 0 (pass) nor 1 (regression)."""


class CheckFailed(RunError):
    """A release's check could not run on a Celery worker; the version is released for the next
    tick. One plain string argument, so it crosses the JSON result backend intact."""


class IntegrityError(RunError):
    """A shard of a run marked complete does not match what the manifest recorded for it (its
    sha256 and size, its run id, its shard fingerprint), or is missing: the bytes changed after
    the run finished, or a shard of another run was copied in. Names the shard. Exit 3, not 2:
    the user's input is fine, the stored run is not (re-run it, or restore it from DVC)."""


class MeasureError(RunError):
    """A metric value is NaN or infinite and its spec says that means the measure could not be
    taken (``nonfinite="error"``, :class:`regress.metrics.spec.Output`): no verdict comes from a
    broken measure. Names the prompt and the value."""


class PhaseDeadlineExceeded(RunError):
    """A phase of a command (environment, engine start, generation, teacher forcing, scoring,
    report) did not finish within its deadline (:mod:`regress.watchdog`): it hung, or it is
    slower than its limit allows. Names the phase, the limit and how to raise it."""

    def __init__(self, message: str, phase: str = "", limit_s: float = 0.0):
        self.phase, self.limit_s = phase, limit_s
        super().__init__(message)


class MessageRefused(RunError):
    """A worker refused a broker message before running anything: unsigned, tampered, signed
    with another key, stale, or asking for what a message may not choose (a command, a path
    outside the results directory, a direct-URL requirement, a loader variable). One plain
    string argument, so it crosses the JSON result backend intact."""


class ProjectLocked(RegressError):
    """Another regress command holds the project's lock (:mod:`regress.project_lock`): it is
    writing the same runs, scores, reports or bisect state. Names it (pid, command). Exit 2: run
    the command again once that one has finished."""

    exit_code = EXIT_INPUT


class StorageError(RegressError):
    """A results directory is missing, incomplete or does not parse."""

    exit_code = EXIT_INPUT


class NoiseFloorError(StorageError):
    """``golden/noise.json`` (which widens thresholds) is not the file ``regress noise`` recorded in
    the golden's manifest: measured against another golden, changed since, or never recorded.
    Names the file; never used then (run ``regress noise`` again)."""
