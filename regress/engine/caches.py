"""Where an engine process keeps what vLLM and torch cache between starts.

Two kinds of cache, kept apart because only one of them is safe to share:

- **Data, parsed safely**: vLLM's model-class facts (``modelinfos/<class>.json``, read with
  ``json.load`` into a dataclass of flags, in ``vllm/model_executor/models/registry.py``). They
  stay in regress's home, one directory per environment (:func:`regress.home.vllm_cache_root`),
  so every later command reuses them.
- **Code**: vLLM's torch.compile cache under ``VLLM_CACHE_ROOT/torch_compile_cache`` (the AOT
  artifact ``rank_0_0/model`` is unpickled and its bytecode run,
  ``vllm/compilation/decorators.py`` -> ``torch.compiler.load_compiled_function``; the piecewise
  artifacts are ``pickle.loads``-ed, ``vllm/compilation/caching.py``), the Inductor cache vLLM
  points ``TORCHINDUCTOR_CACHE_DIR`` at inside it (generated ``.py`` modules imported, ``.so``
  files loaded, FX-graph and AOTAutograd entries unpickled), Inductor's own cache in eager mode
  (the same files, ``TORCHINDUCTOR_CACHE_DIR``) and torch's precompiled C++ headers (always
  ``$TMPDIR/torchinductor_<user>/precompiled_headers``, compiled into every kernel). Whoever can
  write any of these runs code in the engine. They go in ``$REGRESS_HOME/compile-cache``
  (:func:`code_cache_dir`), checked before every engine start to be this user's and writable
  by nobody else along its whole path (:func:`private_dir_problem`): as trusted as the candidate
  environments beside it, kept across commands so that a command does not compile again (13-19 s
  of every engine start on these CPUs, docs/benchmarks.md), and never ``/tmp/torchinductor_<user>``,
  which any local user can create first. A home where others could write gets a directory of the
  command's own instead (:func:`command_cache_dir`: ``mkdtemp``, 0700, removed with the process),
  with a warning.

``REGRESS_COMPILE_CACHE`` (:data:`COMPILE_CACHE_VARIABLE`) names another directory for them (a
job's own, ``mktemp -d``, to keep nothing compiled past the job): it is checked the same way and
refused (exit 2) when others could write there. A candidate's own ``env`` or the user's
``VLLM_CACHE_ROOT`` / ``TORCHINDUCTOR_CACHE_DIR`` still wins, unchecked: the user's choice.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from regress.errors import ConfigError
from regress.home import regress_home, vllm_cache_root

SHIM_PREFIX = "regress-shim-"
"""Prefix of an engine's private directory and of :func:`command_cache_dir`; the owner's pid
follows, so a directory whose owner died is removed by the next engine start."""

MODELINFOS = "modelinfos"
"""The one entry of ``VLLM_CACHE_ROOT`` that is data parsed as JSON, shared across commands."""

COMPILE_CACHE_VARIABLE = "REGRESS_COMPILE_CACHE"
"""Another directory for the code caches of all the engines (a job's own, to keep nothing compiled
past the job; else ``$REGRESS_HOME/compile-cache``): this user's, writable by nobody else."""

_command_dirs: dict[int, Path] = {}
_lock = threading.Lock()


CODE_CACHE = "compile-cache"
"""The code caches' directory in regress's home."""
_warned: set[str] = set()


def code_cache_dir() -> Path:
    """Where the engines' code caches go: :data:`COMPILE_CACHE_VARIABLE` when set (checked by
    :func:`checked_private_dir`), else ``$REGRESS_HOME/compile-cache`` (made 0700) when nobody
    else can write there, else this process's own directory (:func:`command_cache_dir`)."""
    chosen = os.environ.get(COMPILE_CACHE_VARIABLE)
    if chosen:
        return checked_private_dir(Path(chosen))
    home = regress_home() / CODE_CACHE
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = private_dir_problem(home)
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem is None:
        return home.absolute().resolve()
    if str(home) not in _warned:
        _warned.add(str(home))
        from regress.progress import warn

        warn(f"{home}: {problem}; engines load the code compiled there, so this command compiles into a "
             "directory of its own instead (each command compiles again: make that directory this user's, "
             "mode 700)")
    return command_cache_dir()


def command_cache_dir() -> Path:
    """This process's private directory for the engines' code caches, made on first use.

    Keyed by pid: a forked child (a Celery prefork worker) makes its own rather than sharing its
    parent's, whose exit removes it. Removed at exit; after a SIGKILL, by the next engine start
    (``remove_stale_shims``)."""
    pid = os.getpid()
    with _lock:
        path = _command_dirs.get(pid)
        if path is None or not path.is_dir():
            path = Path(tempfile.mkdtemp(prefix=f"{SHIM_PREFIX}{pid}-caches-"))
            _command_dirs[pid] = path
            atexit.register(_remove, pid, path)
        return path


