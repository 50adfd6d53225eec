"""Measures that are not numbers, or could not be taken, are never noise: NaN and infinite values
per prompt, per sampled prompt and in the run's aggregates, every threshold comparison, and
prompts the teacher-forcing pass could not score."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from regress.errors import EXIT_RUN_FAILED, MeasureError
from regress.metrics import get_metric, output_specs
from regress.metrics.base import Pair
from regress.metrics.sampled import group_values
from regress.metrics.sampled_policy import prompt_units, run_shift
from regress.metrics.spec import Bound, Output, Setting
from regress.records import Generation, LogprobTrack, ResolvedSampling
from regress.replay.plan import sample_id
from regress.scoring import build_metrics, score_runs
from regress.latency import latency_verdict
from regress.verdict import Thresholds, classify, past, severity
from report_fixtures import NO_SEMANTIC, build_case

NAN, INF = float("nan"), float("inf")
T = Thresholds(metrics=NO_SEMANTIC)

# A flip at a near-tie that stayed close by every measure: benign.
NOISE = {"identical": False, "input_drift": False, "first_divergence": 7, "golden_margin": 0.02,
         "golden_token_in_candidate_topk": True, "candidate_token_in_golden_topk": True, "tf_positions": 20,
         "tf_unscored": 0, "tf_kl_mean": 0.001, "tf_same_top1_rate": 0.99, "tf_max_flipped_margin": 0.03,
         "semantic_similarity": 0.95}


# ------------------------------------------------------------------ per prompt

def test_a_nan_teacher_forced_kl_is_a_regression_like_a_large_one() -> None:
    t = Thresholds()
    assert classify(NOISE, t)[0] == "benign"
    assert classify({**NOISE, "tf_kl_mean": 5.0}, t)[0] == "regression"
    for broken in (NAN, INF, -INF):
        klass, reasons = classify({**NOISE, "tf_kl_mean": broken}, t)
        assert klass == "regression", (broken, reasons)
        assert "TF KL (tf_kl_mean) is " in reasons[0] and "not a finite number" in reasons[0]
    # A broken measure outranks identity: identical tokens with NaN logprobs are no pass.
    assert classify({**NOISE, "identical": True, "tf_same_top1_rate": NAN}, t)[0] == "regression"
    assert severity({**NOISE, "tf_kl_mean": NAN}, t) >= 1.0


@pytest.mark.parametrize("spec", output_specs(), ids=lambda s: s.name)
def test_every_value_declares_what_a_nonfinite_value_means_and_the_classifier_obeys(spec: Output) -> None:
    assert spec.nonfinite in ("error", "regression")
    row = {**NOISE, spec.name: NAN}
    if spec.nonfinite == "regression":
        klass, reasons = classify(row, Thresholds(), prompt_id="p-7")
        assert klass == "regression" and any(spec.name in r and "NaN" in r for r in reasons)
    else:
        with pytest.raises(MeasureError, match=rf"prompt 'p-7': .*{spec.name}.* is NaN") as caught:
            classify(row, Thresholds(), prompt_id="p-7")
        assert caught.value.exit_code == EXIT_RUN_FAILED


def test_a_value_nobody_declares_is_an_error_when_it_is_not_a_number() -> None:
    with pytest.raises(MeasureError, match="plugin_score is NaN"):
        classify({**NOISE, "plugin_score": NAN}, Thresholds(), prompt_id="p")
    assert classify({**NOISE, "plugin_score": 0.5}, Thresholds())[0] == "benign"


def test_the_semantic_measure_broken_is_exit_3_not_a_verdict() -> None:
    """The embedder is regress's own: a NaN cosine says nothing about the candidate."""
    with pytest.raises(MeasureError, match="prompt 'q': semantic .*semantic_similarity.* is NaN"):
        classify({**NOISE, "semantic_similarity": NAN}, Thresholds(), prompt_id="q")


def _track(tokens, lp, top_ids, top_lp) -> LogprobTrack:
    return LogprobTrack(np.asarray(tokens, np.int32), np.asarray(lp, np.float32), np.asarray(top_ids, np.int32),
                        np.asarray(top_lp, np.float32))


