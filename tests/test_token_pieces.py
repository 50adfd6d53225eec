"""Byte pieces: tokens holding only some bytes of a character (byte-level BPE, byte fallback).

tokens.json records their raw bytes (the engine's vocab op), runs show them as ``<0xE5><0x90>``
and the report shows what consecutive pieces complete. No engine: the vocab op is fed real
``tokenizers``/``transformers`` tokenizers directly.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from report_fixtures import VOCAB, Case, build_case
from regress.report.payload import build_payload
from regress.report.render import render_candidate
from regress.engine.protocol import VocabReply, VocabRequest
from regress.engine.server import EngineServer
from regress.engine.vocabulary import _gpt2_byte_decoder, token_bytes, vocabulary
from regress.runs import VOCAB_FILE, RunResult, is_partial, join_pieces, load_run, piece_display

TEXT = "天气很好，今天我们去公园散步吧。🙂 明天见"
"""Chinese the fixture tokenizer saw in training (some characters merged, some in byte pieces)
and an emoji it never saw (four single-byte tokens)."""
PIECE = re.compile(r"(?:<0x[0-9A-F]{2}>)+")


@pytest.fixture(scope="module")
def byte_level() -> Any:
    """The fixture model's tokenizer: a 1024-token byte-level BPE trained on a corpus with Chinese."""
    from regress.fixture_model import _train_tokenizer

    return _train_tokenizer()


@pytest.fixture(scope="module")
def byte_fallback() -> Any:
    """A sentencepiece-style tokenizer (metaspace, byte fallback) that knows no Chinese at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for word in ("▁", "a", "b", "c", "▁a", "▁b"):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", clean_up_tokenization_spaces=False)


def _run_with(tmp_path: Path, vocab: dict[str, Any]) -> RunResult:
    """A run directory holding only tokens.json (all the token functions read)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return RunResult(tmp_path, None, [], [], [], [], {})  # type: ignore[arg-type]


# ------------------------------------------------------------------ the engine's vocab op


def test_byte_table_is_the_gpt2_bijection() -> None:
    from tokenizers import pre_tokenizers

    table = _gpt2_byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["!"] == 0x21 and table["ÿ"] == 0xFF
    assert table["Ā"] == 0x00 and table["Ń"] == 0xAD  # the 68 moved bytes, in byte order from U+0100
    # tokenizers' ByteLevel writes text as the table's characters: every byte valid UTF-8 can hold
    leads = [0x800] + [0x1000 * k + 0x100 for k in range(1, 16)] + [0x10000, 0x40000, 0x80000, 0xC0000, 0x100000]
    text = "".join(map(chr, [*range(0x800), *leads]))
    mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    inverse = {b: c for c, b in table.items()}
    assert "".join(m for m, _ in mapped) == "".join(inverse[b] for b in text.encode("utf-8"))
    assert len(set(text.encode("utf-8"))) == 256 - 13  # all but C0, C1, F5..FF


def test_vocab_records_bytes_of_every_lossy_token(byte_level: Any) -> None:
    data = vocabulary(byte_level)
    assert data["size"] == len(byte_level) == len(data["tokens"])
    lossy = {i for i, t in enumerate(data["tokens"]) if "\ufffd" in t}
    assert lossy and set(map(int, data["bytes"])) == lossy
    for key, value in data["bytes"].items():
        raw = bytes.fromhex(value)
        assert value == value.lower() and raw
        assert raw.decode("utf-8", "replace") == data["tokens"][int(key)]
    # the byte table inverse is tokenizers' own: every single-byte token maps to its byte
    vocab = byte_level.get_vocab()
    for char, byte in _gpt2_byte_decoder().items():
        if byte >= 0x80:
            assert data["bytes"][str(vocab[char])] == f"{byte:02x}"


def test_byte_level_pieces_join_back_into_the_text(byte_level: Any, tmp_path: Path) -> None:
    run = _run_with(tmp_path, vocabulary(byte_level))
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    pieces = [i for i in ids if i in run.piece_bytes()]
    assert len(pieces) >= 6  # the emoji's four bytes and at least one split character
    for i in ids:
        shown = run.display_text(i)
        if i in run.piece_bytes():
            assert PIECE.search(shown) and "\ufffd" not in shown
            assert run.token_text(i) == run.token_texts()[i] and "\ufffd" in run.token_text(i)  # raw text kept
        else:
            assert shown == run.token_text(i) == byte_level.decode([i])
    raws = [run.token_bytes(i) for i in ids]
    assert b"".join(raws).decode("utf-8") == TEXT
    # each run of pieces completes characters; with the whole tokens between runs it is the text
    runs = join_pieces(raws)
    rebuilt, at = [], 0
    for first, end, text in runs:
        rebuilt += [run.token_text(i) for i in ids[at:first]] + [text]
        at = end
    rebuilt += [run.token_text(i) for i in ids[at:]]
    assert "".join(rebuilt) == TEXT
    assert "🙂" in [text for _, _, text in runs]
    emoji = [run.display_text(i) for i in byte_level.encode("🙂", add_special_tokens=False)]
    assert emoji == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]


