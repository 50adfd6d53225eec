"""Multiple-choice prompts scored by log-likelihood: the prompt set fields, the stored scores, the
metric, and (engine) the scores a golden, a replay and the HF reference store for the same choices."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli, write_params
from regress.datasets import check_prompt_set
from regress.errors import MeasureError
from regress.metrics.base import Pair
from regress.metrics.choices import answer_check, choices, per_char
from regress.records import LogprobTrack, PromptRecord
from regress.records.generation import ChoiceScores, Generation, choices_problem

# ---------------------------------------------------------------------------------------------
# The prompt set: choices and answer, validated with file, line and field
# ---------------------------------------------------------------------------------------------

GOOD = {"id": "mc-1", "prompt": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0}


def problems_of(tmp_path: Path, record: dict, card: str | None = None) -> list:
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"id": "plain", "prompt": "Hello"}) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    if card is not None:
        (tmp_path / "set.yaml").write_text(card, encoding="utf-8")
    prompt_set, problems = check_prompt_set(path)
    assert (prompt_set is None) == bool(problems)
    return problems


def test_a_good_choice_prompt_loads_and_its_choices_reach_the_engine_input(tmp_path):
    assert problems_of(tmp_path, GOOD) == []
    record = PromptRecord.model_validate(GOOD)
    assert record.choice_input() == {"choices": [" Paris", " Rome"], "answer": 0}
    assert record.payload() == {"prompt": "The capital of France is"}  # rendering ignores the choices
    assert PromptRecord.model_validate({"id": "x", "prompt": "y"}).choice_input() == {}


HOSTILE = [
    ("huge-list", {"choices": [f" c{i}" for i in range(100_000)]}, "choices", "2 to 26 choices, got 100000"),
    ("one-choice", {"choices": [" Paris"]}, "choices", "2 to 26 choices, got 1"),
    ("27-choices", {"choices": [f" c{i}" for i in range(27)], "answer": 3}, "choices", "got 27"),
    ("not-a-list", {"choices": " Paris"}, "choices", "must be a list"),
    ("empty-string", {"choices": [" Paris", ""]}, "choices", "choice 1: must not be empty"),
    ("whitespace", {"choices": ["   ", " Rome"]}, "choices", "choice 0: must not be empty"),
    ("number-choice", {"choices": [" Paris", 4]}, "choices", "choice 1: must be a string, got a number"),
    ("duplicate", {"choices": [" Paris", " Paris"]}, "choices", "same text as choice 0"),
    ("long-choice", {"choices": [" Paris", "x" * 4001]}, "choices", "4001 characters long"),
    ("answer-out-of-range", {"answer": 2}, "answer", "outside the 2 choices (0 .. 1)"),
    ("negative-answer", {"answer": -1}, "answer", "outside the 2 choices"),
    ("bool-answer", {"answer": True}, "answer", "integer index into 'choices'"),
    ("float-answer", {"answer": 1.0}, "answer", "got a number (1.0)"),
    ("string-answer", {"answer": "0"}, "answer", "integer index"),
    ("huge-answer", {"answer": 10**30}, "answer", "outside the 2 choices"),
    ("no-answer", {"answer": None}, "answer", "required with 'choices'"),
    ("answer-without-choices", {"choices": None}, "answer", "needs 'choices'"),
    ("with-expected", {"expected": "Paris"}, "choices", "either 'expected'"),
    ("with-samples", {"samples": 4, "sampling": {"temperature": 0.8}}, "choices", "cannot go with 'samples'"),
]


@pytest.mark.parametrize("change,field,words", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_choices_are_refused_naming_file_line_and_field(tmp_path, change, field, words):
    record = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    problems = problems_of(tmp_path, record)
    assert len(problems) == 1, problems
    problem = problems[0]
    assert (problem.file, problem.line, problem.field) == (str(tmp_path / "set.jsonl"), 2, field), str(problem)
    assert words in problem.message


def test_the_cards_samples_cannot_sample_a_choice_prompt_but_samples_1_or_greedy_is_fine(tmp_path):
    hot = {**GOOD, "sampling": {"temperature": 0.7}}
    problems = problems_of(tmp_path, hot, card="samples: 4\n")
    assert [(p.line, p.field) for p in problems] == [(2, "choices")] and "card's samples: 4" in problems[0].message
    assert problems_of(tmp_path, {**hot, "samples": 1}, card="samples: 4\n") == []
    assert problems_of(tmp_path, GOOD, card="samples: 4\n") == []  # greedy: the card's samples do not apply


def test_the_plan_refuses_a_choice_prompt_a_candidate_would_sample(tmp_path):
    from regress.errors import ConfigError
    from regress.records import CandidateSpec
    from regress.replay.plan import plan_entries

    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    (tmp_path / "set.yaml").write_text("samples: 3\n", encoding="utf-8")
    prompt_set, problems = check_prompt_set(path)
    assert problems == []
    hot = CandidateSpec(name="hot", model="m", sampling={"temperature": 0.9})
    with pytest.raises(ConfigError, match="prompt 'mc-1' has choices but would run as 3 samples"):
        plan_entries(prompt_set, hot, {})
    entries = plan_entries(prompt_set, CandidateSpec(name="cold", model="m"), {})
    assert [e.id for e in entries] == ["mc-1"]


def test_the_engine_protocol_checks_choices_it_receives():
    from regress.engine.protocol import PROTOCOL_VERSION, ProtocolError, request_from_dict

    def shard(prompt):
        return {"protocol": PROTOCOL_VERSION, "op": "shard", "index": 0, "teacher_force": None, "out": "x",
                "prompts": [{"id": "p", "payload": {"prompt": "a"}, "sampling": {}, **prompt}]}

    assert request_from_dict(shard({"choices": [" a", " b"], "answer": 1})).prompts[0]["answer"] == 1
    for bad, words in (({"choices": [" a", " b"]}, "come together"), ({"choices": [" a", ""], "answer": 0}, "non-empty"),
                       ({"choices": [" a", " b"], "answer": 2}, "does not index"),
                       ({"choices": [" a", " b"], "answer": True}, "an integer")):
        with pytest.raises(ProtocolError, match=words):
            request_from_dict(shard(bad))


# ---------------------------------------------------------------------------------------------
# Stored scores: checked on load, never a NaN, an infinity or a positive log-likelihood
# ---------------------------------------------------------------------------------------------


def stored(token_lps: list[list[float]], texts=(" a", " bb"), answer=0, count=1, totals=None):
    """A shard's choice arrays and meta for one prompt with these choices (then count - 1 without)."""
    offsets = np.array([0] + [len(token_lps)] * count, np.int64)
    lengths = np.cumsum([0] + [len(t) for t in token_lps]).astype(np.int64)
    flat = np.array([v for t in token_lps for v in t], np.float32)
    sums = [float(np.sum(np.array(t, np.float32), dtype=np.float64)) for t in token_lps]
    arrays = {"choice_offsets": offsets, "choice_logprobs": np.array(totals if totals is not None else sums, np.float64),
              "choice_token_offsets": lengths, "choice_tokens": np.arange(len(flat), dtype=np.int32),
              "choice_token_logprobs": flat}
    meta = {"choices_format": 1, "choice_texts": [list(texts)] + [None] * (count - 1),
            "choice_answers": [answer] + [None] * (count - 1)}
    return meta, arrays


