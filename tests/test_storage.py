"""Shard files: exact round trip, atomic writes, compact size; stored records read back; directories built aside."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel

from regress.errors import StorageError
from regress.storage import (
    atomic_write_text,
    building,
    decode_shard,
    encode_shard,
    ragged,
    read_record,
    read_shard,
    read_shard_meta,
    write_shard,
)


def _arrays(rng: np.random.Generator, prompts: int, tokens: int, k: int = 5, vocab: int = 32000) -> dict[str, np.ndarray]:
    n = prompts * tokens
    top1 = -rng.exponential(0.4, n)
    top = np.concatenate([top1[:, None], top1[:, None] - np.cumsum(rng.exponential(0.8, (n, k - 1)), axis=1)], axis=1)
    top = top.astype(np.float32)
    token_lp = top[:, 0].copy()
    flip = rng.random(n) < 0.1  # sampled tokens that were not the top-1
    token_lp[flip] = top[flip, 1]
    output, offsets = ragged([rng.integers(0, vocab, tokens) for _ in range(prompts)], np.int32)
    return {
        "output_tokens": output,
        "output_offsets": offsets,
        "out_token_logprobs": token_lp,
        "out_top_ids": rng.integers(0, vocab, (n, k)).astype(np.int32),
        "out_top_logprobs": top,
    }


def test_round_trip_is_bit_exact(tmp_path: Path):
    rng = np.random.default_rng(1)
    arrays = _arrays(rng, 20, 33)
    arrays["out_top_logprobs"][3, 4] = -np.inf
    arrays["out_token_logprobs"][7] = np.float32(-1e-30)
    write_shard(tmp_path / "s.shard", {"prompt_ids": ["a"], "texts": ["<script>é</script>"]}, arrays)
    meta, back = read_shard(tmp_path / "s.shard")
    assert meta["texts"] == ["<script>é</script>"]
    assert read_shard_meta(tmp_path / "s.shard")["prompt_ids"] == ["a"]
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        assert np.array_equal(back[name].view(np.uint8), array.view(np.uint8)), name


def test_empty_arrays_round_trip():
    arrays = {"output_tokens": np.zeros(0, np.int32), "out_top_ids": np.zeros((0, 5), np.int32),
              "out_top_logprobs": np.zeros((0, 5), np.float32), "out_token_logprobs": np.zeros(0, np.float32)}
    _, back = decode_shard(encode_shard({}, arrays))
    assert all(back[k].shape == v.shape for k, v in arrays.items())


def test_garbage_is_rejected():
    with pytest.raises(ValueError, match="not a regress shard"):
        decode_shard(b"PK\x03\x04 not a zip at all")


def test_atomic_write_leaves_no_temporary_files_and_normal_permissions(tmp_path: Path):
    target = tmp_path / "sub" / "f.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]
    assert target.stat().st_mode & 0o044  # readable by group/others like a plain open() under the usual umask


def test_ten_thousand_prompts_are_compact():
    """10,000 prompts x 256 tokens x top-5 must not take hundreds of MB: measured on a 1/20 sample
    (500 prompts) with random float32 mantissas, the worst case for compression."""
    rng = np.random.default_rng(0)
    arrays = _arrays(rng, 500, 256)
    size = len(encode_shard({}, arrays))
    projected_mb = size * 20 / 1e6
    raw_mb = sum(a.nbytes for a in arrays.values()) * 20 / 1e6
    assert projected_mb < 0.6 * raw_mb
    assert projected_mb < 100, f"projected {projected_mb:.0f} MB for a golden of 10,000 x 256 x top-5"


class _Thing(BaseModel):
    name: str
    size: int


def test_read_record_reads_a_good_file(tmp_path: Path):
    path = tmp_path / "thing.json"
    path.write_text('{"name": "a", "size": 3}', encoding="utf-8")
    assert read_record(path, _Thing, what="a thing") == _Thing(name="a", size=3)
    assert read_record(path, _Thing, what="a thing", loads=True) == _Thing(name="a", size=3)


def test_read_record_without_a_file_raises_or_returns_what_it_is_given(tmp_path: Path):
    path = tmp_path / "gone.json"
    with pytest.raises(StorageError, match=r"gone\.json: no such file \(make it first\)$"):
        read_record(path, _Thing, what="a thing", missing_hint=" (make it first)")
    assert read_record(path, _Thing, what="a thing", missing=None) is None


def test_read_record_names_the_file_of_malformed_json(tmp_path: Path):
    path = tmp_path / "thing.json"
    path.write_text('{"name": ', encoding="utf-8")
    with pytest.raises(StorageError, match=r"thing\.json: not a thing: Invalid JSON") as caught:
        read_record(path, _Thing, what="a thing")
    assert caught.value.__cause__ is not None  # the parser's own error, chained
    # With loads, a file that is not JSON cannot be read (json.loads said why).
    with pytest.raises(StorageError, match=r"thing\.json: cannot read a thing \(Expecting value"):
        read_record(path, _Thing, what="a thing", loads=True)
    with pytest.raises(StorageError, match=r"thing\.json: broken: "):
        read_record(path, _Thing, what="a thing", loads=True, unreadable=lambda exc: f"broken: {exc}")


def test_read_record_names_the_file_of_wrong_fields(tmp_path: Path):
    path = tmp_path / "thing.json"
    path.write_text('{"name": "a", "size": "big"}', encoding="utf-8")
    with pytest.raises(StorageError, match=r"thing\.json: not a thing: Input should be a valid integer"):
        read_record(path, _Thing, what="a thing")
    with pytest.raises(StorageError, match=r"thing\.json: field size$"):
        read_record(path, _Thing, what="a thing", invalid=lambda exc: f"field {exc.errors()[0]['loc'][0]}")


def test_read_record_checks_the_data_first_and_raises_the_error_asked_for(tmp_path: Path):
    path = tmp_path / "thing.json"
    path.write_text('{"format": 9, "name": "a", "size": 1}', encoding="utf-8")

    def check(data):
        if data.get("format") != 1:
            raise StorageError(f"{path}: format {data.get('format')}")

    with pytest.raises(StorageError, match="format 9"):
        read_record(path, _Thing, what="a thing", check=check)
    with pytest.raises(LookupError, match="nothing.json: no such file"):
        read_record(tmp_path / "nothing.json", _Thing, what="a thing", error=LookupError)


def test_read_record_can_let_unreadable_files_through(tmp_path: Path):
    path = tmp_path / "thing.json"
    path.write_bytes(b"\xff\xfe not UTF-8")
    with pytest.raises(StorageError, match=r"thing\.json: cannot read a thing"):
        read_record(path, _Thing, what="a thing")
    with pytest.raises(UnicodeDecodeError):
        read_record(path, _Thing, what="a thing", unreadable=None)


@pytest.mark.parametrize("unique", [False, True])
def test_building_renames_into_place_on_success(tmp_path: Path, unique: bool):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with building(dest, unique=unique) as work:
        assert work.is_dir() and not any(work.iterdir()) and work.parent == tmp_path
        (work / "new.txt").write_text("new")
        assert (dest / "old.txt").exists()  # the old one stays until the new one is complete
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]  # replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("unique", [False, True])
def test_building_leaves_nothing_when_the_build_fails(tmp_path: Path, unique: bool):
    dest = tmp_path / "sub" / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with building(dest, unique=unique) as work:
            (work / "half.txt").write_text("half")
            raise RuntimeError("boom")
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_building_keeps_an_existing_dest_when_the_build_fails(tmp_path: Path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with building(dest):
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (dest / "old.txt").read_text() == "old"


def test_building_removes_a_stale_partial_first(tmp_path: Path):
    dest = tmp_path / "out"
    stale = tmp_path / "out.partial"
    stale.mkdir()
    (stale / "leftover.txt").write_text("from an interrupted build")
    with building(dest) as work:
        assert work == stale and not any(work.iterdir())
        (work / "new.txt").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"] and not stale.exists()


def test_building_with_merge_moves_files_into_dest_and_keeps_the_others(tmp_path: Path):
    dest = tmp_path / "out"
    (dest / "sub").mkdir(parents=True)
    (dest / "keep.txt").write_text("mine")
    (dest / "sub" / "same.txt").write_text("old")
    with building(dest, unique=True, merge=True) as work:
        (work / "sub").mkdir()
        (work / "sub" / "same.txt").write_text("new")
        (work / "added.txt").write_text("added")
    assert (dest / "keep.txt").read_text() == "mine" and (dest / "sub" / "same.txt").read_text() == "new"
    assert (dest / "added.txt").read_text() == "added"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
