"""The run-level fidelity test against the measured noise (regress.noise.beyond) and how it makes the
run verdict with the per-prompt classes (regress.verdict.run_verdict): no engine, synthetic floors."""

from __future__ import annotations

import math
import random

import pytest

from regress.noise.beyond import MEASURES, compare_to_noise, describe, signed_rank
from regress.stats import holm
from regress.noise.floor import NoiseFloor, PromptNoise
from regress.verdict import NoiseJudgement, Thresholds, run_verdict, severe, verdict_basis

T = Thresholds()


def _floor(kl: list[float], same: list[float] | None = None, margin: list[float | None] | None = None) -> NoiseFloor:
    same = same or [1.0] * len(kl)
    margin = margin or [None] * len(kl)
    prompts = [PromptNoise(prompt_id=f"p{i}", flipped=False, tf_kl_mean=k, tf_same_top1_rate=s, tf_max_flipped_margin=m)
               for i, (k, s, m) in enumerate(zip(kl, same, margin))]
    return NoiseFloor(golden_run_id="g", k=2, quantile=0.95, arms=[], floor={}, prompts=prompts)


def _rows(kl: list[float], same: list[float] | None = None, margin: list[float | None] | None = None) -> dict:
    same = same or [1.0] * len(kl)
    margin = margin or [None] * len(kl)
    return {f"p{i}": {"tf_positions": 20, "tf_kl_mean": k, "tf_same_top1_rate": s, "tf_max_flipped_margin": m}
            for i, (k, s, m) in enumerate(zip(kl, same, margin))}


def _noise(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.lognormvariate(math.log(1e-3), 0.8) for _ in range(n)]


def test_holm_matches_the_step_down_definition() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([0.001]) == [0.001]


def test_signed_rank_of_nothing_above_is_p_one() -> None:
    assert signed_rank([0.0, 0.0, 0.0]) == (0.0, 1.0, 0.0)
    assert signed_rank([-1.0, -2.0, 0.0]) == (0.0, 1.0, -1.0)
    _, p, effect = signed_rank([1.0] * 10)
    assert p == pytest.approx(1 / 2 ** 10) and effect == 1.0


def test_another_draw_of_the_noise_is_within_it() -> None:
    """The envelope is the worst of the arms; a candidate that is one more draw of the same noise
    (here: the max of three draws against one draw) passes, on every seed tried."""
    for seed in range(20):
        draws = [_noise(100, seed * 10 + a) for a in range(3)]
        envelope = [max(vals) for vals in zip(*draws)]
        candidate = _noise(100, seed * 10 + 7)
        test = compare_to_noise(_rows(candidate), _floor(envelope), T)
        assert test is not None and not test.beyond, (seed, test.summary)
        assert test.summary.startswith("within the baseline's noise")


def test_a_change_on_every_prompt_is_beyond_the_noise() -> None:
    envelope = _noise(60, 1)
    candidate = [3 * e for e in envelope]
    test = compare_to_noise(_rows(candidate), _floor(envelope), T)
    kl = test.measures[0]
    assert test.beyond and kl.beyond and kl.ratio == pytest.approx(3.0) and kl.above == 60 and kl.effect == 1.0
    assert kl.p_value < 1e-10 and test.summary.startswith("beyond the baseline's noise: teacher-forced KL 3x")
    # Significant but not material: every prompt 1.2x its envelope is within at min_ratio 2.
    mild = compare_to_noise(_rows([1.2 * e for e in envelope]), _floor(envelope), T)
    assert Thresholds(noise_min_ratio=1.1) and compare_to_noise(
        _rows([1.2 * e for e in envelope]), _floor(envelope), Thresholds(noise_min_ratio=1.1)).beyond
    assert not mild.beyond and mild.measures[0].p_value < 1e-10


def test_below_the_resolution_nothing_differs_and_above_it_zero_noise_is_beaten() -> None:
    """A float32 baseline's noise is ~1e-13 nat: a change of 1e-12 is none (noise_kl_resolution),
    one of 1e-3 on every prompt is beyond; flips at near-ties are coin tosses on both sides."""
    tiny = compare_to_noise(_rows([1e-12] * 10), _floor([1e-13] * 10), T)
    assert not tiny.beyond and tiny.measures[0].ratio == 1.0 and tiny.measures[0].above == 0
    real = compare_to_noise(_rows([1e-3] * 10), _floor([1e-13] * 10), T)
    assert real.beyond and real.measures[0].ratio == pytest.approx(100)
    ties = compare_to_noise(_rows([1e-13] * 10, same=[0.9] * 10, margin=[0.2] * 10), _floor([1e-13] * 10), T)
    assert not ties.beyond and all(m.candidate_mean == 0 for m in ties.measures[1:])
    assert "0.00%, as in the noise" in describe(ties.measures[1])
    flips = compare_to_noise(_rows([1e-13] * 10, same=[0.9] * 10, margin=[1.5] * 10), _floor([1e-13] * 10), T)
    assert flips.beyond and [m.beyond for m in flips.measures] == [False, True, True, False]
    assert flips.measures[2].ratio is None and "where the noise is exactly 0" in describe(flips.measures[2])


