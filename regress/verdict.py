"""Per-prompt classes and the run verdict, from metric values and thresholds.

Classes, checked in this order:

``input_drift``
    The prompt's token ids changed (tokenizer or chat template): outputs are not comparable
    token by token, so the prompt is set apart rather than called a regression.
``identical``
    Exactly the golden's tokens.
``regression``
    Any regression signal: a confident flip at the first divergence, a divergence that fails
    vLLM's own top-k check, or teacher-forced / semantic measures beyond their regression
    thresholds.
``benign``
    Diverged at a near-tie of the golden and stayed close by every teacher-forced and
    semantic measure: the numerical noise that kernels, batching and dtypes produce.
``drift``
    Everything else: beyond noise, within tolerance. Worth a look, not a reason to stop.

The bounds are not written here: every value a metric returns declares its own benign and
regression bounds (:class:`regress.metrics.spec.Output`), and rules over several values
(vLLM's top-k check) come with their metric; :func:`classify` walks them in metric order, and
:data:`Thresholds` is built from the settings they declare.

A value that is NaN or infinite is never noise, whatever the class would otherwise be: NaN
compares false with every bound, so it would pass them all. Each value's spec says what it means
(``nonfinite``): the measure could not be taken (:class:`~regress.errors.MeasureError`, exit 3)
or the candidate's answer is broken (a regression). :func:`past` counts such a value as past
every bound too, so no comparison here can take one for "within".

A single flipped token at a near-tie changes everything after it, so the free-running output
alone cannot tell noise from damage; the teacher-forced measures (scored on the golden's own
completion, no cascade) carry most of the decision. See docs/verdicts.md for how the default
thresholds were measured.

Prompts with an expected answer (``expected`` in the prompt set) are also checked for it in both
outputs (:mod:`regress.metrics.answers`); that does not change their class. A lost answer (golden
correct, candidate not) is reported per prompt and per run, and fails the run only when
``max_answer_flips_lost`` is set and exceeded.

Rates are judged by their confidence intervals (:mod:`regress.stats`): ``max_regression_rate`` and
``max_answer_flip_rate`` fail the run when the lower bound of the rate's Wilson interval exceeds them.
``max_regression_rate`` set without an explicit ``max_regressions`` turns the count gate off.

Latency is judged apart (:func:`regress.latency.latency_verdict`, ``RunMetrics.latency_verdict``): ``max_latency_ratio``
bounds the candidate's p95 time to first token, time per output token and total time against the
golden's, ``min_throughput_ratio`` its throughput. The output verdict never changes for it; a failed
latency verdict fails the check only with ``gate_latency: true`` (``RunMetrics.gating_failed``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from regress.errors import ConfigError, MeasureError
from regress.metrics import registered
from regress.metrics.spec import Bound, Output, Rule, Setting
from regress.records import MetricValue, PromptClass
from regress.validation import first_error

# Run-level limits, not about any one metric. Together with the settings the registered metrics
# declare they make the Thresholds model (see thresholds_model for the field order).
_LIMITS: dict[str, tuple[Any, Any]] = {
    "max_regressions": (int, Field(0, ge=0, description="The run fails when more prompts than this are regressions.")),
    "max_answer_flips_lost": (int | None, Field(None, ge=0, description=(
        "The run fails when more prompts than this lose their expected answer (golden correct, candidate "
        "not). None (the default): lost answers are reported, never gating."))),
    "max_regression_rate": (float | None, Field(None, ge=0, le=1, description=(
        "The run fails when the lower bound of the regression rate's Wilson interval (regressions / comparable "
        "prompts, at `confidence`) exceeds this. Set without max_regressions, it replaces the count gate. "
        "None (the default): not gating."))),
    "max_answer_flip_rate": (float | None, Field(None, ge=0, le=1, description=(
        "The run fails when the lower bound of the answer flip rate's Wilson interval ((lost + gained) / "
        "prompts with an expected answer, at `confidence`) exceeds this. None (the default): not gating."))),
    # The run-level test against the measured noise (regress.noise.beyond; only with golden/noise.json).
    "noise_alpha": (float, Field(0.01, gt=0, lt=0.5, description=(
        "With a measured noise floor: significance level of the run-level test (one-sided Wilcoxon signed-rank "
        "of each prompt's teacher-forced KL, top-1 disagreement and overturned margin against its noise "
        "envelope, Holm-corrected over the three)."))),
    "noise_min_ratio": (float, Field(2.0, ge=1, description=(
        "With a measured noise floor: a measure is beyond the noise only when the candidate's mean is at least "
        "this times the envelope's on the same prompts (significant and material)."))),
    "noise_kl_resolution": (float, Field(1e-5, ge=0, description=(
        "With a measured noise floor: teacher-forced KL (nat per token) below this is no difference in the "
        "run-level test, on either side (a float32 baseline's own noise is about 1e-13, bf16's 1e-5 to 1e-3)."))),
    "severe_regression": (float, Field(3.0, ge=1, description=(
        "With a measured noise floor, `max_regressions` counts only regressions at least this severe (how far "
        "past its regression bound a prompt is: 1 at the bound; a failed top-k check and a NaN or infinite "
        "measure always count). Milder "
        "regressions explain where the run moved; whether it moved beyond the noise is the run-level test's "
        "call. Without a noise floor every regression counts."))),
    # The quality verdict (regress.quality): answers, paired, against a margin.
    "quality_theta": (float, Field(0.05, gt=0, lt=1, description=(
        "Quality verdict: non-inferiority margin in accuracy (0.05: five points). The candidate passes when the "
        "lower bound of the paired interval of its accuracy minus the golden's is above -quality_theta."))),
    "quality_power": (float, Field(0.8, gt=0.5, lt=1, description=(
        "Quality verdict: the power at which an inconclusive verdict's 'prompts needed' is computed."))),
    "quality_min_slice": (int, Field(5, ge=2, description=(
        "Quality verdict: a tag (or kind of prompt) with at least this many answered prompts is a slice, with its "
        "own interval and one-sided exact McNemar test (Tarone-corrected over the slices that could be worse); a "
        "slice significantly worse by more than quality_theta fails the verdict."))),
    "confidence": (float, Field(0.95, ge=0.5, le=0.999, description=(
        "Confidence level of the rate intervals (Wilson score) in metrics.json and the rate gates."))),
    # Latency (regress.latency): judged apart from the outputs, in RunMetrics.latency_verdict.
    "max_latency_ratio": (float | None, Field(None, gt=0, description=(
        "The latency verdict fails when the candidate's p95 time to first token, p95 time per output token "
        "or p95 total time is more than this times the golden's (1.2: 20 % slower). Needs per-request times "
        "(server runs). None (the default): not checked."))),
    "min_throughput_ratio": (float | None, Field(None, gt=0, description=(
        "The latency verdict fails when the candidate's throughput (output tokens per second of generation "
        "time) is below this times the golden's (0.8: 20 % fewer tokens/s). None (the default): not checked."))),
    "gate_latency": (bool, Field(False, description=(
        "Whether a failed latency verdict fails the check (exit 1) like a failed output verdict. False (the "
        "default): latency is reported (metrics.json, report, summary.md, JUnit properties), never gating."))),
}
_METRICS_FIELD: tuple[Any, Any] = (list[str] | None, Field(None, description=(
    "Metrics to compute (default: all built in). Drop 'semantic' to skip embeddings; add a registered "
    "plugin's name to run it.")))

DIVERGENCE_MARGIN = "golden_margin"
"""The golden's margin at the first divergence: below ``near_tie_margin`` the divergence was a coin
toss, which is what lets a prompt be benign and what excuses a value with ``noise_after_near_tie``."""


class ThresholdsBase(BaseModel):
    """Verdict thresholds (``thresholds:`` in params.yaml): the run's limits, and every setting the
    registered metrics declare (their benign and regression bounds, switches and options) with its
    default. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def from_params(cls, data: dict[str, Any], *, file: str | None = None) -> "ThresholdsBase":
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            where, message = first_error(exc, cls)
            raise ConfigError(message, file=file, field=f"thresholds.{where}" if where else "thresholds") from exc


