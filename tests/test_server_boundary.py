"""The server backend's boundary with a vLLM server it does not trust (issue 26, items 3 to 5).

Every test talks to a real listening socket (tests/fake_openai_server.py: http.server in a
thread, or a process that regress starts), never to a mock of the client:

- the API key never follows a redirect, and every request has a deadline and a byte limit;
- a malformed answer (a stream cut short, text without token ids, a logprob that is NaN, infinite
  or positive, an id outside the vocabulary, rows that do not match the tokens, JSON cut short)
  is a ServerReplyError naming the request (exit 3 naming the prompt through the command), never
  a score; a max_model_len that cannot be true is refused, and teacher forcing cut to a server's
  max_model_len is recorded per prompt;
- the server regress starts is the one it talks to (a Unix socket in a private directory), even
  when another local process holds the TCP port it would have picked.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from conftest import run_cli
from fake_openai_server import FakeOpenAIServer

from regress.backends.base import GenerationRequest
from regress.backends.vllm_server import VllmServerBackend
from regress.errors import RunError, ServerHTTPError, ServerReplyError
from regress.records import ResolvedSampling

KEY_VARIABLE = "REGRESS_TEST_BOUNDARY_KEY"
KEY_VALUE = "sk-boundary-5d1e9a-never-elsewhere"
FAKE = Path(__file__).with_name("fake_openai_server.py")
K = 3
MAX_TOKENS = 4


def _backend(fixture_model: Path, url: str | None, **server: Any) -> VllmServerBackend:
    settings = {"url": url, "api_key_env": KEY_VARIABLE, **server} if url else {"api_key_env": KEY_VARIABLE, **server}
    return VllmServerBackend({"model": str(fixture_model), "backend": "server", "server": settings})


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, KEY_VALUE)


def _sampling(**over: Any) -> dict[str, Any]:
    return ResolvedSampling(max_tokens=MAX_TOKENS, logprobs=K, **over).model_dump()


def _requests(backend: VllmServerBackend, *payloads: dict[str, Any]) -> list[GenerationRequest]:
    return [GenerationRequest(backend.render(p), _sampling()) for p in payloads]


TWO_PROMPTS = ({"prompt": "The cat sat on the"}, {"prompt": "A good cup of tea starts with"})


def _second(body: dict[str, Any], first_ids: list[int]) -> bool:
    """Whether ``body`` is not the first prompt's request (tampering hits request 1 only)."""
    return body.get("prompt", [])[: len(first_ids)] != first_ids


def _no_key_elsewhere(elsewhere: FakeOpenAIServer) -> None:
    assert elsewhere.requests == [], elsewhere.requests  # nothing followed the redirect, the key included


def _redirect(status: int, location: str) -> Callable[[Any], None]:
    def handle(h: Any) -> None:
        h.send_response(status)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return handle


# -- item 3: redirects, deadlines, limits ----------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions"])
def test_the_key_never_follows_a_redirect_of_a_pre_run_check(fixture_model, key, status, path):
    with FakeOpenAIServer(str(fixture_model), key=KEY_VALUE) as elsewhere:
        with FakeOpenAIServer(str(fixture_model), key=KEY_VALUE,
                              routes={path: _redirect(status, elsewhere.url + path)}) as fake:
            backend = _backend(fixture_model, fake.url)
            with pytest.raises(ServerHTTPError, match="redirect") as caught:
                backend.load()
    assert caught.value.status == status and caught.value.exit_code == 3
    assert KEY_VALUE not in str(caught.value)
    _no_key_elsewhere(elsewhere)