def test_valid_choice_arrays_pass_and_a_shard_without_choices_has_nothing_to_check():
    assert choices_problem(*stored([[-0.5, -1.0], [-2.0]], count=3), 3) is None
    assert choices_problem({}, {}, 3) is None


@pytest.mark.parametrize("value,words", [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), (0.5, "0.5")])
def test_a_nonfinite_or_positive_logprob_is_refused(value, words):
    meta, arrays = stored([[-0.5, value], [-2.0]])
    assert words in (choices_problem(meta, arrays, 1) or "")
    meta, arrays = stored([[-0.5, -1.0], [-2.0]], totals=[value, -2.0])
    assert words in (choices_problem(meta, arrays, 1) or "")


def test_inconsistent_choice_records_are_refused():
    meta, arrays = stored([[-0.5, -1.0], [-2.0]], totals=[-0.1, -2.0])
    assert "not the sum of its token logprobs" in choices_problem(meta, arrays, 1)
    meta, arrays = stored([[-0.5], [-2.0]])
    assert "choices_format 2" in choices_problem({**meta, "choices_format": 2}, arrays, 1)
    assert "are missing" in choices_problem(meta, {k: v for k, v in arrays.items() if k != "choice_tokens"}, 1)
    assert "not an index" in choices_problem({**meta, "choice_answers": [2]}, arrays, 1)
    assert "not an index" in choices_problem({**meta, "choice_answers": [True]}, arrays, 1)
    assert "choice scores for choice texts" in choices_problem({**meta, "choice_texts": [[" a"]]}, arrays, 1)
    assert "lists of 2 entries" in choices_problem(meta, arrays, 2)
    empty_choice = {**arrays, "choice_token_offsets": np.array([0, 0, 2], np.int64)}
    assert "one token or more" in choices_problem(meta, empty_choice, 1)


