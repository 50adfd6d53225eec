"""A regression check as one call: replay a candidate, score it, write its report.

The CLI (``regress check``), the release watcher and its Celery task all run checks through
here, so a check means the same thing whoever starts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from regress.config import Params
from regress.records import CandidateSpec, RunManifest, ScoredRun

if TYPE_CHECKING:
    from regress.replay.warm import WarmEngines
    from regress.diagnosis.record import Diagnosis
    from regress.replay import Executor, ProgressSink


@dataclass(frozen=True)
class ScoredCandidate:
    """Where a scored candidate's outputs went."""

    report: ScoredRun
    scores_dir: Path
    page: Path | None
    diagnosis: "Diagnosis | None" = None
    """Why its prompts drifted, when a diagnosis ran in this check (``diagnose:`` in params)."""


@dataclass(frozen=True)
class CheckResult:
    """A finished check: the run's manifest, the scores and the report page."""

    manifest: RunManifest
    scored: ScoredCandidate

    @property
    def verdict(self) -> str:
        return self.scored.report.metrics.verdict

    @property
    def gating_failed(self) -> bool:
        """Whether the check fails CI: the output verdict, or a latency verdict that gates
        (``thresholds.gate_latency``)."""
        return self.scored.report.metrics.gating_failed


def executor_for(params: Params, choice: str | None = None, queue: str | None = None) -> "Executor | None":
    """The executor asked for (``choice``, else params.yaml's ``executor``); ``None`` is local."""
    from regress.errors import ConfigError

    kind = choice or params.executor
    if kind == "local":
        if queue:
            raise ConfigError("--queue only applies with --executor celery", field="--queue")
        return None
    if kind != "celery":
        raise ConfigError(f"must be 'local' or 'celery', got '{kind}'", field="--executor")
    from regress.worker.executor import CeleryExecutor

    return CeleryExecutor(params.celery, queue=queue)


def score_candidate(
    params: Params,
    spec: CandidateSpec,
    *,
    golden_dir: Path | None = None,
    run_dir: Path | None = None,
    out: Path | None = None,
    with_report: bool = True,
    diagnosis: "Diagnosis | None" = None,
    source: str = "score",
    release: tuple[str, str] | None = None,
) -> ScoredCandidate:
    """Score a replayed candidate; write scores.json and metrics.json, and (unless told not to)
    its report. The baseline's measured noise (``golden/noise.json``, when there is one for this
    golden) is applied (:mod:`regress.noise.floor`). ``out`` writes scores and report there instead of scores/ and reports/.
    The report shows the candidate's diagnosis (``diagnosis``, else its ``diagnosis.json`` when it
    is of this run).

    Scores written to scores/ add a line to the check history (``scores/history.jsonl``,
    :func:`regress.trend.record_check`) with ``source`` (``check``, ``score``, ``watch``,
    ``bisect``) and the ``release`` checked, (package, version); None: inferred from how the
    candidate differs from the golden's baseline (:func:`regress.trend.release_of`)."""
    from regress.diagnosis.record import load_diagnosis
    from regress.datasets import load_prompt_set
    from regress.envs import regress_home
    from regress.noise.floor import load_floor
    from regress.progress import stderr_console
    from regress.report import refresh_index, write_candidate_report
    from regress.runs import load_run
    from regress.scoring import build_metrics, expected_answers, score_runs, write_score_outputs
    from regress.verdict import Thresholds

    thresholds = Thresholds.from_params(params.thresholds, file=str(params.path))
    golden_run = load_run(golden_dir or params.golden_dir())
    run = load_run(run_dir or params.run_dir(spec.name))
    noise = load_floor(golden_dir or params.golden_dir(), golden_run.manifest.run_id)
    if noise is not None and params.noise is not None and params.noise.k != noise.k:
        noise = noise.model_copy(update={"k": params.noise.k})  # params' k wins: changing it re-scores only
    prompt_set = load_prompt_set(params.dataset) if params.dataset.exists() else None
    tags = {pr.id: pr.tags for pr in prompt_set.prompts} if prompt_set else {}
    with stderr_console.status(f"scoring '{spec.name}' against the golden"):
        metrics = build_metrics(thresholds, cache_dir=regress_home() / "cache")
        report = score_runs(golden_run, run, thresholds, tags=tags, expected=expected_answers(prompt_set),
                            metrics=metrics, noise=noise)
    scores_dir = out or params.scores_dir() / spec.name
    write_score_outputs(report, scores_dir)
    if out is None:  # scores written elsewhere (--out) are an aside, not a check of the project
        from regress.trend import record_check, release_of

        if release is None:
            release = release_of(spec, params.golden_baseline(golden_run.manifest) or params.baseline)
        record_check(params, report, spec, source=source, release=release)  # type: ignore[arg-type]
    page = None
    if with_report:
        with stderr_console.status("writing the report"):
            # A report written elsewhere (--out) has no reports/index.html to link back to.
            if diagnosis is None:
                diagnosis = load_diagnosis(scores_dir, run.manifest.run_id)
            page = write_candidate_report(report, golden_run, run, prompt_set,
                                          out or params.reports_dir() / spec.name,
                                          index_link=None if out else "../index.html", diagnosis=diagnosis)
            if out is None:
                refresh_index(params.reports_dir(), params.scores_dir())
    return ScoredCandidate(report, scores_dir, page)


