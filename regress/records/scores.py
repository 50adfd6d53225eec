"""Score records: what scoring produces, per prompt and per run.

Per-prompt scores and classes, latency, run aggregates (metrics.json) and the scored run."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import Field

from regress.noise.record import NoiseApplied, NoiseTest
from regress.power.record import PowerFigure
from regress.records.quality import Gate, QualityVerdict, gate_fails
from regress.records.base import FORMAT_VERSION, _Record
from regress.records.manifest import RunManifest

PromptClass = Literal["identical", "benign", "drift", "regression", "input_drift"]
"""Per-prompt outcome, from harmless to harmful; ``input_drift`` stands apart (not comparable)."""

MetricValue = float | int | bool | str | None


class AnswerCheck(_Record):
    """A prompt's expected answer checked in both outputs (prompts with ``expected`` only)."""

    expected: list[str]
    """The accepted answers, from the prompt set."""
    golden_correct: bool
    """The golden's output contains an accepted answer."""
    candidate_correct: bool
    """The candidate's output contains an accepted answer."""
    golden_match: str | None = None
    """The accepted answer found in the golden's output (the first one listed), if any."""
    candidate_match: str | None = None
    """The accepted answer found in the candidate's output (the first one listed), if any."""
    golden_rejected: str | None = None
    candidate_rejected: str | None = None
    """A rejected answer (the prompt's ``reject``) found in that side's output, which makes it
    wrong whatever else it holds; for sampled prompts, the first found in any sample."""
    golden_rate: float | None = None
    candidate_rate: float | None = None
    """Sampled prompts: the share of each side's samples that hold an accepted answer (the quality
    verdict judges the prompt by these, as distributions; ``*_correct`` is the majority). None for
    a prompt answered once."""

    @property
    def golden_score(self) -> float:
        """What the quality verdict counts for the golden: its rate, or 1/0."""
        return self.golden_rate if self.golden_rate is not None else float(self.golden_correct)

    @property
    def candidate_score(self) -> float:
        """What the quality verdict counts for the candidate: its rate, or 1/0."""
        return self.candidate_rate if self.candidate_rate is not None else float(self.candidate_correct)

    @property
    def flip(self) -> Literal["lost", "gained"] | None:
        """``lost``: golden correct, candidate not; ``gained``: the other way round; else None."""
        if self.golden_correct == self.candidate_correct:
            return None
        return "lost" if self.golden_correct else "gained"


class PromptScore(_Record):
    """One prompt's scores against the golden and the class they add up to."""

    prompt_id: str
    """Id from the prompt set."""
    tags: list[str] = Field(default_factory=list)
    """The prompt's tags."""
    prompt_class: PromptClass
    """identical, benign, drift, regression, or input_drift."""
    reasons: list[str] = Field(default_factory=list)
    """Why this class (thresholds crossed, or the benign criteria met)."""
    metrics: dict[str, MetricValue]
    """Every metric output by name (see regress.metrics for their meaning)."""
    answer: AnswerCheck | None = None
    """The expected answer checked in both outputs; None when the prompt has no ``expected``."""


class LatencyStats(_Record):
    """Latency of one run's requests (:mod:`regress.latency`). Per-request times exist only for
    runs of the ``server`` backend (time to first token and total time of every request, several
    in flight); for offline runs every field but ``throughput_tokens_per_s`` is None. Percentiles
    are numpy's (linear interpolation) over the requests that have the time; seconds."""

    requests: int = 0
    """Requests with a measured total time (0 for offline runs)."""
    ttft_p50_s: float | None = None
    """Median time to first token."""
    ttft_p95_s: float | None = None
    """95th percentile of the time to first token."""
    ttft_p99_s: float | None = None
    """99th percentile of the time to first token."""
    tpot_p50_s: float | None = None
    """Median time per output token after the first: (total - TTFT) / max(1, output tokens - 1) per request."""
    tpot_p95_s: float | None = None
    """95th percentile of the time per output token."""
    tpot_p99_s: float | None = None
    """99th percentile of the time per output token."""
    latency_p50_s: float | None = None
    """Median total time of a request."""
    latency_p95_s: float | None = None
    """95th percentile of a request's total time."""
    latency_p99_s: float | None = None
    """99th percentile of a request's total time."""
    throughput_tokens_per_s: float | None = None
    """Output tokens per second of the run's generation wall time (the manifest's timings: every
    shard's ``generation_s`` summed); None when that time is 0."""
    concurrency: int | None = None
    """Requests kept in flight (``server`` runs); None for offline runs."""


class LatencyComparison(_Record):
    """The candidate's latency against the golden's (``RunMetrics.latency``). A ratio is candidate
    / golden (above 1: the candidate takes longer, or for throughput is faster); None when either
    side lacks the number or the golden's is 0."""

    golden: LatencyStats
    """The golden's latency."""
    candidate: LatencyStats
    """The candidate's latency."""
    ttft_p50_ratio: float | None = None
    """Candidate / golden median time to first token."""
    ttft_p95_ratio: float | None = None
    """Candidate / golden 95th percentile time to first token (gated by ``max_latency_ratio``)."""
    tpot_p95_ratio: float | None = None
    """Candidate / golden 95th percentile time per output token (gated by ``max_latency_ratio``)."""
    latency_p95_ratio: float | None = None
    """Candidate / golden 95th percentile total time (gated by ``max_latency_ratio``)."""
    throughput_ratio: float | None = None
    """Candidate / golden throughput (gated by ``min_throughput_ratio``)."""