def test_a_run_written_before_choices_loads_and_a_mixed_run_joins_its_shards(tmp_path):
    """Old shards have no choice arrays (and must still load); in a run, a shard without choice
    prompts sits between shards with them, and every prompt finds its own choices."""
    from regress.runs import _concatenate_choices

    def part(count: int, with_choices: bool):
        p = {"prompt_offsets": np.zeros(count + 1, np.int64)}
        if with_choices:
            meta, arrays = stored([[-0.25], [-1.0, -0.5]], count=count)
            p.update(arrays)
        return p

    joined = _concatenate_choices([part(2, True), part(3, False), part(1, True)])
    assert joined["choice_offsets"].tolist() == [0, 2, 2, 2, 2, 2, 4]
    assert joined["choice_token_offsets"].tolist() == [0, 1, 3, 4, 6]
    assert joined["choice_logprobs"].tolist() == [-0.25, -1.5, -0.25, -1.5]


# ---------------------------------------------------------------------------------------------
# The metric on synthetic rows
# ---------------------------------------------------------------------------------------------


def generation(totals: list[float] | None, texts=(" red", " green", " blue"), answer=1) -> Generation:
    empty = LogprobTrack(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros((0, 1), np.int32),
                         np.zeros((0, 1), np.float32))
    scores = None
    if totals is not None:
        scores = ChoiceScores(tuple(texts), answer, np.array(totals, np.float64),
                              tuple(np.zeros(1, np.int32) for _ in totals),
                              tuple(np.array([t], np.float32) for t in totals))
    return Generation("q", np.zeros(1, np.int32), np.zeros(0, np.int32), "", "length", empty, choices=scores)


def test_picks_rightness_and_margins_by_total_and_per_character():
    # Per character (leading space left out): red -6/3 = -2, green -7/5 = -1.4, blue -6.5/4 = -1.625.
    golden, candidate = generation([-6.0, -7.0, -6.5]), generation([-8.0, -7.0, -9.0])
    values = choices()(Pair(golden, candidate))
    assert values["choice_golden_pick"] == 0 and values["choice_golden_right"] is False
    assert values["choice_golden_pick_norm"] == 1 and values["choice_golden_right_norm"] is True
    assert values["choice_candidate_pick"] == 1 and values["choice_candidate_right"] is True
    assert values["choice_golden_margin"] == pytest.approx(-1.0)  # -7 - (-6)
    assert values["choice_candidate_margin"] == pytest.approx(1.0)  # -7 - (-8)
    assert (values["choice_golden_correct"], values["choice_candidate_correct"]) == (False, True)
    assert values["choice_logprob_shift"] == pytest.approx(-2.5)  # blue moved most: -9 - (-6.5)
    assert values["choices"] == 3
    normed = choices(pick="per_char")(Pair(golden, candidate))
    assert (normed["choice_golden_correct"], normed["choice_candidate_correct"]) == (True, True)
    assert normed["choice_golden_margin"] == pytest.approx(-1.4 - -1.625)
    assert per_char(golden.choices).tolist() == pytest.approx([-2.0, -1.4, -1.625])


def test_ties_pick_the_first_choice_as_lm_eval_does():
    values = choices()(Pair(generation([-1.0, -1.0, -3.0], answer=1), generation([-1.0, -1.0, -3.0], answer=1)))
    assert values["choice_golden_pick"] == 0 and values["choice_golden_margin"] == 0.0
    assert values["choice_golden_correct"] is False


def test_prompts_without_choices_get_no_values_and_half_a_question_is_an_error():
    assert choices()(Pair(generation(None), generation(None))) == {}
    with pytest.raises(MeasureError, match="prompt 'q': the candidate did not score the same choices"):
        choices()(Pair(generation([-1.0, -2.0, -3.0]), generation(None)))
    with pytest.raises(MeasureError, match="the two sides"):
        choices()(Pair(generation([-1.0, -2.0, -3.0]), generation([-1.0, -2.0, -3.0], answer=2)))
    with pytest.raises(ValueError, match="choice_pick"):
        choices(pick="per_token")


def test_the_answer_check_of_a_choice_prompt_counts_a_lost_answer():
    golden, candidate = generation([-6.0, -1.0, -6.5]), generation([-1.0, -7.0, -9.0])
    check = answer_check(choices()(Pair(golden, candidate)), golden.choices)
    assert (check.golden_correct, check.candidate_correct, check.flip) == (True, False, "lost")
    assert check.expected == [" green"] and check.golden_match == " green" and check.candidate_match is None
    assert answer_check({}, golden.choices) is None


