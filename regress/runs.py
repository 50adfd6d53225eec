"""Run directories: where a golden or a replay lives on disk, and how it is read back.

::

    <run>/manifest.json          RunManifest, written last: no manifest, no complete run
    <run>/shards/shard-00000.shard   columnar results of shard 0 (see regress.storage)
    <run>/engine.log             what the engine process printed
    <run>/tokens.json            the text of every token id (so reports need no tokenizer)
    <run>/golden-scored/         sampled prompts only: the baseline's teacher-forced scores of
                                 the candidate's samples (a run of its own, against this one)

``tokens.json`` holds ``{"size": N, "tokens": [text of id 0, ...], "bytes": {"<id>": "e590", ...}}``.
``tokens`` is each id decoded alone. ``bytes`` (optional: absent in files written before it, and
when no token needs it) has the raw bytes, as lowercase hex, of each id whose decoded text lost
bytes to U+FFFD: a byte-level BPE or byte-fallback token holding only part of a character's
UTF-8 encoding (a Chinese character or an emoji split over several tokens). Such a *byte piece*
is displayed as its bytes, ``<0xE5><0x90>`` (whole characters in it stay text, see
:func:`piece_display`); consecutive pieces join back into the text (see :func:`join_pieces`).

A run is assembled in ``<run>.partial/`` and renamed into place when every shard is there,
so a reader never sees half a run, and an interrupted run resumes from its finished shards
(see :mod:`regress.replay.rundir` for the swap and its recovery).

Integrity: the manifest records every shard file's sha256, size, run id and shard fingerprint
(``RunManifest.shard_files``, filled in by :func:`write_manifest`). :func:`load_run` checks them
before parsing a shard, so changed bytes, a shard of another run copied in, or a missing shard
is an :class:`~regress.errors.IntegrityError` (exit 3) naming the shard; so is a manifest without
shard hashes (every manifest of this format version records them: removing them must not turn
the check off). Each verified shard's values are then checked (:mod:`regress.run_values`): a
value no engine writes (NaN, a positive logprob, an id outside the vocabulary, a prompt id twice,
a finish reason or sampling that is not one) is a :class:`~regress.errors.StorageError` (exit 2)
naming the shard and the field, before anything is scored.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from regress.errors import IntegrityError, StorageError
from regress.records import FORMAT_VERSION, Generation, LogprobTrack, RunManifest, ShardFile
from regress.records.generation import CHOICE_ARRAYS, ChoiceScores, choice_scores, choices_problem
from regress.run_values import check_array_values, check_meta_values, vocabulary_bound
from regress.storage import (atomic_write_text, decode_shard, partial_path, read_record, read_shard_meta,
                             sha256_file)

MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
ENGINE_LOG = "engine.log"
VOCAB_FILE = "tokens.json"
GOLDEN_SCORED_DIR = "golden-scored"
"""Inside a replay of sampled prompts: the baseline's teacher-forced scores of the candidate's
samples, a run of its own (see :func:`regress.replay.plan.plan_golden_scoring`)."""

_RAGGED = {
    # offsets key: (values key, row-aligned keys)
    "prompt_offsets": ("prompt_tokens", ()),
    "output_offsets": ("output_tokens", ("out_token_logprobs", "out_top_ids", "out_top_logprobs")),
    "tf_offsets": ("tf_tokens", ("tf_token_logprobs", "tf_top_ids", "tf_top_logprobs")),
}


def is_partial(raw: bytes) -> bool:
    """Whether a token's bytes are not valid UTF-8 on their own (a byte piece of a character)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def piece_display(raw: bytes) -> str:
    """A token's bytes for a reader: valid UTF-8 as text, every other byte as ``<0xE5>``
    (uppercase hex, as sentencepiece names its byte tokens)."""
    out: list[str] = []
    while raw:
        try:
            out.append(raw.decode("utf-8"))
            break
        except UnicodeDecodeError as exc:
            out.append(raw[: exc.start].decode("utf-8"))
            out.append("".join(f"<0x{b:02X}>" for b in raw[exc.start: exc.end]))
            raw = raw[exc.end:]
    return "".join(out)


