"""The index page's "Trend across releases": per package, inline SVG charts and a table.

The geometry is computed here, so the template writes only numbers into SVG attributes and
text (escaped) into ``<text>`` and ``<title>``. Colours are SVG presentation attributes
(``fill``, ``stroke``), not ``style=`` attributes, which the page's CSP blocks; the page needs
no script for the section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from regress.report import overview
from regress.trend import HistoryLine, safe_report_path

WIDTH = 560
RATES_HEIGHT = 190
KL_HEIGHT = 120
LEFT, RIGHT, TOP = 46, 14, 10
"""LEFT is the least room for the y-axis labels; longer labels widen it (:func:`_left_for`)."""
TICK_CHAR_PX, TICK_GAP = 6.2, 6
"""Room for one character of a 10 px tick label (digits, '.', 'e', '-' are narrower in common
sans-serif fonts; the browser tests measure the labels), and the gap between a label and its grid line."""
ROTATE_AFTER = 6
"""More releases than this: the version labels are written at an angle, so they do not overlap."""
ANGLE, LABEL_CHARS, VERSION_CHAR_PX, LABEL_DROP = 40, 24, 6.8, 14
"""Version labels: the angle they are written at past ROTATE_AFTER releases, their most characters,
the width of one character at 11 px (about the widest of digits, letters and '+'), and how far
under the plot their baseline starts."""
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
    """Version labels on the x axis: {"x", "y", "text" (cut to fit), "full", "rotate", "angle"}."""
    width: int = WIDTH
    left: int = LEFT
    """Where the plot starts: the y labels end TICK_GAP before it (right-aligned), and start inside the SVG."""

    @property
    def tick_x(self) -> int:
        """The x of the tick labels' right ends."""
        return self.left - TICK_GAP


def axis_number(value: float) -> str:
    """A y-axis label that fits the chart's margin: '0', '0.011', '12.3', '6.1e-5' (two significant
    digits and a short exponent for small values, where '6.10e-05' would not fit)."""
    if value == 0:
        return "0"
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{value:.2g}" if abs(value) < 1 else f"{value:.3g}"


def _left_for(*tick_sets: list[tuple[float, str]]) -> int:
    """The plot's left edge: room for the longest tick label of all the package's charts (so their
    x positions line up), never less than LEFT."""
    longest = max((len(label) for ticks in tick_sets for _, label in ticks), default=0)
    return max(LEFT, int(longest * TICK_CHAR_PX + TICK_GAP + 4 + 0.5))


def _x_positions(n: int, left: int = LEFT) -> list[float]:
    inner = WIDTH - left - RIGHT
    if n == 1:
        return [left + inner / 2]
    return [left + inner * i / (n - 1) for i in range(n)]


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


def _label_texts(xs: list[float], versions: list[str]) -> list[str]:
    """The version labels, each cut ("…") to what fits: written at an angle and ending at its x, a
    label must not start left of the chart; upright and centred on its x, it must fit between its
    neighbours and inside both edges. The full version is the label's tooltip and in the table."""
    rotate = len(xs) > ROTATE_AFTER
    gap = (xs[1] - xs[0]) if len(xs) > 1 else float(WIDTH)
    out = []
    for x, v in zip(xs, versions):
        room = x / math.cos(math.radians(ANGLE)) if rotate else min(gap, 2 * x, 2 * (WIDTH - x)) - 4
        out.append(_short(v, min(LABEL_CHARS, max(4, int(room / VERSION_CHAR_PX)))))
    return out


def _bottom_for(texts: list[str], rotate: bool) -> int:
    """Room under the plot for the version labels (at an angle: as deep as the longest goes)."""
    if not rotate:
        return 26
    longest = max((len(t) for t in texts), default=0) * VERSION_CHAR_PX
    return int(LABEL_DROP + longest * math.sin(math.radians(ANGLE)) + 6 + 0.5)


def _short(text: str, limit: int = LABEL_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _chart(lines: list[HistoryLine], values: dict[str, list[float | None]], *, plot_height: int, top_value: float,
           ticks: list[tuple[float, str]], marker_series: str | None, left: int = LEFT) -> Chart:
    """``plot_height``: the chart's height with upright labels; labels at an angle add their depth."""
    rotate = len(lines) > ROTATE_AFTER
    xs = _x_positions(len(lines), left)
    texts = _label_texts(xs, [line.version or "" for line in lines])
    bottom = _bottom_for(texts, rotate)
    height = plot_height + bottom - _bottom_for([], False)
    plot_h = height - TOP - bottom

    def y_of(v: float) -> float:
        return TOP + plot_h * (1 - min(max(v / top_value, 0.0), 1.0)) if top_value > 0 else TOP + plot_h

    chart = Chart(height=height, bottom=bottom, ticks=[(round(y_of(t), 1), label) for t, label in ticks], left=left)
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
    chart.labels = [{"x": round(x, 1), "y": height - bottom + LABEL_DROP, "text": text, "full": line.version or "",
                     "rotate": rotate, "angle": ANGLE} for x, text, line in zip(xs, texts, lines)]
    return chart


def _kl_ticks(top: float) -> list[tuple[float, str]]:
    return [(0.0, "0"), (top / 2, axis_number(top / 2)), (top, axis_number(top))]


RATE_TICKS = [(0.0, "0%"), (0.5, "50%"), (1.0, "100%")]


def package_trend(package: str, lines: list[HistoryLine]) -> dict[str, Any]:
    """What the template needs for one package: its charts and table rows."""
    kls = [ln.mean_teacher_forced_kl for ln in lines]
    present = [v for v in kls if v is not None]
    top = (max(max(present), 0.0) or 1e-6) if present else None
    kl_ticks = _kl_ticks(top) if top is not None else []
    left = _left_for(RATE_TICKS, kl_ticks)
    rates = _chart(lines, {"exact": [ln.exact_match_rate for ln in lines],
                           "regression": [ln.regression_rate for ln in lines]},
                   plot_height=RATES_HEIGHT, top_value=1.0,
                   ticks=RATE_TICKS, marker_series="exact", left=left)
    kl = None
    if top is not None:
        kl = _chart(lines, {"kl": kls}, plot_height=KL_HEIGHT, top_value=top,
                    ticks=kl_ticks, marker_series=None, left=left)
        for x, v, line in zip(_x_positions(len(lines), left), kls, lines):
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
