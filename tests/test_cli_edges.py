"""The command line's rough edges a new user trips over: help that names what to type, --version,
validate for params files (typos with "did you mean", misspelt engine arguments, samples a
candidate's temperature 0 would refuse), a candidate that was never scored, the DVC metrics file.
No engine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from conftest import run_cli
from regress.cli import app


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, command in group.commands.items():
        found.append((*prefix, name))
        if hasattr(command, "commands"):  # a group (Typer's own click, whichever it is)
            found += _commands(command, (*prefix, name))
    return found


COMMANDS = _commands(typer.main.get_command(app))  # type: ignore[arg-type]


def test_help_names_what_to_type_not_python_types() -> None:
    runner = CliRunner()
    assert len(COMMANDS) >= 20 and ("env", "create") in COMMANDS
    for command in COMMANDS:
        result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "160"}, terminal_width=160)
        assert result.exit_code == 0, (command, result.output)
        text = result.output
        for python_type in ("<bool>", "<list[", "range>", "<str>", "<path>", "<int>", "[x>="):
            assert python_type not in text, (command, python_type)
    gate = runner.invoke(app, ["gate", "--help"], terminal_width=160).output
    assert re.search(r"--annotate\s+Also print", gate)  # a flag takes no value: nothing between name and help
    assert re.search(r"--params\s+-p\s+PATH", gate)
    worker = runner.invoke(app, ["worker", "--help"], terminal_width=160).output
    assert "INT, at least 1" in worker


def test_version() -> None:
    from importlib.metadata import version

    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"regress {version('regress')}"


def _project(root: Path, params: dict, prompts: list[dict]) -> Path:
    (root / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump({"dataset": "p.jsonl", **params}, sort_keys=False), encoding="utf-8")
    return path


def test_validate_checks_a_params_file_whole(tmp_path: Path) -> None:
    _project(tmp_path, {"baseline": {"package": "current", "model": "m"},
                        "candidates": {"fp8": {"engine_args": {"kv_cache_dtpye": "fp8"}}, "half": {"dtyp": "float16"}},
                        "thresholds": {"max_regresions": 2}}, [{"id": "a", "prompt": "hi"}])
    result = run_cli("validate", "params.yaml", cwd=tmp_path)
    assert result.returncode == 2
    err = " ".join(result.stderr.split())
    # Every candidate's problem, each with its line and the one name meant.
    assert "params.yaml:7: field 'candidates.fp8.engine_args': 'kv_cache_dtpye' is not an engine argument" in err
    assert "did you mean 'kv_cache_dtype'?" in err
    assert "field 'candidates.half.dtyp': unknown field: did you mean 'dtype'?" in err
    assert "field 'thresholds.max_regresions': unknown field: did you mean 'max_regressions'?" in err
    assert "allowed:" not in err and "Traceback" not in err
    # A key no vLLM release has and nothing resembles may be a newer release's: the engine decides.
    _project(tmp_path, {"baseline": {"package": "current", "model": "m", "engine_args": {"brand_new_knob": 1}}},
             [{"id": "a", "prompt": "hi"}])
    ok = run_cli("validate", "params.yaml", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("params.yaml: ok, baseline 'baseline' and 0 candidate(s); 1 prompts")


def test_validate_says_what_the_run_would_refuse(tmp_path: Path) -> None:
    prompts = [{"id": "x", "prompt": "one"}, {"id": "s", "prompt": "two", "samples": 4}]
    _project(tmp_path, {"baseline": {"package": "current", "model": "m"},
                        "candidates": {"hot": {"sampling": {"temperature": 0.7}}}}, prompts)
    alone = run_cli("validate", "p.jsonl", cwd=tmp_path)
    assert alone.returncode == 0 and "p.jsonl: ok" in alone.stdout
    note = " ".join(alone.stderr.split())
    assert "note: p.jsonl:2: field 'samples': prompt 's' asks for 4 samples" in note
    with_params = run_cli("validate", "params.yaml", cwd=tmp_path)
    assert with_params.returncode == 2
    err = " ".join(with_params.stderr.split())
    # The baseline samples at temperature 0; the hot candidate does not, and is not named.
    assert "p.jsonl:2: for candidate 'baseline': prompt 's' asks for 4 samples at temperature 0" in err
    assert "'hot'" not in err


def test_gate_on_a_candidate_never_scored(tmp_path: Path) -> None:
    _project(tmp_path, {"baseline": {"package": "current", "model": "m"}}, [{"id": "a", "prompt": "hi"}])
    (tmp_path / "scores" / "next").mkdir(parents=True)
    (tmp_path / "scores" / "next" / "metrics.json").write_text("{}")
    result = run_cli("gate", "nxt", cwd=tmp_path)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Errno" not in err
    assert "'nxt' has not been scored: no scores/nxt/metrics.json; did you mean 'next'?" in err


@pytest.mark.parametrize("command", [["bisect"], ["watch"]])
def test_prereleases_are_asked_for_the_same_way_everywhere(command: list[str]) -> None:
    text = run_cli(*command, "--help", env={"TERMINAL_WIDTH": "200"}).stdout
    assert re.search(r"--include-prereleases\s*,?\s*--pre\b", text) or ("--include-prereleases" in text and " --pre " in text)


def test_dvc_metrics_are_the_numbers_people_compare(tmp_path: Path) -> None:
    from report_fixtures import build_case
    from regress.scoring import DVC_METRICS_FILE, dvc_metrics

    case = build_case(tmp_path, 12, tokens=16, semantic=False)
    shown = json.loads((tmp_path / "scores" / DVC_METRICS_FILE).read_text())
    assert shown == json.loads(json.dumps(dvc_metrics(case.score.metrics)))
    assert 8 <= len(shown) <= 16 and all(isinstance(v, (int, float, bool)) for v in shown.values())
    assert shown["gating_failed"] is case.score.metrics.gating_failed
    assert shown["regression"] == case.score.metrics.regression