def test_byte_fallback_tokens(byte_fallback: Any, tmp_path: Path) -> None:
    data = vocabulary(byte_fallback)
    e4 = byte_fallback.convert_tokens_to_ids("<0xE4>")
    assert data["tokens"][e4] == "\ufffd" and data["bytes"][str(e4)] == "e4"
    assert str(byte_fallback.convert_tokens_to_ids("<0x41>")) not in data["bytes"]  # "A" is whole
    run = _run_with(tmp_path, data)
    ids = byte_fallback.encode("ab 中文", add_special_tokens=False)
    assert [run.display_text(i) for i in ids][-6:] == ["<0xE4>", "<0xB8>", "<0xAD>", "<0xE6>", "<0x96>", "<0x87>"]
    assert [t for _, _, t in join_pieces([run.token_bytes(i) for i in ids])] == ["中", "文"]


class _SlowSentencepiece:
    """What a slow sentencepiece tokenizer may do: decode a lone byte token to nothing."""

    tokens = ["<unk>", "<0xE4>", "<0xB8>", "▁hi", "<0x0A>"]

    def __len__(self) -> int:
        return len(self.tokens)

    def batch_decode(self, ids: list[list[int]], **_: Any) -> list[str]:
        return [{1: "", 2: "", 3: " hi", 4: "\n"}.get(i[0], "") for i in ids]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokens[i] for i in ids]


def test_empty_decoded_byte_tokens_and_other_schemes() -> None:
    assert vocabulary(_SlowSentencepiece())["bytes"] == {"1": "e4", "2": "b8"}
    assert token_bytes("Ġä¸", " \ufffd") == b" \xe4\xb8"
    assert token_bytes("Ġä¸", "\ufffd") == b" \xe4\xb8"  # decode() cleaned up the space
    assert token_bytes("ä¸ä¸", "\ufffd") == b"\xe4\xb8\xe4\xb8"  # U+FFFD counts may differ
    assert token_bytes("ä¸", "\ufffd") == b"\xe4\xb8"
    assert token_bytes("▁中", "\ufffd") is None  # not byte-level: no table character
    assert token_bytes("ab", "\ufffd") is None  # byte-level characters, but they do not decode to the text
    assert token_bytes(None, "\ufffd") is None


