"""``regress worker``: one Celery worker process, one engine at a time (one per GPU).

The worker runs tasks in its own main process (the ``solo`` pool), one shard at a time: the
engine it keeps warm lives in a subprocess of that process, never inside a prefork child.
For several GPUs, start one worker per GPU (``CUDA_VISIBLE_DEVICES=N regress worker ...``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from regress.worker.settings import CelerySettings


def run_worker(
    settings: CelerySettings,
    *,
    queues: list[str],
    name: str | None = None,
    max_engines: int = 1,
    loglevel: str = "INFO",
    params: Path | None = None,
) -> None:
    """Start a worker in this process and serve until stopped (SIGTERM: finish the shard, exit).

    Refuses to start (:class:`~regress.errors.ConfigError`) on a password-less broker off
    loopback or without a signing key, unless the settings allow it. ``params``: the worker's
    own params.yaml, where watch tasks take their configuration (check command, state, webhook)
    from; never from a message."""
    # Read by regress.worker.tasks when it is imported (by the worker, below).
    os.environ["REGRESS_WORKER_MAX_ENGINES"] = str(max_engines)
    if params is not None and params.is_file() and not os.environ.get("REGRESS_WATCH_PARAMS"):
        os.environ["REGRESS_WATCH_PARAMS"] = str(params.resolve())
    from celery.signals import worker_shutdown

    from regress.worker.app import app, check_worker, configure

    configure(app, settings)
    check_worker(settings)

    @worker_shutdown.connect
    def _close_engines(**_: object) -> None:
        from regress.worker.tasks import engines

        engines.close()

    hostname = name or f"regress-{os.getpid()}@{socket.gethostname()}"
    app.worker_main([
        "worker",
        "--pool=solo",
        "--concurrency=1",
        f"--queues={','.join(queues)}",
        f"--hostname={hostname}",
        f"--loglevel={loglevel}",
        # Workers do not need to know about each other; gossip and mingle only slow start-up.
        "--without-gossip",
        "--without-mingle",
    ])
