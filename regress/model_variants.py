"""Deliberately damaged copies of a model: candidates whose outcome is known in advance.

A regression checker must be shown to catch real damage, not only to stay quiet on noise.
``perturb_layer`` adds Gaussian noise to every weight of one decoder layer, scaled by each
tensor's own standard deviation, deterministically (fixed seed); ``perturb_linear`` does the same
to every linear layer of every decoder layer, the graded damage of a detection-power ladder
(:mod:`regress.power`). Quantized variants are made with llm-compressor in its own environment
(:mod:`regress.quantize`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from regress.errors import ConfigError, MissingDependencyError
from regress.storage import building


def perturb_layer(src: str | Path, dst: str | Path, *, layer: int = 1, scale: float = 0.5, seed: int = 0) -> dict:
    """Copy the model at ``src`` to ``dst`` with layer ``layer``'s weights perturbed.

    Every tensor named ``model.layers.<layer>.*`` gets ``N(0, 1) * scale * std(tensor)`` added.
    Returns what was changed (tensor names and the noise scale), also written to
    ``dst/perturbation.json``.
    """
    import torch

    src, dst = Path(src), Path(dst)
    tensors = _load_weights(src, "perturbing")
    prefix = f"model.layers.{layer}."
    names = sorted(n for n in tensors if n.startswith(prefix))
    if not names:
        raise ConfigError(f"the model has no layer {layer} (no tensor starts with '{prefix}')", field="layer")
    # numpy draws the noise (same numbers as before for float32 models); torch holds the tensors,
    # since numpy has no bfloat16 and real checkpoints are stored in it.
    import numpy as np

    rng = np.random.default_rng(seed)
    for name in names:
        t = tensors[name]
        wide = t.to(torch.float64)
        noise = torch.from_numpy(rng.standard_normal(tuple(t.shape))) * scale * float(wide.std(correction=0))
        tensors[name] = (wide + noise).to(t.dtype).contiguous()
    return _write_variant(src, dst, tensors, {"layer": layer, "scale": scale, "seed": seed, "tensors": names})


LINEAR_SUFFIXES = ("_proj.weight",)
"""Tensors ``perturb_linear`` changes: the projections of attention and MLP (q/k/v/o, gate/up/down
in Llama-style checkpoints); norms, biases and embeddings keep their values."""


def linear_tensors(names: list[str]) -> list[str]:
    """The decoder layers' linear weight matrices among ``names``, sorted."""
    return sorted(n for n in names if n.startswith("model.layers.") and n.endswith(LINEAR_SUFFIXES))


def perturb_linear(src: str | Path, dst: str | Path, *, scale: float, seed: int = 0) -> dict:
    """Copy the model at ``src`` to ``dst`` with every linear layer's weights perturbed.

    Every decoder-layer projection (:data:`LINEAR_SUFFIXES`) gets ``N(0, 1) * scale * std(tensor)``
    added. The noise's direction depends only on ``seed`` (each tensor draws from its own
    generator, keyed by the seed and the tensor's name), so a ladder of scales with one seed is
    one direction at growing strength: every step is the one below it, only more. Returns what
    was changed, also written to ``dst/perturbation.json``.
    """
    if not scale > 0:
        raise ConfigError(f"the noise scale must be above 0, got {scale}", field="scale")
    tensors = _load_weights(Path(src), "perturbing")
    import hashlib

    import numpy as np
    import torch

    src, dst = Path(src), Path(dst)
    names = linear_tensors(list(tensors))
    if not names:
        raise ConfigError(f"{src / 'model.safetensors'}: no decoder-layer linear weight "
                          f"(model.layers.*{LINEAR_SUFFIXES[0]})")
    for name in names:
        t = tensors[name]
        key = int.from_bytes(hashlib.sha256(f"{seed}|{name}".encode()).digest()[:8], "big")
        wide = t.to(torch.float64)
        noise = torch.from_numpy(np.random.default_rng(key).standard_normal(tuple(t.shape)))
        tensors[name] = (wide + noise * scale * float(wide.std(correction=0))).to(t.dtype).contiguous()
    return _write_variant(src, dst, tensors, {"kind": "linear", "scale": scale, "seed": seed, "tensors": names})


def damage_token(src: str | Path, dst: str | Path, *, token_id: int, scale: float = 30.0, seed: int = 0) -> dict:
    """Copy the model at ``src`` to ``dst`` with the input embedding of one token replaced by noise.

    Every prompt holding that token is damaged and no other is (for a model with untied
    embeddings that never generates the token): planted damage on a known share of prompts.
    The row becomes ``N(0, 1) * scale * std(embedding matrix)``. Returns what was changed, also
    written to ``dst/perturbation.json``.
    """
    src, dst = Path(src), Path(dst)
    tensors = _load_weights(src, "damaging")
    import numpy as np
    import torch

    name = "model.embed_tokens.weight"
    if name not in tensors:
        raise ConfigError(f"the model has no tensor {name}", field="token_id")
    table = tensors[name]
    if not 0 <= token_id < table.shape[0]:
        raise ConfigError(f"token id {token_id} is outside the vocabulary (0..{table.shape[0] - 1})", field="token_id")
    wide = table.to(torch.float64)
    rng = np.random.default_rng(seed)
    wide[token_id] = torch.from_numpy(rng.standard_normal(table.shape[1])) * scale * float(wide.std(correction=0))
    tensors[name] = wide.to(table.dtype).contiguous()
    return _write_variant(src, dst, tensors, {"token_id": token_id, "scale": scale, "seed": seed, "tensors": [name]})


def _load_weights(src: Path, doing: str) -> dict:
    """The tensors of ``src/model.safetensors`` (torch and safetensors needed: the engine extras)."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise MissingDependencyError(f"{doing} a model needs torch and safetensors (pip install torch safetensors)") from exc
    weights_file = src / "model.safetensors"
    if not weights_file.is_file():
        raise ConfigError(f"{weights_file}: no such file (a single-file safetensors model is expected)")
    return load_file(str(weights_file))


def _write_variant(src: Path, dst: Path, tensors: dict, change: dict) -> dict:
    """Write ``src``'s files with ``tensors`` as its weights to ``dst`` (through ``dst.partial``,
    renamed into place), and what changed as ``dst/perturbation.json``; returns that record."""
    from safetensors.torch import save_file

    with building(dst) as partial:  # replaces an existing dst, as a rebuilt variant should
        shutil.copytree(src, partial, ignore=shutil.ignore_patterns("model.safetensors", ".*"), dirs_exist_ok=True)
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        info = {"source": str(src), **change}
        (partial / "perturbation.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    return info

