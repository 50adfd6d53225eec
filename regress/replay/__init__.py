"""The replay path: plan shards, run a candidate's engine over them, write a complete run.

:func:`replay` is the one entry point for both the golden (the baseline, no reference) and a
candidate replay (with a golden: its completions are also scored teacher-forced). It is plain
Python; executors decide where the shards run (:class:`LocalExecutor` here, Celery in
``regress.worker``). The parts, one job each:

- :mod:`~regress.replay.plan`: shards, sampling, fingerprints (:func:`plan_replay`);
- :mod:`~regress.replay.executors`: running shards (:class:`LocalExecutor`);
- :mod:`~regress.replay.rundir`: a run directory's life (reuse, resume, finish);
- :mod:`~regress.replay.manifest`: the finished run's manifest;
- :mod:`~regress.replay.sink`: where progress goes;
- :mod:`~regress.replay.run`: :func:`replay`, which ties them together.
"""

from regress.replay.executors import (
    ExecutionOutcome,
    Executor,
    LocalExecutor,
    saved_execution_outcome,
    shard_request,
)
from regress.replay.manifest import build_manifest, versions_record
from regress.replay.plan import ReplayPlan, ShardTask, plan_layout, plan_replay, resolve_sampling
from regress.replay.run import replay
from regress.replay.rundir import ENGINE_INFO_FILE, PLAN_FILE, shard_file_matches, shard_is_done
from regress.replay.sink import ProgressSink, SilentProgress

__all__ = [
    "ENGINE_INFO_FILE",
    "PLAN_FILE",
    "ExecutionOutcome",
    "Executor",
    "LocalExecutor",
    "ProgressSink",
    "ReplayPlan",
    "ShardTask",
    "SilentProgress",
    "build_manifest",
    "plan_layout",
    "plan_replay",
    "replay",
    "resolve_sampling",
    "saved_execution_outcome",
    "shard_file_matches",
    "shard_is_done",
    "shard_request",
    "versions_record",
]
