"""The drill's report: what it measured, its limits, its JSON form and its text for people."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Seconds a hand-off after SIGTERM may take: in the plain and shared-jobs drills, from the first
#: fire time the standby could run (the stopping node runs the one due while it hands over) to its
#: run; in the task drill, from SIGTERM to the handed-back task's start.
TERM_LIMIT = 1.5
#: The drill job's interval (:mod:`~mutexcron.drill.node_jobs`: cron ``second="*"``).
JOB_INTERVAL = 1.0


@dataclass
class PhaseMark:
    """When the drill signalled which node, for the analysis."""

    phase: str
    node: str
    at: float
    until: float | None = None  # freeze: when SIGCONT was sent


@dataclass
class HandOff:
    """The hand-off after SIGTERM, read from the ledger of fire times (the ticks).

    Under balanced placement the stopping node keeps the lock for a fire time due while it hands
    over, runs it, and only then hands the lock over: the standby's first fire time is the one after
    that run, so the hand-off is timed from when that fire time was due, not from the signal, and a
    fire time lost in between is counted. All times are seconds after the signal."""

    node: str  # the stopping node
    last_fire: float | None  # the fire time of its last run after the signal; None: it ran none
    ran_until: float  # when that run ended (0.0: it ran none)
    due: float  # when the first fire time after that run (or after the signal) was due
    next_run: float | None  # when another node ran first; None: none did
    first_fire: float | None  # the fire time that run ran
    missed: list[float] = field(default_factory=list)  # fire times from its last run to that one that ran nowhere

    @property
    def gap(self) -> float | None:
        """Seconds from ``due`` to the first run on another node: the figure the verdict judges."""
        return None if self.next_run is None else max(0.0, self.next_run - self.due)

    def to_json(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 3) + 0.0

        return {
            "measured_from": "the first fire time due after the stopping node's last run (or after SIGTERM, if it ran none)",
            "node": self.node,
            "last_fire": self.last_fire,
            "ran_until_seconds": r(self.ran_until),
            "due_seconds": r(self.due),
            "next_run_seconds": r(self.next_run),
            "first_fire": self.first_fire,
            "missed_fire_times": self.missed,
        }


@dataclass
class DrillReport:
    """What a drill measured."""

    nodes: int
    unactive_interval: float
    gaps: dict[str, float | None] = field(default_factory=dict)
    expected: int = 0
    executed: int = 0
    missed: int = 0
    duplicated: list[float] = field(default_factory=list)
    attrs_repeats: int = 0
    attrs_breaks: int = 0
    failures: list[str] = field(default_factory=list)
    store: str = ""
    lock: str = ""
    lock_left: str = ""
    #: Where the nodes' logs and records were kept because the drill did not pass ("" if removed).
    logs: str = ""
    skew: float = 0.0
    seconds: float = 0.0
    takeover: dict[str, float | None] = field(default_factory=dict)
    clock_lead: dict[str, float] = field(default_factory=dict)
    clock_offsets: dict[str, float] = field(default_factory=dict)
    latency: dict[str, Any] = field(default_factory=dict)
    marks: list[PhaseMark] = field(default_factory=list)
    #: After SIGTERM: ``gaps["term"]`` and ``takeover["term"]`` are counted from this hand-off's
    #: due fire time and the end of the stopping node's last run (the other phases: from the signal).
    hand_off: HandOff | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def limit(self, phase: str) -> float:
        """The verdict's limit for ``phase``: ``unactive_interval`` + 1 s, or 1.5 s after SIGTERM."""
        return TERM_LIMIT if phase == "term" else self.unactive_interval + 1.0

    def measured_from(self, phase: str) -> str:
        """What ``gaps[phase]`` counts from."""
        if phase == "term" and self.hand_off is not None:
            after = "the stopping node's last run" if self.hand_off.last_fire is not None else "SIGTERM"
            return f"the first fire time due after {after}"
        return "the signal"

    def to_json(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 3) + 0.0  # + 0.0: no "-0.0"

        return {
            "verdict": "PASS" if self.passed else "FAIL",
            "failures": self.failures,
            "store": self.store,
            "lock": self.lock,
            "lock_left": self.lock_left,
            "logs": self.logs,
            "nodes": self.nodes,
            "unactive_interval": self.unactive_interval,
            "skew": self.skew,
            "seconds": round(self.seconds, 1),
            "ticks": {
                "expected": self.expected,
                "executed": self.executed,
                "missed": self.missed,
                "duplicated": len(self.duplicated),
            },
            "gaps_seconds": {k: r(v) for k, v in self.gaps.items()},
            "takeover_seconds": {k: r(v) for k, v in self.takeover.items()},
            "limits_seconds": {k: self.limit(k) for k in self.gaps},
            "clock_lead_seconds": {k: r(v) for k, v in self.clock_lead.items()},
            "clock_offsets_seconds": {k: r(v) for k, v in self.clock_offsets.items()},
            "gaps_measured_from": {k: self.measured_from(k) for k in self.gaps},
            "term_hand_off": None if self.hand_off is None else self.hand_off.to_json(),
            "attrs": {"repeats": self.attrs_repeats, "breaks": self.attrs_breaks},
            "store_latency_ms": self.latency,
        }


