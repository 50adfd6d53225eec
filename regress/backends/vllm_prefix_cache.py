"""Teacher forcing that reads the prompt's keys and values from vLLM's prefix cache.

Teacher forcing prefills prompt + the golden's completion right after the same shard's generation,
so the prompt's keys and values are in the engine's prefix cache already. vLLM never reads the
cache for a request with ``prompt_logprobs`` (``SamplingParams.skip_reading_prefix_cache``
defaults to True then): a cache hit leaves the hit positions' logprob rows uncomputed, and those
rows may be wanted. Here only the completion's rows are wanted (:mod:`vllm_scored_positions`), so
the cache may serve every position before them, and no more: the cache can hold more than the
prompt (the candidate's own output up to its first divergence, another sample's completion of the
same prompt), and a hit that reached into the completion would leave its first rows uncomputed.

How: vLLM's scheduler looks a new request up with ``KVCacheManager.get_computed_blocks``, which
finds the longest run of cached blocks among the request's block hashes. Around it, a request
that carries :data:`vllm_scored_positions.SCORE_FROM` = N is shown only the hashes of its first
``N // hash block size`` blocks for the one call, so the hit ends at or before position N and the
rows from N are computed as in a fresh prefill. Requests without that key are untouched.

Measured (docs/benchmarks.md, "Reading the prompt from the prefix cache"): with 32-token blocks,
teacher forcing of 96 SmolLM2 chat prompts took 4.56 s instead of 6.91 s, every completion logprob
bit-identical. With the CPU engine's default 128-token blocks a short prompt fills no block and
nothing is read.

As with the scored positions, this is a wrapper on vLLM internals, so :func:`enable` verifies it
on the loaded engine (:func:`verify`): a probe sequence cached whole, then teacher-forced from a
position inside its second block, must hit exactly its first block and give the same logprobs, bit
for bit, as the same request prefilled afresh. Otherwise the wrapper is taken out and teacher
forcing prefills the prompt again, as before (the reason is recorded in the run's effective
settings).

What the probe cannot promise: the same bits for a sequence whose own prefill already depends on
its batch. The CPU engine's attention divides a long sequence's work among its threads by what
the whole step holds, so a prompt of 1,151-2,785 tokens is scored differently alone than in its
shard (up to 0.15 nat per position, bf16), and a step made shorter by the cache moves it the same
way. On the demo every teacher-forced sequence of up to a few hundred tokens kept its bits with the
cache read (next, FP8 KV, W8A8, W4A16); its three long-context prompts moved within that batch
variance (docs/benchmarks.md).

Runs in candidate environments: the standard library, numpy and vLLM only.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from regress.backends import vllm_patch
from regress.backends import vllm_scored_positions as scored_positions

_MARK = "_regress_capped_prefix_lookup"
PROBE_TAIL = 16
"""Tokens of the probe past its second block."""


def _manager_class() -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager


def _hash_block_size(manager: Any) -> int | None:
    """Tokens per block hash of ``manager``'s requests, else None (then no hit is allowed)."""
    coordinator = getattr(manager, "coordinator", None)
    for owner in (coordinator, getattr(coordinator, "block_pool", None)):
        value = getattr(owner, "hash_block_size", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _capped_lookup(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: Any, request: Any) -> Any:
        start = scored_positions.score_from(request)
        hashes = getattr(request, "block_hashes", None)
        if start is None or not isinstance(hashes, list):
            return original(self, request)
        size = _hash_block_size(self)
        request.block_hashes = hashes[: start // size] if size else []
        try:
            return original(self, request)
        finally:
            request.block_hashes = hashes

    return wrapper


def install() -> str | None:
    """Wrap the scheduler's prefix-cache lookup; the reason it cannot be, else None."""
    try:
        from vllm import SamplingParams

        manager = _manager_class()
    except ImportError as exc:
        return f"no V1 KV cache manager to wrap ({exc})"
    try:
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)
    except TypeError:
        return "SamplingParams has no skip_reading_prefix_cache"
    if not vllm_patch.wrap(manager, "get_computed_blocks", _capped_lookup, _MARK):
        return "the KV cache manager has no get_computed_blocks"
    return None


def uninstall() -> None:
    try:
        manager = _manager_class()
    except ImportError:
        return
    vllm_patch.unwrap(manager, "get_computed_blocks", _MARK)


def _block_size(llm: Any) -> int | None:
    cache = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    value = getattr(cache, "block_size", None)
    return value if isinstance(value, int) and value > 0 else None


def verify(llm: Any, vocab_size: int) -> str | None:
    """Cache a probe, teacher-force it from inside its second block reading the cache and not;
    why the hit or the logprobs are not what they must be, else None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cache = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    if not getattr(cache, "enable_prefix_caching", False):
        return "prefix caching is off"
    size = _block_size(llm)
    if size is None:
        return "the engine's block size could not be read"
    length = 2 * size + PROBE_TAIL
    start = size + PROBE_TAIL // 2  # the scored rows start inside the second block: one block may be read
    # Spread over the vocabulary, away from its special tokens; another pattern than the scored
    # positions' probe so that neither finds the other's blocks.
    ids = [int(100 + (i * 6151 + 17) % max(1, vocab_size - 100)) for i in range(length)]
    prompt = TokensPrompt(prompt_token_ids=ids)

    def forced(read: bool) -> Any:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False,
                                skip_reading_prefix_cache=not read, extra_args={scored_positions.SCORE_FROM: start})
        return llm.generate([prompt], [params], use_tqdm=False)[0]

    try:
        llm.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)], use_tqdm=False)
        fresh, read = forced(False), forced(True)
    finally:
        llm.reset_prefix_cache()
    return probe_problem(fresh.prompt_logprobs, read.prompt_logprobs, getattr(read, "num_cached_tokens", None),
                         ids, start, size)


def probe_problem(fresh: Any, read: Any, cached: int | None, ids: list[int], start: int, size: int) -> str | None:
    """What is wrong with the probe read from the cache (``cached`` tokens hit) against it
    prefilled afresh (vLLM's per-position containers), else None."""
    if cached is None:
        return "the engine does not report its prefix-cache hits"
    if cached == 0:
        return "the probe found nothing in the prefix cache"
    if cached != size * (start // size):
        return f"the probe's prefix-cache hit was {cached} tokens, not the {size * (start // size)} before its scored rows"
    a, b = _chosen(fresh, ids, start), _chosen(read, ids, start)
    if a is None or b is None:
        return "the probe's prompt logprobs could not be read"
    if not np.array_equal(a, b):
        diff = np.abs(a - b)
        return (f"reading the prompt from the prefix cache changes the probe's logprobs "
                f"(max {float(np.nanmax(diff)):.3g} nat): the cache does not hold what a prefill computes")
    return None


def _chosen(positions: Any, ids: list[int], start: int) -> np.ndarray | None:
    """The logprob of each probe token from row ``start`` (scoring token ``start + 1``) on."""
    if positions is None or len(positions) != len(ids):
        return None
    values = []
    for i in range(start + 1, len(ids)):
        position = positions[i]
        entry = position.get(ids[i]) if position else None
        if entry is None:
            return None
        values.append(float(entry.logprob))
    return np.array(values)


def enable(llm: Any, vocab_size: int) -> str | None:
    """Install and verify; on any failure leave vLLM as it was. Returns the reason, else None."""
    return vllm_patch.verified(install, lambda: verify(llm, vocab_size), uninstall)
