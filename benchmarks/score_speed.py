"""Scoring speed: 10,000 prompts x 128 generated tokens x top-5 logprobs on this machine.

Builds a synthetic golden and two candidate runs in the real storage format (random float32
logprobs, vocabulary 32,000; 30 % of prompts identical, the rest diverging at a random
position, teacher-forced tracks present; texts of --words random words, all distinct), then
times `score_runs`:

1. without the semantic metric;
2. with it, cold: every diverged text embedded (all-MiniLM-L6-v2 on the CPU, by the default
   backend: ONNX + OpenVINO; ``REGRESS_SEMANTIC_BACKEND=torch`` for sentence-transformers);
3. a second candidate against the same golden: the golden's texts come from the embedding
   cache, only the candidate's are embedded;
4. the first candidate re-scored (a threshold changed): everything from the cache.

Usage: python benchmarks/score_speed.py [--prompts 10000] [--tokens 128] [--words 90]
Writes benchmarks/results/score_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from regress.records import (CandidateSpec, DatasetRef, Hardware, Memory, ModelInfo, ResolvedSampling, RunManifest,
                             Timings, Versions, GoldenRef)
from regress.replay import plan_layout
from regress.runs import load_run, shard_file, write_manifest
from regress.storage import ragged, write_shard

REPO = Path(__file__).resolve().parent.parent
WORDS = ("river stone garden window kettle morning harbour lantern meadow orchard violin ladder "
         "pepper tunnel candle mirror saddle thunder biscuit compass").split()


def _rows(rng, n, k):
    top1 = -rng.exponential(0.3, n)
    top = np.concatenate([top1[:, None], top1[:, None] - np.cumsum(rng.exponential(0.8, (n, k - 1)), axis=1)], axis=1)
    return top.astype(np.float32), rng.integers(0, 32000, (n, k)).astype(np.int32)


TEXT_WORDS = 90  # about what 128 generated tokens of English come to
IDENTICAL_SHARE = 0.3


def _text(rng, n_words=None):
    return " ".join(rng.choice(WORDS, n_words or TEXT_WORDS))


def make_run(path: Path, kind: str, prompts: int, tokens: int, k: int, golden=None, seed=0, shard=1000) -> None:
    rng = np.random.default_rng(seed)
    ids = [f"p{i:05d}" for i in range(prompts)]
    layout = plan_layout(ids, shard)
    for s in layout.shards:
        n = s.count * tokens
        top_lp, top_ids = _rows(rng, n, k)
        out = rng.integers(0, 32000, (s.count, tokens)).astype(np.int32)
        texts = [_text(rng) for _ in range(s.count)]
        if golden is not None:
            g_out = golden["out"][s.start:s.start + s.count]
            same = rng.random(s.count) < IDENTICAL_SHARE
            div = rng.integers(0, tokens, s.count)
            for i in range(s.count):
                out[i, :div[i]] = g_out[i, :div[i]]
                if same[i]:
                    out[i] = g_out[i]
                    texts[i] = golden["texts"][s.start + i]
        top_ids[:, 0] = out.reshape(-1)
        arrays = {
            "prompt_tokens": np.tile(np.arange(12, dtype=np.int32), s.count), "prompt_offsets": np.arange(0, 12 * s.count + 1, 12, dtype=np.int64),
            "output_tokens": out.reshape(-1), "output_offsets": np.arange(0, n + 1, tokens, dtype=np.int64),
            "out_token_logprobs": top_lp[:, 0].copy(), "out_top_ids": top_ids, "out_top_logprobs": top_lp,
        }
        if golden is not None:
            tf_lp, tf_ids = _rows(rng, n, k)
            g_out_flat = golden["out"][s.start:s.start + s.count].reshape(-1)
            tf_ids[:, 0] = g_out_flat
            arrays.update(tf_tokens=g_out_flat, tf_offsets=arrays["output_offsets"], tf_token_logprobs=tf_lp[:, 0].copy(),
                          tf_top_ids=tf_ids, tf_top_logprobs=tf_lp)
        meta = {"prompt_ids": ids[s.start:s.start + s.count], "texts": texts, "finish_reasons": ["length"] * s.count,
                "sampling": [ResolvedSampling(max_tokens=tokens).model_dump()] * s.count, "generation_s": 1.0,
                "teacher_forcing_s": 0.0, "prompt_tokens": 12 * s.count, "output_tokens": n}
        write_shard(shard_file(path, s.index), meta, arrays)
        if golden is None:
            store = _GOLDEN.setdefault(str(path), {"out": [], "texts": []})
            store["out"].append(out)
            store["texts"].extend(texts)
    manifest = RunManifest(
        run_id=f"{kind}-run", kind=kind, candidate=CandidateSpec(name=kind, model="synthetic"),
        dataset=DatasetRef(name="synthetic", path="-", sha256="0", prompts=prompts),
        golden=GoldenRef(run_id="golden-run", path="-", candidate="golden") if golden is not None else None,
        layout=layout, versions=Versions(python="3", regress="0"), model=ModelInfo(model="synthetic"),
        hardware=Hardware(platform="x"), env_vars={}, engine_args={}, teacher_forced=golden is not None,
        timings=Timings(engine_load_s=1, generation_s=1, total_s=2, prompt_tokens=1, output_tokens=1, tokens_per_s=1),
        memory=Memory(),
    )
    write_manifest(path, manifest)


_GOLDEN: dict = {}


def main() -> None:
    global TEXT_WORDS, IDENTICAL_SHARE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--words", type=int, default=TEXT_WORDS)
    parser.add_argument("--identical", type=float, default=IDENTICAL_SHARE,
                        help="share of candidate prompts identical to the golden (noise-like candidates: 0.7-0.95)")
    args = parser.parse_args()
    TEXT_WORDS, IDENTICAL_SHARE = args.words, args.identical
    from regress.metrics.embedder import resolve_backend
    from regress.scoring import build_metrics, score_runs
    from regress.verdict import Thresholds

    with tempfile.TemporaryDirectory() as tmp:
        g_path, c_path, c2_path = Path(tmp) / "golden", Path(tmp) / "cand", Path(tmp) / "cand2"
        make_run(g_path, "golden", args.prompts, args.tokens, 5, seed=1)
        state = _GOLDEN[str(g_path)]
        golden_state = {"out": np.concatenate(state["out"]), "texts": state["texts"]}
        make_run(c_path, "replay", args.prompts, args.tokens, 5, golden=golden_state, seed=2)
        make_run(c2_path, "replay", args.prompts, args.tokens, 5, golden=golden_state, seed=3)
        sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*")) for p in (g_path, c_path)}
        t0 = time.perf_counter()
        golden, run, run2 = load_run(g_path), load_run(c_path), load_run(c2_path)
        load_s = time.perf_counter() - t0
        cache = Path(tmp) / "cache"
        plain = Thresholds(metrics=["exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced", "surface"])
        full = Thresholds()
        results = {}

        def timed(label, t, candidate, **kw):
            metrics = build_metrics(t, **kw)
            t0 = time.perf_counter()
            report = score_runs(golden, candidate, t, metrics=metrics)
            results[label] = {"seconds": round(time.perf_counter() - t0, 2), "identical": report.metrics.identical,
                              "prompts": report.metrics.prompts}
            print(label, results[label], flush=True)

        timed("without_semantic", plain, run)
        timed("semantic_cold", full, run, cache_dir=cache)
        timed("semantic_second_candidate_golden_cached", full, run2, cache_dir=cache)
        timed("semantic_rescore_all_cached", full, run, cache_dir=cache)
    summary = {"prompts": args.prompts, "tokens": args.tokens, "words_per_text": args.words, "top_k": 5,
               "identical_share": args.identical,
               "cpu_count": os.cpu_count(), "semantic_precision": full.semantic_precision,
               "semantic_backend": resolve_backend("auto", full.semantic_model)[0],
               "load_runs_s": round(load_s, 2), "run_sizes_bytes": sizes, **results}
    out = REPO / "benchmarks" / "results" / f"score_speed_identical{args.identical}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
