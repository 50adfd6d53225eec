"""One registry for every kind of plugin: metrics, engine backends, watch triggers.

A :class:`Registry` knows its built-ins as ``"module:attr"`` strings and finds other packages'
plugins through one entry-point group; nothing is imported until :meth:`Registry.get` asks for it,
and entry points are read once per process. A built-in name wins over an entry point of the same
name: installing a package must not silently replace how regress measures or runs.

Standard library only: :mod:`regress.backends` uses this inside candidate environments, where
regress's own dependencies may be missing.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from regress.errors import UnknownPluginError


class Registry:
    """Plugins of one kind (``metric``, ``backend``, ``trigger``) by name."""

    def __init__(self, kind: str, entry_point_group: str, builtin: Mapping[str, str]):
        self.kind = kind
        self.group = entry_point_group
        self._builtin = dict(builtin)
        self._added: dict[str, Any] = {}
        self._found: dict[str, tuple[str, str | None]] | None = None
        self._lock = threading.Lock()

    def _entry_points(self) -> dict[str, tuple[str, str | None]]:
        """Entry points of the group: name -> (target, distribution), read on first need."""
        with self._lock:
            if self._found is None:
                found: dict[str, tuple[str, str | None]] = {}
                for entry in metadata.entry_points(group=self.group):
                    dist = getattr(entry, "dist", None)
                    found.setdefault(entry.name, (entry.value, dist.name if dist is not None else None))
                self._found = found
        return self._found

    def register(self, name: str, obj: Any) -> None:
        """Add (or replace) ``name`` in this process only, with an object already imported."""
        self._added[name] = obj

    def names(self) -> list[str]:
        """Every registered name, built-ins first in their declared order, then the rest sorted."""
        others = (set(self._entry_points()) | set(self._added)) - set(self._builtin)
        return [*self._builtin, *sorted(others)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._added or name in self._builtin or name in self._entry_points())

    def target(self, name: str) -> str:
        """``module:attr`` of ``name``; raises :class:`UnknownPluginError` listing the known names."""
        if name in self._builtin:
            return self._builtin[name]
        found = self._entry_points().get(name)
        if found is None:
            raise UnknownPluginError(self.kind, name, self.names())
        return found[0]

    def distribution(self, name: str) -> str | None:
        """The installed distribution that provides ``name`` through an entry point (None: built in)."""
        if name in self._builtin:
            return None
        found = self._entry_points().get(name)
        return found[1] if found else None

    def get(self, name: str) -> Any:
        """The object registered as ``name``, importing its module now (ImportError passes through)."""
        if name in self._added:
            return self._added[name]
        return load(self.target(name))


def load(target: str) -> Any:
    """The object a ``package.module:attr`` string names (an entry point's ``[extras]`` ignored)."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    for part in attr.split("[", 1)[0].strip().split("."):
        if part:
            obj = getattr(obj, part)
    return obj
