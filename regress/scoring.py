"""Score a candidate run against its golden: metrics per prompt, classes, aggregates, verdict.

Reads two complete runs, writes nothing: :func:`score_runs` returns a
:class:`~regress.records.ScoredRun`; :func:`write_score_outputs` stores it. Which values are
aggregated, and how, is what each metric declares (:class:`regress.metrics.spec.Aggregate`,
applied by :mod:`regress.metrics.aggregate`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from regress.errors import ConfigError
from regress.metrics import DEFAULT_METRICS, get_metric
from regress.metrics.aggregate import aggregates
from regress.metrics.answers import AnswerKey, answers_in
from regress.metrics.base import MetricInfo, Pair
from regress.metrics.choices import answer_check as choice_answer_check
from regress.metrics.sampled_policy import prompt_units, run_shift, sampled_class
from regress.metrics.teacher_forced import not_teacher_forced
from regress.records import AnswerCheck, PromptScore, RunMetrics, ScoredRun
from regress.run_pairs import check_pair, check_teacher_forced
from regress.runs import RunResult, golden_scored
from regress.storage import atomic_write_text, read_record
from regress.verdict import (NoiseJudgement, Thresholds, classify, nonfinite, run_verdict, severe,
                             verdict_basis)

if TYPE_CHECKING:
    from regress.noise.floor import NoiseFloor

SCORES_FILE = "scores.json"
METRICS_FILE = "metrics.json"

ProgressFn = Callable[[int], None]


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(factory).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def build_metrics(t: Any, **context: Any) -> list[tuple[MetricInfo, Any]]:
    """(MetricInfo, configured function) for every metric in force (``t.metrics``, default: the
    built-ins). Each factory gets its declared options from ``t``, and whichever of ``context``
    it takes by name (``cache_dir``: where sentence embeddings persist; ``encoder``: an
    embedding model already loaded)."""
    built = []
    for name in t.metrics or DEFAULT_METRICS:
        info = get_metric(name)
        kwargs = {param: getattr(t, setting.name) for param, setting in info.options.items()}
        kwargs.update({k: v for k, v in context.items() if _accepts(info.factory, k)})
        built.append((info, info.factory(**kwargs)))
    return built


ANSWER_SHOWN = 80
"""Characters of an accepted answer quoted in a prompt's reasons."""


def expected_answers(prompt_set: Any) -> dict[str, AnswerKey]:
    """Prompt id -> answer key (accepted and rejected answers), for the prompts of a
    :class:`~regress.datasets.PromptSet` (or None) that have ``expected``: what
    :func:`score_runs` takes as ``expected``."""
    if prompt_set is None:
        return {}
    return {p.id: AnswerKey(tuple(p.expected), tuple(p.reject or ())) for p in prompt_set.prompts if p.expected}


def check_answer(golden_text: str, candidate_text: str, expected: AnswerKey | list[str]) -> AnswerCheck:
    """The expected answer checked in both outputs."""
    key = AnswerKey.of(expected)
    (g, g_rejected), (c, c_rejected) = answers_in(golden_text, key), answers_in(candidate_text, key)
    return AnswerCheck(expected=list(key.accepted), golden_correct=g is not None, candidate_correct=c is not None,
                       golden_match=g, candidate_match=c, golden_rejected=g_rejected, candidate_rejected=c_rejected)


def _quoted(answer: str | None) -> str:
    text = " ".join((answer or "").split())
    return repr(text if len(text) <= ANSWER_SHOWN else text[:ANSWER_SHOWN] + "…")


def answer_reason(check: AnswerCheck) -> str | None:
    """The per-prompt reason for an answer flip (None without one)."""
    if check.flip == "lost":
        if check.candidate_rejected:
            return (f"expected answer lost: golden had {_quoted(check.golden_match)}, the candidate names the "
                    f"rejected answer {_quoted(check.candidate_rejected)}")
        return f"expected answer lost: golden had {_quoted(check.golden_match)}, candidate does not"
    if check.flip == "gained":
        return f"expected answer gained: candidate has {_quoted(check.candidate_match)}, golden did not"
    return None


