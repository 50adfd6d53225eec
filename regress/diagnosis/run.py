"""``regress diagnose``: run a candidate's drifted prompts again under probes and say why they drifted.

Steps: pick the drifted prompts from the candidate's scores (regressions first, at most
``max_prompts``), build the probes that apply (:mod:`regress.diagnosis.probes`), run each as a
normal, resumable replay of just those prompts into ``<diagnosis dir>/<probe>[-side]/`` on warm
engines (one engine per configuration: :mod:`regress.replay.warm`), compare the outputs,
and attribute (:mod:`regress.diagnosis.attribute`). The result is ``diagnosis.json`` beside the
candidate's scores.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from regress.diagnosis.attribute import attribute
from regress.diagnosis.probes import Probe, build_probes
from regress.diagnosis.record import DIAGNOSIS_FILE, Diagnosis, Observation, ProbeRun
from regress.errors import CandidateEnvError, ConfigError, EngineError, InputError
from regress.records import CandidateSpec, ScoredRun
from regress.storage import atomic_write_text

if TYPE_CHECKING:
    from regress.datasets import PromptSet
    from regress.replay.warm import WarmEngines
    from regress.replay import ProgressSink
    from regress.runs import RunResult

DRIFTED = ("regression", "input_drift", "drift")
"""Classes diagnosed, worst first."""
DEFAULT_MAX_PROMPTS = 10


def _served_defaults(scored: ScoredRun, found: list[Any]) -> list[Any]:
    """The server-side defaults the two runs met, when they differ and params.yaml cannot show it
    (two ``url:`` servers started with other ``--generation-config``): an input-defaults difference,
    so that the revert-input-defaults probe runs."""
    from regress.effective import Difference
    from regress.report.configdiff import input_defaults_drift, server_defaults_applied, shown_defaults

    if any(d.source == "input defaults" for d in found) or input_defaults_drift(scored.golden, scored.run) is None:
        return []
    return [Difference("input defaults", "server defaults applied", shown_defaults(server_defaults_applied(scored.golden)),
                       shown_defaults(server_defaults_applied(scored.run)))]


def drifted_prompts(scored: ScoredRun, run: "RunResult", limit: int) -> tuple[list[str], list[str]]:
    """(prompts to diagnose, drifted prompts left out with why): regressions first, then input
    drift, then drift, each in prompt-set order. Sampled prompts (stored per sample) are left out:
    they are compared as distributions, not token by token."""
    chosen: list[str] = []
    left: list[str] = []
    for klass in DRIFTED:
        for s in scored.scores:
            if s.prompt_class != klass:
                continue
            if s.prompt_id not in run:
                left.append(f"{s.prompt_id} (sampled: compared as distributions)")
            elif len(chosen) < limit:
                chosen.append(s.prompt_id)
            else:
                left.append(f"{s.prompt_id} (over the limit of {limit} prompts)")
    return chosen, left


def subset(prompt_set: "PromptSet", ids: list[str]) -> "PromptSet":
    """The prompt set cut to ``ids`` (in that order). It keeps the set's hash: its runs are
    replays against the same golden, and their plans differ by their prompts."""
    prompts = [prompt_set.get(i) for i in ids]
    return dataclasses.replace(prompt_set, prompts=prompts, _by_id={})


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """First position where two token sequences differ (None: equal)."""
    n = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    if diff.size:
        return int(diff[0])
    return None if len(a) == len(b) else n


@dataclass
class _Job:
    probe: Probe
    side: str
    spec: CandidateSpec
    out: Path


def _jobs(probes: list[Probe], root: Path) -> list[_Job]:
    jobs = []
    for p in probes:
        if p.side in ("baseline", "both"):
            assert p.baseline is not None
            jobs.append(_Job(p, "baseline", p.baseline, root / (p.name if p.side == "baseline" else f"{p.name}-baseline")))
        if p.side in ("candidate", "both"):
            assert p.candidate is not None
            jobs.append(_Job(p, "candidate", p.candidate, root / (p.name if p.side == "candidate" else f"{p.name}-candidate")))
    return jobs


def _ordered(jobs: list[_Job]) -> list[_Job]:
    """Jobs grouped by engine configuration (first appearance order), so one warm engine serves each group."""
    from regress.replay.warm import configuration_key

    order: dict[str, int] = {}
    for j in jobs:
        order.setdefault(configuration_key(j.spec), len(order))
    return sorted(jobs, key=lambda j: order[configuration_key(j.spec)])


def diagnose(
    candidate: CandidateSpec,
    baseline: CandidateSpec,
    prompt_set: "PromptSet",
    golden: "RunResult",
    run: "RunResult",
    scored: ScoredRun,
    out_dir: str | Path,
    scores_dir: str | Path,
    *,
    probes: list[str] | None = None,
    max_prompts: int = DEFAULT_MAX_PROMPTS,
    progress: "ProgressSink | None" = None,
    force: bool = False,
    engines: "WarmEngines | None" = None,
    candidate_defaults: dict[str, Any] | None = None,
) -> Diagnosis:
    """Diagnose ``candidate``'s drifted prompts; write and return ``diagnosis.json`` in ``scores_dir``.

    ``out_dir`` holds the probes' runs (kept, resumable: a second call reuses finished ones unless
    ``force``). ``engines``: warm engines to run on (and leave open); by default the diagnosis
    keeps its own, one at a time, and closes them when done. ``candidate_defaults``: the
    candidate's generation_config defaults when the caller has read them (a check has)."""
    from contextlib import nullcontext

    from regress.effective import differences
    from regress.replay import SilentProgress
    from regress.replay.executors import LocalExecutor
    from regress.replay.plan import plan_replay
    from regress.replay.run import execute_plan
    from regress.replay.warm import WarmEngines
    from regress.runs import load_run

    progress = progress or SilentProgress()
    started = time.monotonic()
    if scored.run.run_id != run.manifest.run_id:
        raise ConfigError(f"the scores of '{candidate.name}' are of run {scored.run.run_id}, not of {run.path} "
                          f"(run {run.manifest.run_id}); score it again (`regress score {candidate.name}`)")
    ids, left_out = drifted_prompts(scored, run, max_prompts)
    found = differences(baseline, candidate, candidate_defaults=candidate_defaults)
    found += _served_defaults(scored, found)
    shown_differences = [d.row() for d in found]
    effective = _effective(run)
    built, skipped = build_probes(baseline, candidate, probes, effective=effective, found=found) if ids else ([], [])
    records: dict[str, ProbeRun] = {}
    outputs: dict[tuple[str, str], "RunResult"] = {}
    failed: dict[str, str] = {}
    out_dir = Path(out_dir)
    if ids:
        sub = subset(prompt_set, ids)
        pool = nullcontext(engines) if engines is not None else WarmEngines(keep=1)
        with pool as engines:
            loads_before = engines.loads
            for job in _ordered(_jobs(built, out_dir)):
                if job.probe.name in failed:
                    continue
                size = 1 if job.probe.layout == "alone" else len(ids)
                plan = plan_replay(job.spec, sub, golden=golden, shard_size=size, teacher_force=False)
                progress.status(f"probe '{job.probe.name}' ({job.side}): {job.probe.changed}")
                t0, before = time.monotonic(), engines.loads
                # fresh: the probes send the same prompts again and again, so an engine that cannot
                # confirm it cleared the earlier probes' prefix cache (which would skip their
                # prefill and compute otherwise) is replaced rather than reused.
                try:
                    execute_plan(plan, job.out, executor=LocalExecutor.on(engines, fresh=True), progress=progress, force=force)
                except (EngineError, CandidateEnvError, InputError) as exc:
                    if job.probe.name in ("reference", "control"):
                        raise
                    failed[job.probe.name] = f"the engine could not run it: {str(exc).splitlines()[0][:300]}"
                    continue
                outputs[(job.probe.name, job.side)] = load_run(job.out)
                prev = records.get(job.probe.name)
                loads = engines.loads - before
                seconds = round(time.monotonic() - t0, 3)
                records[job.probe.name] = _probe_record(job.probe, [str(job.out)], loads, seconds, prev)
            loads_total = engines.loads - loads_before
    else:
        loads_total = 0
    # A probe with a side that could not run is skipped as a whole (its other side is not compared).
    probe_runs = [records[p.name] if p.name in records and p.name not in failed else
                  ProbeRun(name=p.name, source=p.source, changed=p.changed, side=p.side, compared_with=p.compared_with,
                           run_dirs=records[p.name].run_dirs if p.name in records else [],
                           skipped=failed.get(p.name, "not run"))
                  for p in built]
    outputs = {key: run for key, run in outputs.items() if key[0] not in failed}
    probe_runs += [ProbeRun(name=s.name, source=s.source, changed="-", side="candidate", compared_with="-",
                            skipped=s.reason) for s in skipped]
    observations = _observe(built, ids, golden, run, outputs)
    scores = {s.prompt_id: s for s in scored.scores}
    prompts = [attribute(pid, scores[pid], observations.get(pid, []), built, found,
                         golden=golden[pid], candidate_run=run[pid]) for pid in ids]
    by_cause: dict[str, int] = {}
    for p in prompts:
        for cause in p.causes:
            by_cause[cause] = by_cause.get(cause, 0) + 1
    diagnosis = Diagnosis(
        candidate=candidate.name, baseline=baseline.name, golden_run_id=golden.manifest.run_id,
        run_id=run.manifest.run_id, drifted=len(ids) + len(left_out), differences=shown_differences,
        probes=probe_runs, prompts=prompts, by_cause=by_cause, engine_loads=loads_total,
        seconds=round(time.monotonic() - started, 3), left_out=left_out)
    scores_dir = Path(scores_dir)
    scores_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(scores_dir / DIAGNOSIS_FILE, diagnosis.model_dump_json(indent=1))
    return diagnosis


