"""The shared-jobs drill's analysis and report: runs once per (job, fire time), failover of the
struck node's jobs within the lease, changes on every node in time and in effect."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apscheduler.events import EVENT_JOB_ADDED, EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED

from .report import TERM_LIMIT, closing_lines, format_gap

#: Seconds within which a change must have reached (its APScheduler event dispatched on) every live node.
PROPAGATION_LIMIT = 2.0
#: A change takes effect from the fire times after this many seconds (a run already claimed finishes).
EFFECT_AFTER = 1.5
_EVENT_NAMES = {EVENT_JOB_ADDED: "added", EVENT_JOB_MODIFIED: "modified", EVENT_JOB_REMOVED: "removed"}


@dataclass
class Run:
    job: str
    node: str
    fire: float
    token: int
    mono: float
    wall: float = 0.0
    version: str = "v1"  # the jobs file that last added the job (the rolling restart's is v2)


#: A rolling restart hands each lock over (SIGTERM): a job waits at most its interval plus this between two runs.
ROLLING_LIMIT = 1.5

@dataclass
class Change:
    """A change the drill made through its paused scheduler, and the event every node must show."""

    what: str  # "reschedule", "pause", "resume", "remove"
    job: str
    at: float  # time.monotonic() when the call returned
    event: int
    nodes: list[str]  # the nodes alive and not frozen then
    seen: dict[str, float | None] = field(default_factory=dict)  # node -> seconds until its event


@dataclass
class Strike:
    phase: str
    node: str
    at: float  # time.monotonic()
    wall: float  # time.time() at the same moment
    jobs: list[str]  # the jobs the node ran last before the strike
    #: job -> seconds from the strike (or from its next fire time, if later) to its next run elsewhere
    gaps: dict[str, float | None] = field(default_factory=dict)


@dataclass
class SharedDrillReport:
    """What a shared-jobs drill measured, and its verdict."""

    nodes: int
    lease: float
    lock_store: str
    job_store: str
    jobs: list[str] = field(default_factory=list)
    runs: int = 0
    twice: list[tuple[str, float]] = field(default_factory=list)
    strikes: list[Strike] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    effects: dict[str, str] = field(default_factory=dict)
    #: After every node was frozen past the lease and resumed: job -> seconds to its first run (None: none).
    resumed: dict[str, float | None] = field(default_factory=dict)
    #: The rolling restart to a changed jobs file: job -> the longest wait between two of its runs.
    rolling: dict[str, float | None] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    cleanup: str = ""
    logs: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def limit(self, phase: str) -> float:
        return TERM_LIMIT if phase == "term" else self.lease + 1.0

    @property
    def resume_limit(self) -> float:
        """Every node frozen past the lease and resumed: each job runs again within this (seconds)."""
        return self.lease + 2.0

    def to_json(self) -> dict[str, Any]:
        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 3) + 0.0

        return {
            "verdict": "PASS" if self.passed else "FAIL",
            "failures": self.failures,
            "lock_store": self.lock_store,
            "job_store": self.job_store,
            "nodes": self.nodes,
            "lease": self.lease,
            "jobs": self.jobs,
            "seconds": round(self.seconds, 1),
            "runs": {"total": self.runs, "twice": len(self.twice)},
            "failover": [
                {"phase": s.phase, "node": s.node, "jobs": s.jobs, "limit": self.limit(s.phase),
                 "gaps_seconds": {j: r(g) for j, g in s.gaps.items()}}
                for s in self.strikes
            ],
            "changes": [
                {"what": c.what, "job": c.job, "limit": PROPAGATION_LIMIT,
                 "seen_seconds": {n: r(s) for n, s in c.seen.items()}}
                for c in self.changes
            ],
            "effects": self.effects,
            "freeze_all": {"limit": self.resume_limit, "seconds_to_first_run": {j: r(g) for j, g in self.resumed.items()}},
            "rolling_restart": {"limit_over_interval": ROLLING_LIMIT,
                                "longest_gap_seconds": {j: r(g) for j, g in self.rolling.items()}},
            "cleanup": self.cleanup,
            "logs": self.logs,
        }


def read_shared(path: Path) -> tuple[list[Run], list[dict[str, Any]]]:
    """The runs and the job events the nodes wrote (none if the file does not exist yet)."""
    runs: list[Run] = []
    events: list[dict[str, Any]] = []
    if not path.exists():
        return runs, events
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a half-written last line
        if "event" in row:
            events.append(row)
        elif "fire" in row:
            runs.append(Run(row["job"], row["node"], float(row["fire"]), int(row["token"]), float(row["mono"]),
                            float(row.get("wall", 0.0)), str(row.get("version", "v1"))))  # fmt: skip
    return runs, events


def analyse(report: SharedDrillReport, runs: list[Run], events: list[dict[str, Any]]) -> None:
    """Fill the report's figures and its failures from what the nodes wrote."""
    report.runs = len(runs)
    counts = Counter((r.job, round(r.fire, 3)) for r in runs)
    report.twice = sorted(key for key, n in counts.items() if n > 1)
    if report.twice:
        report.failures.append(f"{len(report.twice)} (job, fire time) ran more than once: {report.twice[:5]}")
    for strike in report.strikes:
        _failover(report, strike, runs)
    for change in report.changes:
        _propagation(report, change, events)
    _effects(report, runs)