def _gen(tokens, top_ids, top_lp, tf=None) -> Generation:
    lp = [row[0] for row in top_lp]
    return Generation(prompt_id="p", prompt_token_ids=np.asarray([1, 2, 3], np.int32),
                      output_token_ids=np.asarray(tokens, np.int32), text=" ".join(map(str, tokens)),
                      finish_reason="length", free_run=_track(tokens, lp, top_ids, top_lp), teacher_forced=tf)


LN = math.log
GOLDEN = _gen([10, 20, 30], [[10, 11], [20, 21], [30, 31]],
              [[LN(0.9), LN(0.05)], [LN(0.5), LN(0.45)], [LN(0.8), LN(0.1)]])


def _scored(name: str, pair: Pair) -> dict:
    info = get_metric(name)
    fn = info.factory()
    return fn([pair])[0] if info.batched else fn(pair)


def test_a_broken_embedding_is_not_taken_for_another_meaning() -> None:
    class NanEncoder:  # an embedding model gone wrong (an overflow in reduced precision)
        def encode(self, texts, **_):  # type: ignore[no-untyped-def]
            return np.full((len(texts), 4), np.nan, np.float32)

    fn = get_metric("semantic").factory(encoder=NanEncoder())
    [v] = fn([Pair(GOLDEN, dataclasses.replace(GOLDEN, text="something else"))])
    assert math.isnan(v["semantic_similarity"])  # not clamped to -1, a "different meaning" nobody measured
    with pytest.raises(MeasureError, match="semantic_similarity"):
        classify({**NOISE, **v}, Thresholds(), prompt_id="p")


def test_a_nan_logprob_in_the_candidates_answer_makes_the_prompt_a_regression() -> None:
    # The candidate diverges at the near-tie (position 1), and teacher-forced reports a NaN logprob.
    tf = _track([10, 20, 30], [LN(0.9), NAN, LN(0.8)], [[10, 11], [20, 21], [30, 31]],
                [[LN(0.9), LN(0.05)], [NAN, LN(0.45)], [LN(0.8), LN(0.1)]])
    cand = _gen([10, 21, 30], [[10, 11], [21, 20], [30, 31]],
                [[LN(0.9), LN(0.05)], [LN(0.48), LN(0.47)], [LN(0.8), LN(0.1)]], tf=tf)
    pair = Pair(GOLDEN, cand)
    row = {}
    for name in NO_SEMANTIC:
        row.update(_scored(name, pair))
    assert math.isnan(row["tf_kl_mean"])  # the metric does not hide it
    klass, reasons = classify(row, T, prompt_id="p")
    assert klass == "regression" and any("tf_kl_mean" in r for r in reasons)


# ------------------------------------------------------------------ sampled prompts

def _sample_rows(kl: list[float], margin: list[float]) -> list[dict]:
    return [{**NOISE, "tf_positions": 2, "tf_kl_mean": k, "tf_max_flipped_margin": m} for k, m in zip(kl, margin)]


def _sample(k: int, n: int, tokens: list[int], logprob: float) -> Generation:
    """Sample ``k`` of ``n`` of prompt ``p``, each token at ``logprob``."""
    ids = np.asarray(tokens, np.int32)
    lp = np.full(len(ids), logprob, np.float32)
    track = LogprobTrack(ids, lp, np.stack([ids, ids + 1], axis=1), np.stack([lp, lp - 1.0], axis=1))
    sampling = ResolvedSampling(temperature=0.8, sample=k, samples=n).model_dump()
    return Generation(sample_id("p", k), np.asarray([1, 2], np.int32), ids, " ".join(map(str, tokens)), "length",
                      track, track, sampling)


def _sample_pairs(golden: list[float], candidate: list[float]) -> list[Pair]:
    n = len(golden)
    return [Pair(_sample(k, n, [10 + k, 11], golden[k]), _sample(k, n, [20 + k, 21], candidate[k])) for k in range(n)]


