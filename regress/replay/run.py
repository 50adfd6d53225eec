"""``replay()``: plan, run the shards that are not done, write the manifest, put the run in place."""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from regress.datasets import PromptSet
from regress.errors import RunError
from regress.records import CandidateSpec, RunManifest
from regress.replay.executors import Executor, LocalExecutor
from regress.replay.manifest import build_manifest
from regress.replay.plan import ReplayPlan, plan_golden_scoring, plan_replay
from regress.replay.rundir import (finish, partial_dir, prepare_partial, prompts_done, recover, run_target,
                                   shard_is_done, shard_metas, up_to_date_run)
from regress.replay.sink import ProgressSink, SilentProgress
from regress.runs import GOLDEN_SCORED_DIR, RunResult, write_manifest


def replay(
    candidate: CandidateSpec,
    prompt_set: PromptSet,
    out_dir: str | Path,
    *,
    golden: RunResult | None = None,
    shard_size: int | None = None,
    teacher_force: bool = True,
    executor: Executor | None = None,
    progress: ProgressSink | None = None,
    force: bool = False,
    baseline: CandidateSpec | None = None,
    generation_defaults: dict[str, Any] | None = None,
    generate: bool = True,
    golden_scoring: str = "auto",
) -> RunManifest:
    """Run ``candidate`` over ``prompt_set`` into ``out_dir``; with ``golden``, a replay against it.

    A complete run of the same plan already in ``out_dir`` is reused unless ``force``; finished
    shards of an interrupted run with the same plan are kept and not run again. Returns the
    manifest of the complete run.

    ``baseline`` (the golden's candidate, as configured): when the prompt set has sampled prompts,
    the baseline then scores the candidate's samples teacher-forced into
    ``<out_dir>/golden-scored/`` (:func:`~regress.replay.plan.plan_golden_scoring`): how likely the
    golden's model finds what the candidate sampled. One more engine load, only for sampled prompts,
    and with ``golden_scoring="auto"`` only when the candidate's decode logprobs are not the
    golden's where both had the same context (:func:`regress.metrics.sample_scorer.logprob_agreement`):
    where they agree, its own logprobs of its samples are the baseline's and the engine is not started.
    ``"always"`` has the baseline score them regardless.

    ``generation_defaults``: the candidate's generation_config defaults when the caller has read
    them (:func:`regress.effective.generation_defaults`; None: the plan reads them).

    ``generate=False``: prefill only (a quick check, :mod:`regress.quick`): the golden's
    completions teacher-forced, nothing generated, sampled prompts left out.
    """
    from regress.metrics.sample_scorer import GOLDEN_SCORING_MODES

    if golden_scoring not in GOLDEN_SCORING_MODES:
        raise ValueError(f"golden_scoring {golden_scoring!r}: one of {', '.join(GOLDEN_SCORING_MODES)}")
    out_dir = run_target(Path(out_dir))  # before any engine starts
    progress = progress or SilentProgress()
    executor = executor or LocalExecutor()
    plan = plan_replay(candidate, prompt_set, golden=golden, shard_size=shard_size, teacher_force=teacher_force,
                       generation_defaults=generation_defaults, generate=generate)
    scores_samples = (golden is not None and baseline is not None and candidate.name != baseline.name and generate
                      and golden_scoring != "never")
    early = scores_samples and baseline_likely_scores(candidate, baseline, golden_scoring)
    with _baseline_started_early(executor, baseline if early else None, plan, out_dir, force) as executor:
        manifest = execute_plan(plan, out_dir, executor=executor, progress=progress, force=force)
        if scores_samples:
            assert golden is not None and baseline is not None
            _score_samples(baseline, prompt_set, out_dir, golden=golden, golden_scoring=golden_scoring,
                           executor=executor, progress=progress, force=force)
    return manifest


def baseline_likely_scores(candidate: CandidateSpec, baseline: CandidateSpec, golden_scoring: str) -> bool:
    """Whether starting the baseline's engine early pays off: always when asked, and under
    ``auto`` when the candidate changes a setting of the baseline's own engine package (a
    quantization, a KV-cache dtype: its logprobs differ by design). Another release's usually
    agree, and beside its start an unneeded engine only slows it (measured in docs/benchmarks.md)."""
    return golden_scoring == "always" or (golden_scoring == "auto" and candidate.package == baseline.package)


