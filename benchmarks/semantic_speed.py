"""Semantic scoring speed: every embedding option on the same texts, interleaved, plus the
10,000-prompt scoring time of today's path and of the default.

Part 1, texts per second and agreement. Options, all built in this one process:

- ``torch_bf16``: sentence-transformers, bfloat16 on AMX, batch 128 (the path before the ONNX
  export; still the fallback);
- ``torch_fp32``: the same in float32 (the reference for accuracy);
- ``ort_fp32``: the ONNX export run by onnxruntime on 2 threads (batches of 32, length-sorted);
- ``ort_int8``: the ONNX export fused by onnxruntime's transformer optimizer and quantized with
  onnxruntime's dynamic quantization (int8 weights per channel, uint8 activations);
- ``ort_int8_attention``: the same with the feed-forward MatMuls left in float32;
- ``openvino_bf16``: the ONNX export run by OpenVINO, bfloat16, throughput mode (one inference
  request per stream, batches of 32, texts sorted by length): the default now;
- ``openvino_bf16_b16`` / ``_b64``: the same with batches of 16 / 64;
- ``openvino_bf16_unsorted``: the same without sorting by length;
- ``openvino_bf16_latency``: OpenVINO's latency mode (one request on both cores).

Timing: the texts are cut into chunks of 128 and, chunk by chunk, every option embeds the chunk
(A, B, C, ..., A, B, C, ...), for ``--rounds`` rounds; texts/s is the median over chunks, so a
burst of load from other processes hits every option alike. CPU ms/text is this process's CPU
time per text (robust to load, but it counts spinning threads). Text sets: ``synthetic``
(score_speed.py's texts: 90 random words of 20, about 100 tokens) and ``real`` (every distinct
output text of the runs under golden/ and runs/*/ plus the prompts of datasets/prompts/).

Agreement: cosines of pairs (synthetic: independent texts, as score_speed.py's diverged outputs;
real: golden vs candidate where they differ, and shuffled pairs for low cosines; varied: English,
Chinese, code, mixed, long texts, all pairs), max |Δcosine| against ``torch_bf16`` and
``torch_fp32``.

Part 2, scoring (``--score-prompts``, 0 to skip): score_speed.py's synthetic 10,000-prompt runs
(70 % diverged) scored with ``REGRESS_SEMANTIC_BACKEND=torch`` and ``=openvino``, alternating,
each with a fresh embedding cache: cold, a second candidate (golden cached), a re-score (all
cached). The ONNX file is built before (its one-time build is timed apart, into a temporary
directory). Load: other processes' CPU use in cores, from /proc/stat minus this process's own
CPU time, for every timed part.

Usage: python benchmarks/semantic_speed.py [--texts 1024] [--rounds 3] [--score-prompts 10000]
       [--score-repeats 2] [--scoring-only] [--out FILE]
Writes benchmarks/results/semantic_speed.json (or --out). About 25 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from regress.metrics import embedder as E  # noqa: E402

# Prose, paraphrases, Chinese, code, numbers, very short and past-256-token texts (shared with the test).
VARIED = json.loads((REPO / "tests" / "data" / "varied_texts.json").read_text(encoding="utf-8"))["texts"]


# --- load: other processes' CPU use while something runs ---


def _busy_s() -> float:
    with open("/proc/stat") as fh:
        parts = [float(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Load:
    """Others' CPU use (cores) and the 1-minute load average over a with-block."""

    def __enter__(self) -> "Load":
        self.t, self.busy, self.own, self.avg0 = time.perf_counter(), _busy_s(), _own_cpu_s(), os.getloadavg()[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self.t
        self.wall = wall
        self.others_cores = max(0.0, (_busy_s() - self.busy - (_own_cpu_s() - self.own)) / wall)
        self.loadavg = (self.avg0, os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        return {"others_cores": round(self.others_cores, 2), "loadavg_1m": [round(x, 2) for x in self.loadavg]}


# --- the options ---


class Batched:
    """Tokenize (the model's tokenizer.json, same truncation), sort by length, batch, run."""

    def __init__(self, run: Callable[[dict[str, np.ndarray]], np.ndarray], batch_size: int = 32):
        self.tokenizer = E.load_tokenizer(E.default_model_path())
        self.run, self.batch_size = run, batch_size

    def __call__(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), 384), np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for i in range(0, len(order), self.batch_size):
            rows = order[i : i + self.batch_size]
            out[rows] = self.run(E.token_feeds(self.tokenizer, [texts[j] for j in rows]))
        return out


def ort_session(data: bytes) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def build_int8(data: bytes, tmp: Path, exclude_ffn: bool) -> tuple[bytes, float]:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    t0 = time.perf_counter()
    src, fused, out = tmp / "m.onnx", tmp / "fused.onnx", tmp / f"int8-{exclude_ffn}.onnx"
    src.write_bytes(data)
    if not fused.exists():
        optimize_model(str(src), model_type="bert", num_heads=12, hidden_size=384, opt_level=1).save_model_to_file(str(fused))
    names = [n.name for n in onnx.load(str(fused)).graph.node]
    exclude = [n for n in names if n.endswith("dense/MatMul") and "attention" not in n] if exclude_ffn else []
    quantize_dynamic(str(fused), str(out), weight_type=QuantType.QInt8, per_channel=True, nodes_to_exclude=exclude,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return out.read_bytes(), time.perf_counter() - t0


def build_options(tmp: Path) -> tuple[dict[str, Callable[[list[str]], np.ndarray]], dict[str, Any]]:
    import openvino as ov

    info: dict[str, Any] = {}
    opts: dict[str, Callable[[list[str]], np.ndarray]] = {}
    opts["torch_bf16"] = E._torch_encode(None, "bfloat16", 128, "cpu")
    opts["torch_fp32"] = E._torch_encode(None, "float32", 128, "cpu")
    data = E.cached_onnx(E.default_model_path())
    try:
        import onnxruntime  # noqa: F401  (only this benchmark uses it)
    except ImportError:
        print("onnxruntime is not installed: its options are skipped (pip install onnxruntime)", flush=True)
    else:
        sess = ort_session(data)
        opts["ort_fp32"] = Batched(lambda f: sess.run(None, f)[0])
        for name, exclude in (("ort_int8", False), ("ort_int8_attention", True)):
            q, secs = build_int8(data, tmp, exclude)
            info[f"{name}_build_s"] = round(secs, 1)
            info[f"{name}_bytes"] = len(q)
            opts[name] = (lambda s: Batched(lambda f: s.run(None, f)[0]))(ort_session(q))
    path = E.default_model_path()
    opts["openvino_bf16"] = E.OpenVinoEncoder(path, "bfloat16").encode
    opts["openvino_bf16_b16"] = E.OpenVinoEncoder(path, "bfloat16", batch_size=16).encode
    opts["openvino_bf16_b64"] = E.OpenVinoEncoder(path, "bfloat16", batch_size=64).encode
    opts["openvino_bf16_unsorted"] = E.OpenVinoEncoder(path, "bfloat16", sort_by_length=False).encode
    core = ov.Core()
    latency = core.compile_model(core.read_model(__import__("io").BytesIO(data)), "CPU",
                                 {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "bf16"})
    req = latency.create_infer_request()
    opts["openvino_bf16_latency"] = Batched(lambda f: req.infer(f)[0])
    info["openvino_streams"] = int(E.OpenVinoEncoder(path, "bfloat16").compiled.get_property("NUM_STREAMS"))
    return opts, info


# --- texts ---


def synthetic_texts(n: int, seed: int = 0) -> list[str]:
    from score_speed import TEXT_WORDS, WORDS

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, TEXT_WORDS)) for _ in range(n)]


