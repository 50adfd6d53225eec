"""The page's headline: verdict, counts, aggregate measures, performance, worst prompts, noise floor.

Plain values for the templates (HTML and Markdown alike); formatting of numbers lives here so
every output says the same thing the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from regress.latency import load_comparison
from regress.metrics import output_specs
from regress.records import RunMetrics, ScoredRun
from regress.report.payload import CLASS_ORDER, ranked

CLASS_LABELS = {"regression": "regression", "drift": "drift", "input_drift": "input drift",
                "benign": "benign", "identical": "identical"}
CLASS_HELP = {
    "regression": "beyond a regression threshold",
    "drift": "beyond noise, within tolerance",
    "input_drift": "input tokens changed: not comparable",
    "benign": "diverged at a near-tie, stayed close (numerical noise)",
    "identical": "exactly the golden's tokens",
}
SEVERITY_HELP = ("how far past its regression thresholds the prompt is: 1 = at a threshold, more = past it "
                 "(the worst of its measures), 0 = the golden's output")
DIVERGENCE_HELP = "the position of the first output token that differs from the golden's (the first divergence; 0 = the first token)"
WORST_SHOWN = 8
"""Prompts listed under 'worst prompts' at the top of the page."""
SAME_WITHIN = 0.05
"""Performance changes within 5 % are shown as unchanged."""


def fmt(value: Any, kind: str = "num") -> str:
    """A number for people: '—' when missing."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    if kind == "pct":
        return f"{value:.1%}" if value < 0.999 or value == 1 else f"{value:.2%}"
    if kind == "kl":
        return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "count":  # a count that may be fractional (a sampled prompt counts its share of samples)
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
    if kind == "ratio":
        return f"{value:.2f}×"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


@dataclass(frozen=True)
class Count:
    klass: str
    label: str
    count: int
    share: float
    help: str


@dataclass(frozen=True)
class Measure:
    label: str
    value: str
    help: str
    floor: str = ""
    """The baseline's own noise floor of this measure, when one was applied ('' otherwise)."""
    key: str = ""
    """The RunMetrics field (or ``extra`` key) it shows: what code picks a measure by, never its label."""


@dataclass(frozen=True)
class PerfRow:
    label: str
    golden: str
    candidate: str
    change: str
    direction: str
    """'better', 'worse', 'same', or 'incomparable' (the two runs ran under different loads)."""


@dataclass(frozen=True)
class Worst:
    prompt_id: str
    klass: str
    label: str
    severity: str
    reason: str
    divergence: str
    tags: str


@dataclass(frozen=True)
class Answers:
    """Expected answers of one candidate, for the page, the index and summary.md."""

    prompts: int
    golden_correct: int
    candidate_correct: int
    golden_share: str
    candidate_share: str
    lost: int
    gained: int
    lost_ids: list[str]
    gained_ids: list[str]


@dataclass(frozen=True)
class NoiseBound:
    """A run-level threshold a noise floor can move: as configured and as scoring applied it."""

    name: str
    in_force: str
    configured: str
    widened: bool


@dataclass(frozen=True)
class NoiseMeasure:
    """One row of the noise-floor table: a measure, its floor, the run-level bounds it moves."""

    name: str
    label: str
    floor: str
    bounds: list[NoiseBound]
    """Empty: no run-level bound follows the measure (the page shows its floor for reference)."""


def noise_measures(m: RunMetrics) -> list[NoiseMeasure]:
    """The noise floor as a table: per measure of the floor, in the metrics' order, the bounds its
    spec names (benign, regression) that scoring applied at run level; bounds no measure names
    come last under their own name. Empty without a noise floor."""
    nf = m.noise_floor
    if nf is None:
        return []

    def bound(name: str) -> NoiseBound:
        return NoiseBound(name, fmt(nf.bounds[name]), fmt(nf.configured.get(name)),
                          nf.configured.get(name) is not None and nf.bounds[name] != nf.configured[name])

    specs = {s.name: s for s in output_specs()}
    order = list(specs)
    rows, placed = [], set()
    for name in sorted(nf.floor, key=lambda n: order.index(n) if n in specs else len(order)):
        spec = specs.get(name)
        names = [b.setting.name for b in ((spec.benign, spec.regression) if spec else ()) if b is not None]
        names = [n for n in names if n in nf.bounds and n not in placed]
        placed.update(names)
        rows.append(NoiseMeasure(name, spec.shown_label if spec else name, fmt(nf.floor[name]),
                                 [bound(n) for n in names]))
    rows.sort(key=lambda r: not r.bounds)  # the measures that move a bound first
    rest = [n for n in nf.bounds if n not in placed]
    if rest:
        rows.append(NoiseMeasure("", "other bounds", "—", [bound(n) for n in rest]))
    return rows


def answers(m: RunMetrics) -> Answers | None:
    """The expected-answer counts, or None when no prompt of the set has an expected answer."""
    n = m.answer_prompts
    if not n:
        return None
    return Answers(n, m.golden_answers_correct, m.answers_correct, fmt(m.golden_answers_correct / n, "pct"),
                   fmt(m.answers_correct / n, "pct"), m.answer_flips_lost, m.answer_flips_gained,
                   list(m.answer_flips_lost_ids), list(m.answer_flips_gained_ids))


def counts(m: RunMetrics) -> list[Count]:
    n = max(m.prompts, 1)
    return [Count(k, CLASS_LABELS[k], getattr(m, k), getattr(m, k) / n, CLASS_HELP[k]) for k in CLASS_ORDER]


