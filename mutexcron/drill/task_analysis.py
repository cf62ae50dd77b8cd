"""The task drill's figures from what the nodes recorded: lost and double-run tasks, lag, recovery, verdict."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .analysis import _latency, percentile
from .records import NodeOps
from .report import PhaseMark
from .task_report import DoubleRun, TaskDrillReport, TaskPhase

#: The worker's warning for a fenced completion the store refused (``mutexcron.tasks.worker``).
REFUSED_LINE = re.compile(r"task (?P<code>\S+)/(?P<key>\S+) \(token (?P<token>\d+)\): completion refused")


def read_task_events(workdir: Path, node: str | None = None) -> list[dict[str, Any]]:
    """Every event of every node's ``<node>.tasks.jsonl`` in ``workdir`` (or ``node``'s), each with its ``node``."""
    events: list[dict[str, Any]] = []
    for path in sorted(workdir.glob(f"{node or '*'}.tasks.jsonl")):
        owner = path.name[: -len(".tasks.jsonl")]
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a half-written last line
            if isinstance(obj, dict) and "event" in obj:
                obj["node"] = owner
                events.append(obj)
    return events


def read_refused_lines(workdir: Path, code: str) -> set[tuple[str, int]]:
    """``(key, token)`` of every "completion refused" warning in the nodes' logs for ``code``."""
    found: set[tuple[str, int]] = set()
    for path in sorted(workdir.glob("*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for match in REFUSED_LINE.finditer(text):
            if match["code"] == code:
                found.add((match["key"], int(match["token"])))
    return found


@dataclass
class Ledger:
    """The nodes' events by task key."""

    claims: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # each: node, token, attempt, sent, mono
    starts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    ends: set[tuple[str, str, int]] = field(default_factory=set)  # (node, key, token)
    completes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    releases: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # each: node, token, sent, mono
    held: list[dict[str, Any]] = field(default_factory=list)  # the "held" events
    release_events: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, events: Iterable[Mapping[str, Any]]) -> Ledger:
        ledger = cls()
        for e in events:
            kind, node = e.get("event"), e.get("node", "")
            if kind == "claim":
                for key, token, attempt in e["tasks"]:
                    ledger.claims.setdefault(key, []).append(
                        {"node": node, "token": token, "attempt": attempt, "sent": e["sent"], "mono": e["mono"]}
                    )
            elif kind == "start":
                ledger.starts.setdefault(e["key"], []).append(dict(e))
            elif kind == "end":
                ledger.ends.add((node, e["key"], e["token"]))
            elif kind == "complete":
                ledger.completes.setdefault(e["key"], []).append(dict(e))
            elif kind == "release":
                ledger.release_events.append(dict(e))
                for key, token in e["tasks"]:
                    ledger.releases.setdefault(key, []).append(
                        {"node": node, "token": token, "sent": e["sent"], "mono": e["mono"]}
                    )
            elif kind == "held":
                ledger.held.append(dict(e))
        for items in (*ledger.claims.values(), *ledger.starts.values(), *ledger.completes.values()):
            items.sort(key=lambda x: float(x["mono"]))
        return ledger

    def completed(self) -> set[str]:
        """Keys whose attempt's Done the store recorded."""
        return {k for k, cs in self.completes.items() if any(c["ok"] and c["outcome"] == "Done" for c in cs)}

    def running_handlers(self, node: str, now: float) -> list[tuple[str, float]]:
        """``(key, seconds left)`` of the handlers running on ``node`` at ``now``, by their sleep."""
        out = []
        for key, starts in self.starts.items():
            for s in starts:
                if s["node"] == node and (node, key, s["token"]) not in self.ends and float(s["mono"]) <= now:
                    out.append((key, float(s["mono"]) + float(s["sleep"]) - now))
        return out

    def in_flight(self, node: str, at: float) -> list[str]:
        """Tasks ``node`` held at ``at``: its claim is the last one sent before ``at``, and it had not
        recorded the task's outcome nor handed it back before ``at``."""
        keys = []
        for key, claims in self.claims.items():
            before = [c for c in claims if float(c["sent"]) < at]
            if not before:
                continue
            last = max(before, key=lambda c: float(c["sent"]))
            if last["node"] != node:
                continue
            token = last["token"]
            done = any(
                c["node"] == node and c["token"] == token and c["ok"] and float(c["sent"]) < at
                for c in self.completes.get(key, [])
            )
            released = any(
                r["node"] == node and r["token"] == token and float(r["sent"]) < at for r in self.releases.get(key, [])
            )
            if not done and not released:
                keys.append(key)
        return sorted(keys)

    def unstarted(self, node: str, at: float) -> list[str]:
        """Of the tasks ``node`` held at ``at`` (:meth:`in_flight`), those whose claim had not started."""
        out = []
        for key in self.in_flight(node, at):
            last = max((c for c in self.claims[key] if float(c["sent"]) < at), key=lambda c: float(c["sent"]))
            started = (s for s in self.starts.get(key, []) if s["node"] == node and float(s["mono"]) < at)
            if not any(s["token"] == last["token"] for s in started):
                out.append(key)
        return out

    def restart(self, key: str, not_node: str, after: float) -> dict[str, Any] | None:
        """The first start of ``key`` on another node than ``not_node`` after ``after``."""
        for s in self.starts.get(key, []):
            if s["node"] != not_node and float(s["mono"]) > after:
                return s
        return None


def recovery(ledger: Ledger, keys: list[str], node: str, at: float) -> tuple[float | None, list[str], list[str]]:
    """Seconds from ``at`` until the last of ``keys`` started on another node; the nodes; the keys that never did."""
    worst: float | None = 0.0
    nodes: set[str] = set()
    missing = []
    for key in keys:
        start = ledger.restart(key, node, at)
        if start is None:
            missing.append(key)
            continue
        nodes.add(start["node"])
        worst = max(worst or 0.0, float(start["mono"]) - at)
    if missing or not keys:
        worst = None
    return worst, sorted(nodes), missing


def analyse_tasks(
    report: TaskDrillReport,
    events: list[dict[str, Any]],
    added: Iterable[str],
    *,
    ops: NodeOps,
    refused_lines: set[tuple[str, int]],
    left_in_store: Mapping[str, str],
    measure_from: float,
) -> TaskDrillReport:
    """Count lost and double-run tasks, lag and latency; judge the phases (already marked); add the failures.

    Args:
        report: the report to fill (``phases`` already set by the drill, with ``in_flight`` and ``node``).
        events: every node's events.
        added: the keys the drill added (and whose add did not fail).
        ops: the nodes' timing files.
        refused_lines: ``(key, token)`` of the "completion refused" lines in the node logs.
        left_in_store: key -> state of the drill's tasks still in the store after the drain.
        measure_from: the drill's ``time.monotonic()`` when the warm-up ended: lag counts tasks
            started from then on.
    """
    ledger = Ledger.of(events)
    added_keys = set(added) | set(ledger.starts)  # an add whose reply was lost may still have landed
    completed = ledger.completed()
    killed = {p.node for p in report.phases.values() if p.phase == "kill"}
    report.added = len(added_keys)
    report.completed = len(completed & added_keys)
    report.left_in_store = {}
    for state in left_in_store.values():
        report.left_in_store[state] = report.left_in_store.get(state, 0) + 1
    report.unconfirmed = sorted(_unconfirmed(ledger, added_keys - completed, killed, left_in_store))
    report.lost = sorted(added_keys - completed - set(report.unconfirmed))
    _check_attempts(report, ledger, killed, refused_lines)
    report.charged_unstarted = _charged_unstarted(ledger)
    report.lag = _lag(ledger, measure_from)
    marks = [PhaseMark(p.phase, p.node, p.at, p.until) for p in report.phases.values()]
    report.latency = _latency(ops.samples, marks)
    for phase in report.phases.values():
        _judge_phase(report, ledger, phase, set(report.unconfirmed))
    _verdict(report, left_in_store)
    return report


def _unconfirmed(ledger: Ledger, missing: set[str], killed: set[str], left: Mapping[str, str]) -> set[str]:
    """Tasks a killed node ran to the end and then died while recording: gone from the store, so done."""
    out = set()
    for key in missing:
        if key in left:
            continue
        starts = ledger.starts.get(key, [])
        if starts and starts[-1]["node"] in killed and (starts[-1]["node"], key, starts[-1]["token"]) in ledger.ends:
            out.add(key)
    return out


def _check_attempts(report: TaskDrillReport, ledger: Ledger, killed: set[str], refused_lines: set[tuple[str, int]]) -> None:
    """Double runs and their stale attempts; a recorded outcome must come from the newest attempt."""
    for key in sorted(ledger.starts):
        starts = ledger.starts[key]
        tokens = sorted({int(s["token"]) for s in starts})
        newest = tokens[-1]
        recorded = [c for c in ledger.completes.get(key, []) if c["ok"]]
        if len(recorded) > 1:
            report.completed_twice.append(key)
        if any(int(c["token"]) < newest for c in recorded):
            report.stale_recorded.append(key)
        for c in ledger.completes.get(key, []):
            if not c["ok"]:
                report.refused += 1
                report.refused_logged += (key, int(c["token"])) in refused_lines
        if len(tokens) < 2:
            continue
        run = DoubleRun(
            key,
            tokens,
            [s["node"] for s in starts],
            int(recorded[-1]["token"]) if recorded else None,
        )
        for token in tokens[:-1]:
            mine = [c for c in ledger.completes.get(key, []) if int(c["token"]) == token]
            node = next(s["node"] for s in starts if int(s["token"]) == token)
            if any(c["ok"] for c in mine):
                run.stale[token] = "recorded"
            elif mine:
                run.stale[token] = "refused"
            else:
                run.stale[token] = "killed" if node in killed else "not completed"
        report.double_runs.append(run)


def _charged_unstarted(ledger: Ledger) -> list[str]:
    """Tasks a handler started with an attempt above its earlier starts + 1: an attempt was counted
    for a claim that never reached a handler (held ahead by a node killed or frozen, handed back)."""
    charged = []
    for key, starts in sorted(ledger.starts.items()):
        tokens = sorted({int(s["token"]) for s in starts})
        attempts = {int(s["token"]): int(s["attempt"]) for s in starts}
        if any(attempts[token] > i + 1 for i, token in enumerate(tokens)):
            charged.append(key)
    return charged


def _lag(ledger: Ledger, measure_from: float) -> dict[str, Any]:
    """Start minus due (store clock) of the tasks no fault touched: one claim, one start, attempt 1, never handed back."""
    lags = []
    for key, starts in ledger.starts.items():
        claims = ledger.claims.get(key, [])
        if len(starts) != 1 or len(claims) != 1 or key in ledger.releases or int(starts[0]["attempt"]) != 1:
            continue
        if float(starts[0]["mono"]) < measure_from:
            continue  # started while the nodes were still starting up
        lags.append(float(starts[0]["at"]) - float(starts[0]["due"]))
    if not lags:
        return {"tasks": 0, "p50": None, "p99": None, "max": None}
    return {"tasks": len(lags), "p50": percentile(lags, 50), "p99": percentile(lags, 99), "max": max(lags)}


def _judge_phase(report: TaskDrillReport, ledger: Ledger, phase: TaskPhase, unconfirmed: set[str]) -> None:
    if phase.note:
        return
    ahead: set[str] = set()
    if phase.phase == "term":
        held = [e for e in ledger.held if e["node"] == phase.node and float(e["mono"]) <= phase.at]
        phase.in_flight = sorted(k for k, _t in held[-1]["tasks"]) if held else []
        tokens = {(k, t) for k, t in held[-1]["tasks"]} if held else set()
        phase.handed_back = sum(
            min(int(e["count"]), len(tokens & {(k, t) for k, t in e["tasks"]}))
            for e in ledger.release_events
            if e["node"] == phase.node
        )
    else:
        phase.in_flight = ledger.in_flight(phase.node, phase.at)
        ahead = set(ledger.unstarted(phase.node, phase.at))
        phase.claims_ahead = len(ahead)
        phase.unconfirmed = [k for k in phase.in_flight if k in unconfirmed]
    # Recovery is timed on the handlers that were running: the claims ahead wait for the other
    # nodes' free threads too (they must run, and cost no attempt: see _charged_unstarted).
    keys = [k for k in phase.in_flight if k not in phase.unconfirmed and (phase.phase == "term" or k not in ahead)]
    phase.recovery, phase.restarted_on, _missing = recovery(ledger, keys, phase.node, phase.at)
    if not phase.in_flight:
        phase.note = (
            f"{phase.node} had no claimed task left unstarted at SIGTERM: the hand-back was not exercised"
            if phase.phase == "term"
            else f"{phase.node} had no task in flight at the {phase.phase}: recovery not measured"
        )


def _verdict(report: TaskDrillReport, left_in_store: Mapping[str, str]) -> None:
    f = report.failures
    if report.lost:
        states = (
            f" ({', '.join(f'{n} {s}' for s, n in sorted(report.left_in_store.items()))} still in the store)"
            if left_in_store
            else ""
        )
        f.append(f"{len(report.lost)} task(s) added and never completed{states}: {', '.join(report.lost[:5])}")
    if report.stale_recorded:
        f.append(
            f"{len(report.stale_recorded)} task(s) recorded the outcome of a stale attempt (not the newest token): "
            + ", ".join(report.stale_recorded[:5])
        )
    if report.completed_twice:
        f.append(f"{len(report.completed_twice)} task(s) had two completions recorded: {', '.join(report.completed_twice[:5])}")
    if report.charged_unstarted:
        f.append(
            f"{len(report.charged_unstarted)} task(s) had an attempt counted for a claim that never reached a handler: "
            + ", ".join(report.charged_unstarted[:5])
        )
    names = {"kill": "SIGKILL", "freeze": "SIGSTOP", "term": "SIGTERM"}
    for name, phase in report.phases.items():
        what = f"after {names.get(name, name)}"
        if phase.note:
            f.append(f"{what}: {phase.note}")
            continue
        limit = report.limit(name)
        if phase.recovery is None or phase.recovery > limit:
            f.append(
                f"{what}: the {'handed-back' if name == 'term' else 'in-flight'} task(s) of {phase.node} started again "
                f"on another node after {'never (timed out)' if phase.recovery is None else f'{phase.recovery:.2f}s'} "
                f"(limit {limit:.1f}s)"
            )
        if name == "term" and phase.handed_back is not None and phase.handed_back < len(phase.in_flight):
            f.append(
                f"after SIGTERM: {phase.node} handed back {phase.handed_back} of its {len(phase.in_flight)} unstarted claim(s)"
            )
