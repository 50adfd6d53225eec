"""What ``regress gate`` checks before it believes a ``metrics.json``.

``metrics.json`` is a plain file in the project: anything that can write it can write
``"verdict": "pass"``. Its schema alone (:class:`regress.records.RunMetrics`) accepts negative counts,
NaN rates and a verdict that its own counts contradict. So the gate (:func:`check_metrics`):

* checks every count is a non-negative whole number, the class counts add up to ``prompts``, the
  id lists are as long as their counts, every rate is a finite number within [0, 1] and
  ``exact_match_rate`` is ``identical / prompts``;
* with ``scores.json`` beside it (the scoring writes both, :func:`regress.scoring.write_score_outputs`):
  checks ``metrics.json`` is exactly that file's ``metrics`` and that those counts are the per-prompt
  classes it records, and re-derives the verdict from them and the thresholds it records;
* without one: re-derives it from the counts and the thresholds of ``params.yaml``.

A ``pass`` that the counts and thresholds contradict (more regressions than allowed, input drift
not allowed, a rate past its limit at the lower bound, answers lost past the allowance, a run-level
noise test that found the run beyond the noise) is refused: :class:`StorageError` (exit 2) naming the
file and the field. What this cannot catch: a consistent forgery of both files (per-prompt classes,
counts and verdict rewritten together); only re-scoring (``regress score``) re-derives the classes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from regress.errors import StorageError

CLASSES = ("identical", "benign", "drift", "regression", "input_drift")
COUNTS = (*CLASSES, "prompts", "answer_prompts", "golden_answers_correct", "answers_correct",
          "answer_flips_lost", "answer_flips_gained", "not_teacher_forced", "nonfinite")
RATES = ("exact_match_rate", "same_top1_rate", "regression_rate", "regression_rate_low", "regression_rate_high",
         "flip_rate", "flip_rate_low", "flip_rate_high", "answer_flip_rate", "answer_flip_rate_low",
         "answer_flip_rate_high", "answer_mcnemar_p", "confidence")
FINITE = ("mean_teacher_forced_kl", "mean_semantic_similarity", "mean_first_divergence", "tokens_per_s",
          "golden_tokens_per_s", "tokens_per_s_ratio", "engine_load_s", "golden_engine_load_s",
          "peak_memory_mib", "golden_peak_memory_mib", "mean_sample_logprob_shift")
ID_LISTS = (("nonfinite_ids", "nonfinite"), ("not_teacher_forced_ids", "not_teacher_forced"),
            ("answer_flips_lost_ids", "answer_flips_lost"), ("answer_flips_gained_ids", "answer_flips_gained"))


def _bad(path: Path, field: str, why: str) -> StorageError:
    return StorageError(f"{path}: field '{field}' {why}; the file was not written by `regress score` as it "
                        "stands (edited or damaged): run `regress score` again")


def check_values(path: Path, m: Any) -> None:
    """Types, ranges and counts of one RunMetrics (read from ``path``, named in the error)."""
    for name in COUNTS:
        v = getattr(m, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _bad(path, name, f"is {v!r}, not a count (a whole number, 0 or more)")
    total = sum(getattr(m, c) for c in CLASSES)
    if total != m.prompts:
        raise _bad(path, "prompts", f"is {m.prompts}, but the classes ({', '.join(CLASSES)}) add up to {total}")
    for name in RATES:
        v = getattr(m, name)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0):
            raise _bad(path, name, f"is {v!r}, not a rate within [0, 1]")
    for name in FINITE:
        v = getattr(m, name)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise _bad(path, name, f"is {v!r}, not a finite number")
    if m.mean_teacher_forced_kl is not None and m.mean_teacher_forced_kl < 0:
        raise _bad(path, "mean_teacher_forced_kl", f"is {m.mean_teacher_forced_kl!r}: a KL divergence is never negative")
    expected = m.identical / m.prompts if m.prompts else 0.0
    if abs(m.exact_match_rate - expected) > 1e-9:
        raise _bad(path, "exact_match_rate", f"is {m.exact_match_rate!r}, not identical / prompts ({expected!r})")
    for ids, count in ID_LISTS:
        if len(getattr(m, ids)) != getattr(m, count):
            raise _bad(path, ids, f"names {len(getattr(m, ids))} prompt(s), '{count}' says {getattr(m, count)}")
    for name in ("answers_correct", "golden_answers_correct", "answer_flips_lost", "answer_flips_gained"):
        if getattr(m, name) > m.answer_prompts:
            raise _bad(path, name, f"is {getattr(m, name)}, more than answer_prompts ({m.answer_prompts})")
    if m.severe_regressions is not None and not 0 <= m.severe_regressions <= m.regression:
        raise _bad(path, "severe_regressions", f"is {m.severe_regressions!r}, not within 0..regression ({m.regression})")
    if m.regression_rate is not None:
        comparable = m.prompts - m.input_drift
        want = m.regression / comparable if comparable else None
        if want is None or abs(m.regression_rate - want) > 1e-9:
            raise _bad(path, "regression_rate", f"is {m.regression_rate!r}, not regression / comparable prompts ({want!r})")
    q = m.quality.verdict if m.quality is not None else None
    if m.quality_verdict != q:
        raise _bad(path, "quality_verdict", f"is {m.quality_verdict!r}, the quality record says {q!r}")


def contradiction(m: Any, t: Any, allow_input_drift: bool | None) -> str | None:
    """Why a ``pass`` in ``m`` cannot follow from its counts and the thresholds ``t`` (None: it can).
    Only sure failures of :func:`regress.verdict.run_verdict` are re-derived; a ``fail`` is never
    second-guessed (nothing passes by a forged fail)."""
    if m.verdict != "pass":
        return None
    limit = getattr(t, "max_regressions", None)
    rate_limit = getattr(t, "max_regression_rate", None)
    gating = m.severe_regressions if m.severe_regressions is not None else m.regression
    if limit is not None and rate_limit is None and gating > limit:
        what = "severe regression(s)" if m.severe_regressions is not None else "regression(s)"
        return f"{gating} {what} with {limit} allowed (thresholds.max_regressions)"
    if rate_limit is not None and m.regression_rate_low is not None and m.regression_rate_low > rate_limit:
        return f"regression rate {m.regression_rate_low:g} at the lower bound, past max_regression_rate {rate_limit:g}"
    flip_limit = getattr(t, "max_answer_flip_rate", None)
    if flip_limit is not None and m.answer_flip_rate_low is not None and m.answer_flip_rate_low > flip_limit:
        return f"answer flip rate {m.answer_flip_rate_low:g} at the lower bound, past max_answer_flip_rate {flip_limit:g}"
    lost_limit = getattr(t, "max_answer_flips_lost", None)
    if lost_limit is not None and m.answer_flips_lost > lost_limit:
        return f"{m.answer_flips_lost} answer(s) lost with {lost_limit} allowed (thresholds.max_answer_flips_lost)"
    if m.input_drift and allow_input_drift is False:
        return f"{m.input_drift} prompt(s) with input drift, and the candidate does not set allow_input_drift"
    if m.noise_test is not None and m.noise_test.beyond:
        return "the run-level noise test found the run beyond the baseline's noise (noise_test.beyond)"
    return None


class _Limits:
    """Thresholds read from a recorded dict (``scores.json``'s ``thresholds``)."""

    def __init__(self, d: dict[str, Any]) -> None:
        for name in ("max_regressions", "max_regression_rate", "max_answer_flip_rate", "max_answer_flips_lost"):
            v = d.get(name)
            setattr(self, name, v if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
        if "max_regressions" not in d:
            self.max_regressions = 0


def check_metrics(path: Path, m: Any, *, params: Any = None, candidate: str | None = None) -> Any:
    """Refuse (StorageError, exit 2) a ``metrics.json`` at ``path`` (parsed: ``m``) that is out of range,
    inconsistent, not the aggregates of the ``scores.json`` beside it, or whose ``pass`` its counts and
    thresholds contradict, or whose scores.json is of a run the project no longer holds (``runs/<candidate>``
    or the golden replaced since). ``params``: the loaded params.yaml, for thresholds when no scores.json
    is there. Returns the scores.json beside it, parsed (None when there is none)."""
    from regress.records import ScoredRun

    check_values(path, m)
    if candidate is not None and m.candidate != candidate:  # another candidate's scoring copied or scored here
        raise _bad(path, "candidate", f"is {m.candidate!r}, but the file is {candidate!r}'s: run `regress score {candidate}`")
    if candidate is not None and params is not None:
        _check_gate(path, m, params, candidate)
    scores_path = path.parent / "scores.json"
    allow: bool | None = None
    scored = None
    if scores_path.is_file():
        try:
            scored = ScoredRun.model_validate_json(scores_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StorageError(f"{scores_path}: cannot read the scoring beside {path.name} ({exc})") from exc
        if candidate is not None and scored.run.candidate.name != candidate:
            raise _bad(scores_path, "run.candidate.name", f"is {scored.run.candidate.name!r}, but the file is "
                                                          f"{candidate!r}'s: run `regress score {candidate}`")
        if candidate is not None and params is not None:
            check_current(scores_path, scored, params, candidate)
        mine, theirs = m.model_dump(mode="json"), scored.metrics.model_dump(mode="json")
        for name in type(m).model_fields:
            if mine.get(name) != theirs.get(name):
                raise _bad(path, name, f"is {getattr(m, name)!r}, {scores_path.name} beside it records "
                                       f"{getattr(scored.metrics, name)!r}")
        recount = {c: 0 for c in CLASSES}
        for s in scored.scores:
            recount[s.prompt_class] = recount.get(s.prompt_class, 0) + 1
        for c in CLASSES:
            if recount[c] != getattr(m, c):
                raise _bad(scores_path, f"metrics.{c}", f"is {getattr(m, c)}, its per-prompt scores hold {recount[c]}")
        t: Any = _Limits(scored.thresholds if isinstance(scored.thresholds, dict) else {})
        allow = bool(scored.run.candidate.allow_input_drift)
        source = f"{scores_path.name}'s thresholds"
    else:
        t = _params_thresholds(params)
        if params is not None and candidate is not None:
            spec = getattr(params, "candidates", {}).get(candidate) if isinstance(getattr(params, "candidates", None), dict) else None
            allow = getattr(spec, "allow_input_drift", None) if spec is not None else None
        source = "the thresholds of params.yaml (no scores.json beside it)"
    if t is None:
        return scored
    why = contradiction(m, t, allow)
    if why:
        raise StorageError(f"{path}: field 'verdict' says pass, but its counts and {source} say fail: {why}; "
                           "the file was edited or is of another scoring: run `regress score` again")
    return scored


def check_current(scores_path: Path, scored: Any, params: Any, candidate: str) -> None:
    """A scoring is of the runs it names: when the project's ``runs/<candidate>`` or golden now
    holds another run (replayed again, a new golden), the stored verdict is of outputs that are
    gone and must not gate."""
    from regress.runs import MANIFEST, read_manifest

    dirs = [("run", getattr(params, "run_dir", None), scored.run.run_id),
            ("golden", getattr(params, "golden_dir", None), scored.golden.run_id)]
    for what, where, scored_id in dirs:
        if where is None:
            continue
        directory = where(candidate) if what == "run" else where()
        if not (Path(directory) / MANIFEST).is_file():
            continue  # scores gated where the runs are not (a CI job that fetched scores/ only)
        now = read_manifest(directory).run_id
        if now != scored_id:
            raise StorageError(f"{scores_path}: field '{what}.run_id' is {scored_id}, but {directory} now holds run "
                               f"{now}: the scoring is of outputs that were replaced; run `regress score {candidate}`")


def _check_gate(path: Path, m: Any, params: Any, candidate: str) -> None:
    """The gate metrics.json records must be the one params.yaml sets for the candidate now: a
    candidate moved to ``gate: quality`` is not passed on its fidelity verdict (or the reverse).
    ``auto`` resolves against the golden's baseline at scoring time, so only a gate set by name
    is compared here."""
    spec = params.candidates.get(candidate) if isinstance(getattr(params, "candidates", None), dict) else None
    wanted = getattr(spec, "gate", "auto")
    if wanted in ("fidelity", "quality") and m.gate != wanted:
        raise StorageError(f"{path}: field 'gate' is {m.gate!r}, but params.yaml gates '{candidate}' on {wanted!r}: "
                           f"the scoring is older than that change; run `regress score {candidate}`")


def _params_thresholds(params: Any) -> Any:
    if params is None:
        return None
    try:
        from regress.verdict import thresholds_model

        return thresholds_model().model_validate(getattr(params, "thresholds", {}) or {})
    except Exception:  # noqa: BLE001 - thresholds params.yaml cannot build: nothing to re-derive against
        return None