@pytest.mark.parametrize("target", ["other-port", "other-host-name", "other-scheme"])
def test_a_redirected_version_check_sends_nothing_elsewhere(fixture_model, key, target):
    """``/version`` is optional (its failure leaves the version unknown), but its redirect is not
    followed either: the key stays at the server's origin."""
    with FakeOpenAIServer(str(fixture_model)) as elsewhere:
        with FakeOpenAIServer(str(fixture_model), key=KEY_VALUE) as fake:
            location = {"other-port": elsewhere.url, "other-host-name": f"http://localhost:{fake.port}",
                        "other-scheme": f"https://127.0.0.1:{elsewhere.port}"}[target] + "/version"
            fake.routes["/version"] = _redirect(302, location)
            backend = _backend(fixture_model, fake.url)
            backend.load()
            version_requests = [r for r in fake.requests if r[1] == "/version"]
    assert backend.versions()["server vllm"] is None
    assert len(version_requests) == 1  # not even a same-server, other-name hop
    _no_key_elsewhere(elsewhere)


@pytest.mark.parametrize("phase", ["generate", "teacher_force"])
def test_the_key_never_follows_a_redirect_of_a_replay_request(fixture_model, key, phase):
    with FakeOpenAIServer(str(fixture_model), key=KEY_VALUE) as elsewhere:
        with FakeOpenAIServer(str(fixture_model), key=KEY_VALUE) as fake:
            backend = _backend(fixture_model, fake.url)
            backend.load()
            requests = _requests(backend, *TWO_PROMPTS)
            fake.routes["/v1/completions"] = _redirect(307, elsewhere.url + "/v1/completions")
            with pytest.raises(ServerHTTPError, match="redirect"):
                if phase == "generate":
                    backend.generate(requests, lambda n: None)
                else:
                    backend.teacher_force([(list(requests[0].prompt_token_ids), [5, 6, 7])], K, lambda n: None)
    _no_key_elsewhere(elsewhere)


def _drip(seconds: float, status: int = 200, headers_first: bool = True) -> Callable[[Any], None]:
    """An answer that trickles one byte at a time for ``seconds`` (each byte well inside any
    per-read timeout)."""

    def handle(h: Any) -> None:
        step = 0.02
        count = int(seconds / step)
        if headers_first:
            h.send_response(status)
            h.send_header("Content-Length", str(count))
            h.end_headers()
            byte = b" "
        else:  # the status line, then a header that never ends
            h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
            byte = b"a"
        for _ in range(count):
            h.wfile.write(byte)
            h.wfile.flush()
            time.sleep(step)

    return handle


@pytest.mark.parametrize("path, headers_first", [("/v1/models", True), ("/v1/models", False),
                                                 ("/v1/completions", True), ("/version", True)])
def test_a_trickling_pre_run_answer_is_cut_at_the_deadline(fixture_model, key, path, headers_first):
    with FakeOpenAIServer(str(fixture_model), routes={path: _drip(8.0, headers_first=headers_first)}) as fake:
        backend = _backend(fixture_model, fake.url, request_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):  # /version is optional, but its deadline holds too
            backend.load()
        elapsed = time.monotonic() - started
    assert elapsed < 4.0, elapsed


@pytest.mark.parametrize("phase", ["generate", "teacher_force"])
def test_a_trickling_replay_answer_is_cut_at_the_deadline(fixture_model, key, phase):
    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url, request_timeout_s=1.0)
        backend.load()
        requests = _requests(backend, *TWO_PROMPTS)
        fake.routes["/v1/completions"] = _drip(8.0)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="request_timeout_s"):
            if phase == "generate":
                backend.generate(requests, lambda n: None)
            else:
                backend.teacher_force([(list(requests[0].prompt_token_ids), [5, 6])], K, lambda n: None)
    assert time.monotonic() - started < 4.0


def _big_models(size: int, declared: bool, status: int = 200, record: list[str] | None = None,
                model: str = "") -> Callable[[Any], None]:
    """A valid ``/v1/models`` answer padded to ``size`` bytes, with or without Content-Length."""

    def handle(h: Any) -> None:
        head = json.dumps({"object": "list", "data": [{"id": model, "root": model}], "pad": ""})[:-2].encode()
        tail = b'"}'
        h.send_response(status)
        if declared:
            h.send_header("Content-Length", str(size))
        else:
            h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(head)
        left = size - len(head) - len(tail)
        piece = b"x" * 65536
        while left > 0:
            h.wfile.write(piece[:left])
            left -= len(piece)
        h.wfile.write(tail)
        h.wfile.flush()
        if record is not None:
            record.append("all written")
        h.close_connection = True

    return handle


