"""What a check costs against its replay: `regress check` beside a bare `LLM` script, in one run.

Run in a project whose pipeline has run (the demo after `./scripts/demo`: golden and runs/ in
place, environments cached). For each candidate, one after the other, nothing else running:

1. **bare**: the candidate's own environment runs a script that loads `vllm.LLM` with the engine
   arguments, dtype, model and environment variables the candidate's last run recorded (its
   manifest), and calls `llm.generate` on the same requests: the prompt token ids regress sent,
   the same sampling per request (seeds of sampled prompts included), in the golden's batches
   (shards). Timed: import + engine load, and the generate calls.
2. **full**: `regress check NAME --force`, wall time of the whole command (process start, engine
   load, generation, teacher forcing of the diverged prompts, choices, the baseline scoring the
   samples that differ, scoring, report), and the run's own phase times from its manifest.
3. **quick**: `regress check NAME --quick`, with the baseline's prefill reference already made
   (a quick check without `--force` runs first and makes it where it is missing or stale: timed apart), wall time.
4. **sampled quick** (with ``--quick-prompts N``): `regress check NAME --quick --quick-prompts N`,
   the screening sample of N prompts, its own reference made first likewise (timed apart).

Ratios: full / bare (targets: at most 1.15x when at least 90 % of outputs are identical to the
golden, 1.5x when they diverge), teacher forcing / the diverged prompts' share of generation
(target 0.5x), quick / full (target 0.4x). Speed is measured here, never asserted in tests.

Usage: python benchmarks/check_cost.py [--project DIR] [--candidates next,fp8-kv] [--quick-prompts 128]
Writes benchmarks/results/check_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BARE = r'''
import json, sys, time
if __name__ == "__main__":
    t0 = time.perf_counter()  # import + engine start, as regress's engine_load_s counts it
    import torch
    torch.cpu._init_amx()  # the AMX permission request regress makes (regress/engine/facts.py)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], **job["engine_args"])
    load_s = time.perf_counter() - t0
    keys = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "logprobs", "seed",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "ignore_eos")
    t0 = time.perf_counter()
    tokens = 0
    for shard in job["shards"]:
        prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in shard]
        params = [SamplingParams(**{k: r["sampling"][k] for k in keys if r["sampling"].get(k) is not None})
                  for r in shard]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"load_s": load_s, "generate_s": time.perf_counter() - t0, "tokens": tokens}))
'''


def _regress(project: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "regress.cli", *args], cwd=project, text=True, capture_output=True)
    return time.perf_counter() - started, done


def _bare(project: Path, name: str) -> dict:
    sys.path.insert(0, str(REPO))
    from regress.runs import load_run

    run = load_run(project / "runs" / name)
    m = run.manifest
    requests = [{"ids": run.prompt_token_ids(i).tolist(), "sampling": run.sampling[i]} for i in range(len(run))]
    size = m.layout.shard_size
    job = {"model": m.model.resolved_path or m.candidate.model, "engine_args": m.engine_args,
           "shards": [requests[s.start: s.start + s.count] for s in m.layout.shards]}
    python = Path(m.environment) / "bin" / "python" if m.environment else Path(sys.executable)
    env = {**os.environ, **{k: v for k, v in m.env_vars.items() if v != "***"}}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        (Path(tmp) / "bare.py").write_text(BARE)
        started = time.perf_counter()
        done = subprocess.run([str(python), str(Path(tmp) / "bare.py"), str(Path(tmp) / "job.json")], env=env,
                              text=True, capture_output=True)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"bare script failed for {name}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": round(wall, 2), "requests": len(requests), "shard_size": size}


def _phases(project: Path, where: str) -> dict:
    manifest = json.loads((project / where / "manifest.json").read_text())
    t = manifest["timings"]
    return {k: t.get(k) for k in ("engine_load_s", "generation_s", "teacher_forcing_s", "total_s", "output_tokens")} | {
        "prefilled": len(manifest.get("teacher_force_prefilled") or [])}


def _sampled_quick(project: Path, name: str, size: int, full_s: float) -> dict:
    first = None
    if not (project / f"quick/.baseline/sample-{size}/run/manifest.json").is_file():
        first, _ = _regress(project, "check", name, "--quick", "--quick-prompts", str(size))
    wall, done = _regress(project, "check", name, "--quick", "--quick-prompts", str(size), "--force")
    if done.returncode not in (0, 1):
        raise SystemExit(f"regress check {name} --quick --quick-prompts {size} could not run:\n{done.stderr[-3000:]}")
    metrics = json.loads((project / "quick" / name / "scores/metrics.json").read_text())
    return {"prompts": size, "wall_s": round(wall, 2), "over_full": round(wall / full_s, 3),
            "verdict": metrics["verdict"], "phases": _phases(project, f"quick/{name}/run"),
            "first_wall_s": round(first, 2) if first is not None else None}


def measure(project: Path, name: str, sample: int | None = None) -> dict:
    bare = _bare(project, name)
    full_s, done = _regress(project, "check", name, "--force")
    if done.returncode not in (0, 1):
        raise SystemExit(f"regress check {name} could not run:\n{done.stderr[-3000:]}")
    metrics = json.loads((project / "scores" / name / "metrics.json").read_text())
    phases = _phases(project, f"runs/{name}")
    # A quick check without --force first, every time: it makes the baseline's prefill reference
    # where it is missing or stale (a plan of another regress), and reuses it, in seconds, where
    # it is current. So the timed --force check below never includes the reference.
    first_quick, _ = _regress(project, "check", name, "--quick")
    quick_s, quick = _regress(project, "check", name, "--quick", "--force")
    if quick.returncode not in (0, 1):
        raise SystemExit(f"regress check {name} --quick could not run:\n{quick.stderr[-3000:]}")
    quick_metrics = json.loads((project / "quick" / name / "scores/metrics.json").read_text())
    bare_s = bare["load_s"] + bare["generate_s"]
    diverged = metrics["prompts"] - metrics["identical"]
    return {
        "candidate": name, "bare": bare, "full_wall_s": round(full_s, 2), "full_phases": phases,
        "full_over_bare": round(full_s / bare_s, 3),
        "identical_share": round(metrics["identical"] / metrics["prompts"], 3), "diverged": diverged,
        "verdict": metrics["verdict"], "quality_verdict": metrics.get("quality_verdict"), "gate": metrics.get("gate"),
        "teacher_forcing_over_generation": round(phases["teacher_forcing_s"] / phases["generation_s"], 3),
        "quick_wall_s": round(quick_s, 2), "quick_phases": _phases(project, f"quick/{name}/run"),
        "quick_over_full": round(quick_s / full_s, 3), "quick_verdict": quick_metrics["verdict"],
        "first_quick_wall_s": round(first_quick, 2) if first_quick is not None else None,
        "sampled_quick": _sampled_quick(project, name, sample, full_s) if sample else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=REPO)
    parser.add_argument("--candidates", default="next,fp8-kv")
    parser.add_argument("--quick-prompts", type=int, default=None, help="Also time a quick check of this sample size.")
    args = parser.parse_args()
    rows = []
    for name in args.candidates.split(","):
        row = measure(args.project.resolve(), name, args.quick_prompts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    load = os.getloadavg()[0]
    out = REPO / "benchmarks/results/check_cost.json"
    out.write_text(json.dumps({"rows": rows, "load_avg_after": load, "cpus": os.cpu_count(),
                               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
