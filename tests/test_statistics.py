"""Interval statistics in the verdict (regress.stats): Wilson intervals, exact McNemar, Newcombe's
difference, the rate gates and where they are shown. No engine: runs are report_fixtures' synthetic ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy.stats import binom, binomtest

from report_fixtures import BagOfWordsEncoder, Case, build_case
from regress.errors import ConfigError
from regress.records import RunMetrics, ScoredRun
from regress.report.render import render_candidate
from regress.report.summary import summary_markdown
from regress.scoring import build_metrics, score_runs
from regress.stats import (STAT_FIELDS, failure_probability, fails_from, interval_text, mcnemar_exact,
                           prompts_needed, rate_difference, run_stats, wilson)
from regress.verdict import Thresholds, run_verdict


def _scipy_wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return ci.low, ci.high


# ------------------------------------------------------------------ regress.stats


@pytest.mark.parametrize("k,n,confidence", [(0, 10, 0.95), (3, 124, 0.95), (50, 100, 0.9), (7, 7, 0.99), (1, 1000, 0.95)])
def test_wilson_is_scipys(k: int, n: int, confidence: float) -> None:
    assert wilson(k, n, confidence) == pytest.approx(_scipy_wilson(k, n, confidence), abs=1e-15)


def test_wilson_without_prompts_is_none() -> None:
    assert wilson(0, 0) is None


@pytest.mark.parametrize("b,c", [(3, 1), (10, 0), (4, 4), (21, 8), (0, 5)])
def test_mcnemar_is_the_exact_binomial_test(b: int, c: int) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(binomtest(b, b + c, 0.5).pvalue, abs=1e-15)


def test_mcnemar_without_discordant_pairs_is_one() -> None:
    assert mcnemar_exact(0, 0) == 1.0


def test_rate_difference_is_newcombes_hybrid_score() -> None:
    # Newcombe (1998), Table II, example (a): 56/70 - 48/80 = 0.2000, method 10: 0.0524 to 0.3339.
    d, low, high = rate_difference(56, 70, 48, 80)
    assert d == pytest.approx(0.2)
    assert (round(low, 4), round(high, 4)) == (0.0524, 0.3339)
    (l1, u1), (l2, u2) = _scipy_wilson(56, 70), _scipy_wilson(48, 80)
    assert low == pytest.approx(d - math.sqrt((56 / 70 - l1) ** 2 + (u2 - 48 / 80) ** 2))
    assert high == pytest.approx(d + math.sqrt((u1 - 56 / 70) ** 2 + (48 / 80 - l2) ** 2))
    assert rate_difference(1, 0, 1, 10) is None


def test_run_stats_counts_comparable_prompts() -> None:
    counts = {"identical": 60, "benign": 20, "drift": 10, "regression": 6, "input_drift": 4}
    answers = {"answer_prompts": 40, "answer_flips_lost": 3, "answer_flips_gained": 1}
    s = run_stats(counts, answers, 0.9)
    assert set(s) == set(STAT_FIELDS)
    assert s["regression_rate"] == 6 / 96 and s["flip_rate"] == 36 / 96
    assert (s["regression_rate_low"], s["regression_rate_high"]) == pytest.approx(_scipy_wilson(6, 96, 0.9))
    assert (s["flip_rate_low"], s["flip_rate_high"]) == pytest.approx(_scipy_wilson(36, 96, 0.9))
    assert s["answer_flip_rate"] == 4 / 40
    assert (s["answer_flip_rate_low"], s["answer_flip_rate_high"]) == pytest.approx(_scipy_wilson(4, 40, 0.9))
    assert s["answer_mcnemar_p"] == pytest.approx(binomtest(3, 4, 0.5).pvalue)
    empty = run_stats({"input_drift": 3})
    assert all(empty[k] is None for k in STAT_FIELDS if k != "confidence")


def test_prompts_needed_is_exact_binomial() -> None:
    n = prompts_needed(0.01, 0.05)
    assert n is not None
    k = fails_from(n, 0.01)
    assert wilson(k, n)[0] > 0.01 >= wilson(k - 1, n)[0]
    assert failure_probability(n, 0.05, 0.01) == pytest.approx(binom.sf(k - 1, n, 0.05))
    assert failure_probability(n, 0.05, 0.01) >= 0.8

    def holds_from(start: int) -> bool:
        return all(failure_probability(m, 0.05, 0.01) >= 0.8 for m in range(start, start + start // 4 + 1))

    assert holds_from(n) and not holds_from(n - 1)
    assert prompts_needed(0.01, 0.01) is None


# ------------------------------------------------------------------ the verdict


def test_verdict_fails_when_the_lower_bound_exceeds_the_rate() -> None:
    # 6 of 100: point 6 %, Wilson 95 % 2.8–12.5 %.
    counts = {"identical": 94, "regression": 6}
    low, high = _scipy_wilson(6, 100)
    verdict, reasons = run_verdict(counts, Thresholds(max_regression_rate=0.02))
    assert verdict == "fail"
    assert reasons[0] == f"regression rate 6.0 % (95 % CI {low * 100:.1f}–{high * 100:.1f} %) exceeds 2.0 % at the lower bound"
    assert reasons[0] == "regression rate 6.0 % (95 % CI 2.8–12.5 %) exceeds 2.0 % at the lower bound"


def test_verdict_passes_when_only_the_point_estimate_exceeds_the_rate() -> None:
    # 3 of 100: point 3 % > 2 %, but the lower bound (1.0 %) is within it.
    counts = {"identical": 97, "regression": 3}
    low, high = _scipy_wilson(3, 100)
    assert 3 / 100 > 0.02 > low
    verdict, reasons = run_verdict(counts, Thresholds(max_regression_rate=0.02))
    assert verdict == "pass"
    assert reasons[0] == "3 regression(s) (the count does not gate: max_regression_rate is set)"
    assert reasons[1] == f"regression rate 3.0 % (95 % CI {low * 100:.1f}–{high * 100:.1f} %): lower bound within 2.0 %"


def test_an_explicit_max_regressions_still_gates_beside_the_rate() -> None:
    counts = {"identical": 97, "regression": 3}
    t = Thresholds.from_params({"max_regression_rate": 0.02, "max_regressions": 0})
    verdict, reasons = run_verdict(counts, t)
    assert verdict == "fail" and reasons == ["3 prompt(s) regressed (allowed: 0)"]
    assert run_verdict(counts, Thresholds.from_params({"max_regression_rate": 0.02, "max_regressions": 3}))[0] == "pass"
    # Without a rate the count gates as before.
    assert run_verdict(counts, Thresholds()) == ("fail", ["3 prompt(s) regressed (allowed: 0)"])


def test_confidence_changes_the_interval() -> None:
    counts = {"identical": 97, "regression": 3}
    _, reasons = run_verdict(counts, Thresholds(max_regression_rate=0.02, confidence=0.8))
    low, high = _scipy_wilson(3, 100, 0.8)
    assert reasons[1] == f"regression rate 3.0 % (80 % CI {low * 100:.1f}–{high * 100:.1f} %): lower bound within 2.0 %"


def test_answer_flip_rate_gate_and_mcnemar_note() -> None:
    answers = {"answer_prompts": 40, "golden_answers_correct": 30, "answers_correct": 22, "answer_flips_lost": 10,
               "answer_flips_gained": 2}
    counts = {"identical": 40}
    t = Thresholds(max_answer_flip_rate=0.1)
    verdict, reasons = run_verdict(counts, t, answers=answers)
    low, high = _scipy_wilson(12, 40)
    p = binomtest(10, 12, 0.5).pvalue
    assert verdict == "fail"
    assert reasons[0] == (f"answer flip rate 30.0 % (95 % CI {low * 100:.1f}–{high * 100:.1f} %) "
                          "exceeds 10.0 % at the lower bound")
    assert f"10 lost, 2 gained, exact McNemar p = {p:.2g}" in reasons[-1]
    assert run_verdict(counts, Thresholds(max_answer_flip_rate=0.2), answers=answers)[0] == "pass"


def test_reasons_without_a_rate_gate_are_unchanged() -> None:
    # Without stats (and no rate gate) run_verdict says what it always said.
    assert run_verdict({"regression": 0}, Thresholds()) == ("pass", ["0 regression(s), allowed 0"])


@pytest.mark.parametrize("bad", [1.5, 0.2, 1.0, "high"])
def test_confidence_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        Thresholds.from_params({"confidence": bad}, file="params.yaml")
    assert info.value.field == "thresholds.confidence"
    assert "params.yaml: field 'thresholds.confidence'" in str(info.value)


@pytest.mark.parametrize("field", ["max_regression_rate", "max_answer_flip_rate"])
def test_rates_are_validated(field: str) -> None:
    assert getattr(Thresholds(), field) is None
    with pytest.raises(ConfigError):
        Thresholds.from_params({field: 1.5})
    with pytest.raises(ConfigError):
        Thresholds.from_params({field: -0.1})


# ------------------------------------------------------------------ scored runs, files and pages


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("stats"), 40)


def _score(case: Case, t: Thresholds) -> ScoredRun:
    return score_runs(case.golden, case.run, t, metrics=build_metrics(t, encoder=BagOfWordsEncoder()))


def test_scored_run_carries_the_intervals(case: Case) -> None:
    m = case.score.metrics
    comparable = m.prompts - m.input_drift
    assert m.confidence == 0.95
    assert m.regression_rate == m.regression / comparable
    assert (m.regression_rate_low, m.regression_rate_high) == pytest.approx(_scipy_wilson(m.regression, comparable))
    assert m.flip_rate == (comparable - m.identical) / comparable
    assert m.answer_flip_rate is None and m.answer_mcnemar_p is None


def test_rate_gate_on_a_scored_run(case: Case) -> None:
    m = case.score.metrics
    strict = _score(case, Thresholds(max_regression_rate=0.01))
    assert strict.metrics.verdict == "fail"
    assert strict.verdict_reasons[0].startswith(f"regression rate {m.regression_rate * 100:.1f} % (95 % CI ")
    assert strict.thresholds["max_regression_rate"] == 0.01
    # The page says what stopped the run: the rate, not a count.
    page = render_candidate(strict, case.golden, case.run, case.prompt_set)
    assert f"{strict.verdict_reasons[0]}: stop the rollout" in page
    lenient = _score(case, Thresholds(max_regression_rate=0.5))
    assert lenient.metrics.verdict == "pass"


def test_old_metrics_json_still_loads(case: Case) -> None:
    data = json.loads(case.score.metrics.model_dump_json())
    old = {k: v for k, v in data.items() if k not in STAT_FIELDS}
    m = RunMetrics.model_validate(old)
    assert m.confidence == 0.95 and m.regression_rate is None and m.answer_mcnemar_p is None


def test_schema_lists_the_new_fields() -> None:
    from regress.report import METRICS_SCHEMA

    props = json.loads(Path(METRICS_SCHEMA).read_text(encoding="utf-8"))["properties"]
    assert set(STAT_FIELDS) <= set(props)


def test_summary_and_page_show_the_intervals(case: Case) -> None:
    m = case.score.metrics
    shown = interval_text(m.regression_rate, m.regression_rate_low, m.regression_rate_high, m.confidence)
    page = render_candidate(case.score, case.golden, case.run, case.prompt_set)
    assert "regression rate" in page and "flip rate" in page
    assert shown.replace("(", "").replace(")", "") in page.replace("(", "").replace(")", "")
    md = summary_markdown(case.score)
    assert "| regression rate |" in md and "| flip rate |" in md
    assert "McNemar" not in md  # no expected answers in this set
    old = case.score.model_copy(update={"metrics": RunMetrics.model_validate(
        {k: v for k, v in json.loads(case.score.metrics.model_dump_json()).items() if k not in STAT_FIELDS})})
    assert "| regression rate |" not in summary_markdown(old)
    render_candidate(old, case.golden, case.run, case.prompt_set)
