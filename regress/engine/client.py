"""The orchestrator's handle on one engine process (``python -m regress.engine.server``).

The engine always runs in a subprocess of the candidate's interpreter: a different vLLM
version per environment, vLLM's spawn-based start-up kept out of the orchestrator, a crash
(vLLM on CPU can die with SIGILL) contained and reported as a retryable error naming the
candidate. The process loads the engine once and serves shards until closed.

This is the one place where the engine's replies enter regress: whatever the process sends
(an error reply, a message that does not follow :mod:`regress.engine.protocol`, nothing at all)
becomes an :class:`~regress.errors.EngineError` naming the candidate, or an
:class:`~regress.errors.InputError` when the engine says the request was wrong for the model.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import regress
from regress.engine.caches import SHIM_PREFIX, set_cache_environment
from regress.engine.protocol import (
    INPUT_ERROR,
    EngineInfo,
    ErrorReply,
    ExitRequest,
    LoadReply,
    LoadRequest,
    MemoryReply,
    MemoryRequest,
    MemoryUsage,
    ProgressEvent,
    ProtocolError,
    Reply,
    Request,
    ResetReply,
    ResetRequest,
    ShardReply,
    ShardRequest,
    ShardSummary,
    VocabReply,
    VocabRequest,
    decode_reply,
    encode,
)
from regress.envs.spec import FOREIGN_INTERPRETER_VARIABLES
from regress.errors import EngineError, InputError
from regress.records import CandidateSpec
from regress.redact import without_secrets
from regress.watchdog import register_child, unregister_child

ProgressHandler = Callable[[ProgressEvent], None]
R = TypeVar("R", bound=Reply)

SERVER_MODULE = "regress.engine.server"
"""What the candidate's interpreter runs (``python -m``)."""

ENGINE_DEFAULT_ENV = {
    # The multi-process engine died with SIGILL at its first forward pass on these CPUs; the
    # in-process engine did not, and vLLM's reproducibility guide recommends it offline anyway.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONNOUSERSITE": "1",
    "PYTHONUNBUFFERED": "1",
}
"""Set for every engine process; a candidate's ``env`` overrides them."""


def engine_environment(candidate: CandidateSpec) -> dict[str, str]:
    """The variables regress sets for this candidate's engine (recorded in the manifest)."""
    return {**ENGINE_DEFAULT_ENV, **candidate.env}


DEFAULT_LOAD_TIMEOUT_S = 1800.0
# The longest line read from an engine process. Its messages are small (results go to shard
# files; a load reply with the engine's facts is some kB); a longer line is a library printing to
# the protocol stream, or a hostile engine filling the orchestrator's memory.
MAX_MESSAGE_BYTES = 16 << 20
"""How long an engine may take to start (environment imports, weights, KV cache) by default."""


