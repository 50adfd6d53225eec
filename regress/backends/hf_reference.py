"""Hugging Face transformers reference backend: the yardstick for implementation drift.

Prompts run one at a time (no padding, so batch composition cannot change a result), with
the raw logits of every step turned into logprobs the same way vLLM reports them (log-softmax
of the unprocessed logits, in float32).
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

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}


class HFReferenceBackend(EngineBackend):
    """``transformers.AutoModelForCausalLM`` on the CPU or the first GPU."""

    name = "hf"

    def load(self) -> dict[str, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = self.spec
        if spec.get("quantization"):
            raise ValueError("the hf backend does not apply 'quantization'; load a quantized checkpoint instead")
        dtype_name = _DTYPES.get(spec.get("dtype") or "auto")
        dtype = getattr(torch, dtype_name) if dtype_name else "auto"
        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        common = {"revision": spec.get("revision")} if spec.get("revision") else {}
        self._tokenizer = AutoTokenizer.from_pretrained(spec.get("tokenizer") or spec["model"], **common)
        try:
            model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, **common)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=dtype, **common)
        self._model = model.to(self._device).eval()
        dtype_used = str(next(model.parameters()).dtype).replace("torch.", "")
        return {
            "resolved_path": str(getattr(model.config, "_name_or_path", spec["model"])),
            "revision": spec.get("revision"),
            "dtype": dtype_used,
            "quantization": None,
            "engine_args": {"device": self._device},
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

    def versions(self) -> dict[str, str | None]:
        found = {**super().versions(), **distribution_versions("torch", "transformers", "accelerate")}
        if found["accelerate"] is None:  # optional for transformers: recorded only when it is there
            del found["accelerate"]
        return found

    def generate(
        self, requests: list[GenerationRequest], progress: ProgressCallback
    ) -> list[RawGeneration]:
        return [self._generate_one(r, progress) for r in requests]

    def _generate_one(self, request: GenerationRequest, progress: ProgressCallback) -> RawGeneration:
        import torch

        s = request.sampling
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
        input_ids = torch.tensor([request.prompt_token_ids], device=self._device)
        with torch.inference_mode():
            torch.manual_seed(s["seed"])
            out = self._model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        new_tokens = out.sequences[0, input_ids.shape[1]:].tolist()
        logits = torch.stack([step[0] for step in out.logits]).float()
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
        progress(1)
        return RawGeneration(new_tokens, text, finish, rows)

    def teacher_force(
        self, sequences: list[tuple[list[int], list[int]]], k: int, progress: ProgressCallback
    ) -> list[LogprobRows]:
        import torch

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