def real_runs() -> list[tuple[str, list[str]]]:
    from regress.runs import load_run

    found = []
    for path in [REPO / "golden", *sorted((REPO / "runs").glob("*"))]:
        if path.is_dir() and not path.name.endswith(".partial"):
            try:
                found.append((path.name, list(load_run(path).texts)))
            except Exception:  # an unfinished or foreign directory
                pass
    return found


def prompt_texts() -> list[str]:
    texts = []
    for f in sorted((REPO / "datasets" / "prompts").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                p = json.loads(line)
                texts.append(p.get("prompt") or "\n".join(m["content"] for m in p.get("messages", [])))
    return texts


def pair_sets(synthetic: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    sets = {"synthetic": (synthetic[0::2], synthetic[1::2])}
    runs = real_runs()
    golden = dict(runs).get("golden")
    a, b = [], []
    if golden:
        for name, texts in runs:
            if name != "golden" and len(texts) == len(golden):
                for g, c in zip(golden, texts):
                    if g != c:
                        a.append(g)
                        b.append(c)
        sets["real_golden_vs_candidate"] = (a, b)
        perm = np.random.default_rng(1).permutation(len(golden))
        sets["real_shuffled"] = (list(golden), [golden[i] for i in perm])
    prompts = prompt_texts()
    if prompts and golden and len(prompts) == len(golden):
        sets["real_prompt_vs_output"] = (prompts, list(golden))
    ia, ib = np.triu_indices(len(VARIED), 1)
    sets["varied_all_pairs"] = ([VARIED[i] for i in ia], [VARIED[i] for i in ib])
    return {k: v for k, v in sets.items() if v[0]}


def real_texts() -> list[str]:
    seen = dict.fromkeys(t for _, texts in real_runs() for t in texts)
    seen.update(dict.fromkeys(prompt_texts()))
    return [t for t in seen if t.strip()]


# --- part 1 ---


def speed(opts: dict[str, Callable], texts: list[str], rounds: int, chunk: int = 128) -> dict[str, Any]:
    for f in opts.values():
        f(texts[:32])  # warm-up: first-call allocations, kernel selection
    wall = {k: [] for k in opts}
    cpu = {k: [] for k in opts}
    with Load() as load:
        for _ in range(rounds):
            for i in range(0, len(texts), chunk):
                part = texts[i : i + chunk]
                for k, f in opts.items():
                    t, c = time.perf_counter(), _own_cpu_s()
                    f(part)
                    wall[k].append(time.perf_counter() - t)
                    cpu[k].append((_own_cpu_s() - c) / len(part))
    sizes = [len(texts[i : i + chunk]) for i in range(0, len(texts), chunk)] * rounds
    out = {k: {"texts_per_s_median": round(statistics.median(n / w for n, w in zip(sizes, wall[k])), 1),
               "texts_per_s_best": round(max(n / w for n, w in zip(sizes, wall[k])), 1),
               "cpu_ms_per_text": round(1000 * statistics.median(cpu[k]), 2)} for k in opts}
    return {"texts": len(texts), "rounds": rounds, "chunk": chunk, "load": load.summary(), "options": out}


def agreement(opts: dict[str, Callable], sets: dict[str, tuple[list[str], list[str]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, (a, b) in sets.items():
        texts = list(dict.fromkeys(a + b))
        cos = {}
        for k, f in opts.items():
            e = dict(zip(texts, f(texts)))
            cos[k] = np.array([float(np.clip(np.dot(e[x], e[y]), -1, 1)) for x, y in zip(a, b)])
        result[name] = {"pairs": len(a), "cosine_range_fp32": [round(float(cos["torch_fp32"].min()), 3), round(float(cos["torch_fp32"].max()), 3)],
                        "options": {k: {"max_abs_vs_torch_bf16": round(float(np.abs(v - cos["torch_bf16"]).max()), 4),
                                        "mean_abs_vs_torch_bf16": round(float(np.abs(v - cos["torch_bf16"]).mean()), 4),
                                        "max_abs_vs_torch_fp32": round(float(np.abs(v - cos["torch_fp32"]).max()), 4)}
                                    for k, v in cos.items()}}
        print(name, len(a), {k: v["max_abs_vs_torch_bf16"] for k, v in result[name]["options"].items()}, flush=True)
    return result


# --- part 2 ---


def scoring(prompts: int, repeats: int) -> dict[str, Any]:
    import score_speed
    from regress.runs import load_run
    from regress.scoring import build_metrics, score_runs
    from regress.verdict import Thresholds

    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        g_path, c_path, c2_path = Path(tmp) / "golden", Path(tmp) / "cand", Path(tmp) / "cand2"
        score_speed.make_run(g_path, "golden", prompts, 128, 5, seed=1)
        state = score_speed._GOLDEN[str(g_path)]
        golden_state = {"out": np.concatenate(state["out"]), "texts": state["texts"]}
        score_speed.make_run(c_path, "replay", prompts, 128, 5, golden=golden_state, seed=2)
        score_speed.make_run(c2_path, "replay", prompts, 128, 5, golden=golden_state, seed=3)
        golden, run, run2 = load_run(g_path), load_run(c_path), load_run(c2_path)
        full = Thresholds()

        def timed(label: str, candidate: Any, cache: Path) -> None:
            metrics = build_metrics(full, cache_dir=cache)
            with Load() as load:
                report = score_runs(golden, candidate, full, metrics=metrics)
            row = {"seconds": round(load.wall, 1), "prompts": report.metrics.prompts,
                   "identical": report.metrics.identical, **load.summary()}
            results.setdefault(label, []).append(row)
            print(label, row, flush=True)

        plain = Thresholds(metrics=["exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced", "surface"])
        with Load() as load:
            score_runs(golden, run, plain, metrics=build_metrics(plain))
        results["without_semantic"] = [{"seconds": round(load.wall, 1), **load.summary()}]
        for rep in range(repeats):
            for backend in (("torch", "openvino") if rep % 2 == 0 else ("openvino", "torch")):
                os.environ[E.BACKEND_ENV] = backend
                cache = Path(tmp) / f"cache-{backend}-{rep}"
                timed(f"{backend}_cold", run, cache)
                timed(f"{backend}_second_candidate_golden_cached", run2, cache)
                timed(f"{backend}_rescore_all_cached", run, cache)
        os.environ.pop(E.BACKEND_ENV, None)
    return {label: {"runs": rows, "median_s": round(statistics.median(r["seconds"] for r in rows), 1)}
            for label, rows in results.items()}


def build_time() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, Load() as load:
        t0 = time.perf_counter()
        E.cached_onnx(E.default_model_path(), tmp)
        secs = time.perf_counter() - t0
    return {"seconds": round(secs, 1), **load.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=1024, help="synthetic texts for part 1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--score-prompts", type=int, default=10_000, help="0: skip part 2")
    parser.add_argument("--score-repeats", type=int, default=2)
    parser.add_argument("--scoring-only", action="store_true", help="part 2 only")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "semantic_speed.json"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # onnxruntime's quantizer advice
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    summary: dict[str, Any] = {"cpu_count": os.cpu_count(), "precision": E._precision("auto")}
    summary["onnx_build"] = build_time()
    print("onnx build", summary["onnx_build"], flush=True)
    if not args.scoring_only:
        with tempfile.TemporaryDirectory() as tmp:
            opts, summary["builds"] = build_options(Path(tmp))
            summary["agreement"] = agreement(opts, pair_sets(synthetic_texts(512, seed=7)))
            summary["speed_synthetic"] = speed(opts, synthetic_texts(args.texts), args.rounds)
            print(json.dumps(summary["speed_synthetic"], indent=1), flush=True)
            real = real_texts()
            if real:
                summary["speed_real"] = speed(opts, real, args.rounds)
                print(json.dumps(summary["speed_real"], indent=1), flush=True)
            del opts
    if args.score_prompts:
        summary["scoring"] = {"prompts": args.score_prompts, **scoring(args.score_prompts, args.score_repeats)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    os._exit(0)  # skip interpreter teardown of the inference runtimes' thread pools


if __name__ == "__main__":
    main()
