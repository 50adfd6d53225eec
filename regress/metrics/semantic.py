"""Semantic similarity: cosine of sentence embeddings of the golden and candidate texts.

Texts are embedded in batches and cached by text, so a golden text shared by several candidates is
embedded once, and identical outputs are not embedded at all. The embeddings (the default model,
the ``openvino``/``torch``/``auto`` backends, the ONNX export and its cache) come from
:mod:`regress.metrics.embedder`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from regress.metrics.base import SEMANTIC_MODEL, Aggregate, Bound, Chart, Output, Pair, Setting, Values, metric
from regress.metrics.embedder import (
    BACKEND_ENV,
    DEFAULT_MODEL,
    EmbeddingCache,
    Encode,
    OpenVinoEncoder,
    _model_path,
    _note,
    _precision,
    _torch_encode,
    resolve_backend,
)

_SEMANTIC_REASON = "semantic similarity {value:.2f} < {bound}"


@metric(
    "semantic",
    outputs=[Output(
        "semantic_similarity", "cosine similarity of the two texts' sentence embeddings (1 = same meaning)",
        label="semantic", better="higher", headline=60, column=True,
        aggregate=Aggregate("mean", key="mean_semantic_similarity", label="semantic similarity", rank=30,
                            doc="mean cosine similarity of the outputs"),
        benign=Bound(Setting("benign_semantic", 0.8, ge=-1, le=1, doc="Semantic similarity at least this for ``benign``."),
                     reason=_SEMANTIC_REASON),
        regression=Bound(Setting("regression_semantic", 0.3, ge=-1, le=1,
                                 doc="Semantic similarity below this is a regression."),
                         reason=_SEMANTIC_REASON),
        # A small model's continuation after a coin toss may mean something else with nothing broken;
        # the teacher-forced measures judge the model there.
        noise_after_near_tie=True,
        chart=Chart("Semantic similarity", "embedding cosine, 1 = same meaning", scale="unit", noun="diverged prompt",
                    empty="no diverged prompt with a semantic score", diverged_only=True),
    )],
    batched=True,
    options={
        "model": SEMANTIC_MODEL,
        "precision": Setting("semantic_precision", "auto", type=Literal["auto", "float32", "bfloat16"],
                             doc="Embedding precision: auto = bfloat16 on CPUs with AMX (2.3x faster, cosines within 0.006)."),
    },
)
def semantic(
    model: str | None = None,
    batch_size: int = 128,
    encoder: Any = None,
    precision: str = "auto",
    cache_dir: str | Path | None = None,
    backend: str = "auto",
    onnx_cache: str | Path | None = None,
) -> "callable":
    """``precision``: float32, bfloat16, or auto (bfloat16 on CPUs with AMX). ``cache_dir``: where
    the persistent embedding cache lives (None: in memory only). ``backend``: auto, openvino or
    torch (see :mod:`regress.metrics.embedder`; ``$REGRESS_SEMANTIC_BACKEND`` overrides auto).
    ``onnx_cache``: where ONNX exports live (default ``$REGRESS_HOME/models/semantic-onnx``)."""
    precision = _precision(precision)
    memories: dict[str, dict[str, np.ndarray]] = {}  # by cache key
    # Resolved and loaded on first need: a run with only identical outputs never pays for it.
    state: dict[str, Any] = {}
    if encoder is not None:
        state["encode"] = lambda texts: np.asarray(encoder.encode(
            texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
            show_progress_bar=False), dtype=np.float32)
        state["backend"] = "given"

    def choose(kind: str) -> None:
        state["backend"] = kind
        suffix = {"torch": "", "given": "", "cuda": "|cuda", "openvino": "|openvino"}[kind]
        key = f"{model or DEFAULT_MODEL}|{precision}{suffix}"
        state["disk"] = EmbeddingCache(Path(cache_dir) / "embeddings.sqlite", key) if cache_dir else None
        state["memory"] = memories.setdefault(key, {})

    def load() -> Encode:
        kind = state["backend"]
        if kind == "openvino":
            try:
                return OpenVinoEncoder(_model_path(model), precision, onnx_cache).encode
            except Exception as exc:
                if backend == "openvino" or os.environ.get(BACKEND_ENV) == "openvino":
                    raise
                _note(f"the ONNX/OpenVINO path failed ({type(exc).__name__}: {exc}); "
                      "using sentence-transformers on the CPU")
                choose("torch")
                kind = "torch"
        return _torch_encode(model, precision, batch_size, "cuda" if kind == "cuda" else "cpu")

    def embed(texts: list[str]) -> dict[str, np.ndarray]:
        if "memory" not in state:
            kind = state.get("backend")
            if kind is None:
                kind, why = resolve_backend(backend, model)
                if why:
                    _note(why)
            choose(kind)
        known: dict[str, np.ndarray] = state["memory"]
        todo = sorted({t for t in texts if t not in known})
        if todo and state["disk"] is not None:
            known.update(state["disk"].get_many(todo))
            todo = [t for t in todo if t not in known]
        if todo:
            if "encode" not in state:
                state["encode"] = load()
                if state["memory"] is not known:  # fell back to another backend: another cache key
                    return embed(texts)
            new = dict(zip(todo, state["encode"](todo)))
            known.update(new)
            dim = next(iter(new.values())).size if new else None
            # A cached vector of another dimension than the encoder's is not this encoder's: recomputed.
            stale = sorted({t for t in texts if dim is not None and known[t].size != dim})
            if stale:
                _note(f"{len(stale)} cached embedding(s) of another dimension than the encoder's ({dim}); recomputing them")
                fixed = dict(zip(stale, state["encode"](stale)))
                known.update(fixed)
                new.update(fixed)
            if state["disk"] is not None:
                state["disk"].put_many(new)
        return known

    def score(pairs: list[Pair]) -> list[Values]:
        differing = [p for p in pairs if p.golden.text != p.candidate.text]
        vectors = embed([t for p in differing for t in (p.golden.text, p.candidate.text)])
        out = []
        for p in pairs:
            if p.golden.text == p.candidate.text:
                out.append({"semantic_similarity": 1.0})
            else:
                sim = float(np.dot(vectors[p.golden.text], vectors[p.candidate.text]))
                # Clamped to [-1, 1] only when a number: min/max would turn a broken embedding's
                # NaN into -1, a "different meaning" nobody measured (it is an error: the spec's default).
                out.append({"semantic_similarity": min(1.0, max(-1.0, sim)) if np.isfinite(sim) else sim})
        return out

    score.state = state  # type: ignore[attr-defined]  # which backend ran (tests, benchmarks)
    return score
