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


def test_annotations_are_few_titled_by_class_and_point_at_the_prompt(tmp_path, monkeypatch):
    """At most a few annotations per candidate (GitHub shows about ten a step): the failed verdict
    first, then gating prompts titled with their class at their prompt's file and line, then one
    line counting the rest."""
    from regress.report.annotations import ANNOTATIONS_PER_CANDIDATE

    cases = ['<testcase classname="regress.c" name="fidelity"><failure type="fidelity" message="fidelity fail: 9 regressions"/></testcase>',
             '<testcase classname="regress.c" name="quality"><skipped message="reported, not gating"/></testcase>']
    for i in range(8):
        kind = "input_drift" if i == 0 else "regression"
        cases.append(f'<testcase classname="regress.c" name="p{i}" file="datasets/prompts/set.jsonl" line="{i + 3}">'
                     f'<failure type="{kind}" message="m{i}"/></testcase>')
    cases.append('<testcase classname="regress.c" name="lost" line="2"><skipped message="expected answer lost, not gating"/></testcase>')
    junit = tmp_path / "junit.xml"
    junit.write_text(f'<testsuites><testsuite name="s">{"".join(cases)}</testsuite></testsuites>')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    lines = junit_annotations(junit, project=tmp_path)
    assert len(lines) == ANNOTATIONS_PER_CANDIDATE + 1
    assert lines[0] == "::error title=fidelity FAIL%3A regress.c::fidelity fail: 9 regressions"
    assert lines[1] == "::error file=datasets/prompts/set.jsonl,line=3,title=input drift%3A regress.c / p0::m0"
    assert lines[2] == "::error file=datasets/prompts/set.jsonl,line=4,title=regression%3A regress.c / p1::m1"
    assert lines[-1].startswith("::error title=regress.c%3A 4 more::4 more failure(s) not annotated")
    # A project inside the checkout: the file is named from the checkout's root, as GitHub wants it.
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path.parent))
    assert f"file={tmp_path.name}/datasets/prompts/set.jsonl,line=3," in junit_annotations(junit, project=tmp_path)[1]
    assert junit_annotations(junit, limit=20, project=tmp_path)[-1].endswith("::m7")


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


@pytest.mark.parametrize("group", [[], ["env"]])
def test_command_lists_reflow_their_summaries(group):
    """A command's summary is one paragraph in the list, not the docstring's source lines: on a
    wide terminal each command takes one line of the Commands panel."""
    result = run_cli(*group, "--help", env={"COLUMNS": "2000", "TERM": "dumb"})
    assert result.returncode == 0
    panel = result.stdout.split("Commands")[1].split("╰")[0].splitlines()[1:]
    rows = [line.strip("│ ").rstrip() for line in panel if line.strip("│ ")]
    continued = [line for line in panel if line.startswith("│ ") and line[2:3] == " " and line.strip("│ ")]
    assert rows and not continued, continued
