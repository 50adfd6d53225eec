"""The semantic metric's fast path: the bundled MiniLM exported to ONNX and run by OpenVINO.

What would break silently if this path broke: its cosines drifting from sentence-transformers'
(the thresholds were calibrated on those), a tampered shared cache being loaded, or a machine
without openvino failing instead of falling back. Speed itself is measured in
benchmarks/semantic_speed.py, never asserted here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from regress.errors import MissingDependencyError
from regress.metrics import embedder as E
from regress.metrics import semantic as S
from regress.metrics.base import Pair
from regress.records import Generation

pytest.importorskip("openvino")
pytest.importorskip("onnx")

TEXTS = json.loads((Path(__file__).parent / "data" / "varied_texts.json").read_text(encoding="utf-8"))["texts"]


@pytest.fixture(scope="module")
def onnx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real export, shared by this module's tests (a few seconds)."""
    root = tmp_path_factory.mktemp("semantic-onnx")
    E.cached_onnx(E.default_model_path(), root)
    return root


@pytest.fixture(scope="module")
def torch_vectors() -> np.ndarray:
    """sentence-transformers' embeddings: the path the thresholds were calibrated on."""
    return E._torch_encode(None, E._precision("auto"), 128, "cpu")(TEXTS)


def _gen(text: str, pid: str = "p") -> Generation:
    # The semantic metric reads only the text.
    return Generation(prompt_id=pid, prompt_token_ids=np.array([1], np.int32), output_token_ids=np.array([1], np.int32),
                      text=text, finish_reason="length", free_run=None)  # type: ignore[arg-type]


def _pairs() -> list[Pair]:
    return [Pair(_gen(a, f"p{i}-{j}"), _gen(b, f"p{i}-{j}")) for i, a in enumerate(TEXTS) for j, b in enumerate(TEXTS) if i < j]


def test_openvino_cosines_match_sentence_transformers(onnx_root: Path, torch_vectors: np.ndarray) -> None:
    fast = E.OpenVinoEncoder(E.default_model_path(), E._precision("auto"), onnx_root).encode(TEXTS)
    assert fast.shape == torch_vectors.shape
    assert np.allclose(np.linalg.norm(fast, axis=1), 1, atol=1e-3)
    delta = np.abs(np.clip(fast @ fast.T, -1, 1) - np.clip(torch_vectors @ torch_vectors.T, -1, 1))
    assert delta.max() < 0.01, f"max |Δcosine| {delta.max():.4f}"
    # Order and batching do not matter: a text gets the same vector alone or in a mixed batch.
    alone = E.OpenVinoEncoder(E.default_model_path(), E._precision("auto"), onnx_root, batch_size=1).encode(TEXTS[::-1])
    assert np.abs((alone[::-1] * fast).sum(1) - 1).max() < 0.01


