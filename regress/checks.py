"""A regression check as one call: replay a candidate, score it, write its report.

The CLI (``regress check``), the release watcher and its Celery task all run checks through
here, so a check means the same thing whoever starts it. The commands that run one step of it
(``golden``, ``noise``, ``replay``, ``score``, ``diagnose``) set up and run that step here too.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from regress.config import Params
from regress.records import CandidateSpec, RunManifest, ScoredRun

if TYPE_CHECKING:
    from typing import Callable, ContextManager, Iterator

    from regress.datasets import PromptSet
    from regress.replay.warm import WarmEngines
    from regress.diagnosis.record import Diagnosis
    from regress.replay import Executor, ProgressSink
    from regress.noise.floor import NoiseFloor
    from regress.runs import RunResult


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


def ready_to_run(params: Params, spec: CandidateSpec, executor: "Executor | None") -> "Executor | None":
    """``executor`` back (from :func:`executor_for`; None runs here) once what a run of ``spec``
    needs before anything starts is checked: run here, its model directories must exist. Every
    command that runs a candidate (golden, noise, replay, check) sets up through here."""
    if executor is None:  # runs here: a missing model directory is an error now, not after env and engine start
        params.check_model_paths(spec)
    return executor


@contextmanager
def local_engines(executor: "Executor | None") -> "Iterator[tuple[Executor | None, WarmEngines | None]]":
    """For a command that runs the baseline more than once (the golden, then its noise arms):
    run here (``executor`` None), one pool of warm engines for all of its runs and the local
    executor on it, so that an arm that only changes what is sent reuses the golden's engine
    instead of paying for another start; elsewhere (Celery), ``executor`` and no pool."""
    if executor is not None:
        yield executor, None
        return
    from regress.replay import LocalExecutor
    from regress.replay.warm import WarmEngines

    with WarmEngines(keep=1) as engines:
        yield LocalExecutor.on(engines, fresh=True), engines


def measure_noise(
    params: Params,
    spec: CandidateSpec,
    prompt_set: "PromptSet",
    golden_dir: Path,
    executor: "Executor | None",
    *,
    progress: "Callable[[str], ContextManager[ProgressSink]] | None" = None,
    force: bool = False,
    engines: "WarmEngines | None" = None,
) -> "NoiseFloor":
    """Run params' noise arms of ``spec`` (the golden's candidate) against the golden in
    ``golden_dir``, scored with params' thresholds and metrics, and write golden/noise.json
    (:func:`regress.noise.arms.run_arms`). ``progress``: makes the display, given its title.
    ``engines``: the warm engines of the golden's run (:func:`local_engines`); run here without
    them, the arms get a pool of their own."""
    from contextlib import nullcontext

    from regress.home import regress_home
    from regress.noise.arms import run_arms
    from regress.scoring import build_metrics, expected_answers
    from regress.verdict import Thresholds

    thresholds = Thresholds.from_params(params.thresholds, file=str(params.path))
    metrics = build_metrics(thresholds, cache_dir=regress_home() / "cache")
    shown = progress(f"noise arms of '{spec.name}'") if progress is not None else nullcontext(None)
    pool = local_engines(executor) if engines is None else nullcontext((executor, engines))
    with pool as (_, arm_engines), shown as sink:
        return run_arms(spec, prompt_set, golden_dir, params.noise, thresholds=thresholds,
                        expected=expected_answers(prompt_set), executor=executor, progress=sink,
                        force=force, metrics=metrics, engines=arm_engines)


@dataclass(frozen=True)
class _Scoring:
    """A candidate scored, not written yet, with what it was scored from."""

    report: ScoredRun
    golden: "RunResult"
    run: "RunResult"
    prompt_set: "PromptSet | None"
    scores_dir: Path


def _score(params: Params, spec: CandidateSpec, *, golden_dir: Path | None, run_dir: Path | None,
           out: Path | None, golden: "RunResult | None" = None, prompt_set: "PromptSet | None" = None,
           whole: bool = True) -> _Scoring:
    """Score ``spec``'s run against the golden, writing nothing. ``golden`` and ``prompt_set``:
    loaded already by the caller (a check), else read here. ``whole``: the run must hold every
    prompt of the golden (False for a try, which runs part of the prompt set)."""
    from regress.datasets import load_prompt_set
    from regress.errors import ConfigError
    from regress.home import regress_home
    from regress.noise.floor import load_floor
    from regress.progress import stderr_console
    from regress.runs import load_run
    from regress.scoring import build_metrics, expected_answers, score_runs
    from regress.verdict import Thresholds
    from regress.watchdog import phase

    thresholds = Thresholds.from_params(params.thresholds, file=str(params.path))
    golden_run = golden if golden is not None else load_run(golden_dir or params.golden_dir())
    run = load_run(run_dir or params.run_dir(spec.name))
    if run.manifest.candidate.name != spec.name and run.manifest.candidate.name in params.candidates:
        # `--run` naming another candidate's run (a baseline's run, a noise arm, may be scored as a candidate)
        raise ConfigError(f"{run.path} is a run of candidate '{run.manifest.candidate.name}', not of '{spec.name}': "
                          f"scores and the gate are filed under the candidate's name, so score it as "
                          f"'{run.manifest.candidate.name}' or replay '{spec.name}'")
    if whole:
        from regress.run_pairs import check_same_entries

        check_same_entries(golden_run, run)
    noise = load_floor(golden_dir or params.golden_dir(), golden_run.manifest.run_id)
    if noise is not None and params.noise is not None and params.noise.k != noise.k:
        noise = noise.model_copy(update={"k": params.noise.k})  # params' k wins: changing it re-scores only
    if prompt_set is None:
        if not params.dataset.exists():
            # Its expected answers and tags are scored: without it the quality verdict would quietly
            # judge fewer prompts, or fall back to fidelity (a DVC-tracked set not pulled, a moved file).
            raise ConfigError(f"the prompt set {params.dataset} is missing: the golden {golden_run.path} was made "
                              f"from it (sha256 {golden_run.manifest.dataset.sha256[:12]}) and its expected answers "
                              "and tags are scored; restore it (`dvc pull`) or point `dataset` at it",
                              file=str(params.path), field="dataset")
        prompt_set = load_prompt_set(params.dataset)
    if prompt_set is not None and prompt_set.sha256 != golden_run.manifest.dataset.sha256:
        # Its expected answers and tags are scored: an edit since the golden would change the verdict.
        raise ConfigError(
            f"the prompt set {prompt_set.path} changed since the golden {golden_run.path} was made "
            f"(sha256 {prompt_set.sha256[:12]} vs {golden_run.manifest.dataset.sha256[:12]}); re-run `regress golden`")
    tags = {pr.id: pr.tags for pr in prompt_set.prompts} if prompt_set else {}
    with phase("scoring", f"candidate '{spec.name}'"), stderr_console.status(f"scoring '{spec.name}' against the golden"):
        metrics = build_metrics(thresholds, cache_dir=regress_home() / "cache")
        from regress.quality import resolve_gate

        gate = resolve_gate(spec, params.golden_baseline(golden_run.manifest) or params.baseline)
        report = score_runs(golden_run, run, thresholds, tags=tags, expected=expected_answers(prompt_set),
                            metrics=metrics, noise=noise, gate=gate, gate_by_default=spec.gate == "auto")
    from regress.power.ladder import load_power

    power = load_power(params.power_dir(), golden_run.manifest.run_id, thresholds)
    if power is not None:  # the gate's measured detection power, shown beside its verdict
        report = report.model_copy(update={"metrics": report.metrics.model_copy(update={"detection_power": power})})
    return _Scoring(report, golden_run, run, prompt_set, out or params.scores_dir() / spec.name)


def _write_scores(params: Params, spec: CandidateSpec, scoring: _Scoring, *, recorded: bool, source: str,
                  release: tuple[str, str] | None) -> None:
    """scores.json and metrics.json, and with ``recorded`` the check's line in the history."""
    from regress.scoring import write_score_outputs

    write_score_outputs(scoring.report, scoring.scores_dir)
    if recorded:  # scores written elsewhere (--out) are an aside, not a check of the project
        from regress.trend import record_check, release_of

        if release is None:
            release = release_of(spec, params.golden_baseline(scoring.golden.manifest) or params.baseline)
        record_check(params, scoring.report, spec, source=source, release=release)  # type: ignore[arg-type]