def _remove(pid: int, path: Path) -> None:
    """At exit, in the process that made ``path`` only (a forked child inherits the handler)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def checked_private_dir(path: Path) -> Path:
    """``path`` resolved, once :func:`private_dir_problem` finds nothing; else
    :class:`~regress.errors.ConfigError` (exit 2) naming :data:`COMPILE_CACHE_VARIABLE`, since
    whoever can write there runs code in the engine."""
    problem = private_dir_problem(path)
    if problem:
        raise ConfigError(f"{COMPILE_CACHE_VARIABLE}={path}: {problem}. Engines load the code compiled there: "
                          "give it a directory of this job's own (mktemp -d), or unset it")
    return path.absolute().resolve()


def private_dir_problem(path: Path) -> str | None:
    """Why others could write into or replace ``path`` (None: only this user can): it must be a
    directory of this user's, not writable by its group or others, and every directory above it
    root's or this user's, writable by others only with the sticky bit (as ``/tmp``)."""
    resolved = path.absolute().resolve()
    uid = os.getuid()
    try:
        info = resolved.lstat()
        problem = None
        if not stat.S_ISDIR(info.st_mode):
            problem = "not a directory"
        elif info.st_uid != uid:
            problem = f"owned by uid {info.st_uid}, not by this user (uid {uid})"
        elif info.st_mode & 0o022:
            problem = f"writable by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
        for parent in resolved.parents if problem is None else ():
            above = parent.lstat()
            if above.st_uid not in (uid, 0):
                problem = f"{parent} is owned by uid {above.st_uid}, who could replace it"
            elif above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX:
                problem = f"{parent} is writable by its group or others (mode {stat.S_IMODE(above.st_mode):o})"
            if problem:
                break
    except OSError as exc:
        problem = exc.strerror or str(exc)
    return problem


CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")
"""The variables that say where an engine's code caches are."""


def _inherited_choice(env: dict[str, str], chosen: Mapping[str, str]) -> None:
    """Keep in ``env`` a cache variable the candidate sets (``chosen``: its ``env``), or one of the
    orchestrator's own that names a directory only this user can write; drop any other. torch
    itself writes ``TORCHINDUCTOR_CACHE_DIR`` into its process's environment when it first looks
    for its cache (``/tmp/torchinductor_<user>``, which anyone may have made first), so an
    inherited value is not known to be anyone's choice. An empty value is no value."""
    for name in CACHE_VARIABLES:
        if chosen.get(name):
            continue
        value = env.pop(name, "")
        if not value:
            continue
        try:  # made as torch would, then checked like any other (a parent others can write fails)
            Path(value).mkdir(mode=0o700, parents=True, exist_ok=True)
            problem = private_dir_problem(Path(value))
        except OSError as exc:
            problem = exc.strerror or str(exc)
        if problem is None:
            env[name] = value
        elif value not in _warned:
            _warned.add(value)
            from regress.progress import warn

            warn(f"{name}={value}: {problem}; engines load the code compiled there, so regress's own cache "
                 "is used instead")


def set_cache_environment(env: dict[str, str], *, python: Path, private_tmp: Path,
                          chosen: Mapping[str, str] = MappingProxyType({})) -> None:
    """Point the engine run by ``python`` at its caches, in ``env`` (the process's variables,
    ``TMPDIR`` already ``private_tmp``). ``chosen``: the candidate's own ``env``, whose cache
    variables win; the orchestrator's win only where nobody else can write (:func:`_inherited_choice`)."""
    _inherited_choice(env, chosen)
    own = code_cache_dir()
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(own / "torchinductor"))
    inductor = Path(env["TORCHINDUCTOR_CACHE_DIR"]).absolute()
    inductor.mkdir(parents=True, exist_ok=True)
    # torch puts its precompiled headers under TMPDIR/torchinductor_<user> whatever the variable
    # says. Without a place that outlives the engine, every start spent 5-6 s precompiling a
    # header inside its first generate call (py-spy on SmolLM2-135M): link it to Inductor's.
    (private_tmp / f"torchinductor_{_user()}").symlink_to(inductor, target_is_directory=True)
    if "VLLM_CACHE_ROOT" in env:  # the candidate's or the user's choice, code caches and all
        return
    # One root per environment, as regress.home.vllm_cache_root says why; its model-class facts
    # (JSON) link to the shared one so that they survive the command.
    shared = vllm_cache_root(python) / MODELINFOS
    root = own / "vllm" / shared.parent.name
    root.mkdir(parents=True, exist_ok=True)
    if not (root / MODELINFOS).is_symlink():
        shared.mkdir(parents=True, exist_ok=True)
        try:
            (root / MODELINFOS).symlink_to(shared, target_is_directory=True)
        except FileExistsError:  # another thread's engine of this environment got there first
            pass
    env["VLLM_CACHE_ROOT"] = str(root)


def _user() -> str:
    """The user name torch puts in its default cache directory name."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"
