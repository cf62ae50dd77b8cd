"""The drill's report: what it measured, its limits, its JSON form and its text for people."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TERM_LIMIT = 1.5  # seconds from SIGTERM to the next run on a standby


@dataclass
class PhaseMark:
    """When the drill signalled which node, for the analysis."""

    phase: str
    node: str
    at: float
    until: float | None = None  # freeze: when SIGCONT was sent


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

    @property
    def passed(self) -> bool:
        return not self.failures

    def limit(self, phase: str) -> float:
        """The verdict's limit for ``phase``: ``unactive_interval`` + 1 s, or 1.5 s after SIGTERM."""
        return TERM_LIMIT if phase == "term" else self.unactive_interval + 1.0

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
        takeover = f"lock moved {format_gap(report.takeover[phase])}, " if phase in report.takeover else ""
        lead = report.clock_lead.get(phase)
        behind = f", new holder's clock {lead:.1f}s behind" if report.skew and lead and lead > 0.5 else ""
        lines.append(
            f"{'failover' if phase == first_phase else '':<10} {names.get(phase, phase):<14} "
            f"{takeover}next run {format_gap(gap)}  (limit {report.limit(phase):.1f}s{behind})"
        )
    return lines
