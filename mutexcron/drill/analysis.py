"""From what the nodes wrote to the drill's figures and its FAIL reasons."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from .records import NodeOps, Tick
from .report import JOB_INTERVAL, DrillReport, HandOff, PhaseMark, format_gap


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
    for node, first in sorted(ops.starts.items()):
        report.clock_offsets[node] = float(first["wall"]) - float(first["mono"]) - wall_minus_mono
    for mark in report.marks:
        if mark.phase == "term":
            offsets = report.clock_offsets if report.skew else {}
            report.hand_off = hand_off(ticks, mark, wall_minus_mono, offsets)
            report.gaps["term"] = report.hand_off.gap
    _analyse_ops(report, ops)
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


def hand_off(
    ticks: list[Tick], mark: PhaseMark, wall_minus_mono: float, clock_offsets: Mapping[str, float] | None = None
) -> HandOff:
    """The hand-off after ``mark`` (a SIGTERM), from the ledger of fire times: when the stopping
    node's last run ended, when the first fire time after it (or after the signal, if it ran none)
    was due, when another node ran first, and the fire times in between that ran on no node.

    Args:
        ticks: every tick the nodes wrote.
        mark: the SIGTERM.
        wall_minus_mono: the drill's ``time.time() - time.monotonic()``, used if the stopping node
            wrote no tick to read its own clock from.
        clock_offsets: node -> its wall clock's offset (``--skew``): a standby whose clock is
            ahead of the stopping node's by *n* intervals starts *n* fire times later by design
            (they are already past on its clock; no instant goes without a run), so those *n*
            are not counted as missed.
    """
    ordered = sorted(ticks, key=lambda t: t.mono)
    first = next((t for t in ordered if t.node != mark.node and t.mono > mark.at), None)
    own = [t for t in ordered if t.node == mark.node and (first is None or t.fire < first.fire)]
    # Fire times are the stopping node's wall clock (libfaketime may shift it, never the
    # monotonic clock): its own ticks tell when, on the monotonic clock, a fire time was due.
    clock = own[-1].wall - own[-1].mono if own and own[-1].wall else wall_minus_mono
    last = own[-1] if own and own[-1].mono > mark.at else None
    if last is not None:
        due_fire = last.fire + JOB_INTERVAL
    else:
        signal_wall = mark.at + clock
        base = own[-1].fire if own else math.floor(signal_wall)
        due_fire = base + (math.floor((signal_wall - base) / JOB_INTERVAL) + 1) * JOB_INTERVAL
    ran = {round(t.fire, 3) for t in ticks}
    missed: list[float] = []
    if first is not None and own:
        offsets = clock_offsets or {}
        ahead = offsets.get(first.node, 0.0) - offsets.get(mark.node, 0.0)
        skipped = max(0, round(ahead / JOB_INTERVAL))  # fire times already past on the standby's clock
        missed = [f for f in _fire_times_between(own[-1].fire, first.fire)[skipped:] if f not in ran]
    return HandOff(
        node=mark.node,
        last_fire=None if last is None else last.fire,
        ran_until=0.0 if last is None else last.mono - mark.at,
        due=max(0.0, due_fire - clock - mark.at),
        next_run=None if first is None else first.mono - mark.at,
        first_fire=None if first is None else first.fire,
        missed=missed,
    )


def _fire_times_between(low: float, high: float) -> list[float]:
    """The drill job's fire times strictly between two of them, rounded as the ledger keys them."""
    return [round(low + k * JOB_INTERVAL, 3) for k in range(1, round((high - low) / JOB_INTERVAL))]


def _check_phase(report: DrillReport, phase: str, gap: float | None) -> None:
    limit = report.limit(phase)
    what = "hand-off after SIGTERM" if phase == "term" else f"failover after {phase}"
    takeover = report.takeover.get(phase)
    since = _since(report, phase)
    if phase in report.takeover and (takeover is None or takeover > limit):
        report.failures.append(f"{what}: the lock moved {format_gap(takeover)} after {since[0]} (limit {limit:.1f}s)")
    if phase == "term" and report.hand_off is not None and report.hand_off.missed:
        missed = report.hand_off.missed
        report.failures.append(
            f"{what}: {len(missed)} fire time(s) between {report.hand_off.node}'s last run and the first run "
            f"on another node ran on no node ({', '.join(_clock_time(f) for f in missed[:5])})"
        )
    # A new holder whose clock is behind the old one's waits, by design, until its clock passes
    # the fire times the old holder already claimed: that wait is allowed on top of the limit.
    lead = max(0.0, report.clock_lead.get(phase, 0.0)) if report.skew else 0.0
    if gap is None or gap > limit + lead:
        allowance = f" + {lead:.1f}s clock lead" if lead else ""
        report.failures.append(
            f"{what}: the next run on another node came {format_gap(gap)} after {since[1]} (limit {limit:.1f}s{allowance})"
        )


def _clock_time(fire: float) -> str:
    return datetime.fromtimestamp(fire, timezone.utc).strftime("%H:%M:%S UTC")


def _since(report: DrillReport, phase: str) -> tuple[str, str]:
    """What the lock move and the next run of ``phase`` are counted from, in words."""
    names = {"kill": "SIGKILL", "freeze": "SIGSTOP", "term": "SIGTERM"}
    signal = names.get(phase, phase)
    hand_off = report.hand_off if phase == "term" else None
    if hand_off is None:
        return signal, signal
    if hand_off.last_fire is None:
        return signal, "the first fire time due after SIGTERM"
    return f"{hand_off.node}'s last run", f"the fire time due after {hand_off.node}'s last run"


def _analyse_ops(report: DrillReport, ops: NodeOps) -> None:
    report.latency = _latency(ops.samples, report.marks)
    acquired = sorted(ops.acquired, key=lambda e: float(e["mono"]))
    for mark in report.marks:
        after = [e for e in acquired if e["node"] != mark.node and float(e["mono"]) > mark.at and e["lock"] == report.lock]
        # A stopping node hands its lock over once its last run has ended: the move counts from then.
        since = mark.at + (report.hand_off.ran_until if mark.phase == "term" and report.hand_off else 0.0)
        report.takeover[mark.phase] = max(0.0, float(after[0]["mono"]) - since) if after else None
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
