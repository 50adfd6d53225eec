"""What a worker answers for a shard, checked before the orchestrator believes it.

A shard's reply comes back through the result backend (Redis), and its facts file through the
shared results directory: either can be written by anyone who can write there, not only by a
regress worker. Their facts (the engine's versions and hardware, its load time, its memory, the
environment it ran in, which worker ran it) go into the run's manifest, so each field is checked
here with the engine protocol's own rules; a reply that fails is refused whole, never repaired.
"""

from __future__ import annotations

import math
from typing import Any

from regress.engine.protocol import checked_engine_info, checked_memory
from regress.errors import ProtocolError
from regress.untrusted import printable

_FIELDS = {"index", "worker", "pid", "skipped", "stale", "engine_loaded", "engine_load_s", "engine_info",
           "environment", "memory", "cache_cleared"}


def _problem(reply: dict[str, Any]) -> str | None:
    unknown = sorted(set(reply) - _FIELDS)
    if unknown:
        return f"unknown field(s) {', '.join(map(repr, unknown))}"
    index, pid = reply.get("index"), reply.get("pid")
    if type(index) is not int or index < 0:
        return f"'index' must be an integer >= 0, got {index!r}"
    if type(pid) is not int or pid <= 0:
        return f"'pid' must be a process id, got {pid!r}"
    worker = reply.get("worker")
    if not isinstance(worker, str) or not 0 < len(worker) <= 255 or not worker.isprintable():
        return f"'worker' must be a printable name of at most 255 characters, got {worker!r}"
    for flag in ("skipped", "stale", "engine_loaded", "cache_cleared"):
        if flag in reply and not isinstance(reply[flag], bool):
            return f"'{flag}' must be true or false, got {reply[flag]!r}"
    load_s = reply.get("engine_load_s", 0.0)
    if isinstance(load_s, bool) or not isinstance(load_s, (int, float)) or not math.isfinite(load_s) or load_s < 0:
        return f"'engine_load_s' must be a finite number >= 0, got {load_s!r}"
    environment = reply.get("environment")
    # Where the worker's engine environment lives, on the worker: a path, nothing that could
    # be a command line or hide a line break in a log.
    if environment is not None and not (isinstance(environment, str) and environment.startswith("/")
                                        and environment.isprintable() and len(environment) <= 4096):
        return f"'environment' must be an absolute path or null, got {environment!r}"
    try:
        if reply.get("memory") is not None:
            checked_memory(reply["memory"], "memory")
        if reply.get("engine_info"):
            checked_engine_info(reply["engine_info"], "engine_info")
    except ProtocolError as exc:
        return str(exc)
    return None


def checked_reply(reply: Any, where: str) -> dict[str, Any]:
    """``reply`` if it is a worker's answer for a shard; else a ProtocolError saying ``where`` it
    came from and what is wrong (printable: the text is the sender's)."""
    problem = "not a JSON object" if not isinstance(reply, dict) else _problem(reply)
    if problem is not None:
        raise ProtocolError(printable(f"{where}: not a regress worker's shard reply: {problem}"[:600]))
    return reply
