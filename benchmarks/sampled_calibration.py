"""Sampled prompts on the real model: a reseeded baseline against a hotter and a narrower sampler.

Builds a workspace with the first N chat questions of the demo set, each with ``samples: 8`` at
temperature 0.8 (32 tokens), runs the golden and three candidates with the `regress` command
(reseeded with ``seed: 1``, temperature 1.3, top_p 0.5), scores them and prints per candidate the
range of per-prompt logprob shifts, Mann-Whitney p-values and semantic gaps, the classes and the
verdict; the raw numbers go to benchmarks/results/sampled_calibration.json. docs/verdicts.md
("Sampled prompts") quotes them.

    .venv/bin/python benchmarks/sampled_calibration.py [--model models/smollm2-135m-instruct] [--prompts 24]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = {"reseeded": {"sampling": {"temperature": 0.8, "seed": 1}},
              "temperature-1_3": {"sampling": {"temperature": 1.3}},
              "top-p-0_5": {"sampling": {"temperature": 0.8, "top_p": 0.5}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="regress-sampled-"))
    demo = [json.loads(line) for line in (ROOT / "regress/data/prompts/demo.jsonl").read_text().splitlines() if line]
    rows = [{**{k: v for k, v in r.items() if k != "sampling"}, "samples": args.samples}
            for r in demo if r["id"].startswith("qa-")][: args.prompts]
    (work / "datasets").mkdir()
    (work / "datasets/s.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (work / "datasets/s.yaml").write_text("defaults: {max_tokens: 32, logprobs: 5}\n")
    params = {"dataset": "datasets/s.jsonl", "shard_size": 64,
              "baseline": {"name": "baseline", "package": "current", "model": str(Path(args.model).resolve()),
                           "dtype": "bfloat16", "engine_args": {"enforce_eager": True, "max_model_len": 4096},
                           "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "sampling": {"temperature": 0.8}},
              "candidates": CANDIDATES}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    def regress(*argv: str) -> int:
        return subprocess.run([sys.executable, "-m", "regress.cli", *argv], cwd=work).returncode

    assert regress("golden") == 0
    results = {}
    for name in CANDIDATES:
        code = regress("check", name)
        scored = json.loads((work / "scores" / name / "scores.json").read_text())
        values = [s["metrics"] for s in scored["scores"]]

        def span(key: str) -> list[float]:
            found = [v[key] for v in values if isinstance(v.get(key), (int, float))]
            return [min(found), max(found)] if found else []

        m = scored["metrics"]
        results[name] = {"exit_code": code, "verdict": m["verdict"],
                         "classes": {k: m[k] for k in ("identical", "benign", "drift", "regression")},
                         "shift": span("sample_logprob_shift"), "p": span("sample_logprob_p"),
                         "semantic_gap": span("sample_semantic_gap"), "reasons": scored["verdict_reasons"]}
        print(name, json.dumps(results[name]))
    out = ROOT / "benchmarks/results/sampled_calibration.json"
    out.write_text(json.dumps({"model": args.model, "prompts": len(rows), "samples": args.samples,
                               "temperature": 0.8, "max_tokens": 32, "results": results}, indent=1))
    print(f"written: {out} (workspace {work})")


if __name__ == "__main__":
    main()
