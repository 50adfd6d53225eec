"""What teacher forcing costs, and what cuts it: one engine, the prompts a replay prefilled again.

Run in a project whose pipeline has run (the demo after `./scripts/demo`). For a candidate, its
run's manifest names the entries teacher forcing prefilled (`teacher_force_prefilled`: those
whose output diverged from the golden's); the candidate's own environment loads its engine once
(the engine arguments, model and variables its run recorded, prefix caching off) and times, on
those sequences
(prompt + the golden's completion), one after the other:

- `shards`: what regress does, one `generate` per shard of the golden's shard size,
  `prompt_logprobs=k` (top-k at every position, prompt positions included), one new token;
- `one batch`: the same in a single `generate` call;
- `chosen only`: `prompt_logprobs=0` (each position's own token only, no top-k);
- `prefill only`: no `prompt_logprobs` at all: the prefill and one token, the floor any
  teacher forcing stands on;
- `generation`: the same prompts generated as the run did (greedy, its max_tokens, top-k logprobs).

Usage: python benchmarks/teacher_forcing_cost.py [--project DIR] [--candidate w4a16]
Writes benchmarks/results/teacher_forcing_cost.json.
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

ENGINE = r'''
import json, sys, time
if __name__ == "__main__":
    import torch
    torch.cpu._init_amx()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(open(sys.argv[1]))
    # No prefix cache: every variant computes its sequences in full. (vLLM never looks a request
    # with prompt_logprobs up in the prefix cache anyway: vllm/v1/core/kv_cache_manager.py,
    # get_computed_blocks; without this the prefill-only variant would hit the earlier ones' cache.)
    llm = LLM(model=job["model"], **{**job["engine_args"], "enable_prefix_caching": False})
    seqs, size, k = job["sequences"], job["shard_size"], job["k"]
    def run(prompts, params, chunk):
        t0 = time.perf_counter()
        for i in range(0, len(prompts), chunk):
            llm.generate(prompts[i:i + chunk], params, use_tqdm=False)
        return round(time.perf_counter() - t0, 3)
    full = [TokensPrompt(prompt_token_ids=p + c) for p, c in seqs]
    base = dict(temperature=0.0, max_tokens=1, detokenize=False)
    try:  # the flat logprobs container, as regress asks for it where the release has it
        SamplingParams(flat_logprobs=True)
        base["flat_logprobs"] = True
    except TypeError:
        pass
    out = {"warm_up_s": run(full[:size], SamplingParams(**base, prompt_logprobs=k), size)}
    out["shards_s"] = run(full, SamplingParams(**base, prompt_logprobs=k), size)
    out["one_batch_s"] = run(full, SamplingParams(**base, prompt_logprobs=k), len(full))
    out["chosen_only_s"] = run(full, SamplingParams(**base, prompt_logprobs=0), size)
    out["prefill_only_s"] = run(full, SamplingParams(**base), size)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in seqs]
    flat = {"flat_logprobs": True} if base.get("flat_logprobs") else {}
    gen = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=k, **flat) for m in job["max_tokens"]]
    t0 = time.perf_counter()
    for i in range(0, len(prompts), size):
        llm.generate(prompts[i:i + size], gen[i:i + size], use_tqdm=False)
    out["generation_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(out))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=REPO)
    parser.add_argument("--candidate", default="w4a16")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from regress.runs import load_run

    project = args.project.resolve()
    run = load_run(project / "runs" / args.candidate)
    golden = load_run(project / "golden")
    m = run.manifest
    chosen = [e for e in (m.teacher_force_prefilled or []) if e in golden]
    seqs = [[golden.prompt_token_ids(golden.position(e)).tolist(), golden.output_token_ids(golden.position(e)).tolist()]
            for e in chosen]
    job = {"model": m.model.resolved_path or m.candidate.model, "engine_args": m.engine_args, "sequences": seqs,
           "shard_size": m.layout.shard_size, "k": max(int(run.sampling[0].get("logprobs") or 5), 1),
           "max_tokens": [int(run.sampling[run.position(e)]["max_tokens"]) for e in chosen]}
    python = Path(m.environment) / "bin" / "python" if m.environment else Path(sys.executable)
    env = {**os.environ, **{k: v for k, v in m.env_vars.items() if v != "***"}}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        (Path(tmp) / "engine.py").write_text(ENGINE)
        done = subprocess.run([str(python), str(Path(tmp) / "engine.py"), str(Path(tmp) / "job.json")], env=env,
                              text=True, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    row = {"candidate": args.candidate, "sequences": len(seqs),
           "prompt_tokens": sum(len(p) for p, _ in seqs), "completion_tokens": sum(len(c) for _, c in seqs),
           "regress_teacher_forcing_s": m.timings.teacher_forcing_s, "regress_generation_s": m.timings.generation_s,
           **result, "load_avg": os.getloadavg()[0],
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(row, indent=1))
    out = REPO / "benchmarks/results/teacher_forcing_cost.json"
    rows = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps([r for r in rows if r.get("candidate") != args.candidate] + [row], indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