@pytest.mark.parametrize("declared", [True, False])
def test_an_answer_past_its_limit_is_refused(fixture_model, key, declared):
    size = 48 * 1024 * 1024
    with FakeOpenAIServer(str(fixture_model)) as fake:
        fake.routes["/v1/models"] = _big_models(size, declared, model=str(fixture_model))
        backend = _backend(fixture_model, fake.url)
        with pytest.raises(ServerReplyError, match="limit") as caught:
            backend.load()
    assert caught.value.exit_code == 3 and "/v1/models" in str(caught.value)


def test_an_error_body_is_read_only_up_to_its_limit(fixture_model, key):
    written: list[str] = []
    with FakeOpenAIServer(str(fixture_model)) as fake:
        fake.routes["/v1/models"] = _big_models(48 * 1024 * 1024, False, status=500, record=written)
        backend = _backend(fixture_model, fake.url)
        with pytest.raises(ServerHTTPError) as caught:
            backend.load()
        time.sleep(0.5)
    assert caught.value.status == 500 and len(str(caught.value)) < 1000
    assert written == []  # the client stopped reading long before the end


def test_an_oversized_stream_and_teacher_forcing_answer_are_refused(fixture_model, key):
    huge = "y" * (4 * 1024 * 1024)

    def tamper(kind: str, value: Any, body: dict[str, Any]) -> Any:
        if kind == "stream":
            chunk = {"choices": [{"index": 0, "text": huge, "logprobs": {"tokens": [], "top_logprobs": []},
                                  "finish_reason": None}]}
            return [b"data: " + json.dumps(chunk).encode()] + value
        if body.get("max_tokens") == 1 and len(body.get("prompt", [])) > 3 and body.get("prompt_logprobs"):
            value["pad"] = huge
        return value

    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        requests = _requests(backend, *TWO_PROMPTS)
        fake.tamper = tamper
        with pytest.raises(ServerReplyError, match="limit"):
            backend.generate(requests, lambda n: None)
        with pytest.raises(ServerReplyError, match="limit"):
            backend.teacher_force([(list(requests[0].prompt_token_ids), [5, 6])], K, lambda n: None)


# -- item 4: a malformed answer is an error, never a score -------------------------------------


def _json_line(line: bytes) -> dict[str, Any]:
    return json.loads(line[len(b"data: "):])


def _line(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode()  # json.dumps writes NaN and Infinity as such


def _edit_first_row(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[bytes]], list[bytes]]:
    def apply(lines: list[bytes]) -> list[bytes]:
        chunk = _json_line(lines[0])
        edit(chunk["choices"][0])
        return [_line(chunk)] + lines[1:]

    return apply


def _set_top(value: Any, place: int = 1) -> Callable[[dict[str, Any]], None]:
    def edit(choice: dict[str, Any]) -> None:
        row = choice["logprobs"]["top_logprobs"][0]
        row[list(row)[place]] = value

    return edit


def _rename_top(key: str) -> Callable[[dict[str, Any]], None]:
    def edit(choice: dict[str, Any]) -> None:
        row = choice["logprobs"]["top_logprobs"][0]
        items = list(row.items())
        items[1] = (key, items[1][1])
        choice["logprobs"]["top_logprobs"][0] = dict(items)

    return edit


def _last_finish(value: Any) -> Callable[[list[bytes]], list[bytes]]:
    def apply(lines: list[bytes]) -> list[bytes]:
        chunk = _json_line(lines[-2])
        chunk["choices"][0]["finish_reason"] = value
        return lines[:-2] + [_line(chunk), lines[-1]]

    return apply


def _text_only(lines: list[bytes]) -> list[bytes]:
    out = []
    for line in lines[:-1]:
        chunk = _json_line(line)
        chunk["choices"][0]["logprobs"] = None
        out.append(_line(chunk))
    return out + lines[-1:]


