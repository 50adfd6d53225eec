"""Executors run a plan's shards and say what they learned about the engine.

:class:`LocalExecutor` (here) runs them in one engine process on this machine (its own, or a warm
one from :class:`regress.replay.warm.WarmEngines`); the Celery
executor (``regress.worker.executor``) sends them to workers. Either way a shard's result is
the file it writes into the run directory; the executor returns only the engine's facts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from typing import TYPE_CHECKING

from regress.engine.protocol import EngineInfo, ProgressEvent, ShardRequest
from regress.errors import EngineError
from regress.replay.plan import ReplayPlan, ShardTask
from regress.replay.rundir import ENGINE_INFO_FILE, shard_is_done, write_engine_info
from regress.replay.sink import ProgressSink
from regress.runs import ENGINE_LOG, VOCAB_FILE, shard_file
from regress.watchdog import Phase, phase

if TYPE_CHECKING:
    from regress.replay.warm import WarmEngine, WarmEngines


@dataclass
class ExecutionOutcome:
    """What an executor learned while running shards (for the manifest)."""

    engine_info: EngineInfo
    engine_loads: int
    engine_load_s: float
    memory: dict[str, Any]
    environment: str | None = None
    reused: bool = False
    """The run got a warm engine an earlier run had loaded: it timed no engine load of its own."""


def saved_execution_outcome(run_dir: Path) -> ExecutionOutcome:
    """What the executor recorded when it ran the shards now on disk (nothing left to run)."""
    saved = json.loads((run_dir / ENGINE_INFO_FILE).read_text(encoding="utf-8"))
    return ExecutionOutcome(saved["info"], 0, 0.0, saved.get("memory", {}), saved.get("environment"),
                            reused="reused" in saved)


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
        generate=task.generate,
    )


def _phases_of(task: ShardTask, current: Phase, progress: ProgressSink) -> Callable[[ProgressEvent], None]:
    """The progress handler of one shard: advances the bars, and moves the shard's watched phase
    on to teacher forcing once its generation is done (every prompt counted, or the first
    teacher-forcing event)."""
    generated = 0

    def on_progress(event: ProgressEvent) -> None:
        nonlocal generated
        progress.advance(event.phase, event.done)
        if event.phase == "generate":
            generated += event.done
        if task.teacher_force is not None and (event.phase == "teacher_force" or generated >= task.size):
            current.switch("teacher_forcing")

    return on_progress


def _engine_facts(warm: "WarmEngine", loaded: bool) -> dict[str, Any]:
    """What engine-info.json says of the engine a run got: its load facts, its environment, and
    for a warm one an earlier run used, how many runs it had served and whether it forgot them."""
    facts: dict[str, Any] = {"info": warm.info, "environment": warm.environment}
    if not loaded:
        facts["reused"] = {"runs_before": warm.runs, "cache_cleared": warm.cache_cleared}
    return facts


class LocalExecutor:
    """Runs every shard in one engine process on this machine (the default; no broker).

    If the engine dies (retryable), it is restarted and the shard retried, up to
    ``max_restarts`` times per run; finished shards are never redone. With ``engines`` (a pool of
    warm engines, :class:`regress.replay.warm.WarmEngines`) the engine comes from the pool and
    stays warm after the run (its cache cleared before the next run uses it); without, the run
    starts its own and closes it at the end. With ``fresh`` too, an engine that cannot say it
    cleared its cache is replaced rather than reused (a noise arm on the golden's engine, a
    diagnosis probe: :meth:`regress.replay.warm.WarmEngines.acquire`).
    """

    def __init__(self, *, max_restarts: int = 1, shard_timeout_s: float | None = None,
                 engines: "WarmEngines | None" = None, fresh: bool = False):
        self.max_restarts = max_restarts
        self.shard_timeout_s = shard_timeout_s
        self.engines = engines
        self.fresh = fresh

    @classmethod
    def on(cls, engines: "WarmEngines", *, max_restarts: int = 1, fresh: bool = False) -> "LocalExecutor":
        """The local executor, running on ``engines`` (they stay warm after each run)."""
        return cls(max_restarts=max_restarts, shard_timeout_s=engines.shard_timeout_s, engines=engines, fresh=fresh)

    def run(self, plan: ReplayPlan, run_dir: Path, progress: ProgressSink) -> ExecutionOutcome:
        from regress.replay.warm import WarmEngines

        candidate = plan.candidate
        pending = [t for t in plan.tasks if not shard_is_done(run_dir, t)]
        if not pending:
            return saved_execution_outcome(run_dir)
        info_file = run_dir / ENGINE_INFO_FILE
        pool = self.engines if self.engines is not None else WarmEngines(keep=1)
        loads, load_s, restarts = 0, 0.0, 0
        warm = None
        try:
            queue = list(pending)
            while queue:
                if warm is None:
                    warm, loaded = pool.acquire(candidate, log=run_dir / ENGINE_LOG, vocab_out=run_dir / VOCAB_FILE,
                                                on_status=progress.status, fresh=self.fresh)
                    if loaded:
                        loads += 1
                        load_s += warm.load_s
                    facts = _engine_facts(warm, loaded)
                    write_engine_info(info_file, facts)
                    progress.status(f"running '{candidate.name}'")
                task = queue[0]
                try:
                    # Each shard's generation, then its teacher forcing, has its own deadline.
                    with phase("generation", f"shard {task.index + 1} of {len(plan.tasks)}") as current:
                        warm.engine.run_shard(
                            shard_request(task, run_dir, plan.run_id),
                            timeout_s=self.shard_timeout_s,
                            on_progress=_phases_of(task, current, progress),
                        )
                except EngineError as exc:
                    pool.discard(candidate)
                    warm = None
                    if not exc.retryable or restarts >= self.max_restarts:
                        raise
                    restarts += 1
                    progress.status(f"engine died on shard {task.index}; restarting ({restarts}/{self.max_restarts})")
                    continue
                queue.pop(0)
            assert warm is not None
            memory = dict(warm.engine.memory())
            warm.runs += 1
            write_engine_info(info_file, {**facts, "memory": memory})
        finally:
            if self.engines is None:
                pool.close()
        return ExecutionOutcome(warm.info, loads, load_s, memory, warm.environment, reused="reused" in facts)