@pytest.mark.parametrize("order", ["nan-first", "nan-last"])
def test_a_sampled_prompt_with_one_broken_sample_is_a_regression(order: str) -> None:
    kl, margin = [0.001, 0.002, NAN], [0.02, NAN, 0.01]
    if order == "nan-first":
        kl, margin = kl[::-1], margin[::-1]
    [unit] = prompt_units(_sample_pairs([-1.0] * 3, [-1.0] * 3), _sample_rows(kl, margin))
    # A mean, a max: neither is the others' number (max() and min() would answer by the NaN's place).
    assert math.isnan(unit.row["tf_kl_mean"]) and math.isnan(unit.row["tf_max_flipped_margin"])
    assert classify(unit.row, T, prompt_id="p")[0] == "regression"


def test_a_nan_sample_logprob_is_not_averaged_away() -> None:
    golden = [-1.0, -1.1, -0.9, -1.05]
    candidate = [-1.05, NAN, -1.0, -0.95]
    v = group_values(_sample_pairs(golden, candidate), similarity=None)
    assert math.isnan(v["sample_logprob_shift"]) and math.isnan(v["sample_likely_share"])
    klass, _ = classify({**NOISE, **v}, T, prompt_id="p")
    assert klass == "regression"
    # The run's shift test takes the numbers only (the broken prompt is a regression already).
    shifts = [NAN] + [-2.0 - 0.01 * i for i in range(12)]
    failure, _ = run_shift([SimpleNamespace(metrics={"samples": 4, "sample_logprob_shift": x}) for x in shifts], T)
    assert failure is not None and failure.startswith("12 sampled prompt(s)")


# ------------------------------------------------------------------ every threshold comparison