def _write_report(params: Params, spec: CandidateSpec, scoring: _Scoring, *, out: Path | None,
                  diagnosis: "Diagnosis | None", staged: Path | None = None) -> Path:
    """The candidate's report (and, in reports/, the index): with ``diagnosis``, else with its
    ``diagnosis.json`` when that is of this run. ``staged``: write the candidate's files there
    (the caller moves them into place) and leave the index alone."""
    from regress.diagnosis.record import load_diagnosis
    from regress.progress import stderr_console
    from regress.report import refresh_index, write_candidate_report
    from regress.watchdog import phase

    with phase("report", f"candidate '{spec.name}'"), stderr_console.status("writing the report"):
        # A report written elsewhere (--out) has no reports/index.html to link back to.
        if diagnosis is None:
            diagnosis = load_diagnosis(scoring.scores_dir, scoring.run.manifest.run_id)
        page = write_candidate_report(scoring.report, scoring.golden, scoring.run, scoring.prompt_set,
                                      staged or out or params.reports_dir() / spec.name,
                                      index_link=None if out else "../index.html", diagnosis=diagnosis)
        if out is None and staged is None:
            refresh_index(params.reports_dir(), params.scores_dir())
    return page


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
    whole: bool = True,
) -> ScoredCandidate:
    """Score a replayed candidate; write scores.json and metrics.json, and (unless told not to)
    its report. ``whole``: the run must hold the golden's whole prompt set (False: a caller that
    replayed part of it on purpose, as a try does). The baseline's measured noise (``golden/noise.json``, when there is one for this
    golden) is applied (:mod:`regress.noise.floor`). ``out`` writes scores and report there instead of scores/ and reports/.
    The report shows the candidate's diagnosis (``diagnosis``, else its ``diagnosis.json`` when it
    is of this run).

    Scores written to scores/ add a line to the check history (``scores/history.jsonl``,
    :func:`regress.trend.record_check`) with ``source`` (``check``, ``score``, ``watch``,
    ``bisect``) and the ``release`` checked, (package, version); None: inferred from how the
    candidate differs from the golden's baseline (:func:`regress.trend.release_of`)."""
    scoring = _score(params, spec, golden_dir=golden_dir, run_dir=run_dir, out=out, whole=whole)
    if not with_report:
        _write_scores(params, spec, scoring, recorded=out is None, source=source, release=release)
        return ScoredCandidate(scoring.report, scoring.scores_dir, None)
    page = _write_scored(params, spec, scoring, out=out, diagnosis=diagnosis, source=source, release=release)
    return ScoredCandidate(scoring.report, scoring.scores_dir, page)