def test_unpaired_and_nonfinite_prompts_are_left_out_and_few_prompts_give_no_test() -> None:
    rows = _rows([0.5] * 12)
    rows["p3"]["tf_kl_mean"] = float("nan")
    rows["p4"].update(tf_positions=0, tf_kl_mean=None, tf_same_top1_rate=None)  # not teacher-forced
    floor = _floor([0.1] * 12)
    test = compare_to_noise(rows, floor, T)
    assert [m.prompts for m in test.measures] == [10, 11, 11, 12] and test.left_out == 2
    assert compare_to_noise(_rows([0.5] * 5), _floor([0.1] * 5), T) is None


@pytest.mark.parametrize("n", range(5, 13))
def test_a_set_too_small_to_say_beyond_gets_no_test_and_every_regression_counts(n: int) -> None:
    """The run-level test runs only where it can say "beyond": n prompts all above their envelope
    give p = 1/2^n at best, times Holm's 4 for the tests; at alpha 0.01 that takes 9. So 6 to 8
    prompts that each regressed are not excused as "within the noise" (they once were, while 5
    and 9 failed), and from 9 prompts the test says beyond."""
    from regress.noise.beyond import MEASURES
    from regress.noise.record import RUN_LEVEL_MEASURES, min_testable

    assert min_testable(T.noise_alpha) == 9 and len(MEASURES) + 1 == RUN_LEVEL_MEASURES
    test = compare_to_noise(_rows([0.25] * n), _floor([1e-4] * n), T)
    if n < 9:
        assert test is None
    else:
        assert test is not None and test.beyond


def test_an_excess_rising_to_zero_never_raises_p() -> None:
    """One method per set size: scipy's "auto" switched from the exact p to the normal
    approximation when one excess was exactly 0, so a prompt's excess rising from just below its
    envelope to exactly it raised p (0.0026 to 0.0035 here) and could pass a larger change."""
    from regress.noise.beyond import signed_rank

    base = [0.1, 0.2, -0.007, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, -0.05, 1.2]
    previous = 1.0
    for excess in (-0.5, -0.05, -0.007, -1e-9, 0.0, 1e-9, 0.05, 2.0):
        p = signed_rank([*base[:2], excess, *base[3:]])[1]
        assert p <= previous + 1e-12, (excess, p, previous)
        previous = p


def test_the_verdict_is_monotone_along_a_ladder_and_the_same_for_the_same_size() -> None:
    """Damage that grows along one direction (a per-prompt susceptibility times the step) never
    passes a step above one that failed, and two candidates of one size, drawn apart, agree."""
    envelope = _noise(80, 3)
    rng = random.Random(5)
    susceptibility = [rng.lognormvariate(0, 0.7) for _ in envelope]
    verdicts = []
    for step in [0.1 * 1.5 ** i for i in range(14)]:
        candidate = [e * rng.uniform(0.3, 1.0) + step * s * 1e-3 for e, s in zip(envelope, susceptibility)]
        test = compare_to_noise(_rows(candidate), _floor(envelope), T)
        verdicts.append(test.beyond)
    assert verdicts[0] is False and verdicts[-1] is True
    first = verdicts.index(True)
    assert all(verdicts[first:]), verdicts


def _counts(regressions: int, n: int = 100) -> dict[str, int]:
    return {"identical": n - regressions, "regression": regressions}


def test_a_run_beyond_the_noise_fails_with_no_regression() -> None:
    envelope = _noise(40, 2)
    test = compare_to_noise(_rows([5 * e for e in envelope]), _floor(envelope), T)
    verdict, reasons = run_verdict(_counts(0), T, noise=NoiseJudgement(test, ()))
    assert verdict == "fail" and reasons[0].startswith("the run as a whole is beyond the baseline's noise")


