"""Teacher forcing scores only the completion's positions (regress.backends.vllm_scored_positions).

The wrapper's bookkeeping is checked here against a stand-in runner that computes prompt-logprob
rows the way vLLM's V1 runner does (per request, the rows of the tokens scheduled in a step, from
where its computed tokens end, in chunks): every row from the requested position must be the
all-positions row, every earlier row zeros, and the runner's state as it was. On the real engine
the choice scores of the patched vLLM match the HF reference (tests/test_choices.py) and the
demo's teacher-forced tracks agree with the candidates' own decode (tests/test_pipeline.py).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from regress.backends import vllm_scored_positions as scored  # noqa: E402

K = 2


class _Tensors(tuple):
    """(token ids, logprobs, ranks), as vLLM's LogprobsTensors."""


class _Runner:
    """The parts of vLLM's model runner that the wrapper reads and moves, and a prompt-logprob
    method with vLLM's row semantics: row r scores token r + 1 from hidden state r."""

    def __init__(self, prompts: dict[str, list[int]], starts: dict[str, int | None]):
        self.requests = {
            rid: types.SimpleNamespace(
                prompt_token_ids=ids, num_computed_tokens=0, out=None,
                sampling_params=types.SimpleNamespace(
                    extra_args=None if starts.get(rid) is None else {scored.SCORE_FROM: starts[rid]}))
            for rid, ids in prompts.items()}
        self.num_prompt_logprobs = {rid: K for rid in prompts}
        self.input_batch = types.SimpleNamespace(req_id_to_index={rid: i for i, rid in enumerate(prompts)})
        self.query_start_loc = types.SimpleNamespace(np=None)
        self.rows_computed = 0

    def step(self, chunk: dict[str, int]) -> dict[str, _Tensors]:
        """One scheduler step of ``chunk[rid]`` tokens per request: hidden state = its position."""
        hidden, starts = [], []
        for rid in self.requests:  # rows in request order, as input_batch.req_id_to_index numbers them
            starts.append(len(hidden))
            request = self.requests[rid]
            hidden += [float(request.num_computed_tokens + i) for i in range(chunk.get(rid, 0))]
        starts.append(len(hidden))
        import numpy as np

        self.query_start_loc.np = np.array(starts, np.int64)
        before = [(r.num_computed_tokens, dict(chunk)) for r in self.requests.values()]
        result = self._get_prompt_logprobs_dict(torch.tensor(hidden), dict(chunk))
        assert [(r.num_computed_tokens, dict(chunk)) for r in self.requests.values()] == before
        assert self.query_start_loc.np.tolist() == starts  # restored for the rest of the step
        for rid, n in chunk.items():
            self.requests[rid].num_computed_tokens += n
        return result

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        done = {}
        for rid in list(self.num_prompt_logprobs):
            n = num_scheduled_tokens.get(rid)
            if n is None:
                continue
            request = self.requests[rid]
            total = len(request.prompt_token_ids)
            if request.out is None:
                request.out = _Tensors((torch.full((total - 1, K + 1), -7, dtype=torch.int64),
                                        torch.full((total - 1, K + 1), -7.0), torch.full((total - 1,), -7)))
            start = request.num_computed_tokens
            remaining = total - (start + 1)
            if n <= remaining:
                count = n
            else:
                count = remaining
                done[rid] = request.out
            if count <= 0:
                continue
            offset = int(self.query_start_loc.np[self.input_batch.req_id_to_index[rid]])
            rows = hidden_states[offset: offset + count]
            self.rows_computed += count
            targets = torch.tensor(request.prompt_token_ids[start + 1: start + 1 + count])
            request.out[0][start: start + count] = targets[:, None].repeat(1, K + 1)
            request.out[1][start: start + count] = -(rows[:, None] + targets[:, None] / 100.0).repeat(1, K + 1)
            request.out[2][start: start + count] = 1
        for rid in done:
            del self.num_prompt_logprobs[rid]
            self.requests[rid].out = None
        return done


@pytest.fixture
def runner_class(monkeypatch):
    monkeypatch.setattr(scored, "_runner_class", lambda: _Runner)
    original = _Runner._get_prompt_logprobs_dict
    yield _Runner
    _Runner._get_prompt_logprobs_dict = original


def _score(chunks: list[dict[str, int]], prompts, starts):
    runner = _Runner(prompts, starts)
    results = {}
    for chunk in chunks:
        results.update(runner.step(chunk))
    return results, runner.rows_computed


PROMPTS = {"a": list(range(100, 130)), "b": list(range(200, 211)), "c": list(range(300, 340))}
# Chunked prefill: "a" in two steps (the requested position inside the second), "c" in three (the
# first step wholly before its requested position), "b" (no request) in one.
CHUNKS = [{"a": 12, "b": 11, "c": 10}, {"a": 18, "c": 10}, {"c": 20}]
STARTS = {"a": 20, "b": None, "c": 25}


def test_rows_from_the_requested_position_are_the_all_positions_rows_and_the_rest_zeros(runner_class):
    every, every_rows = _score(CHUNKS, PROMPTS, {})
    assert scored.install() is None
    assert scored.install() is None  # installing twice wraps once
    some, some_rows = _score(CHUNKS, PROMPTS, STARTS)
    assert set(some) == set(every) == set(PROMPTS)
    for rid, start in STARTS.items():
        for mine, theirs in zip(some[rid], every[rid]):
            if start is None:
                assert torch.equal(mine, theirs)
                continue
            assert torch.equal(mine[start:], theirs[start:])
            assert not mine[:start].any()
    # Rows actually computed: all of b's, a's from 20 and c's from 25 (of 10 + 29 + 39 rows).
    assert every_rows == 29 + 10 + 39 and some_rows == 10 + (29 - 20) + (39 - 25)
    scored.uninstall()
    assert not hasattr(_Runner._get_prompt_logprobs_dict, scored._MARK)


