"""What a metric declares about each value it returns: the one source its consumers follow.

The verdict, the aggregates, metrics.json, JUnit, summary.md and the report page all follow from
the declaration.

An :class:`Output` says what a value measures, how it is shown, which way is better, how it is
aggregated over prompts and, where it gates, its benign and regression bounds. A bound is a
:class:`Setting`: a field of ``thresholds:`` in params.yaml with its default and validation, so a
metric's thresholds exist wherever the metric is registered. A :class:`Rule` covers what a bound
cannot say (several values together). Plain data, no regress imports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Aggregation = Literal["mean", "median", "max", "min", "rate", "none"]
"""How a value is reduced over prompts: ``rate`` is the share of prompts where it is true."""
Better = Literal["higher", "lower"]
"""Which way a value is better; its bounds are crossed the other way."""
Format = Literal["num", "int", "pct", "kl", "ratio"]
"""How a number is written: 3 significant digits, integer, percentage, KL-style (tiny values in
scientific notation), ratio (``1.25×``)."""
Scale = Literal["position", "log", "unit"]
"""A chart's x axis: token positions (integer bins), log10, or linear up to 1."""
NonFinite = Literal["error", "regression"]
"""What a NaN or infinite value means: ``error``, the measure could not be taken and the scoring
stops (exit 3, :class:`regress.errors.MeasureError`); ``regression``, the candidate's answer is
broken and the prompt is a regression. Never noise: NaN compares false with every bound, so a
value that is not a number would otherwise pass every gate."""

Findings = tuple[list[str], list[str]]
"""(regression reasons, not-benign reasons) of one prompt."""


@dataclass(frozen=True)
class Setting:
    """A field of ``thresholds:`` in params.yaml that a metric declares (a bound, a switch or an option)."""

    name: str
    default: Any
    doc: str
    type: Any = float
    """The annotation pydantic validates with (``float``, ``bool``, ``Literal[...]``, ``str | None``)."""
    ge: float | None = None
    le: float | None = None


@dataclass(frozen=True)
class Bound:
    """One gate on a value: past ``setting`` (against the value's direction) it is a regression,
    or, for a benign bound, not benign."""

    setting: Setting
    reason: str | None = None
    """``str.format`` template of the reason; ``{value}``, ``{bound}`` and every value of the
    prompt by name (``{first_divergence}``). Default: ``<label> <value> > <bound>``."""
    inclusive: bool = False
    """At the bound counts as past it."""


@dataclass(frozen=True)
class Aggregate:
    """How a value becomes one number of the run (a ``metrics.json`` field)."""

    how: Aggregation
    key: str | None = None
    """The field name in metrics.json (default ``<how>_<value name>``)."""
    label: str | None = None
    """Shown among the run's measures (default: the value's label)."""
    doc: str | None = None
    """Tooltip of that measure (default: the value's doc)."""
    weight: str | None = None
    """Another value of the same prompt to weight a mean by (a rate over positions, not prompts)."""
    rank: int = 100
    """Order among the run's measures, lowest first."""
    shown_empty: bool = True
    """Shown among the run's measures (as —) when no prompt has the value; False for values only
    some prompt sets have (sampled prompts)."""


@dataclass(frozen=True)
class Chart:
    """A histogram of the value on the report page, stacked by class."""

    title: str
    sub: str
    """What the x axis is, after the count of prompts."""
    scale: Scale = "unit"
    noun: str = "prompt"
    """What is counted (``diverged prompt``)."""
    empty: str = "no values"
    diverged_only: bool = False
    """Leave identical prompts out (their value says nothing)."""


@dataclass(frozen=True)
class Output:
    """One value a metric returns per prompt."""

    name: str
    doc: str
    label: str | None = None
    """Short name for column headers (default: ``name``)."""
    format: Format = "num"
    better: Better | None = None
    aggregate: Aggregate | None = None
    benign: Bound | None = None
    """Past it, the prompt is not benign (drift at best)."""
    regression: Bound | None = None
    """Past it, the prompt is a regression."""
    noise_after_near_tie: bool = False
    """Past the regression bound after a first divergence at a near-tie is drift, not a
    regression: after a coin-toss flip the rest of an output may change without anything broken."""
    best: float | None = None
    """The ideal value, from which severity measures the way to the regression bound
    (default: 0 when lower is better, 1 when higher is better)."""
    headline: int | None = None
    """Order among the values shown with a prompt (its JUnit line, and the prompt table when
    ``column``), lowest first; None: only in the details (values that gate still show, last)."""
    column: bool = False
    """A column of the report's prompt table."""
    chart: Chart | None = None
    nonfinite: NonFinite = "error"
    """What a NaN or infinite value of it means (:data:`NonFinite`); the default, ``error``, is the
    conservative one for a value whose metric does not say: no verdict from a broken measure."""

    @property
    def shown_label(self) -> str:
        return self.label or self.name

    @property
    def aggregate_key(self) -> str | None:
        """This value's metrics.json field, if it is aggregated."""
        a = self.aggregate
        if a is None or a.how == "none":
            return None
        return a.key or f"{a.how}_{self.name}"

    @property
    def ideal(self) -> float | None:
        if self.best is not None:
            return self.best
        return {"lower": 0.0, "higher": 1.0}.get(self.better or "")

    def settings(self) -> list[Setting]:
        return [b.setting for b in (self.benign, self.regression) if b is not None]


@dataclass(frozen=True)
class Rule:
    """A verdict rule over several values of one metric, for what a bound cannot express;
    ``check(values, thresholds)`` returns (regression reasons, not-benign reasons)."""

    name: str
    doc: str
    check: Callable[[Mapping[str, Any], Any], Findings]
    settings: tuple[Setting, ...] = field(default_factory=tuple)
    categorical: bool = False
    """A regression this rule finds is a category, not a degree (vLLM's top-k check: a token the other
    side did not even rank): it gates on its own beside the run-level test (:func:`regress.verdict.severe`).
    A rule of degree (a sampled prompt's distribution, judged from a handful of samples) gates through
    its run-level test instead."""


def headline(specs: list[Output]) -> list[Output]:
    """The values shown with a prompt (its JUnit line; the prompt table's columns when ``column``),
    in order: those with a ``headline`` rank, lowest first, then those that gate, in metric order."""
    ranked = sorted((s for s in specs if s.headline is not None), key=lambda s: s.headline or 0)
    return ranked + [s for s in specs if s.headline is None and (s.benign or s.regression)]
