"""Hostile answers of an OpenAI-compatible server that the server backend once took (a review's
findings 3 to 10): every one is a ServerReplyError naming what was wrong, never a score, never a
bare TypeError, KeyError, OverflowError or UnicodeError.

- text that no token backs, or anything after the finish reason (a second finish reason too);
- text with a lone surrogate, and a ``/version`` that is not a version;
- top-k rows that contradict themselves: a chosen token left out although more likely than the
  k-th entry, an unsorted tail, ranks that disagree with logprobs, one token under two spellings
  or with two logprobs, a row whose best entry is at the server's -9999 clamp;
- choices that are not the one asked for (an index that is not the number 0, two of index 0);
- malformed ``/v1/models`` and probe answers (exit 3: the server is at fault, not the input);
- JSON numbers too large for a float, and keys named twice.

Fast tier (tests/conftest.py marks it: no engine, no real server): the row and stream readers are
called directly, and the backend talks to the stand-in server of tests/fake_openai_server.py
through the helpers of tests/test_server_boundary.py.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import pytest

from conftest import run_cli
from fake_openai_server import FakeOpenAIServer
from test_server_boundary import (  # noqa: F401  (key: a fixture, used by name)
    K,
    TWO_PROMPTS,
    _backend,
    _edit_first_row,
    _first_prompt_id,
    _json_line,
    _line,
    _position,
    _requests,
    _second,
    _workspace,
    key,
)

from regress.backends import server_wire as wire
from regress.backends.server_http import run_to_end, strict_json
from regress.backends.server_sampling import checked_defaults, defaults_from_log
from regress.errors import RegressError, ServerReplyError

V = 100  # the vocabulary of the direct calls


def tid(token: int) -> str:
    return f"token_id:{token}"


class _Chunks:
    """A client whose stream is the given chunks (already JSON objects), for the stream readers."""

    def __init__(self, chunks: list[dict[str, Any]]):
        self.chunks = chunks

    async def events(self, path: str, payload: Any, *, limit: int):
        for chunk in self.chunks:
            yield chunk


def _completion(chunks: list[dict[str, Any]], k: int = 2, max_tokens: int = 4):
    payload = {"prompt": [1, 2, 3], "logprobs": k, "max_tokens": max_tokens}
    # run_to_end: the browser tests' Playwright leaves an event loop running in this thread.
    # The wire rules alone: made-up ids with made-up text (tests/test_server_text_ids.py checks the two agree).
    return run_to_end(lambda: wire.read_completion(_Chunks(chunks), "/v1/completions", payload, V, text_check=None))


def _chat(chunks: list[dict[str, Any]], k: int = 2, max_tokens: int = 4):
    payload = {"messages": [], "top_logprobs": k, "max_tokens": max_tokens}
    return run_to_end(lambda: wire.read_chat(_Chunks(chunks), "/v1/chat/completions", payload, k, 3, V,
                                             text_check=None))


def _piece(text: Any, tokens: list[int], finish: Any = None, **choice: Any) -> dict[str, Any]:
    """A completion chunk: ``tokens``, each ranked first (-0.1) before token 7 (-2.0)."""
    rows = [{tid(t): -0.1, tid(7): -2.0} for t in tokens]
    return {"choices": [{"index": 0, "text": text, "logprobs": {"tokens": [tid(t) for t in tokens],
                                                                 "top_logprobs": rows},
                         "finish_reason": finish, **choice}]}


def _entry(token: int, lp: float, listed: list[tuple[int, float]]) -> dict[str, Any]:
    return {"token": tid(token), "logprob": lp, "top_logprobs": [{"token": tid(t), "logprob": v} for t, v in listed]}


def _delta(text: Any, tokens: list[int], finish: Any = None, prompt: list[int] | None = None) -> dict[str, Any]:
    """A chat chunk: ``tokens``, each ranked first (-0.1) before token 7 (-2.0)."""
    entries = [_entry(t, -0.1, [(t, -0.1), (7, -2.0)]) for t in tokens]
    chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": text}, "logprobs": {"content": entries},
                                          "token_ids": tokens, "finish_reason": finish}]}
    if prompt is not None:
        chunk["prompt_token_ids"] = prompt
    return chunk


def _refused(call: Callable[[], Any], match: str) -> ServerReplyError:
    with pytest.raises(ServerReplyError, match=match) as caught:
        call()
    assert caught.value.exit_code == 3
    return caught.value


def test_well_formed_answers_still_pass():
    """What vLLM sends passes, ties included, so the refusals below are about what is wrong."""
    out = _completion([_piece("A", [5]), _piece("", [6]), _piece("B", [8], "stop"), {"choices": [], "usage": {}}])
    assert out.output_token_ids == [5, 6, 8] and out.text == "AB" and out.finish_reason == "stop"
    out = _chat([_delta("", [], prompt=[1, 2]), _delta("A", [5]), _delta("B", [6], "length")])
    assert out.output_token_ids == [5, 6] and out.prompt_token_ids == [1, 2]
    # The chosen token outside the top-k, tied with the k-th entry (vLLM's layout: it first).
    ids, rows = wire.stream_rows([tid(5)], [{tid(5): -2.0, tid(7): -0.5, tid(8): -2.0}], 2, V)
    assert rows.top_ids.tolist() == [[7, 8]] and rows.token_logprobs.tolist() == [-2.0]
    # Clamped (-9999) entries past the best, and a chosen token at the clamp, read as -inf.
    _, rows = wire.stream_rows([tid(5)], [{tid(5): -9999.0, tid(7): -0.5, tid(8): -9999.0}], 2, V)
    assert rows.token_logprobs.tolist() == [-np.inf] and rows.top_logprobs.tolist() == [[-0.5, -np.inf]]
    # A given token outside the top-k whose rank ties the k-th entry's.
    rows = wire.prompt_rows([None, {"5": {"logprob": -2.0, "rank": 2}, "7": {"logprob": -0.5, "rank": 1},
                                    "8": {"logprob": -2.0, "rank": 2}}], [5], 1, 2, V)
    assert rows.top_logprobs.tolist() == [[-0.5, -2.0]]
    rows = wire.chat_rows([5], [_entry(5, -1.0, [(5, -1.0), (7, -0.5), (8, -1.0)])], 2, V)
    assert rows.top_ids.tolist() == [[7, 5]]
    assert wire.server_version({"version": "0.10.2rc1.dev12+g1a2b3c.cu128"}) == "0.10.2rc1.dev12+g1a2b3c.cu128"
    assert wire.server_version({}) is None and wire.server_version([1]) is None


# -- finding 3: text that no token backs; finding 7: nothing after the finish reason -------------


@pytest.mark.parametrize("name, chunks, match", [
    ("text with an empty tokens list", [_piece("A", [5]), _piece(" INJECTED TEXT", []), _piece("B", [6], "stop")],
     "text without token ids"),
    ("text with logprobs null", [_piece("A", [5]), {"choices": [{"index": 0, "text": "x", "logprobs": None,
                                                                   "finish_reason": None}]}, _piece("B", [6], "stop")],
     "text without token ids"),
    ("text after the finish reason", [_piece("A", [5], "stop"), _piece(" AFTER", [])], "text after the finish reason"),
    ("a second finish reason", [_piece("A", [5], "length"), {"choices": [{"index": 0, "text": "", "logprobs": None,
                                                                          "finish_reason": "stop"}]}],
     "another finish reason after the finish reason 'length'"),
    ("an empty choice after the finish reason", [_piece("A", [5], "stop"), _piece("", [])],
     "a choice after the finish reason"),
    ("a finish reason that is a list", [_piece("A", [5], ["stop"])], r"finish reason \['stop'\]"),
])
def test_completion_text_must_come_with_tokens_and_nothing_after_the_finish(name, chunks, match):
    _refused(lambda: _completion(chunks), match)


@pytest.mark.parametrize("name, chunks, match", [
    ("content with logprobs.content []", [_delta("A", [5], prompt=[1]), _delta(" INJECTED", [])],
     "text without token ids"),
    ("content after the finish reason", [_delta("A", [5], "stop", prompt=[1]), _delta(" AFTER", [])],
     "text after the finish reason"),
    ("a second finish reason", [_delta("A", [5], "length", prompt=[1]), _delta("", [], "stop")],
     "another finish reason"),
    ("a delta that is a string", [{"prompt_token_ids": [1], "choices": [
        {"index": 0, "delta": "A", "logprobs": None, "finish_reason": "stop"}]}], "delta 'A', not an object"),
    ("logprobs that are a list", [{"prompt_token_ids": [1], "choices": [
        {"index": 0, "delta": {"content": "A"}, "logprobs": ["x"], "finish_reason": "stop"}]}], "not an object"),
    ("a second, different prompt", [_delta("A", [5], prompt=[1, 2]), {"choices": [], "prompt_token_ids": [9, 9, 9]},
                                    _delta("", [], "stop")], "two different prompt_token_ids"),
])
def test_chat_content_must_come_with_tokens_and_nothing_after_the_finish(name, chunks, match):
    _refused(lambda: _chat(chunks), match)


# -- finding 6: the one choice asked for ----------------------------------------------------------


@pytest.mark.parametrize("name, choice, match", [
    ("index false", {"index": False}, "index is False"),
    ("index 0.0", {"index": 0.0}, "index is 0.0"),
    ("no index", {"index": None}, "index is None"),
    ("index 1", {"index": 1}, "other than the one asked for"),
])
def test_a_choice_index_must_be_the_number_0(name, choice, match):
    chunk = _piece("A", [5], "stop")
    chunk["choices"][0].update(choice)
    if choice["index"] is None:
        del chunk["choices"][0]["index"]
    _refused(lambda: _completion([chunk]), match)
    _refused(lambda: wire.one_choice(chunk, "the answer"), match)


def test_two_choices_of_index_0_in_one_chunk_are_not_merged():
    two = {"choices": _piece("A", [5])["choices"] + _piece("Z", [9])["choices"]}
    _refused(lambda: _completion([two, _piece("B", [6], "stop")]), "2 choices of index 0 in one chunk")
    _refused(lambda: _chat([{"prompt_token_ids": [1], "choices": _delta("A", [5])["choices"] * 2},
                            _delta("", [], "stop")]), "2 choices of index 0")
    _refused(lambda: wire.one_choice(two, "the answer"), "not the one choice asked for")


# -- finding 4: lone surrogates; a version that is not one ----------------------------------------


@pytest.mark.parametrize("text", ["A\ud800", "\udfff", "ok \ud83d then"])
def test_text_with_a_lone_surrogate_is_refused(text):
    _refused(lambda: _completion([_piece(text, [5], "stop")]), "lone surrogate")
    _refused(lambda: _chat([_delta(text, [5], "stop", prompt=[1])]), "lone surrogate")


@pytest.mark.parametrize("version", ["0.9.1\ud800\u001b[2J", "0.9.1\u001b[2J", "0.9\n", "", " 0.9", "0.9 (cpu)",
                                     "v" * 101, 5, {"x": 1}, ["0.9"], True])
def test_a_version_that_is_not_one_is_refused(version):
    _refused(lambda: wire.server_version({"version": version}), "not a version")


def test_a_lone_surrogate_in_the_output_fails_the_command_naming_the_prompt(tmp_path, fixture_model):
    def surrogate(kind: str, value: Any, body: dict[str, Any]) -> Any:
        if kind != "stream":
            return value
        chunk = _json_line(value[0])
        chunk["choices"][0]["text"] = "A\ud800"  # json.dumps writes it as the escape a server would send
        return [_line(chunk)] + value[1:]

    with FakeOpenAIServer(str(fixture_model), tamper=surrogate) as fake:
        workspace = _workspace(tmp_path, fixture_model, fake.url)
        result = run_cli("golden", cwd=workspace, timeout=600)
    assert result.returncode == 3, result.stderr
    assert f"prompt '{_first_prompt_id()}'" in result.stderr and "lone surrogate" in result.stderr, result.stderr
    assert "UnicodeEncodeError" not in result.stderr


def _answer(body: bytes) -> Callable[[Any], None]:
    def handle(h: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return handle


def test_a_hostile_version_stops_the_load_naming_version(fixture_model, key):
    hostile = _answer(b'{"version": "0.9.1\\ud800\\u001b[2J"}')  # as JSON spells it
    with FakeOpenAIServer(str(fixture_model), routes={"/version": hostile}) as fake:
        backend = _backend(fixture_model, fake.url)
        error = _refused(backend.load, "not a version")
    assert fake.url + "/version" in str(error) and "\x1b" not in str(error) and "\ud800" not in str(error)


# -- finding 5: rows that contradict themselves ----------------------------------------------------


@pytest.mark.parametrize("name, tokens, rows, match", [
    ("the chosen token left out though more likely than the k-th (k+1 entries)",
     [5], [{tid(5): -1.0, tid(7): -0.5, tid(8): -2.0}], "left out of its top-k although more likely"),
    ("the chosen token left out though the best", [5], [{tid(5): -0.1, tid(7): -0.5, tid(8): -2.0}],
     "more likely than the best"),
    ("one token as token_id:5 and token_id:05", [5], [{tid(5): -0.3, "token_id:05": -0.1, tid(7): -0.2}],
     "names token 5 twice"),
    ("another token under two spellings", [5], [{tid(5): -3.0, tid(7): -0.1, "token_id:07": -0.2}],
     "names token 7 twice"),
    ("the chosen token and the best at the clamp", [5], [{tid(5): -9999.0, tid(7): -9999.0}], "-9999 clamp"),
    ("top_logprobs not a list", [5], {"a": 1}, "not two lists"),
])
def test_contradicting_stream_rows_are_refused(name, tokens, rows, match):
    _refused(lambda: wire.stream_rows([tid(t) for t in tokens], rows, 2, V), match)


@pytest.mark.parametrize("name, entry, match", [
    ("an unsorted tail past the cut", _entry(5, -0.1, [(5, -0.1), (7, -3.0), (8, -2.0)]), "not best first"),
    ("the chosen token listed with another logprob", _entry(5, -2.0, [(5, -0.1), (7, -0.5), (8, -3.0)]),
     "gives the chosen token 5 the logprob -0.1, its entry -2.0"),
    ("another token listed twice", _entry(5, -0.1, [(5, -0.1), (7, -2.0), (7, -2.0)]), "lists token 7 twice"),
    ("a token listed twice past the cut", _entry(5, -0.1, [(5, -0.1), (7, -2.0), (8, -3.0), (8, -4.0)]),
     "lists token 8 twice"),
    ("the chosen token and the best at the clamp", _entry(5, -9999.0, [(5, -9999.0), (7, -9999.0)]), "-9999 clamp"),
])
def test_contradicting_chat_rows_are_refused(name, entry, match):
    _refused(lambda: wire.chat_rows([5], [entry], 2, V), match)


def _ranked(entries: dict[int, tuple[float, int]]) -> list[Any]:
    return [None, {str(t): {"logprob": lp, "rank": rank} for t, (lp, rank) in entries.items()}]


@pytest.mark.parametrize("name, position, match", [
    ("a rank-3 entry more likely than the rank-2", _ranked({5: (-0.1, 1), 7: (-3.0, 2), 8: (-2.0, 3)}),
     r"token 8 \(rank 3, -2.0\) is more likely than token 7 \(rank 2, -3.0\)"),
    ("the given token ranked 5 but between the top-2", _ranked({5: (-1.0, 5), 7: (-0.5, 1), 8: (-2.0, 2)}),
     "ranks and logprobs disagree"),
    ("one token as 5 and token_id:05", [None, {"5": {"logprob": -0.1, "rank": 1}, "7": {"logprob": -0.5, "rank": 2},
                                               "token_id:05": {"logprob": -3.0, "rank": 3}}], "names token 5 twice"),
    ("the best at the clamp", _ranked({5: (-9999.0, 1), 7: (-9999.0, 2)}), "-9999 clamp"),
])
def test_contradicting_prompt_rows_are_refused(name, position, match):
    _refused(lambda: wire.prompt_rows(position, [5], 1, 2, V), match)


def _outside_but_better(choice: dict[str, Any]) -> None:
    """The first row as k+1 entries: the chosen token left out although it beats the k-th."""
    row = choice["logprobs"]["top_logprobs"][0]
    chosen, *others = row  # the stand-in's tokens t, t+1, t+2: t+500 is none of them
    far = f"token_id:{(int(chosen[len('token_id:'):]) + 500) % 1024}"
    choice["logprobs"]["top_logprobs"][0] = {chosen: -0.5, **{t: -0.2 - 0.01 * j for j, t in enumerate(others)},
                                             far: -3.0}


def _better_past_the_cut(position: dict[str, Any]) -> None:
    """An entry ranked k+1 (dropped from the top-k) more likely than the k-th."""
    far = str((int(next(iter(position))) + 500) % 1024)
    position[far] = {"logprob": -1.5, "rank": K + 1}  # the k-th (rank 3) is at -2.1


def test_contradicting_rows_from_the_server_are_errors_naming_the_request(fixture_model, key):
    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        requests = _requests(backend, *TWO_PROMPTS)
        a, b = (list(r.prompt_token_ids) for r in requests)
        fake.tamper = lambda kind, value, body: (_edit_first_row(_outside_but_better)(value)
                                                 if kind == "stream" and _second(body, a) else value)
        error = _refused(lambda: backend.generate(requests, lambda n: None), "left out of its top-k")
        assert error.index == 1
        fake.tamper = lambda kind, value, body: (_position(_better_past_the_cut)(value) if kind == "json"
                                                 and body.get("prompt", [])[: len(b)] == b else value)
        error = _refused(lambda: backend.teacher_force([(a, [5, 6]), (b, [8, 9])], K, lambda n: None),
                         "ranks and logprobs disagree")
        assert error.index == 1


# -- findings 6 and 7 through the client: a hostile stream from the server ------------------------


def _after_the_end(choice: dict[str, Any]) -> Callable[[list[bytes]], list[bytes]]:
    def apply(lines: list[bytes]) -> list[bytes]:
        return lines[:-1] + [_line({"choices": [choice]})] + lines[-1:]

    return apply


def _doubled(lines: list[bytes]) -> list[bytes]:
    chunk = _json_line(lines[0])
    chunk["choices"] = chunk["choices"] * 2
    return [_line(chunk)] + lines[1:]


HOSTILE_STREAMS: dict[str, tuple[Callable[[list[bytes]], list[bytes]], str]] = {
    "a second finish reason": (_after_the_end({"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}),
                               "another finish reason after the finish reason 'length'"),
    "text after the finish reason": (_after_the_end({"index": 0, "text": " more", "finish_reason": None,
                                                     "logprobs": {"tokens": [], "top_logprobs": []}}),
                                     "text after the finish reason"),
    "text with an empty tokens list": (lambda lines: lines[:1] + [_line({"choices": [
        {"index": 0, "text": " INJECTED", "logprobs": {"tokens": [], "top_logprobs": []}, "finish_reason": None}]})]
        + lines[1:], "text without token ids"),
    "two choices of index 0": (_doubled, "2 choices of index 0"),
    "a choice of index false": (_edit_first_row(lambda c: c.update(index=False)), "index is False"),
}


@pytest.mark.parametrize("name", list(HOSTILE_STREAMS))
def test_a_hostile_stream_is_an_error_naming_the_request(fixture_model, key, name):
    tamper, match = HOSTILE_STREAMS[name]
    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        requests = _requests(backend, *TWO_PROMPTS)
        first = list(requests[0].prompt_token_ids)
        fake.tamper = lambda kind, value, body: tamper(value) if kind == "stream" and _second(body, first) else value
        error = _refused(lambda: backend.generate(requests, lambda n: None), match)
    assert error.index == 1 and fake.url in str(error)


# -- finding 9: malformed /v1/models and probe answers are the server's fault (exit 3) -------------


@pytest.mark.parametrize("name, models, match", [
    ("data 5", {"data": 5}, "no list of models"),
    ("data true", {"data": True}, "no list of models"),
    ("data a string", {"data": "m"}, "no list of models"),
    ("a model that is a string", {"data": ["m"]}, "not a model with an 'id' name"),
    ("id null, root the model", {"data": [{"id": None, "root": "MODEL"}]}, "not a model with an 'id' name"),
    ("id a list", {"data": [{"id": ["MODEL"], "root": "MODEL"}]}, "not a model with an 'id' name"),
    ("root a number", {"data": [{"id": "MODEL", "root": 5}]}, "not a name"),
])
def test_a_malformed_model_list_is_a_server_reply_error(fixture_model, key, name, models, match):
    body = json.dumps(models).replace("MODEL", str(fixture_model)).encode()
    with FakeOpenAIServer(str(fixture_model), routes={"/v1/models": _answer(body)}) as fake:
        backend = _backend(fixture_model, fake.url)
        error = _refused(backend.load, match)
    assert fake.url + "/v1/models" in str(error)


def _probe_answer(edit: Callable[[dict[str, Any]], Any]) -> Callable[[str, Any, dict[str, Any]], Any]:
    def tamper(kind: str, value: Any, body: dict[str, Any]) -> Any:
        if kind == "json" and body.get("max_tokens") == 1 and body.get("prompt_logprobs") == 1:
            return edit(value)
        return value

    return tamper


def _tokens(value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(answer: dict[str, Any]) -> Any:
        answer["choices"][0]["logprobs"]["tokens"] = value
        return answer

    return edit


PROBE_ANSWERS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "choices 5": (lambda a: {"choices": 5}, "not the one choice asked for"),
    "choices an object": (lambda a: {"choices": {"a": 1}}, "not the one choice asked for"),
    "no choices": (lambda a: {"choices": []}, "not the one choice asked for"),
    "two choices": (lambda a: {"choices": a["choices"] * 2}, "not the one choice asked for"),
    "not an object": (lambda a: json.dumps([a]).encode(), "not a JSON object"),  # bytes: sent as they are
    "tokens 5": (_tokens(5), "5 tokens for a 1-token probe"),
    "no token": (_tokens([]), "0 tokens for a 1-token probe"),
    "logprobs a list": (lambda a: (a["choices"][0].update(logprobs=[1]), a)[1], "logprobs"),
    "top_logprobs 7": (lambda a: (a["choices"][0]["logprobs"].update(top_logprobs=7), a)[1], "not two lists"),
}


@pytest.mark.parametrize("name", list(PROBE_ANSWERS))
def test_a_malformed_probe_answer_is_a_server_reply_error(fixture_model, key, name):
    edit, match = PROBE_ANSWERS[name]
    with FakeOpenAIServer(str(fixture_model), tamper=_probe_answer(edit)) as fake:
        backend = _backend(fixture_model, fake.url)
        error = _refused(backend.load, match)
    assert "(the 1-token probe)" in str(error)


# -- finding 8: a number too large for a float in the logged defaults ------------------------------


def test_a_huge_logged_default_is_not_learnt():
    line = ("WARNING Default vLLM sampling parameters have been overridden by the model's: "
            "`{'temperature': " + "9" * 400 + "}`.")
    assert defaults_from_log([line]) is None
    for value in (10 ** 400, -(10 ** 400), 10 ** 5000):
        with pytest.raises(ValueError, match="not a finite number") as caught:
            checked_defaults({"temperature": value})
        assert not isinstance(caught.value, OverflowError)


# -- finding 10: JSON that Python reads but no standard reader means the same --------------------


@pytest.mark.parametrize("data, match", [
    (b'{"a": 1e400}', "too large for a float"),
    (b'{"a": [-1e999]}', "too large for a float"),
    (b'{"a": 1' + b"0" * 400 + b'.5}', "too large for a float"),
    (b'{"a": 1, "a": 2}', "names the key 'a' twice"),
    (b'{"choices": [{"logprobs": {"top_logprobs": [{"token_id:5": -0.1, "token_id:5": -9.0}]}}]}',
     "names the key 'token_id:5' twice"),
    ('{"a": 1}'.encode("utf-16"), "utf-8"),
])
def test_strict_json_refuses_what_python_would_bend(data, match):
    with pytest.raises(ValueError, match=match):
        strict_json(data)


def test_strict_json_still_reads_numbers_and_text_that_merely_look_large():
    assert strict_json(b'{"text": "e123 and 1e400", "lp": -1e-400, "big": -1.5e308, "n": 12345}') == {
        "text": "e123 and 1e400", "lp": -0.0, "big": -1.5e308, "n": 12345}


def test_a_duplicate_key_from_the_server_is_a_server_reply_error(fixture_model, key):
    body = b'{"object": "list", "data": [], "data": [{"id": "x"}]}'
    with FakeOpenAIServer(str(fixture_model), routes={"/v1/models": _answer(body)}) as fake:
        backend = _backend(fixture_model, fake.url)
        _refused(backend.load, "names the key 'data' twice")


def test_every_refusal_here_is_a_regress_error():
    assert issubclass(ServerReplyError, RegressError) and ServerReplyError("x").exit_code == 3
