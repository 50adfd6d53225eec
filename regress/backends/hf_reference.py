"""Hugging Face transformers reference backend: the yardstick for implementation drift.

By default prompts run one at a time (no padding, so batch composition cannot change a result),
with the raw logits of every step turned into logprobs the same way vLLM reports them
(log-softmax of the unprocessed logits, in float32).

Candidate settings (``engine_args``; keys other backends use are ignored, since a candidate
inherits the baseline's ``engine_args``):

- ``device``: ``auto`` (default: the first visible GPU when torch sees one, else the CPU, as
  before these settings existed), ``cpu``, ``cuda`` or ``cuda:N``. A worker pinned to one GPU
  with ``CUDA_VISIBLE_DEVICES`` sees it as ``cuda:0``.
- ``attn_implementation``: passed to ``from_pretrained`` (``sdpa``, ``eager``, ...); default:
  transformers' choice, recorded as the effective ``attention``.
- ``max_batch_size``: prompts generated (and teacher-forced) together, left-padded, in shard
  order (default 1: one at a time, no padding). Only prompts with the same sampling and no stop
  strings share a batch; the others still run alone. This is how batch-variant drift of the
  reference itself is measured (padding and batch shape change the kernels' arithmetic).
- ``tf32``: ``true`` lets float32 matrix products on the GPU use TF32
  (``torch.set_float32_matmul_precision("high")``), ``false`` forbids it (``"highest"``);
  default: torch's own setting, untouched. Applies to float32 models only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from regress.backends.base import (
    EngineBackend,
    GenerationRequest,
    LogprobRows,
    ProgressCallback,
    RawGeneration,
    distribution_versions,
    json_value,
    read_chat_template,
    tokenizer_facts,
    top_k_rows,
)

_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "do_sample")
"""Keys of the model's generation config that transformers falls back on for what a call leaves unset."""

_ENGINE_ARGS = ("device", "attn_implementation", "max_batch_size", "tf32")
"""The ``engine_args`` this backend reads."""

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}


def hf_engine_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    """This backend's settings from a candidate's ``engine_args``, checked (ValueError naming the
    key, what is allowed and what was given); unset ones are left out."""
    out: dict[str, Any] = {}
    device = engine_args.get("device")
    if device is not None:
        if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda")
                                               or (device.startswith("cuda:") and device[5:].isdigit())):
            raise ValueError(f"engine_args.device: use 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        out["device"] = device
    attention = engine_args.get("attn_implementation")
    if attention is not None:
        if not isinstance(attention, str) or not attention:
            raise ValueError(f"engine_args.attn_implementation: use a name such as 'sdpa' or 'eager', got {attention!r}")
        out["attn_implementation"] = attention
    batch = engine_args.get("max_batch_size")
    if batch is not None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"engine_args.max_batch_size: use a whole number >= 1, got {batch!r}")
        out["max_batch_size"] = batch
    tf32 = engine_args.get("tf32")
    if tf32 is not None:
        if not isinstance(tf32, bool):
            raise ValueError(f"engine_args.tf32: use true or false, got {tf32!r}")
        out["tf32"] = tf32
    return out


def _resolve_device(torch: Any, wanted: str | None) -> str:
    if wanted in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"engine_args.device is {wanted!r}, but torch sees no GPU "
                             f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={_visible_devices()!r})")
        index = int(wanted[5:]) if ":" in wanted else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"engine_args.device is {wanted!r}, but torch sees {torch.cuda.device_count()} GPU(s)")
    return wanted


def _visible_devices() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _sampling_group(sampling: dict[str, Any]) -> str | None:
    """Requests with the same key may share a batch; None: this one runs alone (stop strings are
    matched per sequence after the fact, which a padded batch cannot do the same way)."""
    import json

    if sampling.get("stop"):
        return None
    return json.dumps(sampling, sort_keys=True, default=str)


