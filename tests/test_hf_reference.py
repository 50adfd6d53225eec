"""The hf backend's candidate settings (engine_args), on the CPU with the fixture model, in process.

The end-to-end replay through the engine process is in test_replay_engine.py; here the backend
is driven directly, so batch composition and padding can be checked against one-at-a-time runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from regress.backends.base import GenerationRequest
from regress.backends.hf_reference import HFReferenceBackend, hf_engine_args
from regress.records import ResolvedSampling, SamplingSpec

PROMPTS = [
    "The old market opened before sunrise, and",
    "def add(a, b):",
    "Rain",
    "In the mountains the trail turns north toward the lake where travellers rest",
    "我们今天",
    "A recipe for bread needs flour, water,",
]


def sampling(**overrides):
    return ResolvedSampling.resolve(SamplingSpec(**{"temperature": 0, "max_tokens": 12, "logprobs": 5, **overrides})).model_dump()


def load(model, **engine_args) -> HFReferenceBackend:
    backend = HFReferenceBackend({"backend": "hf", "model": str(model), "dtype": "float32",
                                  "engine_args": {"device": "cpu", **engine_args}})
    backend.facts = backend.load()
    return backend


def requests(backend, **overrides):
    tok = backend.get_tokenizer()
    return [GenerationRequest(list(tok.encode(p)), sampling(**overrides)) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(fixture_model):
    return load(fixture_model)


def test_engine_args_are_checked_and_other_backends_keys_ignored():
    assert hf_engine_args({"enforce_eager": True, "max_model_len": 4096}) == {}
    assert hf_engine_args({"device": "cuda:1", "attn_implementation": "eager", "max_batch_size": 64,
                           "tf32": False}) == {"device": "cuda:1", "attn_implementation": "eager",
                                               "max_batch_size": 64, "tf32": False}
    for bad, field in (({"device": "gpu"}, "device"), ({"max_batch_size": 0}, "max_batch_size"),
                       ({"max_batch_size": True}, "max_batch_size"), ({"tf32": "yes"}, "tf32"),
                       ({"attn_implementation": ""}, "attn_implementation")):
        with pytest.raises(ValueError, match=f"engine_args.{field}"):
            hf_engine_args(bad)


def test_settings_are_applied_and_recorded(fixture_model):
    import torch

    before = torch.get_float32_matmul_precision()
    try:
        backend = load(fixture_model, attn_implementation="eager", tf32=False, max_batch_size=4)
        facts = backend.facts
        assert facts["engine_args"] == {"device": "cpu", "attn_implementation": "eager", "max_batch_size": 4,
                                        "tf32": False, "float32_matmul_precision": "highest"}
        assert facts["effective"]["attention"] == "eager"
        assert str(next(backend._model.parameters()).device) == "cpu"
    finally:
        torch.set_float32_matmul_precision(before)


def test_default_is_one_prompt_at_a_time_on_the_cpu_here(alone):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the default device is the GPU where torch sees one")
    assert alone.facts["engine_args"] == {"device": "cpu"} and alone._max_batch_size == 1


def test_a_gpu_that_is_not_there_is_a_clear_error(fixture_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is there")
    with pytest.raises(ValueError, match="engine_args.device is 'cuda', but torch sees no GPU"):
        load(fixture_model, device="cuda")


def test_left_padded_batches_match_one_at_a_time(fixture_model, alone):
    batched = load(fixture_model, max_batch_size=4)
    done: list[int] = []
    one = alone.generate(requests(alone), lambda n: None)
    many = batched.generate(requests(batched), done.append)
    assert sum(done) == len(PROMPTS) and done == [4, 2]  # two batches, in shard order
    same = 0
    for a, b in zip(one, many):
        n = min(len(a.output_token_ids), len(b.output_token_ids))
        first = next((i for i in range(n) if a.output_token_ids[i] != b.output_token_ids[i]), n)
        # float32: padding changes the arithmetic's shapes, not the model; up to the first
        # differing token (a near-tie, if any) logprobs agree closely.
        np.testing.assert_allclose(a.logprobs.token_logprobs[:first], b.logprobs.token_logprobs[:first], atol=1e-3)
        same += a.output_token_ids == b.output_token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert same >= len(PROMPTS) - 1

    sequences = [(r.prompt_token_ids, o.output_token_ids) for r, o in zip(requests(alone), one)]
    sequences.append((sequences[0][0], []))  # nothing to score: an empty row, as alone
    forced_one = alone.teacher_force(sequences, 5, lambda n: None)
    forced_many = batched.teacher_force(sequences, 5, lambda n: None)
    for a, b in zip(forced_one, forced_many):
        assert a.token_logprobs.shape == b.token_logprobs.shape
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-4)
        assert np.array_equal(a.top_ids[:, 0], b.top_ids[:, 0])
    assert forced_many[-1].token_logprobs.size == 0


def test_only_prompts_of_one_sampling_without_stop_strings_share_a_batch(fixture_model):
    backend = load(fixture_model, max_batch_size=8)
    samplings = [sampling(), sampling(), sampling(stop=["."]), sampling(max_tokens=3), sampling(), sampling(seed=7)]
    assert backend._batches(samplings) == [[0, 1, 4], [2], [3], [5]]
    reqs = requests(backend)
    for r, s in zip(reqs, samplings):
        r.sampling = s
    out = backend.generate(reqs, lambda n: None)
    assert len(out) == len(reqs) and len(out[3].output_token_ids) <= 3
    assert all(o.logprobs.top_ids.shape[1] == 5 for o in out)