class EngineProcess:
    """One running engine for one candidate."""

    def __init__(self, candidate: CandidateSpec, python: Path, log_path: Path, *, load_timeout_s: float | None = None):
        self.candidate = candidate
        self.python = python
        self.log_path = log_path
        self.load_timeout_s = DEFAULT_LOAD_TIMEOUT_S if load_timeout_s is None else load_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._shim: tempfile.TemporaryDirectory[str] | None = None
        self._buffer = bytearray()
        self._launched = 0.0
        self.info: EngineInfo = {}

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, vocab_out: Path | None = None) -> EngineInfo:
        """Start the process and load the engine. Returns the engine's facts for the manifest.

        With ``vocab_out``, the engine also writes every token id's text there (for reports).
        """
        self.launch(vocab_out)
        return self.wait_loaded()

    def launch(self, vocab_out: Path | None = None) -> None:
        """Start the process and send it the load request without waiting for the engine: it
        imports and loads while the caller goes on (:meth:`wait_loaded` collects its reply)."""
        remove_stale_shims()
        self._shim = tempfile.TemporaryDirectory(prefix=f"{SHIM_PREFIX}{os.getpid()}-")
        env = _prepare_shim(self.candidate, Path(self._shim.name), python=self.python)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                [str(self.python), "-m", SERVER_MODULE],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                cwd=self._shim.name, start_new_session=True, preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise EngineError(f"cannot start {self.python}: {exc}", candidate=self.candidate.name) from exc
        finally:
            log.close()
        # A phase past its deadline kills the engine's process group (regress.watchdog).
        register_child(self._proc.pid, group=True)
        load = LoadRequest(spec=_absolute_paths(self.candidate.engine_spec()),
                           vocab_out=str(Path(vocab_out).resolve()) if vocab_out is not None else None)
        self._launched = time.monotonic()
        self._send(load, "engine start")

    def wait_loaded(self) -> EngineInfo:
        """The engine's reply to :meth:`launch`'s load request (its facts for the manifest); the
        load timeout counts from the launch."""
        deadline = self._launched + self.load_timeout_s
        self.info = self._await(LoadReply, "load", deadline=deadline, what="engine start").info
        return self.info

    def run_shard(self, request: ShardRequest, *, timeout_s: float | None = None,
                  on_progress: ProgressHandler | None = None) -> ShardSummary:
        """Run one shard; its results are in ``request.out`` when this returns."""
        return self.request(request, ShardReply, timeout_s=timeout_s, on_progress=on_progress,
                            what=f"shard {request.index}").result

    def memory(self) -> MemoryUsage:
        """Peak memory of the engine process so far."""
        return self.request(MemoryRequest(), MemoryReply, timeout_s=60, what="memory query").memory

    def write_vocabulary(self, out: str | Path) -> None:
        """Have the engine write its vocabulary (tokens.json) to ``out``."""
        self.request(VocabRequest(out=str(out)), VocabReply, timeout_s=600, what="vocabulary")

    def reset_cache(self) -> bool:
        """Have the engine forget what earlier requests computed (its prefix cache); True when
        nothing of them is left to reuse (:class:`~regress.engine.protocol.ResetReply`)."""
        return self.request(ResetRequest(), ResetReply, timeout_s=60, what="cache reset").reset

    def close(self, *, ask_first: bool = True) -> None:
        """Ask the process to exit; kill it if it does not. Without ``ask_first``, kill it at once
        (an engine still loading reads an exit request only once loaded)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if not ask_first:
                self.kill(proc)
            else:
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(encode(ExitRequest()))
                    proc.stdin.flush()
                    proc.stdin.close()
                    proc.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    self.kill(proc)
        if proc is not None:
            # The engine may have started helper processes (vLLM's multi-process mode); they share
            # the engine's process group and must not outlive it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            unregister_child(proc.pid)
        if self._shim is not None:
            self._shim.cleanup()
            self._shim = None

    def abandon(self) -> None:
        """Stop a launched engine that will not be used, at once, and remove its log."""
        self.close(ask_first=False)
        self.log_path.unlink(missing_ok=True)

    def move_log(self, path: Path) -> None:
        """Have the engine's log continue at ``path``: the file is renamed, and the process keeps
        writing to it. On another filesystem the log stays where it is (errors name it)."""
        if path == self.log_path:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(self.log_path, path)
        except OSError:
            return
        self.log_path = path

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # -- protocol ----------------------------------------------------------------------

    def request(
        self,
        message: Request,
        expected: type[R],
        *,
        timeout_s: float | None = None,
        on_progress: ProgressHandler | None = None,
        what: str = "request",
    ) -> R:
        """Send one request and wait for its reply (of type ``expected``), passing progress
        events to ``on_progress``."""
        self._send(message, what)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self._await(expected, message.op, deadline=deadline, on_progress=on_progress, what=what)

    def _send(self, message: Request, what: str) -> None:
        proc = self._proc
        if proc is None:
            raise EngineError("the engine process is not running", candidate=self.candidate.name)
        try:
            assert proc.stdin is not None
            proc.stdin.write(encode(message))
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._died(what) from exc

    def _await(self, expected: type[R], op: str, *, deadline: float | None,
               on_progress: ProgressHandler | None = None, what: str = "request") -> R:
        if self._proc is None:
            raise EngineError("the engine process is not running", candidate=self.candidate.name)
        while True:
            line = self._read_line(deadline, what)
            try:
                reply = decode_reply(line)
            except ProtocolError as exc:
                raise self._malformed(what, str(exc)) from None
            if isinstance(reply, ProgressEvent):
                if on_progress:
                    on_progress(reply)
                continue
            if isinstance(reply, ErrorReply):
                raise self._failed(what, reply)
            if not isinstance(reply, expected):
                raise self._malformed(what, f"a '{reply.op}' reply came to a '{op}' request")
            return reply

    def _failed(self, what: str, reply: ErrorReply) -> InputError | EngineError:
        error = reply.error
        if error["type"] == INPUT_ERROR:
            return InputError(f"candidate '{self.candidate.name}': {error['message']}")
        detail = error["traceback"].strip().splitlines()[-1:] or [error["message"]]
        return EngineError(
            f"{what} failed: {error['message']}\n  ({detail[0]}; engine log: {self.log_path})",
            candidate=self.candidate.name, retryable=False, log=str(self.log_path),
        )

    def _malformed(self, what: str, problem: str) -> EngineError:
        # Not retryable: an engine process that breaks the protocol once (a library writing to
        # the protocol stream, a mismatched regress) would do it again after a restart.
        return EngineError(
            f"the engine process sent a malformed message during {what}: {problem} (engine log: {self.log_path})",
            candidate=self.candidate.name, retryable=False, log=str(self.log_path),
        )

    def _read_line(self, deadline: float | None, what: str) -> bytes:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            scanned = 0  # the buffer before this is known to hold no newline: each byte is searched once
            while (end := self._buffer.find(b"\n", scanned)) < 0:
                scanned = len(self._buffer)
                if scanned > MAX_MESSAGE_BYTES:
                    self.kill(proc)
                    raise self._malformed(what, f"a line of more than {MAX_MESSAGE_BYTES >> 20} MiB without an end; "
                                                "no message of this protocol is that long")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self.kill(proc)
                    raise EngineError(f"{what} timed out; the engine process was killed (log: {self.log_path})",
                                      candidate=self.candidate.name, log=str(self.log_path))
                if not selector.select(timeout=remaining if remaining is not None else 5.0):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise self._died(what)
                self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        return line

    def _died(self, what: str) -> EngineError:
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill(proc)
                code = proc.returncode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        tail = _tail(self.log_path)
        return EngineError(
            f"the engine process {how} during {what}; this is retryable.\n"
            f"Last lines of the engine log ({self.log_path}):\n{tail}",
            candidate=self.candidate.name, retryable=True, log=str(self.log_path),
        )


def _prepare_shim(candidate: CandidateSpec, shim: Path, *, python: Path) -> dict[str, str]:
    """Fill the engine process's private directory ``shim`` (the regress package, a temp
    directory) and return the process's environment variables for the engine run by ``python``."""
    # The candidate environment holds vLLM, not regress: expose only the regress package
    # directory to it, through a private directory on PYTHONPATH.
    os.symlink(Path(regress.__file__).resolve().parent, shim / "regress")
    # Nor the orchestrator's secrets (broker URL and key, tokens, watcher URLs, passwords): the
    # engine runs third-party code that has no use for them. A candidate's own ``env`` may still
    # set any variable on purpose.
    # Nor the variables that belong to this interpreter (FOREIGN_INTERPRETER_VARIABLES).
    env = {k: v for k, v in without_secrets(os.environ).items() if k not in FOREIGN_INTERPRETER_VARIABLES}
    env.update(engine_environment(candidate))
    # The server backend's API key, by the variable the candidate names: passed to this engine
    # alone, whatever its name looks like, and never recorded (the manifest shows only
    # engine_environment, which does not hold it).
    key_variable = candidate.server.api_key_env if candidate.server is not None else None
    if key_variable and key_variable in os.environ:
        env[key_variable] = os.environ[key_variable]
    # The candidate may add its own paths (a custom backend module, say) after the shim.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), candidate.env.get("PYTHONPATH")) if p)
    # vLLM leaves a file in the temp directory per engine start (its distributed init file,
    # never removed because the engine process exits without teardown): give the engine a
    # private temp directory that goes with the shim.
    private_tmp = shim / "tmp"
    private_tmp.mkdir()
    env["TMPDIR"] = str(private_tmp)
    # vLLM's and torch's caches: JSON shared, code where only this user can write
    # (regress.engine.caches says what is loaded how).
    set_cache_environment(env, python=python, private_tmp=private_tmp, chosen=candidate.env)
    return env


def remove_stale_shims(directory: str | None = None) -> None:
    """Remove shim directories whose owner process is gone (a worker killed with SIGKILL cannot
    clean up; its shim holds the engine's temp files)."""
    import shutil

    root = Path(directory or tempfile.gettempdir())
    for path in root.glob(f"{SHIM_PREFIX}*-*"):
        owner = path.name[len(SHIM_PREFIX):].split("-", 1)[0]
        if not owner.isdigit():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


def _die_with_parent() -> None:
    """In the engine process, before exec: be killed when the process that started it dies.

    A Celery worker killed with SIGKILL cannot close its engine; without this the engine
    would finish its shard as an orphan, holding the GPU the replacement worker needs.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the orchestrator's killpg still applies
        pass


def _absolute_paths(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine process runs in another directory: make local paths absolute."""
    out = dict(spec)
    for key in ("model", "tokenizer", "chat_template"):
        value = out.get(key)
        if isinstance(value, str) and Path(value).exists():
            out[key] = str(Path(value).resolve())
    return out


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("  " + line for line in text[-lines:])
