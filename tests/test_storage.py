"""Shard files: exact round trip, atomic writes, compact size."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from regress.storage import (
    atomic_write_text,
    decode_shard,
    encode_shard,
    ragged,
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
