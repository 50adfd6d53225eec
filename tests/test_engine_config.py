"""The configuration as applied: a candidate's ``generation_config`` (which model defaults fill
unset sampling fields) and the manifest's ``effective`` record, read back from the engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ENGINE_BASE, run_cli
from regress.datasets import load_prompt_set
from regress.effective import differences, generation_defaults
from regress.errors import ConfigError
from regress.records import CandidateSpec, EffectiveConfig, RunManifest
from regress.replay.plan import plan_replay, resolve_sampling


def _prompt_set(directory: Path):
    path = directory / "gc.jsonl"
    rows = [
        {"id": "p-1", "prompt": "One"},
        {"id": "p-2", "prompt": "Two", "sampling": {"repetition_penalty": 1.1}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return load_prompt_set(path)


def _model_dir(directory: Path, generation: dict | None) -> Path:
    model = directory / "model"
    model.mkdir()
    if generation is not None:
        (model / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return model


def test_auto_applies_the_models_defaults_below_every_layer(tmp_path):
    prompts = _prompt_set(tmp_path)
    model = _model_dir(tmp_path, {"repetition_penalty": 1.3, "max_new_tokens": 7, "eos_token_id": 2, "min_p": 0.1})
    spec = CandidateSpec(name="c", model=str(model), generation_config="auto")
    first, second = resolve_sampling(prompts, spec)
    assert first.repetition_penalty == 1.3 and first.max_tokens == 7
    assert second.repetition_penalty == 1.1  # the prompt's own sampling wins
    assert generation_defaults(spec) == {"repetition_penalty": 1.3, "max_tokens": 7}  # no field for min_p

    over = CandidateSpec(name="c", model=str(model), generation_config="auto", sampling={"repetition_penalty": 1.2})
    assert resolve_sampling(prompts, over)[0].repetition_penalty == 1.2  # candidate sampling is above it


def test_vllm_ignores_the_models_defaults_and_keeps_fingerprints(tmp_path):
    prompts = _prompt_set(tmp_path)
    model = _model_dir(tmp_path, {"repetition_penalty": 1.3})
    plain = CandidateSpec(name="c", model=str(model))
    explicit = CandidateSpec(name="c", model=str(model), generation_config="vllm")
    assert resolve_sampling(prompts, plain)[0].repetition_penalty == 1.0
    assert "generation_config" not in plain.model_dump() and "generation_config" not in explicit.model_dump()
    assert plan_replay(plain, prompts).fingerprint == plan_replay(explicit, prompts).fingerprint
    auto = CandidateSpec(name="c", model=str(model), generation_config="auto")
    assert plan_replay(auto, prompts).fingerprint != plan_replay(plain, prompts).fingerprint


def test_do_sample_false_keeps_the_sampler_keys_out(tmp_path):
    model = _model_dir(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                  "repetition_penalty": 1.05})
    spec = CandidateSpec(name="c", model=str(model), generation_config="auto")
    assert generation_defaults(spec) == {"repetition_penalty": 1.05}


def test_a_directory_and_a_missing_file(tmp_path):
    prompts = _prompt_set(tmp_path)
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_k": 40}))
    spec = CandidateSpec(name="c", model="org/hub-model", generation_config=str(folder))
    resolved = resolve_sampling(prompts, spec)[0]
    assert (resolved.temperature, resolved.top_k) == (0.5, 40)
    # auto on a model without the file: no defaults, as in vLLM
    bare = CandidateSpec(name="c", model=str(_model_dir(tmp_path, None)), generation_config="auto")
    assert generation_defaults(bare) == {}


def test_hub_ids_and_bad_files_are_config_errors(tmp_path):
    prompts = _prompt_set(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_sampling(prompts, CandidateSpec(name="hubby", model="org/not-here", generation_config="auto"))
    assert info.value.field == "generation_config" and "hubby" in str(info.value)
    model = _model_dir(tmp_path, {"temperature": -3})
    with pytest.raises(ConfigError, match="temperature"):
        resolve_sampling(prompts, CandidateSpec(name="c", model=str(model), generation_config="auto"))


def test_defaults_read_once_are_the_ones_planned_recorded_and_compared(tmp_path, monkeypatch):
    """A check reads a candidate's generation_config defaults once and passes them down: the plan
    resolves sampling with them and carries them to the manifest, the diagnosis's differences
    compare them; nothing reads the file again."""
    import regress.effective
    import regress.replay.manifest
    import regress.replay.plan
    from regress.replay.manifest import effective_record

    prompts = _prompt_set(tmp_path)
    model = _model_dir(tmp_path, {"repetition_penalty": 1.3})
    spec = CandidateSpec(name="c", model=str(model), generation_config="auto")
    read = generation_defaults(spec)

    def unread(candidate):  # the baseline's own defaults are another candidate's: still read
        assert candidate.name != spec.name, "the candidate's generation_config.json read again"
        return generation_defaults(candidate)

    for module, name in ((regress.replay.plan, "read_generation_defaults"), (regress.replay.manifest, "generation_defaults"),
                         (regress.effective, "generation_defaults")):
        monkeypatch.setattr(module, name, unread)
    plan = plan_replay(spec, prompts, generation_defaults=read)
    assert plan.generation_defaults == read and plan.tasks[0].prompts[0]["sampling"]["repetition_penalty"] == 1.3
    assert effective_record(spec, {}, [], plan.generation_defaults).generation_defaults_applied == read
    bare = CandidateSpec(name="a", model=str(model))
    found = {d.name: d for d in differences(bare, spec, candidate_defaults=read)}
    assert found["model defaults applied"].candidate == '{"repetition_penalty": 1.3}'


def test_the_setting_is_an_input_defaults_fact(tmp_path):
    model = _model_dir(tmp_path, {"repetition_penalty": 1.3})
    a = CandidateSpec(name="a", model=str(model))
    b = CandidateSpec(name="b", model=str(model), generation_config="auto")
    found = {d.name: d for d in differences(a, b)}
    assert found["generation_config"].source == "input defaults"
    assert (found["generation_config"].baseline, found["generation_config"].candidate) == ("vllm", "auto")
    assert found["model defaults applied"].candidate == '{"repetition_penalty": 1.3}'


def _params(directory: Path, model: Path, **baseline) -> None:
    data = {"dataset": "gc.jsonl", "baseline": {"package": "current", "model": str(model), **ENGINE_BASE, **baseline}}
    (directory / "params.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")


def test_a_bad_generation_config_exits_2_before_any_engine(tmp_path):
    _prompt_set(tmp_path)
    model = _model_dir(tmp_path, None)
    _params(tmp_path, model, generation_config="gen-missing")
    result = run_cli("golden", cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "generation_config" in result.stderr and "Traceback" not in result.stderr

    _params(tmp_path, Path("org/not-a-dir"), generation_config="auto")
    result = run_cli("golden", cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "generation_config" in result.stderr and "local directory" in result.stderr


def test_a_manifest_without_effective_still_loads(golden_dir):
    data = json.loads((golden_dir / "manifest.json").read_text())
    data.pop("effective", None)
    assert RunManifest.model_validate(data).effective is None


def test_the_golden_records_what_the_engine_applied(golden_dir):
    from regress.runs import load_run

    effective = load_run(golden_dir).manifest.effective
    assert isinstance(effective, EffectiveConfig)
    assert effective.dtype == "bfloat16"
    assert effective.kv_cache_dtype is not None
    assert effective.max_model_len == 4096
    assert effective.enforce_eager is True
    assert effective.enable_prefix_caching is not None
    assert effective.tokenizer is not None and effective.tokenizer.eos_token_id is not None
    assert effective.tokenizer.vocab_size
    assert effective.generation_config == "vllm" and effective.generation_defaults_applied == {}
    assert effective.sampling_applied
    first = effective.sampling_applied[0]
    assert first.applied["max_tokens"] == first.sampling["max_tokens"]
    assert "temperature" in first.applied


def test_the_configuration_table_shows_what_the_engine_applied(golden_dir):
    from regress.report.configdiff import config_diff
    from regress.runs import load_run

    golden = load_run(golden_dir).manifest
    assert golden.effective is not None
    other = golden.model_copy(update={"effective": golden.effective.model_copy(update={"kv_cache_dtype": "fp8"})})
    rows = {(r.section, r.name): r for r in config_diff(golden, other)}
    assert rows[("effective", "KV-cache dtype")].changed
    assert not rows[("effective", "max model len")].changed
    assert rows[("effective", "sampling applied #1")].baseline.startswith("n=1 temperature=0.0")
    # a manifest from before the record: no effective rows on that side, the other side's still shown
    older = golden.model_copy(update={"effective": None})
    rows = {(r.section, r.name): r for r in config_diff(older, golden)}
    assert rows[("effective", "max model len")].baseline == "—"


def _fake_vllm(monkeypatch, *, cpu: bool, subprocess_run=None):
    """A stand-in vLLM in sys.modules: its registry (with ``subprocess_run`` as the inspection
    subprocess, or none, as a release that moved it) and its platform."""
    import types

    registry = types.ModuleType("vllm.model_executor.models.registry")
    if subprocess_run is not None:
        registry._run_in_subprocess = subprocess_run
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    modules = {name: types.ModuleType(name) for name in ("vllm", "vllm.model_executor", "vllm.model_executor.models")}
    modules["vllm.model_executor.models"].registry = registry
    modules["vllm"].platforms = platforms
    for name, module in {**modules, registry.__name__: registry, platforms.__name__: platforms}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return registry


@pytest.mark.parametrize("cpu", [True, False])
def test_vllm_inspects_the_model_class_in_process_on_cpus_only(monkeypatch, cpu):
    """vLLM's fresh process for inspecting a model class keeps CUDA out of the parent; on a CPU
    it only imports vLLM again (7-8 s per first engine start), so the CPU engine inspects in
    process, with the same function. GPUs keep the subprocess."""
    from regress.backends.vllm_offline import _inspect_models_in_process

    calls: list[str] = []

    def subprocess_run(fn):
        calls.append("subprocess")
        return fn()

    registry = _fake_vllm(monkeypatch, cpu=cpu, subprocess_run=subprocess_run)
    assert _inspect_models_in_process() is cpu
    assert registry._run_in_subprocess(lambda: "model info") == "model info"
    assert calls == ([] if cpu else ["subprocess"])


def test_a_vllm_without_the_inspection_subprocess_is_left_alone(monkeypatch):
    from regress.backends.vllm_offline import _inspect_models_in_process

    registry = _fake_vllm(monkeypatch, cpu=True)  # a release that moved it
    assert _inspect_models_in_process() is False and not hasattr(registry, "_run_in_subprocess")
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # no vLLM at all
    assert _inspect_models_in_process() is False