def join_pieces(tokens: Sequence[bytes]) -> list[tuple[int, int, str]]:
    """Where consecutive tokens complete characters: ``(start, end, text)`` for each run
    ``tokens[start:end]`` of two or more tokens that begins with a byte piece and ends on a
    character boundary, ``text`` being the run's bytes decoded (U+FFFD where a character was cut
    off). ``tokens`` holds each token's bytes (:meth:`RunResult.token_bytes`). A run still open
    at the end is left out."""
    runs: list[tuple[int, int, str]] = []
    start: int | None = None
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text: list[str] = []
    for i, raw in enumerate(tokens):
        if start is None:
            if not is_partial(raw):
                continue
            start, text = i, []
            decoder.reset()
        text.append(decoder.decode(raw))
        if not decoder.getstate()[0]:
            if i > start:
                runs.append((start, i + 1, "".join(text)))
            start = None
    return runs


def shard_file(run_dir: Path, index: int) -> Path:
    """Path of shard ``index`` in a run directory."""
    return run_dir / SHARDS_DIR / f"shard-{index:05d}.shard"


def shard_files(run_dir: Path, manifest: RunManifest) -> list[ShardFile]:
    """What the manifest records of each shard file of ``run_dir``: hash, size and the stamps in
    its metadata. A shard that is missing, does not parse, or is stamped with another run id is
    an :class:`IntegrityError`: a manifest must never bless it."""
    records = []
    for shard in manifest.layout.shards:
        file = shard_file(run_dir, shard.index)
        try:
            sha256, size = sha256_file(file)
            meta = read_shard_meta(file)
        except FileNotFoundError as exc:
            raise IntegrityError(f"{file}: shard {shard.index} is missing; the run cannot be marked complete") from exc
        except (OSError, ValueError) as exc:
            raise IntegrityError(f"{file}: shard {shard.index} is unreadable ({exc})") from exc
        run_id = meta.get("run_id")
        if run_id is not None and run_id != manifest.run_id:
            raise IntegrityError(f"{file}: shard {shard.index} belongs to run {run_id}, not {manifest.run_id}")
        fingerprint = meta.get("fingerprint")
        records.append(ShardFile(index=shard.index, sha256=sha256, size=size,
                                 run_id=run_id if isinstance(run_id, str) else None,
                                 fingerprint=fingerprint if isinstance(fingerprint, str) else None))
    return records


def write_manifest(run_dir: Path, manifest: RunManifest) -> RunManifest:
    """Record every shard file in the manifest (:func:`shard_files`) and write it atomically (it
    marks the run complete). Returns the manifest as written."""
    manifest = manifest.model_copy(update={"shard_files": shard_files(run_dir, manifest)})
    atomic_write_text(run_dir / MANIFEST, manifest.model_dump_json(indent=2))
    return manifest


def read_manifest(run_dir: str | Path) -> RunManifest:
    """Read and validate a run's manifest."""
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST
    if not path.is_file():
        partial = partial_path(run_dir)
        hint = f" (an unfinished run is in {partial}; run the command again to resume it)" if partial.exists() else ""
        if run_dir.with_name(f".{run_dir.name}.old").exists():
            hint = " (a run was being replaced when its process died; run the command again to recover it)"
        raise StorageError(f"{run_dir}: not a complete run, {MANIFEST} is missing{hint}")

    def check(data: Any) -> None:
        version = data.get("format_version") if isinstance(data, dict) else None
        if version != FORMAT_VERSION:
            raise StorageError(f"{path}: format version {version!r}, this regress reads {FORMAT_VERSION}")

    return read_record(path, RunManifest, what="a run manifest", check=check,
                       unreadable=lambda exc: f"unreadable manifest: {exc}",
                       invalid=lambda exc: f"invalid manifest: {exc.errors()[0]['msg']} at "
                                           f"{'.'.join(map(str, exc.errors()[0]['loc']))}")