class RunMetrics(_Record):
    """Aggregates of one candidate against the golden: written as ``metrics.json`` (DVC metrics)."""

    format_version: int = FORMAT_VERSION
    """Stored format version."""
    candidate: str
    """Candidate name."""
    prompts: int
    """Prompts scored."""
    identical: int
    """Prompts with exactly the golden's tokens."""
    benign: int
    """Prompts that diverged at a near-tie and stayed close (numerical noise)."""
    drift: int
    """Prompts that diverged beyond noise but within tolerance."""
    regression: int
    """Prompts beyond a regression threshold."""
    input_drift: int
    """Prompts whose input tokens changed (tokenizer or chat template), not comparable."""
    exact_match_rate: float
    """identical / prompts."""
    mean_teacher_forced_kl: float | None
    """Mean over prompts of the mean per-position teacher-forced KL."""
    same_top1_rate: float | None
    """Teacher-forced same-top-1 rate over all scored positions."""
    mean_semantic_similarity: float | None
    """Mean semantic similarity over prompts."""
    mean_first_divergence: float | None
    """Mean first-divergence position over diverged prompts."""
    verdict: Literal["pass", "fail"]
    """pass: no regression beyond the allowance; fail: CI should stop the rollout."""
    gate: Gate = "fidelity"
    """Which verdict gates the check (the candidate's ``gate``, ``auto`` resolved): ``verdict`` (fidelity),
    ``quality_verdict``, or both."""
    quality_verdict: Literal["pass", "fail", "inconclusive"] | None = None
    """Did answers hold (:mod:`regress.quality`): pass, fail, inconclusive (gates like a fail); None
    without answered prompts."""
    quality: QualityVerdict | None = Field(None, exclude_if=lambda v: v is None)
    """The quality verdict whole: accuracies, the paired difference with its interval against theta, the
    prompts needed, the slices per tag; left out of the file without answered prompts."""
    verdict_basis: str | None = None
    """What the verdict rests on: the run-level test against the measured noise, or fixed per-prompt
    thresholds alone (no noise floor); None in files written before it."""
    tokens_per_s: float
    """Candidate generation throughput."""
    golden_tokens_per_s: float
    """Golden (baseline) generation throughput."""
    tokens_per_s_ratio: float | None
    """Candidate / golden throughput (> 1 is faster)."""
    speed_comparable: bool | None = Field(None, exclude_if=lambda v: v is None)
    """Whether the golden's and the candidate's speeds compare: the load beside the engine during
    each side's generation differs by at most ``PERF_LOAD_BOUND`` cores (:func:`regress.scoring.speed_comparison`).
    False: the speed figures say more about what else ran than about the candidate. None: not recorded."""
    speed_note: str | None = Field(None, exclude_if=lambda v: v is None)
    """Why the speeds do or do not compare, in words (the loads of both sides)."""
    engine_load_s: float
    """Candidate engine load time."""
    golden_engine_load_s: float
    """Golden engine load time."""
    peak_memory_mib: float | None
    """Candidate engine process peak memory."""
    golden_peak_memory_mib: float | None
    """Golden engine process peak memory."""
    answer_prompts: int = 0
    """Prompts with an expected answer (``expected`` in the prompt set); 0 when none has one."""
    golden_answers_correct: int = 0
    """Of those, prompts whose golden output contains an accepted answer."""
    answers_correct: int = 0
    """Of those, prompts whose candidate output contains an accepted answer."""
    answer_flips_lost: int = 0
    """Prompts whose golden output had the expected answer and the candidate's does not."""
    answer_flips_gained: int = 0
    """Prompts whose candidate output has the expected answer and the golden's did not."""
    answer_flips_lost_ids: list[str] = Field(default_factory=list)
    """Ids of the prompts whose answer was lost, in prompt set order."""
    answer_flips_gained_ids: list[str] = Field(default_factory=list)
    """Ids of the prompts whose answer was gained, in prompt set order."""
    confidence: float = 0.95
    """Confidence level of the intervals below (``thresholds.confidence``)."""
    regression_rate: float | None = None
    """regression / comparable prompts (prompts - input_drift); None without comparable prompts."""
    regression_rate_low: float | None = None
    """Lower bound of the regression rate's Wilson score interval (what ``max_regression_rate`` gates on)."""
    regression_rate_high: float | None = None
    """Upper bound of the regression rate's Wilson score interval."""
    flip_rate: float | None = None
    """Comparable prompts whose output is not identical to the golden's / comparable prompts."""
    flip_rate_low: float | None = None
    """Lower bound of the flip rate's Wilson score interval."""
    flip_rate_high: float | None = None
    """Upper bound of the flip rate's Wilson score interval."""
    answer_flip_rate: float | None = None
    """(answer_flips_lost + answer_flips_gained) / answer_prompts; None without answer prompts."""
    answer_flip_rate_low: float | None = None
    """Lower bound of the answer flip rate's Wilson score interval (what ``max_answer_flip_rate`` gates on)."""
    answer_flip_rate_high: float | None = None
    """Upper bound of the answer flip rate's Wilson score interval."""
    answer_mcnemar_p: float | None = None
    """Two-sided exact McNemar p-value of answers lost against gained; None without answer prompts."""
    not_teacher_forced: int = 0
    """Prompts the teacher-forcing pass could not score (prompt + golden completion longer than the
    candidate's max_model_len): they have no teacher-forced measure and are never benign."""
    not_teacher_forced_ids: list[str] = Field(default_factory=list)
    """Their ids, in prompt set order."""
    nonfinite: int = 0
    """Prompts with a measure that is NaN or infinite: regressions (or, where the metric says the
    measure could not be taken, no scoring at all), left out of the aggregates above."""
    nonfinite_ids: list[str] = Field(default_factory=list)
    """Their ids, in prompt set order."""
    mean_sample_logprob_shift: float | None = None
    """Sampled prompts (``samples:``): mean over them of the candidate-minus-golden mean logprob per
    token of their samples (below 0: the candidate samples hotter); None without sampled prompts."""
    sample_scoring: str | None = Field(None, exclude_if=lambda v: v is None)
    """Sampled prompts: whose model scored the candidate's samples (the baseline's, ``golden-scored/``,
    or the candidate's own) and why (:mod:`regress.metrics.sample_scorer`); left out of the file
    without sampled prompts."""
    noise_floor: NoiseApplied | None = Field(None, exclude_if=lambda v: v is None)
    """The baseline's measured noise floor applied to this scoring (``golden/noise.json``): arms,
    floor per measure, the bounds in force and the prompts noisy on the baseline itself; left out
    of the file when none was applied."""
    noise_test: NoiseTest | None = Field(None, exclude_if=lambda v: v is None)
    """The run-level test against the measured noise (:mod:`regress.noise.beyond`): whether the run as a
    whole moved beyond the baseline's noise, per measure with its ratio, effect and p-value; left out of
    the file without a noise floor (or with too few prompts to test)."""
    severe_regressions: int | None = Field(None, exclude_if=lambda v: v is None)
    """With a noise floor: the regressions severe enough to gate on their own (``thresholds.severe_regression``);
    ``max_regressions`` counts these. Left out of the file without a noise floor (then every regression counts)."""
    severe_regression_ids: list[str] = Field(default_factory=list, exclude_if=lambda v: not v)
    """Their ids, in prompt set order."""
    detection_power: PowerFigure | None = Field(None, exclude_if=lambda v: v is None)
    """The gate's detection power on this golden and prompt set (``regress power``, power/power.json): the
    smallest planted weight noise it fails and its margin to the noise arms; left out of the file when not
    measured for this golden."""
    extra: dict[str, float | None] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """Aggregates of metrics that have no field above (plugins' metrics), by the name their spec
    gives; left out of the file when there are none."""
    latency: LatencyComparison | None = None
    """Latency of golden and candidate and their ratios (:mod:`regress.latency`): per-request
    percentiles for ``server`` runs, throughput only for offline runs; None in files written before it."""
    latency_verdict: Literal["pass", "fail"] | None = None
    """The latency verdict, apart from ``verdict`` (which is about outputs): fail when a ratio is past
    ``max_latency_ratio`` or ``min_throughput_ratio``; None when neither is set or nothing could be compared."""
    latency_reasons: list[str] = Field(default_factory=list)
    """Why the latency verdict is what it is (empty without one)."""
    latency_gates: bool = False
    """Whether a failed latency verdict fails the check (``thresholds.gate_latency``); otherwise it is reported only."""

    @property
    def gating_failed(self) -> bool:
        """Whether CI should stop: the verdict that gates (``gate``) says stop, or the latency verdict
        failed and gates (``thresholds.gate_latency: true``). What exit codes are decided by."""
        return gate_fails(self.gate, self.verdict, self.quality) or (self.latency_gates and self.latency_verdict == "fail")


class ScoredRun(_Record):
    """One candidate scored against its golden (``scores.json``): per-prompt scores, aggregates
    and the verdict; the input of the report and of CI gating."""

    format_version: int = FORMAT_VERSION
    """Stored format version."""
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    """When scored."""
    golden: RunManifest
    """The golden's manifest."""
    run: RunManifest
    """The candidate run's manifest."""
    thresholds: dict[str, Any]
    """Thresholds in force."""
    metric_descriptions: dict[str, str]
    """What each metric output means."""
    metrics: RunMetrics
    """Aggregates."""
    verdict_reasons: list[str]
    """Why the run passed or failed."""
    scores: list[PromptScore]
    """Per prompt, in prompt set order."""