def _effective(run: "RunResult") -> dict[str, Any] | None:
    effective = getattr(run.manifest, "effective", None)
    if effective is None:
        return None
    return effective.model_dump() if hasattr(effective, "model_dump") else dict(effective)


def _probe_record(probe: Probe, dirs: list[str], loads: int, seconds: float, prev: ProbeRun | None) -> ProbeRun:
    if prev is not None:
        return prev.model_copy(update={"run_dirs": [*prev.run_dirs, *dirs], "engine_loads": prev.engine_loads + loads,
                                       "seconds": round(prev.seconds + seconds, 3)})
    return ProbeRun(name=probe.name, source=probe.source, changed=probe.changed, side=probe.side,
                    compared_with=probe.compared_with, run_dirs=dirs, engine_loads=loads, seconds=seconds)


def _observe(probes: list[Probe], ids: list[str], golden: "RunResult", run: "RunResult",
             outputs: dict[tuple[str, str], "RunResult"]) -> dict[str, list[Observation]]:
    """Per prompt, what each probe that ran showed: its output against what it is compared with."""
    reference = outputs.get(("reference", "baseline"))
    control = outputs.get(("control", "candidate"))
    found: dict[str, list[Observation]] = {pid: [] for pid in ids}
    for p in probes:
        for pid in ids:
            if p.side == "both":
                a, b = outputs.get((p.name, "baseline")), outputs.get((p.name, "candidate"))
            elif p.side == "baseline":
                a, b = golden, outputs.get((p.name, "baseline"))
            else:
                mine = outputs.get((p.name, "candidate"))
                against = {"candidate run": run, "control": control, "reference": reference}[p.compared_with]
                a, b = against, mine
            if a is None or b is None or pid not in a or pid not in b:
                continue
            d = first_difference(a[pid].output_token_ids, b[pid].output_token_ids)
            found[pid].append(Observation(probe=p.name, same=d is None, first_divergence=d))
    if reference is not None and control is not None:
        # The two sides in the same batch: does the drift reproduce outside the batch it ran in?
        for pid in ids:
            d = first_difference(reference[pid].output_token_ids, control[pid].output_token_ids)
            found[pid].append(Observation(probe="same-batch", same=d is None, first_divergence=d))
    return found