def _same(a: Setting, b: Setting) -> bool:
    return (a.type, a.default, a.ge, a.le) == (b.type, b.default, b.ge, b.le)


@functools.lru_cache(maxsize=1)
def thresholds_model() -> type[ThresholdsBase]:
    """The ``Thresholds`` model of this process's registered metrics, built once.

    Field order (the order of ``model_dump`` and of "allowed:" in error messages): the values'
    bounds, the rules' switches, the run-level limits, the factories' options, ``metrics``.
    """
    infos = registered()
    fields: dict[str, tuple[Any, Any]] = {}
    declared: dict[str, Setting] = {}

    def add(settings: list[Setting]) -> None:
        for s in settings:
            if s.name in _LIMITS or s.name == "metrics":
                raise TypeError(f"a metric declares the threshold {s.name!r}, which regress itself defines")
            if s.name in declared:
                if not _same(declared[s.name], s):
                    raise TypeError(f"two metrics declare the threshold {s.name!r} differently: {declared[s.name]}, {s}")
                continue
            declared[s.name] = s
            fields[s.name] = (s.type, Field(s.default, ge=s.ge, le=s.le, description=s.doc))

    add([s for info in infos for v in info.values for s in v.settings()])
    add([s for info in infos for r in info.rules for s in r.settings])
    fields.update(_LIMITS)
    add([s for info in infos for s in info.options.values()])
    fields["metrics"] = _METRICS_FIELD
    return create_model("Thresholds", __base__=ThresholdsBase, __module__=__name__,  # type: ignore[call-overload]
                        __doc__=ThresholdsBase.__doc__, **fields)


