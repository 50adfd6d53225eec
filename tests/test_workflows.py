"""The GitHub Actions workflows pass the security audit (zizmor) and the linter (actionlint, which
also checks them against GitHub's workflow syntax), and keep the hardening the regression job
relies on.

(check-jsonschema is not used: it depends on a PyPI package that is also named ``regress`` and
would replace this project in the environment.)"""

from __future__ import annotations

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