def answer_totals(scores: list[PromptScore]) -> dict[str, Any]:
    """The RunMetrics fields about expected answers, from per-prompt scores."""
    checked = [s for s in scores if s.answer is not None]
    lost = [s.prompt_id for s in checked if s.answer.flip == "lost"]
    gained = [s.prompt_id for s in checked if s.answer.flip == "gained"]
    return {
        "answer_prompts": len(checked),
        "golden_answers_correct": sum(1 for s in checked if s.answer.golden_correct),
        "answers_correct": sum(1 for s in checked if s.answer.candidate_correct),
        "answer_flips_lost": len(lost),
        "answer_flips_gained": len(gained),
        "answer_flips_lost_ids": lost,
        "answer_flips_gained_ids": gained,
    }


def score_runs(
    golden: RunResult,
    run: RunResult,
    thresholds: Thresholds | None = None,
    *,
    tags: dict[str, list[str]] | None = None,
    expected: Mapping[str, AnswerKey | list[str]] | None = None,
    metrics: list[tuple[Any, Any]] | None = None,
    progress: ProgressFn | None = None,
    noise: NoiseFloor | None = None,
    gate: str = "fidelity",
    gate_by_default: bool = False,
) -> ScoredRun:
    """Score every prompt of ``run`` against ``golden``. ``expected`` maps prompt ids to their
    answer keys (:func:`expected_answers`; a plain list is accepted answers only); those prompts
    are also checked for them.
    ``noise``: the baseline's measured noise (``golden/noise.json``, :mod:`regress.noise.floor`):
    run-level bounds follow its floor, and a prompt the baseline flipped itself is benign within
    its envelope; None: the thresholds as configured. ``gate``: which verdict gates the check
    (``fidelity``, ``quality``, ``both``: :func:`regress.quality.resolve_gate`); both are computed.
    ``gate_by_default``: ``gate`` came from ``auto``, so a quality gate with no answered prompt to
    judge falls back to fidelity (a gate the candidate asked for by name does not)."""
    configured = t = thresholds or Thresholds()
    envelopes: dict[str, Any] = {}
    if noise is not None:
        from regress.noise import floor as noise_floor

        t = noise_floor.run_thresholds(configured, noise)
        envelopes = {p.prompt_id: p for p in noise.noisy()}
    made_benign: list[str] = []
    missing = [pid for pid in run.prompt_ids if pid not in golden]
    if missing:
        raise ConfigError(f"{len(missing)} prompt(s) of {run.path} are not in the golden {golden.path} "
                          f"(first: {missing[0]}); was the run made against another golden?")
    if run.manifest.golden is not None and run.manifest.golden.run_id != golden.manifest.run_id:
        raise ConfigError(f"{run.path} was replayed against golden {run.manifest.golden.run_id}, "
                          f"not {golden.manifest.run_id} ({golden.path}); replay it again")
    check_pair(golden, run)
    metrics = metrics if metrics is not None else build_metrics(t)
    by_golden = golden_scored(run, golden)
    if by_golden is not None:  # the baseline teacher-forced the candidate's samples: its tokens are the run's
        check_teacher_forced(by_golden, run)
    pairs = [Pair(golden[pid], run[i], by_golden[pid] if by_golden is not None and pid in by_golden else None)
             for i, pid in enumerate(run.prompt_ids)]
    with_choices = [p.golden.prompt_id for p in pairs if p.golden.choices is not None]
    if with_choices and not any(info.name == "choices" for info, _ in metrics):
        # Without the metric their picks are never made, and the prompts would silently leave the quality verdict.
        raise ConfigError(f"{len(with_choices)} prompt(s) have 'choices' (first: {with_choices[0]}), but "
                          "thresholds.metrics leaves out 'choices': their answers would not be judged; add 'choices' "
                          "to thresholds.metrics", field="thresholds.metrics")
    values: list[dict[str, Any]] = [{} for _ in pairs]
    for info, fn in metrics:
        if info.batched:
            for row, out in zip(values, fn(pairs)):
                row.update(out)
        else:
            for row, pair in zip(values, pairs):
                row.update(fn(pair))
        if progress:
            progress(1)
    tags = tags or {}
    expected = {pid: AnswerKey.of(value) for pid, value in (expected or {}).items() if value}
    scores = []
    counts = {"identical": 0, "benign": 0, "drift": 0, "regression": 0, "input_drift": 0}
    unforced: list[str] = []
    broken: list[str] = []
    sampled: set[str] = set()
    for unit in prompt_units(pairs, values):
        pair, row = unit.pairs[0], unit.row
        own = envelopes.get(unit.prompt_id)
        klass, reasons = classify(row, t if own is None else noise_floor.prompt_thresholds(t, own, noise.k),
                                  prompt_id=unit.prompt_id)
        if not_teacher_forced(row):
            unforced.append(unit.prompt_id)
        if nonfinite(row):
            broken.append(unit.prompt_id)
        if own is not None and klass == "benign" and classify(row, t)[0] != "benign":
            reasons = [noise_floor.envelope_reason(own)]
            made_benign.append(unit.prompt_id)
        answer = None
        if unit.sampled:
            sampled.add(unit.prompt_id)
            klass, reasons, answer = sampled_class(unit, klass, reasons, expected.get(unit.prompt_id), t)
        elif expected.get(unit.prompt_id):
            answer = check_answer(pair.golden.text, pair.candidate.text, expected[unit.prompt_id])
        elif pair.golden.choices is not None:  # multiple choice: the pick by log-likelihood is the answer
            answer = choice_answer_check(row, pair.golden.choices)
        counts[klass] += 1
        why = answer_reason(answer) if answer is not None else None
        if why:  # a lost answer leads (it is what a reader acts on); a gained one follows
            reasons = [why, *reasons] if answer.flip == "lost" else [*reasons, why]
        scores.append(PromptScore(prompt_id=unit.prompt_id, tags=tags.get(unit.prompt_id, []),
                                  prompt_class=klass, reasons=reasons, metrics=row, answer=answer))
    answers = answer_totals(scores)
    from regress.stats import run_stats  # interval statistics (scipy, imported on first use)

    stats = run_stats(counts, answers, t.confidence)
    judgement = noise_judgement(scores, noise, t, sampled) if noise is not None else None
    verdict, verdict_reasons = run_verdict(counts, t, answers=answers, stats=stats,
                                           allow_input_drift=run.manifest.candidate.allow_input_drift,
                                           not_teacher_forced=unforced, nonfinite_ids=broken, noise=judgement)
    sampled_failure, sampled_note = run_shift(scores, t)
    if sampled_failure:
        if verdict == "pass":  # the passing count line goes (after the run-level test's line, when there is one)
            at = 1 if judgement is not None and judgement.test is not None else 0
            verdict_reasons = verdict_reasons[:at] + verdict_reasons[at + 1:]
        verdict_reasons = [sampled_failure] + verdict_reasons
        verdict = "fail"
    elif sampled_note:
        verdict_reasons.append(sampled_note)

    from regress.quality import judge_quality

    quality = judge_quality([(s.prompt_id, s.tags, s.answer.golden_score, s.answer.candidate_score)
                             for s in scores if s.answer is not None], t, sampled_ids=sampled,
                            choice_ids={pair.golden.prompt_id for pair in pairs if pair.golden.choices is not None})
    if quality is None and gate_by_default and gate == "quality":
        gate = "fidelity"  # nothing to judge quality by, and nobody asked for it by name
    gm, rm = golden.manifest, run.manifest
    from regress.latency import speed_comparison

    comparable, speed_note = speed_comparison(gm.timings, rm.timings)
    n = len(scores)
    fields, extra = aggregates([info for info, _ in metrics], [s.metrics for s in scores])
    run_metrics = RunMetrics(
        candidate=rm.candidate.name,
        prompts=n,
        **counts,
        exact_match_rate=counts["identical"] / n if n else 0.0,
        **fields,
        verdict=verdict,
        verdict_basis=verdict_basis(judgement),
        gate=gate,
        quality=quality,
        quality_verdict=quality.verdict if quality is not None else None,
        tokens_per_s=rm.timings.tokens_per_s,
        golden_tokens_per_s=gm.timings.tokens_per_s,
        tokens_per_s_ratio=(rm.timings.tokens_per_s / gm.timings.tokens_per_s) if gm.timings.tokens_per_s else None,
        speed_comparable=comparable,
        speed_note=speed_note,
        engine_load_s=rm.timings.engine_load_s,
        golden_engine_load_s=gm.timings.engine_load_s,
        peak_memory_mib=rm.memory.peak_rss_mib,
        golden_peak_memory_mib=gm.memory.peak_rss_mib,
        **answers,
        **stats,
        not_teacher_forced=len(unforced),
        not_teacher_forced_ids=unforced,
        nonfinite=len(broken),
        nonfinite_ids=broken,
        extra=extra,
        sample_scoring=_sample_scoring(scores, sampled, run, golden, by_golden is not None),
        **_latency_fields(golden, run, t),
    )
    if noise is not None:  # what the noise floor changed and the run-level test, for metrics.json and the report
        run_metrics = run_metrics.model_copy(update={
            "noise_floor": noise_floor.applied(configured, t, noise, made_benign),
            "noise_test": judgement.test if judgement is not None else None,
            "severe_regressions": len(judgement.severe_ids) if judgement is not None else None,
            "severe_regression_ids": list(judgement.severe_ids) if judgement is not None else []})
    descriptions = {name: text for info, _ in metrics for name, text in info.outputs.items()}
    return ScoredRun(golden=gm, run=rm, thresholds=t.model_dump(), metric_descriptions=descriptions,
                     metrics=run_metrics, verdict_reasons=verdict_reasons, scores=scores)


