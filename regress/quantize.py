"""Quantized candidates made the way production users make them: with llm-compressor.

llm-compressor runs in its own environment (it pins other transformers and compressed-tensors
versions than vLLM does).

``quantize_model`` creates (or reuses) that environment, runs :mod:`regress.quantize_entry`
there, and writes a compressed-tensors checkpoint that vLLM loads with
``quantization: compressed-tensors``. The output appears atomically (built beside, then renamed).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import regress
from regress.envs import EnvSpec, ensure_env
from regress.envs.spec import FOREIGN_INTERPRETER_VARIABLES
from regress.errors import ConfigError, RunError
from regress.storage import building

# On machines where pip finds the CPU build of torch for this version (a local wheel directory
# or PyTorch's CPU index), the pin keeps the environment at ~1.5 GB instead of a CUDA torch.
DEFAULT_QUANTIZER = EnvSpec("llmcompressor==0.14.0.1", ("torch==2.13.0",))
SCHEMES = ("W8A8", "W4A16", "W8A16", "FP8_DYNAMIC")


def calibration_texts(limit: int = 64) -> list[str]:
    """Calibration texts: paragraphs of the fixture corpus shipped with regress."""
    corpus = Path(regress.__file__).parent / "data" / "fixture_corpus"
    texts: list[str] = []
    for path in sorted(corpus.glob("*.txt")):
        texts += [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if len(p.strip()) > 40]
    return texts[:limit]


def quantize_model(
    model: str | Path,
    out: str | Path,
    *,
    scheme: str,
    group_size: int | None = None,
    quantizer: EnvSpec = DEFAULT_QUANTIZER,
    on_line: Callable[[str], None] | None = None,
) -> Path:
    """Quantize ``model`` into ``out`` with llm-compressor's ``scheme``; returns ``out``.

    ``group_size`` replaces the preset's weight group size (int4 schemes group by 128 columns,
    which must divide the model's hidden size).
    """
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r}; supported: {', '.join(SCHEMES)}", field="scheme")
    if group_size is not None and (group_size < 1 or group_size & (group_size - 1)):
        raise ConfigError(f"group size must be a power of two, got {group_size}", field="group_size")
    model, out = Path(model).resolve(), Path(out)
    if not (model / "config.json").is_file():
        raise ConfigError(f"{model}: not a model directory (no config.json)", field="model")
    env, _ = ensure_env(quantizer, candidate=f"quantizer {quantizer.describe()}", on_line=on_line)
    # Built in out.partial (a stale one removed first), renamed over an existing out when done.
    with building(out) as partial:
        with tempfile.TemporaryDirectory(prefix="regress-quantize-") as tmp:
            shim = Path(tmp) / "shim"
            shim.mkdir()
            os.symlink(Path(regress.__file__).resolve().parent, shim / "regress")
            calibration = Path(tmp) / "calibration.json"
            calibration.write_text(json.dumps(calibration_texts()), encoding="utf-8")
            env_vars = {k: v for k, v in os.environ.items() if k not in FOREIGN_INTERPRETER_VARIABLES}
            env_vars.update(PYTHONPATH=str(shim), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
            cmd = [str(env.python), "-m", "regress.quantize_entry", "--model", str(model), "--out",
                   str(partial.resolve()), "--scheme", scheme, "--calibration", str(calibration)]
            if group_size is not None:
                cmd += ["--group-size", str(group_size)]
            result = subprocess.run(cmd, cwd=tmp, env=env_vars, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-12:])
            raise RunError(f"quantizing {model} with {scheme} failed (exit {result.returncode}):\n{tail}")
        (partial / "quantization.json").write_text(
            json.dumps({"source": str(model), "scheme": scheme, "group_size": group_size,
                        "quantizer": quantizer.describe()}, indent=2))
    return out