class _Broken(_SlowSentencepiece):
    def batch_decode(self, ids: list[list[int]], **_: Any) -> list[str]:
        return ["\ufffd"] * len(ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        raise NotImplementedError("no such thing here")


class _Backend:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer


def test_vocab_op_writes_the_file(byte_level: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = EngineServer(None)
    server.backend = _Backend(byte_level)  # type: ignore[assignment]
    out = tmp_path / "tokens.json"
    assert server.handle(VocabRequest(out=str(out))) == VocabReply()
    data = json.loads(out.read_text(encoding="utf-8"))
    assert set(data) == {"size", "tokens", "bytes"} and data == vocabulary(byte_level)
    # a tokenizer whose entries cannot be read costs only the bytes, not the texts
    server.backend = _Backend(_Broken())  # type: ignore[assignment]
    server.handle(VocabRequest(out=str(out)))
    data = json.loads(out.read_text(encoding="utf-8"))
    assert set(data) == {"size", "tokens"} and len(data["tokens"]) == 5
    assert "bytes of partial tokens not recorded" in capsys.readouterr().err


# ------------------------------------------------------------------ reading runs


def test_display() -> None:
    assert piece_display(b"\xe4\xb8") == "<0xE4><0xB8>"
    assert piece_display(b"\xad") == "<0xAD>"
    assert piece_display("中".encode() + b"\xe5") == "中<0xE5>"  # whole characters stay text
    assert piece_display(b" \xf0\x9f") == " <0xF0><0x9F>"
    assert is_partial(b"\xe4") and not is_partial("中".encode()) and not is_partial(b"")


def test_join_pieces() -> None:
    b = "天气很好".encode()
    tokens = [b[:1], b[1:4], b[4:5], b[5:9], b[9:], b"x", b"\xe5", b" y", b"\xb8", b"\xe4\xb8"]
    # a cut-off character reads as U+FFFD; a lone continuation byte and an unfinished run complete nothing
    assert join_pieces(tokens) == [(0, 4, "天气很"), (6, 8, "\ufffd y")]
    assert join_pieces([b"a", b"b"]) == []


def test_old_tokens_json_still_reads(tmp_path: Path) -> None:
    old = _run_with(tmp_path / "old", {"size": 3, "tokens": ["a", "\ufffd", " b"]})
    assert old.piece_bytes() == {}
    assert old.display_texts() == old.token_texts() == ["a", "\ufffd", " b"]
    assert old.display_text(1) == "\ufffd" and old.display_text(7) == "<7>" and old.token_bytes(2) == b" b"
    odd = _run_with(tmp_path / "odd", {"size": 3, "tokens": ["a", "\ufffd", "\ufffd"],
                                       "bytes": {"1": "zz", "x": "e4", "2": "e4b8", "0": "61"}})
    assert odd.piece_bytes() == {2: b"\xe4\xb8"}  # unreadable entries and whole bytes are ignored
    assert odd.display_texts() == ["a", "\ufffd", "<0xE4><0xB8>"]
    assert _run_with(tmp_path / "none", {"size": 1, "tokens": ["a"], "bytes": None}).piece_bytes() == {}
    assert RunResult(tmp_path / "missing", None, [], [], [], [], {}).display_texts() == []  # type: ignore[arg-type]


# ------------------------------------------------------------------ the report


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("pieces"), 20, semantic=False)


PIECES = {"\xe4\xb8": "e4b8", "中": "ad", "上": "8a", "lead": "e5"}
"""Four byte pieces added to the fixture vocabulary: the first two bytes of 中 and 上, the third
byte of each, and a lone lead byte."""


def _with_pieces(case: Case, tmp_path: Path) -> tuple[RunResult, RunResult, str, int, dict[str, int]]:
    """Golden and candidate copies whose regression diverges inside a character: both write E4 B8,
    then the golden AD (中) and the candidate 8A (上)."""
    ids = {name: len(VOCAB) + i for i, name in enumerate(PIECES)}
    vocab = {"size": len(VOCAB) + len(PIECES), "tokens": VOCAB + ["\ufffd"] * len(PIECES),
             "bytes": {str(ids[name]): value for name, value in PIECES.items()}}
    runs = []
    for source in (case.golden, case.run):
        target = tmp_path / source.path.name
        shutil.copytree(source.path, target)
        (target / VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        runs.append(load_run(target))
    golden, run = runs
    score = next(s for s in case.score.scores if s.prompt_class == "regression")
    d = score.metrics["first_divergence"]
    assert d >= 1
    for r, mine, theirs in ((golden, "中", "上"), (run, "上", "中")):
        at = int(r.arrays["output_offsets"][r.position(score.prompt_id)]) + d
        r.arrays["output_tokens"][at - 1] = ids["\xe4\xb8"]
        r.arrays["output_tokens"][at] = ids[mine]
        r.arrays["out_top_ids"][at, :3] = [ids[mine], ids[theirs], ids["lead"]]
    return golden, run, score.prompt_id, d, ids


def test_payload_shows_pieces_and_what_they_complete(case: Case, tmp_path: Path) -> None:
    golden, run, pid, d, _ = _with_pieces(case, tmp_path)
    data = build_payload(case.score, golden, run, None)
    w = next(p for p in data["prompts"] if p["id"] == pid)["w"]
    lo = w.get("pre0", 0)
    assert w["pre"][-1] == "<0xE4><0xB8>" and w["g"][0] == "<0xAD>" and w["c"][0] == "<0x8A>"
    assert w["gj"] == [[d - 1 - lo, d + 1 - lo, "中"]] and w["cj"] == [[d - 1 - lo, d + 1 - lo, "上"]]
    assert w["gk"][0] == ["<0xAD>", w["gk"][0][1], 1, "中"]
    assert w["gk"][1] == ["<0x8A>", w["gk"][1][1], 2, "上"]  # the choice at the divergence is readable
    assert w["gk"][2][0] == "<0xE5>" and len(w["gk"][2]) == 3  # a lead byte completes nothing
    assert w["ck"][0][3] == "上" and w["ck"][1][3] == "中"
    others = [p["w"] for p in data["prompts"] if "w" in p and p["id"] != pid]
    assert others and not any("gj" in o or "cj" in o for o in others)
    assert all(len(row) == 3 for o in others for row in o.get("gk", []))

    page = render_candidate(case.score, golden, run, None)
    block = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, flags=re.S)
    assert block
    shown = next(p for p in json.loads(block.group(1))["prompts"] if p["id"] == pid)["w"]
    assert shown["g"][0] == "<0xAD>" and shown["gj"] == w["gj"]


def test_payload_without_recorded_bytes_is_unchanged(case: Case) -> None:
    data = build_payload(case.score, case.golden, case.run, None)
    windows = [p["w"] for p in data["prompts"] if "w" in p]
    assert windows and not any(k in w for w in windows for k in ("gj", "cj"))
    texts = set(VOCAB)
    assert all(t in texts for w in windows for t in w["pre"] + w["g"] + w["c"])