def _sample_scoring(scores: list[PromptScore], sampled: set[str], run: RunResult, golden: RunResult,
                    baseline_scored: bool) -> str | None:
    """Whose model scored the candidate's samples, and why (RunMetrics.sample_scoring); None
    without sampled prompts. ``baseline_scored``: the replay holds the baseline's scores."""
    scorers = {s.metrics.get("sample_scored_by") for s in scores if s.prompt_id in sampled}
    if "candidate" not in scorers:
        if "golden" not in scorers:
            return None
        where = "golden-scored/" if baseline_scored else "each sample the golden's own"
        return f"the baseline's model scored the candidate's samples ({where})"
    from regress.metrics.sample_scorer import logprob_agreement

    agreement = logprob_agreement(run, golden)
    if agreement.holds:
        return f"the candidate's own logprobs scored its samples: {agreement.describe()}"
    return (f"the candidate's own logprobs scored its samples, with no baseline scores in the replay "
            f"(--golden-scoring never, or a replay made without the baseline) although {agreement.describe()}: "
            "a sampled shift may be the scorer's")


def noise_judgement(scores: list[PromptScore], noise: NoiseFloor, t: Any,
                    sampled: set[str] = frozenset()) -> NoiseJudgement:  # type: ignore[assignment]
    """The run-level test of the comparable prompts against ``noise`` (:mod:`regress.noise.beyond`)
    and the regressions severe enough to gate on their own (:func:`regress.verdict.severe`).
    Sampled prompts are judged by their samples' own test (:mod:`regress.metrics.sampled`), not here."""
    from regress.noise.beyond import compare_to_noise

    judged = [s for s in scores if s.prompt_class != "input_drift" and s.prompt_id not in sampled]
    rows = {s.prompt_id: s.metrics for s in judged}
    test = compare_to_noise(rows, noise, t, regressed={s.prompt_id for s in judged if s.prompt_class == "regression"})
    severe_ids = tuple(s.prompt_id for s in scores if s.prompt_class == "regression" and severe(s.metrics, t))
    return NoiseJudgement(test, severe_ids)


