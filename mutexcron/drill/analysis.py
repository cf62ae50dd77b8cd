"""From what the nodes wrote to the drill's figures and its FAIL reasons."""

from __future__ import annotations

import itertools
from typing import Any

from .records import NodeOps, Tick
from .report import DrillReport, PhaseMark, format_gap


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def analyse(
    ticks: list[Tick],
    report: DrillReport,
    ops: NodeOps,
    *,
    mono_range: tuple[float, float],
    wall_minus_mono: float,
) -> DrillReport:
    """Count duplicates, misses and attrs repeats/breaks, read the nodes' timings; add the verdict's failures.

    Args:
        ticks: every tick the nodes wrote.
        report: the report to fill (``gaps`` and ``marks`` already set by the drill).
        ops: the nodes' timing files (latency, takeovers, clock offsets).
        mono_range: the drill's own ``time.monotonic()`` at its start and end: node times outside
            it mean libfaketime faked the monotonic clock.
        wall_minus_mono: the drill's ``time.time() - time.monotonic()``, to measure node clock offsets.
    """
    _count_ticks(ticks, report)
    _analyse_ops(report, ops, wall_minus_mono)
    low, high = mono_range
    bad = [t for t in ticks if not low - 1.0 <= t.mono <= high + 1.0]
    if bad:
        report.failures.append(
            f"{len(bad)} tick(s) carry a monotonic time outside the drill's run: this libfaketime fakes "
            "time.monotonic() despite FAKETIME_DONT_FAKE_MONOTONIC=1, so the gaps cannot be trusted"
        )
    if report.duplicated:
        report.failures.append(f"{len(report.duplicated)} fire time(s) ran on more than one node")
    if report.attrs_repeats:
        report.failures.append(f"the attrs counter repeated or went back {report.attrs_repeats} time(s)")
    for phase, gap in report.gaps.items():
        _check_phase(report, phase, gap)
    return report


def _count_ticks(ticks: list[Tick], report: DrillReport) -> None:
    by_fire: dict[float, list[Tick]] = {}
    for tick in ticks:
        by_fire.setdefault(round(tick.fire, 3), []).append(tick)
    report.duplicated = sorted(f for f, ts in by_fire.items() if len(ts) > 1)
    fires = sorted(by_fire)
    report.executed = len(fires)
    if fires:
        report.expected = round(fires[-1] - fires[0]) + 1
        report.missed = report.expected - report.executed
    ordered = sorted(ticks, key=lambda t: (t.fire, t.mono))
    for prev, cur in itertools.pairwise(ordered):
        if cur.n <= prev.n:
            report.attrs_repeats += 1
        elif cur.n != prev.n + 1:
            report.attrs_breaks += 1


def _check_phase(report: DrillReport, phase: str, gap: float | None) -> None:
    limit = report.limit(phase)
    what = "hand-off after SIGTERM" if phase == "term" else f"failover after {phase}"
    takeover = report.takeover.get(phase)
    if phase in report.takeover and (takeover is None or takeover > limit):
        report.failures.append(f"{what}: the lock moved after {format_gap(takeover)} (limit {limit:.1f}s)")
    # A new holder whose clock is behind the old one's waits, by design, until its clock passes
    # the fire times the old holder already claimed: that wait is allowed on top of the limit.
    lead = max(0.0, report.clock_lead.get(phase, 0.0)) if report.skew else 0.0
    if gap is None or gap > limit + lead:
        allowance = f" + {lead:.1f}s clock lead" if lead else ""
        report.failures.append(f"{what}: the next run came after {format_gap(gap)} (limit {limit:.1f}s{allowance})")


def _analyse_ops(report: DrillReport, ops: NodeOps, wall_minus_mono: float) -> None:
    for node, first in sorted(ops.starts.items()):
        report.clock_offsets[node] = float(first["wall"]) - float(first["mono"]) - wall_minus_mono
    report.latency = _latency(ops.samples, report.marks)
    acquired = sorted(ops.acquired, key=lambda e: float(e["mono"]))
    for mark in report.marks:
        after = [e for e in acquired if e["node"] != mark.node and float(e["mono"]) > mark.at and e["lock"] == report.lock]
        report.takeover[mark.phase] = float(after[0]["mono"]) - mark.at if after else None
        if after and mark.node in report.clock_offsets and after[0]["node"] in report.clock_offsets:
            report.clock_lead[mark.phase] = report.clock_offsets[mark.node] - report.clock_offsets[after[0]["node"]]
    if report.skew and report.clock_offsets:
        _check_skew(report)


def _latency(samples: list[tuple[str, str, float, float]], marks: list[PhaseMark]) -> dict[str, Any]:
    """p50/p99 in ms of the nodes' store calls, overall and by operation."""
    frozen = [(m.node, m.at, m.until or m.at) for m in marks if m.phase == "freeze"]
    kept: dict[str, list[float]] = {}
    for node, op, start, seconds in samples:
        if any(node == f and start < until and start + seconds > at for f, at, until in frozen):
            continue  # a call in flight while its node was stopped measures the freeze, not the store
        kept.setdefault(op, []).append(seconds * 1000)
    everything = [ms for values in kept.values() for ms in values]
    return {
        "p50": round(percentile(everything, 50), 2) if everything else None,
        "p99": round(percentile(everything, 99), 2) if everything else None,
        "calls": len(everything),
        "by_op": {
            op: {"p50": round(percentile(v, 50), 2), "p99": round(percentile(v, 99), 2), "calls": len(v)}
            for op, v in sorted(kept.items())
        },
    }


def _check_skew(report: DrillReport) -> None:
    """Fail the drill if libfaketime did not shift node i's clock by i x ``skew``."""
    wrong = []
    for node, offset in report.clock_offsets.items():
        index = int(node.split("-")[1]) if node.count("-") >= 2 and node.split("-")[1].isdigit() else None
        if index is not None and abs(offset - index * report.skew) > 0.5:
            wrong.append(f"{node} {offset:+.2f}s (asked {index * report.skew:+.2f}s)")
    if wrong:
        report.failures.append("--skew did not shift the node clocks as asked: " + ", ".join(wrong))