def closing_lines(cleanup: str, logs: str, failures: list[str]) -> list[str]:
    """The last lines of a drill's report: what was cleaned up, where the kept logs are, the verdict."""
    lines = [f"cleanup    {cleanup}"] if cleanup else []
    if logs:
        lines.append(f"logs       the nodes' logs and records are kept in {logs}")
    lines.append("FAIL: " + "; ".join(failures) if failures else "PASS")
    return lines


def format_gap(gap: float | None) -> str:
    return "never (timed out)" if gap is None else f"{gap:.2f}s"


def format_report(report: DrillReport) -> str:
    """The drill's report for people; the last line is the verdict."""
    lat = report.latency
    lines = [
        f"store      {report.store}  ({report.nodes} nodes, unactive_interval {report.unactive_interval:g}s, "
        f"{report.seconds:.0f}s" + (f", skew {report.skew:+g}s per node" if report.skew else "") + ")",
        f"ticks      expected {report.expected}  executed {report.executed}  missed {report.missed}  "
        f"duplicated {len(report.duplicated)}",
    ]
    lines += _phase_lines(report)
    lines.append(f"attrs      repeats {report.attrs_repeats}  breaks {report.attrs_breaks}")
    if lat.get("calls"):
        lines.append(
            f"latency    store round trip p50 {lat['p50']:.2f} ms  p99 {lat['p99']:.2f} ms  "
            f"({lat['calls']} lock operations timed in the nodes)"
        )
    if report.skew and report.clock_offsets:
        lines.append("clocks     " + "  ".join(f"{n} {round(o, 2) + 0.0:+.2f}s" for n, o in report.clock_offsets.items()))
    if report.lock_left:
        lines.append(f"lock       {report.lock_left}")
    if report.logs:
        lines.append(f"logs       the nodes' logs and records are kept in {report.logs}")
    lines.append("PASS" if report.passed else "FAIL: " + "; ".join(report.failures))
    return "\n".join(lines)


def _phase_lines(report: DrillReport) -> list[str]:
    names = {"kill": "after SIGKILL", "freeze": "after SIGSTOP", "term": "after SIGTERM"}
    first_phase = next(iter(report.gaps), None)
    lines = []
    for phase, gap in report.gaps.items():
        lead = report.clock_lead.get(phase)
        behind = f", new holder's clock {lead:.1f}s behind" if report.skew and lead and lead > 0.5 else ""
        if phase == "term" and report.hand_off is not None:
            measured = _hand_off_text(report.hand_off, report.takeover.get(phase))
        else:
            takeover = f"lock moved {format_gap(report.takeover[phase])}, " if phase in report.takeover else ""
            measured = f"{takeover}next run {format_gap(gap)}"
        lines.append(
            f"{'failover' if phase == first_phase else '':<10} {names.get(phase, phase):<14} "
            f"{measured}  (limit {report.limit(phase):.1f}s{behind})"
        )
    return lines


def _hand_off_text(hand_off: HandOff, takeover: float | None) -> str:
    """The SIGTERM line's figures, each with what it counts from (times after the signal in brackets)."""
    if hand_off.last_fire is not None:
        since = f"after its last run (ended +{hand_off.ran_until:.2f}s)"
        due = "the fire time after it"
    else:
        since, due = "after the signal (it ran no fire time after it)", "the first fire time after the signal"
    ran = "" if hand_off.next_run is None else f"; ran +{hand_off.next_run:.2f}s"
    return (
        f"lock moved {format_gap(takeover)} {since}, next run {format_gap(hand_off.gap)} after {due} was due "
        f"(due +{hand_off.due:.2f}s{ran}), {len(hand_off.missed)} fire time(s) missed"
    )
