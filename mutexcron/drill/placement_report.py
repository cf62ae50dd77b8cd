"""The placement drill's report: each change of the cluster and how long the locks took to follow
it, the fire times run twice and missed, the verdict, its JSON form and its text for people."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .report import closing_lines, format_gap

#: The share tolerance: each live node holds ⌈locks / live nodes⌉ ± this fraction (at least ± 1 lock).
SHARE_TOLERANCE = 0.10
#: Seconds from SIGTERM until every lock of the node that left is held by another one.
TERM_MOVED_LIMIT = 1.0
#: Seconds, on top of the lease, from SIGKILL until every lock of the killed node is held by another one.
KILL_MOVED_MARGIN = 1.0
#: The kinds of change the drill makes, in their order, and what each one does.
CHANGES: dict[str, str] = {
    "join": "a node joins",
    "term": "a node leaves (SIGTERM)",
    "kill": "a node is killed (SIGKILL)",
    "return": "a node comes back",
}


def fair_share(locks: int, live: int) -> int:
    """⌈locks / live⌉: the share each live node should hold."""
    return math.ceil(locks / live) if live else 0


def shares_balanced(held: Mapping[str, int], live: Iterable[str], locks: int) -> bool:
    """Every lock is held by a live node, and each live node holds its fair share ± :data:`SHARE_TOLERANCE`."""
    live = list(live)
    share = fair_share(locks, len(live))
    slack = max(1.0, share * SHARE_TOLERANCE)
    return sum(held.get(n, 0) for n in live) == locks and all(abs(held.get(n, 0) - share) <= slack for n in live)


@dataclass
class Change:
    """One change of the cluster and what the drill measured after it (seconds from ``at``)."""

    kind: str  #: one of :data:`CHANGES`
    node: str
    at: float  #: ``time.monotonic()`` of the signal, or of the node's start for a join or a return
    wall: float  #: ``time.time()`` of the same instant
    live: list[str] = field(default_factory=list)  #: the live nodes after the change
    moved: float | None = None  #: term, kill: until every lock the node held was held by another node
    moved_limit: float | None = None
    balanced: float | None = None  #: until every live node held its share
    balanced_limit: float = 0.0
    shares: dict[str, int] = field(default_factory=dict)  #: the locks each live node held at the end of the wait
    missed: int = 0  #: fire times from this change to the next that ran on no node

    def failures(self) -> list[str]:
        what = f"{self.kind} of {self.node}"
        found = []
        if self.moved_limit is not None and (self.moved is None or self.moved > self.moved_limit):
            found.append(f"{what}: its locks held elsewhere after {format_gap(self.moved)} (limit {self.moved_limit:.1f}s)")
        if self.balanced is None or self.balanced > self.balanced_limit:
            found.append(
                f"{what}: shares balanced after {format_gap(self.balanced)} (limit {self.balanced_limit:.1f}s, 2 leases); "
                f"held: {_shares_text(self.shares)}"
            )
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "node": self.node,
            "live": self.live,
            "moved_seconds": _round(self.moved),
            "moved_limit_seconds": self.moved_limit,
            "balanced_seconds": _round(self.balanced),
            "balanced_limit_seconds": self.balanced_limit,
            "shares": self.shares,
            "missed": self.missed,
        }


@dataclass
class PlacementDrillReport:
    """What a placement drill measured."""

    nodes: int
    lease: float
    locks: int
    store: str = ""
    changes: list[Change] = field(default_factory=list)
    runs: int = 0
    doubled: list[tuple[int, float]] = field(default_factory=list)  #: (job, fire time) run more than once
    expected: int = 0
    missed: int = 0
    errors: list[str] = field(default_factory=list)  #: what kept the drill from measuring
    lock_left: str = ""
    logs: str = ""
    seconds: float = 0.0

    @property
    def failures(self) -> list[str]:
        found = [failure for change in self.changes for failure in change.failures()]
        if self.doubled:
            job, fire = self.doubled[0]
            found.append(f"{len(self.doubled)} fire time(s) ran twice (e.g. job {job} at {fire:.0f})")
        return [*self.errors, *found]

    @property
    def passed(self) -> bool:
        return not self.failures

    def count_runs(self, runs: Iterable[tuple[int, float]], since: float, until: float) -> None:
        """Count the fire times run twice (any), and in ``[since, until)`` (whole seconds, wall clock)
        the runs and the fire times that ran on no node, in all and per change (from it to the next)."""
        counted = Counter(runs)
        self.doubled = sorted(key for key, n in counted.items() if n > 1)
        ran = set(counted)
        seconds = range(math.ceil(since), math.floor(until))
        self.runs = sum(n for (_job, fire), n in counted.items() if seconds.start <= fire < seconds.stop)
        missing = [fire for fire in seconds for job in range(self.locks) if (job, float(fire)) not in ran]
        self.expected, self.missed = len(seconds) * self.locks, len(missing)
        starts = [change.wall for change in self.changes]
        for i, change in enumerate(self.changes):
            end = starts[i + 1] if i + 1 < len(starts) else math.inf
            change.missed = sum(1 for fire in missing if change.wall <= fire < end)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": "PASS" if self.passed else "FAIL",
            "failures": self.failures,
            "store": self.store,
            "nodes": self.nodes,
            "lease": self.lease,
            "locks": self.locks,
            "seconds": round(self.seconds, 1),
            "changes": [change.to_json() for change in self.changes],
            "fire_times": {"expected": self.expected, "runs": self.runs, "missed": self.missed, "doubled": len(self.doubled)},
            "lock_left": self.lock_left,
            "logs": self.logs,
        }


def format_placement_report(report: PlacementDrillReport) -> str:
    """The placement drill's report for people; the last line is the verdict."""
    lines = [
        f"store      {report.store}  ({report.nodes} nodes, {report.locks} locks, lease {report.lease:g}s, "
        f"{report.seconds:.0f}s, balanced placement)",
    ]
    for change in report.changes:
        moved = ""
        if change.moved_limit is not None:
            moved = f"locks held elsewhere {format_gap(change.moved)} (limit {change.moved_limit:.1f}s), "
        lines.append(
            f"{change.kind:<10} {change.node:<18} {moved}shares balanced {format_gap(change.balanced)} "
            f"(limit {change.balanced_limit:.1f}s): {_shares_text(change.shares)}; {change.missed} fire time(s) missed"
        )
    lines.append(
        f"fire times expected {report.expected}  runs {report.runs}  missed {report.missed}  doubled {len(report.doubled)}"
        "  (misses are reported, not judged: a killed node's locks wait for its lease)"
    )
    return "\n".join(lines + closing_lines(report.lock_left, report.logs, report.failures))


def _shares_text(shares: Mapping[str, int]) -> str:
    return ", ".join(f"{node} {count}" for node, count in shares.items()) or "none"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3) + 0.0