def _failover(report: SharedDrillReport, strike: Strike, runs: list[Run]) -> None:
    limit = report.limit(strike.phase)
    for job in strike.jobs:
        after = sorted((r for r in runs if r.job == job and r.node != strike.node and r.mono > strike.at), key=lambda r: r.mono)
        since = strike.wall
        if strike.phase == "term":  # a stopping node runs the fire times due during its hand-over wait, then hands over
            own = [r.fire for r in runs if r.job == job and r.node == strike.node and r.mono > strike.at]
            since = max([since, *own])
        due = _next_slot(runs, job, since)
        # The job could not run before its first fire time after the strike (after the stopping
        # node's last run of it, after SIGTERM): the wait counts from then.
        strike.gaps[job] = after[0].mono - strike.at - max(0.0, due - strike.wall) if after and due is not None else None
        gap = strike.gaps[job]
        if gap is None or gap > limit:
            report.failures.append(f"after {strike.phase} of {strike.node}, job {job} ran elsewhere after "
                                   f"{format_gap(gap)} (limit {limit:.1f}s)")  # fmt: skip


#: How many of a job's latest fire times before a strike show its interval (the smaller step between
#: them: one of them may be missing). Older ones may be from before the drill's reschedule.
RECENT_FIRES = 3


def _next_slot(runs: list[Run], job: str, wall: float) -> float | None:
    """The job's first fire time after ``wall``, from its schedule as its latest runs show it (the
    last fire time before, plus its interval), whether or not a node ran it."""
    fires = sorted({round(r.fire, 3) for r in runs if r.job == job})
    before = [f for f in fires if f <= wall]
    steps = [b - a for a, b in itertools.pairwise(before[-RECENT_FIRES:]) if b - a >= 0.5]
    if not before or not steps:
        return None
    period = min(steps)
    return before[-1] + (math.floor((wall - before[-1]) / period) + 1) * period


def _propagation(report: SharedDrillReport, change: Change, events: list[dict[str, Any]]) -> None:
    for node in change.nodes:
        seen = [
            float(e["mono"])
            for e in events
            if e["node"] == node and e["job"] == change.job and e["event"] == change.event and float(e["mono"]) >= change.at - 0.5
        ]
        change.seen[node] = max(0.0, min(seen) - change.at) if seen else None
        late = change.seen[node]
        if late is None or late > PROPAGATION_LIMIT:
            report.failures.append(f"{change.what} of {change.job}: node {node} saw it after {format_gap(late)} "
                                   f"(limit {PROPAGATION_LIMIT:g}s)")  # fmt: skip