def __getattr__(name: str) -> Any:
    # Built on first use, not at import: the model needs every registered metric imported.
    if name == "Thresholds":
        return thresholds_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Thresholds: type[ThresholdsBase]  # for type checkers; the value comes from __getattr__


@functools.lru_cache(maxsize=1)
def gates() -> tuple[Output | Rule, ...]:
    """What :func:`classify` checks, in order: each registered metric's bounded values, then its rules."""
    seen: set[str] = set()
    steps: list[Output | Rule] = []
    for info in registered():
        for spec in info.values:
            if spec.name not in seen and (spec.benign or spec.regression):
                steps.append(spec)
            seen.add(spec.name)
        steps.extend(info.rules)
    return tuple(steps)


def number(value: Any) -> float | None:
    """``value`` if it is a real number (not a bool, not missing), NaN and infinities included:
    :func:`nonfinite` says what those mean before any bound is compared."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def finite(value: Any) -> bool:
    """Whether ``value`` is not a NaN or infinite number (missing values and flags are finite)."""
    v = number(value)
    return v is None or math.isfinite(v)


@functools.lru_cache(maxsize=1)
def _declared() -> dict[str, tuple[str, Output]]:
    """Value name -> (metric name, spec), first declaration of a name winning."""
    found: dict[str, tuple[str, Output]] = {}
    for info in registered():
        for spec in info.values:
            found.setdefault(spec.name, (info.name, spec))
    return found


def nonfinite(values: Mapping[str, Any]) -> list[tuple[str, float, str | None, Output]]:
    """(name, value, metric, spec) of every NaN or infinite value of one prompt, in the row's order.
    A value no registered metric declares gets the default spec (``nonfinite="error"``)."""
    declared = _declared()
    found = []
    for name, value in values.items():
        if finite(value):
            continue
        metric, spec = declared.get(name, (None, Output(name, "")))
        found.append((name, float(value), metric, spec))
    return found


def _shown(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


def _nonfinite_findings(values: Mapping[str, Any], prompt_id: str | None) -> list[str]:
    """Regression reasons of the non-finite values whose spec makes them regressions; raises
    :class:`MeasureError` for the first whose spec says the measure could not be taken."""
    reasons = []
    for name, value, metric, spec in nonfinite(values):
        label = spec.shown_label if spec.shown_label == name else f"{spec.shown_label} ({name})"
        if spec.nonfinite == "error":
            who = f"prompt '{prompt_id}'" if prompt_id is not None else "a prompt"
            by = f"metric '{metric}'" if metric else "no registered metric (it declares no meaning for it)"
            raise MeasureError(f"{who}: {label} is {_shown(value)}, not a number regress can judge ({by}); "
                               "no verdict from a broken measure: check both runs' logprobs and outputs")
        reasons.append(f"{label} is {_shown(value)}: not a finite number, so never within a bound "
                       "(the candidate's answer is broken)")
    return reasons


def past(spec: Output, bound: Bound, value: float, limit: float) -> bool:
    """Whether ``value`` is beyond ``limit`` against the value's direction. A NaN or infinite
    value (or limit) is past every bound: NaN compares false with everything, and a number that
    is not finite is no measurement within any tolerance."""
    if not (math.isfinite(value) and math.isfinite(limit)):
        return True
    if spec.better == "lower":
        return value >= limit if bound.inclusive else value > limit
    return value <= limit if bound.inclusive else value < limit


class _Fields(dict):
    def __missing__(self, key: str) -> None:
        return None


def reason(spec: Output, bound: Bound, value: float, limit: Any, values: Mapping[str, Any]) -> str:
    """The bound's reason, filled in: ``{value}``, ``{bound}`` and the prompt's values by name."""
    template = bound.reason
    if template is None:
        op = {("lower", False): ">", ("lower", True): ">=", ("higher", False): "<", ("higher", True): "<="}[
            (spec.better or "lower", bound.inclusive)]
        label = spec.shown_label.replace("{", "{{").replace("}", "}}")
        template = f"{label} {{value:.4g}} {op} {{bound}}"
    return template.format_map(_Fields(values, value=value, bound=limit))


def near_tie(values: Mapping[str, Any], t: Any) -> bool:
    """The first divergence was a coin toss (the golden's margin there below ``near_tie_margin``)."""
    margin = values.get(DIVERGENCE_MARGIN)
    return margin is not None and margin < t.near_tie_margin


def classify(values: dict[str, MetricValue], t: Any, *,
             prompt_id: str | None = None) -> tuple[PromptClass, list[str]]:
    """Class of one prompt from its metric values, with the reasons.

    A NaN or infinite value comes first, before input drift and identity: a regression when its
    spec says so, else :class:`MeasureError` (naming ``prompt_id``)."""
    broken = _nonfinite_findings(values, prompt_id)
    if broken:
        return "regression", broken
    if values.get("input_drift"):
        return "input_drift", ["prompt token ids differ from the golden's (tokenizer or chat template changed)",
                               *_outputs_of_input_drift(values)]
    if values.get("identical"):
        return "identical", []

    regression: list[str] = []
    not_benign: list[str] = []
    coin_toss = near_tie(values, t)
    for step in gates():
        if isinstance(step, Rule):
            worse, not_good = step.check(values, t)
            regression += worse
            not_benign += not_good
            continue
        value = number(values.get(step.name))
        if value is None:
            continue
        excused = step.noise_after_near_tie and coin_toss
        for bound, found in ((step.regression, regression), (step.benign, not_benign)):
            if bound is None:
                continue
            limit = getattr(t, bound.setting.name)
            if past(step, bound, value, limit) and not (found is regression and excused):
                found.append(reason(step, bound, value, limit, values))
                break

    if regression:
        return "regression", regression
    if not_benign:
        return "drift", not_benign
    d = values.get("first_divergence")
    if d is None:  # scored teacher-forced only (a quick check): nothing was generated to diverge
        return "benign", ["the teacher-forced logprobs moved and stayed close by every measure"]
    return "benign", [f"diverged at token {d} at a near-tie and stayed close by every measure"]


def _outputs_of_input_drift(values: Mapping[str, Any]) -> list[str]:
    """What the outputs of a prompt whose input changed still say: token-by-token measures do not
    apply, the text and meaning measures do (an expected answer is checked like any prompt's)."""
    shown = []
    for name, label in (("semantic_similarity", "semantic similarity"), ("rouge_l", "ROUGE-L"),
                        ("edit_distance", "edit distance")):
        value = number(values.get(name))
        if value is not None:
            shown.append(f"{label} {value:.2f}")
    return [f"outputs: {', '.join(shown)}"] if shown else []


def severity(values: Mapping[str, Any], t: Any) -> float:
    """How far past its regression thresholds a prompt is: 1.0 = at a threshold, 0 = nothing.

    For every value with a regression bound, the way from its ideal value (``best``) to the value
    as a share of the way to the bound (KL / regression_kl, (1 - same top-1) / (1 - regression_same_top1),
    ...); 1 for a rule that finds a regression, and for a NaN or infinite value (a regression by
    its spec: :func:`classify`).
    """
    ratios = [1.0 if nonfinite(values) else 0.0]
    for step in gates():
        if isinstance(step, Rule):
            if step.check(values, t)[0]:
                ratios.append(1.0)
            continue
        value, best = number(values.get(step.name)), step.ideal
        if value is None or step.regression is None or best is None or not math.isfinite(value):
            continue
        span = getattr(t, step.regression.setting.name) - best
        if (span > 0) if step.better == "lower" else (span < 0):
            ratios.append((value - best) / span)
    return max(ratios)


def count_gate(t: Any) -> bool:
    """Whether ``max_regressions`` gates: always, unless ``max_regression_rate`` is set and
    ``max_regressions`` was not given explicitly (then the rate replaces the count)."""
    fields_set = getattr(t, "model_fields_set", None)
    explicit = fields_set is None or "max_regressions" in fields_set
    return t.max_regression_rate is None or explicit


def run_verdict(counts: dict[str, int], t: Any, *,
                answers: Mapping[str, Any] | None = None,
                stats: Mapping[str, Any] | None = None,
                allow_input_drift: bool = False,
                not_teacher_forced: Sequence[str] = (),
                nonfinite_ids: Sequence[str] = (),
                noise: "NoiseJudgement | None" = None) -> tuple[str, list[str]]:
    """``pass`` or ``fail`` for the run, with reasons.

    ``noise``: with a measured noise floor, the run-level test and which regressions are severe
    (:class:`NoiseJudgement`). Then the run fails when the test finds it beyond the baseline's
    noise, or when more than ``max_regressions`` prompts are *severe* regressions; milder ones stay
    as the explanation of where it moved. Without one every regression counts against
    ``max_regressions``, and the reasons say that the verdict rests on fixed per-prompt thresholds.

    Prompts whose input tokens changed (``input_drift``: tokenizer, chat template, special tokens)
    fail the run unless the candidate sets ``allow_input_drift: true``: the candidate was asked
    another question, which is a change to roll out knowingly, not noise.

    ``answers`` holds the expected-answer counts under their RunMetrics names
    (``answer_prompts``, ``golden_answers_correct``, ``answers_correct``, ``answer_flips_lost``,
    ``answer_flips_gained``); without prompts that have an expected answer the verdict and its
    reasons are those of the classes alone. ``stats`` holds the interval fields of
    :func:`regress.stats.run_stats` (computed here when a rate gate is set and they are not given):
    the rate gates fail on an interval's lower bound, and the answers' note gets the McNemar p-value.

    ``not_teacher_forced``: the prompts the teacher-forcing pass could not score (their context did
    not fit), and ``nonfinite_ids``: the prompts with a NaN or infinite measure (regressions); both
    are stated among the reasons, pass or fail, never dropped.
    """
    if stats is None and (t.max_regression_rate is not None or t.max_answer_flip_rate is not None):
        from regress.stats import run_stats

        stats = run_stats(counts, answers, t.confidence)
    regressions = counts.get("regression", 0)
    by_count = count_gate(t)
    failures, passes = [], []
    judged = noise is not None and noise.test is not None
    gating = len(noise.severe_ids) if judged else regressions
    # The run-level call leads the reasons, pass or fail: among the failures when it is beyond,
    # right after them when it is within.
    run_level = [f"the run as a whole is {noise.test.summary}"] if judged else []
    if judged and noise.test.beyond:
        failures += run_level
        run_level = []
    if by_count and gating > t.max_regressions:
        if judged:
            failures.append(f"{gating} prompt(s) regressed severely ({_ids(noise.severe_ids)}: at least "
                            f"{t.severe_regression:g}x past a regression bound, a token outside the other side's "
                            f"top-k, or a broken measure; allowed: {t.max_regressions})")
        else:
            failures.append(f"{regressions} prompt(s) regressed (allowed: {t.max_regressions})")
    for gate, name, label in (("max_regression_rate", "regression_rate", "regression rate"),
                              ("max_answer_flip_rate", "answer_flip_rate", "answer flip rate")):
        line = _rate_gate(stats, getattr(t, gate), name, label)
        if line is not None:
            (failures if line[0] else passes).append(line[1])
    answer_failure = _answers_fail(answers, t)
    if answer_failure:
        failures.append(answer_failure)
    drifted = counts.get("input_drift", 0)
    if drifted and not allow_input_drift:
        failures.append(f"{drifted} prompt(s) changed their input tokens (tokenizer, chat template or special tokens; "
                        "`regress diff` names what differs): set allow_input_drift: true on the candidate to accept it")
    notes = _answer_notes(answers, t, failed=bool(answer_failure), stats=stats)
    notes += _unmeasured_notes(not_teacher_forced, nonfinite_ids)
    notes += _basis_notes(noise, regressions, t)
    if failures:
        return "fail", failures + run_level + notes
    if by_count and judged:
        reasons = [f"{gating} severe regression(s), allowed {t.max_regressions}"]
    elif by_count:
        reasons = [f"{regressions} regression(s), allowed {t.max_regressions}"]
    else:
        reasons = [f"{regressions} regression(s) (the count does not gate: max_regression_rate is set)"]
    reasons = run_level + reasons + passes
    if drifted:
        reasons.append(f"{drifted} prompt(s) changed their input tokens, accepted (allow_input_drift: true)")
    return "pass", reasons + notes


@dataclass(frozen=True)
class NoiseJudgement:
    """What a measured noise floor adds to the run verdict."""

    test: Any
    """The run-level test (a :class:`~regress.noise.record.NoiseTest`); None when too few prompts pair."""
    severe_ids: tuple[str, ...] = ()
    """The regressions severe enough to gate on their own (:func:`severe`), in prompt set order."""


def severe(values: Mapping[str, Any], t: Any) -> bool:
    """A regression that gates on its own beside the run-level test: a NaN or infinite measure, a
    categorical rule that finds a regression (vLLM's top-k check: a token the other side did not even
    rank is a category, not a matter of degree, and no noise arm measured makes one; a sampled
    prompt's distribution rule is of degree, and gates through the sampled prompts' run-level
    test), or :func:`severity`
    at least ``severe_regression`` (far past a bound). Damage on a few prompts, which a test over
    the whole run cannot see, is of these kinds."""
    if nonfinite(values) or severity(values, t) >= t.severe_regression:
        return True
    return any(isinstance(step, Rule) and step.categorical and step.check(values, t)[0] for step in gates())


def _basis_notes(noise: "NoiseJudgement | None", regressions: int, t: Any) -> list[str]:
    """How a noise floor's judgement bears on the regressions (the basis itself: :func:`verdict_basis`)."""
    if noise is None:
        return []
    if noise.test is None:
        from regress.noise.record import min_testable

        return [f"too few prompts pair with the noise floor for a run-level test (at least "
                f"{min_testable(t.noise_alpha)} at alpha {t.noise_alpha:g}): the "
                "verdict rests on the per-prompt thresholds (widened by the floor)"]
    mild = regressions - len(noise.severe_ids)
    if mild > 0:
        return [f"{mild} milder regression(s) (severity below {t.severe_regression:g}) show where the run moved; "
                "they do not gate one by one: the run-level test counts them against the prompts the baseline "
                "itself regressed on"]
    return []


def verdict_basis(noise: "NoiseJudgement | None") -> str:
    """What the run verdict rests on, in one line (``RunMetrics.verdict_basis``)."""
    if noise is None:
        return ("fixed per-prompt thresholds alone: no noise floor was measured (golden/noise.json), so nothing "
                "tells a change from the baseline's own noise; add `noise:` to params.yaml and run `regress noise` "
                "for the run-level test")
    if noise.test is None:
        return "per-prompt thresholds widened by the measured noise floor (too few prompts for the run-level test)"
    return ("the run-level test against the baseline's measured noise (golden/noise.json), and regressions "
            "severe enough to gate on their own")


SHOWN_IDS = 5
"""Prompt ids named in a reason before "and N more"."""


def _ids(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def _unmeasured_notes(not_teacher_forced: Sequence[str], nonfinite_ids: Sequence[str]) -> list[str]:
    """What could not be measured, in the run's reasons."""
    notes = []
    if nonfinite_ids:
        notes.append(f"{len(nonfinite_ids)} prompt(s) with a measure that is NaN or infinite ({_ids(nonfinite_ids)}): "
                     "regressions, left out of the run's means")
    if not_teacher_forced:
        notes.append(f"{len(not_teacher_forced)} prompt(s) could not be teacher-forced ({_ids(not_teacher_forced)}): "
                     "prompt + golden completion do not fit the candidate's context (max_model_len), so they have "
                     "no teacher-forced measure and none of them is benign")
    return notes


def _rate_gate(stats: Mapping[str, Any] | None, limit: float | None, name: str,
               label: str) -> tuple[bool, str] | None:
    """(failed, reason) of one rate gate; None when it is not set or has no prompts to rate."""
    if limit is None or not stats or stats.get(name) is None:
        return None
    from regress.stats import interval_text, pct

    low = stats[f"{name}_low"]
    shown = f"{label} {interval_text(stats[name], low, stats[f'{name}_high'], stats['confidence'])}"
    if math.isnan(low) or low > limit:  # NaN compares false: it must not pass
        return True, f"{shown} exceeds {pct(limit)} % at the lower bound"
    return False, f"{shown}: lower bound within {pct(limit)} %"


def _answers_fail(answers: Mapping[str, Any] | None, t: Any) -> str | None:
    lost = (answers or {}).get("answer_flips_lost", 0)
    if t.max_answer_flips_lost is not None and lost > t.max_answer_flips_lost:
        return f"{lost} prompt(s) lost their expected answer (allowed: {t.max_answer_flips_lost})"
    return None


def _answer_notes(answers: Mapping[str, Any] | None, t: Any, *, failed: bool,
                  stats: Mapping[str, Any] | None = None) -> list[str]:
    n = (answers or {}).get("answer_prompts", 0)
    if not answers or not n:
        return []
    lost, gained = answers.get("answer_flips_lost", 0), answers.get("answer_flips_gained", 0)
    note = (f"expected answers: golden {answers.get('golden_answers_correct', 0)}/{n} correct, "
            f"candidate {answers.get('answers_correct', 0)}/{n}; {lost} lost, {gained} gained")
    if stats and stats.get("answer_mcnemar_p") is not None:
        note += f", exact McNemar p = {stats['answer_mcnemar_p']:.2g}"
    if failed:  # the failure reason already says how many were lost and allowed
        return [note]
    if t.max_answer_flips_lost is not None:
        note += f" (allowed lost: {t.max_answer_flips_lost})"
    elif lost:
        note += " (reported, not gating: thresholds.max_answer_flips_lost is not set)"
    return [note]