def _latency_fields(golden: RunResult, run: RunResult, t: Any) -> dict[str, Any]:
    """RunMetrics' latency fields: both runs' latency and their ratios (:mod:`regress.latency`),
    and the latency verdict, apart from the output verdict (:func:`regress.latency.latency_verdict`)."""
    from regress.latency import compare_runs
    from regress.latency import latency_verdict

    latency = compare_runs(golden, run)
    verdict, reasons = latency_verdict(latency, t)
    return {"latency": latency, "latency_verdict": verdict, "latency_reasons": reasons,
            "latency_gates": bool(getattr(t, "gate_latency", False))}


def scoring_id(scored: ScoredRun) -> str:
    """Identifies one scoring: its time, both runs and its aggregates. Every report file carries
    it (see :mod:`regress.report`), so a file left from another scoring is recognised."""
    identity = "|".join([scored.created_at.isoformat(), scored.run.run_id, scored.golden.run_id,
                         scored.metrics.model_dump_json()])
    return hashlib.sha256(identity.encode("utf-8")).hexdigest()[:16]


DVC_METRICS_FILE = "dvc-metrics.json"
"""The numbers a person compares across experiments (``dvc metrics show``/``diff``): a dozen, not
metrics.json's every field (strings, id lists and constants included)."""


def dvc_metrics(m: RunMetrics) -> dict[str, Any]:
    """The headline numbers of one candidate's scoring, for DVC (:data:`DVC_METRICS_FILE`)."""
    q = m.quality
    shown: dict[str, Any] = {
        "gating_failed": m.gating_failed,
        "fidelity_pass": m.verdict == "pass",
        "quality_pass": None if q is None else q.verdict == "pass",
        "prompts": m.prompts,
        "identical": m.identical,
        "regression": m.regression,
        "drift": m.drift,
        "exact_match_rate": m.exact_match_rate,
        "mean_teacher_forced_kl": m.mean_teacher_forced_kl,
        "accuracy_golden": None if q is None else q.golden_accuracy,
        "accuracy_candidate": None if q is None else q.candidate_accuracy,
        "accuracy_difference": None if q is None else q.difference,
        "accuracy_difference_low": None if q is None else q.low,
        "tokens_per_s_ratio": m.tokens_per_s_ratio,
    }
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in shown.items() if v is not None}


