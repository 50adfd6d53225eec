"""Every phase of a check has a deadline: a real hang, through the real `regress` command, is exit 3
naming the phase and the limit, with the engine killed and nothing half-written.

The hangs are real: an engine backend plugin that stops in its engine process at load, generation
or teacher forcing (tests/plugins/hanging.py), a metric plugin whose score deadlocks inside C in
the orchestrator itself (tests/plugins/hanging_metric.py, registered through an entry point), and
pip waiting on a package index that never answers.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli
from hang_project import NO_SEMANTIC, is_alive, leftovers, wait_none_with, with_golden, write_project
from regress.errors import ConfigError


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deadlines")
    write_project(root)
    return with_golden(root, env={"REGRESS_HOME": str(root / "home")})


def _run(project: Path, *args: str, **env: str):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = run_cli(*args, cwd=project, env={"REGRESS_HOME": str(project / "home"), **env}, timeout=240)
    return result, time.monotonic() - started


def _assert_stopped_cleanly(project: Path, candidate: str, pid_file: Path) -> None:
    """The engine that hung is gone (found by its environment: it may have been stopped before it
    got to write its pid), and no run, score or report of the candidate is half-written."""
    left = wait_none_with("FAKE_HANG_PID_FILE", str(pid_file))
    assert left == [], f"processes of the command outlived it: {left}"
    assert not (project / "runs" / candidate).exists()  # never put in place
    partial = project / "runs" / f"{candidate}.partial"
    assert not (partial / "manifest.json").exists()  # an unfinished run stays a resumable .partial
    assert not (project / "scores" / candidate).exists() and not (project / "reports" / candidate).exists()
    assert leftovers(project) == []


@pytest.mark.parametrize(("candidate", "phase", "variable", "detail"), [
    ("hang-load", "engine start", "REGRESS_DEADLINE_ENGINE_START", "candidate 'hang-load'"),
    ("hang-generate", "generation", "REGRESS_DEADLINE_GENERATION", "shard 1 of 2"),
    ("hang-tf", "teacher forcing", "REGRESS_DEADLINE_TEACHER_FORCING", "shard 1 of 2"),
])
def test_a_hung_engine_is_exit_3_naming_the_phase(project, tmp_path, candidate, phase, variable, detail):
    pid_file = tmp_path / "engine.pid"
    result, seconds = _run(project, "check", candidate, **{variable: "3", "FAKE_HANG_PID_FILE": str(pid_file)})
    assert result.returncode == 3, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert f"phase '{phase}' ({detail}) did not finish within its deadline of 3 s" in message, message
    key = variable.removeprefix("REGRESS_DEADLINE_").lower()
    assert f"deadlines.{key} in params.yaml, or {variable}=SECONDS" in message
    assert "Traceback" not in result.stderr
    assert seconds < 90, seconds  # the deadline, not the engine's own 30-minute time-out
    _assert_stopped_cleanly(project, candidate, pid_file)
    assert "6 prompt(s) not run" in message and "run the command again to retry" in message


def test_a_deadline_in_params_yaml_applies_and_a_resumed_run_finishes(project, tmp_path):
    """The limit from params.yaml's deadlines: section; the hung check leaves the project as it was,
    so the next check of a candidate that does not hang runs to the end."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["deadlines"] = {"generation": 2, "grace": 5}
    (project / "params-deadline.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    pid_file = tmp_path / "engine.pid"
    result, _ = _run(project, "check", "hang-generate", "-p", "params-deadline.yaml",
                     FAKE_HANG_PID_FILE=str(pid_file))
    assert result.returncode == 3, result.stderr
    assert "phase 'generation' (shard 1 of 2) did not finish within its deadline of 2 s" in " ".join(result.stderr.split())
    _assert_stopped_cleanly(project, "hang-generate", pid_file)
    done, _ = _run(project, "check", "same", "-p", "params-deadline.yaml")
    assert done.returncode == 0, done.stderr
    assert (project / "runs" / "same" / "manifest.json").is_file()


def _hanging_metric_site(root: Path) -> Path:
    """A directory that registers tests/plugins/hanging_metric.py as the metric ``hang_in_c``
    through an entry point of the ``regress.metrics`` group (a dist-info, as pip writes one)."""
    info = root / "site" / "regress_hanging_metric-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: regress-hanging-metric\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[regress.metrics]\nhang_in_c = plugins.hanging_metric:hang_in_c\n")
    return root / "site"


