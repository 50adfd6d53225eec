"""The worker's side of a replay: run one shard in a warm engine, write its result file.

A task carries everything the shard needs as JSON (the candidate, the engine request, where
to write): workers share no state with the orchestrator but the results directory. A shard
whose result file is already there with the same fingerprint and run id is not run again, so
a redelivered message (a worker died after writing, before acknowledging) costs nothing.

Nothing in a message is trusted (:mod:`regress.worker.trust`): the candidate is validated like
params.yaml and may not choose loader variables, direct-URL requirements or ``module:Class``
backends; every path must lie in the worker's results directory, inside a run directory an
orchestrator prepared (its ``plan.json``), for the run id written there: a message of an
earlier attempt (before ``--force``) is dropped without writing anything. Before an environment
or engine starts, whatever the candidate names (model, tokenizer, chat template, server URL and
key variable, text-valued engine arguments) must come from the worker's own params. Besides
the shard file, the worker writes the engine's facts for the shard
(``engine-facts/shard-NNNNN.json``), so an orchestrator that died and runs again can finish the
run from files alone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from celery.utils.log import get_task_logger

from regress.engine.protocol import ProtocolError, ShardRequest, request_from_dict
from regress.errors import EngineError, InputError, MessageRefused, RegressError, ShardFailed
from regress.home import regress_home
from regress.records import CandidateSpec
from regress.replay import PLAN_FILE, shard_file_matches
from regress.replay.warm import WarmEngines, configuration_digest
from regress.runs import SHARDS_DIR, VOCAB_FILE
from regress.storage import atomic_write_text, read_shard_meta
from regress.worker.app import TASK_REPLAY_SHARD, app
from regress.worker.executor import ENGINE_FACTS_DIR
from regress.worker.settings import CelerySettings
from regress.worker.trust import from_own_configuration, inside, untrusted_candidate, worker_configuration

logger = get_task_logger(__name__)

# Stop a shard this far before the visibility timeout, so Redis never hands a shard that is
# still running to a second worker.
_VISIBILITY_MARGIN = 0.9


def _engine_log(candidate: CandidateSpec) -> Path:
    """This worker's log of ``candidate``'s engine (one per worker process and configuration)."""
    return (regress_home() / "logs" / f"worker-{socket.gethostname()}-{os.getpid()}"
            / f"{candidate.name}-{configuration_digest(candidate)}.log")


engines = WarmEngines(keep=int(os.environ.get("REGRESS_WORKER_MAX_ENGINES", "1")), failure_ttl_s=300)
"""This worker process's warm engines (the solo pool runs every task in this process): one per
engine configuration, up to ``--max-engines`` (one GPU rarely holds two), so a worker serving the
shards of one candidate loads its engine once per run, not once per shard; an engine that failed
to start for a reason other than a crash is not tried again for 5 minutes."""


def engine_facts_file(run_dir: Path, index: int) -> Path:
    return run_dir / ENGINE_FACTS_DIR / f"shard-{index:05d}.json"


def results_root(settings: CelerySettings | None = None) -> Path:
    """The directory this worker writes under (``celery.results_dir``; default: its cwd)."""
    settings = settings or CelerySettings(**app.conf.regress_settings)
    return Path(settings.results_dir or os.getcwd()).expanduser().resolve()


def _file_run_id(path: Path) -> str | None:
    try:
        return read_shard_meta(path).get("run_id")
    except (OSError, ValueError):
        return None


def _checked_paths(payload: dict[str, Any], request: ShardRequest, root: Path, where: str) -> tuple[Path, Path, str | None]:
    """(shard file, run directory, run id on disk): every path of the message resolved inside
    ``root``, the shard file in the run's ``shards/`` and the vocabulary beside it."""
    out = inside(root, request.out, "shard file", where)
    run_dir = out.parent.parent
    if out.parent.name != SHARDS_DIR or out.name != f"shard-{request.index:05d}.shard" or not run_dir.is_relative_to(root):
        raise MessageRefused(f"{where}: shard file {request.out!r} is not <run>/{SHARDS_DIR}/shard-{request.index:05d}.shard")
    vocab = payload.get("vocab_out")
    if vocab is not None and inside(root, vocab, "vocabulary file", where) != run_dir / VOCAB_FILE:
        raise MessageRefused(f"{where}: vocabulary file {vocab!r} is not {run_dir / VOCAB_FILE}")
    try:
        on_disk = json.loads((run_dir / PLAN_FILE).read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        on_disk = None
    return out, run_dir, on_disk


def run_shard(payload: dict[str, Any], *, deadline: float | None = None, max_restarts: int = 1,
              worker: str | None = None, root: Path | None = None) -> dict[str, Any]:
    """Run one shard described by ``payload`` (see CeleryExecutor); returns facts for the manifest.

    ``worker``: this worker's name (``regress worker --name``), for messages and the manifest.
    ``root``: the results directory (default: the worker's ``celery.results_dir``)."""
    worker = worker or socket.gethostname()
    where = f"worker {worker}"
    if not isinstance(payload, dict):
        raise MessageRefused(f"{where}: malformed task: the payload is not an object")
    candidate = untrusted_candidate(payload.get("candidate"), where)
    request = _shard_request(payload.get("message"), f"{where}: candidate '{candidate.name}'")
    root = results_root() if root is None else root
    out, run_dir, run_on_disk = _checked_paths(payload, request, root, f"{where}: candidate '{candidate.name}'")
    run_id = request.meta.get("run_id")
    base = {"index": request.index, "worker": worker, "pid": os.getpid()}
    if not out.parent.is_dir():
        raise ShardFailed(f"{where}: candidate '{candidate.name}': the results directory {out.parent} is not there; "
                          "workers need the orchestrator's results directory (shared storage)")
    if run_on_disk is None or run_on_disk != run_id:
        # The run directory belongs to another attempt (``--force`` started over) or is no run
        # being built: writing would mix attempts. Nothing to do for this message.
        logger.warning("%s: shard %d of run %s dropped: %s holds run %s", where, request.index, run_id,
                       run_dir, run_on_disk)
        return {**base, "skipped": True, "stale": True}
    if shard_file_matches(out, request.meta.get("fingerprint", "")) and _file_run_id(out) == run_id:
        return {**base, "skipped": True}
    # Here, not earlier: a stale or finished shard runs nothing, whatever its candidate says.
    from_own_configuration(candidate, worker_configuration(where), where)
    payload = {**payload, "vocab_out": str(run_dir / VOCAB_FILE) if payload.get("vocab_out") else None}
    restarts = 0
    loaded_now = False
    while True:
        try:
            load_timeout = None if deadline is None else max(60.0, deadline - time.monotonic())
            warm, fresh = engines.acquire(candidate, log=_engine_log(candidate), load_timeout_s=load_timeout,
                                          on_status=lambda message: logger.info("%s: %s", where, message))
            if fresh:
                logger.info("engine for '%s' loaded in %.1f s", candidate.name, warm.load_s)
            engine = warm.engine
            loaded_now = loaded_now or fresh
            vocab = payload.get("vocab_out")
            if vocab and not Path(vocab).is_file():
                engine.write_vocabulary(vocab)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ShardFailed(f"{where}: candidate '{candidate.name}': no time left before the visibility timeout (environment or engine start too slow)")
            engine.run_shard(request, timeout_s=remaining)
            memory = engine.memory()
            reply = {**base, "skipped": False, "engine_loaded": loaded_now,
                     "engine_load_s": warm.load_s if loaded_now else 0.0,
                     "engine_info": warm.info, "environment": warm.environment, "memory": memory}
            if not fresh:  # an engine an earlier shard used: did it say it cleared its cache?
                reply["cache_cleared"] = warm.cache_cleared is True
            facts_file = engine_facts_file(run_dir, request.index)
            facts_file.parent.mkdir(exist_ok=True)
            atomic_write_text(facts_file, json.dumps(reply, default=str))
            return reply
        except ShardFailed:
            raise  # already says where and what; a RegressError, so it must pass the clauses below untouched
        except EngineError as exc:
            engines.discard(candidate)
            if deadline is not None and time.monotonic() >= deadline:
                raise ShardFailed(f"{where}: candidate '{candidate.name}': shard {request.index} did not finish "
                                  "before the visibility timeout ran out; raise celery.visibility_timeout_s "
                                  f"or use smaller shards ({exc})") from None
            if exc.retryable and restarts < max_restarts:
                restarts += 1
                logger.warning("%s: engine died, restarting (%d/%d): %s", where, restarts, max_restarts, exc)
                continue
            raise ShardFailed(f"{where}: {exc}") from None
        except InputError as exc:
            raise ShardFailed(f"{where}: {exc}") from None
        except RegressError as exc:
            engines.discard(candidate)
            raise ShardFailed(f"{where}: {exc}") from None


def _shard_request(message: Any, where: str) -> ShardRequest:
    """The shard request a task carries (``CeleryExecutor`` wrote it with the protocol's own form)."""
    try:
        request = request_from_dict(message, "shard message")
    except ProtocolError as exc:
        # An orchestrator on another regress version, or a hand-made task: name what is wrong.
        raise MessageRefused(f"{where}: malformed task: {exc}") from None
    if not isinstance(request, ShardRequest):
        raise MessageRefused(f"{where}: malformed task: a '{request.op}' request instead of a shard")
    return request


@app.task(name=TASK_REPLAY_SHARD, bind=True)
def replay_shard(self: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery task: one shard of a replay (JSON in, JSON out; the result itself goes to a file)."""
    visibility = float(self.app.conf.broker_transport_options.get("visibility_timeout", 3600))
    deadline = time.monotonic() + visibility * _VISIBILITY_MARGIN
    return run_shard(payload, deadline=deadline, worker=self.request.hostname)
