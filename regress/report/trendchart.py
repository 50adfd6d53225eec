"""The index page's "Trend across releases": per package, inline SVG charts and a table.

The geometry is computed here, so the template writes only numbers into SVG attributes and
text (escaped) into ``<text>`` and ``<title>``. Colours are SVG presentation attributes
(``fill``, ``stroke``), not ``style=`` attributes, which the page's CSP blocks; the page needs
no script for the section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from regress.report import overview
from regress.trend import HistoryLine, safe_report_path

WIDTH = 560
RATES_HEIGHT = 190
KL_HEIGHT = 120
LEFT, RIGHT, TOP = 46, 14, 10
ROTATE_AFTER = 6
"""More releases than this: the version labels are written at an angle, so they do not overlap."""
COLOURS = {"exact": "#0969da", "regression": "#d97706", "kl": "#8250df", "pass": "#1a7f37", "fail": "#cf222e",
           "grid": "#d8dee4", "axis": "#656d76"}


@dataclass
class Chart:
    """One small line chart: series of (x, y) points (a gap where a value is missing)."""

    height: int
    bottom: int
    ticks: list[tuple[float, str]]
    """(y, label) of the horizontal grid lines."""
    lines: list[dict[str, Any]] = field(default_factory=list)
    """{"stroke", "segments": [points attribute], "label"}."""
    markers: list[dict[str, Any]] = field(default_factory=list)
    """{"x", "y", "fill", "title"}."""
    labels: list[dict[str, Any]] = field(default_factory=list)
    """Version labels on the x axis: {"x", "y", "text", "rotate"}."""
    width: int = WIDTH


def _x_positions(n: int) -> list[float]:
    inner = WIDTH - LEFT - RIGHT
    if n == 1:
        return [LEFT + inner / 2]
    return [LEFT + inner * i / (n - 1) for i in range(n)]


def _segments(points: list[tuple[float, float | None]]) -> list[str]:
    """SVG ``points`` attributes of the runs of present values."""
    out, run = [], []
    for x, y in points + [(0.0, None)]:
        if y is None:
            if run:
                out.append(" ".join(f"{px:.1f},{py:.1f}" for px, py in run))
            run = []
        else:
            run.append((x, y))
    return out


def _labels(xs: list[float], versions: list[str], y: float) -> list[dict[str, Any]]:
    rotate = len(xs) > ROTATE_AFTER
    return [{"x": round(x, 1), "y": round(y, 1), "text": _short(v), "rotate": rotate} for x, v in zip(xs, versions)]


def _short(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _chart(lines: list[HistoryLine], values: dict[str, list[float | None]], *, height: int, top_value: float,
           ticks: list[tuple[float, str]], marker_series: str | None) -> Chart:
    rotate = len(lines) > ROTATE_AFTER
    bottom = 58 if rotate else 26
    plot_h = height - TOP - bottom
    xs = _x_positions(len(lines))

    def y_of(v: float) -> float:
        return TOP + plot_h * (1 - min(max(v / top_value, 0.0), 1.0)) if top_value > 0 else TOP + plot_h

    chart = Chart(height=height, bottom=bottom, ticks=[(round(y_of(t), 1), label) for t, label in ticks])
    for key, series in values.items():
        pts = [(x, None if v is None else y_of(v)) for x, v in zip(xs, series)]
        chart.lines.append({"stroke": COLOURS[key], "segments": _segments(pts), "key": key})
    if marker_series is not None:
        for x, v, line in zip(xs, values[marker_series], lines):
            if v is None:
                continue
            chart.markers.append({"x": round(x, 1), "y": round(y_of(v), 1), "fill": COLOURS[line.verdict],
                                  "title": f"{line.version}: {line.verdict}, exact match "
                                           f"{overview.fmt(line.exact_match_rate, 'pct')}, regression rate "
                                           f"{overview.fmt(line.regression_rate, 'pct')}"})
    chart.labels = _labels(xs, [line.version or "" for line in lines], height - bottom + 14)
    return chart


def _kl_ticks(top: float) -> list[tuple[float, str]]:
    return [(0.0, "0"), (top / 2, overview.fmt(top / 2, "kl")), (top, overview.fmt(top, "kl"))]


def package_trend(package: str, lines: list[HistoryLine]) -> dict[str, Any]:
    """What the template needs for one package: its charts and table rows."""
    rates = _chart(lines, {"exact": [ln.exact_match_rate for ln in lines],
                           "regression": [ln.regression_rate for ln in lines]},
                   height=RATES_HEIGHT + (32 if len(lines) > ROTATE_AFTER else 0), top_value=1.0,
                   ticks=[(0.0, "0%"), (0.5, "50%"), (1.0, "100%")], marker_series="exact")
    kls = [ln.mean_teacher_forced_kl for ln in lines]
    present = [v for v in kls if v is not None]
    kl = None
    if present:
        top = max(max(present), 0.0) or 1e-6
        kl = _chart(lines, {"kl": kls}, height=KL_HEIGHT + (32 if len(lines) > ROTATE_AFTER else 0), top_value=top,
                    ticks=_kl_ticks(top), marker_series=None)
        for x, v, line in zip(_x_positions(len(lines)), kls, lines):
            if v is not None:
                y = TOP + (kl.height - TOP - kl.bottom) * (1 - min(max(v / top, 0.0), 1.0))
                kl.markers.append({"x": round(x, 1), "y": round(y, 1), "fill": COLOURS[line.verdict],
                                   "title": f"{line.version}: teacher-forced KL {overview.fmt(v, 'kl')}"})
    rows = [{"line": ln, "link": safe_report_path(ln.report), "checked": _when(ln.checked_at)} for ln in lines]
    return {"package": package, "rates": rates, "kl": kl, "rows": rows, "colours": COLOURS,
            "with_answers": any(ln.answer_flips_lost is not None for ln in lines)}


def _when(when: datetime) -> str:
    if when.tzinfo is None:  # a hand-written line without a zone: taken as UTC
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def trend_context(series: dict[str, list[HistoryLine]]) -> list[dict[str, Any]]:
    """Per package with at least one release line, in name order: :func:`package_trend`."""
    return [package_trend(package, lines) for package, lines in series.items() if lines]
