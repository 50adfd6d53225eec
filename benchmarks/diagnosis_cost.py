"""What a diagnosis costs, and what it finds, on the demo's real model (SmolLM2-135M-Instruct).

For each candidate: replay and score it against the golden (`regress check`, reused when up to
date), then `regress diagnose` it with the default probes on its 10 worst drifted prompts, timed.
Prints and writes (benchmarks/results/diagnosis_cost.json) per candidate: engine loads, seconds,
each probe's loads and seconds (or why it was skipped), causes per prompt, and the candidate
replay's own engine load time for scale. docs/benchmarks.md ("Diagnosis") quotes it.

Run it in a checkout where `./scripts/demo` (or `dvc repro`) has made models/ and golden/:

    .venv/bin/python benchmarks/diagnosis_cost.py [--candidates fp8-kv,w8a8,w4a16] [--max-prompts 10]

Nothing else should run on the machine meanwhile: on 2 cores another busy process makes engine
starts and generation several times slower.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def regress(*argv: str) -> int:
    return subprocess.run([sys.executable, "-m", "regress.cli", *argv], cwd=ROOT).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidates", default="fp8-kv,w8a8,w4a16")
    ap.add_argument("--max-prompts", type=int, default=10)
    ap.add_argument("--probes", default="auto")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "diagnosis_cost.json"))
    args = ap.parse_args()
    results = {}
    for name in args.candidates.split(","):
        code = regress("check", name)
        if code not in (0, 1):
            raise SystemExit(f"regress check {name} exited {code}")
        started = time.monotonic()
        code = regress("diagnose", name, "--max-prompts", str(args.max_prompts), "--probes", args.probes, "--force")
        wall = time.monotonic() - started
        if code != 0:
            raise SystemExit(f"regress diagnose {name} exited {code}")
        d = json.loads((ROOT / "scores" / name / "diagnosis.json").read_text())
        run = json.loads((ROOT / "runs" / name / "manifest.json").read_text())
        ran = [p for p in d["probes"] if not p["skipped"]]
        results[name] = {
            "wall_s": round(wall, 1),
            "diagnosis_s": d["seconds"],
            "engine_loads": d["engine_loads"],
            "probes_run": len(ran),
            "candidate_engine_load_s": run["timings"]["engine_load_s"],
            "prompts": len(d["prompts"]),
            "drifted": d["drifted"],
            "by_cause": d["by_cause"],
            "explained": sum(1 for p in d["prompts"] if p["explained"]),
            "probes": [{"name": p["name"], "side": p["side"], "engine_loads": p["engine_loads"],
                        "seconds": p["seconds"], "skipped": p["skipped"]} for p in d["probes"]],
            "causes": {p["prompt_id"]: p["causes"] for p in d["prompts"]},
            "differences": [f"{x['source']}: {x['setting']}" for x in d["differences"]],
        }
        r = results[name]
        print(f"{name}: {r['prompts']} of {r['drifted']} drifted prompts, {r['probes_run']} probes, "
              f"{r['engine_loads']} engine loads, {r['diagnosis_s']:.0f} s (one engine load of the candidate: "
              f"{r['candidate_engine_load_s']:.1f} s); causes {r['by_cause']}, {r['explained']} explained by a probe")
        for p in r["probes"]:
            print(f"  {p['name']:>20} {p['side']:>9}  loads {p['engine_loads']}  {p['seconds']:6.1f} s"
                  + (f"  skipped: {p['skipped']}" if p["skipped"] else ""))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
