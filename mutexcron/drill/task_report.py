"""The task drill's report: what it measured, its limits, its JSON form and its text for people."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .report import TERM_LIMIT, closing_lines, format_gap

#: Seconds allowed on top of lease + 1 s for a task to restart after SIGKILL or SIGSTOP: the
#: other nodes' wake-up (a notice, or a poll) and their claim round trip.
RECOVERY_SLACK = 0.5

#: The most lost, double-run... keys listed in a report (the counts are always whole).
LISTED = 10


@dataclass
class TaskPhase:
    """One fault and what followed it.

    Attributes:
        phase: ``kill``, ``freeze`` or ``term``.
        node: the node signalled.
        at: when (the drill's ``time.monotonic()``); ``until``: SIGCONT, for a freeze.
        in_flight: kill/freeze: the tasks the node had claimed and not finished; term: the claimed
            tasks that had not started (held by the drill, see :mod:`~mutexcron.drill.task_node_side`).
        recovery: seconds until the last of them started on another node (None: one never did);
            kill/freeze: of those whose handler was running (the claims ahead wait for free threads).
        restarted_on: the nodes that ran them again.
        handed_back: term: how many the node handed back on its way out.
        unconfirmed: kill: tasks the node finished, then died while recording it (gone from the store).
        claims_ahead: kill/freeze: claims the node held that had not started (a burst of tasks
            just before the fault fills its threads and its queue).
        note: why the phase could not be measured, if so.
    """

    phase: str
    node: str
    at: float
    until: float | None = None
    in_flight: list[str] = field(default_factory=list)
    recovery: float | None = None
    restarted_on: list[str] = field(default_factory=list)
    handed_back: int | None = None
    unconfirmed: list[str] = field(default_factory=list)
    claims_ahead: int = 0
    note: str = ""


@dataclass
class DoubleRun:
    """A task started by more than one attempt (token), and what became of the stale ones.

    ``stale`` per stale token: ``refused`` (its completion was refused by the store),
    ``killed`` (its node was killed: it never completed), ``not completed``, or ``recorded``
    (the store took a stale attempt's completion: a FAIL).
    """

    key: str
    tokens: list[int]
    nodes: list[str]
    recorded_token: int | None
    stale: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "tokens": self.tokens,
            "nodes": self.nodes,
            "recorded_token": self.recorded_token,
            "stale": {str(k): v for k, v in self.stale.items()},
        }


@dataclass
class TaskDrillReport:
    """What a task drill measured."""

    nodes: int
    lease: float
    rate: float
    store: str = ""
    code: str = ""
    seconds: float = 0.0
    added: int = 0
    add_errors: int = 0
    completed: int = 0
    lost: list[str] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)
    double_runs: list[DoubleRun] = field(default_factory=list)
    stale_recorded: list[str] = field(default_factory=list)
    completed_twice: list[str] = field(default_factory=list)
    #: tasks a handler started with an attempt number above its earlier starts + 1: a claim that
    #: never reached a handler cost an attempt (what fails tasks that never ran)
    charged_unstarted: list[str] = field(default_factory=list)
    refused: int = 0
    refused_logged: int = 0
    lag: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, TaskPhase] = field(default_factory=dict)
    latency: dict[str, Any] = field(default_factory=dict)
    left_in_store: dict[str, int] = field(default_factory=dict)
    cleanup: str = ""
    #: Where the nodes' logs and records were kept because the drill did not pass ("" if removed).
    logs: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def limit(self, phase: str) -> float:
        """How soon the fault's tasks must start on another node: lease + 1 s + slack, 1.5 s after SIGTERM."""
        return TERM_LIMIT if phase == "term" else self.lease + 1.0 + RECOVERY_SLACK

    def stale_counts(self) -> dict[str, int]:
        counts = {"refused": 0, "killed": 0, "not completed": 0, "recorded": 0}
        for run in self.double_runs:
            for outcome in run.stale.values():
                counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    def to_json(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 3) + 0.0  # + 0.0: no "-0.0"

        return {
            "verdict": "PASS" if self.passed else "FAIL",
            "failures": self.failures,
            "mode": "tasks",
            "store": self.store,
            "task_code": self.code,
            "nodes": self.nodes,
            "lease": self.lease,
            "rate": self.rate,
            "seconds": round(self.seconds, 1),
            "tasks": {
                "added": self.added,
                "completed": self.completed,
                "lost": len(self.lost),
                "unconfirmed": len(self.unconfirmed),
                "run_twice": len(self.double_runs),
                "stale": self.stale_counts(),
                "completed_twice": len(self.completed_twice),
                "attempts_lost_to_unstarted_claims": len(self.charged_unstarted),
                "refused_completions": self.refused,
                "refused_logged": self.refused_logged,
                "add_errors": self.add_errors,
                "left_in_store": self.left_in_store,
            },
            "lost_keys": self.lost[:LISTED],
            "run_twice": [d.to_json() for d in self.double_runs[:LISTED]],
            "lag_seconds": {k: (r(v) if isinstance(v, float) else v) for k, v in self.lag.items()},
            "recovery_seconds": {k: r(p.recovery) for k, p in self.phases.items()},
            "recovery_lease_multiple": {
                k: None if p.recovery is None else round(p.recovery / self.lease, 2) for k, p in self.phases.items()
            },
            "limits_seconds": {k: self.limit(k) for k in self.phases},
            "phases": {
                k: {
                    "node": p.node,
                    "in_flight": p.in_flight[:LISTED],
                    "restarted_on": p.restarted_on,
                    "handed_back": p.handed_back,
                    "unconfirmed": p.unconfirmed,
                    "claims_ahead": p.claims_ahead,
                    "note": p.note,
                }
                for k, p in self.phases.items()
            },
            "store_latency_ms": self.latency,
            "cleanup": self.cleanup,
            "logs": self.logs,
        }


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:LISTED])
    return shown + (f" (+{len(keys) - LISTED} more)" if len(keys) > LISTED else "")


