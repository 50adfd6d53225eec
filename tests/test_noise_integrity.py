"""golden/noise.json widens thresholds, so it is used only as `regress noise` wrote it for this golden:
its sha256 recorded in the golden's manifest and checked on every read; a foreign, changed or
unrecorded file is an error naming it (exit 2), never applied; no number in it may be NaN or infinite."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import run_cli
from regress.errors import EXIT_INPUT, NoiseFloorError
from regress.noise.floor import (KL, SAME, NoiseArmResult, NoiseFloor, PromptNoise, build_floor, load_floor,
                                 noise_path, prompt_thresholds, write_floor)
from regress.runs import read_manifest
from report_fixtures import build_case, build_scored_project


def _arm(scored) -> NoiseArmResult:  # type: ignore[no-untyped-def]
    m = scored.metrics
    return NoiseArmResult(name="alone", kind="alone", changed="each prompt alone", shard_size=1,
                          run_id=scored.run.run_id, prompts=m.prompts, identical=m.identical,
                          diverged=m.prompts - m.identical)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    return build_case(tmp_path_factory.mktemp("noise-integrity"), prompts=10, tokens=16, semantic=False)


@pytest.fixture
def golden(case, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the case's golden with its noise floor written by regress."""
    target = tmp_path / "golden"
    shutil.copytree(case.golden.path, target)
    write_floor(build_floor(case.golden.manifest.run_id, [(_arm(case.score), case.score)], k=2, q=0.95), target)
    return target


def test_the_digest_is_recorded_where_the_golden_lives_and_checked(golden: Path, case) -> None:  # type: ignore[no-untyped-def]
    run_id = case.golden.manifest.run_id
    digest = hashlib.sha256(noise_path(golden).read_bytes()).hexdigest()
    manifest = read_manifest(golden)
    assert manifest.noise_sha256 == digest and manifest.run_id == run_id
    assert manifest.shard_files == case.golden.manifest.shard_files  # the run itself is untouched
    floor = load_floor(golden, run_id)
    assert floor is not None and floor.golden_run_id == run_id


def test_a_changed_noise_json_is_refused_naming_the_file(golden: Path, case) -> None:  # type: ignore[no-untyped-def]
    path = noise_path(golden)
    data = json.loads(path.read_text())
    data["k"] = 1000.0  # a wider floor: every bound x 1000
    path.write_text(json.dumps(data, indent=1))
    with pytest.raises(NoiseFloorError, match=rf"{path}: changed since `regress noise` wrote it") as caught:
        load_floor(golden, case.golden.manifest.run_id)
    assert caught.value.exit_code == EXIT_INPUT
    # Whitespace alone is a change too: the bytes are what was recorded.
    path.write_text(path.read_text() + "\n")
    with pytest.raises(NoiseFloorError):
        load_floor(golden, case.golden.manifest.run_id)


def test_a_foreign_noise_json_is_refused_not_ignored(golden: Path, case, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Another golden's floor, written by regress there and copied in here.
    other = tmp_path / "other"
    shutil.copytree(case.golden.path, other)
    manifest = read_manifest(other)
    (other / "manifest.json").write_text(manifest.model_copy(update={"run_id": "another-golden"}).model_dump_json())
    write_floor(build_floor("another-golden", [(_arm(case.score), case.score)], k=50, q=0.95), other)
    shutil.copy(noise_path(other), noise_path(golden))
    with pytest.raises(NoiseFloorError, match=r"measured against golden another-golden, but the golden is golden-run"):
        load_floor(golden, case.golden.manifest.run_id)
    # A floor no manifest records (copied into a golden that never measured one).
    fresh = tmp_path / "fresh"
    shutil.copytree(case.golden.path, fresh)
    shutil.copy(noise_path(golden), noise_path(fresh))
    (noise_path(fresh)).write_text(noise_path(golden).read_text().replace("another-golden", "golden-run"))
    with pytest.raises(NoiseFloorError, match="not recorded in the golden's manifest.json"):
        load_floor(fresh, case.golden.manifest.run_id)


def test_no_noise_json_means_no_floor_and_a_recorded_one_gone_is_a_warning(golden: Path, case, capsys) -> None:  # type: ignore[no-untyped-def]
    noise_path(golden).unlink()
    assert load_floor(golden, case.golden.manifest.run_id) is None
    assert "is missing although the golden's manifest.json records a noise floor" in capsys.readouterr().err
    assert load_floor(golden.parent / "nothing", "golden-run") is None


def test_a_floor_holds_finite_numbers_only(case) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError):
        NoiseFloor(golden_run_id="g", k=2, quantile=0.95, arms=[], floor={KL: float("inf")}, prompts=[])
    with pytest.raises(ValidationError):
        PromptNoise(prompt_id="p", flipped=True, tf_kl_mean=float("nan"))
    # An arm whose measure is not a number widens nothing: the envelope leaves it out.
    scored = case.score
    broken = scored.model_copy(update={"scores": [s.model_copy(update={
        "prompt_class": "regression", "metrics": {**s.metrics, "tf_kl_mean": float("inf"), "tf_same_top1_rate": float("nan")}})
        for s in scored.scores]})
    floor = build_floor("g", [(_arm(broken), broken)], k=2, q=0.95)
    assert all(p.tf_kl_mean is None and p.tf_same_top1_rate is None for p in floor.prompts)
    assert floor.floor[KL] is None and floor.floor[SAME] is None
    from regress.verdict import Thresholds

    t = prompt_thresholds(Thresholds(), floor.prompts[0], floor.k)
    assert t.benign_kl == Thresholds().benign_kl


def test_regress_score_with_a_changed_noise_json_exits_2_naming_it(tmp_path: Path) -> None:
    project = build_scored_project(tmp_path / "p")
    golden = project / "golden"
    from regress.runs import load_run
    from regress.scoring import build_metrics, score_runs
    from regress.verdict import Thresholds
    from report_fixtures import NO_SEMANTIC

    t = Thresholds(metrics=NO_SEMANTIC)
    scored = score_runs(load_run(golden), load_run(project / "runs" / "candidate"), t, metrics=build_metrics(t))
    write_floor(build_floor(read_manifest(golden).run_id, [(_arm(scored), scored)], k=2, q=0.95), golden)
    env = {"REGRESS_HOME": str(project / "home")}
    params = project / "params.yaml"
    params.write_text(params.read_text() + "thresholds: {metrics: [exact_tokens, divergence_point, teacher_forced]}\n")
    ok = run_cli("score", "candidate", "--no-report", cwd=project, env=env)
    assert ok.returncode in (0, 1), ok.stderr
    assert json.loads((project / "scores" / "candidate" / "metrics.json").read_text())["noise_floor"]["arms"] == ["alone"]
    path = noise_path(golden)
    path.write_text(path.read_text().replace('"k": 2.0', '"k": 9.0'))
    bad = run_cli("score", "candidate", "--no-report", cwd=project, env=env)
    assert bad.returncode == EXIT_INPUT, bad.stderr
    assert "noise.json: changed since `regress noise` wrote it" in bad.stderr and "Traceback" not in bad.stderr