def test_with_a_floor_only_severe_regressions_gate_and_milder_ones_explain() -> None:
    envelope = _noise(40, 2)
    within = compare_to_noise(_rows(envelope), _floor(envelope), T)
    verdict, reasons = run_verdict(_counts(2), T, noise=NoiseJudgement(within, ()))
    assert verdict == "pass", reasons
    assert reasons[0] == "the run as a whole is " + within.summary
    assert "0 severe regression(s), allowed 0" in reasons
    assert any(r.startswith("2 milder regression(s)") for r in reasons)
    verdict, reasons = run_verdict(_counts(2), T, noise=NoiseJudgement(within, ("p7",)))
    assert verdict == "fail" and reasons[0].startswith("1 prompt(s) regressed severely (p7")
    assert reasons[1] == "the run as a whole is " + within.summary  # said on a failure too
    # Without a floor every regression counts, as before.
    verdict, reasons = run_verdict(_counts(2), T)
    assert verdict == "fail" and reasons[0] == "2 prompt(s) regressed (allowed: 0)"


def test_severity_decides_what_is_severe() -> None:
    mild = {"tf_kl_mean": 0.15, "tf_positions": 10}  # 1.5x regression_kl 0.1
    far = {"tf_kl_mean": 2.0, "tf_positions": 10}  # 20x
    broken = {"tf_kl_mean": float("nan"), "tf_positions": 10}
    outside = {"tf_kl_mean": 0.05, "tf_positions": 10, "first_divergence": 0, "golden_margin": 0.07,
               "candidate_token_in_golden_topk": False, "golden_token_in_candidate_topk": True}
    assert not severe(mild, T) and severe(far, T) and severe(broken, T)
    assert severe(outside, T), "a token outside the golden's top-k is categorical"
    assert severe(mild, Thresholds(severe_regression=1.2))
    # A sampled prompt whose four samples mean something else (the demo's 'next' on the capital of
    # Italy: 'Rome.' four times against four phrasings) is a rule of degree, not a category: the
    # sampled prompts' run-level test judges it, it does not gate alone. Four samples a side
    # cannot put the gap beyond chance (1 split in 70 at best): drift. A gap without its p (which
    # the metric always gives with it) is no finding at all: never a regression on size alone.
    from regress.metrics.sampled import DISTRIBUTION_RULE

    sampled = {"samples": 4, "tf_kl_mean": 0.0, "tf_positions": 0, "sample_semantic_gap": 0.35,
               "sample_semantic_candidate": 0.65, "sample_semantic_golden": 0.99, "sample_logprob_shift": -0.9,
               "sample_logprob_p": 0.12}
    assert DISTRIBUTION_RULE.check(sampled, T) == ([], []), "a gap is never judged on its size alone"
    assert not DISTRIBUTION_RULE.categorical and not severe(sampled, T)
    regression, drift = DISTRIBUTION_RULE.check({**sampled, "sample_semantic_p": 1 / 70}, T)
    assert not regression and drift and "permutation p = 0.014" in drift[0]
    assert DISTRIBUTION_RULE.check({**sampled, "sample_semantic_p": 1e-4}, T)[0]


def test_the_basis_says_what_the_verdict_rests_on() -> None:
    assert verdict_basis(None).startswith("fixed per-prompt thresholds alone")
    assert "too few prompts" in verdict_basis(NoiseJudgement(None, ()))
    assert verdict_basis(NoiseJudgement(object(), ())).startswith("the run-level test")


def test_measures_are_the_three_the_issue_names() -> None:
    assert [m.name for m in MEASURES] == ["tf_kl_mean", "tf_disagreement", "tf_max_flipped_margin"]


def test_a_power_file_is_shown_only_whole_and_for_its_golden(tmp_path, capsys) -> None:
    from regress.power.ladder import conclude, load_power, thresholds_digest
    from regress.power.record import POWER_FILE, PowerStep

    steps = [PowerStep(key=f"w{i}", scale=s, label=f"step {i}", run_id="r", prompts=10, identical=5, regressions=0,
                       verdict=v, reasons=[]) for i, (s, v) in enumerate([(0.001, "pass"), (0.01, "fail")])]
    power = conclude("g1", 0, steps, [], basis="noise", digest=thresholds_digest(T))
    assert power.smallest_failing == "w1" and power.monotone and "fails step 1 and passes step 0" in power.summary
    assert load_power(tmp_path, "g1", T) is None  # no file: no figure, no warning
    (tmp_path / POWER_FILE).write_text(power.model_dump_json())
    figure = load_power(tmp_path, "g1", T)
    assert figure.smallest_failing_scale == 0.01 and figure.current and figure.arms_pass is None
    assert load_power(tmp_path, "another-golden", T) is None
    assert load_power(tmp_path, "g1", Thresholds(noise_min_ratio=3)).current is False
    (tmp_path / POWER_FILE).write_text('{"format_version": 1, "steps": "nope"}')
    assert load_power(tmp_path, "g1", T) is None
    assert "not a regress power file" in capsys.readouterr().err