def _effects(report: SharedDrillReport, runs: list[Run]) -> None:
    """A removed job never runs again, a paused one not until resumed, a rescheduled one on its new interval."""
    by_what = {c.what: c for c in report.changes}
    removed = by_what.get("remove")
    if removed is not None:
        late = [r for r in runs if r.job == removed.job and r.mono > removed.at + EFFECT_AFTER]
        report.effects["remove"] = f"{removed.job}: {len(late)} run(s) after its removal"
        if late:
            report.failures.append(f"removed job {removed.job} ran {len(late)} time(s) after its removal")
    paused, resumed = by_what.get("pause"), by_what.get("resume")
    if paused is not None and resumed is not None:
        during = [r for r in runs if r.job == paused.job and paused.at + EFFECT_AFTER < r.mono < resumed.at]
        again = [r for r in runs if r.job == paused.job and r.mono > resumed.at]
        report.effects["pause"] = f"{paused.job}: {len(during)} run(s) while paused, {len(again)} after its resume"
        if during:
            report.failures.append(f"paused job {paused.job} ran {len(during)} time(s) while paused")
        if not again:
            report.failures.append(f"resumed job {paused.job} never ran again")
    moved = by_what.get("reschedule")
    if moved is not None:
        fires = sorted({round(r.fire, 3) for r in runs if r.job == moved.job and r.mono > moved.at + EFFECT_AFTER})
        steps = [round(b - a, 3) for a, b in itertools.pairwise(fires)]
        off = [s for s in steps if s % 2.0]  # a failover may skip fire times, never break the 2 s slots
        report.effects["reschedule"] = f"{moved.job}: {len(fires)} fire times after it, every 2 s" + (
            f" but {off}" if off else "")  # fmt: skip
        if len(fires) < 2 or off:
            report.failures.append(f"rescheduled job {moved.job} did not run on its new 2 s interval: steps {steps[:10]}")


def format_shared_report(report: SharedDrillReport) -> str:
    """The report for people; the last line is the verdict."""
    names = {"kill": "after SIGKILL", "freeze": "after SIGSTOP", "term": "after SIGTERM"}
    lines = [
        f"stores     locks {report.lock_store}; jobs {report.job_store}",
        f"cluster    {report.nodes} nodes, lease {report.lease:g}s, {len(report.jobs)} every-second shared jobs, "
        f"{report.seconds:.0f}s",
        f"runs       {report.runs} runs, (job, fire time) run twice: {len(report.twice)}",
    ]
    for i, strike in enumerate(report.strikes):
        gaps = ", ".join(f"{job.rsplit('-', 1)[-1]} {format_gap(g)}" for job, g in strike.gaps.items()) or "held none"
        lines.append(f"{'failover' if i == 0 else '':<10} {names.get(strike.phase, strike.phase):<14} {strike.node}'s "
                     f"jobs ran elsewhere, after their next fire time by: {gaps}  "
                     f"(limit {report.limit(strike.phase):.1f}s)")  # fmt: skip
    for i, change in enumerate(report.changes):
        worst = max((s for s in change.seen.values() if s is not None), default=None)
        missing = [n for n, s in change.seen.items() if s is None]
        seen = f"on every node within {format_gap(worst)}" if not missing else f"not seen on {', '.join(missing)}"
        lines.append(f"{'changes' if i == 0 else '':<10} {change.what} {change.job.rsplit('-', 1)[-1]}: "
                     f"{_EVENT_NAMES.get(change.event, change.event)} {seen}  (limit {PROPAGATION_LIMIT:g}s)")  # fmt: skip
    if report.resumed:
        gaps = ", ".join(f"{job.rsplit('-', 1)[-1]} {format_gap(g)}" for job, g in report.resumed.items())
        lines.append(f"{'freeze all':<10} every node SIGSTOPped past the lease, then resumed; each job ran again "
                     f"after: {gaps}  (limit {report.resume_limit:.1f}s)")  # fmt: skip
    if report.rolling:
        gaps = ", ".join(f"{job.rsplit('-', 1)[-1]} {format_gap(g)}" for job, g in report.rolling.items())
        lines.append(f"{'rolling':<10} each node replaced by one with a changed jobs file; longest wait between two runs: "
                     f"{gaps}  (limit: the job's interval + {ROLLING_LIMIT:g}s)")  # fmt: skip
    for i, text in enumerate(report.effects.values()):
        lines.append(f"{'effects' if i == 0 else '':<10} {text}")
    lines += closing_lines(report.cleanup, report.logs, report.failures)
    return "\n".join(lines)
