"""Server-rendered inline SVG charts (no script, no inline style: colours come from the stylesheet's classes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["Bar", "Series", "bar_chart", "count", "line_chart", "seconds"]

_W, _H, _LEFT, _BOTTOM, _TOP = 560, 150, 52, 18, 20


@dataclass(frozen=True)
class Bar:
    label: str  # the tooltip
    value: float
    kind: str = "ok"  # a CSS class: ok, err


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # a CSS class
    values: Sequence[float]


def seconds(value: float) -> str:
    """A short duration for axes and tooltips: 840µs, 12ms, 3.4s, 5m."""
    if value < 0.001:
        return f"{value * 1e6:.0f}µs"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.1f}s"
    return f"{value / 60:.0f}m"


def count(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _frame(title: str, top: float, note: str, fmt: Callable[[float], str] = seconds) -> list[str]:
    plot_h = _H - _BOTTOM - _TOP
    parts = [f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" aria-label="{escape(title)}">',
             f'<text class="chart-title" x="{_LEFT}" y="13">{escape(title)}</text>']  # fmt: skip
    for i in range(3):
        y = _TOP + plot_h * i / 2
        value = top * (1 - i / 2)
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{_W - 4}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="axis" x="{_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{fmt(value) if value else "0"}</text>'
        )
    if note:
        parts.append(f'<text class="axis" x="{_W - 4}" y="{_H - 4}" text-anchor="end">{escape(note)}</text>')
    return parts


def bar_chart(title: str, bars: Sequence[Bar], note: str = "", fmt: Callable[[float], str] = seconds,
              floor: float = 1e-6, empty: str = "no runs kept yet") -> str:  # fmt: skip
    """One bar per value, oldest left; a tooltip on each. ``floor``: the least top of the axis."""
    if not bars:
        return f'<p class="muted">{escape(title)}: {escape(empty)}</p>'
    top = max(max(b.value for b in bars), floor) * 1.1
    parts = _frame(title, top, note, fmt)
    plot_w, plot_h = _W - _LEFT - 4, _H - _BOTTOM - _TOP
    step = plot_w / len(bars)
    for i, bar in enumerate(bars):
        h = max(1.0, plot_h * bar.value / top)
        x, y = _LEFT + i * step + step * 0.15, _TOP + plot_h - h
        parts.append(f'<rect class="bar {escape(bar.kind)}" x="{x:.1f}" y="{y:.1f}" width="{max(1.0, step * 0.7):.1f}" '
                     f'height="{h:.1f}"><title>{escape(bar.label)}</title></rect>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def line_chart(title: str, series: Sequence[Series], note: str = "", fmt: Callable[[float], str] = seconds) -> str:
    """Lines over the samples (oldest left), sharing one axis; a legend under the title."""
    values = [v for s in series for v in s.values]
    if len(values) < 2:
        return f'<p class="muted">{escape(title)}: collecting samples (one per refresh)</p>'
    top = max(max(values), 1.0) * 1.1  # at least 1 (task, second): a flat zero line stays at the bottom
    parts = _frame(title, top, note, fmt)
    plot_w, plot_h = _W - _LEFT - 4, _H - _BOTTOM - _TOP
    x0 = _LEFT + 8 * len(title) + 12
    for i, s in enumerate(series):
        n = len(s.values)
        points = " ".join(
            f"{_LEFT + plot_w * j / max(1, n - 1):.1f},{_TOP + plot_h - plot_h * v / top:.1f}" for j, v in enumerate(s.values)
        )
        parts.append(f'<polyline class="line {escape(s.kind)}" points="{points}"/>')
        parts.append(f'<text class="legend {escape(s.kind)}" x="{x0 + i * 150}" y="13">— {escape(s.name)}</text>')
    parts.append("</svg>")
    return "".join(parts)