@pytest.mark.parametrize("better", ["lower", "higher"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_past_counts_a_nonfinite_value_as_past_every_bound(better: str, value: float) -> None:
    spec = Output("x", "", better=better)  # type: ignore[arg-type]
    bound = Bound(Setting("x_bound", 0.5, doc="a bound"))
    assert past(spec, bound, value, 0.5)
    assert past(spec, bound, 0.4 if better == "lower" else 0.6, NAN)
    assert not past(spec, bound, 0.4 if better == "lower" else 0.6, 0.5)


def test_a_nan_latency_ratio_fails_the_latency_verdict() -> None:
    stats = SimpleNamespace(ttft_p95_s=0.1, tpot_p95_s=0.01, latency_p95_s=1.0, throughput_tokens_per_s=10.0)
    latency = SimpleNamespace(ttft_p95_ratio=NAN, tpot_p95_ratio=1.0, latency_p95_ratio=1.0, throughput_ratio=NAN,
                              candidate=stats, golden=stats)
    verdict, reasons = latency_verdict(latency, Thresholds(max_latency_ratio=1.2, min_throughput_ratio=0.8))
    assert verdict == "fail"
    assert any("time to first token" in r and "exceeds" in r for r in reasons)
    assert any("throughput" in r and "below" in r for r in reasons)


# ------------------------------------------------------------------ a whole scoring

@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    return build_case(tmp_path_factory.mktemp("nonfinite-case"), prompts=20, tokens=16, semantic=False)


def test_a_run_with_a_nan_prompt_fails_on_it_names_it_and_keeps_its_means_numbers(case) -> None:  # type: ignore[no-untyped-def]
    plain = score_runs(case.golden, case.run, T, metrics=build_metrics(T))
    victim = next(s.prompt_id for s in plain.scores if s.prompt_class == "benign")
    metrics = []
    for info, fn in build_metrics(T):
        if info.name == "teacher_forced":
            def broken(pairs, fn=fn):  # type: ignore[no-untyped-def]
                out = fn(pairs)
                for pair, row in zip(pairs, out):
                    if pair.prompt_id == victim:
                        row["tf_kl_mean"] = NAN
                return out
            fn = broken
        metrics.append((info, fn))
    scored = score_runs(case.golden, case.run, T, metrics=metrics)
    by_id = {s.prompt_id: s for s in scored.scores}
    assert by_id[victim].prompt_class == "regression"
    m = scored.metrics
    assert m.nonfinite == 1 and m.nonfinite_ids == [victim]
    assert m.regression == plain.metrics.regression + 1
    others = [s.metrics["tf_kl_mean"] for s in plain.scores if s.prompt_id != victim]
    assert m.mean_teacher_forced_kl == pytest.approx(sum(others) / len(others))
    assert any(victim in r and "NaN or infinite" in r for r in scored.verdict_reasons)
    assert json.loads(m.model_dump_json())["nonfinite_ids"] == [victim]
    # The page, summary.md and JUnit show it (the page's data stays JSON: no NaN literal in it).
    from regress.report.junit import junit_xml
    from regress.report.render import render_candidate
    from regress.report.summary import summary_markdown

    page = render_candidate(scored, case.golden, case.run, case.prompt_set)
    data = page.split('<script type="application/json" id="data">')[1].split("</script>")[0]

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the page's data: JSON.parse would fail")

    json.loads(data, parse_constant=refuse)
    assert "NaN or infinite" in page and victim in page
    assert "NaN or infinite" in summary_markdown(scored) and victim in junit_xml(scored)


# ------------------------------------------------------------------ teacher forcing that could not run

def test_a_prompt_teacher_forcing_could_not_score_is_never_benign() -> None:
    empty = _track([], [], np.zeros((0, 2)), np.zeros((0, 2)))
    cand = _gen([10, 21, 30], [[10, 11], [21, 20], [30, 31]],
                [[LN(0.9), LN(0.05)], [LN(0.48), LN(0.47)], [LN(0.8), LN(0.1)]], tf=empty)
    v = _scored("teacher_forced", Pair(GOLDEN, cand))
    assert v["tf_positions"] == 0 and v["tf_unscored"] == 3 and v["tf_kl_mean"] is None
    near_tie = {**NOISE, "tf_kl_mean": None, "tf_same_top1_rate": None, "tf_max_flipped_margin": None, **v}
    klass, reasons = classify(near_tie, Thresholds())
    assert klass == "drift" and any("teacher forcing could not run" in r and "3 token(s)" in r for r in reasons)
    # Scored in part (the last position did not fit): measured, and benign where the measures say so.
    part = _track([10, 20], [LN(0.9), LN(0.5)], [[10, 11], [20, 21]], [[LN(0.9), LN(0.05)], [LN(0.5), LN(0.45)]])
    v = _scored("teacher_forced", Pair(GOLDEN, dataclasses.replace(cand, teacher_forced=part)))
    assert v["tf_positions"] == 2 and v["tf_unscored"] == 1


def test_prompts_not_teacher_forced_are_counted_named_and_stated(case) -> None:  # type: ignore[no-untyped-def]
    run = case.run
    offsets = run.arrays["tf_offsets"]
    skip = {run.position(s.prompt_id) for s in case.score.scores if s.prompt_class in ("benign", "identical")}
    keep = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in range(len(run)) if i not in skip])
    lengths = [0 if i in skip else int(offsets[i + 1] - offsets[i]) for i in range(len(run))]
    arrays = dict(run.arrays, tf_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(offsets.dtype),
                  **{k: run.arrays[k][keep] for k in ("tf_tokens", "tf_token_logprobs", "tf_top_ids", "tf_top_logprobs")})
    cut = dataclasses.replace(run, arrays=arrays)
    scored = score_runs(case.golden, cut, T, metrics=build_metrics(T))
    expected = [pid for pid in run.prompt_ids if run.position(pid) in skip]
    m = scored.metrics
    assert m.not_teacher_forced == len(expected) and m.not_teacher_forced_ids == expected
    by_id = {s.prompt_id: s for s in scored.scores}
    benign_before = [s.prompt_id for s in case.score.scores if s.prompt_class == "benign"]
    assert benign_before and all(by_id[pid].prompt_class == "drift" for pid in benign_before)
    assert all(any("teacher forcing could not run" in r for r in by_id[pid].reasons) for pid in benign_before)
    assert m.benign == 0
    note = next(r for r in scored.verdict_reasons if "could not be teacher-forced" in r)
    assert f"{len(expected)} prompt(s)" in note and expected[0] in note
    assert json.loads(m.model_dump_json())["not_teacher_forced_ids"] == expected
