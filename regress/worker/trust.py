"""What a broker message may choose on a worker, and what it may not.

params.yaml is trusted: whoever writes it runs the check on their own machine. A message is
not, even a signed one (a leaked key, a compromised sender): a worker validates every
candidate it receives with params.yaml's own rules (:class:`~regress.records.CandidateSpec`),
then refuses what would let a message choose code, commands or where files go:

- engine ``env`` keys that steer loaders and interpreters (``LD_PRELOAD``, ``PYTHONPATH``, ...)
  or name directories (``*_HOME``, ``*_DIR``, ...): set those in the worker's own environment;
- requirements that are not plain ``name[extras] <specifier>`` (direct URLs ``x @ URL``, pip
  options such as ``--index-url`` or ``-e``, local paths);
- backends given as ``module:Class`` (registered names only);
- engine arguments that load code (``trust_remote_code``, ``worker_cls``, ...);
- any path to write outside the worker's results directory (``celery.results_dir``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import ValidationError

from regress.errors import MessageRefused
from regress.records import CURRENT_ENVIRONMENT, CandidateSpec

DENIED_ENV = frozenset({
    "PATH", "BASH_ENV", "ENV", "SHELL", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "CDPATH", "HOME",
    "GCONV_PATH", "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS",
    "TMPDIR", "OPENSSL_CONF", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE", "UV_INDEX_URL",
    "HF_ENDPOINT", "HF_TOKEN", "VLLM_PLUGINS",
})
"""Environment variables a message may never set for an engine."""
DENIED_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON", "MALLOC_", "GLIBC_", "REGRESS_", "PIP_", "UV_", "CELERY_")
"""Whole families: the dynamic loader, the interpreter (``PYTHONWARNINGS`` imports modules too)."""
DENIED_ENV_SUFFIXES = ("PATH", "_HOME", "_DIR", "_ROOT", "_CACHE", "_FILE", "_CONFIG")
"""Variables that name files or directories (caches, configs): a message must not choose them."""
DENIED_ENGINE_ARGS = frozenset({
    "trust_remote_code", "worker_cls", "worker_extension_cls", "distributed_executor_backend",
    "logits_processors", "download_dir", "model_loader_extra_config", "hf_overrides", "code_revision",
    "allowed_local_media_path", "compilation_config",
})
"""Engine arguments that import or download code, or write where they like."""

_PLAIN_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,\s-]*\])?\s*([<>=!~]=?[^;@\s,]+(\s*,\s*[<>=!~]=?[^;@\s,]+)*)?$")


def denied_env_key(key: str) -> bool:
    """Whether a message may not set ``key`` in an engine's environment."""
    upper = key.upper()
    return (upper in DENIED_ENV or upper.startswith(DENIED_ENV_PREFIXES) or upper.endswith(DENIED_ENV_SUFFIXES)
            or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key))


def requirement_problem(text: str) -> str | None:
    """Why ``text`` is not a plain requirement a message may ask pip for (``None``: it is)."""
    stripped = text.strip()
    if stripped.startswith("-"):
        return f"pip option {stripped.split()[0]!r}"
    try:
        parsed = Requirement(stripped)
    except InvalidRequirement:
        return "not a requirement (a path or URL?)"
    if parsed.url:
        return "a direct URL (name @ URL)"
    if parsed.marker is not None or not _PLAIN_REQUIREMENT.match(stripped):
        return "not a plain 'name[extras] specifier' requirement"
    return None


def untrusted_candidate(data: Any, where: str) -> CandidateSpec:
    """A candidate from a broker message: params.yaml's validation, then the message's limits."""
    if not isinstance(data, dict):
        raise MessageRefused(f"{where}: the candidate is not an object")
    try:
        candidate = CandidateSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise MessageRefused(f"{where}: invalid candidate: field '{field}': {first['msg']}") from None
    problems: list[str] = []
    for key in candidate.env:
        if denied_env_key(key):
            problems.append(f"env '{key}' (loader, interpreter or path variables come from the worker's own "
                            "environment, never from a message)")
    for requirement in ([candidate.package] if candidate.package != CURRENT_ENVIRONMENT else []) + candidate.requirements:
        problem = requirement_problem(requirement)
        if problem:
            problems.append(f"requirement {requirement!r}: {problem}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", candidate.backend):
        problems.append(f"backend {candidate.backend!r} (registered backend names only, not module:Class)")
    for arg in candidate.engine_args:
        if arg in DENIED_ENGINE_ARGS:
            problems.append(f"engine argument '{arg}' (loads code or chooses where files go)")
    if problems:
        raise MessageRefused(f"{where}: candidate '{candidate.name}' refused: " + "; ".join(problems))
    return candidate


def inside(root: Path, path: str | Path, what: str, where: str) -> Path:
    """``path`` resolved (symlinks included); :class:`MessageRefused` unless it lies below ``root``."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise MessageRefused(f"{where}: {what} is missing")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root):
        raise MessageRefused(f"{where}: {what} {str(path)!r} is outside this worker's results directory {root} "
                             "(celery.results_dir / REGRESS_RESULTS_DIR)")
    return resolved
