"""Latency as a measured output: per-run statistics and the candidate against the golden.

Runs of the ``server`` backend (requests replayed through vLLM's HTTP server, several in flight)
record, per prompt, the time to its first token and its total time (shard meta ``ttft_s`` and
``latency_s``, read into :class:`~regress.runs.RunResult`); :func:`latency_stats` reduces them to
percentiles. Offline runs have no per-request times: only their throughput (output tokens per
second of generation wall time, from the manifest) is known.

The time per output token of a request is ``(total - TTFT) / max(1, output tokens - 1)``: the
decode time spread over the tokens after the first. Percentiles are numpy's default (linear
interpolation between the closest ranks), over the requests that have the time.

Whether a candidate is slower is judged apart from its outputs (:func:`latency_verdict`, below).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from regress.records import LatencyComparison, LatencyStats
from regress.runs import RunResult

PERCENTILES = (50, 95, 99)
"""The percentiles reported of every time."""


def percentiles(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """p50, p95 and p99 of ``values`` (Nones when empty)."""
    if len(values) == 0:
        return None, None, None
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return float(p50), float(p95), float(p99)


def output_token_counts(run: RunResult) -> np.ndarray:
    """Output tokens of every prompt of ``run``, in row order."""
    offsets = run.arrays.get("output_offsets")
    if offsets is None:
        return np.zeros(len(run), dtype=np.int64)
    return np.diff(np.asarray(offsets, dtype=np.int64))


def throughput(run: RunResult) -> float | None:
    """Output tokens per second of the run's generation wall time (every shard's
    ``generation_s``, summed in the manifest's timings); None when that time is 0."""
    t = run.manifest.timings
    return t.output_tokens / t.generation_s if t.generation_s > 0 else None


def latency_stats(run: RunResult) -> LatencyStats:
    """The latency statistics of one run (only throughput for a run without per-request times)."""
    rate = throughput(run)
    if run.latency_s is None and run.ttft_s is None:
        return LatencyStats(throughput_tokens_per_s=rate, concurrency=run.concurrency)
    n = len(run)
    ttft = run.ttft_s if run.ttft_s is not None else [None] * n
    total = run.latency_s if run.latency_s is not None else [None] * n
    tokens = output_token_counts(run)
    ttfts = [t for t in ttft if t is not None]
    totals = [t for t in total if t is not None]
    tpots = [max(lat - first, 0.0) / max(1, int(k) - 1)
             for first, lat, k in zip(ttft, total, tokens) if first is not None and lat is not None]
    t50, t95, t99 = percentiles(ttfts)
    o50, o95, o99 = percentiles(tpots)
    l50, l95, l99 = percentiles(totals)
    return LatencyStats(requests=len(totals), ttft_p50_s=t50, ttft_p95_s=t95, ttft_p99_s=t99,
                        tpot_p50_s=o50, tpot_p95_s=o95, tpot_p99_s=o99,
                        latency_p50_s=l50, latency_p95_s=l95, latency_p99_s=l99,
                        throughput_tokens_per_s=rate, concurrency=run.concurrency)


def ratio(candidate: float | None, golden: float | None) -> float | None:
    """candidate / golden; None when either is missing or the golden's is not positive."""
    if candidate is None or golden is None or golden <= 0:
        return None
    return candidate / golden


def compare(golden: LatencyStats, candidate: LatencyStats) -> LatencyComparison:
    """Both runs' statistics and the candidate / golden ratios."""
    return LatencyComparison(
        golden=golden, candidate=candidate,
        ttft_p50_ratio=ratio(candidate.ttft_p50_s, golden.ttft_p50_s),
        ttft_p95_ratio=ratio(candidate.ttft_p95_s, golden.ttft_p95_s),
        tpot_p95_ratio=ratio(candidate.tpot_p95_s, golden.tpot_p95_s),
        latency_p95_ratio=ratio(candidate.latency_p95_s, golden.latency_p95_s),
        throughput_ratio=ratio(candidate.throughput_tokens_per_s, golden.throughput_tokens_per_s),
    )


def compare_runs(golden: RunResult, run: RunResult) -> LatencyComparison:
    """:func:`compare` of two runs' :func:`latency_stats`."""
    return compare(latency_stats(golden), latency_stats(run))


def timed(comparison: LatencyComparison | None) -> bool:
    """Whether either side has per-request times (a ``server`` run)."""
    return comparison is not None and (comparison.golden.requests > 0 or comparison.candidate.requests > 0)


# ------------------------------------------------------------------ the latency verdict