@pytest.mark.parametrize("extra", [{scored.SCORE_FROM: True}, {scored.SCORE_FROM: "5"}, {scored.SCORE_FROM: -3},
                                   {scored.SCORE_FROM: 0}, {"other": 5}])
def test_a_request_without_a_valid_position_is_scored_everywhere(runner_class, extra):
    every, _ = _score(CHUNKS, PROMPTS, {})
    scored.install()
    runner = _Runner(PROMPTS, {})
    runner.requests["a"].sampling_params.extra_args = extra
    results = {}
    for chunk in CHUNKS:
        results.update(runner.step(chunk))
    assert all(torch.equal(x, y) for x, y in zip(results["a"], every["a"]))


class _RenamedRunner(_Runner):
    """A runner that keeps its request rows where the wrapper does not look (a vLLM that renamed
    ``input_batch.req_id_to_index``): the method itself still finds them."""

    def step(self, chunk):
        index = self.input_batch.req_id_to_index
        self.input_batch = types.SimpleNamespace()
        self._index = index
        try:
            return super().step(chunk)
        finally:
            self.input_batch = types.SimpleNamespace(req_id_to_index=index)

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        self.input_batch = types.SimpleNamespace(req_id_to_index=self._index)
        try:
            return _Runner._get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens)
        finally:
            self.input_batch = types.SimpleNamespace()


def test_a_runner_it_cannot_read_is_scored_everywhere_and_left_as_it_was(monkeypatch):
    every, every_rows = _score(CHUNKS, PROMPTS, {})
    monkeypatch.setattr(scored, "_runner_class", lambda: _RenamedRunner)
    original = _RenamedRunner.__dict__["_get_prompt_logprobs_dict"]
    try:
        assert scored.install() is None
        runner = _RenamedRunner(PROMPTS, STARTS)
        results = {}
        for chunk in CHUNKS:  # step() asserts the runner's state is as it was after each call
            results.update(runner.step(chunk))
    finally:
        _RenamedRunner._get_prompt_logprobs_dict = original
    assert runner.rows_computed == every_rows  # nothing skipped
    for rid, start in STARTS.items():
        for mine, theirs in zip(results[rid], every[rid]):
            assert torch.equal(mine[start or 0:], theirs[start or 0:])


def test_an_engine_without_the_runner_method_scores_every_position(monkeypatch):
    monkeypatch.setattr(scored, "_runner_class", lambda: type("Runner", (), {}))
    assert "no _get_prompt_logprobs_dict" in scored.install()

    def missing():
        raise ImportError("no module named vllm.v1")

    monkeypatch.setattr(scored, "_runner_class", missing)
    assert "no V1 model runner" in scored.install()


def _positions(values: list[float], ids: list[int], skipped: int = 0) -> list:
    """vLLM's per-position prompt logprobs (position 0: None), the chosen token's only; the first
    ``skipped`` rows as the wrapper leaves them (token 0, logprob 0)."""
    entry = types.SimpleNamespace
    return [None] + [{0: entry(logprob=0.0)} if i < skipped else {ids[i]: entry(logprob=values[i])}
                     for i in range(1, len(ids))]


IDS = list(range(100, 100 + scored.PROBE_LENGTH))
TRUE = [-1.0 - (i % 7) for i in range(scored.PROBE_LENGTH)]


def test_the_probe_accepts_rows_that_agree_but_for_rounding():
    rounded = [v + (0.125 if i % 9 == 0 else 0.0) for i, v in enumerate(TRUE)]
    assert scored.probe_problem(_positions(TRUE, IDS), _positions(rounded, IDS, scored.PROBE_FROM), IDS) is None


@pytest.mark.parametrize("scored_rows, words", [
    # A wrapper whose rows are off by one position: each token scored in its neighbour's context.
    (_positions(TRUE[1:] + TRUE[:1], IDS, scored.PROBE_FROM), "differ from the all-positions ones"),
    # A wrapper that never ran (another process's runner, a renamed method): every row computed.
    (_positions(TRUE, IDS), "did not take effect"),
    (_positions([float("nan")] * scored.PROBE_LENGTH, IDS, scored.PROBE_FROM), "differ"),
    (None, "could not be read"),
    (_positions(TRUE, IDS)[:-3], "could not be read"),
])
def test_the_probe_refuses_a_wrapper_that_scores_the_wrong_rows_or_none(scored_rows, words):
    assert words in scored.probe_problem(_positions(TRUE, IDS), scored_rows, IDS)


def test_a_failed_probe_takes_the_wrapper_out_again(runner_class, monkeypatch):
    monkeypatch.setattr(scored, "verify", lambda llm, vocab: "the probe's logprobs differ")
    assert scored.enable(object(), 1000) == "the probe's logprobs differ"
    assert not hasattr(_Runner._get_prompt_logprobs_dict, scored._MARK)

    def broken(llm, vocab):
        raise RuntimeError("engine gone")

    monkeypatch.setattr(scored, "verify", broken)
    assert "RuntimeError: engine gone" in scored.enable(object(), 1000)
    assert not hasattr(_Runner._get_prompt_logprobs_dict, scored._MARK)
    monkeypatch.setattr(scored, "verify", lambda llm, vocab: None)
    assert scored.enable(object(), 1000) is None and hasattr(_Runner._get_prompt_logprobs_dict, scored._MARK)
