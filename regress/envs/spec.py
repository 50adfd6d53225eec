"""What names and locates a candidate environment: its spec, cache key, directory and marker.

See :mod:`regress.envs` for how environments are built, layered and checked.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from regress.errors import ConfigError
from regress.home import regress_home
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec

ENV_MARKER = "regress-env.json"
# Not part of the cache key (ENV_FORMAT_VERSION is): recording digests must not orphan every
# cached environment, which would cost each machine a rebuild of several minutes per spec.
ENV_MANIFEST = "regress-env.files.json"
ENV_FORMAT_VERSION = 1


FOREIGN_INTERPRETER_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
"""Variables of this process that a candidate environment's interpreter must not inherit: the
paths would point it at regress's own environment, and its environment is installed without
bytecode (regress.envs.build), so its processes write bytecode as they import."""


def envs_root() -> Path:
    """Where candidate environments live."""
    return regress_home() / "envs"


@dataclass(frozen=True)
class EnvSpec:
    """What defines a candidate environment."""

    package: str
    requirements: tuple[str, ...] = ()
    layered: bool = False
    """``requirements`` go into a thin environment over the cached environment of ``package``
    alone (see :mod:`regress.envs`, "Layers")."""

    @classmethod
    def for_candidate(cls, candidate: CandidateSpec) -> "EnvSpec":
        return cls(candidate.package, tuple(candidate.requirements), layered=candidate.layered)

    @property
    def base(self) -> "EnvSpec":
        """The environment a layered spec is layered over (``package`` alone)."""
        return EnvSpec(self.package)

    def validate(self) -> None:
        """Raise ConfigError when a requirement does not parse as a pip requirement, or when a
        layered spec has nothing to layer or nothing to layer over."""
        if self.layered:
            if self.package.strip() == CURRENT_ENVIRONMENT:
                raise ConfigError(f"'layered' needs a package spec to layer over, not '{CURRENT_ENVIRONMENT}'",
                                  field="layered")
            if not self.requirements:
                raise ConfigError("'layered' needs 'requirements': they are what goes into the layer", field="layered")
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
        if self.layered:  # only when set: every environment made before layers keeps its key
            payload["layered"] = True
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

    def dirname(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", self.package).strip("-")[:60] or "env"
        if self.layered:
            layer = re.sub(r"[^A-Za-z0-9.]+", "-", " ".join(self.requirements)).strip("-")[:40]
            return f"{slug}-layer-{layer}-{self.key()}"
        return f"{slug}-{self.key()}"

    def describe(self) -> str:
        if self.layered:
            return f"{' '.join(self.requirements)} layered over {self.package}"
        return " ".join((self.package, *self.requirements))


@dataclass(frozen=True)
class CandidateEnv:
    """A complete candidate environment (its marker says the build finished)."""

    path: Path
    spec: EnvSpec
    info: dict

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def has_digest(self) -> bool:
        """Whether a content digest was recorded (environments made before digests have none)."""
        return "integrity" in self.info


@dataclass(frozen=True)
class EnvCheck:
    """What a verification of an environment looked at."""

    files: int
    """Entries (files, links) compared with the record."""
    hashed: int
    """How many of them were hashed again."""
    bytes_hashed: int
    seconds: float
    adopted: bool = False
    """No digest was recorded before: this verification recorded one from the current content."""
    base: "EnvCheck | None" = None
    """For a layer: the check of the environment it is layered over."""


def env_path(spec: EnvSpec) -> Path:
    """Directory of the environment for ``spec`` (whether or not it exists)."""
    return envs_root() / spec.dirname()


def _read_marker(path: Path, spec: EnvSpec) -> CandidateEnv | None:
    """The environment at ``path`` if its marker says it is complete (nothing verified yet)."""
    marker = path / ENV_MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(info, dict) or not (path / "bin" / "python").exists():
        return None
    # The marker says which spec it was built for: an environment copied or moved under another
    # spec's directory (its own content record intact) is not that spec's environment.
    for field, want in (("package", spec.package), ("key", spec.key())):
        if info.get(field) != want:
            from regress.errors import CandidateEnvError

            raise CandidateEnvError(
                f"the environment at {path} was built for {field} {str(info.get(field))[:80]!r}, not "
                f"{want!r} ('{spec.describe()}'): it was copied or moved there. regress runs no code from it; "
                f"delete {path} (the next use rebuilds it)")
    return CandidateEnv(path, spec, info)


def cached_env(spec: EnvSpec) -> CandidateEnv | None:
    """The environment for ``spec`` if its marker says the build finished; not verified (hand it
    to :func:`verify_env`). Code is run only from what :func:`find_env` or :func:`ensure_env` return."""
    return _read_marker(env_path(spec), spec)


def layers_over(spec: EnvSpec) -> list[CandidateEnv]:
    """The complete layered environments built over the environment for ``spec`` (listed, not verified)."""
    path = str(env_path(spec))
    return [env for env in list_envs() if env.spec.layered and (env.info.get("base") or {}).get("path") == path]


def list_envs() -> list[CandidateEnv]:
    """All complete environments under :func:`envs_root` (listed, not verified)."""
    found = []
    root = envs_root()
    if not root.is_dir():
        return []
    for marker in sorted(root.glob(f"*/{ENV_MARKER}")):
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
            spec = EnvSpec(info["package"], tuple(info.get("requirements", ())), layered=info.get("layered") is True)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            continue
        found.append(CandidateEnv(marker.parent, spec, info))
    return found