def format_task_report(report: TaskDrillReport) -> str:
    """The task drill's report for people; the last line is the verdict."""
    stale = report.stale_counts()
    lines = [
        f"store      {report.store}  ({report.nodes} nodes, task lease {report.lease:g}s, {report.rate:g} tasks/s, "
        f"{report.seconds:.0f}s, task code {report.code})",
        f"tasks      added {report.added}  completed {report.completed}  lost {len(report.lost)}  "
        f"run twice {len(report.double_runs)}" + (f"  unconfirmed {len(report.unconfirmed)}" if report.unconfirmed else ""),
    ]
    if report.double_runs:
        lines.append(
            f"run twice  stale attempts: completion refused {stale['refused']}, killed before completing {stale['killed']}, "
            f"not completed {stale['not completed']}, recorded {stale['recorded']}  "
            f"({report.refused_logged} 'completion refused' lines in the node logs)"
        )
    if report.lost:
        lines.append(f"lost       {_listed(report.lost)}")
    lines.append(f"attempts   lost to claims that never ran: {len(report.charged_unstarted)}")
    lag = report.lag
    if lag.get("tasks"):
        lines.append(
            f"lag        start - due p50 {lag['p50']:.3f}s  p99 {lag['p99']:.3f}s  max {lag['max']:.3f}s  "
            f"({lag['tasks']} tasks no fault touched; store clock)"
        )
    lines += _phase_lines(report)
    lat = report.latency
    if lat.get("calls"):
        lines.append(
            f"latency    store round trip p50 {lat['p50']:.2f} ms  p99 {lat['p99']:.2f} ms  "
            f"({lat['calls']} task operations timed in the nodes)"
        )
    lines += closing_lines(report.cleanup, report.logs, report.failures)
    return "\n".join(lines)


def _phase_lines(report: TaskDrillReport) -> list[str]:
    names = {"kill": "after SIGKILL", "freeze": "after SIGSTOP", "term": "after SIGTERM"}
    lines = []
    for i, (phase, p) in enumerate(report.phases.items()):
        head = f"{'recovery' if i == 0 else '':<10} {names.get(phase, phase):<14} "
        if p.note:
            lines.append(head + p.note)
            continue
        what = "unstarted claim(s)" if phase == "term" else "in-flight task(s)"
        back = f", {p.handed_back} handed back" if p.handed_back is not None else ""
        back += f" ({p.claims_ahead} claimed ahead, not started)" if p.claims_ahead else ""
        where = f" on {', '.join(p.restarted_on)}" if p.restarted_on else ""
        multiple = "" if p.recovery is None else f" ({p.recovery / report.lease:.2f} x lease)"
        lines.append(
            f"{head}{len(p.in_flight)} {what} of {p.node}{back}; started again{where} after "
            f"{format_gap(p.recovery)}{multiple}  (limit {report.limit(phase):.1f}s)"
        )
    return lines
