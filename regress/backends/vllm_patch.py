"""Wrappers on vLLM internals: installed once, kept only where a probe confirms them.

Used by regress.backends.vllm_scored_positions and regress.backends.vllm_prefix_cache, whose
probes run on the loaded engine.

Runs in candidate environments: the standard library only.
"""

from __future__ import annotations

from typing import Any, Callable


def wrap(owner: Any, name: str, make: Callable[[Any], Any], mark: str) -> bool:
    """Replace ``owner.name`` by ``make(original)``, the original kept under ``mark``; once only.
    False where ``owner`` has no such method."""
    method = getattr(owner, name, None)
    if method is None:
        return False
    if not hasattr(method, mark):
        wrapped = make(method)
        setattr(wrapped, mark, method)
        setattr(owner, name, wrapped)
    return True


def unwrap(owner: Any, name: str, mark: str) -> None:
    """Put back what :func:`wrap` replaced (nothing where it did not)."""
    method = getattr(owner, name, None)
    if method is not None and hasattr(method, mark):
        setattr(owner, name, getattr(method, mark))


def verified(install: Callable[[], str | None], verify: Callable[[], str | None],
             uninstall: Callable[[], None]) -> str | None:
    """Install and verify; on any failure leave vLLM as it was. Returns the reason, else None."""
    reason = install()
    if reason is not None:
        return reason
    try:
        reason = verify()
    except Exception as exc:  # noqa: BLE001 - any failure means: do without the wrapper
        reason = f"the probe failed: {type(exc).__name__}: {exc}"
    if reason is not None:
        uninstall()
    return reason