def run_check(
    params: Params,
    spec: CandidateSpec,
    *,
    golden_dir: Path | None = None,
    executor: "Executor | None" = None,
    progress: "ProgressSink | None" = None,
    force: bool = False,
    golden_scoring: bool = True,
    source: str = "check",
    release: tuple[str, str] | None = None,
) -> CheckResult:
    """Replay ``spec`` against the golden into runs/<name>, score it and write its report.
    ``golden_scoring``: let the baseline score the candidate's samples (sampled prompts only;
    one more engine load; see :func:`regress.replay.replay`). ``source`` and ``release`` go to
    the check history (:func:`score_candidate`): who ran the check (``check``, ``watch``,
    ``bisect``) and the (package, version) it checks, None to infer it."""
    from regress.datasets import load_prompt_set
    from regress.replay import replay
    from regress.runs import load_run

    if executor is None:  # runs here: a missing model directory is an error now, not after env and engine start
        params.check_model_paths(spec)
    prompt_set = load_prompt_set(params.dataset)
    golden_run = load_run(golden_dir or params.golden_dir())
    manifest = replay(spec, prompt_set, params.run_dir(spec.name), golden=golden_run,
                      executor=executor, progress=progress, force=force,
                      baseline=params.golden_baseline(golden_run.manifest) if golden_scoring else None)
    scored = score_candidate(params, spec, golden_dir=golden_dir, source=source, release=release)
    if params.diagnose is not None and scored.report.metrics.verdict == "fail" and spec.name != params.baseline.name:
        # A warm executor's engines (regress.replay.warm) serve the probes too.
        diagnosis = diagnose_candidate(params, spec, golden_dir=golden_dir, progress=progress,
                                       probes=params.diagnose.probes, max_prompts=params.diagnose.max_prompts,
                                       engines=getattr(executor, "engines", None))
        scored = ScoredCandidate(scored.report, scored.scores_dir, scored.page, diagnosis)
    return CheckResult(manifest, scored)


def diagnosis_dir(params: Params, name: str) -> Path:
    """Where a candidate's probe runs go (``diagnosis/<candidate>/``, beside runs/)."""
    return params.root / "diagnosis" / name


def diagnose_candidate(
    params: Params,
    spec: CandidateSpec,
    *,
    golden_dir: Path | None = None,
    progress: "ProgressSink | None" = None,
    probes: list[str] | None = None,
    max_prompts: int = 10,
    force: bool = False,
    engines: "WarmEngines | None" = None,
) -> "Diagnosis":
    """Diagnose a scored candidate (:func:`regress.diagnosis.run.diagnose`): its drifted prompts
    under probes into diagnosis/<name>/, ``diagnosis.json`` beside its scores, and its report
    written again with the "Why" column."""
    from regress.datasets import load_prompt_set
    from regress.diagnosis.run import diagnose
    from regress.errors import ConfigError
    from regress.runs import load_run
    from regress.scoring import read_scored_run

    scores_dir = params.scores_dir() / spec.name
    if not (scores_dir / "scores.json").is_file():
        raise ConfigError(f"'{spec.name}' has no scores in {scores_dir}: run `regress check {spec.name}` "
                          f"(or `regress score {spec.name}`) first", field="candidate")
    golden = load_run(golden_dir or params.golden_dir())
    baseline = params.golden_baseline(golden.manifest) or params.baseline
    if baseline.name == spec.name:
        raise ConfigError(f"'{spec.name}' made the golden: there is nothing to diagnose against", field="candidate")
    params.check_model_paths(spec)
    result = diagnose(spec, baseline, load_prompt_set(params.dataset), golden, load_run(params.run_dir(spec.name)),
                      read_scored_run(scores_dir), diagnosis_dir(params, spec.name), scores_dir,
                      probes=probes, max_prompts=max_prompts, progress=progress, force=force, engines=engines)
    score_candidate(params, spec, golden_dir=golden_dir, diagnosis=result)
    return result
