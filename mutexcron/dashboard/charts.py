"""Server-rendered inline SVG charts (no script, no inline style: colours come from the stylesheet's classes).

Every chart has a value axis whose ticks share one unit chosen from the largest value (µs, ms, s,
min: never "0ms" beside "400µs"), a time axis labelled under the plot when its points have times
(UTC), and its legend or note on a row of its own, so nothing is clipped at any width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape

__all__ = ["Bar", "Series", "bar_chart", "count", "line_chart", "seconds"]

_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 560, 176, 52, 8, 22, 40
_PLOT_W, _PLOT_H = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
#: Where the time labels and the legend (or note) go, under the plot.
_TIME_Y, _LEGEND_Y = _H - _BOTTOM + 14, _H - 6


@dataclass(frozen=True)
class Bar:
    label: str  # the tooltip
    value: float
    kind: str = "ok"  # a CSS class: ok, err
    at: datetime | None = None  # its place on the time axis


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # a CSS class
    values: Sequence[float]


_UNITS = ((1e-3, 1e6, "µs"), (1.0, 1e3, "ms"), (120.0, 1.0, "s"), (float("inf"), 1 / 60, "min"))


def seconds(value: float) -> str:
    """A short duration for tooltips: 840µs, 12ms, 3.4s, 5m."""
    if value < 0.001:
        return f"{value * 1e6:.0f}µs"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.1f}s"
    return f"{value / 60:.0f}m"


def seconds_axis(top: float) -> Callable[[float], str]:
    """Tick labels in the one unit that suits ``top`` (the axis's largest value)."""
    scale, unit = next((s, u) for limit, s, u in _UNITS if top < limit)
    digits = 0 if top * scale >= 10 else 1 if top * scale >= 1 else 2
    return lambda value: f"{value * scale:.{digits}f}{unit}"


def count(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _top(highest: float, floor: float, fmt: Callable[[float], str] | None) -> float:
    """The axis's top: a little over the highest value; for counts an even whole number (whole ticks)."""
    top = max(highest, floor) * 1.1
    if fmt is count:
        top = math.ceil(top)
        top += top % 2
    return top


def _frame(title: str, top: float, fmt: Callable[[float], str] | None) -> list[str]:
    label = (fmt or seconds_axis(top)) if fmt is not count else count
    parts = [f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" aria-label="{escape(title)}">',
             f"<title>{escape(title)}</title>",
             f'<text class="chart-title" x="{_LEFT}" y="14">{escape(title)}</text>']  # fmt: skip
    for i in range(3):
        y = _TOP + _PLOT_H * i / 2
        value = top * (1 - i / 2)
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        tick = label(value) if value else "0"
        parts.append(f'<text class="axis" x="{_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{tick}</text>')
    return parts


def _time_axis(times: Sequence[datetime | None]) -> list[str]:
    """Labels under the plot at its first, middle and last point (UTC), if the points have times."""
    if not times or any(t is None for t in (times[0], times[-1])):
        return []
    first, last = times[0], times[-1]
    span = (last - first).total_seconds() if first is not None and last is not None else 0.0
    shown = "%H:%M" if span >= 3 * 3600 else "%H:%M:%S"
    marks = [(0, "start"), (len(times) - 1, "end")]
    if len(times) > 2:
        marks.insert(1, (len(times) // 2, "middle"))
    parts = []
    for index, where in marks:
        when = times[index]
        if when is None:
            continue
        x = _LEFT + _PLOT_W * (index + 0.5) / len(times)
        x = _LEFT if where == "start" else _W - _RIGHT if where == "end" else x
        parts.append(f'<text class="axis" x="{x:.1f}" y="{_TIME_Y}" text-anchor="{where}">{when:{shown}}</text>')
    parts.append(f'<text class="axis" x="{_W - _RIGHT}" y="{_LEGEND_Y}" text-anchor="end">UTC</text>')
    return parts


def bar_chart(title: str, bars: Sequence[Bar], note: str = "", fmt: Callable[[float], str] | None = None,
              floor: float = 1e-6, empty: str = "no runs kept yet") -> str:  # fmt: skip
    """One bar per value, oldest left; a tooltip on each. ``floor``: the least top of the axis;
    ``fmt``: the value axis's labels (default: durations, one unit for every tick)."""
    if not bars:
        return f'<p class="muted chart-empty">{escape(title)}: {escape(empty)}</p>'
    top = _top(max(b.value for b in bars), floor, fmt)
    parts = _frame(title, top, fmt)
    step = _PLOT_W / len(bars)
    for i, bar in enumerate(bars):
        h = max(1.0, _PLOT_H * bar.value / top)
        x, y = _LEFT + i * step + step * 0.15, _TOP + _PLOT_H - h
        parts.append(f'<rect class="bar {escape(bar.kind)}" x="{x:.1f}" y="{y:.1f}" width="{max(1.0, step * 0.7):.1f}" '
                     f'height="{h:.1f}"><title>{escape(bar.label)}</title></rect>')  # fmt: skip
    parts += _time_axis([b.at for b in bars])
    if note:
        parts.append(f'<text class="axis" x="{_LEFT}" y="{_LEGEND_Y}">{escape(note)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_chart(title: str, series: Sequence[Series], note: str = "", fmt: Callable[[float], str] | None = None,
               times: Sequence[datetime | None] = ()) -> str:  # fmt: skip
    """Lines over the samples (oldest left), sharing one axis; the legend under the plot."""
    values = [v for s in series for v in s.values]
    if len(values) < 2:
        return f'<p class="muted chart-empty">{escape(title)}: collecting samples (one per refresh)</p>'
    top = _top(max(values), 1.0, fmt)  # at least 1 (task, second): a flat zero line stays at the bottom
    parts = _frame(title, top, fmt)
    for i, s in enumerate(series):
        n = len(s.values)
        points = " ".join(
            f"{_LEFT + _PLOT_W * j / max(1, n - 1):.1f},{_TOP + _PLOT_H - _PLOT_H * v / top:.1f}" for j, v in enumerate(s.values)
        )
        parts.append(f'<polyline class="line {escape(s.kind)}" points="{points}"/>')
        x = _LEFT + i * 110  # a coloured key, then the name in the text colour (readable on any screen)
        parts.append(f'<rect class="key {escape(s.kind)}" x="{x}" y="{_LEGEND_Y - 8}" width="12" height="8"/>'
                     f'<text class="legend" x="{x + 16}" y="{_LEGEND_Y}">{escape(s.name)}</text>')  # fmt: skip
    parts += _time_axis(times)
    if note:
        parts.append(f'<text class="axis" x="{_W - _RIGHT - 30}" y="{_LEGEND_Y}" text-anchor="end">{escape(note)}</text>')
    parts.append("</svg>")
    return "".join(parts)
