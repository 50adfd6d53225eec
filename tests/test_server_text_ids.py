"""A served answer's text must be what its token ids decode to (regress.backends.server_text).

Exact match and the first divergence are scored on a served answer's token ids, the text metrics
and expected answers on its text: a server that sends the golden's ids with other text (or the
golden's text with other ids) must be refused, exit 3 naming the prompt, never scored. What vLLM's
server legitimately sends must pass: its incremental detokenizer (here ``tokenizers``' DecodeStream
primed with the prompt, what vLLM's fast detokenizer steps) holds back a character split across
tokens until its last byte, drops the EOS it stopped at, and cuts the text before a stop string.

Fast tier: the fixture model's tokenizer (a byte-level BPE of 1,024 tokens, whose Chinese
characters are split across tokens), the stand-in server of tests/fake_openai_server.py, and the
real command against it. The real vLLM server's answers are checked by tests/test_server_backend.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import run_cli
from fake_openai_server import FakeOpenAIServer
from test_server_boundary import _backend, _requests, _workspace, key  # noqa: F401  (key: a fixture)

from regress.backends.server_text import TextCheck, shown
from regress.errors import ServerReplyError

SPLIT = "我们在山上看到了美丽的风景。"
"""Fourteen characters the fixture tokenizer splits across 23 tokens (11 of them partial bytes)."""
HOSTILE = "<script>alert(1)</script>\x1b[2J\u202e `**bold**` &amp;"


@pytest.fixture(scope="module")
def tokenizer(fixture_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixture_model))


@pytest.fixture(scope="module")
def check(tokenizer) -> TextCheck:
    return TextCheck(tokenizer)


def _streamed(tokenizer, prompt: list[int], ids: list[int], stop_token: bool = False) -> str:
    """What vLLM's server sends for ``ids`` after ``prompt`` (its fast detokenizer's steps)."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
    decoded = ids[:-1] if stop_token else ids
    return "".join(stream.step(tokenizer.backend_tokenizer, t) or "" for t in decoded)


