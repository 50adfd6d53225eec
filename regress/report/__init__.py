"""The regression report: decide a rollout from one page.

::

    reports/index.html                 every candidate checked: verdict, counts, link
    reports/<candidate>/index.html     the candidate's page (self-contained, opens from disk)
    reports/<candidate>/metrics.json   aggregates (RunMetrics; schema in metrics.schema.json)
    reports/<candidate>/junit.xml      a test case per prompt, a failure per regression
    reports/<candidate>/summary.md     Markdown for a CI job summary or a PR comment
    reports/candidates.json            headline numbers per candidate (dvc plots)
    reports/trend.json                 per release checked, in version order (dvc plots; regress.trend)

Every file is written atomically. The files of one candidate are not replaced all at once, so
each names the scoring it was made from: ``index.html``, ``junit.xml`` and ``summary.md`` end
with a comment ``<!-- regress-scoring: ID -->`` (:func:`regress.scoring.scoring_id`) and
``metrics.json`` is exactly that scoring's aggregates; ``metrics.json`` is written last.
:func:`check_report` tells a report left half-rewritten by a crash from a whole one. See
docs/report.md for what each part of the page shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from regress.records import ScoredRun
from regress.runs import RunResult
from regress.storage import atomic_write_text

if TYPE_CHECKING:
    from regress.diagnosis.record import Diagnosis
    from regress.trend import HistoryLine

INDEX_FILE = "index.html"
METRICS_FILE = "metrics.json"
JUNIT_FILE = "junit.xml"
SUMMARY_FILE = "summary.md"
METRICS_SCHEMA = Path(__file__).parent / "metrics.schema.json"
"""JSON Schema of ``metrics.json`` (generated from RunMetrics; a test keeps it current)."""


def write_candidate_report(score: ScoredRun, golden: RunResult, run: RunResult, prompt_set: Any,
                           out_dir: str | Path, *, index_link: str | None = "../index.html",
                           report_link: str | None = None, diagnosis: "Diagnosis | None" = None) -> Path:
    """Write a candidate's ``index.html``, ``metrics.json``, ``junit.xml`` and ``summary.md``.

    ``prompt_set`` (a :class:`regress.datasets.PromptSet`, or None) supplies the prompt texts
    shown in the details. ``index_link`` is the page's link back to the list of candidates
    (None: no link); ``report_link`` is mentioned at the end of ``summary.md``. ``diagnosis``
    (``regress diagnose``'s record, :func:`regress.diagnosis.record.load_diagnosis`) adds the
    page's "Why it drifted" card and cause column, summary.md's "Why it drifted" section and the
    causes in junit.xml's failures; one made for another run than ``score``'s is not shown.
    Returns the path of ``index.html``.
    """
    from regress.report.junit import junit_xml
    from regress.report.render import render_candidate
    from regress.report.summary import summary_markdown

    out = Path(out_dir)
    page = out / INDEX_FILE
    # A comment after the content: invisible in the page, the rendered summary and junit readers.
    trailer = f"\n{_TRAILER_START}{_scoring_id(score)} -->\n"
    atomic_write_text(out / JUNIT_FILE, junit_xml(score, diagnosis=diagnosis, prompt_set=prompt_set).rstrip("\n") + trailer)
    atomic_write_text(out / SUMMARY_FILE,
                      summary_markdown(score, report_link, diagnosis=diagnosis).rstrip("\n") + "\n" + trailer)
    atomic_write_text(page, render_candidate(score, golden, run, prompt_set, index_link=index_link,
                                             diagnosis=diagnosis).rstrip("\n") + trailer)
    atomic_write_text(out / METRICS_FILE, _metrics_json(score))
    return page


def _metrics_json(score: ScoredRun) -> str:
    """``metrics.json``'s text. A lone surrogate (a prompt id or tag from a JSON ``\\ud800`` escape,
    in the lost ids or the slices) cannot be written as UTF-8, nor read back by pydantic when
    escaped: it becomes '?', as in the page, rather than stopping the report."""
    from pydantic_core import PydanticSerializationError

    try:
        return score.metrics.model_dump_json(indent=2)
    except PydanticSerializationError:
        import json
        import math

        from regress.report.render import valid_text

        def writable(value: Any) -> Any:  # what model_dump_json would write: non-finite floats as null
            if isinstance(value, str):
                return valid_text(value)
            if isinstance(value, float) and not math.isfinite(value):
                return None
            if isinstance(value, dict):
                return {writable(k): writable(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [writable(v) for v in value]
            return value

        return json.dumps(writable(score.metrics.model_dump(mode="json")), indent=2, ensure_ascii=False,
                          allow_nan=False)


_TRAILER_START = "<!-- regress-scoring: "


def _scoring_id(score: ScoredRun) -> str:
    """:func:`regress.scoring.scoring_id`; for a scoring holding a lone surrogate (which it cannot
    encode, nor can scores.json be written with one: such a scoring is only ever in memory), the
    same hash of what metrics.json holds instead."""
    from pydantic_core import PydanticSerializationError

    from regress.scoring import scoring_id

    try:
        return scoring_id(score)
    except (PydanticSerializationError, UnicodeEncodeError):
        import hashlib

        from regress.report.render import valid_text

        identity = "|".join([score.created_at.isoformat(), score.run.run_id, score.golden.run_id, _metrics_json(score)])
        return hashlib.sha256(valid_text(identity).encode("utf-8")).hexdigest()[:16]


def check_report(score: ScoredRun, out_dir: str | Path) -> None:
    """Raise :class:`~regress.errors.StorageError` naming the first file of the candidate report
    in ``out_dir`` that is not of ``score``'s scoring (missing, from an earlier scoring, or
    written before reports named their scoring)."""
    from regress.errors import StorageError
    from regress.scoring import check_metrics_beside

    out = Path(out_dir)
    expected = f"{_TRAILER_START}{_scoring_id(score)} -->"
    for name in (JUNIT_FILE, SUMMARY_FILE, INDEX_FILE):
        path = out / name
        try:
            with open(path, "rb") as fh:  # the trailer is in the last bytes; pages can be large
                fh.seek(max(0, path.stat().st_size - 200))
                tail = fh.read().decode("utf-8", "replace")
        except OSError as exc:
            raise StorageError(f"{path}: the report is incomplete ({exc.strerror or exc}); run `regress report`") from exc
        if expected not in tail:
            raise StorageError(f"{path}: not of the scoring in scores.json (an interrupted or older report); "
                               "run `regress report` again")
    if not (out / METRICS_FILE).is_file():
        raise StorageError(f"{out / METRICS_FILE}: the report is incomplete; run `regress report`")
    check_metrics_beside(score, out / METRICS_FILE, "not of the scoring in scores.json (an interrupted or older "
                         "report); run `regress report` again")


def write_index(reports: list[tuple[ScoredRun, str]], out_dir: str | Path, *,
                history: "str | Path | list[HistoryLine] | None" = None) -> Path:
    """Write ``index.html`` listing every candidate: (score report, relative link to its page).

    Links must be relative paths (``f32/index.html``); anything with a scheme is refused.
    ``history`` (the check history's file, ``scores/history.jsonl``, or its lines) adds the
    "Trend across releases" section and writes ``trend.json`` beside the page
    (:func:`write_trend_table`).
    """
    from regress.report.render import render_index
    from regress.trend import load_history

    lines = None
    if history is not None:
        lines = history if isinstance(history, list) else load_history(history)
        write_trend_table(lines, out_dir)
    page = Path(out_dir) / INDEX_FILE
    atomic_write_text(page, render_index(reports, lines))
    return page


TREND_TABLE = "trend.json"
"""Per package, per release in version order: the numbers of the trend (the data of ``dvc plots``)."""


def write_trend_table(history: "list[HistoryLine]", out_dir: str | Path) -> Path:
    """Write ``trend.json``: the rows of :func:`regress.trend.trend_rows` ([] without release lines)."""
    import json

    from regress.trend import trend_rows, trend_series

    path = Path(out_dir) / TREND_TABLE
    atomic_write_text(path, json.dumps(trend_rows(trend_series(history)), indent=2, ensure_ascii=False))
    return path


CANDIDATES_TABLE = "candidates.json"
"""One row of headline numbers per candidate: the data of ``dvc plots`` (drift across candidates)."""


def write_candidates_table(reports: list[ScoredRun], out_dir: str | Path) -> Path:
    """Write ``candidates.json``: per candidate, the numbers worth plotting side by side."""
    import json

    rows = []
    for r in reports:
        m = r.metrics
        rows.append({
            "candidate": m.candidate,
            "engine": r.run.versions.engine_package or r.run.candidate.backend,
            "verdict": m.verdict,
            "gate": m.gate,
            "quality_verdict": m.quality_verdict,
            "quality_difference": m.quality.difference if m.quality is not None else None,
            "exact_match_rate": m.exact_match_rate,
            "regression_rate": m.regression / m.prompts if m.prompts else 0.0,
            "mean_teacher_forced_kl": m.mean_teacher_forced_kl,
            "same_top1_rate": m.same_top1_rate,
            "mean_semantic_similarity": m.mean_semantic_similarity,
            "tokens_per_s_ratio": m.tokens_per_s_ratio,
            **m.extra,  # plugins' aggregates, plotted like the built-in ones
        })
    path = Path(out_dir) / CANDIDATES_TABLE
    atomic_write_text(path, json.dumps(rows, indent=2))
    return path


def refresh_index(reports_dir: str | Path, scores_dir: str | Path | None = None) -> Path:
    """Rewrite ``<reports_dir>/index.html``, ``candidates.json`` and ``trend.json`` from every
    ``<scores_dir>/*/scores.json`` and the check history ``<scores_dir>/history.jsonl``
    (default: the reports directory itself), by candidate name."""
    from regress.scoring import SCORES_FILE, read_scored_run
    from regress.trend import HISTORY_FILE

    reports_dir = Path(reports_dir)
    scores = Path(scores_dir or reports_dir)
    found = sorted(p.parent for p in scores.glob(f"*/{SCORES_FILE}"))
    reports = [read_scored_run(d / SCORES_FILE) for d in found]
    write_candidates_table(reports, reports_dir)
    return write_index([(r, f"{d.name}/{INDEX_FILE}") for r, d in zip(reports, found)], reports_dir,
                       history=scores / HISTORY_FILE)


__all__ = ["write_candidate_report", "check_report", "write_index", "refresh_index", "write_trend_table", "TREND_TABLE", "METRICS_SCHEMA", "INDEX_FILE", "METRICS_FILE",
           "JUNIT_FILE", "SUMMARY_FILE"]