LATENCY_GATES = (
    # (ratio field of LatencyComparison, label, golden and candidate stat fields)
    ("ttft_p95_ratio", "p95 time to first token", "ttft_p95_s"),
    ("tpot_p95_ratio", "p95 time per output token", "tpot_p95_s"),
    ("latency_p95_ratio", "p95 total time", "latency_p95_s"),
)
"""What ``max_latency_ratio`` bounds, in the order the reasons list them."""


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def latency_verdict(latency: Any, t: Any) -> tuple[str | None, list[str]]:
    """The latency verdict of a :class:`~regress.records.LatencyComparison` (or None) under the
    thresholds ``max_latency_ratio`` and ``min_throughput_ratio``: ``fail`` when a p95 time (TTFT,
    time per output token, total) is more than ``max_latency_ratio`` times the golden's, or the
    throughput is below ``min_throughput_ratio`` times the golden's; ``pass`` when something was
    compared and nothing failed; None (with a reason when a bound was set) when no bound is set or
    there is nothing to compare. Apart from :func:`run_verdict`: the output verdict does not change;
    whether this one fails the check is ``gate_latency``."""
    max_ratio = getattr(t, "max_latency_ratio", None)
    min_throughput = getattr(t, "min_throughput_ratio", None)
    if max_ratio is None and min_throughput is None:
        return None, []
    if latency is None:
        return None, ["latency not compared: the runs record no timings"]
    failures: list[str] = []
    passes: list[str] = []
    checked = False
    if max_ratio is not None:
        for field, label, stat in LATENCY_GATES:
            r = getattr(latency, field)
            if r is None:
                continue
            checked = True
            shown = (f"{label} {_seconds(getattr(latency.candidate, stat))} vs golden "
                     f"{_seconds(getattr(latency.golden, stat))} ({r:.2f}×)")
            if math.isnan(r) or r > max_ratio:  # NaN compares false: it must not pass
                failures.append(f"{shown} exceeds {max_ratio:g}× (max_latency_ratio)")
            else:
                passes.append(f"{shown}: within {max_ratio:g}×")
        if not any(getattr(latency, f) is not None for f, _, _ in LATENCY_GATES):
            passes.append("per-request latency not compared: no per-request times on both sides "
                          "(only server runs record them); max_latency_ratio not checked")
    if min_throughput is not None:
        r = latency.throughput_ratio
        if r is None:
            passes.append("throughput not compared (no generation time recorded); min_throughput_ratio not checked")
        else:
            checked = True
            shown = (f"throughput {latency.candidate.throughput_tokens_per_s:,.1f} tokens/s vs golden "
                     f"{latency.golden.throughput_tokens_per_s:,.1f} ({r:.2f}×)")
            if math.isnan(r) or r < min_throughput:
                failures.append(f"{shown} below {min_throughput:g}× (min_throughput_ratio)")
            else:
                passes.append(f"{shown}: at least {min_throughput:g}×")
    if failures:
        return "fail", failures + passes
    return ("pass" if checked else None), passes


PERF_LOAD_BOUND = 0.5
"""Cores of load beside the engine by which two runs' generations may differ and their speeds
still compare. More, and the figures measure what else ran (a pip build, a test beside it)."""


def speed_comparison(golden: Any, run: Any, bound: float = PERF_LOAD_BOUND) -> tuple[bool | None, str | None]:
    """Whether two runs' speeds compare (:class:`regress.records.Timings` each), and why: the load
    beside each engine during its generation (:meth:`~regress.records.Timings.other_load`) differs
    by at most ``bound`` cores. (None, None) when either run did not record it."""
    g, c = golden.other_load(), run.other_load()
    if g is None or c is None:
        return None, None
    return _compared("speeds", abs(g - c) <= bound, "; re-time both on a quiet machine",
                     f"beside the engine, the machine's load was {g:.1f} during the golden's generation and "
                     f"{c:.1f} during the candidate's (of {run.cpu_count or golden.cpu_count or '?'} CPUs)")


def _compared(what: str, alike: bool, advice: str, said: str) -> tuple[bool, str]:
    """A comparison's answer and its note: ``what`` (not) comparable, and the figures it read."""
    return (True, f"{what} comparable: {said}") if alike else (False, f"{what} not comparable: {said}{advice}")


def load_comparison(golden: Any, run: Any, bound: float = PERF_LOAD_BOUND) -> tuple[bool | None, str | None]:
    """Whether two runs' engine loads compare (:class:`regress.records.Timings` each), and why:
    the cores busy beside each engine during its load (``engine_load_beside_cores``) differ by at
    most ``bound``. A candidate whose baseline's engine started beside it (to score its samples)
    loaded on a busier machine than its golden. (None, None) when either run did not record it."""
    g, c = golden.engine_load_beside_cores, run.engine_load_beside_cores
    if g is None or c is None:
        return None, None
    return _compared("engine loads", abs(g - c) <= bound, "",
                     f"beside the engine, {g:.1f} cores were busy during the golden's engine load and "
                     f"{c:.1f} during the candidate's")