def _score_samples(baseline: CandidateSpec, prompt_set: PromptSet, out_dir: Path, *, golden: RunResult,
                   golden_scoring: str, executor: Executor, progress: ProgressSink, force: bool) -> None:
    """The baseline scores the candidate run's samples into ``<out_dir>/golden-scored/`` unless
    none needs it or (``auto``) the candidate's logprobs are the golden's."""
    from regress.metrics.sample_scorer import logprob_agreement
    from regress.runs import load_run

    run = load_run(out_dir)
    scoring = plan_golden_scoring(baseline, prompt_set, run, golden=golden)
    if scoring is None:
        return
    agreement = logprob_agreement(run, golden) if golden_scoring == "auto" else None
    if agreement is not None and agreement.holds:
        progress.status(f"the candidate scores its own samples: {agreement.describe()}")
        return
    progress.status(f"the baseline '{baseline.name}' scores the candidate's samples"
                    + (f" ({agreement.describe()})" if agreement is not None else ""))
    execute_plan(scoring, out_dir / GOLDEN_SCORED_DIR, executor=executor, progress=progress, force=force)


@contextmanager
def _baseline_started_early(executor: Executor, baseline: CandidateSpec | None, plan: ReplayPlan, out_dir: Path,
                            force: bool) -> Iterator[Executor]:
    """The executor to replay on, with the baseline's engine already starting when it will likely
    score the candidate's samples: a local run whose plan has sampled prompts and work to do.
    vLLM's imports are most of an engine start and run on one core, so the baseline's load
    overlaps the candidate's own start instead of following its replay (measured in
    docs/benchmarks.md); when it is not needed it is stopped. Otherwise ``executor`` as it is."""
    samples = any(p["sampling"].get("samples") for task in plan.tasks for p in task.prompts)
    if baseline is None or not samples or not isinstance(executor, LocalExecutor) \
            or (not force and up_to_date_run(out_dir, plan) is not None):
        yield executor
        return
    from regress.replay.warm import WarmEngines

    own = executor.engines is None
    engines = WarmEngines(keep=1, shard_timeout_s=executor.shard_timeout_s) if own else executor.engines
    assert engines is not None
    try:
        engines.prestart(baseline, log=out_dir.parent / f".{out_dir.name}.{GOLDEN_SCORED_DIR}.{os.getpid()}.log")
        yield LocalExecutor(max_restarts=executor.max_restarts, shard_timeout_s=executor.shard_timeout_s,
                            engines=engines)
    finally:
        if own:
            engines.close()
        else:
            engines.drop_launched(baseline)


def execute_plan(plan: ReplayPlan, out_dir: Path, *, executor: Executor, progress: ProgressSink,
                 force: bool = False) -> RunManifest:
    """Run a plan's shards that are not done into ``out_dir`` and put the run in place."""
    started = time.monotonic()
    out_dir = run_target(out_dir)
    # An earlier command may have died in the middle of putting its run in place: finish its
    # swap first, so that a complete run is never mistaken for a stale .partial.
    recover(out_dir)
    if not force:
        existing = up_to_date_run(out_dir, plan)
        if existing is not None:
            progress.status(f"{out_dir} is up to date (same candidate, prompts, batches and golden); --force reruns it")
            return existing
    else:
        # Start over for real: no shard of an interrupted attempt is reused, and the new run id
        # (plan.run_id, fresh) makes workers drop the old attempt's queued messages.
        shutil.rmtree(partial_dir(out_dir), ignore_errors=True)
    work = prepare_partial(out_dir, plan)
    already = prompts_done(work, plan)
    total = sum(t.size for t in plan.tasks)  # requests: a sampled prompt counts once per sample
    if not plan.prefill_only:
        progress.start("generate", total)
        if already:
            progress.advance("generate", already)
    if plan.kind == "replay" and plan.teacher_forced:
        progress.start("teacher_force", total)
        if already:
            progress.advance("teacher_force", already)
    try:
        outcome = executor.run(plan, work, progress)
    except RunError as exc:
        _name_missing_prompts(exc, plan, work)
        raise
    manifest = build_manifest(plan, outcome, shard_metas(work, plan), time.monotonic() - started)
    manifest = write_manifest(work, manifest)
    finish(work, out_dir)
    return manifest


MISSING_SHOWN = 10
"""Prompt ids a failed run names (then a count)."""


def _name_missing_prompts(exc: RunError, plan: ReplayPlan, work: Path) -> None:
    """Add to a failed run's error which prompts it did not run, and that the finished shards are
    kept: the user knows what is missing and that running the command again resumes."""
    missing = [p["id"] for t in plan.tasks if not shard_is_done(work, t) for p in t.prompts]
    if not missing:
        return
    done = sum(1 for t in plan.tasks if shard_is_done(work, t))
    shown = ", ".join(missing[:MISSING_SHOWN]) + (f" and {len(missing) - MISSING_SHOWN} more"
                                                   if len(missing) > MISSING_SHOWN else "")
    note = (f"{len(missing)} prompt(s) not run: {shown}; "
            + (f"the {done} finished shard(s) are kept in {work}: run the command again to resume"
               if done else "run the command again to retry"))
    exc.args = (f"{exc}\n{note}", *exc.args[1:])