class HFReferenceBackend(EngineBackend):
    """``transformers.AutoModelForCausalLM`` on the CPU or a GPU (``engine_args``: see the module)."""

    name = "hf"
    _max_batch_size = 1

    def load(self) -> dict[str, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = self.spec
        if spec.get("quantization"):
            raise ValueError("the hf backend does not apply 'quantization'; load a quantized checkpoint instead")
        dtype_name = _DTYPES.get(spec.get("dtype") or "auto")
        dtype = getattr(torch, dtype_name) if dtype_name else "auto"
        args = hf_engine_args(spec.get("engine_args") or {})
        self._device = _resolve_device(torch, args.get("device"))
        self._max_batch_size = args.get("max_batch_size", 1)
        if "tf32" in args:
            # The legacy setter keeps torch's old and new precision flags consistent (setting only
            # torch.backends.cuda.matmul.fp32_precision makes get_float32_matmul_precision raise).
            torch.set_float32_matmul_precision("high" if args["tf32"] else "highest")
        common = {"revision": spec.get("revision")} if spec.get("revision") else {}
        self._tokenizer = AutoTokenizer.from_pretrained(spec.get("tokenizer") or spec["model"], **common)
        extra = {"attn_implementation": args["attn_implementation"]} if "attn_implementation" in args else {}
        try:
            model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, **common, **extra)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=dtype, **common, **extra)
        self._model = model.to(self._device).eval()
        dtype_used = str(next(model.parameters()).dtype).replace("torch.", "")
        applied: dict[str, Any] = {"device": self._device}
        if "attn_implementation" in args:
            applied["attn_implementation"] = args["attn_implementation"]
        if "max_batch_size" in args:
            applied["max_batch_size"] = self._max_batch_size
        if "tf32" in args:
            applied["tf32"] = args["tf32"]
            applied["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        if self._device.startswith("cuda"):
            applied["gpu"] = torch.cuda.get_device_name(torch.device(self._device))
        return {
            "resolved_path": str(getattr(model.config, "_name_or_path", spec["model"])),
            "revision": spec.get("revision"),
            "dtype": dtype_used,
            "quantization": None,
            "engine_args": applied,
            "effective": self._effective(dtype_used),
        }

    def _effective(self, dtype: str) -> dict[str, Any]:
        """What applies to transformers of the engine's configuration: dtype, attention, the
        model's generation defaults, the tokenizer. Scheduling and KV-cache settings do not
        (one prompt at a time, no cache sharing), so they stay None."""
        generation = getattr(self._model, "generation_config", None)
        defaults = None
        if generation is not None:
            try:
                diff = generation.to_diff_dict()
            except Exception:  # noqa: BLE001 - a fact we could not read must not fail the load
                diff = {}
            defaults = {k: diff[k] for k in _GENERATION_KEYS if diff.get(k) is not None}
        config = getattr(self._model, "config", None)
        attention = getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", None)
        return json_value({
            "dtype": dtype,
            "quantization": None,
            "attention": attention,
            "engine_generation_defaults": defaults,
            "tokenizer": tokenizer_facts(self._tokenizer, read_chat_template(self.spec)),
        })

    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def reset_cache(self) -> bool:
        return True  # nothing outlives a generate call: each builds its own key-value cache

    def versions(self) -> dict[str, str | None]:
        found = {**super().versions(), **distribution_versions("torch", "transformers", "accelerate")}
        if found["accelerate"] is None:  # optional for transformers: recorded only when it is there
            del found["accelerate"]
        return found

    def generate(
        self, requests: list[GenerationRequest], progress: ProgressCallback
    ) -> list[RawGeneration]:
        if self._max_batch_size <= 1:
            return [self._generate_one(r, progress) for r in requests]
        results: list[RawGeneration | None] = [None] * len(requests)
        for batch in self._batches([r.sampling for r in requests]):
            if len(batch) == 1:
                results[batch[0]] = self._generate_one(requests[batch[0]], progress)
                continue
            outputs = self._generate_batch([requests[i] for i in batch])
            for i, out in zip(batch, outputs):
                results[i] = out
            progress(len(batch))
        return [r for r in results if r is not None]

    def _batches(self, samplings: list[dict[str, Any]]) -> list[list[int]]:
        """Indices of the requests that run together: same sampling, in shard order, at most
        ``max_batch_size`` each (a request with stop strings alone). Deterministic, so the same
        shard always gives the same batches."""
        groups: dict[str, list[int]] = {}
        alone: list[list[int]] = []
        for i, sampling in enumerate(samplings):
            key = _sampling_group(sampling)
            if key is None:
                alone.append([i])
            else:
                groups.setdefault(key, []).append(i)
        batches = [members[j:j + self._max_batch_size] for members in groups.values()
                   for j in range(0, len(members), self._max_batch_size)]
        return sorted(batches + alone, key=lambda b: b[0])

    def _generation_kwargs(self, s: dict[str, Any]) -> dict[str, Any]:
        greedy = s["temperature"] == 0
        eos = self._tokenizer.eos_token_id
        kwargs: dict[str, Any] = dict(
            max_new_tokens=s["max_tokens"],
            min_new_tokens=s["min_tokens"] or None,
            do_sample=not greedy,
            repetition_penalty=s["repetition_penalty"],
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else eos,
            eos_token_id=None if s["ignore_eos"] else eos,
        )
        if not greedy:
            kwargs.update(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"] or None)
        else:
            # The model's generation_config may carry sampling defaults; greedy means greedy.
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if s["stop"]:
            kwargs.update(stop_strings=list(s["stop"]), tokenizer=self._tokenizer)
        return kwargs

    def _pad_id(self) -> int:
        pad = self._tokenizer.pad_token_id
        return pad if pad is not None else self._tokenizer.eos_token_id

    def _generate_one(self, request: GenerationRequest, progress: ProgressCallback) -> RawGeneration:
        import torch

        s = request.sampling
        kwargs = self._generation_kwargs(s)
        input_ids = torch.tensor([request.prompt_token_ids], device=self._device)
        with torch.inference_mode():
            torch.manual_seed(s["seed"])
            out = self._model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        new_tokens = out.sequences[0, input_ids.shape[1]:].tolist()
        logits = torch.stack([step[0] for step in out.logits]).float()
        progress(1)
        return self._raw_generation(s, new_tokens, logits)

    def _generate_batch(self, requests: list[GenerationRequest]) -> list[RawGeneration]:
        """Requests of one sampling generated as one left-padded batch."""
        import torch

        s = requests[0].sampling
        kwargs = self._generation_kwargs(s)
        input_ids, attention = self._left_padded([r.prompt_token_ids for r in requests])
        with torch.inference_mode():
            torch.manual_seed(s["seed"])
            out = self._model.generate(input_ids, attention_mask=attention, **kwargs)
        width = input_ids.shape[1]
        eos = None if s["ignore_eos"] else self._tokenizer.eos_token_id
        results = []
        for i in range(len(requests)):
            new_tokens = out.sequences[i, width:].tolist()
            # A sequence that finished early is filled with padding up to the batch's longest:
            # keep what it generated, up to and including its eos.
            if eos is not None and eos in new_tokens:
                new_tokens = new_tokens[: new_tokens.index(eos) + 1]
            logits = torch.stack([step[i] for step in out.logits[: len(new_tokens)]]).float() if new_tokens else None
            results.append(self._raw_generation(s, new_tokens, logits))
        return results

    def _left_padded(self, sequences: list[list[int]]) -> tuple[Any, Any]:
        import torch

        width = max(len(seq) for seq in sequences)
        pad = self._pad_id()
        ids = [[pad] * (width - len(seq)) + list(seq) for seq in sequences]
        mask = [[0] * (width - len(seq)) + [1] * len(seq) for seq in sequences]
        return (torch.tensor(ids, device=self._device), torch.tensor(mask, device=self._device))

    def _raw_generation(self, s: dict[str, Any], new_tokens: list[int], logits: Any) -> RawGeneration:
        import torch

        eos = self._tokenizer.eos_token_id
        if not new_tokens:
            rows = LogprobRows.empty(s["logprobs"])
        else:
            logprobs = torch.log_softmax(logits, dim=-1).cpu().numpy()
            rows = top_k_rows(logprobs, np.asarray(new_tokens), s["logprobs"])
        text = self._tokenizer.decode(new_tokens, skip_special_tokens=True)
        finish = "length"
        if new_tokens and eos is not None and new_tokens[-1] == eos and not s["ignore_eos"]:
            finish = "stop"
        for stop in s["stop"]:
            cut = text.find(stop)
            if cut >= 0:
                text, finish = text[:cut], "stop"
        return RawGeneration(new_tokens, text, finish, rows)

    def teacher_force(
        self, sequences: list[tuple[list[int], list[int]]], k: int, progress: ProgressCallback
    ) -> list[LogprobRows]:
        import torch

        if self._max_batch_size > 1:
            return self._teacher_force_batched(sequences, k, progress)
        results = []
        for prompt_ids, completion_ids in sequences:
            if not completion_ids:
                results.append(LogprobRows.empty(k))
                progress(1)
                continue
            ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=self._device)
            with torch.inference_mode():
                logits = self._model(ids).logits[0].float()
            # Row t predicts token t+1: the completion's tokens are predicted by rows p-1 .. p+c-2.
            rows = logits[len(prompt_ids) - 1 : len(prompt_ids) + len(completion_ids) - 1]
            logprobs = torch.log_softmax(rows, dim=-1).cpu().numpy()
            results.append(top_k_rows(logprobs, np.asarray(completion_ids), k))
            progress(1)
        return results

    def _teacher_force_batched(
        self, sequences: list[tuple[list[int], list[int]]], k: int, progress: ProgressCallback
    ) -> list[LogprobRows]:
        """Teacher forcing in left-padded batches of up to ``max_batch_size``, in order (positions
        counted from each sequence's first real token, as when it runs alone)."""
        import torch

        results: list[LogprobRows] = [LogprobRows.empty(k) for _ in sequences]
        todo = [i for i, (_, completion) in enumerate(sequences) if completion]
        progress(len(sequences) - len(todo))
        for j in range(0, len(todo), self._max_batch_size):
            batch = todo[j:j + self._max_batch_size]
            full = [list(sequences[i][0]) + list(sequences[i][1]) for i in batch]
            ids, mask = self._left_padded(full)
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                logits = self._model(ids, attention_mask=mask, position_ids=positions).logits
            width = ids.shape[1]
            for row, i in enumerate(batch):
                prompt_ids, completion_ids = sequences[i]
                start = width - len(full[row]) + len(prompt_ids) - 1
                picked = logits[row, start:start + len(completion_ids)].float()
                logprobs = torch.log_softmax(picked, dim=-1).cpu().numpy()
                results[i] = top_k_rows(logprobs, np.asarray(completion_ids), k)
            progress(len(batch))
        return results
