"""``regress report`` and ``regress gate``: commands that read stored results (no engine, no scoring)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from regress.cli_guard import writing_project
from regress.cli_options import ParamsOption
from regress.cli_output import out as _out, workflow_command
from regress.errors import EXIT_REGRESSION
from regress.progress import warn


def report(
    candidates: Optional[list[str]] = typer.Argument(None, help="Candidates to render (default: every scored one)."),
    params: Path = ParamsOption,
) -> None:
    """Render the report from stored scores and runs (no replay, no scoring): reports/index.html,
    reports/<candidate>/{index.html,metrics.json,junit.xml,summary.md}, reports/candidates.json.
    Everything stored is shown again: the scores with their noise floor and detection power, a
    candidate's diagnosis (scores/<candidate>/diagnosis.json, when of this run), the trend."""
    from regress.config import load_params
    from regress.datasets import load_prompt_set
    from regress.diagnosis.record import load_diagnosis
    from regress.gate_check import check_current
    from regress.report import refresh_index, write_candidate_report
    from regress.runs import load_run
    from regress.scoring import SCORES_FILE, read_scored_run
    from regress.validation import check_candidate_name
    from regress.watchdog import phase

    # Names become paths under scores/ and reports/: checked before anything is read or written.
    for name in candidates or []:
        check_candidate_name(name)
    p = load_params(params)
    scores_dir, reports_dir = p.scores_dir(), p.reports_dir()
    names = candidates or sorted(d.parent.name for d in scores_dir.glob(f"*/{SCORES_FILE}"))
    prompt_set = load_prompt_set(p.dataset) if p.dataset.exists() else None
    with writing_project(p), phase("report"):
        golden_run = load_run(p.golden_dir())
        for name in names:
            scores = read_scored_run(scores_dir / name)
            run = load_run(p.run_dir(name))
            check_current(scores_dir / name / SCORES_FILE, scores, p, name)  # else new outputs under old classes
            page = write_candidate_report(scores, golden_run, run, prompt_set, reports_dir / name,
                                          diagnosis=load_diagnosis(scores_dir / name, run.manifest.run_id))
            _out(f"report: {page}")
        _out(f"index: {refresh_index(reports_dir, scores_dir)}")


def gate(
    candidates: Optional[list[str]] = typer.Argument(None, help="Candidates to gate on (default: every scored one)."),
    params: Path = ParamsOption,
    fail: bool = typer.Option(True, "--fail/--no-fail", help="Exit 1 when a candidate failed (--no-fail: only print)."),
    annotate: bool = typer.Option(False, "--annotate", help="Also print GitHub Actions error annotations from reports/<candidate>/junit.xml: a few per candidate (failed verdicts, then gating prompts, each at its prompt's file and line), and a count of the rest."),
) -> None:
    """Print every scored candidate's verdicts and exit 1 if any failed the one that gates it (for CI after `dvc repro`).

    Each line: PASS or FAIL as the candidate's gate decides (`gate:` on the candidate: fidelity for engine releases and serving settings, quality for changes made on purpose), then both verdicts: fidelity (outputs against the baseline's noise) and quality (answers, paired, against a margin)."""
    from regress.config import load_params
    from regress.errors import ConfigError, StorageError
    from regress.gate_check import check_metrics
    from regress.records import RunMetrics
    from regress.scoring import METRICS_FILE
    from regress.validation import check_candidate_name

    p = load_params(params)
    names = candidates or sorted(d.parent.name for d in p.scores_dir().glob(f"*/{METRICS_FILE}"))
    if not names:
        raise StorageError(f"{p.scores_dir()}: no scored candidates (run `dvc repro` or `regress score`)")
    failed = []
    for name in names:
        check_candidate_name(name)
    scored = sorted(d.parent.name for d in p.scores_dir().glob(f"*/{METRICS_FILE}"))
    unknown = [n for n in names if n not in scored]
    if unknown:
        from regress.engine_args import did_you_mean

        close = did_you_mean(unknown[0], scored) if scored else None
        raise ConfigError(f"'{unknown[0]}' has not been scored: no {p.scores_dir() / unknown[0] / METRICS_FILE}"
                          + (f"; did you mean '{close}'?" if close else "")
                          + (f" (scored: {', '.join(scored)})" if scored else " (nothing scored yet: run `dvc repro` or `regress check`)"))
    for name in names:
        path = p.scores_dir() / name / METRICS_FILE
        try:
            m = RunMetrics.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StorageError(f"{path}: cannot read the candidate's metrics ({exc})") from exc
        scored_run = check_metrics(path, m, params=p, candidate=name)  # a pass its own counts contradict is refused
        if m.gating_failed:
            failed.append(name)
        latency = ""
        if m.latency_verdict == "fail":
            latency = f"; latency FAIL ({'gating' if m.latency_gates else 'reported, not gating'})"
        shown = "FAIL" if m.gating_failed else "PASS"
        quality = (f"quality {m.quality_verdict.upper()} ({m.quality.difference * 100:+.1f} points)"
                   if m.quality is not None and m.quality.difference is not None else "quality —")
        _out(f"{shown:4}  {name:24} gate {m.gate:<8} fidelity {m.verdict.upper()}, {quality}; {m.regression} "
             f"regression, {m.drift} drift, {m.benign} benign, {m.identical} identical of {m.prompts}{latency}")
        junit = p.reports_dir() / name / "junit.xml"
        if annotate and junit.is_file():
            from regress.report import check_report
            from regress.report.annotations import junit_annotations

            try:  # annotations from an older scoring's junit.xml would contradict the line above
                if scored_run is not None:
                    check_report(scored_run, p.reports_dir() / name)
            except StorageError as exc:
                warn(f"no annotations for '{name}': {exc}")
            else:
                for line in junit_annotations(junit, project=p.root):
                    workflow_command(line)
    _out(f"{len(names) - len(failed)} of {len(names)} candidates pass" + (f"; failing: {', '.join(failed)}" if failed else ""))
    if failed and fail:
        raise typer.Exit(EXIT_REGRESSION)


def register(app: typer.Typer) -> None:
    """Add ``report`` and ``gate`` to the ``regress`` app."""
    app.command()(report)
    app.command()(gate)