def test_metric_takes_the_openvino_path_by_default(onnx_root: Path, torch_vectors: np.ndarray, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(E.BACKEND_ENV, raising=False)
    fn = S.semantic(cache_dir=tmp_path, onnx_cache=onnx_root)
    pairs = _pairs()
    sims = np.array([v["semantic_similarity"] for v in fn(pairs)])
    assert fn.state["backend"] == ("cuda" if E.cuda_available() else "openvino")
    index = {t: i for i, t in enumerate(TEXTS)}
    ref = np.array([np.clip(torch_vectors[index[p.golden.text]] @ torch_vectors[index[p.candidate.text]], -1, 1) for p in pairs])
    assert np.abs(sims - ref).max() < 0.01
    # Embeddings of this backend are cached under their own key, apart from the torch path's.
    assert fn.state["disk"].key.endswith("|openvino")
    again = S.semantic(cache_dir=tmp_path, onnx_cache=onnx_root)
    assert [v["semantic_similarity"] for v in again(pairs)] == sims.tolist()
    assert "encode" not in again.state  # everything came from the cache: nothing loaded


def _tamper(folder: Path) -> bytes:
    """Replace the cached file by another valid model: the embedding LayerNorm's scale reversed."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load_from_string((folder / "model.onnx").read_bytes())
    (init,) = [i for i in model.graph.initializer if i.name.endswith("embeddings.LayerNorm.weight")]
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init)[::-1].copy(), init.name))
    data = model.SerializeToString()
    (folder / "model.onnx").write_bytes(data)
    return data


def test_tampered_cached_onnx_is_rebuilt_not_loaded(onnx_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    shutil.copytree(onnx_root, root)
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    good = (folder / "model.onnx").read_bytes()
    record = json.loads((folder / "record.json").read_text())
    assert record["sha256"] == hashlib.sha256(good).hexdigest()
    assert record["source_sha256"] == E.source_sha256(E.default_model_path())

    exports = []
    real_export = E.export_onnx

    def counting_export(path: str) -> bytes:
        exports.append(path)
        return real_export(path)

    monkeypatch.setattr(E, "export_onnx", counting_export)
    # An intact file is loaded as it is.
    assert E.cached_onnx(E.default_model_path(), root) == good and exports == []

    tampered = _tamper(folder)
    assert tampered != good
    data = E.cached_onnx(E.default_model_path(), root)
    assert len(exports) == 1, "the tampered file was not rebuilt"
    assert data != tampered
    assert hashlib.sha256(data).hexdigest() == json.loads((folder / "record.json").read_text())["sha256"]
    assert (folder / "model.onnx").read_bytes() == data
    assert "does not match its record; rebuilding" in capsys.readouterr().err

    # A forged record (its sha256 changed to the tampered file's) is not enough either: the
    # record must name this source and recipe, and the key folder is derived from both.
    _tamper(folder)
    forged = json.loads((folder / "record.json").read_text())
    forged["recipe"] = "something else"
    (folder / "record.json").write_text(json.dumps(forged))
    E.cached_onnx(E.default_model_path(), root)
    assert len(exports) == 2


def test_encoder_loads_the_verified_bytes(onnx_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder hands OpenVINO the bytes it hashed, not the path (no swap between check and load)."""
    root = tmp_path / "cache"
    shutil.copytree(onnx_root, root)
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    _tamper(folder)
    monkeypatch.setattr(E, "export_onnx", lambda path: (onnx_root / folder.name / "model.onnx").read_bytes())
    enc = E.OpenVinoEncoder(E.default_model_path(), "float32", root)
    reference = E.OpenVinoEncoder(E.default_model_path(), "float32", onnx_root)
    assert np.abs((enc.encode(TEXTS[:6]) * reference.encode(TEXTS[:6])).sum(1) - 1).max() < 1e-4


def test_falls_back_to_sentence_transformers_without_openvino(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(E.BACKEND_ENV, raising=False)
    monkeypatch.setattr(E, "cuda_available", lambda: False)
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino -> ImportError
    monkeypatch.setattr(E, "_notes_given", set())
    fn = S.semantic(cache_dir=tmp_path / "emb", onnx_cache=tmp_path / "onnx")
    out = fn([Pair(_gen(TEXTS[0]), _gen(TEXTS[1])), Pair(_gen(TEXTS[0]), _gen(TEXTS[2]))])
    assert fn.state["backend"] == "torch"
    assert out[0]["semantic_similarity"] > 0.7 > 0.3 > out[1]["semantic_similarity"]
    err = capsys.readouterr().err
    assert "openvino is not installed" in err and "using sentence-transformers" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "onnx").exists()  # nothing exported for nothing
    with pytest.raises(MissingDependencyError, match="openvino"):
        E.resolve_backend("openvino", None)


def test_falls_back_when_the_export_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(E.BACKEND_ENV, raising=False)
    monkeypatch.setattr(E, "cuda_available", lambda: False)
    monkeypatch.setattr(E, "_notes_given", set())

    def broken(path: str) -> bytes:
        raise RuntimeError("exporter broke")

    monkeypatch.setattr(E, "export_onnx", broken)
    fn = S.semantic(cache_dir=tmp_path / "emb", onnx_cache=tmp_path / "onnx")
    out = fn([Pair(_gen(TEXTS[3]), _gen(TEXTS[4]))])
    assert fn.state["backend"] == "torch" and fn.state["disk"].key.endswith(E._precision("auto"))
    assert out[0]["semantic_similarity"] > 0.7
    assert "exporter broke" in capsys.readouterr().err


def test_backend_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(E, "cuda_available", lambda: False)
    monkeypatch.delenv(E.BACKEND_ENV, raising=False)
    assert E.resolve_backend("auto", None) == ("openvino", None)
    assert E.resolve_backend("torch", None) == ("torch", None)
    monkeypatch.setenv(E.BACKEND_ENV, "torch")
    assert E.resolve_backend("auto", None) == ("torch", None)
    monkeypatch.setattr(E, "cuda_available", lambda: True)
    monkeypatch.delenv(E.BACKEND_ENV)
    assert E.resolve_backend("auto", None) == ("cuda", None)  # a GPU: sentence-transformers on it
    monkeypatch.setattr(E, "cuda_available", lambda: False)
    # A model the export recipe does not cover goes to sentence-transformers, with the reason.
    model = tmp_path / "cls-model"
    shutil.copytree(E.default_model_path(), model, ignore=shutil.ignore_patterns("*.safetensors"))
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, "pooling_mode_cls_token": True}))
    kind, note = E.resolve_backend("auto", str(model))
    assert kind == "torch" and "pooling" in note
    assert E.onnx_unsupported_reason(str(tmp_path / "missing")) is not None
    assert E.onnx_unsupported_reason(E.default_model_path()) is None


def test_importing_regress_stays_light() -> None:
    code = ("import sys, regress, regress.scoring, regress.metrics.semantic as s; s.semantic(); "
            "print(sorted(m for m in ('torch', 'openvino', 'onnx', 'onnxruntime', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
