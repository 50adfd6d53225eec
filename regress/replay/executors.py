"""Executors run a plan's shards and say what they learned about the engine.

:class:`LocalExecutor` (here) runs them in one engine process on this machine; the Celery
executor (``regress.worker.executor``) sends them to workers. Either way a shard's result is
the file it writes into the run directory; the executor returns only the engine's facts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from regress.engine.client import EngineProcess
from regress.engine.protocol import EngineInfo, ShardRequest
from regress.envs import python_for
from regress.errors import EngineError
from regress.replay.plan import ReplayPlan, ShardTask
from regress.replay.rundir import ENGINE_INFO_FILE, shard_is_done
from regress.replay.sink import ProgressSink
from regress.runs import ENGINE_LOG, VOCAB_FILE, shard_file
from regress.storage import atomic_write_text


@dataclass
class ExecutionOutcome:
    """What an executor learned while running shards (for the manifest)."""

    engine_info: EngineInfo
    engine_loads: int
    engine_load_s: float
    memory: dict[str, Any]
    environment: str | None = None


def saved_execution_outcome(run_dir: Path) -> ExecutionOutcome:
    """What the executor recorded when it ran the shards now on disk (nothing left to run)."""
    saved = json.loads((run_dir / ENGINE_INFO_FILE).read_text(encoding="utf-8"))
    return ExecutionOutcome(saved["info"], 0, 0.0, saved.get("memory", {}), saved.get("environment"))


class Executor(Protocol):
    """Runs the shards of a plan, writing each to ``shard_file(run_dir, index)``."""

    def run(self, plan: ReplayPlan, run_dir: Path, progress: ProgressSink) -> ExecutionOutcome:
        """Run every shard not yet done; return when all are on disk."""


def shard_request(task: ShardTask, run_dir: Path, run_id: str) -> ShardRequest:
    """The engine request for one shard: the task plus where to write and what to stamp on it."""
    return ShardRequest(
        index=task.index,
        prompts=task.prompts,
        teacher_force=task.teacher_force,
        out=str(shard_file(run_dir, task.index).resolve()),
        meta={"fingerprint": task.fingerprint, "run_id": run_id},
    )


class LocalExecutor:
    """Runs every shard in one engine process on this machine (the default; no broker).

    If the engine dies (retryable), it is restarted and the shard retried, up to
    ``max_restarts`` times per run; finished shards are never redone.
    """

    def __init__(self, *, max_restarts: int = 1, shard_timeout_s: float | None = None):
        self.max_restarts = max_restarts
        self.shard_timeout_s = shard_timeout_s

    def run(self, plan: ReplayPlan, run_dir: Path, progress: ProgressSink) -> ExecutionOutcome:
        candidate = plan.candidate
        pending = [t for t in plan.tasks if not shard_is_done(run_dir, t)]
        if not pending:
            return saved_execution_outcome(run_dir)
        info_file = run_dir / ENGINE_INFO_FILE
        progress.status(f"preparing environment for {candidate.package}")
        python, env, _ = python_for(candidate, on_line=lambda line: progress.status(f"pip: {line[:100]}"))
        environment = str(env.path) if env is not None else None
        loads, load_s, restarts = 0, 0.0, 0
        engine: EngineProcess | None = None
        info: EngineInfo = {}
        try:
            queue = list(pending)
            while queue:
                if engine is None:
                    progress.status(f"loading engine for '{candidate.name}' ({candidate.backend}, {candidate.dtype})")
                    engine = EngineProcess(candidate, python, run_dir / ENGINE_LOG)
                    info = engine.start(vocab_out=run_dir / VOCAB_FILE)
                    loads += 1
                    load_s += float(info.get("engine_load_s", 0.0))
                    atomic_write_text(info_file, json.dumps({"info": info, "environment": environment}, default=str))
                    progress.status(f"running '{candidate.name}'")
                task = queue[0]
                try:
                    engine.run_shard(
                        shard_request(task, run_dir, plan.run_id),
                        timeout_s=self.shard_timeout_s,
                        on_progress=lambda event: progress.advance(event.phase, event.done),
                    )
                except EngineError as exc:
                    engine.close()
                    engine = None
                    if not exc.retryable or restarts >= self.max_restarts:
                        raise
                    restarts += 1
                    progress.status(f"engine died on shard {task.index}; restarting ({restarts}/{self.max_restarts})")
                    continue
                queue.pop(0)
            assert engine is not None
            memory = dict(engine.memory())
            atomic_write_text(info_file, json.dumps({"info": info, "memory": memory, "environment": environment},
                                                    default=str))
        finally:
            if engine is not None:
                engine.close()
        return ExecutionOutcome(info, loads, load_s, memory, environment)
