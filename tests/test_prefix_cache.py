"""Teacher forcing reads the prompt from vLLM's prefix cache, capped at the completion
(regress.backends.vllm_prefix_cache).

The cap's bookkeeping is checked against a stand-in KV cache manager; the probe's judgement on
made-up answers; and on the real engine (the fixture model, 32-token blocks) teacher forcing of
sequences whose every block is cached (the completion is the engine's own output) must give the
same bits with the cache read as prefilled afresh, with hits that stop before the completion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from regress.backends import vllm_prefix_cache as prefix_cache
from regress.backends import vllm_scored_positions as scored_positions


class _Manager:
    """What the wrapper reads of vLLM's KVCacheManager, with a lookup that reports the hashes it saw."""

    def __init__(self, hash_block_size: int | None):
        pool = types.SimpleNamespace(hash_block_size=hash_block_size)
        self.coordinator = types.SimpleNamespace(block_pool=pool)

    def get_computed_blocks(self, request):
        if getattr(request, "fail", False):
            raise RuntimeError("lookup failed")
        return list(request.block_hashes), len(request.block_hashes) * 32, 0


def _request(start: int | None, blocks: int = 5):
    extra = None if start is None else {scored_positions.SCORE_FROM: start}
    return types.SimpleNamespace(block_hashes=[f"h{i}" for i in range(blocks)],
                                 sampling_params=types.SimpleNamespace(extra_args=extra))


@pytest.mark.fast
@pytest.mark.parametrize(("start", "seen"), [(None, 5), (31, 0), (32, 1), (63, 1), (64, 2), (1000, 5)])
def test_the_lookup_sees_only_the_blocks_before_the_scored_rows(start, seen):
    lookup = prefix_cache._capped_lookup(_Manager.get_computed_blocks)
    request = _request(start)
    hashes = request.block_hashes
    blocks, tokens, _ = lookup(_Manager(32), request)
    assert blocks == hashes[:seen] and tokens == 32 * seen
    assert start is None or tokens <= start  # the scored rows are computed, never read
    assert request.block_hashes is hashes and len(hashes) == 5  # the request's own list, untouched


@pytest.mark.fast
def test_an_unknown_block_size_allows_no_hit_and_a_failed_lookup_restores_the_request():
    lookup = prefix_cache._capped_lookup(_Manager.get_computed_blocks)
    assert lookup(_Manager(None), _request(100))[1] == 0
    request = _request(100)
    hashes = request.block_hashes
    request.fail = True
    with pytest.raises(RuntimeError):
        lookup(_Manager(32), request)
    assert request.block_hashes is hashes


def _positions(ids, values):
    entry = types.SimpleNamespace
    return [None] + [{token: entry(logprob=value)} for token, value in zip(ids[1:], values)]


@pytest.mark.fast
def test_the_probe_keeps_the_cache_only_for_a_capped_hit_with_the_same_bits():
    ids = list(range(100, 180))
    fresh = _positions(ids, [-1.0 - i / 100 for i in range(79)])
    start, size = 40, 32
    assert prefix_cache.probe_problem(fresh, fresh, 32, ids, start, size) is None
    assert "nothing" in prefix_cache.probe_problem(fresh, fresh, 0, ids, start, size)
    assert "64 tokens" in prefix_cache.probe_problem(fresh, fresh, 64, ids, start, size)  # not capped
    assert "does not report" in prefix_cache.probe_problem(fresh, fresh, None, ids, start, size)
    moved = _positions(ids, [-1.0 - i / 100 for i in range(78)] + [-2.5])
    assert "changes the probe's logprobs" in prefix_cache.probe_problem(fresh, moved, 32, ids, start, size)
    # A row the engine did not compute (a hit past the cap leaves it empty) is a failure too.
    holed = list(fresh)
    holed[start + 3] = {}
    assert "could not be read" in prefix_cache.probe_problem(fresh, holed, 32, ids, start, size)
    # Rows before the scored ones are not compared (the wrapper zeroes them).
    early = list(fresh)
    early[5] = {}
    assert prefix_cache.probe_problem(fresh, early, 32, ids, start, size) is None


_ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from regress.backends.base import GenerationRequest
    from regress.backends.vllm_offline import VllmOfflineBackend
    from regress.backends import vllm_prefix_cache

    model, block_size = sys.argv[1], int(sys.argv[2])
    backend = VllmOfflineBackend({"model": model, "dtype": "bfloat16", "engine_args": {
        "enforce_eager": True, "max_model_len": 1024, "block_size": block_size,
        "enable_prefix_caching": True}})
    facts = backend.load()
    sampling = dict(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=70, min_tokens=70, seed=0, stop=[],
                    logprobs=3, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                    ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 1000, size=n)] for n in (20, 37, 64, 90, 129)]
    outputs = backend.generate([GenerationRequest(p, sampling) for p in prompts], lambda n: None)
    sequences = [(p, o.output_token_ids) for p, o in zip(prompts, outputs)]

    hits = []
    manager = vllm_prefix_cache._manager_class()
    capped = manager.get_computed_blocks
    def spy(self, request):
        result = capped(self, request)
        hits.append((len(request.block_hashes), int(result[1]), request.num_tokens))
        return result
    manager.get_computed_blocks = spy

    read = backend.teacher_force(sequences, 3, lambda n: None)
    read_hits, hits[:] = list(hits), []
    reason, backend._prefix_cache_unavailable = backend._prefix_cache_unavailable, "off for the comparison"
    fresh = backend.teacher_force(sequences, 3, lambda n: None)
    same = [bool(np.array_equal(a.token_logprobs, b.token_logprobs) and np.array_equal(a.top_ids, b.top_ids)
                 and np.array_equal(a.top_logprobs, b.top_logprobs)) for a, b in zip(read, fresh)]
    print(json.dumps({"effective": facts["effective"], "reason": reason, "same": same,
                      "lengths": [len(r.token_logprobs) for r in read],
                      "prompt_lengths": [len(p) for p in prompts], "read_hits": read_hits, "fresh_hits": hits}))
""")


@pytest.mark.engine
def test_teacher_forcing_reads_the_prompt_from_the_cache_with_the_same_bits(fixture_model):
    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(fixture_model), "32"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["effective"]["teacher_force_prefix_cache"] == "read", result["effective"]
    assert result["reason"] is None
    assert result["lengths"] == [70] * 5
    # Every teacher-forced row is the fresh prefill's, to the bit: top-k ids and logprobs too.
    assert result["same"] == [True] * 5
    hits = result["read_hits"]
    assert len(hits) == 5 and all(tokens == 0 for _, tokens, _ in result["fresh_hits"])
    for (hashes, tokens, _), prompt_length in zip(hits, result["prompt_lengths"]):
        # The cache held prompt + output (every full block of them); the hit stops at the whole
        # blocks before the completion's first scored row (prompt length - 1), and the rest are
        # computed.
        assert hashes * 32 > prompt_length
        assert tokens == 32 * ((prompt_length - 1) // 32)
    assert sum(tokens for _, tokens, _ in hits) > 0
