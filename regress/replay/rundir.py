"""A run directory's life: an up-to-date run is reused, an unfinished one (``<out>.partial``)
is resumed shard by shard, a finished one replaces the old run in one move.

A shard counts as done only when its result file carries the fingerprint of exactly this
shard of exactly this plan; so a changed plan never mixes with an earlier one's files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from regress.errors import StorageError
from regress.records import RunManifest
from regress.replay.plan import ReplayPlan, ShardTask
from regress.runs import MANIFEST, read_manifest, shard_file
from regress.storage import atomic_write_text, read_shard_meta

PLAN_FILE = "plan.json"
"""In an unfinished run: the plan's fingerprint and run id (so a resumed run keeps its id)."""
ENGINE_INFO_FILE = "engine-info.json"
"""The engine's facts as the executor saw them (read back when every shard was already done)."""


def shard_file_matches(path: Path, fingerprint: str) -> bool:
    """Whether ``path`` holds a valid shard result stamped with ``fingerprint``."""
    if not path.is_file():
        return False
    try:
        return read_shard_meta(path).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        return False


def shard_is_done(run_dir: Path, task: ShardTask) -> bool:
    """Whether a valid result for exactly this shard request is on disk."""
    return shard_file_matches(shard_file(run_dir, task.index), task.fingerprint)


def up_to_date_run(out_dir: Path, plan: ReplayPlan) -> RunManifest | None:
    """The manifest of the complete run of this same plan in ``out_dir``, if there is one."""
    if not (out_dir / MANIFEST).is_file():
        return None
    try:
        existing = read_manifest(out_dir)
    except StorageError:
        return None
    return existing if existing.plan_fingerprint == plan.fingerprint else None


def partial_dir(out_dir: Path) -> Path:
    """Where the run into ``out_dir`` is built until it is complete."""
    return out_dir.with_name(out_dir.name + ".partial")


def prepare_partial(out_dir: Path, plan: ReplayPlan) -> Path:
    """The working directory of this run; an earlier unfinished run of the same plan is resumed
    (and ``plan.run_id`` becomes its run id), one of another plan is removed."""
    partial = partial_dir(out_dir)
    plan_file = partial / PLAN_FILE
    if partial.exists():
        try:
            earlier = json.loads(plan_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            earlier = {}
        if earlier.get("fingerprint") == plan.fingerprint:
            plan.run_id = earlier["run_id"]
            return partial
        shutil.rmtree(partial)
    (partial / "shards").mkdir(parents=True)
    atomic_write_text(plan_file, json.dumps({"fingerprint": plan.fingerprint, "run_id": plan.run_id}))
    return partial


def prompts_done(work: Path, plan: ReplayPlan) -> int:
    """Prompts whose shards are already on disk (a resumed run starts its bars there)."""
    return sum(t.size for t in plan.tasks if shard_is_done(work, t))


def shard_metas(work: Path, plan: ReplayPlan) -> list[dict[str, Any]]:
    """Every shard's metadata, in order; a shard not on disk is a :class:`StorageError`."""
    metas = []
    for task in plan.tasks:
        if not shard_is_done(work, task):
            raise StorageError(f"{shard_file(work, task.index)}: shard {task.index} did not complete")
        metas.append(read_shard_meta(shard_file(work, task.index)))
    return metas


def finish(work: Path, out_dir: Path) -> None:
    """Move the complete run in ``work`` to ``out_dir``; a reader sees the old or the new run,
    never a mix."""
    (work / PLAN_FILE).unlink(missing_ok=True)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(work, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
