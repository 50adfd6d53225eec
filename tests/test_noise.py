"""Noise arms and the measured noise floor (regress.noise): the envelope, how scoring applies it,
params' ``noise:`` section, the report, and one real-engine check on the fixture model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from regress.errors import ConfigError, ConfigProblems, NoiseFloorError
from regress.noise.floor import (KL, SAME, NoiseArmResult, NoiseFloor, PromptNoise, build_floor, load_floor,
                                 noise_path, prompt_thresholds, quantile, run_thresholds, write_floor)
from regress.noise.settings import NoiseSettings
from regress.scoring import build_metrics, score_runs
from regress.verdict import Thresholds
from report_fixtures import HOSTILE, NO_SEMANTIC, build_case

T = Thresholds(metrics=NO_SEMANTIC)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    return build_case(tmp_path_factory.mktemp("noise-case"), prompts=20, tokens=16, semantic=False)


def _arm(name: str, scored) -> NoiseArmResult:  # type: ignore[no-untyped-def]
    m = scored.metrics
    return NoiseArmResult(name=name, kind="alone", changed="each prompt alone", shard_size=1, run_id=scored.run.run_id,
                          prompts=m.prompts, identical=m.identical, diverged=m.prompts - m.identical)


def _score(case, noise=None):  # type: ignore[no-untyped-def]
    return score_runs(case.golden, case.run, T, metrics=build_metrics(T), noise=noise)


# ------------------------------------------------------------------ the envelope

def test_quantile_interpolates() -> None:
    assert quantile([0.0, 1.0], 0.5) == 0.5
    assert quantile([3.0, 1.0, 2.0], 1.0) == 3.0
    assert quantile([], 0.5) is None


def test_envelope_takes_the_worst_of_every_arm(case) -> None:  # type: ignore[no-untyped-def]
    scored = case.score
    floor = build_floor(case.golden.manifest.run_id, [(_arm("alone", scored), scored)], k=2, q=0.95)
    by_id = floor.by_id()
    assert [p.prompt_id for p in floor.prompts] == [s.prompt_id for s in scored.scores]
    for s in scored.scores:
        p = by_id[s.prompt_id]
        assert p.flipped == (s.prompt_class != "identical")
        assert p.arms == (["alone"] if p.flipped else [])
        assert p.tf_kl_mean == pytest.approx(s.metrics["tf_kl_mean"])
        if s.prompt_class in ("benign", "drift", "regression"):
            assert p.golden_margin == pytest.approx(s.metrics["golden_margin"]) and p.golden_margin_arm == "alone"
        else:
            assert p.golden_margin is None
    kls = sorted(s.metrics["tf_kl_mean"] for s in scored.scores)
    assert floor.floor[KL] == pytest.approx(quantile(kls, 0.95))
    sames = [s.metrics["tf_same_top1_rate"] for s in scored.scores]
    assert floor.floor[SAME] == pytest.approx(quantile(sames, 0.05))
    # Two arms: the larger KL, the smaller same-top-1, the flips of either.
    other = scored.model_copy(update={"scores": [s.model_copy(update={
        "prompt_class": "identical", "metrics": {**s.metrics, "tf_kl_mean": s.metrics["tf_kl_mean"] * 3}})
        for s in scored.scores]})
    both = build_floor("g", [(_arm("alone", scored), scored), (_arm("rerun", other), other)], k=2, q=0.5)
    for s in scored.scores:
        p = both.by_id()[s.prompt_id]
        assert p.tf_kl_mean == pytest.approx(3 * s.metrics["tf_kl_mean"])
        assert p.arms == (["alone"] if s.prompt_class != "identical" else [])


def test_noise_json_is_written_atomically_and_a_stale_one_is_refused(case, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    golden = tmp_path / "golden"
    shutil.copytree(case.golden.path, golden)
    run_id = case.golden.manifest.run_id
    floor = build_floor(run_id, [(_arm("alone", case.score), case.score)], k=2, q=0.95)
    path = write_floor(floor, golden)
    assert path == noise_path(golden) and json.loads(path.read_text())["golden_run_id"] == run_id
    assert load_floor(golden, run_id) == floor
    # Measured against another golden: refused, naming the file (tests/test_noise_integrity.py).
    with pytest.raises(NoiseFloorError, match="stale"):
        load_floor(golden, "golden-2")
    assert load_floor(tmp_path / "nothing", run_id) is None


# ------------------------------------------------------------------ classification with a floor

def test_a_divergence_within_its_envelope_is_benign(case) -> None:  # type: ignore[no-untyped-def]
    plain = _score(case)
    drift = [s.prompt_id for s in plain.scores if s.prompt_class == "drift"]
    regressions = [s.prompt_id for s in plain.scores if s.prompt_class == "regression"]
    assert drift and regressions
    # The baseline flipped exactly these prompts the same way under 'alone'.
    floor = build_floor(case.golden.manifest.run_id, [(_arm("alone", plain), plain)], k=2, q=0.95)
    noisy = _score(case, floor)
    by_id = {s.prompt_id: s for s in noisy.scores}
    for pid in drift:
        assert by_id[pid].prompt_class == "benign", by_id[pid].reasons
        assert by_id[pid].reasons[0].startswith("within its noise envelope: the baseline flipped it too under 'alone' at margin 0.5")
    for pid in regressions:  # regression bounds do not move per prompt: a confident flip stays a regression
        assert by_id[pid].prompt_class == "regression"
    nf = noisy.metrics.noise_floor
    assert nf is not None and nf.arms == ["alone"] and set(nf.made_benign) == set(drift)
    assert nf.noisy_prompts == len([p for p in floor.prompts if p.flipped])
    assert plain.metrics.noise_floor is None
    assert "noise_floor" not in json.loads(plain.metrics.model_dump_json())


def test_a_divergence_beyond_its_envelope_is_not_benign(case) -> None:  # type: ignore[no-untyped-def]
    plain = _score(case)
    drift = next(s for s in plain.scores if s.prompt_class == "drift")
    # The baseline flipped it, but only at a smaller margin than the candidate's.
    floor = NoiseFloor(golden_run_id=case.golden.manifest.run_id, k=2, quantile=0.95, arms=[_arm("alone", plain)],
                       floor={KL: 0.0, SAME: 1.0}, prompts=[PromptNoise(
                           prompt_id=drift.prompt_id, flipped=True, arms=["alone"], golden_margin=0.25,
                           golden_margin_arm="alone", tf_kl_mean=1.0, tf_same_top1_rate=0.0)])
    scored = {s.prompt_id: s for s in _score(case, floor).scores}[drift.prompt_id]
    assert scored.prompt_class == "drift"
    assert scored.reasons == drift.reasons


def test_run_level_bounds_follow_the_floor() -> None:
    floor = NoiseFloor(golden_run_id="g", k=2, quantile=0.95, arms=[], prompts=[],
                       floor={KL: 0.03, SAME: 0.85})
    t = run_thresholds(T, floor)
    assert t.benign_kl == pytest.approx(0.06) and t.regression_kl == pytest.approx(0.1)  # max(configured, k x floor)
    assert t.benign_same_top1 == pytest.approx(0.7) and t.regression_same_top1 == pytest.approx(0.7)
    quiet = run_thresholds(T, floor.model_copy(update={"floor": {KL: 0.001, SAME: 0.999}}))
    assert (quiet.benign_kl, quiet.regression_kl, quiet.benign_same_top1, quiet.regression_same_top1) == (
        T.benign_kl, T.regression_kl, T.benign_same_top1, T.regression_same_top1)  # never tightened
    own = prompt_thresholds(T, PromptNoise(prompt_id="p", flipped=True, golden_margin=0.41, tf_max_flipped_margin=0.2,
                                           tf_kl_mean=0.03, tf_same_top1_rate=0.9, semantic_similarity=0.5), k=2)
    assert 0.41 < own.near_tie_margin < 0.4101
    assert own.benign_kl == pytest.approx(0.06) and own.benign_same_top1 == 0.9 and own.benign_semantic == 0.5
    assert own.regression_kl == T.regression_kl and own.confident_margin == T.confident_margin


def test_the_report_and_summary_show_the_floor_escaped(case) -> None:  # type: ignore[no-untyped-def]
    from regress.report.render import render_candidate
    from regress.report.summary import summary_markdown

    plain = _score(case)
    floor = build_floor(case.golden.manifest.run_id, [(_arm("alone", plain), plain)], k=2, q=0.95)
    hostile = PromptNoise(prompt_id=HOSTILE[0], flipped=True, arms=["alone"], golden_margin=0.1)
    floor = floor.model_copy(update={"prompts": [*floor.prompts, hostile]})
    scored = _score(case, floor)
    page = render_candidate(scored, case.golden, case.run, case.prompt_set)
    assert 'id="noise"' in page and "Noise floor" in page and "floor " in page
    assert HOSTILE[0] not in page  # escaped
    md = summary_markdown(scored)
    assert "**Noise floor**" in md and f"`{HOSTILE[0]}`" in md  # user text only in code spans
    assert md.count(HOSTILE[0]) == md.count(f"`{HOSTILE[0]}`")


# ------------------------------------------------------------------ params.yaml

def _params(tmp_path: Path, noise: object) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"dataset": "d.jsonl", "baseline": {"package": "current", "model": "m"},
                                    "noise": noise}, sort_keys=False), encoding="utf-8")
    return path


def test_noise_settings_are_validated(tmp_path: Path) -> None:
    from regress.config import load_params

    p = load_params(_params(tmp_path, {"arms": ["rerun", {"name": "batch", "shard_size": 4}, "alone"], "k": 3}))
    assert [a.key for a in p.noise.arms] == ["rerun", "batch-4", "alone"] and p.noise.k == 3 and p.noise.quantile == 0.95
    assert [a.shard_size_for(16) for a in p.noise.arms] == [16, 4, 1]
    assert NoiseSettings(arms=["batch"]).arms[0].shard_size_for(16) == 32
    assert load_params(_params(tmp_path, None)).noise is None
    # The concurrency arm (a server baseline): 8 in flight, or 1 when the golden had more.
    arm = NoiseSettings(arms=["concurrency"]).arms[0]
    assert (arm.key, arm.concurrency_for(1), arm.concurrency_for(16)) == ("concurrency", 8, 1)
    assert NoiseSettings(arms=[{"name": "concurrency", "concurrency": 32}]).arms[0].key == "concurrency-32"
    for bad, field, words in (
        ({"arms": ["rerun"], "bogus": 1}, "noise.bogus", "unknown field"),
        ({"arms": [{"name": "batch", "concurrency": 4}]}, "noise.arms[0]", "'concurrency' arm only"),
        ({"arms": ["sometimes"]}, "noise.arms[0].name", "rerun"),
        ({"arms": [{"name": "alone", "shard_size": 2}]}, "noise.arms[0]", "'batch' arm only"),
        ({"arms": ["rerun"], "quantile": 1.5}, "noise.quantile", "1"),
        ({"arms": ["rerun"], "k": 0}, "noise.k", "1"),
        ({"arms": []}, "noise.arms", "at least 1"),
        ({"arms": ["batch", "batch"]}, "noise", "twice"),
    ):
        with pytest.raises((ConfigError, ConfigProblems)) as info:
            load_params(_params(tmp_path, bad))
        err = info.value if isinstance(info.value, ConfigError) else info.value.problems[0]
        assert err.field == field and words in err.message and "params.yaml" in str(err), (bad, str(err))


# ------------------------------------------------------------------ the real engine

@pytest.mark.engine
def test_an_arm_that_flips_a_prompt_makes_the_same_flip_benign(alone_arm, tmp_path: Path) -> None:
    """near_tie_margin 0: no flip is benign by margin alone. The 'alone' arm (each prompt alone)
    flips the fixture prompts that the planted batch variance touches (tests/planted); a candidate
    that is the baseline with shard size 1 repeats those flips, and they are benign with
    golden/noise.json and not without it."""
    from conftest import run_cli

    # The arm, for real (conftest.alone_arm): `regress golden` with `noise: {arms: [alone]}`, the
    # baseline with each prompt alone, replayed against the golden.
    arm_root, result = alone_arm
    root = tmp_path / "ws"
    shutil.copytree(arm_root, root)  # this test moves noise.json aside; the arm's copy stays whole
    assert result.returncode == 0, result.stderr
    assert "noise arm 'alone'" in result.stdout and "noisy on the baseline itself" in result.stdout
    floor = NoiseFloor.model_validate_json(noise_path(root / "golden").read_text())
    assert floor.golden_run_id == json.loads((root / "golden/manifest.json").read_text())["run_id"]
    # The arm ran on the golden's engine, which cleared vLLM's prefix cache first: no second start,
    # and the flips below are the planted batch variance, not prompts read back from a cache.
    arm_facts = json.loads((root / "golden/noise-arms/alone/engine-info.json").read_text())
    assert arm_facts["reused"] == {"runs_before": 1, "cache_cleared": True}
    assert json.loads((root / "golden/noise-arms/alone/manifest.json").read_text())["timings"]["engine_loads"] == 0
    # The candidate: the baseline with shard size 1, the arm's only change (on this CPU a rerun of
    # the same layout is bit-identical, so its run is the arm's; replaying it again costs a minute).
    shutil.copytree(root / "golden/noise-arms/alone", root / "runs/alone")

    # Without noise.json: no flip is benign (near_tie_margin 0).
    noise_path(root / "golden").rename(root / "noise.json.aside")
    result = run_cli("score", "baseline", "--run", "runs/alone", "--out", "scores/plain", "--no-report", cwd=root)
    assert result.returncode in (0, 1), result.stderr
    plain = json.loads((root / "scores/plain/scores.json").read_text())
    flipped = {s["prompt_id"]: s for s in plain["scores"] if s["prompt_class"] != "identical"}
    assert flipped, "the 'alone' arm flipped no fixture prompt: the planted batch variance did not load"
    assert all(s["prompt_class"] != "benign" for s in flipped.values())
    assert {p.prompt_id for p in floor.noisy()} == set(flipped)
    assert floor.arms[0].diverged == len(flipped)

    # With it: the same flips are within their envelopes.
    (root / "noise.json.aside").rename(noise_path(root / "golden"))
    result = run_cli("score", "baseline", "--run", "runs/alone", "--out", "scores/noisy", "--no-report", cwd=root)
    assert result.returncode == 0, result.stderr + result.stdout
    noisy = {s["prompt_id"]: s for s in json.loads((root / "scores/noisy/scores.json").read_text())["scores"]}
    for pid in flipped:
        assert noisy[pid]["prompt_class"] == "benign", noisy[pid]["reasons"]
        assert "within its noise envelope" in noisy[pid]["reasons"][0] and "'alone'" in noisy[pid]["reasons"][0]
    metrics = json.loads((root / "scores/noisy/metrics.json").read_text())
    assert metrics["noise_floor"]["noisy_prompts"] == len(flipped) and metrics["noise_floor"]["arms"] == ["alone"]
