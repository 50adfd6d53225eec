"""What a stored run may hold: every value of its shards checked as it is read back.

A golden or a replay read from disk (shared storage, a cache, a DVC remote) is untrusted: its
manifest's hashes say the shards were not changed since the manifest was written, not that the
manifest and shards are what regress wrote. The engine side refuses impossible values before it
writes a shard (:func:`regress.backends.base.rows_problem`, :mod:`regress.backends.server_wire`);
:func:`regress.runs.load_run` refuses the same on the way back in, so that a NaN, a positive
logprob, a token id outside the vocabulary or a finish reason no engine gives never becomes a
score. Each refusal is a :class:`~regress.errors.StorageError` (exit 2) naming the file and the
field. What only the two runs together can show is checked by :mod:`regress.run_pairs`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from regress.errors import StorageError
from regress.records.generation import LOGPROB_LIMIT, NOT_GENERATED

if TYPE_CHECKING:
    from regress.records import RunManifest

FINISH_REASONS = frozenset({"stop", "length", "repetition", NOT_GENERATED})
"""The finish reasons a stored prompt may have: a whole output (``stop``, ``length``, vLLM's
``repetition``; the server backend refuses ``abort`` and ``error``) or a prefill-only prompt's
:data:`~regress.records.generation.NOT_GENERATED`."""

INT32_BOUND = 2 ** 31
"""Token ids are stored as int32: the bound where the vocabulary is not known."""

VOCAB_PADDING = 1024
"""Ids a model may have past its tokenizer's (``tokens.json``'s ``size`` is ``len(tokenizer)``):
embedding rows are padded, to a multiple of 128 x the tensor-parallel size in Megatron-made
checkpoints (Qwen2.5's 151,936 rows for 151,665 tokenizer ids), and vLLM keeps the config's rows.
A run records only the tokenizer's size, so ids up to this far past it are accepted."""

TOKEN_ARRAYS = ("prompt_tokens", "output_tokens", "tf_tokens")
TRACKS = ("out_", "tf_")
"""Prefixes of the logprob tracks: ``<p>token_logprobs`` [n], ``<p>top_ids`` / ``<p>top_logprobs`` [n, k]."""


def vocabulary_bound(run_dir: Path, manifest: "RunManifest") -> tuple[int, str]:
    """(one past the largest token id the run may hold, where that bound comes from)."""
    sizes: list[int] = []
    try:
        data = json.loads((run_dir / "tokens.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    size = data.get("size") if isinstance(data, dict) else None
    if type(size) is int and size > 0:
        sizes.append(size)
    tokenizer = manifest.effective.tokenizer if manifest.effective is not None else None
    if tokenizer is not None and type(tokenizer.vocab_size) is int and tokenizer.vocab_size > 0:
        sizes.append(tokenizer.vocab_size)
    if not sizes:
        return INT32_BOUND, "the int32 range (the run records no vocabulary size)"
    bound = min(max(sizes) + VOCAB_PADDING, INT32_BOUND)
    return bound, f"the vocabulary of {max(sizes)} ids (+{VOCAB_PADDING} padded embedding rows)"


def check_meta_values(file: Path, meta: dict[str, Any], count: int) -> None:
    """The per-prompt lists of a shard's meta.json (their lengths are checked already): prompt ids
    non-empty strings, once each; texts strings; finish reasons of :data:`FINISH_REASONS`; each
    sampling a resolved sampling."""
    from pydantic import ValidationError

    from regress.records import ResolvedSampling

    def bad(key: str, i: int, why: str) -> StorageError:
        return StorageError(f"{file}: not a consistent shard: meta.json '{key}'[{i}] {why}")

    seen: set[str] = set()
    for i, pid in enumerate(meta["prompt_ids"]):
        if not isinstance(pid, str) or not pid:
            raise bad("prompt_ids", i, f"is {str(pid)[:40]!r}, not a prompt id")
        if pid in seen:
            raise bad("prompt_ids", i, f"repeats the prompt id {pid[:60]!r}: a prompt is stored once")
        seen.add(pid)
    for i, text in enumerate(meta["texts"]):
        if not isinstance(text, str):
            raise bad("texts", i, f"is {str(text)[:40]!r}, not a text")
    for i, reason in enumerate(meta["finish_reasons"]):
        if not isinstance(reason, str) or reason not in FINISH_REASONS:
            raise bad("finish_reasons", i, f"is {str(reason)[:40]!r}, not one of {', '.join(sorted(FINISH_REASONS))}")
    for i, sampling in enumerate(meta["sampling"]):
        if not isinstance(sampling, dict):
            raise bad("sampling", i, f"is {str(sampling)[:40]!r}, not a sampling record")
        try:
            ResolvedSampling.model_validate(sampling)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise bad("sampling", i, f"is not a sampling record: {first['msg']} at "
                                     f"{'.'.join(map(str, first['loc']))}") from exc


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in np.argwhere(mask)[0])


def check_array_values(file: Path, arrays: dict[str, np.ndarray], bound: tuple[int, str]) -> None:
    """A shard's arrays (their offsets and row counts are checked already): token ids 1-D integers
    in ``0 .. bound - 1``; per track, logprobs 1-D floats, top-k ids and logprobs 2-D of one shape
    (the same top-k width in both tracks, at least 1 where there are tokens), every logprob NaN-free
    and <= :data:`~regress.records.generation.LOGPROB_LIMIT` (-inf is a logprob: an engine reports
    it, and rows are padded with it), a top-k id in the vocabulary or -1, the padding marker, whose
    logprob is -inf."""
    limit, where_from = bound

    def bad(key: str, why: str) -> StorageError:
        return StorageError(f"{file}: not a consistent shard: array '{key}' {why}")

    for key in TOKEN_ARRAYS:
        if key not in arrays:
            continue
        values = arrays[key]
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise bad(key, f"is {values.dtype} shaped {list(values.shape)}, not 1-D integer token ids")
        outside = (values < 0) | (values >= limit)
        if outside.any():
            at = _first(outside)
            raise bad(key, f"holds the token id {int(values[at])} at {at[0]}, outside {where_from}")
    widths: dict[str, int] = {}
    for prefix in TRACKS:
        lp_key, ids_key, top_key = f"{prefix}token_logprobs", f"{prefix}top_ids", f"{prefix}top_logprobs"
        if lp_key not in arrays:
            continue
        token_lp, top_ids, top_lp = arrays[lp_key], arrays[ids_key], arrays[top_key]
        if token_lp.ndim != 1 or token_lp.dtype.kind != "f":
            raise bad(lp_key, f"is {token_lp.dtype} shaped {list(token_lp.shape)}, not 1-D float logprobs")
        if top_ids.ndim != 2 or top_ids.dtype.kind not in "iu":
            raise bad(ids_key, f"is {top_ids.dtype} shaped {list(top_ids.shape)}, not 2-D integer token ids")
        if top_lp.dtype.kind != "f" or top_lp.shape != top_ids.shape:
            raise bad(top_key, f"is {top_lp.dtype} shaped {list(top_lp.shape)}, not float logprobs shaped "
                               f"as '{ids_key}' {list(top_ids.shape)}")
        if len(top_ids) and top_ids.shape[1] < 1:
            raise bad(ids_key, "has no top-k column for its tokens (a top-k is at least 1)")
        widths[ids_key] = top_ids.shape[1]
        for key, values in ((lp_key, token_lp), (top_key, top_lp)):
            wrong = np.isnan(values) | (values > LOGPROB_LIMIT)
            if wrong.any():
                at = _first(wrong)
                raise bad(key, f"holds {float(values[at])!r} at {list(at)}: a logprob is a number <= 0 "
                               f"(up to {LOGPROB_LIMIT:g} above it for float rounding) or -inf")
        outside = (top_ids < -1) | (top_ids >= limit)
        if outside.any():
            at = _first(outside)
            raise bad(ids_key, f"holds the token id {int(top_ids[at])} at {list(at)}, outside {where_from}")
        padding = (top_ids == -1) & (top_lp != -np.inf)
        if padding.any():
            at = _first(padding)
            raise bad(ids_key, f"holds the padding id -1 at {list(at)} with the logprob {float(top_lp[at])!r} "
                               "(padding has -inf)")
    if len(set(widths.values())) > 1:
        raise bad("tf_top_ids", f"has {widths['tf_top_ids']} top-k columns, 'out_top_ids' {widths['out_top_ids']}: "
                                "both tracks of a shard keep the same top-k")
