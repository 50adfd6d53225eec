"""Damage on a minority of prompts, with a measured noise floor (regress.noise.beyond's count of
regressed prompts). No engine: synthetic floors and the synthetic scored case of report_fixtures.

A signed-rank test over the whole run cannot see 10 of 100 prompts that each overturn a choice the
baseline never overturned (90 exact zeros pull it to "within"), and such regressions are below the
"severe" bar, so before this test the run passed. Now the prompts the candidate regressed on where
no noise arm did are tested against those some arm regressed on where the candidate did not."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from regress.errors import NoiseFloorError
from regress.noise.beyond import REGRESSED, compare_to_noise, mcnemar_greater, regressed_prompts
from regress.noise.floor import NOISE_FORMAT_VERSION, NoiseArmResult, NoiseFloor, PromptNoise, build_floor, \
    load_floor, write_floor
from regress.scoring import build_metrics, score_runs
from regress.verdict import NoiseJudgement, Thresholds, run_verdict
from report_fixtures import NO_SEMANTIC, build_case

T = Thresholds()
NOISE_KL = 1e-3

def _floor(n: int, regressed: dict[int, list[str]] | None = None) -> NoiseFloor:
    regressed = regressed or {}
    prompts = [PromptNoise(prompt_id=f"p{i}", flipped=i in regressed, arms=regressed.get(i, []),
                           regressed=regressed.get(i, []), tf_kl_mean=NOISE_KL * (1 + i % 7), tf_same_top1_rate=1.0)
               for i in range(n)]
    return NoiseFloor(golden_run_id="g", k=2, quantile=0.95, arms=[], floor={}, prompts=prompts)

def _rows(n: int, damaged: set[int], *, margin: float = 2.5, kl: float = 0.15) -> dict:
    """Every prompt exactly at its envelope but the ``damaged`` ones, which overturn a ``margin``-nat
    golden choice with KL ``kl``: regressions (2.5 nat: 1.5x confident_margin), none severe (3x)."""
    rows = {}
    for i in range(n):
        if i in damaged:
            rows[f"p{i}"] = {"tf_positions": 20, "tf_kl_mean": kl, "tf_same_top1_rate": 0.9,
                             "tf_max_flipped_margin": margin}
        else:
            rows[f"p{i}"] = {"tf_positions": 20, "tf_kl_mean": NOISE_KL * (1 + i % 7), "tf_same_top1_rate": 1.0,
                             "tf_max_flipped_margin": None}
    return rows

def _spread(n: int, k: int, seed: int = 0) -> set[int]:
    return set(random.Random(seed).sample(range(n), k))

def _count(test):  # type: ignore[no-untyped-def]
    return next(m for m in test.measures if m.measure == REGRESSED)

def test_ten_of_a_hundred_prompts_regressing_where_the_noise_never_did_fail_the_run() -> None:
    damaged = _spread(100, 10)
    rows, floor = _rows(100, damaged), _floor(100)
    regressed = {f"p{i}" for i in damaged}
    # What the run-level test said before it counted regressed prompts: within.
    blind = compare_to_noise(rows, floor, T)
    assert blind is not None and not blind.beyond
    assert all(not m.beyond for m in blind.measures[:3])
    test = compare_to_noise(rows, floor, T, regressed=regressed)
    count = _count(test)
    assert test.beyond and count.beyond and count.above == 10 and count.prompts == 100
    assert count.p_value == pytest.approx(0.5 ** 10) and count.ratio is None and count.effect == 1.0
    assert test.summary.startswith("beyond the baseline's noise: prompts regressed where no noise arm did: 10")
    verdict, reasons = run_verdict({"identical": 90, "regression": 10}, T, noise=NoiseJudgement(test, ()))
    assert verdict == "fail" and reasons[0].startswith("the run as a whole is beyond the baseline's noise")
    assert any("the run-level test counts them" in r for r in reasons)

@pytest.mark.parametrize("n", [40, 100, 476, 2000])
def test_the_count_fails_from_nine_prompts_whatever_the_set_size_and_never_passes_more(n: int) -> None:
    """Where no arm regressed, k prompts regressing give p = 1/2^k, times Holm's 4: beyond at 0.01
    from 9. The verdict is monotone in k and the same wherever the damaged prompts lie."""
    floor = _floor(n)
    verdicts = []
    for k in range(0, 16):
        seen = set()
        for seed in range(3):
            damaged = _spread(n, k, seed)
            test = compare_to_noise(_rows(n, damaged), floor, T, regressed={f"p{i}" for i in damaged})
            seen.add(test.beyond)
        assert len(seen) == 1, (n, k, "the same size gave two verdicts")
        verdicts.append(seen.pop())
    first = verdicts.index(True)
    assert first <= 9 and all(verdicts[first:]), verdicts
    assert not any(verdicts[:7]), verdicts

def test_another_draw_of_the_noise_is_within_the_count() -> None:
    """A candidate that regresses as often as the arms do, on other prompts or the same, passes."""
    n = 200
    for seed in range(20):
        arm = _spread(n, 12, seed)
        for cand in (_spread(n, 12, seed + 100), arm):
            rows = _rows(n, cand)
            for i in arm - cand:  # the arm regressed there: its envelope holds that damage
                rows[f"p{i}"] = {"tf_positions": 20, "tf_kl_mean": 0.1, "tf_same_top1_rate": 0.9,
                                 "tf_max_flipped_margin": None}
            floor = _floor(n, {i: ["batch"] for i in arm})
            # The arm's envelope on its own regressed prompts is as bad as the candidate's damage.
            floor = floor.model_copy(update={"prompts": [
                p.model_copy(update={"tf_kl_mean": 0.15, "tf_same_top1_rate": 0.9, "tf_max_flipped_margin": 2.5})
                if int(p.prompt_id[1:]) in arm else p for p in floor.prompts]})
            test = compare_to_noise(rows, floor, T, regressed={f"p{i}" for i in cand})
            assert not _count(test).beyond, (seed, _count(test))

def test_the_arms_own_regressions_are_the_reference() -> None:
    ids = [f"p{i}" for i in range(10)]
    floor = _floor(10, {0: ["batch"], 1: ["alone", "batch"], 2: ["alone"]})
    assert regressed_prompts(ids, {"p0", "p5", "p6"}, floor.by_id(), T) == (3, 3, 2, 2)
    assert mcnemar_greater(0, 5) == 1.0
    assert mcnemar_greater(10, 0) == pytest.approx(1 / 1024)
    assert mcnemar_greater(10, 10) > 0.5
    # Twice as many regressed prompts as the noise's but few: significant only with enough of them.
    n = 300
    arm = set(range(0, 20))
    floor = _floor(n, {i: ["batch"] for i in arm})
    cand = set(range(100, 140))
    test = compare_to_noise(_rows(n, cand), floor, T, regressed={f"p{i}" for i in cand})
    count = _count(test)
    assert count.ratio == pytest.approx(2.0) and count.above == 40 and count.beyond

def test_thresholds_tightened_after_the_floor_judge_the_noise_too() -> None:
    """The arms' classes were decided when the floor was measured; with regression_kl lowered since,
    the envelope read under the new bound counts where the noise regresses, so a candidate that is
    that noise again still passes, and one that regresses beyond it still fails."""
    n = 100
    arm = set(range(0, 12))
    floor = _floor(n)  # no arm regressed under the thresholds of the day
    floor = floor.model_copy(update={"prompts": [
        p.model_copy(update={"tf_kl_mean": 0.05}) if int(p.prompt_id[1:]) in arm else p for p in floor.prompts]})
    tight = Thresholds(regression_kl=0.04)
    rows = _rows(n, arm, kl=0.05, margin=None)  # the same KL as the arms', now past the bound
    for i in arm:
        rows[f"p{i}"]["tf_same_top1_rate"] = 1.0
    test = compare_to_noise(rows, floor, tight, regressed={f"p{i}" for i in arm})
    assert _count(test).above == 0 and not _count(test).beyond
    # Regressing elsewhere as often as the noise does is that noise again; three times as often is not.
    elsewhere = set(range(50, 62))
    test = compare_to_noise(_rows(n, elsewhere, kl=0.05, margin=None), floor, tight,
                            regressed={f"p{i}" for i in elsewhere})
    assert _count(test).above == 12 and not _count(test).beyond
    more = arm | set(range(50, 74))
    test = compare_to_noise(_rows(n, more, kl=0.05, margin=None), floor, tight, regressed={f"p{i}" for i in more})
    assert _count(test).above == 24 and _count(test).ratio == pytest.approx(3.0) and _count(test).beyond


def test_max_regressions_is_the_allowance_beyond_the_noise() -> None:
    n = 100
    for allowed, k, beyond in ((10, 10, False), (10, 11, True), (0, 9, True)):
        damaged = set(range(k))
        test = compare_to_noise(_rows(n, damaged), _floor(n), Thresholds(max_regressions=allowed),
                                regressed={f"p{i}" for i in damaged})
        assert _count(test).beyond is beyond, (allowed, k)

# ------------------------------------------------------------------ the floor records it; scoring uses it

T_PLAIN = Thresholds(metrics=NO_SEMANTIC)

@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_case(tmp_path_factory.mktemp("minority-case"), prompts=100, tokens=16, semantic=False)

def _arm(name: str, scored) -> NoiseArmResult:  # type: ignore[no-untyped-def]
    m = scored.metrics
    return NoiseArmResult(name=name, kind="batch", changed="another batch", shard_size=2, run_id=scored.run.run_id,
                          prompts=m.prompts, identical=m.identical, diverged=m.prompts - m.identical)

def test_the_floor_records_where_the_baseline_itself_regressed(case) -> None:  # type: ignore[no-untyped-def]
    scored = case.score
    floor = build_floor(case.golden.manifest.run_id, [(_arm("batch", scored), scored)], k=2, q=0.95)
    by_id = floor.by_id()
    for s in scored.scores:
        assert by_id[s.prompt_id].regressed == (["batch"] if s.prompt_class == "regression" else [])
    assert floor.format_version == NOISE_FORMAT_VERSION == 2

def test_scoring_counts_the_candidates_regressions_against_the_arms(case) -> None:  # type: ignore[no-untyped-def]
    t = Thresholds(metrics=NO_SEMANTIC, severe_regression=1e9)  # nothing severe: only the count can see them
    plain = score_runs(case.golden, case.run, t, metrics=build_metrics(t))
    regressions = {s.prompt_id for s in plain.scores if s.prompt_class == "regression"}
    assert len(regressions) == 10
    # An arm that measured the same as the candidate but on the ten, where it stayed the golden ...
    quiet = next(s.metrics for s in plain.scores if s.prompt_class == "identical")
    clean = plain.model_copy(update={"scores": [
        s.model_copy(update={"prompt_class": "identical", "metrics": quiet}) if s.prompt_class == "regression" else s
        for s in plain.scores]})
    floor = build_floor(case.golden.manifest.run_id, [(_arm("batch", clean), clean)], k=2, q=0.95)
    scored = score_runs(case.golden, case.run, t, metrics=build_metrics(t), noise=floor)
    count = _count(scored.metrics.noise_test)
    assert count.above == 10 and count.beyond and scored.metrics.verdict == "fail"
    assert scored.metrics.severe_regressions == 0
    assert any("prompts regressed where no noise arm did: 10" in r for r in scored.verdict_reasons)
    # ... and one that regressed on the same prompts: the candidate is that noise again.
    same = build_floor(case.golden.manifest.run_id, [(_arm("batch", plain), plain)], k=2, q=0.95)
    again = score_runs(case.golden, case.run, t, metrics=build_metrics(t), noise=same)
    assert _count(again.metrics.noise_test).above == 0 and not _count(again.metrics.noise_test).beyond

def test_a_floor_of_the_old_format_is_refused_naming_the_file(case, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    golden = tmp_path / "golden"
    shutil.copytree(case.golden.path, golden)
    run_id = case.golden.manifest.run_id
    floor = build_floor(run_id, [(_arm("batch", case.score), case.score)], k=2, q=0.95)
    write_floor(floor.model_copy(update={"format_version": 1}), golden)
    with pytest.raises(NoiseFloorError, match=r"noise\.json: noise format 1, this regress reads 2.*regress noise"):
        load_floor(golden, run_id)
    write_floor(floor, golden)
    assert load_floor(golden, run_id) == floor
