"""Warm engines: one engine per configuration, shared by every run that uses it.

Several runs of one configuration (a diagnosis runs the candidate batched together, alone and
again; candidates that differ only in sampling run on the baseline's engine) would otherwise
cost an engine start each; the local executor starts one per run. :class:`WarmEngines` keeps
one engine process per configuration (what the engine process is started with) while its
user runs and hands out executors that run plans on it. At most ``keep`` engines stay alive (the
least recently used is closed first), so memory stays bounded; the diagnosis orders its runs so
that each configuration's runs come together. A caller that diagnoses several candidates (or
replays one and then diagnoses it) can pass one :class:`WarmEngines` to all of them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from regress.engine.client import EngineProcess
from regress.envs import python_for
from regress.errors import EngineError
from regress.records import CandidateSpec
from regress.replay.executors import ExecutionOutcome, saved_execution_outcome, shard_request
from regress.replay.plan import ReplayPlan
from regress.replay.rundir import ENGINE_INFO_FILE, shard_is_done
from regress.replay.sink import ProgressSink
from regress.runs import ENGINE_LOG, VOCAB_FILE
from regress.storage import atomic_write_text


def configuration_key(spec: CandidateSpec) -> str:
    """What makes two specs the same engine: what the engine process is started with (its
    environment, variables and engine spec), not the name, nor what is applied when the plan is
    made (sampling, generation_config defaults): a revert back to the baseline's configuration
    runs on the baseline's engine."""
    engine = {k: v for k, v in spec.engine_spec().items() if k != "name"}
    return json.dumps({"engine": engine, "package": spec.package, "requirements": list(spec.requirements),
                       "env": spec.env}, sort_keys=True, default=str)


class _Warm:
    def __init__(self, engine: EngineProcess, info: dict[str, Any], environment: str | None, load_s: float):
        self.engine = engine
        self.info = info
        self.environment = environment
        self.load_s = load_s
        self.runs = 0


class WarmEngines:
    """Engines kept warm across the runs of a diagnosis (use as a context manager)."""

    def __init__(self, *, keep: int = 1, shard_timeout_s: float | None = None):
        self.keep = keep
        self.shard_timeout_s = shard_timeout_s
        self._warm: dict[str, _Warm] = {}
        self.loads = 0

    def __enter__(self) -> "WarmEngines":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for warm in self._warm.values():
            warm.engine.close()
        self._warm.clear()

    def _engine(self, spec: CandidateSpec, log_dir: Path, progress: ProgressSink) -> tuple[_Warm, bool]:
        key = configuration_key(spec)
        warm = self._warm.pop(key, None)
        if warm is not None:
            self._warm[key] = warm  # most recently used last: the least recently used goes first
            return warm, False
        while len(self._warm) >= self.keep:
            oldest = next(iter(self._warm))
            self._warm.pop(oldest).engine.close()
        progress.status(f"preparing environment for {spec.package}")
        python, env, _ = python_for(spec, on_line=lambda line: progress.status(f"pip: {line[:100]}"))
        progress.status(f"loading engine for '{spec.name}' ({spec.backend}, {spec.dtype})")
        engine = EngineProcess(spec, python, log_dir / ENGINE_LOG)
        started = time.monotonic()
        try:
            info = dict(engine.start())
        except BaseException:
            engine.close()
            raise
        self.loads += 1
        warm = _Warm(engine, info, str(env.path) if env is not None else None,
                     float(info.get("engine_load_s", time.monotonic() - started)))
        self._warm[key] = warm
        return warm, True

    def executor(self) -> "WarmExecutor":
        return WarmExecutor(self)


class WarmExecutor:
    """An :class:`~regress.replay.Executor` that runs a plan's shards on a warm engine."""

    def __init__(self, engines: WarmEngines):
        self.engines = engines

    def run(self, plan: ReplayPlan, run_dir: Path, progress: ProgressSink) -> ExecutionOutcome:
        pending = [t for t in plan.tasks if not shard_is_done(run_dir, t)]
        if not pending:
            return saved_execution_outcome(run_dir)
        warm, loaded = self.engines._engine(plan.candidate, run_dir, progress)
        engine = warm.engine
        try:
            engine.write_vocabulary(run_dir / VOCAB_FILE)
        except EngineError:
            pass  # a tokenizer without a vocabulary only costs the report its token texts
        atomic_write_text(run_dir / ENGINE_INFO_FILE,
                          json.dumps({"info": warm.info, "environment": warm.environment}, default=str))
        progress.status(f"running '{plan.candidate.name}'")
        for task in pending:
            engine.run_shard(shard_request(task, run_dir, plan.run_id), timeout_s=self.engines.shard_timeout_s,
                             on_progress=lambda event: progress.advance(event.phase, event.done))
        memory = dict(engine.memory())
        atomic_write_text(run_dir / ENGINE_INFO_FILE,
                          json.dumps({"info": warm.info, "memory": memory, "environment": warm.environment},
                                     default=str))
        warm.runs += 1
        return ExecutionOutcome(warm.info, 1 if loaded else 0, warm.load_s if loaded else 0.0, memory,
                                warm.environment)