def _decoded(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The one-shot decode of ``ids`` after ``prompt`` (special tokens skipped)."""
    decode = tokenizer.backend_tokenizer.decode
    return decode(prompt + ids, skip_special_tokens=True)[len(decode(prompt, skip_special_tokens=True)):]


def _refused(call: Callable[[], Any], match: str = "not what its") -> ServerReplyError:
    with pytest.raises(ServerReplyError, match=match) as caught:
        call()
    assert caught.value.exit_code == 3
    return caught.value


# -- the rule, on the fixture tokenizer -----------------------------------------------------------


def test_what_vllms_detokenizer_sends_passes(tokenizer, check):
    """Slices of the fixture corpus (English, Chinese, code, ChatML) and of random ids (special
    tokens among them) after prompts of every length, cut anywhere, a character split across the
    prompt's end excepted (regress renders prompts from text: they end on a whole character)."""
    from regress.fixture_model import corpus_text

    corpus = tokenizer.backend_tokenizer.encode(corpus_text()).ids
    rng = random.Random(7)
    held = 0
    for _ in range(400):
        start = rng.randrange(len(corpus) - 80)
        cut = start + rng.randrange(1, 24)
        prompt = corpus[start:cut]
        ids = (corpus[cut:cut + rng.randrange(1, 40)] if rng.random() < 0.7
               else [rng.randrange(1024) for _ in range(rng.randrange(1, 40))])
        if tokenizer.backend_tokenizer.decode(prompt).endswith("\ufffd"):
            continue
        text = _streamed(tokenizer, prompt, ids)
        held += text != _decoded(tokenizer, prompt, ids)
        check.check(text, ids, prompt, "length", None, 1)
        check.check(_streamed(tokenizer, prompt, ids, stop_token=True), ids, prompt, "stop", None, 1)
    assert held > 10  # the held-back tails were among them


def test_a_character_split_across_tokens(tokenizer, check):
    """Held back until its last byte; at the output's end, never sent. The one-shot decode (U+FFFD
    for the partial tail) passes too; a text that drops more, or keeps a made-up tail, does not."""
    prompt = tokenizer.encode("The view:")
    ids = tokenizer.encode(SPLIT)
    assert any(tokenizer.backend_tokenizer.decode([t]) == "\ufffd" for t in ids)  # split indeed
    partial = ids[:5]  # 我们在 and two of the three bytes of 山
    assert tokenizer.backend_tokenizer.decode(partial) == "我们在\ufffd"
    check.check(SPLIT, ids, prompt, "length", None, 1)
    check.check("我们在", partial, prompt, "length", None, 1)
    check.check("我们在\ufffd", partial, prompt, "length", None, 1)
    for wrong in ("我们", "我们在山", "我们在?", ""):
        _refused(lambda: check.check(wrong, partial, prompt, "length", None, 1))


def test_the_stop_token_and_stop_strings(tokenizer, check):
    prompt = tokenizer.encode("def test_stack():\n")
    body = tokenizer.encode("    s = Stack()\n\n    s.push(1)")
    eos = tokenizer.eos_token_id
    # EOS: not detokenized (special, and the token that stopped the output).
    check.check("    s = Stack()\n\n    s.push(1)", body + [eos], prompt, "stop", None, 1)
    # A stop string: the text is cut before it, at the token that completes it.
    whole = _decoded(tokenizer, prompt, body)
    end = next(n for n in range(1, len(body) + 1) if "\n\n" in _decoded(tokenizer, prompt, body[:n]))
    ids = body[:end]
    cut = whole[:whole.index("\n\n")]
    assert cut == "    s = Stack()"
    check.check(cut, ids, prompt, "stop", ["\n\n"], 1)
    # ... but only for a stop string the request sent, only with "stop", and only where it ends
    # in the last chunk's tokens (a text cut at an earlier place is a text cut short).
    _refused(lambda: check.check(cut, ids, prompt, "stop", ["\n\n\n"], 1))
    _refused(lambda: check.check(cut, ids, prompt, "length", ["\n\n"], 1))
    longer = ids + tokenizer.encode(" x = 1\n\n")
    _refused(lambda: check.check(cut, longer, prompt, "stop", ["\n\n"], 1))
    check.check(cut, longer, prompt, "stop", ["\n\n"], len(longer))  # all in one chunk: one step
    # Without a stop, the last token's text is the output's.
    _refused(lambda: check.check("    s = Stack()\n\n    s.push(", body, prompt, "length", None, 1))


@pytest.mark.parametrize("name", ["other text", "text cut short", "text added", "another token's text",
                                  "nothing", "markup"])
def test_text_the_ids_do_not_hold_is_refused(tokenizer, check, name):
    prompt = tokenizer.encode("The cat sat on the")
    ids = tokenizer.encode(" mat and looked out of the window.")
    true = " mat and looked out of the window."
    text = {"other text": " dog and barked at the postman all day.", "text cut short": " mat and looked",
            "text added": true + " It was raining.", "another token's text": true.replace("window", "widow"),
            "nothing": "", "markup": HOSTILE}[name]
    error = _refused(lambda: check.check(text, ids, prompt, "length", None, 1))
    message = str(error)
    assert f"{len(ids)} token ids" in message and f"({len(text)} characters)" in message
    assert "<" not in message and "\x1b" not in message and "\u202e" not in message and "`" not in message
    assert len(message) < 600


def test_shown_text_is_escaped_and_keeps_its_words():
    assert shown("a\nb") == '"a\\nb"'
    escaped = shown(HOSTILE)
    assert "script" in escaped and "\\u003cscript\\u003e" in escaped
    for char in "<>&`'\x1b\u202e":
        assert char not in escaped
    assert shown("美丽") == '"美丽"'  # readable: only what could act is escaped


# -- through the backend and the stand-in server -------------------------------------------------


def _retext(field: str, texts: Callable[[list[str]], list[str]]) -> Callable[[str, Any, dict[str, Any]], Any]:
    """A tamper that rewrites a stream's texts (``field``: ``text``, or ``content`` of a chat's
    delta) and keeps everything else, the token ids included."""

    def tamper(kind: str, value: Any, body: dict[str, Any]) -> Any:
        if kind != "stream":
            return value
        chunks = [json.loads(line[len(b"data: "):]) for line in value[:-1]]
        with_tokens = [c["choices"][0] for c in chunks if c["choices"][0].get("finish_reason") is not None
                       or (c["choices"][0].get("logprobs") or {}).get("tokens" if field == "text" else "content")]
        new = texts([(c["delta"]["content"] if field == "content" else c["text"]) for c in with_tokens])
        for choice, piece in zip(with_tokens, new):
            if field == "content":
                choice["delta"]["content"] = piece
            else:
                choice["text"] = piece
        return [b"data: " + json.dumps(c).encode() for c in chunks] + value[-1:]

    return tamper


def _chat_requests(backend):
    from regress.backends.base import GenerationRequest
    from test_server_boundary import _sampling

    payloads = ({"messages": [{"role": "user", "content": "Hi"}]},
                {"messages": [{"role": "user", "content": "Hello there"}]})
    return [GenerationRequest(backend.render(p), _sampling()) for p in payloads]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_servers_ids_with_other_text_are_refused(fixture_model, key, endpoint):
    """(a) The ids the server generates (a golden's, for a server that agrees with it) with other
    text, markup in it: refused, naming the request, the markup escaped."""
    field = "content" if endpoint == "chat" else "text"
    with FakeOpenAIServer(str(fixture_model)) as fake:
        backend = _backend(fixture_model, fake.url, endpoint=endpoint)
        backend.load()
        requests = _chat_requests(backend) if endpoint == "chat" else _requests(
            backend, {"prompt": "The cat sat on the"}, {"prompt": "A good cup of tea starts with"})
        assert len(backend.generate(requests, lambda n: None)) == 2  # the honest answers pass
        fake.tamper = _retext(field, lambda pieces: [HOSTILE] + [""] * (len(pieces) - 1))
        error = _refused(lambda: backend.generate(requests, lambda n: None))
    assert f"the {field} is not what its" in str(error) and error.index == 0
    assert "<" not in str(error) and "\x1b" not in str(error)


def test_text_whose_ids_decode_to_something_else_is_refused(fixture_model, key, tokenizer):
    """(b) The text of one output with the ids of another: the text a golden holds, say, sent with
    ids that decode to something else."""
    other = tokenizer.encode(" the dog")
    with FakeOpenAIServer(str(fixture_model), outputs=lambda prompt, n: other) as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        requests = _requests(backend, {"prompt": "The cat sat on"})
        requests[0].sampling["max_tokens"] = len(other)
        assert backend.generate(requests, lambda n: None)[0].text == " the dog"
        fake.tamper = _retext("text", lambda pieces: [" the mat"] + [""] * (len(pieces) - 1))
        error = _refused(lambda: backend.generate(requests, lambda n: None))
    assert '" the mat"' in str(error) and '" the dog"' in str(error), str(error)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("cut", [len(SPLIT), 5, 9])
def test_a_split_character_from_the_server_passes(fixture_model, key, tokenizer, endpoint, cut):
    """(c) What vLLM's server sends for a character split across tokens, in the middle of the
    output and at its end (held back: the text is shorter than the one-shot decode), passes."""
    ids = tokenizer.encode(SPLIT)[:cut]
    with FakeOpenAIServer(str(fixture_model), outputs=lambda prompt, n: ids) as fake:
        backend = _backend(fixture_model, fake.url, endpoint=endpoint)
        backend.load()
        requests = _chat_requests(backend) if endpoint == "chat" else _requests(backend, {"prompt": "The view:"})
        for request in requests:
            request.sampling["max_tokens"] = len(ids)
        outputs = backend.generate(requests, lambda n: None)
    for output in outputs:
        assert output.output_token_ids == ids
        assert output.text == tokenizer.backend_tokenizer.decode(ids).rstrip("\ufffd")
    if cut != len(SPLIT):
        assert outputs[0].text != tokenizer.backend_tokenizer.decode(ids)  # held back indeed


def test_an_output_that_stopped_at_eos_passes(fixture_model, key, tokenizer):
    ids = tokenizer.encode(" and the sun came out.") + [tokenizer.eos_token_id]
    with FakeOpenAIServer(str(fixture_model), outputs=lambda prompt, n: ids, finish="stop") as fake:
        backend = _backend(fixture_model, fake.url)
        backend.load()
        requests = _requests(backend, {"prompt": "The rain stopped"})
        requests[0].sampling["max_tokens"] = len(ids)
        output = backend.generate(requests, lambda n: None)[0]
    assert output.finish_reason == "stop" and output.text == " and the sun came out."


# -- through the command: exit 3 naming the prompt, nothing half-written -------------------------


@pytest.fixture(scope="module")
def golden_project(tmp_path_factory, fixture_model: Path) -> Path:
    """A project whose golden an honest stand-in server answered."""
    root = tmp_path_factory.mktemp("text-ids-golden")
    with FakeOpenAIServer(str(fixture_model)) as fake:
        _workspace(root, fixture_model, fake.url)
        result = run_cli("golden", cwd=root, timeout=600)
    assert result.returncode == 0, result.stderr
    return root


def _first_prompt() -> tuple[str, str]:
    from regress.datasets import FIXTURE_PROMPTS

    first = json.loads(FIXTURE_PROMPTS.read_text(encoding="utf-8").splitlines()[0])
    return first["id"], first["prompt"]


def test_the_goldens_ids_with_other_text_fail_the_check_with_exit_3(tmp_path, fixture_model, golden_project):
    """A candidate server that sends the golden's very ids (scored identical, were the text not
    checked) with other text for one prompt: `regress check` exits 3 naming that prompt and what
    differed, escaped; no run, score or report of the candidate is written."""
    import yaml

    from regress.runs import load_run
    from regress.storage import read_shard_meta

    project = tmp_path / "project"
    shutil.copytree(golden_project, project)
    prompt_id, prompt = _first_prompt()
    golden = {g.prompt_id: g for g in load_run(project / "golden")}
    first_ids = list(golden[prompt_id].prompt_token_ids)

    def tamper(kind: str, value: Any, body: dict[str, Any]) -> Any:
        if kind == "stream" and body.get("prompt") == first_ids:
            return _retext("text", lambda pieces: [HOSTILE] + [""] * (len(pieces) - 1))(kind, value, body)
        return value

    with FakeOpenAIServer(str(fixture_model), tamper=tamper) as fake:
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["candidates"] = {"liar": {"server": {"url": fake.url}}}
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        result = run_cli("check", "liar", cwd=project, timeout=600)
    assert result.returncode == 3, result.stderr
    assert f"prompt '{prompt_id}'" in result.stderr and "not what its" in result.stderr, result.stderr
    assert "<script>" not in result.stderr and "\x1b[2J" not in result.stderr
    assert not (project / "runs" / "liar").exists()  # only its .partial, for a rerun to resume
    assert not (project / "scores" / "liar").exists() and not (project / "reports" / "liar").exists()
    for shard in (project / "runs").glob("liar*/shards/*.shard"):
        assert prompt_id not in read_shard_meta(shard)["prompt_ids"]
