"""The orchestrator's side of the Celery executor: send shards as tasks, wait for their files.

The results directory is the truth, not the broker: a shard is done when its result file with
the plan's fingerprint is on disk (workers write it there; it must be shared storage when the
workers are other machines). The broker's task states only say which shards failed. So a
broker that restarts, or a task whose result was lost, cannot make a run look complete: the
run is complete only when every shard's file is there, and otherwise the executor fails
loudly, naming the shards it is missing.

A shard counts only when its file carries this plan's fingerprint *and* this attempt's run
id: a resumed run keeps its run id (so shards finished by workers after the orchestrator died
count), a ``--force`` run gets a new one (so a late shard of the old attempt does not). The
engine's facts come from the workers' ``engine-facts/`` files, so a run whose every shard
finished while no orchestrator waited completes from files alone.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regress.errors import BrokerError, ProtocolError, ShardsFailedError, StorageError
from regress.replay import (
    ENGINE_INFO_FILE,
    ExecutionOutcome,
    ProgressSink,
    ReplayPlan,
    ShardTask,
    saved_execution_outcome,
    shard_is_done,
    shard_request,
)
from regress.replay.rundir import write_engine_info
from regress.runs import VOCAB_FILE, shard_file
from regress.storage import read_shard_meta
from regress.worker.app import BROKER_CONNECTION_ERRORS, ensure_broker, sending_app
from regress.worker.replies import checked_reply
from regress.worker.settings import CelerySettings


ENGINE_FACTS_DIR = "engine-facts"
"""In a run directory being built: the engine's facts per shard (``shard-NNNNN.json``), written
by the worker that ran it; folded into ``engine-info.json`` when the run completes."""


@dataclass
class _Tracked:
    """One shard on its way through the workers."""

    task: ShardTask
    task_id: str = ""
    result: dict[str, Any] | None = None
    error: str | None = None


class CeleryExecutor:
    """Runs a plan's shards on Celery workers (``regress worker``) over Redis.

    ``stall_timeout_s``: fail if no shard finishes for this long (default: the visibility
    timeout plus ten minutes, the longest a redelivered shard can take to come back).
    ``broker_outage_s``: fail if the broker stays unreachable this long.
    """

    def __init__(self, settings: CelerySettings | None = None, *, queue: str | None = None,
                 stall_timeout_s: float | None = None, broker_outage_s: float = 600, poll_s: float = 0.5,
                 state_poll_s: float = 2.0):
        self.settings = (settings or CelerySettings()).with_environment()
        self.explicit_queue = queue
        self.queue = ""  # chosen per run: --queue, else the candidate's queue, else the default
        self.stall_timeout_s = (stall_timeout_s or self.settings.stall_timeout_s
                                or self.settings.visibility_timeout_s + 600)
        self.broker_outage_s = broker_outage_s
        self.poll_s = poll_s
        self.state_poll_s = state_poll_s

    def _app(self):  # type: ignore[no-untyped-def]
        return sending_app(self.settings)

    @staticmethod
    def _done(run_dir: Path, task: ShardTask, run_id: str) -> bool:
        """This shard of this plan, written for this attempt (see the module's docstring)."""
        if not shard_is_done(run_dir, task):
            return False
        try:
            return read_shard_meta(shard_file(run_dir, task.index)).get("run_id") == run_id
        except (OSError, ValueError):
            return False

    def _payload(self, plan: ReplayPlan, run_dir: Path, task: ShardTask) -> dict[str, Any]:
        return {
            "candidate": plan.candidate.model_dump(mode="json"),
            "message": shard_request(task, run_dir, plan.run_id).to_dict(),
            "vocab_out": str((run_dir / VOCAB_FILE).resolve()),
        }

    def _send(self, app: Any, plan: ReplayPlan, run_dir: Path, tracked: _Tracked) -> None:
        from regress.worker.app import TASK_REPLAY_SHARD

        # A fresh task id per send: a resumed run (same run id) must not read the FAILURE or
        # REVOKED state an earlier attempt left under the old id.
        tracked.task_id = f"{plan.run_id}-shard-{tracked.task.index:05d}-{uuid.uuid4().hex[:8]}"
        app.send_task(TASK_REPLAY_SHARD, args=[self._payload(plan, run_dir, tracked.task)],
                      task_id=tracked.task_id, queue=self.queue)

    def run(self, plan: ReplayPlan, run_dir: Path, progress: ProgressSink) -> ExecutionOutcome:
        from celery.result import AsyncResult

        pending = [t for t in plan.tasks if not self._done(run_dir, t, plan.run_id)]
        info_file = run_dir / ENGINE_INFO_FILE
        if not pending:
            if info_file.is_file() and not (run_dir / ENGINE_FACTS_DIR).is_dir():
                return saved_execution_outcome(run_dir)
            # Every shard finished while no orchestrator waited (it died): the facts are in files.
            return self._outcome({}, info_file)
        self.queue = self.explicit_queue or self.settings.queue_for(plan.candidate.name)
        app = self._app()
        broker = self.settings.describe()
        ensure_broker(app, broker)
        progress.status(f"sending {len(pending)} shard(s) to queue '{self.queue}' on {broker}")
        tracked: dict[int, _Tracked] = {}
        outage_since: float | None = None
        try:
            for task in pending:
                item = _Tracked(task)
                self._retry_broker(lambda item=item: self._send(app, plan, run_dir, item), broker)
                tracked[task.index] = item
            progress.status(f"waiting for workers on queue '{self.queue}' ({len(pending)} shard(s))")
            phases = ["generate"] + (["teacher_force"] if plan.teacher_forced else [])
            last_change = time.monotonic()  # when a shard last finished or failed (stall timeout)
            waiting = dict(tracked)
            last_states = 0.0
            while waiting:
                time.sleep(self.poll_s)
                # Files are checked every poll; task states (one Redis read per waiting shard)
                # only every few seconds, so a run of thousands of shards does not hammer Redis.
                ask_states = time.monotonic() - last_states >= self.state_poll_s
                if ask_states:
                    last_states = time.monotonic()
                for index, item in list(waiting.items()):
                    if self._done(run_dir, item.task, plan.run_id):
                        item.result = self._result_of(AsyncResult(item.task_id, app=app), index)
                        del waiting[index]
                        for phase in phases:
                            progress.advance(phase, item.task.size)
                        last_change = time.monotonic()
                        continue
                    if not ask_states and outage_since is None:
                        continue
                    try:
                        state = AsyncResult(item.task_id, app=app).state
                    except BROKER_CONNECTION_ERRORS as exc:
                        # The broker is down: keep waiting (the files may still arrive), up to
                        # broker_outage_s.
                        if outage_since is None:
                            outage_since = time.monotonic()
                            progress.status(f"lost the broker {broker} ({type(exc).__name__}); waiting for it")
                        if time.monotonic() - outage_since > self.broker_outage_s:
                            raise BrokerError(f"the broker {broker} was unreachable for {self.broker_outage_s:.0f} s; "
                                              f"{len(waiting)} shard(s) unfinished; run the command again to resume") from exc
                        break
                    if outage_since is not None:
                        # Back after an outage: queued messages may be gone if the broker lost
                        # them. Send every unfinished shard again; a shard already running or
                        # done is not harmed (results are keyed by run and shard).
                        progress.status(f"the broker {broker} is back; re-sending {len(waiting)} unfinished shard(s)")
                        outage_since = None
                        for again in waiting.values():
                            if AsyncResult(again.task_id, app=app).state != "STARTED":
                                self._send(app, plan, run_dir, again)
                        last_change = time.monotonic()
                        break
                    if state == "FAILURE":
                        item.error = str(AsyncResult(item.task_id, app=app).result)
                        del waiting[index]
                        last_change = time.monotonic()
                    elif state in ("REVOKED", "REJECTED"):
                        item.error = f"the task was {state.lower()} (revoked by an interrupted run, or refused by the worker)"
                        del waiting[index]
                        last_change = time.monotonic()
                    elif state == "SUCCESS" and not self._done(run_dir, item.task, plan.run_id):
                        item.error = (f"the worker reported success but {shard_file(run_dir, item.task.index).resolve()} "
                                      "is not there: do the workers see this results directory (shared storage)?")
                        del waiting[index]
                if waiting and time.monotonic() - last_change > self.stall_timeout_s:
                    missing = ", ".join(str(i) for i in sorted(waiting))
                    raise BrokerError(
                        f"no shard finished for {self.stall_timeout_s:.0f} s on queue '{self.queue}' ({broker}); "
                        f"unfinished shard(s): {missing}. Is a worker running (`regress worker --queue {self.queue}`)?"
                    )
        except KeyboardInterrupt:
            self._revoke(app, [t for t in tracked.values() if t.result is None and t.error is None])
            raise
        failed = [t for t in tracked.values() if t.error is not None]
        if failed:
            lines = "\n".join(f"  shard {t.task.index}: {t.error}" for t in sorted(failed, key=lambda t: t.task.index))
            raise ShardsFailedError(
                f"{len(failed)} of {len(plan.tasks)} shard(s) of '{plan.candidate.name}' failed; finished shards are "
                f"kept in {run_dir}, run the command again to retry the rest:\n{lines}"
            )
        return self._outcome(tracked, info_file)

    @staticmethod
    def _result_of(result: Any, index: int) -> dict[str, Any]:
        # The file is the truth; the worker's reply (engine facts) may lag or be gone after a
        # broker restart, or the shard was written by an earlier attempt. A reply that is there
        # is checked: anyone who can write to the result backend can write one.
        try:
            if result.state == "SUCCESS" and result.result is not None:
                return checked_reply(result.result, f"shard {index}'s result in the result backend")
        except BROKER_CONNECTION_ERRORS:
            pass
        return {}

    def _retry_broker(self, action: Any, broker: str) -> None:
        deadline = time.monotonic() + min(self.broker_outage_s, 60)
        while True:
            try:
                action()
                return
            except BROKER_CONNECTION_ERRORS as exc:
                if time.monotonic() > deadline:
                    raise BrokerError(f"cannot send shards to the broker {broker}: {exc}") from exc
                time.sleep(1)

    @staticmethod
    def _revoke(app: Any, items: list[_Tracked]) -> None:
        # Best effort on the way out of an interrupted run: a broker that is gone cannot be told,
        # and its queued shards are harmless (results are keyed by run and shard).
        try:
            for item in items:
                app.control.revoke(item.task_id)
        except BROKER_CONNECTION_ERRORS:
            pass

    def _outcome(self, tracked: dict[int, _Tracked], info_file: Path) -> ExecutionOutcome:
        replies = [t.result for t in tracked.values() if t.result and not t.result.get("skipped")]
        # Shards whose reply this attempt did not get (run by workers for an orchestrator that
        # died, or whose reply was lost with the broker): their facts files stand in.
        facts_dir = info_file.parent / ENGINE_FACTS_DIR
        answered = {int(r["index"]) for r in replies if "index" in r}
        for path in sorted(facts_dir.glob("shard-*.json")) if facts_dir.is_dir() else []:
            try:
                facts = json.loads(path.read_text(encoding="utf-8"))
                facts = checked_reply(facts, str(path))
            except (OSError, ValueError, ProtocolError) as exc:
                raise StorageError(f"{path}: unreadable engine facts ({exc}); delete it and run again") from exc
            if facts.get("index") not in answered:
                replies.append(facts)
        saved: dict[str, Any] = {}
        if info_file.is_file():
            try:
                saved = json.loads(info_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise StorageError(f"{info_file}: unreadable engine facts ({exc}); delete it and run again") from exc
        info = next((r["engine_info"] for r in replies if r.get("engine_info")), saved.get("info", {}))
        environment = next((r.get("environment") for r in replies if r.get("engine_info")), saved.get("environment"))
        loads = sum(1 for r in replies if r.get("engine_loaded"))
        load_s = sum(float(r.get("engine_load_s", 0.0)) for r in replies)
        memory: dict[str, Any] = dict(saved.get("memory", {}))
        for reply in replies:
            for key, value in (reply.get("memory") or {}).items():
                if value is not None and (memory.get(key) is None or value > memory[key]):
                    memory[key] = value
        workers = sorted({f"{r['worker']}:{r['pid']}" for r in replies})
        if not workers:
            workers = saved.get("workers", [])
        facts = {"info": info, "memory": memory, "environment": environment, "workers": workers}
        reused = [r for r in replies if "cache_cleared" in r]
        if reused:  # as a local run's "reused": shards run on an engine an earlier shard had used
            facts["reused_shards"] = {"count": len(reused), "cache_not_cleared": sorted(
                int(r["index"]) for r in reused if not r["cache_cleared"])}
        elif not replies and "reused_shards" in saved:  # as for the workers: nothing new to say
            facts["reused_shards"] = saved["reused_shards"]
        write_engine_info(info_file, facts)
        # Folded into engine-info.json: the finished run keeps the summary only.
        shutil.rmtree(facts_dir, ignore_errors=True)
        return ExecutionOutcome(info, loads, load_s, memory, environment)
