"""The worker's side of a replay: run one shard in a warm engine, write its result file.

A task carries everything the shard needs as JSON (the candidate, the engine request, where
to write): workers share no state with the orchestrator but the results directory. A shard
whose result file is already there with the same fingerprint and run id is not run again, so
a redelivered message (a worker died after writing, before acknowledging) costs nothing.

Nothing in a message is trusted (:mod:`regress.worker.trust`): the candidate is validated like
params.yaml and may not choose loader variables, direct-URL requirements or ``module:Class``
backends; every path must lie in the worker's results directory, inside a run directory an
orchestrator prepared (its ``plan.json``), for the run id written there: a message of an
earlier attempt (before ``--force``) is dropped without writing anything. Besides the shard
file, the worker writes the engine's facts for the shard (``engine-facts/shard-NNNNN.json``),
so an orchestrator that died and runs again can finish the run from files alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from celery.utils.log import get_task_logger

from regress.engine.client import EngineProcess
from regress.engine.protocol import ProtocolError, ShardRequest, request_from_dict
from regress.envs import python_for, regress_home
from regress.errors import EngineError, InputError, MessageRefused, RegressError, ShardFailed
from regress.records import CandidateSpec
from regress.replay import PLAN_FILE, shard_file_matches
from regress.runs import SHARDS_DIR, VOCAB_FILE
from regress.storage import atomic_write_text, read_shard_meta
from regress.worker.app import TASK_REPLAY_SHARD, app
from regress.worker.executor import ENGINE_FACTS_DIR
from regress.worker.settings import CelerySettings
from regress.worker.trust import inside, untrusted_candidate

logger = get_task_logger(__name__)

# Stop a shard this far before the visibility timeout, so Redis never hands a shard that is
# still running to a second worker.
_VISIBILITY_MARGIN = 0.9


def engine_key(candidate: CandidateSpec) -> str:
    """What makes two candidates share an engine: everything but the name."""
    data = candidate.model_dump(mode="json")
    data.pop("name", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class WarmEngines:
    """The engines this worker keeps loaded, least recently used first out.

    One per candidate, up to ``capacity`` (one GPU rarely holds two engines): a worker serving
    the shards of one candidate loads its engine once per run, not once per shard.
    """

    def __init__(self, capacity: int = 1, *, failure_ttl_s: float = 300):
        self.capacity = max(1, capacity)
        self.failure_ttl_s = failure_ttl_s
        self._engines: OrderedDict[str, tuple[EngineProcess, dict[str, Any]]] = OrderedDict()
        # Engines that failed to start for a reason that is not a crash (a bad engine argument,
        # a missing model): later shards of the same candidate fail at once instead of paying
        # for another doomed start each (a run of 1,000 shards would otherwise try 1,000 times).
        self._start_failures: dict[str, tuple[float, RegressError]] = {}

    def get(self, candidate: CandidateSpec, deadline: float | None) -> tuple[EngineProcess, dict[str, Any], bool]:
        """The warm engine for ``candidate`` (loading it if needed): (engine, facts, loaded now)."""
        key = engine_key(candidate)
        failed = self._start_failures.get(key)
        if failed is not None and time.monotonic() - failed[0] < self.failure_ttl_s:
            age = time.monotonic() - failed[0]
            detail = str(failed[1]).removeprefix(f"candidate '{candidate.name}': ")
            raise EngineError(f"{detail} [not started again: the same engine failed to start on this worker "
                              f"{age:.0f} s ago; next attempt after {self.failure_ttl_s:.0f} s]",
                              candidate=candidate.name, retryable=False)
        if key in self._engines:
            self._engines.move_to_end(key)
            engine, facts = self._engines[key]
            return engine, facts, False
        while len(self._engines) >= self.capacity:
            _, (old, _) = self._engines.popitem(last=False)
            old.close()
        python, env, _ = python_for(candidate, on_line=lambda line: logger.info("pip: %s", line))
        log = regress_home() / "logs" / f"worker-{socket.gethostname()}-{os.getpid()}" / f"{candidate.name}-{key}.log"
        timeout = None if deadline is None else max(60.0, deadline - time.monotonic())
        engine = EngineProcess(candidate, python, log, load_timeout_s=timeout)
        started = time.monotonic()
        try:
            info = engine.start()
        except (EngineError, InputError) as exc:
            engine.close()
            if not getattr(exc, "retryable", False):
                self._start_failures[key] = (time.monotonic(), exc)
            raise
        except BaseException:
            engine.close()
            raise
        self._start_failures.pop(key, None)
        facts = {"info": info, "environment": str(env.path) if env is not None else None,
                 "load_s": time.monotonic() - started}
        self._engines[key] = (engine, facts)
        logger.info("engine for '%s' loaded in %.1f s", candidate.name, facts["load_s"])
        return engine, facts, True

    def drop(self, candidate: CandidateSpec) -> None:
        """Forget (and stop) the engine for ``candidate``, e.g. after it died."""
        entry = self._engines.pop(engine_key(candidate), None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        while self._engines:
            _, (engine, _) = self._engines.popitem()
            engine.close()


engines = WarmEngines(int(os.environ.get("REGRESS_WORKER_MAX_ENGINES", "1")))
"""This worker process's warm engines (the solo pool runs every task in this process)."""


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
    payload = {**payload, "vocab_out": str(run_dir / VOCAB_FILE) if payload.get("vocab_out") else None}
    restarts = 0
    loaded_now = False
    while True:
        try:
            engine, facts, fresh = engines.get(candidate, deadline)
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
                     "engine_load_s": facts["load_s"] if loaded_now else 0.0,
                     "engine_info": facts["info"], "environment": facts["environment"], "memory": memory}
            facts_file = engine_facts_file(run_dir, request.index)
            facts_file.parent.mkdir(exist_ok=True)
            atomic_write_text(facts_file, json.dumps(reply, default=str))
            return reply
        except ShardFailed:
            raise  # already says where and what; a RegressError, so it must pass the clauses below untouched
        except EngineError as exc:
            engines.drop(candidate)
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
            engines.drop(candidate)
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