def test_the_metric_is_registered_with_a_spec_for_every_value_and_its_setting_is_a_threshold():
    from regress.metrics import get_metric
    from regress.verdict import Thresholds

    info = get_metric("choices")
    values = choices()(Pair(generation([-6.0, -7.0, -6.5]), generation([-8.0, -7.0, -9.0])))
    assert set(values) == {o.name for o in info.values}
    assert Thresholds().choice_pick == "total" and Thresholds(choice_pick="per_char").choice_pick == "per_char"
    with pytest.raises(ValueError):
        Thresholds(choice_pick="per_token")


# ---------------------------------------------------------------------------------------------
# The real engine: a golden, a replay and the HF reference score the same choices
# ---------------------------------------------------------------------------------------------

ENGINE_PROMPTS = [
    {"id": "mc-market", "prompt": "The old market opened before sunrise, and",
     "choices": [" the", " the traders", " seven purple engines"], "answer": 1, "sampling": {"max_tokens": 4}},
    {"id": "mc-bread", "prompt": "A recipe for bread needs flour, water,",
     "choices": [" salt", " and yeast", " gravel"], "answer": 1, "sampling": {"max_tokens": 4}},
    {"id": "plain", "prompt": "Rain", "sampling": {"max_tokens": 4}},
]
HF_TOLERANCE = 1e-3
"""Largest |vLLM - HF| of one choice's log-likelihood (nat), both in float32 on the fixture model:
measured 7e-6 nat (2026-12-02, 6 choices); room for other CPUs' kernels, far below what a changed
model moves (bf16 against float32 moved single logprobs by up to 0.29 nat on these machines)."""
PREFIX_TOLERANCE = 1e-4
"""Largest difference of one token's logprob between two prefills that share it (vLLM, float32)."""


@pytest.fixture(scope="module")
def choice_runs(tmp_path_factory, fixture_model):
    from regress.runs import load_run

    root = tmp_path_factory.mktemp("choices")
    prompts = root / "datasets" / "prompts" / "mc.jsonl"
    prompts.parent.mkdir(parents=True)
    prompts.write_text("".join(json.dumps(p) + "\n" for p in ENGINE_PROMPTS), encoding="utf-8")
    # Shards of 2: the second holds no choice prompt, so its file has no choice arrays to join.
    write_params(root, model=fixture_model, dataset="datasets/prompts/mc.jsonl", shard_size=2,
                 baseline={"dtype": "float32"},
                 candidates={"same": {}, "hf-reference": {"backend": "hf", "env": {"OMP_NUM_THREADS": "1"}}})
    for args in (("golden",), ("replay", "same"), ("replay", "hf-reference")):
        result = run_cli(*args, cwd=root)
        assert result.returncode == 0, result.stderr
    return {name: load_run(root / path) for name, path in
            (("golden", "golden"), ("same", "runs/same"), ("hf", "runs/hf-reference"))}


@pytest.mark.engine
def test_every_run_stores_each_choices_teacher_forced_log_likelihood(choice_runs, fixture_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(fixture_model))
    golden, same, hf = choice_runs["golden"], choice_runs["same"], choice_runs["hf"]
    assert golden.choices("plain") is None and golden["plain"].choices is None
    # vLLM scored the choices' positions only (regress.backends.vllm_scored_positions); the HF
    # reference's forward pass, which knows nothing of that, agrees with it (next test).
    assert golden.manifest.effective.teacher_force_positions == "completion"
    assert same.manifest.effective.teacher_force_positions == "completion"
    for prompt in (p for p in ENGINE_PROMPTS if "choices" in p):
        for run in (golden, same, hf):
            scores = run[prompt["id"]].choices
            assert scores.texts == tuple(prompt["choices"]) and scores.answer == prompt["answer"]
            for text, ids, lps, total in zip(scores.texts, scores.token_ids, scores.token_logprobs, scores.logprobs):
                # (a) the choice's own tokens, each with a teacher-forced logprob, summing to its score
                assert ids.tolist() == tokenizer.encode(text, add_special_tokens=False)
                assert len(lps) == len(ids) and (lps <= 0).all()
                assert total == pytest.approx(float(np.sum(lps, dtype=np.float64)), abs=1e-9)
        # The golden made no teacher forcing of its own, yet scored the choices; the replay of
        # the same candidate scores them again, the same.
        assert np.array_equal(golden[prompt["id"]].choices.logprobs, same[prompt["id"]].choices.logprobs)
        # Each position is conditioned on the prompt and the choice's earlier tokens: " the" is the
        # first token of " the traders", so both prefills give it the same logprob.
    market = golden["mc-market"].choices
    assert market.token_ids[1][0] == market.token_ids[0][0]
    shared = abs(float(market.token_logprobs[1][0]) - float(market.token_logprobs[0][0]))
    print(f"one token in two prefills: {shared:.2e} nat apart")
    assert shared <= PREFIX_TOLERANCE


