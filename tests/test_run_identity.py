"""A stored result is used only as what it is: a run directory replaces only a run, a run and its
scoring are of the candidate they are filed under, and a scoring of replaced runs or an edited
prompt set never gates or shows as current.

The engine is the fake echo backend (no engine is needed to tell whose a file is); the real
engine's runs go through the same paths in test_replay_engine.py and test_pipeline.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_cli

PLUGIN_PATH = str(REPO / "tests")
METRICS = "[exact_tokens, divergence_point, prefix_logprobs, teacher_forced, surface]"


def _project(root: Path, *, shifted_gate: str = "auto") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt number {i}",
                                                      "expected": "number"}) + "\n" for i in range(10)))
    (root / "params.yaml").write_text(
        "dataset: p.jsonl\nshard_size: 4\nbaseline:\n  backend: plugins.fake_backends:EchoBackend\n"
        f"  model: none\n  env: {json.dumps({'PYTHONPATH': PLUGIN_PATH})}\n"
        "candidates:\n  same: {}\n"
        f"  shifted: {{gate: {shifted_gate}, env: {json.dumps({'PYTHONPATH': PLUGIN_PATH, 'FAKE_OUTPUT_OFFSET': '1'})}}}\n"
        f"thresholds:\n  metrics: {METRICS}\n")
    return root


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> Path:
    """A project whose golden, `same` (passes) and `shifted` (fails) are replayed and scored."""
    root = _project(tmp_path_factory.mktemp("identity") / "project")
    assert run_cli("golden", cwd=root).returncode == 0
    assert run_cli("check", "same", cwd=root).returncode == 0
    assert run_cli("check", "shifted", cwd=root).returncode == 1
    return root


@pytest.fixture
def project(checked: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "project"
    shutil.copytree(checked, copy, symlinks=True)
    return copy


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", [["golden", "--out", "mine"], ["replay", "same", "--out", "mine"]])
def test_a_directory_that_is_not_a_run_is_never_replaced(project: Path, command: list[str]) -> None:
    mine = project / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "thesis.txt").write_text("precious")
    (mine / "notes" / "a.md").write_text("also precious")
    before = _tree(mine)
    result = run_cli(*command, cwd=project)
    assert result.returncode == 2, result.stderr
    assert "not a regress run" in result.stderr and "thesis.txt" in result.stderr
    assert _tree(mine) == before and not (project / "mine.partial").exists()


def test_paths_golden_naming_the_prompt_sets_folder_keeps_the_prompt_set(tmp_path: Path) -> None:
    root = _project(tmp_path / "p")
    (root / "data").mkdir()
    (root / "p.jsonl").rename(root / "data" / "p.jsonl")
    text = (root / "params.yaml").read_text().replace("dataset: p.jsonl", "dataset: data/p.jsonl")
    (root / "params.yaml").write_text(text + "paths:\n  golden: data\n")
    result = run_cli("golden", cwd=root)
    assert result.returncode == 2, result.stderr
    assert (root / "data" / "p.jsonl").is_file()


def test_an_empty_directory_and_an_earlier_run_are_replaced(project: Path) -> None:
    (project / "empty").mkdir()
    assert run_cli("golden", "--out", "empty", cwd=project).returncode == 0
    assert (project / "empty" / "manifest.json").is_file()
    result = run_cli("golden", "--out", "empty", "--force", cwd=project)
    assert result.returncode == 0, result.stderr


def test_a_linked_golden_stays_a_link_and_force_replaces_its_target(project: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared-golden"
    shutil.move(project / "golden", shared)
    (project / "golden").symlink_to(shared)
    before = json.loads((shared / "manifest.json").read_text())["run_id"]
    result = run_cli("golden", "--force", cwd=project)
    assert result.returncode == 0, result.stderr
    assert (project / "golden").is_symlink() and (project / "golden").resolve() == shared.resolve()
    assert json.loads((shared / "manifest.json").read_text())["run_id"] != before
    assert not list(project.glob(".golden.old*")) and not list(tmp_path.glob(".shared-golden.old*"))


def test_a_run_is_scored_only_under_its_own_candidates_name(project: Path) -> None:
    before = (project / "scores" / "shifted" / "metrics.json").read_bytes()
    result = run_cli("score", "shifted", "--run", "runs/same", "--no-report", cwd=project)
    assert result.returncode == 2
    assert "is a run of candidate 'same', not of 'shifted'" in " ".join(result.stderr.split())
    assert (project / "scores" / "shifted" / "metrics.json").read_bytes() == before


def test_the_gate_refuses_another_candidates_scoring_under_a_name(project: Path) -> None:
    shutil.rmtree(project / "scores" / "shifted")
    shutil.copytree(project / "scores" / "same", project / "scores" / "shifted")
    result = run_cli("gate", "shifted", cwd=project)
    assert result.returncode == 2 and "PASS" not in result.stdout
    assert "field 'candidate' is 'same'" in " ".join(result.stderr.split())


def test_the_gate_refuses_a_scoring_older_than_the_candidates_gate(project: Path) -> None:
    (project / "params.yaml").write_text((project / "params.yaml").read_text().replace("gate: auto", "gate: quality"))
    result = run_cli("gate", "shifted", cwd=project)
    assert result.returncode == 2
    assert "gates 'shifted' on 'quality'" in " ".join(result.stderr.split())


@pytest.mark.parametrize("edit", ["answers", "truncated"])
def test_score_refuses_a_prompt_set_changed_since_the_golden(project: Path, edit: str) -> None:
    prompts = project / "p.jsonl"
    if edit == "answers":
        prompts.write_text(prompts.read_text().replace('"expected": "number"', '"expected": "ovncfs"'))
    else:
        prompts.write_text("".join(prompts.read_text().splitlines(keepends=True)[:5]))
    before = _tree(project / "scores")
    result = run_cli("score", "shifted", "--no-report", cwd=project)
    assert result.returncode == 2
    assert "changed since the golden" in result.stderr
    assert _tree(project / "scores") == before


@pytest.mark.parametrize("command", [["score", "shifted", "--no-report"], ["check", "shifted"]])
def test_a_missing_prompt_set_is_an_input_error_not_a_scoring_without_answers(project: Path, command) -> None:
    """Its expected answers are what the quality verdict judges (`shifted` is gated on it): scored
    without them, the verdict fell back to fidelity and said nothing of the set being gone."""
    (project / "p.jsonl").unlink()
    before = _tree(project / "scores")
    result = run_cli(*command, cwd=project)
    assert result.returncode == 2, result.stderr
    text = " ".join(result.stderr.split())
    assert "p.jsonl" in text
    if command[0] == "score":  # a check stops sooner, at the replay's own reading of the set
        assert "field 'dataset'" in text and "p.jsonl is missing" in text and "dvc pull" in text
    assert _tree(project / "scores") == before


def test_a_scoring_of_a_replaced_run_neither_gates_nor_renders(project: Path) -> None:
    # `same` replayed again with other outputs: its stored PASS is of outputs that are gone.
    params = project / "params.yaml"
    params.write_text(params.read_text().replace("  same: {}", "  same: {env: "
                                                 + json.dumps({"PYTHONPATH": PLUGIN_PATH, "FAKE_OUTPUT_OFFSET": "2"}) + "}"))
    assert run_cli("replay", "same", cwd=project).returncode == 0
    gate = run_cli("gate", "same", cwd=project)
    assert gate.returncode == 2 and "PASS" not in gate.stdout
    assert "the scoring is of outputs that were replaced" in " ".join(gate.stderr.split())
    report = run_cli("report", "same", cwd=project)
    assert report.returncode == 2 and "run `regress score same`" in " ".join(report.stderr.split())
    assert run_cli("score", "same", "--no-report", cwd=project).returncode == 0
    assert run_cli("gate", "same", cwd=project).returncode == 1


def test_annotations_come_only_from_the_report_of_this_scoring(project: Path) -> None:
    # `shifted` now gives the golden's outputs and is scored without a report: the failing
    # junit.xml of its earlier scoring must not annotate a PASS.
    params = project / "params.yaml"
    params.write_text(params.read_text().replace("'FAKE_OUTPUT_OFFSET': '1'", "'FAKE_OUTPUT_OFFSET': '0'")
                      .replace('"FAKE_OUTPUT_OFFSET": "1"', '"FAKE_OUTPUT_OFFSET": "0"'))
    assert run_cli("replay", "shifted", cwd=project).returncode == 0
    assert run_cli("score", "shifted", "--no-report", cwd=project).returncode == 0
    result = run_cli("gate", "shifted", "--annotate", cwd=project)
    assert result.returncode == 0, result.stderr
    assert "::error" not in result.stdout
    assert "no annotations for 'shifted'" in " ".join(result.stderr.split())
    assert run_cli("report", "shifted", cwd=project).returncode == 0
    assert "::error" not in run_cli("gate", "shifted", "--annotate", cwd=project).stdout