def _extra_text(lines: list[bytes]) -> list[bytes]:
    extra = {"choices": [{"index": 0, "text": "more words", "logprobs": None, "finish_reason": None}]}
    return lines[:1] + [_line(extra)] + lines[1:]


STREAM_TAMPERS: dict[str, Callable[[list[bytes]], list[bytes]]] = {
    "no [DONE]": lambda lines: lines[:-1],
    "no finish reason": _last_finish(None),
    "no [DONE] and no finish reason": lambda lines: _last_finish(None)(lines)[:-1],
    "closed after the first token": lambda lines: lines[:1],
    "text only, no token ids": _text_only,
    "text without token ids in one chunk": _extra_text,
    "finish reason abort": _last_finish("abort"),
    "finish reason error": _last_finish("error"),
    "NaN logprob": _edit_first_row(_set_top(float("nan"))),
    "Infinity logprob": _edit_first_row(_set_top(float("inf"))),
    "-Infinity logprob": _edit_first_row(_set_top(float("-inf"))),
    "1e999 logprob": lambda lines: [lines[0].replace(b"-1.1", b"-1e999")] + lines[1:],
    "positive logprob": _edit_first_row(_set_top(7.5)),
    "NaN chosen logprob": lambda lines: [lines[0].replace(b"-0.1", b"NaN", 2)] + lines[1:],
    "logprob as a string": _edit_first_row(_set_top("-0.5")),
    "logprob true": _edit_first_row(_set_top(True)),
    "logprob null": _edit_first_row(_set_top(None)),
    "top-k id above 2^31": _edit_first_row(_rename_top(f"token_id:{2 ** 31 + 5}")),
    "top-k id above 2^64": _edit_first_row(_rename_top(f"token_id:{2 ** 64 + 5}")),
    "top-k id -1": _edit_first_row(_rename_top("token_id:-1")),
    "top-k id = vocabulary size": _edit_first_row(_rename_top("token_id:1024")),
    "top-k id not a number": _edit_first_row(_rename_top("token_id:seven")),
    "top-k id with unicode digits": _edit_first_row(_rename_top("token_id:\u0663")),
    "chosen id above the vocabulary": lambda lines: [lines[0].replace(b'"tokens": ["token_id:', b'"tokens": ["token_id:99999')] + lines[1:],
    "no top_logprobs row": _edit_first_row(lambda c: c["logprobs"].update(top_logprobs=[])),
    "top_logprobs null": _edit_first_row(lambda c: c["logprobs"].update(top_logprobs=None)),
    "two rows for one token": _edit_first_row(lambda c: c["logprobs"].update(
        top_logprobs=c["logprobs"]["top_logprobs"] * 2)),
    "a row short of the top-k": _edit_first_row(lambda c: c["logprobs"]["top_logprobs"][0].popitem()),
    "chosen token missing from its row": _edit_first_row(lambda c: c["logprobs"].update(top_logprobs=[
        {f"token_id:{900 + i}": -1.0 - i for i in range(K + 1)}])),
    "a row that is not best first": _edit_first_row(_set_top(-0.5, place=2)),
    "truncated JSON chunk": lambda lines: [lines[0][: len(lines[0]) // 2]] + lines[1:],
    "a chunk that is a list": lambda lines: [b"data: []"] + lines[1:],
    "more tokens than max_tokens": lambda lines: lines[:1] + lines[:-1] + lines[-1:],
    "an error chunk": lambda lines: lines[:1] + [b'data: {"error": {"message": "boom"}}'] + lines[1:],
    "a second choice": _edit_first_row(lambda c: c.update(index=1)),
    "tokens after the finish reason": lambda lines: lines[:-1] + lines[:1] + lines[-1:],
}


@pytest.mark.parametrize("name", list(STREAM_TAMPERS))
def test_a_malformed_completion_stream_is_an_error_naming_the_request(fixture_model, key, name):
    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        requests = _requests(backend, *TWO_PROMPTS)
        first = list(requests[0].prompt_token_ids)
        fake.tamper = lambda kind, value, body: (STREAM_TAMPERS[name](value)
                                                 if kind == "stream" and _second(body, first) else value)
        with pytest.raises(ServerReplyError) as caught:
            backend.generate(requests, lambda n: None)
    assert caught.value.index == 1 and caught.value.exit_code == 3, caught.value
    assert fake.url in str(caught.value)


def test_an_untampered_stand_in_is_read_as_it_answered(fixture_model, key):
    """The stand-in's well-formed answers pass, so the refusals above are about what was changed."""
    from fake_openai_server import output_token

    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url, concurrency=2)
        backend.load()
        requests = _requests(backend, *TWO_PROMPTS)
        outputs = backend.generate(requests, lambda n: None)
        prompt = list(requests[0].prompt_token_ids)
        forced = backend.teacher_force([(prompt, [5, 6, 7])], K, lambda n: None)
    for request, output in zip(requests, outputs):
        ids = list(request.prompt_token_ids)
        assert output.output_token_ids == [output_token(ids, j) for j in range(MAX_TOKENS)]
        assert output.finish_reason == "length" and output.logprobs.top_ids.shape == (MAX_TOKENS, K)
        assert output.logprobs.top_ids[:, 0].tolist() == output.output_token_ids
    assert forced[0].top_ids[:, 0].tolist() == [5, 6, 7] and forced[0].token_logprobs.tolist() == pytest.approx([-0.1] * 3)


def _position(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], Any]:
    def apply(answer: dict[str, Any]) -> Any:
        edit(answer["choices"][0]["prompt_logprobs"][-1])
        return answer

    return apply