def _write_scored(params: Params, spec: CandidateSpec, scoring: _Scoring, *, out: Path | None,
                  diagnosis: "Diagnosis | None", source: str, release: tuple[str, str] | None) -> Path:
    """Scores, history line and report of one scoring, as one set: the report is rendered aside
    first, so that a scoring whose report cannot be made writes nothing (no new scores.json beside
    an old report); then the scores, then the report's files are moved into place, then the index."""
    from regress.storage import building

    dest = out or params.reports_dir() / spec.name
    with building(dest, unique=True, merge=True) as staged:
        page = _write_report(params, spec, scoring, out=out, diagnosis=diagnosis, staged=staged)
        _write_scores(params, spec, scoring, recorded=out is None, source=source, release=release)
    if out is None:
        from regress.report import refresh_index

        refresh_index(params.reports_dir(), params.scores_dir())
    return dest / page.name


def run_check(
    params: Params,
    spec: CandidateSpec,
    *,
    golden_dir: Path | None = None,
    executor: "Executor | None" = None,
    progress: "ProgressSink | None" = None,
    force: bool = False,
    golden_scoring: str = "auto",
    source: str = "check",
    release: tuple[str, str] | None = None,
) -> CheckResult:
    """Replay ``spec`` against the golden into runs/<name>, score it and write its report.
    ``golden_scoring``: who scores the candidate's samples (sampled prompts only): ``auto``, the
    baseline unless the candidate's logprobs agree with the golden's, ``always`` or ``never``
    (:func:`regress.replay.replay`). ``source`` and ``release`` go to
    the check history (:func:`score_candidate`): who ran the check (``check``, ``watch``,
    ``bisect``) and the (package, version) it checks, None to infer it.

    With ``diagnose:`` in params, a failing candidate is diagnosed (:func:`regress.diagnosis.run.diagnose`)
    before its report is written: it is scored once and gets one history line and one report, with the "Why"."""
    from regress.datasets import load_prompt_set
    from regress.diagnosis.run import diagnose
    from regress.effective import generation_defaults
    from regress.prewarm import import_in_background
    from regress.replay import replay
    from regress.runs import load_run

    ready_to_run(params, spec, executor)
    import_in_background()  # the scoring's imports, while the replay waits on its engine
    prompt_set = load_prompt_set(params.dataset)
    golden_run = load_run(golden_dir or params.golden_dir())
    # Read once for the check: the plan resolves sampling with them, the manifest records them,
    # the diagnosis compares them with the baseline's.
    defaults = generation_defaults(spec)
    manifest = replay(spec, prompt_set, params.run_dir(spec.name), golden=golden_run,
                      executor=executor, progress=progress, force=force,
                      baseline=params.golden_baseline(golden_run.manifest), golden_scoring=golden_scoring,
                      generation_defaults=defaults)
    scoring = _score(params, spec, golden_dir=golden_dir, run_dir=None, out=None, golden=golden_run,
                     prompt_set=prompt_set)
    _write_scores(params, spec, scoring, recorded=True, source=source, release=release)
    diagnosis = None
    if params.diagnose is not None and scoring.report.metrics.verdict == "fail" and spec.name != params.baseline.name:
        try:
            baseline = _diagnosis_baseline(params, spec, golden_run)
            # A warm executor's engines (regress.replay.warm) serve the probes too.
            diagnosis = diagnose(spec, baseline, prompt_set, golden_run, scoring.run, scoring.report,
                                 diagnosis_dir(params, spec.name), scoring.scores_dir,
                                 probes=params.diagnose.probes, max_prompts=params.diagnose.max_prompts,
                                 progress=progress, engines=getattr(executor, "engines", None),
                                 candidate_defaults=defaults)
        except BaseException:
            # The check's outputs stay whole without the diagnosis: its report, without the "Why".
            _write_report(params, spec, scoring, out=None, diagnosis=None)
            raise
    page = _write_report(params, spec, scoring, out=None, diagnosis=diagnosis)
    return CheckResult(manifest, ScoredCandidate(scoring.report, scoring.scores_dir, page, diagnosis))


