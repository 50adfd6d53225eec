"""What benchmarks/gpu_celery.py and benchmarks/gpu_drift.py share: the prompt set, the models,
the machine's description, and JSON written as it grows (a run cut off by its time limit still
leaves what it measured)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_FIXTURE = REPO / ".gpumodel" / "fixture"
"""Where benchmarks/gpu/carry.sh builds the fixture model (carried to the GPU machine)."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_prompt_set(n: int, path: Path, *, max_tokens: int, description: str) -> Path:
    """``n`` distinct text prompts (the fixture prompt set's texts, numbered) and a card: greedy,
    ``max_tokens`` new tokens, top-5 logprobs, ignore_eos (every prompt generates exactly
    ``max_tokens``: comparable work per prompt, and drift has the whole length to show)."""
    import yaml

    texts = []
    for line in (REPO / "regress/data/prompts/fixture.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if isinstance(record.get("prompt"), str) and "long-context" not in record.get("tags", []):
            texts.append(record["prompt"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"g{i:05d}", "prompt": f"{texts[i % len(texts)]} (#{i})"}) + "\n")
    path.with_suffix(".yaml").write_text(yaml.safe_dump({
        "description": description,
        "defaults": {"temperature": 0, "max_tokens": max_tokens, "logprobs": 5, "seed": 0, "ignore_eos": True},
    }), encoding="utf-8")
    return path


def fixture_model(path: Path | None) -> Path:
    """The fixture model at ``path`` (default: carry.sh's), built there if missing (about 20 s)."""
    path = (path or DEFAULT_FIXTURE).resolve()
    if not (path / "model.safetensors").is_file():
        from regress.fixture_model import build_fixture_model

        log(f"building the fixture model into {path}")
        build_fixture_model(path)
    return path


def build_wide_llama(out: Path, tokenizer_dir: Path, *, seed: int, hidden: int, layers: int,
                     heads: int, kv_heads: int, intermediate: int, logit_std: float) -> dict[str, Any]:
    """A randomly initialised Llama of realistic width, built deterministically from ``seed`` with
    transformers' own initialisation, using the fixture's tokenizer (1024 tokens).

    Untrained, so its text is meaningless; its arithmetic is that of a real model's layer widths
    (matrix products with K = ``hidden`` and ``intermediate``, 64-wide heads, grouped-query
    attention), which is what numerical drift depends on. The output projection is re-drawn so
    the logits' standard deviation is about ``logit_std`` (with transformers' 0.02 it would be
    0.64 and every position a near-tie; 4 gives top-1 margins of about a nat, closer to a trained
    model's). Weights are stored in float32."""
    import hashlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "model.safetensors").is_file() and (out / "wide.json").is_file():
        return json.loads((out / "wide.json").read_text(encoding="utf-8"))
    vocab = json.loads((tokenizer_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=0, pad_token_id=0, initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, logit_std / hidden ** 0.5, generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    facts = {"seed": seed, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
             "intermediate": intermediate, "vocab": vocab, "logit_std": logit_std, "parameters": params,
             "weights_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()}
    (out / "wide.json").write_text(json.dumps(facts, indent=1), encoding="utf-8")
    return facts


def _run(args: list[str]) -> str | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    """GPU(s), driver, CPU, and the versions of the software measured."""
    from importlib import metadata

    import regress

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    facts: dict[str, Any] = {
        "hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "executable": sys.executable,
        "regress": regress.__version__,
        "regress_git_commit": _run(["git", "-C", str(REPO), "rev-parse", "HEAD"]),
        # carry.sh notes the commit here: the device machine gets the working tree without .git.
        "source_at_carry": (REPO / ".gpumodel" / "source.txt").read_text(encoding="utf-8").strip()
                           if (REPO / ".gpumodel" / "source.txt").is_file() else None,
        "packages": {n: version(n) for n in ("torch", "transformers", "celery", "kombu", "redis", "pydantic",
                                             "numpy", "safetensors", "tokenizers")},
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"]),
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
                                               "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                                               "OMP_NUM_THREADS")},
    }
    try:
        import torch

        facts["torch_cuda"] = torch.version.cuda
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001 - a description, never a reason to fail the benchmark
        facts["torch_error"] = repr(exc)
    return facts


class Results:
    """A JSON document written to ``path`` after every change."""

    def __init__(self, path: Path, **head: Any):
        self.path = path
        self.data: dict[str, Any] = {"command": [sys.executable, *sys.argv], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                     **head}
        self.began = time.monotonic()
        self.save()

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def append(self, key: str, value: Any) -> None:
        self.data.setdefault(key, []).append(value)
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.began, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str), encoding="utf-8")
        tmp.replace(self.path)