@dataclass
class RunResult:
    """A complete run, read back: the manifest plus every prompt's result, columnar."""

    path: Path
    manifest: RunManifest
    prompt_ids: list[str]
    texts: list[str]
    finish_reasons: list[str]
    sampling: list[dict[str, Any]]
    arrays: dict[str, np.ndarray]
    verified: bool = True
    """Whether every shard was checked against a hash in the manifest: always, for a run
    :func:`load_run` read (a manifest without hashes is refused); False only for a run built in
    memory by a caller that says so."""
    ttft_s: list[float | None] | None = None
    """Per prompt, the time to its first token in seconds, as the ``server`` backend measured it
    (shard meta ``ttft_s``); None entries where unknown (a shard that did not record it), and None
    altogether for a run that recorded no timing (offline runs, runs written before it)."""
    latency_s: list[float | None] | None = None
    """Per prompt, the request's total time in seconds (shard meta ``latency_s``); None as for
    :attr:`ttft_s`."""
    concurrency: int | None = None
    """Requests the ``server`` backend kept in flight (shard meta ``concurrency``); None when not
    recorded."""
    choice_texts: list[list[str] | None] | None = None
    """Per prompt, its choices (None for a prompt without); None altogether for a run with no
    multiple-choice prompt (or written before choices were scored). Their scores are the
    ``choice_*`` arrays (:data:`~regress.records.generation.CHOICE_ARRAYS`)."""
    choice_answers: list[int | None] | None = None
    """Per prompt, the index of its right choice (as :attr:`choice_texts`)."""

    def __post_init__(self) -> None:
        self._index = {pid: i for i, pid in enumerate(self.prompt_ids)}

    def choices(self, key: int | str) -> ChoiceScores | None:
        """A prompt's choices with their log-likelihoods (None: it has none)."""
        i = self._index[key] if isinstance(key, str) else key
        texts = self.choice_texts[i] if self.choice_texts is not None else None
        if texts is None or self.choice_answers is None:
            return None
        offsets = self.arrays["choice_offsets"]
        return choice_scores(texts, int(self.choice_answers[i]), self.arrays, int(offsets[i]), int(offsets[i + 1]))

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._index

    def __iter__(self) -> Iterator[Generation]:
        for i in range(len(self)):
            yield self[i]

    def position(self, prompt_id: str) -> int:
        """Row of a prompt id."""
        return self._index[prompt_id]

    def _vocab_file(self) -> dict[str, Any]:
        """tokens.json, read once (empty when missing or unreadable)."""
        if not hasattr(self, "_vocab"):
            try:
                data = json.loads((self.path / VOCAB_FILE).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
            self._vocab: dict[str, Any] = data if isinstance(data, dict) else {}
        return self._vocab

    def token_texts(self) -> list[str]:
        """Text of every token id of the run's tokenizer (empty list if not recorded)."""
        if not hasattr(self, "_token_texts"):
            try:
                self._token_texts: list[str] = list(self._vocab_file()["tokens"])
            except (KeyError, TypeError):
                self._token_texts = []
        return self._token_texts

    def token_text(self, token_id: int) -> str:
        """Text of one token id (``<id>`` when unknown)."""
        texts = self.token_texts()
        return texts[token_id] if 0 <= token_id < len(texts) else f"<{token_id}>"

    def piece_bytes(self) -> dict[int, bytes]:
        """Raw bytes of every byte piece: the ids whose bytes are not valid UTF-8 on their own
        (empty when tokens.json does not record bytes)."""
        if not hasattr(self, "_piece_bytes"):
            self._piece_bytes: dict[int, bytes] = {}
            recorded = self._vocab_file().get("bytes")
            items = list(recorded.items()) if isinstance(recorded, dict) else []
            for key, value in items:
                try:
                    raw = bytes.fromhex(value)
                    token_id = int(key)
                except (TypeError, ValueError):
                    continue
                if is_partial(raw):
                    self._piece_bytes[token_id] = raw
        return self._piece_bytes

    def display_texts(self) -> list[str]:
        """:meth:`token_texts` for a reader: byte pieces shown as their bytes (``<0xE5><0x90>``)."""
        if not hasattr(self, "_display_texts"):
            texts = list(self.token_texts())
            for token_id, raw in self.piece_bytes().items():
                if 0 <= token_id < len(texts):
                    texts[token_id] = piece_display(raw)
            self._display_texts: list[str] = texts
        return self._display_texts

    def display_text(self, token_id: int) -> str:
        """Text of one token id for a reader (``<id>`` when unknown)."""
        texts = self.display_texts()
        return texts[token_id] if 0 <= token_id < len(texts) else f"<{token_id}>"

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: a byte piece's own, otherwise its text in UTF-8."""
        raw = self.piece_bytes().get(token_id)
        return raw if raw is not None else self.token_text(token_id).encode("utf-8", "surrogatepass")

    @property
    def teacher_forced(self) -> bool:
        return "tf_offsets" in self.arrays

    def _span(self, offsets: str, i: int) -> slice:
        o = self.arrays[offsets]
        return slice(int(o[i]), int(o[i + 1]))

    def prompt_token_ids(self, i: int) -> np.ndarray:
        return self.arrays["prompt_tokens"][self._span("prompt_offsets", i)]

    def output_token_ids(self, i: int) -> np.ndarray:
        return self.arrays["output_tokens"][self._span("output_offsets", i)]

    def __getitem__(self, key: int | str) -> Generation:
        i = self._index[key] if isinstance(key, str) else key
        a = self.arrays
        out = self._span("output_offsets", i)
        forced = None
        if self.teacher_forced:
            tf = self._span("tf_offsets", i)
            forced = LogprobTrack(
                token_ids=a["tf_tokens"][tf], token_logprobs=a["tf_token_logprobs"][tf],
                top_ids=a["tf_top_ids"][tf], top_logprobs=a["tf_top_logprobs"][tf],
            )
        return Generation(
            prompt_id=self.prompt_ids[i],
            prompt_token_ids=self.prompt_token_ids(i),
            output_token_ids=a["output_tokens"][out],
            text=self.texts[i],
            finish_reason=self.finish_reasons[i],
            free_run=LogprobTrack(
                token_ids=a["output_tokens"][out], token_logprobs=a["out_token_logprobs"][out],
                top_ids=a["out_top_ids"][out], top_logprobs=a["out_top_logprobs"][out],
            ),
            teacher_forced=forced,
            sampling_data=self.sampling[i],
            choices=self.choices(i),
        )


def _pad_columns(array: np.ndarray, width: int, fill: Any) -> np.ndarray:
    if array.ndim != 2 or array.shape[1] == width:
        return array
    padded = np.full((array.shape[0], width), fill, dtype=array.dtype)
    padded[:, : array.shape[1]] = array
    return padded


def _concatenate(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Join shard arrays in order, rebasing offsets."""
    if not parts:
        return {}
    width = max((p["out_top_ids"].shape[1] for p in parts), default=0)
    joined: dict[str, np.ndarray] = {}
    for offsets_key, (values_key, rows) in _RAGGED.items():
        if offsets_key not in parts[0]:
            continue
        offsets = [np.zeros(1, np.int64)]
        base = 0
        for p in parts:
            offsets.append(p[offsets_key][1:] + base)
            base += int(p[offsets_key][-1])
        joined[offsets_key] = np.concatenate(offsets)
        joined[values_key] = np.concatenate([p[values_key] for p in parts])
        for key in rows:
            fill = -1 if key.endswith("ids") else -np.inf
            joined[key] = np.concatenate([_pad_columns(p[key], width, fill) for p in parts])
    return joined


_META_LISTS = ("prompt_ids", "texts", "finish_reasons", "sampling")
_REQUIRED_OFFSETS = ("prompt_offsets", "output_offsets")


def _check_shard(file: Path, meta: dict[str, Any], arrays: dict[str, np.ndarray], count: int) -> None:
    """Raise :class:`StorageError` naming ``file`` unless the shard holds ``count`` prompts with
    consistent per-prompt lists and ragged arrays: a shard that parses but does not add up
    (edited, or written by a broken tool) would otherwise fail deep inside scoring."""

    def bad(why: str) -> StorageError:
        return StorageError(f"{file}: not a consistent shard: {why}")

    for key in _META_LISTS:
        value = meta.get(key)
        if not isinstance(value, list):
            raise bad(f"meta.json has no '{key}' list")
        if len(value) != count:
            if key == "prompt_ids":
                raise StorageError(f"{file}: holds {len(value)} prompts, the layout says {count}")
            raise bad(f"'{key}' has {len(value)} entries for {count} prompts")
    for offsets_key, (values_key, rows) in _RAGGED.items():
        if offsets_key not in arrays:
            if offsets_key in _REQUIRED_OFFSETS:
                raise bad(f"the array '{offsets_key}' is missing")
            continue
        offsets, values = arrays[offsets_key], arrays.get(values_key)
        if values is None:
            raise bad(f"the array '{values_key}' is missing")
        if offsets.ndim != 1 or len(offsets) != count + 1 or offsets.dtype.kind not in "iu":
            raise bad(f"'{offsets_key}' is not {count + 1} integer offsets")
        if offsets[0] != 0 or offsets[-1] != len(values) or (np.diff(offsets) < 0).any():
            raise bad(f"'{offsets_key}' does not index '{values_key}' ({len(values)} values)")
        for key in rows:
            if key not in arrays:
                raise bad(f"the array '{key}' is missing")
            if len(arrays[key]) != len(values):
                raise bad(f"'{key}' has {len(arrays[key])} rows for {len(values)} tokens")


def load_run(path: str | Path) -> RunResult:
    """Read a complete run directory into a :class:`RunResult`."""
    run_dir = Path(path)
    manifest = read_manifest(run_dir)
    prompt_ids: list[str] = []
    texts: list[str] = []
    finish: list[str] = []
    sampling: list[dict[str, Any]] = []
    ttft: list[float | None] = []
    latency: list[float | None] = []
    concurrency: int | None = None
    choice_texts: list[Any] = []
    choice_answers: list[Any] = []
    parts = []
    if manifest.shard_files is None:
        raise IntegrityError(f"{run_dir / MANIFEST}: records no shard hashes ('shard_files'), which every manifest of "
                             f"format version {FORMAT_VERSION} carries: edited after the run finished; re-run it or "
                             "restore it")
    recorded = {f.index: f for f in manifest.shard_files}
    bound = vocabulary_bound(run_dir, manifest)
    seen: dict[str, Path] = {}
    for shard in manifest.layout.shards:
        file = shard_file(run_dir, shard.index)
        expected = recorded.get(shard.index)
        if expected is None:
            raise IntegrityError(f"{file}: the manifest {run_dir / MANIFEST} records no hash for shard {shard.index}")
        try:
            data = file.read_bytes()
        except FileNotFoundError as exc:
            raise IntegrityError(f"{file}: shard {shard.index} is missing from a run marked complete") from exc
        except OSError as exc:
            raise StorageError(f"{file}: {exc}") from exc
        # Before parsing: damaged bytes are then named as such, never as whatever the parser
        # happened to trip over, and a shard that parses but was changed is caught too.
        _verify_bytes(file, shard.index, data, expected)
        try:
            meta, arrays = decode_shard(data)
        except ValueError as exc:  # damaged or foreign (regress.storage)
            raise StorageError(f"{file}: {exc}") from exc
        _verify_stamps(file, shard.index, meta, manifest, expected)
        _check_shard(file, meta, arrays, shard.count)
        check_meta_values(file, meta, shard.count)
        check_array_values(file, arrays, bound)
        for pid in meta["prompt_ids"]:
            if seen.setdefault(pid, file) != file:
                raise StorageError(f"{file}: not a consistent shard: meta.json 'prompt_ids' holds {pid[:60]!r}, "
                                   f"which {seen[pid]} holds too: a prompt is stored once")
        problem = choices_problem(meta, arrays, shard.count)
        if problem is not None:
            raise StorageError(f"{file}: not a consistent shard: {problem}")
        # Only shards holding a multiple-choice prompt have choice arrays: left out of the test.
        if parts and set(arrays) - set(CHOICE_ARRAYS) != set(parts[0]) - set(CHOICE_ARRAYS):
            raise StorageError(f"{file}: holds the arrays {sorted(arrays)}, the run's first shard "
                               f"{sorted(parts[0])}: shards of two different runs?")
        prompt_ids += meta["prompt_ids"]
        texts += meta["texts"]
        finish += meta["finish_reasons"]
        sampling += meta["sampling"]
        ttft += _timing_list(file, meta, "ttft_s", shard.count)
        latency += _timing_list(file, meta, "latency_s", shard.count)
        if concurrency is None:
            concurrency = _concurrency(file, meta)
        parts.append(arrays)
        choice_texts += meta.get("choice_texts") or [None] * shard.count
        choice_answers += meta.get("choice_answers") or [None] * shard.count
    timed = any(v is not None for v in ttft) or any(v is not None for v in latency)
    joined = _concatenate(parts)
    chosen = any(t is not None for t in choice_texts)
    if chosen:
        joined.update(_concatenate_choices(parts))
    return RunResult(run_dir, manifest, prompt_ids, texts, finish, sampling, joined,
                     verified=True,
                     ttft_s=ttft if timed else None, latency_s=latency if timed else None,
                     concurrency=concurrency, choice_texts=choice_texts if chosen else None,
                     choice_answers=choice_answers if chosen else None)


def _concatenate_choices(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The choice arrays of every shard joined in order (a shard without choices adds none, but
    its prompts still take their places in ``choice_offsets``), offsets rebased."""
    prompt_offsets, token_offsets = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    totals, tokens, token_lp = [], [], []
    choices_before = tokens_before = 0
    for p in parts:
        if "choice_offsets" not in p:
            count = len(p["prompt_offsets"]) - 1
            prompt_offsets.append(np.full(count, choices_before, np.int64))
            continue
        prompt_offsets.append(p["choice_offsets"][1:].astype(np.int64) + choices_before)
        token_offsets.append(p["choice_token_offsets"][1:].astype(np.int64) + tokens_before)
        totals.append(p["choice_logprobs"].astype(np.float64))
        tokens.append(p["choice_tokens"].astype(np.int32))
        token_lp.append(p["choice_token_logprobs"].astype(np.float32))
        choices_before += len(p["choice_logprobs"])
        tokens_before += len(p["choice_tokens"])
    return {"choice_offsets": np.concatenate(prompt_offsets), "choice_token_offsets": np.concatenate(token_offsets),
            "choice_logprobs": np.concatenate(totals), "choice_tokens": np.concatenate(tokens),
            "choice_token_logprobs": np.concatenate(token_lp)}


TIMING_LISTS = ("ttft_s", "latency_s")
"""Per-prompt timing lists a ``server`` run's shard meta holds, aligned with ``prompt_ids``
(seconds, ``null`` where unknown); shards of offline runs have none."""


def _timing_list(file: Path, meta: dict[str, Any], key: str, count: int) -> list[float | None]:
    """A shard's per-prompt timing list ``key`` (None entries when the shard has none): a list of
    the wrong length, or holding anything but non-negative finite numbers and nulls, is a
    :class:`StorageError` naming the shard."""
    value = meta.get(key)
    if value is None:
        return [None] * count
    if not isinstance(value, list) or len(value) != count:
        raise StorageError(f"{file}: not a consistent shard: '{key}' is not a list of {count} entries")
    out: list[float | None] = []
    for v in value:
        if v is None:
            out.append(None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            out.append(float(v))
        else:
            raise StorageError(f"{file}: not a consistent shard: '{key}' holds {v!r}, not seconds or null")
    return out


def _concurrency(file: Path, meta: dict[str, Any]) -> int | None:
    value = meta.get("concurrency")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StorageError(f"{file}: not a consistent shard: 'concurrency' is {value!r}, not a positive integer")
    return value


def _verify_bytes(file: Path, index: int, data: bytes, expected: ShardFile) -> None:
    if len(data) != expected.size or hashlib.sha256(data).hexdigest() != expected.sha256:
        raise IntegrityError(
            f"{file}: shard {index} is not the file the run recorded (size {len(data)}, sha256 "
            f"{hashlib.sha256(data).hexdigest()[:12]}; recorded size {expected.size}, sha256 "
            f"{expected.sha256[:12]}): changed or replaced after the run finished; re-run it or restore it")


def _verify_stamps(file: Path, index: int, meta: dict[str, Any], manifest: RunManifest,
                   expected: ShardFile | None) -> None:
    """The shard's own stamps against the manifest's: caught even where no hash was recorded."""
    run_id = meta.get("run_id")
    if run_id is not None and run_id != manifest.run_id:
        raise IntegrityError(f"{file}: shard {index} belongs to run {run_id}, not to this run {manifest.run_id}: "
                             "a shard of another run was copied in")
    if expected is not None and expected.fingerprint is not None and meta.get("fingerprint") != expected.fingerprint:
        raise IntegrityError(f"{file}: shard {index} was made for another plan (fingerprint "
                             f"{str(meta.get('fingerprint'))[:12]}, recorded {expected.fingerprint[:12]})")


def golden_scored(run: RunResult, golden: RunResult) -> RunResult | None:
    """The baseline's scores of ``run``'s samples (``<run>/golden-scored/``), when there and made
    for this run by the golden's baseline; None otherwise (scoring then falls back to the
    candidate's own logprobs, and says so)."""
    path = run.path / GOLDEN_SCORED_DIR
    if not (path / MANIFEST).is_file():
        return None
    scored = load_run(path)
    made_for = scored.manifest.golden.run_id if scored.manifest.golden is not None else None
    if made_for != run.manifest.run_id or scored.manifest.candidate.name != golden.manifest.candidate.name:
        import logging

        logging.getLogger(__name__).warning(
            "%s: made for run %s by '%s', not for %s by '%s': ignored (replay again)", path, made_for,
            scored.manifest.candidate.name, run.manifest.run_id, golden.manifest.candidate.name)
        return None
    return scored

