"""One regress command at a time writes a project: a second one exits 2 naming the first (pid and
command), and a holder that died never blocks. Two real `regress` processes: the first holds the
project while its engine hangs (tests/plugins/hanging.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from hang_project import wait_for_file, wait_gone, with_golden, write_project


def lock_path(root: Path) -> Path:
    """Where the lock of a project of this module is (its commands run with REGRESS_HOME=<project>/home)."""
    from regress.project_lock import lock_path as regress_lock_path

    return regress_lock_path(root, home=root / "home")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("locked")
    write_project(root)
    return with_golden(root, env={"REGRESS_HOME": str(root / "home")})


def _start(project: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "regress.cli", *args], cwd=project, text=True,
                            env={**os.environ, "REGRESS_HOME": str(project / "home"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_second_command_on_the_project_exits_2_naming_the_first(project, tmp_path):
    pid_file = tmp_path / "engine.pid"
    first = _start(project, "check", "hang-generate", FAKE_HANG_PID_FILE=str(pid_file))
    try:
        engine = int(wait_for_file(pid_file, proc=first))  # the first is in its generation, holding the lock
        for second in (["replay", "hang-generate"], ["check", "same"], ["score", "same"], ["report"],
                       ["bisect", "some-plugin", "--good", "1.0", "--bad", "2.0", "--index-url",
                        "http://127.0.0.1:9/simple"]):
            result = run_cli(*second, cwd=project, env={"REGRESS_HOME": str(project / "home")}, timeout=120)
            assert result.returncode == 2, (second, result.stdout + result.stderr)
            message = " ".join(result.stderr.split())
            assert f"another regress command is writing this project (pid {first.pid} on " in message, message
            assert "`regress check hang-generate`" in message, message
            assert str(lock_path(project)) in message
        assert first.poll() is None  # the first one never noticed
        assert not (project / "runs" / "hang-generate").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    # A holder killed with SIGKILL leaves its lines in the lock file, but not the lock.
    assert wait_gone(engine)
    assert "regress check hang-generate" in lock_path(project).read_text()
    again = run_cli("replay", "same", cwd=project, env={"REGRESS_HOME": str(project / "home")}, timeout=120)
    assert again.returncode == 0, again.stderr
    assert lock_path(project).read_text() == ""  # released: no holder named


def test_commands_that_only_read_do_not_wait_for_the_lock(project):
    from regress.project_lock import project_lock

    with project_lock(project, "regress check elsewhere"):
        result = run_cli("diff", "same", cwd=project, env={"REGRESS_HOME": str(project / "home")}, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_holder_is_named_and_the_lock_is_reentrant_within_a_process(tmp_path, monkeypatch):
    from regress.errors import ProjectLocked
    from regress.project_lock import LockHolder, project_lock

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    with project_lock(tmp_path, "regress bisect pkg --good 1 --bad 2"):
        holder = LockHolder.model_validate_json(lock_path(tmp_path).read_text())
        assert holder.pid == os.getpid() and holder.command == "regress bisect pkg --good 1 --bad 2"
        assert not (tmp_path / ".regress").exists() and list(tmp_path.iterdir()) == [tmp_path / "home"]
        with project_lock(tmp_path, "inner"):  # a bisect's checks run inside its command
            pass
        assert LockHolder.model_validate_json(lock_path(tmp_path).read_text()).command.startswith("regress bisect")
        child = subprocess.run(
            [sys.executable, "-c", "import sys; from pathlib import Path; from regress.project_lock import project_lock\n"
             "with project_lock(Path(sys.argv[1]), 'child'): pass", str(tmp_path)],
            capture_output=True, text=True, timeout=60)
        assert child.returncode != 0 and "ProjectLocked" in child.stderr and f"pid {os.getpid()}" in child.stderr
    assert ProjectLocked.exit_code == 2
    with project_lock(tmp_path, "next"):  # released when the block ended
        pass