TRY_DIR = "try"
"""Where tries on part of the prompt set go (``try/<candidate>/``): never runs/, scores/ or reports/."""


def try_check(params: Params, spec: CandidateSpec, *, tags: list[str] | None, limit: int | None,
              executor: "Executor | None" = None, progress: "ProgressSink | None" = None, force: bool = False,
              golden_scoring: str = "auto") -> CheckResult:
    """A try (``regress check --tags T --limit N``): ``spec`` replayed on the chosen prompts
    against the golden, scored and reported as a check is, all under ``try/<candidate>/`` (run,
    scores, report). Nothing of the pipeline's is touched and no history line is written, so a try
    is never taken for the candidate's result. Its batches are not the golden's (fewer prompts
    per shard): batch-variant drift can show where the full check sees none."""
    from regress.datasets import load_prompt_set
    from regress.effective import generation_defaults
    from regress.errors import ConfigError
    from regress.replay import replay
    from regress.runs import load_run

    ready_to_run(params, spec, executor)
    full = load_prompt_set(params.dataset)
    chosen = full.subset(tags, limit)
    if not chosen.prompts:
        raise ConfigError(f"--tags {','.join(tags or [])} --limit {limit} choose no prompt of {full.path}", field="--limit")
    golden_run = load_run(params.golden_dir())
    root = params.root / TRY_DIR / spec.name
    manifest = replay(spec, chosen, root / "run", golden=golden_run, executor=executor, progress=progress, force=force,
                      baseline=params.golden_baseline(golden_run.manifest), golden_scoring=golden_scoring,
                      generation_defaults=generation_defaults(spec))
    scoring = _score(params, spec, golden_dir=None, run_dir=root / "run", out=root / "scores", golden=golden_run,
                     prompt_set=full, whole=False)
    _write_scores(params, spec, scoring, recorded=False, source="try", release=None)
    page = _write_report(params, spec, scoring, out=root / "report", diagnosis=None)
    return CheckResult(manifest, ScoredCandidate(scoring.report, scoring.scores_dir, page))


def diagnosis_dir(params: Params, name: str) -> Path:
    """Where a candidate's probe runs go (``diagnosis/<candidate>/``, beside runs/)."""
    return params.root / "diagnosis" / name


def _diagnosis_baseline(params: Params, spec: CandidateSpec, golden: "RunResult") -> CandidateSpec:
    """The candidate that made ``golden``, which ``spec`` is diagnosed against, once a diagnosis
    can run: ``spec`` is not that candidate, and its model directories exist (probes run here)."""
    from regress.errors import ConfigError

    baseline = params.golden_baseline(golden.manifest) or params.baseline
    if baseline.name == spec.name:
        raise ConfigError(f"'{spec.name}' made the golden: there is nothing to diagnose against", field="candidate")
    params.check_model_paths(spec)
    return baseline


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
    whole: bool = True,
) -> "Diagnosis":
    """Diagnose a scored candidate (:func:`regress.diagnosis.run.diagnose`): its drifted prompts
    under probes into diagnosis/<name>/, ``diagnosis.json`` beside its scores, and its report
    written again with the "Why" column. ``whole``: as :func:`score_candidate`'s."""
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
    baseline = _diagnosis_baseline(params, spec, golden)
    result = diagnose(spec, baseline, load_prompt_set(params.dataset), golden, load_run(params.run_dir(spec.name)),
                      read_scored_run(scores_dir), diagnosis_dir(params, spec.name), scores_dir,
                      probes=probes, max_prompts=max_prompts, progress=progress, force=force, engines=engines)
    score_candidate(params, spec, golden_dir=golden_dir, diagnosis=result, whole=whole)
    return result
