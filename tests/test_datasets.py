"""Prompt set validation: every kind of bad file gives exit 2, names file, line and field, writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli, write_params
from regress.datasets import DEMO_PROMPTS, FIXTURE_PROMPTS
from regress.datasets import check_prompt_set, load_prompt_set
from regress.errors import DatasetError
from regress.records import ResolvedSampling

GOOD = {"id": "a", "prompt": "Hello there"}

# (name, bad line as bytes, line number it lands on, field named in the message or None, words in the message)
BAD_LINES = [
    ("invalid-json", b'{"id": "b", "prompt": "x",}', 2, None, "invalid JSON"),
    ("non-utf8", b'{"id": "b", "prompt": "caf\xe9"}', 2, None, "not valid UTF-8"),
    ("duplicate-id", json.dumps({"id": "a", "prompt": "again"}).encode(), 2, "id", "duplicate id 'a'"),
    ("empty-prompt", json.dumps({"id": "b", "prompt": "   "}).encode(), 2, "prompt", "must not be empty"),
    ("neither", json.dumps({"id": "b", "tags": ["x"]}).encode(), 2, "prompt|messages", "exactly one of"),
    ("both", json.dumps({"id": "b", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}).encode(),
     2, "prompt|messages", "exactly one of"),
    ("unknown-field", json.dumps({"id": "b", "prompt": "x", "temprature": 0}).encode(), 2, "temprature", "unknown field"),
    ("negative-temperature", json.dumps({"id": "b", "prompt": "x", "sampling": {"temperature": -1}}).encode(),
     2, "sampling.temperature", "greater than or equal to 0"),
    ("too-many-logprobs", json.dumps({"id": "b", "prompt": "x", "sampling": {"logprobs": 50}}).encode(),
     2, "sampling.logprobs", "less than or equal to 20"),
    ("string-max-tokens", json.dumps({"id": "b", "prompt": "x", "sampling": {"max_tokens": "ten"}}).encode(),
     2, "sampling.max_tokens", "valid integer"),
    ("unknown-sampling-key", json.dumps({"id": "b", "prompt": "x", "sampling": {"beam_width": 4}}).encode(),
     2, "sampling.beam_width", "unknown field"),
    ("bad-role", json.dumps({"id": "b", "messages": [{"role": "robot", "content": "hi"}]}).encode(),
     2, "messages[0].role", "system"),
    ("not-an-object", b'["id", "b"]', 2, None, "must be a JSON object"),
]


def _write(tmp_path: Path, name: str, bad: bytes) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + bad + b"\n")
    return path


@pytest.mark.parametrize("name,bad,line,field,words", BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_bad_line_is_reported_with_file_line_and_field(tmp_path, name, bad, line, field, words):
    path = _write(tmp_path, name, bad)
    prompt_set, problems = check_prompt_set(path)
    assert prompt_set is None
    assert len(problems) == 1
    problem = problems[0]
    assert problem.file == str(path) and problem.line == line and problem.field == field
    assert words in str(problem)
    assert f"{path}:{line}" in str(problem)


@pytest.mark.parametrize("name,bad,line,field,words", BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_validate_and_golden_exit_2_and_write_nothing(tmp_path, fixture_model, name, bad, line, field, words):
    path = _write(tmp_path, name, bad)
    result = run_cli("validate", str(path))
    assert result.returncode == 2
    assert f"{path}:{line}" in result.stderr
    if field:
        assert f"field '{field}'" in result.stderr
    assert "Traceback" not in result.stderr

    write_params(tmp_path, model=fixture_model)
    out = tmp_path / "golden-out"
    result = run_cli("golden", "--dataset", str(path), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{path}:{line}" in result.stderr
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "params.yaml"])


def test_all_problems_are_listed_by_validate(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), "{oops", json.dumps({"id": "a", "prompt": "dup"}),
                               json.dumps({"id": "c"})]) + "\n")
    result = run_cli("validate", str(path))
    assert result.returncode == 2
    for line in (2, 3, 4):
        assert f"{path}:{line}" in result.stderr
    with pytest.raises(DatasetError, match=r"and 2 more problem"):
        load_prompt_set(path)


def test_empty_file_and_missing_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert "no prompts" in str(check_prompt_set(empty)[1][0])
    result = run_cli("validate", str(tmp_path / "nope.jsonl"))
    assert result.returncode == 2 and "no such file" in result.stderr


def test_bad_card_names_file_line_and_field(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "set.yaml").write_text("description: x\ndefaults:\n  temperature: 0\n  top_p: 3\n")
    _, problems = check_prompt_set(path)
    assert str(problems[0]).startswith(f"{tmp_path / 'set.yaml'}:4: field 'defaults.top_p'")


def test_demo_prompt_set_is_valid_and_varied():
    """The main job's set, written for a real instruct model."""
    prompt_set = load_prompt_set(DEMO_PROMPTS)
    assert len(prompt_set) >= 100
    tags = {t for p in prompt_set.prompts for t in p.tags}
    assert {"qa", "multi-turn", "chinese", "code", "format", "long-context", "completion"} <= tags
    assert sum(1 for p in prompt_set.prompts if p.expected) >= 60
    assert any(p.messages and len(p.messages) >= 3 for p in prompt_set.prompts)
    assert prompt_set.card.defaults.temperature == 0
    result = run_cli("validate", str(DEMO_PROMPTS))
    assert result.returncode == 0 and f"ok, {len(prompt_set)} prompts" in result.stdout


def test_fixture_prompt_set_is_valid_and_varied():
    """The fast tests' set, written for the fixture model's corpus."""
    prompt_set = load_prompt_set(FIXTURE_PROMPTS)
    tags = {t for p in prompt_set.prompts for t in p.tags}
    assert {"english", "chinese", "code", "long-context", "chat"} <= tags
    assert any(p.messages for p in prompt_set.prompts)
    assert prompt_set.card.defaults.temperature == 0
    result = run_cli("validate", str(FIXTURE_PROMPTS))
    assert result.returncode == 0 and "ok, 40 prompts" in result.stdout


def test_sampling_layers_prompt_over_dataset_over_candidate(tmp_path):
    from regress.records import CandidateSpec
    from regress.replay import resolve_sampling

    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "x", "sampling": {"max_tokens": 7}}) + "\n"
                    + json.dumps({"id": "b", "prompt": "y"}) + "\n")
    (tmp_path / "s.yaml").write_text("defaults:\n  max_tokens: 20\n  logprobs: 3\n")
    candidate = CandidateSpec(name="c", model="m", sampling={"max_tokens": 99, "temperature": 0.5, "logprobs": 9})
    a, b = resolve_sampling(load_prompt_set(path), candidate)
    assert (a.max_tokens, a.logprobs, a.temperature) == (7, 3, 0.5)
    assert (b.max_tokens, b.logprobs, b.temperature) == (20, 3, 0.5)
    assert ResolvedSampling().temperature == 0.0