def write_score_outputs(scored: ScoredRun, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``scores.json`` (everything) and ``metrics.json`` (aggregates, DVC metrics).

    Each file is replaced atomically, but not both at once: a crash between the two leaves the
    new ``scores.json`` beside the old ``metrics.json``. ``metrics.json`` is written last and is
    exactly ``scores.json``'s ``metrics``, so :func:`read_scored_run` recognises such a pair
    (and a reader of ``metrics.json`` alone sees a whole scoring, the old one)."""
    out_dir = Path(out_dir)
    scores_path, metrics_path = out_dir / SCORES_FILE, out_dir / METRICS_FILE
    text = scored.model_dump_json(indent=1)
    try:  # never a scores.json that does not read back (JSON has no NaN: pydantic writes null)
        ScoredRun.model_validate_json(text)
    except ValueError as exc:
        from regress.errors import RunError

        first = exc.errors()[0] if callable(getattr(exc, "errors", None)) else {"msg": str(exc), "loc": ()}
        raise RunError(f"{scores_path}: not written: the scoring of {scored.run.run_id} would not read back "
                       f"({first['msg']} at {'.'.join(map(str, first['loc']))}); nothing of it was stored") from exc
    atomic_write_text(scores_path, text)
    atomic_write_text(out_dir / DVC_METRICS_FILE, json.dumps(dvc_metrics(scored.metrics), indent=2) + "\n")
    atomic_write_text(metrics_path, scored.metrics.model_dump_json(indent=2))
    return scores_path, metrics_path


def check_metrics_beside(scored: ScoredRun, metrics_path: Path, mismatch: str | None = None) -> None:
    """Raise :class:`StorageError` if ``metrics_path`` exists and is not ``scored``'s aggregates:
    the two files are of different scorings (a scoring died between its writes). ``mismatch``:
    what the error says then, after the path."""
    from regress.errors import StorageError

    try:
        text = metrics_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        raise StorageError(f"{metrics_path}: cannot read it ({exc})") from exc
    try:
        same = RunMetrics.model_validate_json(text) == scored.metrics
    except ValueError:  # pydantic's ValidationError is a ValueError
        same = False
    if not same:
        raise StorageError(f"{metrics_path}: " + (mismatch or (
            f"not the aggregates of {metrics_path.parent / SCORES_FILE} beside it: the two are of different "
            "scorings (one was interrupted); run `regress score` again")))


def read_scored_run(path: str | Path) -> ScoredRun:
    """Read a ``scores.json`` back (``path`` may be its directory), checking that the
    ``metrics.json`` beside it (if any) is of the same scoring."""
    path = Path(path)
    if path.is_dir():
        path = path / SCORES_FILE
    # unreadable=None: an unreadable scores.json stays the OSError it has always been.
    scored = read_record(path, ScoredRun, what="a regress scores file", missing_hint=" (run `regress score` first)",
                         unreadable=None)
    check_metrics_beside(scored, path.parent / METRICS_FILE)
    return scored
