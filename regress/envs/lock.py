"""The per-environment file lock.

One process at a time builds, adopts, verifies or removes an environment."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from typing import Iterator

from regress.envs.spec import EnvSpec, envs_root


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