def measures(m: RunMetrics) -> list[Measure]:
    """Exact match, then every aggregated metric value in its spec's order: those with a
    RunMetrics field always (— when the metric did not run), plugins' when in ``m.extra``."""
    rows = [Measure("exact match", fmt(m.exact_match_rate, "pct"), "prompts with exactly the golden's tokens",
                    key="exact_match_rate")]
    specs = sorted((s for s in output_specs() if s.aggregate_key), key=lambda s: s.aggregate.rank)  # type: ignore[union-attr]
    listed = set()
    for spec in specs:
        key, a = spec.aggregate_key, spec.aggregate
        assert key is not None and a is not None
        if key in RunMetrics.model_fields:
            value = getattr(m, key)
        elif key in m.extra:
            value = m.extra[key]
        else:
            continue
        listed.add(key)
        if value is None and not a.shown_empty:
            continue
        floor = m.noise_floor.floor.get(spec.name) if m.noise_floor is not None else None
        rows.append(Measure(a.label or spec.shown_label, fmt(value, spec.format), a.doc or spec.doc,
                            "" if floor is None else fmt(floor, spec.format), key=key))
    # Aggregates of a metric not installed here: shown under their own name.
    rows += [Measure(key, fmt(value), key, key=key) for key, value in m.extra.items() if key not in listed]
    return rows


def rates(m: RunMetrics) -> list[Measure]:
    """The rates with their intervals (regress.stats): regression and flip rate over comparable
    prompts, and with expected answers the answer flip rate and the exact McNemar p-value."""
    from regress.stats import interval_text

    level = f"{m.confidence * 100:g} %"
    rows = []
    for label, name, help in (
            ("regression rate", "regression_rate",
             f"regressions / comparable prompts (input drift left out), {level} Wilson score interval"),
            ("flip rate", "flip_rate",
             f"comparable prompts whose output is not identical to the golden's, {level} Wilson score interval"),
            ("answer flip rate", "answer_flip_rate",
             f"answers lost + gained / prompts with an expected answer, {level} Wilson score interval")):
        value = getattr(m, name)
        if value is None or getattr(m, f"{name}_low") is None:
            continue
        rows.append(Measure(label, interval_text(value, getattr(m, f"{name}_low"), getattr(m, f"{name}_high"),
                                                 m.confidence), help))
    if m.answer_prompts and m.answer_mcnemar_p is not None:
        rows.append(Measure("answers McNemar p", f"{m.answer_mcnemar_p:.2g}",
                            f"two-sided exact McNemar test of {m.answer_flips_lost} answers lost against "
                            f"{m.answer_flips_gained} gained: small means the candidate loses more than chance"))
    return rows


def _perf(label: str, golden: float | None, cand: float | None, unit: str, higher_is_better: bool) -> PerfRow:
    def show(v: float | None) -> str:
        return "—" if v is None else f"{fmt(v)} {unit}"

    if golden is None or cand is None or golden == 0:
        return PerfRow(label, show(golden), show(cand), "—", "same")
    ratio = cand / golden
    change = f"{ratio - 1:+.0%}"
    if abs(ratio - 1) <= SAME_WITHIN:
        direction = "same"
    else:
        direction = "better" if (ratio > 1) == higher_is_better else "worse"
    return PerfRow(label, show(golden), show(cand), change, direction)


def _not_comparable(row: PerfRow) -> PerfRow:
    """A time figure whose two runs ran under different loads: shown, not coloured as a change."""
    change = row.change if row.change == "—" else f"{row.change} (not comparable)"
    return PerfRow(row.label, row.golden, row.candidate, change, "incomparable")


def load_note(score: ScoredRun) -> str | None:
    """Why the engine-load row is not compared (its loads ran beside different work), or None."""
    comparable, note = load_comparison(score.golden.timings, score.run.timings)
    return note if comparable is False and score.metrics.speed_comparable is not False else None


def performance(score: ScoredRun) -> list[PerfRow]:
    m, gt, rt = score.metrics, score.golden.timings, score.run.timings
    timed = [
        _perf("throughput", m.golden_tokens_per_s, m.tokens_per_s, "tokens/s", True),
        _perf("engine load", m.golden_engine_load_s, m.engine_load_s, "s", False),
        _perf("generation time", gt.generation_s, rt.generation_s, "s", False),
    ]
    if m.speed_comparable is False:  # a speed-up measured against a busy golden is contention, not the candidate
        timed = [_not_comparable(row) for row in timed]
    elif load_note(score) is not None:  # the engine loads alone ran beside different work
        timed[1] = _not_comparable(timed[1])
    rows = [*timed[:2], _perf("peak memory", m.golden_peak_memory_mib, m.peak_memory_mib, "MiB", False), timed[2]]
    if score.golden.memory.peak_gpu_mib is not None or score.run.memory.peak_gpu_mib is not None:
        rows.append(_perf("peak GPU memory", score.golden.memory.peak_gpu_mib, score.run.memory.peak_gpu_mib, "MiB", False))
    return rows


def worst(score: ScoredRun, limit: int = WORST_SHOWN) -> list[Worst]:
    """Regressions, then drift, then input drift, most severe first."""
    out = []
    for s, sev in ranked(score):
        if s.prompt_class not in ("regression", "drift", "input_drift") or len(out) >= limit:
            break
        d = s.metrics.get("first_divergence")
        out.append(Worst(s.prompt_id, s.prompt_class, CLASS_LABELS[s.prompt_class], f"{sev:.2f}",
                         s.reasons[0] if s.reasons else "", "—" if d is None else str(d), ", ".join(s.tags)))
    return out