def _first_other(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(position: dict[str, Any]) -> None:
        position[list(position)[1]]["logprob"] = value

    return edit


TEACHER_TAMPERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "NaN logprob": _position(_first_other(float("nan"))),
    "Infinity logprob": _position(_first_other(float("inf"))),
    "positive logprob": _position(_first_other(0.5)),
    "logprob as a string": _position(_first_other("-1")),
    "the given token's logprob null": _position(lambda p: p[list(p)[0]].update(logprob=None)),
    "a position short of the top-k": _position(lambda p: p.pop(list(p)[-1])),
    "the given token missing": _position(lambda p: p.pop(list(p)[0])),
    "an id above 2^31": _position(lambda p: p.update({str(2 ** 31 + 5): p.pop(list(p)[1])})),
    "an id -1": _position(lambda p: p.update({"-1": p.pop(list(p)[1])})),
    "a rank that is a string": _position(lambda p: p[list(p)[1]].update(rank="2")),
    "a rank of 0": _position(lambda p: p[list(p)[1]].update(rank=0)),
    "one position too few": lambda a: (a["choices"][0]["prompt_logprobs"].pop(), a)[1],
    "one position too many": lambda a: (a["choices"][0]["prompt_logprobs"].append(None), a)[1],
    "a position that is null": lambda a: (a["choices"][0]["prompt_logprobs"].__setitem__(-1, None), a)[1],
    "no prompt_logprobs": lambda a: (a["choices"][0].pop("prompt_logprobs"), a)[1],
    "no choices": lambda a: {"choices": []},
    "truncated JSON": lambda a: json.dumps(a).encode()[:-7],
    "NaN literal outside a number": lambda a: json.dumps(a).encode().replace(b'"object"', b'"x": NaN, "object"'),
    "not an object": lambda a: b"[1, 2, 3]",
    "deeply nested": lambda a: b"[" * 100000 + b"]" * 100000,
}


@pytest.mark.parametrize("name", list(TEACHER_TAMPERS))
def test_a_malformed_teacher_forcing_answer_is_an_error_naming_the_request(fixture_model, key, name):
    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        a, b = (list(r.prompt_token_ids) for r in _requests(backend, *TWO_PROMPTS))
        fake.tamper = lambda kind, value, body: (TEACHER_TAMPERS[name](value)
                                                 if kind == "json" and body.get("prompt", [])[: len(b)] == b else value)
        with pytest.raises(ServerReplyError) as caught:
            # the second sequence is the empty one's neighbour: indices follow the sequences, not the requests
            backend.teacher_force([(a, [5, 6, 7]), (a, []), (b, [8, 9, 10])], K, lambda n: None)
    assert caught.value.index == 2 and caught.value.exit_code == 3, caught.value


