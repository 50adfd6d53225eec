"""A run directory's life: reuse, resume shard by shard, and replace in one move.

An up-to-date run is reused, an unfinished one (``<out>.partial``) is resumed shard by shard, a
finished one replaces the old run in one move.

A shard counts as done only when its result file carries the fingerprint of exactly this
shard of exactly this plan; so a changed plan never mixes with an earlier one's files.

Putting a complete run in place (:func:`finish`) takes three renames and a removal, the parent
directory fsynced after each, so that a crash at any point leaves a state :func:`recover`
(called before every run) completes without losing a complete run::

    0. <out>.partial/manifest.json written      the new run is complete (a .partial holding a
                                                manifest is never deleted: it is finished)
    1. <out>  -> .<out>.old                     the old run set aside
    2. <out>.partial -> <out>                   the new run in place
    3. <out>/plan.json removed                  a leftover is harmless
    4. .<out>.old removed                       a half-removed one is removed again

After a crash at 0-1, recovery finishes the swap; with <out> gone and no complete .partial (not
reachable through :func:`finish`), it puts ``.<out>.old`` back.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any

from regress.errors import InputError, StorageError
from regress.records import RunManifest
from regress.replay.plan import ReplayPlan, ShardTask
from regress.runs import MANIFEST, read_manifest, shard_file
from regress.storage import atomic_write_text, fsync_dir, partial_path, read_shard_meta

PLAN_FILE = "plan.json"
"""In an unfinished run: the plan's fingerprint and run id (so a resumed run keeps its id)."""
ENGINE_INFO_FILE = "engine-info.json"
"""The engine's facts as the executor saw them (read back when every shard was already done)."""


def write_engine_info(path: Path, facts: dict[str, Any]) -> None:
    """``engine-info.json``: the engine's facts as the executor saw them, with the secrets among
    its engine arguments masked (:func:`regress.redact.masked_settings`), as in manifest.json: the
    file stays in the finished run, which is shared and uploaded as the manifest is."""
    from regress.redact import masked_settings

    info = facts.get("info")
    if isinstance(info, dict) and isinstance(info.get("engine_args"), dict):
        facts = {**facts, "info": {**info, "engine_args": masked_settings(info["engine_args"])}}
    atomic_write_text(path, json.dumps(facts, default=str))


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
    """Where the run into ``out_dir`` is built until it is complete. The name is
    :func:`regress.storage.partial_path`'s, but not the life of :func:`regress.storage.building`:
    a run's partial outlives a failure (the next run resumes it) and is put in place by
    :func:`finish`'s crash-safe swap."""
    return partial_path(out_dir)


def old_dir(out_dir: Path) -> Path:
    """Where :func:`finish` sets the run it replaces aside until the new one is in place."""
    return out_dir.with_name(f".{out_dir.name}.old")


def _set_aside(out_dir: Path) -> list[Path]:
    """Every old run set aside for ``out_dir``: this release's, and ``.<out>.old-<pid>`` of earlier ones."""
    found = [old_dir(out_dir)] if old_dir(out_dir).exists() else []
    return found + sorted(out_dir.parent.glob(f".{glob.escape(out_dir.name)}.old-*"))


def is_complete(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a complete run (a manifest that reads)."""
    if not (run_dir / MANIFEST).is_file():
        return False
    try:
        read_manifest(run_dir)
    except StorageError:
        return False
    return True


def recover(out_dir: Path) -> None:
    """Complete whatever :func:`finish` was doing for ``out_dir`` when its process died (see the
    module docstring): a complete ``.partial`` is put in place, a run set aside is put back if
    nothing replaced it, and removed once something did. Does nothing when nothing was
    interrupted."""
    partial = partial_dir(out_dir)
    if is_complete(partial):
        finish(partial, out_dir)  # died after the manifest was written (steps 0-2)
    elif not out_dir.exists():
        aside = [d for d in _set_aside(out_dir) if is_complete(d)]
        if aside:  # the old run was set aside and no complete run came in: put it back
            newest = max(aside, key=lambda d: (d / MANIFEST).stat().st_mtime)
            os.replace(newest, out_dir)
            fsync_dir(out_dir.parent)
    if is_complete(out_dir):
        (out_dir / PLAN_FILE).unlink(missing_ok=True)  # step 3
        _remove_set_aside(out_dir)  # step 4


def run_target(out_dir: Path) -> Path:
    """Where a run into ``out_dir`` is put, refusing a directory that is not a run.

    :func:`finish` replaces the run directory whole, so a directory that holds something else
    (a typo'd ``--out``, ``paths.golden`` naming the prompt set's folder) would be emptied: it is
    refused, exit 2, before anything runs. An empty directory or one holding a run manifest
    (complete or damaged) is a run's place. A link to a run directory stays a link: the run is
    built and swapped beside its target, so a golden shared through a link stays shared."""
    if out_dir.is_symlink():
        target = out_dir.resolve()
        if target.exists() and not target.is_dir():
            raise InputError(f"{out_dir}: a link to {target}, which is not a directory; a run needs a directory of its own")
        out_dir = target
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: a file, not a run directory; choose another output directory")
    if out_dir.is_dir() and not (out_dir / MANIFEST).exists():
        try:
            held = sorted(entry.name for entry in out_dir.iterdir())
        except OSError as exc:
            raise InputError(f"{out_dir}: cannot be read ({exc.strerror}); choose another output directory") from exc
        if held:
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise InputError(
                f"{out_dir}: holds {shown} but no {MANIFEST}, so it is not a regress run; a run replaces its "
                "directory whole, and regress removes nothing it did not write: choose an empty or new "
                "directory (--out, or params' paths)")
    return out_dir


def _remove_set_aside(out_dir: Path) -> None:
    leftovers = _set_aside(out_dir)
    for old in leftovers:
        if old.is_symlink():  # a link set aside by an earlier release: the link goes, its target stays
            old.unlink()
        else:
            shutil.rmtree(old)
    if leftovers:
        fsync_dir(out_dir.parent)


def prepare_partial(out_dir: Path, plan: ReplayPlan) -> Path:
    """The working directory of this run; an earlier unfinished run of the same plan is resumed
    (and ``plan.run_id`` becomes its run id), one of another plan is removed. A complete one
    (interrupted while being put in place) is put in place first, never removed."""
    recover(out_dir)
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
    never a mix, and a crash at any step is completed by :func:`recover` (module docstring)."""
    if not is_complete(work):
        raise StorageError(f"{work}: not a complete run ({MANIFEST} missing); it cannot replace {out_dir}")
    parent = out_dir.parent
    old = old_dir(out_dir)
    if old.exists() and out_dir.exists():
        # Without recover() first: keep the complete one of the two as the run set aside.
        shutil.rmtree(old if is_complete(out_dir) else out_dir)
    if out_dir.exists():
        os.replace(out_dir, old)  # step 1
        fsync_dir(parent)
    os.replace(work, out_dir)  # step 2
    fsync_dir(parent)
    (out_dir / PLAN_FILE).unlink(missing_ok=True)  # step 3
    _remove_set_aside(out_dir)  # step 4
