"""A metric that hangs inside C, for the phase-deadline tests (tests/test_deadlines.py) only.

Its score locks a mutex it already holds, in C, with the GIL released (as two OpenVINO infer
requests deadlocked in ``InferRequest.infer`` did): no signal handler of the orchestrator's
Python runs while it waits, so only the watchdog's hard exit ends the command. Registered as a
real plugin (an entry point of the ``regress.metrics`` group, which the test writes).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from regress.metrics.base import metric


def deadlock_in_c() -> None:
    """Lock a default (non-recursive) pthread mutex twice: the second lock waits forever in C,
    and signals do not end the wait."""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on glibc
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


@metric("hang_in_c", outputs={"hang_in_c": "never computed: the score deadlocks in C"})
def hang_in_c():  # type: ignore[no-untyped-def]
    def score(pair):  # type: ignore[no-untyped-def]
        pid_file = os.environ.get("FAKE_HANG_PID_FILE")
        if pid_file:
            Path(pid_file).write_text(str(os.getpid()))
        deadlock_in_c()
        return {"hang_in_c": 0.0}

    return score