def test_scoring_stuck_inside_c_is_ended_with_exit_3_and_a_stack_dump(tmp_path):
    """The orchestrator's own main thread deadlocked in C: no Python signal handler can run, so
    the watchdog writes the error and every thread's stack, and ends the process (exit 3)."""
    site = _hanging_metric_site(tmp_path)
    root = tmp_path / "project"
    write_project(root, thresholds={"metrics": [*NO_SEMANTIC, "hang_in_c"]},
                  extra={"deadlines": {"scoring": 2, "grace": 1}})
    home = tmp_path / "home"
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           "REGRESS_HOME": str(home)}
    with_golden(root, env=env)
    pid_file = tmp_path / "orchestrator.pid"
    started = time.monotonic()
    result = run_cli("check", "same", cwd=root, env={**env, "FAKE_HANG_PID_FILE": str(pid_file)}, timeout=240)
    seconds = time.monotonic() - started
    assert result.returncode == 3, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "phase 'scoring' (candidate 'same') did not finish within its deadline of 2 s" in message, message
    assert "deadlines.scoring in params.yaml" in message
    assert "stuck outside Python, so it was ended" in message
    assert seconds < 60, seconds
    logs = list((home / "logs").glob("hang-*.log"))
    assert len(logs) == 1 and str(logs[0]) in message
    dump = logs[0].read_text()
    assert "hanging_metric.py" in dump and "deadlock_in_c" in dump  # where the main thread was stuck
    assert not is_alive(int(pid_file.read_text()))
    # The replay had finished: its run is complete; the scoring that hung wrote nothing.
    assert (root / "runs" / "same" / "manifest.json").is_file()
    assert not (root / "scores" / "same").exists() and not (root / "reports" / "same").exists()
    assert leftovers(root) == []


def test_a_hung_environment_build_is_exit_3_and_pip_does_not_outlive_it(tmp_path, monkeypatch):
    """An environment whose pip waits on a package index that accepts the connection and never
    answers: the environment phase's deadline ends it, venv and pip with it."""
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)  # this machine's wheel directory: pip reads nothing else
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections are accepted by the kernel, never answered
    try:
        root = tmp_path / "project"
        write_project(root)
        params = yaml.safe_load((root / "params.yaml").read_text())
        params["candidates"]["needs-env"] = {"package": "regress-test-never==1.0"}
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        home = tmp_path / "home"
        result = run_cli("golden", "-c", "needs-env", cwd=root, timeout=240, env={
            "REGRESS_HOME": str(home), "REGRESS_DEADLINE_ENVIRONMENT": "8", "REGRESS_DEADLINE_GRACE": "10",
            "PIP_INDEX_URL": f"http://127.0.0.1:{silent.getsockname()[1]}/simple", "PIP_CONFIG_FILE": os.devnull,
            "PIP_DEFAULT_TIMEOUT": "600", "PIP_RETRIES": "0"})
    finally:
        silent.close()
    assert result.returncode == 3, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "phase 'environment' (regress-test-never==1.0) did not finish within its deadline of 8 s" in message, message
    still = wait_none_with("REGRESS_HOME", str(home), timeout_s=5)
    assert still == [], f"processes of the environment build still running: {still}"
    assert not list((home / "envs").glob("*/regress-env.json"))  # no environment looks complete
    assert not (root / "golden").exists()


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------


def test_defaults_are_generous_for_a_real_model_on_two_cores():
    from regress.deadlines import DeadlineSettings

    d = DeadlineSettings()
    assert d.engine_start >= 600 and d.generation >= 900 and d.environment >= 1800 and d.scoring >= 900


def test_environment_variables_override_and_are_validated():
    from regress.deadlines import DeadlineSettings

    d = DeadlineSettings(scoring=100).with_environment({"REGRESS_DEADLINE_SCORING": "7.5", "REGRESS_DEADLINE_GRACE": "2"})
    assert d.scoring == 7.5 and d.grace == 2 and d.report == DeadlineSettings().report
    for bad in ("abc", "0", "-3"):
        with pytest.raises(ConfigError) as refused:
            DeadlineSettings().with_environment({"REGRESS_DEADLINE_GENERATION": bad})
        assert refused.value.field == "REGRESS_DEADLINE_GENERATION" and repr(bad) in str(refused.value)


def test_a_bad_deadline_is_exit_2_with_its_line_before_anything_runs(tmp_path):
    root = tmp_path / "project"
    write_project(root, extra={"deadlines": {"scoring": -1}})
    result = run_cli("golden", cwd=root, env={"REGRESS_HOME": str(tmp_path / "home")}, timeout=120)
    assert result.returncode == 2, result.stderr
    line = next(i for i, text in enumerate((root / "params.yaml").read_text().splitlines(), 1) if "scoring: -1" in text)
    assert f"params.yaml:{line}: field 'deadlines.scoring'" in result.stderr
    write_project(root)
    result = run_cli("golden", cwd=root, env={"REGRESS_HOME": str(tmp_path / "home"), "REGRESS_DEADLINE_REPORT": "soon"},
                     timeout=120)
    assert result.returncode == 2 and "field 'REGRESS_DEADLINE_REPORT'" in result.stderr, result.stderr
    assert not (root / "golden").exists() and not (root / "golden.partial").exists()