@pytest.mark.engine
def test_vllm_choice_scores_match_the_hf_reference(choice_runs):
    golden, hf = choice_runs["golden"], choice_runs["hf"]
    worst = 0.0
    for prompt in (p for p in ENGINE_PROMPTS if "choices" in p):
        v, h = golden[prompt["id"]].choices, hf[prompt["id"]].choices
        worst = max(worst, float(np.max(np.abs(v.logprobs - h.logprobs))))
    print(f"largest |vLLM - HF| choice log-likelihood: {worst:.6f} nat")
    assert worst <= HF_TOLERANCE


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # a choice continues the prompt: no BOS in the middle
        return [ord(ch) % 50 for ch in text]


class _Rows:
    """A stand-in backend for the engine side's checks of what teacher forcing returned: it
    returns the rows a test gives (a real engine's rows are checked in the engine tests above)."""

    def __init__(self, value=-0.5, cut=0):
        self.value, self.cut, self.sequences = value, cut, None

    def get_tokenizer(self):
        return _Tokenizer()

    def teacher_force(self, sequences, k, progress):
        from regress.backends.base import LogprobRows

        self.sequences = sequences
        out = []
        for _, choice in sequences:
            n = len(choice) - self.cut
            lps = np.full(n, self.value, np.float32)
            out.append(LogprobRows(lps, np.zeros((n, k), np.int32), np.maximum(lps, -0.1)[:, None].repeat(k, 1)))
        return out


def test_the_engine_side_scores_choices_after_the_prompt_ids_the_generation_used():
    from regress.engine.choices import score_choices

    prompts = [{"id": "plain"}, {"id": "mc", "choices": [" ab", " c"], "answer": 1}]
    backend = _Rows(-0.5)
    arrays, meta = score_choices(backend, prompts, [[1, 2], [7, 8, 9]])
    assert backend.sequences == [([7, 8, 9], [32, 47, 48]), ([7, 8, 9], [32, 49])]
    assert arrays["choice_offsets"].tolist() == [0, 0, 2]
    assert arrays["choice_logprobs"].tolist() == [-1.5, -1.0]
    assert meta["choice_texts"] == [None, [" ab", " c"]] and meta["choice_answers"] == [None, 1]
    assert choices_problem(meta, arrays, 2) is None  # what the engine writes, the loader accepts
    assert score_choices(backend, [{"id": "plain"}], [[1]]) == ({}, {})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.25])
def test_the_engine_side_refuses_a_logprob_that_is_not_a_score(value):
    from regress.engine.choices import score_choices

    with pytest.raises(ValueError, match="prompt 'mc', choice 0: the engine's teacher-forced logprobs are not a score"):
        score_choices(_Rows(value), [{"id": "mc", "choices": [" ab", " c"], "answer": 1}], [[7]])


def test_a_choice_cut_by_the_context_is_an_input_error_naming_it():
    from regress.engine.choices import score_choices
    from regress.errors import InputError

    with pytest.raises(InputError, match="prompt 'mc', choice 0: the prompt \\(1 tokens\\) and the choice \\(3 tokens\\)"):
        score_choices(_Rows(cut=1), [{"id": "mc", "choices": [" ab", " c"], "answer": 1}], [[7]])


@pytest.mark.engine
def test_leaving_the_choices_metric_out_is_an_input_error_not_fewer_answers(choice_runs):
    """Without the metric nothing picks a choice, and the prompts silently left the quality verdict
    (with only choice prompts answered, it fell back to fidelity under `gate: auto`)."""
    from regress.errors import ConfigError
    from regress.scoring import score_runs
    from regress.verdict import Thresholds

    t = Thresholds(metrics=["exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced", "surface"])
    with pytest.raises(ConfigError, match=r"field 'thresholds.metrics'.*have 'choices' \(first: mc-"):
        score_runs(choice_runs["golden"], choice_runs["same"], t)
    scored = score_runs(choice_runs["golden"], choice_runs["same"], Thresholds(metrics=[*t.metrics, "choices"]))
    assert scored.metrics.quality is not None and scored.metrics.quality.prompts >= 1
