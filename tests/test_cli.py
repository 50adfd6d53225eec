"""The command line: help everywhere, usage errors exit 2 without a traceback, CI annotations."""

from __future__ import annotations

import pytest

from conftest import run_cli
from regress.report.annotations import junit_annotations

COMMANDS = ["validate", "model", "quantize", "golden", "replay", "score", "check", "report", "gate",
            "demo-prompts", "worker", "watch", "env", "env list", "env create", "env remove", "env path"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = run_cli(*command.split(), "--help")
    assert result.returncode == 0 and "Usage:" in result.stdout


@pytest.mark.parametrize("args", [["nosuch"], ["replay"], ["gate", "--bogus"], ["golden", "--shard-size", "0"]])
def test_usage_errors_exit_2_without_traceback(args, tmp_path):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "Error" in result.stderr


def test_missing_params_file_is_a_clear_input_error(tmp_path):
    result = run_cli("golden", cwd=tmp_path)
    assert result.returncode == 2 and "params.yaml: no such file" in result.stderr


def test_junit_failures_become_escaped_annotations(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="s"><testcase classname="regress.c" name="p,1:x">'
        '<failure message="line one&#10;::set-env name=X::1 100%">details</failure></testcase>'
        '<testcase classname="regress.c" name="ok"/></testsuite></testsuites>'
    )
    lines = junit_annotations(junit)
    assert lines == ["::error title=regression%3A regress.c / p%2C1%3Ax::line one%0A::set-env name=X::1 100%25"]
    assert all("\n" not in line for line in lines)