CHAT_TAMPERS: dict[str, Callable[[list[bytes]], list[bytes]]] = {
    "no prompt_token_ids": lambda lines: [lines[0].replace(b'"prompt_token_ids"', b'"other"')] + lines[1:],
    "prompt_token_ids out of the vocabulary": lambda lines: [lines[0].replace(b"[1, 2, 3,", b"[1, 2, 3000,")] + lines[1:],
    "prompt_token_ids as strings": lambda lines: [lines[0].replace(b"[1, 2, 3,", b'["1", 2, 3,')] + lines[1:],
    "no [DONE]": lambda lines: lines[:-1],
    "no finish reason": _last_finish(None),
    "NaN logprob": lambda lines: lines[:1] + [lines[1].replace(b'"logprob": -1.1', b'"logprob": NaN')] + lines[2:],
    "positive chosen logprob": lambda lines: lines[:1] + [lines[1].replace(b'"logprob": -0.1', b'"logprob": 0.1', 1)] + lines[2:],
    "token id out of the vocabulary": lambda lines: lines[:1] + [lines[1].replace(b'"token_ids": [', b'"token_ids": [99999')] + lines[2:],
    "token_ids and logprobs of other tokens": lambda lines: lines[:1] + [lines[1].replace(
        b'"token_ids": [', b'"token_ids": [1')] + lines[2:],
    "two token ids for one logprob entry": lambda lines: lines[:1] + [lines[1].replace(
        b'"token_ids": [', b'"token_ids": [1, ')] + lines[2:],
    "content without logprobs": lambda lines: lines[:1] + [lines[1].replace(
        b'"logprobs": {"content"', b'"logprobs": null, "x": {"content"')] + lines[2:],
    "a top_logprobs entry that is a string": lambda lines: lines[:1] + [lines[1].replace(
        b'"top_logprobs": [', b'"top_logprobs": ["token_id:3", ')] + lines[2:],
}


@pytest.mark.parametrize("name", list(CHAT_TAMPERS))
def test_a_malformed_chat_stream_is_an_error_naming_the_request(fixture_model, key, name):
    messages = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hello there"}]]
    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url, endpoint="chat")
        backend.load()
        requests = [GenerationRequest(backend.render({"messages": m}), _sampling()) for m in messages]
        fake.tamper = lambda kind, value, body: (CHAT_TAMPERS[name](value)
                                                 if kind == "stream" and body.get("messages") == messages[1] else value)
        with pytest.raises(ServerReplyError) as caught:
            backend.generate(requests, lambda n: None)
    assert caught.value.index == 1 and caught.value.exit_code == 3, caught.value


@pytest.mark.parametrize("max_model_len", [1, 0, -5, True, "4096", 2 ** 40])
def test_a_max_model_len_that_cannot_be_true_is_refused(fixture_model, key, max_model_len):
    """A server reporting max_model_len 1 would turn teacher forcing off for every prompt."""
    with FakeOpenAIServer(str(fixture_model), reported_max_model_len=max_model_len) as fake:
        backend = _backend(fixture_model, fake.url)
        with pytest.raises(ServerReplyError, match="max_model_len") as caught:
            backend.load()
    assert caught.value.exit_code == 3


def test_a_max_model_len_below_what_the_server_generated_is_refused(fixture_model, key):
    """A /v1/models that understates max_model_len (but not below the probe) would cut teacher
    forcing short: the server's own outputs give it away."""
    with FakeOpenAIServer(str(fixture_model)) as probe:
        backend = _backend(fixture_model, probe.url)
        backend.load()
        lengths = [len(r.prompt_token_ids) for r in _requests(backend, *TWO_PROMPTS)]
    with FakeOpenAIServer(str(fixture_model), reported_max_model_len=max(lengths) + MAX_TOKENS - 1) as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        requests = _requests(backend, *TWO_PROMPTS)
        backend.generate(requests, lambda n: None)
        with pytest.raises(ServerReplyError, match="max_model_len"):
            backend.teacher_force([(list(requests[0].prompt_token_ids), [5, 6])], K, lambda n: None)


# -- through the command: exit 3 naming the prompt; a cut teacher forcing recorded --------------


def _workspace(tmp_path: Path, fixture_model: Path, url: str, candidates: dict[str, Any] | None = None) -> Path:
    from conftest import write_params
    from regress.datasets import FIXTURE_PROMPTS, write_demo_prompts

    write_demo_prompts(tmp_path / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    write_params(tmp_path, model=fixture_model, baseline={"backend": "server", "server": {"url": url}},
                 candidates=candidates)
    return tmp_path


def _first_prompt_id() -> str:
    from regress.datasets import FIXTURE_PROMPTS

    return json.loads(FIXTURE_PROMPTS.read_text(encoding="utf-8").splitlines()[0])["id"]


def test_a_malformed_answer_fails_the_command_with_exit_3_naming_the_prompt(tmp_path, fixture_model):
    with FakeOpenAIServer(str(fixture_model), tamper=lambda kind, value, body: (
            STREAM_TAMPERS["NaN logprob"](value) if kind == "stream" else value)) as fake:
        workspace = _workspace(tmp_path, fixture_model, fake.url)
        result = run_cli("golden", cwd=workspace, timeout=600)
    assert result.returncode == 3, result.stderr
    assert f"prompt '{_first_prompt_id()}'" in result.stderr and "nan" in result.stderr.lower(), result.stderr
    assert not (workspace / "golden" / "manifest.json").exists()


def test_teacher_forcing_cut_to_the_servers_max_model_len_is_recorded_per_prompt(tmp_path, fixture_model):
    from regress.runs import load_run
    from regress.storage import read_shard_meta

    with FakeOpenAIServer(str(fixture_model)) as golden_server:
        workspace = _workspace(tmp_path, fixture_model, golden_server.url)
        result = run_cli("golden", cwd=workspace, timeout=600)
        assert result.returncode == 0, result.stderr
    golden = load_run(workspace / "golden")
    lengths = {g.prompt_id: (len(g.prompt_token_ids), len(g.output_token_ids)) for g in golden}
    max_model_len = max(p for p, _ in lengths.values()) + 3
    with FakeOpenAIServer(str(fixture_model), max_model_len=max_model_len) as small:
        params = yaml.safe_load((workspace / "params.yaml").read_text())
        params["candidates"] = {"small": {"server": {"url": small.url}}}
        (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        result = run_cli("replay", "small", cwd=workspace, timeout=600)
    assert result.returncode == 0, result.stderr
    cut: dict[str, Any] = {}
    for shard in sorted((workspace / "runs" / "small" / "shards").glob("*.shard")):
        meta = read_shard_meta(shard)
        assert meta["teacher_forced"] and len(meta["teacher_force_cut"]) == len(meta["prompt_ids"])
        cut.update(zip(meta["prompt_ids"], meta["teacher_force_cut"]))
    assert set(cut) == set(lengths)
    for prompt_id, (prompt, output) in lengths.items():
        room = max(0, min(output, max_model_len - prompt - 1))
        expected = None if room >= output else {"scored": room, "of": output}
        assert cut[prompt_id] == expected, prompt_id
    assert any(c is not None for c in cut.values())


# -- item 5: the server regress starts is the one it talks to --------------------------------


def _fake_command(log: Path, delay: float) -> Callable[..., list[str]]:
    from regress.backends import server_process

    original = server_process.server_command

    def command(*args: Any, **kwargs: Any) -> list[str]:
        real = original(*args, **kwargs)
        assert real[1:3] == ["-m", server_process.SERVER_MODULE]
        return [sys.executable, str(FAKE), *real[3:], "--delay", str(delay), "--log", str(log)]

    return command


def test_the_started_server_is_the_one_regress_talks_to(tmp_path, fixture_model, key, monkeypatch):
    """Another local process holds the TCP port regress would have picked, and answers like a
    server: it gets nothing, the key included; the server regress started (a stand-in process that
    binds only after a delay, as vLLM does after its import) gets every request."""
    import regress.backends.vllm_server as vllm_server

    log = tmp_path / "requests.jsonl"
    with FakeOpenAIServer(str(fixture_model)) as impostor:
        monkeypatch.setattr(vllm_server, "free_port", lambda: impostor.port, raising=False)
        monkeypatch.setattr(vllm_server, "_flag_names", lambda: {"--uds", "--port", "--host", "--model"})
        monkeypatch.setattr(vllm_server, "server_command", _fake_command(log, delay=1.5))
        backend = _backend(fixture_model, None, health_timeout_s=60)
        try:
            info = backend.load()
            socket_path = backend._unix_socket
            assert socket_path and Path(socket_path).exists()
            directory = Path(socket_path).parent
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and directory.stat().st_uid == os.getuid()
            assert info["effective"]["server"]["url"] == f"unix:{socket_path}"
            outputs = backend.generate(_requests(backend, *TWO_PROMPTS), lambda n: None)
            assert len(outputs) == 2
        finally:
            process = backend._server
            backend.close()
        assert impostor.requests == [], impostor.requests
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    paths = [r["path"] for r in seen]
    assert "/health" in paths and "/v1/models" in paths and paths.count("/v1/completions") >= 3
    assert all(r["authorization"] == f"Bearer {KEY_VALUE}" for r in seen if r["path"].startswith("/v1"))
    assert process is not None and process.proc.poll() is not None  # stopped with the backend
    assert not directory.exists()  # the private directory (socket and sitecustomize) removed


def test_a_vllm_server_without_a_unix_socket_option_is_not_started(fixture_model, key, monkeypatch):
    import regress.backends.vllm_server as vllm_server
    from regress.errors import InputError

    started: list[Any] = []
    monkeypatch.setattr(vllm_server, "_flag_names", lambda: {"--port", "--host", "--model"})
    monkeypatch.setattr(vllm_server, "ServerProcess", lambda *a, **k: started.append(a))
    backend = _backend(fixture_model, None)
    with pytest.raises(InputError, match="--uds"):
        backend.load()
    assert started == []


def test_a_vllm_server_that_refuses_the_unix_socket_flag_says_so(fixture_model, key, monkeypatch):
    """Where regress cannot read the server's flags, it passes --uds anyway (never falling back to
    a TCP port); a server that does not know it exits, and the error says what to do."""
    import regress.backends.vllm_server as vllm_server
    from regress.errors import InputError

    refuse = "import sys; print('api_server: error: unrecognized arguments: --uds /x', file=sys.stderr); sys.exit(2)"
    monkeypatch.setattr(vllm_server, "_flag_names", lambda: None)
    monkeypatch.setattr(vllm_server, "server_command", lambda *a, **k: [sys.executable, "-c", refuse])
    backend = _backend(fixture_model, None, health_timeout_s=60)
    try:
        with pytest.raises(InputError, match="server.url"):
            backend.load()
    finally:
        backend.close()


def test_the_started_servers_command_names_its_socket_not_a_port():
    from regress.backends.server_process import server_command

    command = server_command({"model": "/m", "engine_args": {"enforce_eager": True}}, None, python="py",
                             unix_socket="/run/x/server.sock")
    assert command == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--dtype", "auto",
                       "--uds", "/run/x/server.sock", "--enforce-eager"]
    assert "--port" not in command and "--host" not in command


def test_a_run_error_is_what_every_refusal_is():
    """Every refusal at the boundary exits 3: the candidate could not be measured."""
    assert issubclass(ServerReplyError, RunError) and issubclass(ServerHTTPError, RunError)
    named = ServerReplyError("a logprob of nan", index=2).located(url="http://h:1/v1/completions", prompt="p-7")
    assert str(named) == "the server at http://h:1/v1/completions, prompt 'p-7': a logprob of nan"
    assert named.index == 2
