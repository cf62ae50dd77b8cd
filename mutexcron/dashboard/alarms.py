"""The Overview's alarms, from one snapshot (and the jobs file, if given): no store call of their own.

* a store part that could not be read (the store unreachable);
* missed runs: a guarded job's latest fire time older than its misfire grace time and later than
  the last fire time any node claimed (the nodes' own alarm, ``EVENT_RUN_MISSED``, judged here by
  the store's clock); only with the jobs file, which says the schedules;
* nodes that disagree: mutexcron versions, a clock offset over 1 s, a holder renewing a lease the
  jobs file does not ask for, a lock whose holder stopped renewing;
* tasks: failed tasks, a backlog that waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..guard.firetimes import latest_fire_time
from .jobsfile import JobsFile
from .reads import Snapshot

__all__ = ["Alarm", "alarms"]

#: A node's clock offset beyond this is an alarm (the nodes log a warning at the same threshold).
CLOCK_OFFSET_ALARM = 1.0
#: Seconds the oldest due task may wait before the backlog is an alarm.
TASK_LAG_ALARM = 60.0


@dataclass(frozen=True)
class Alarm:
    """One line of the alarm list: ``level`` is ``error`` or ``warning``; ``kind`` groups them."""

    level: str
    kind: str
    text: str


def alarms(snap: Snapshot, jobs: JobsFile | None) -> list[Alarm]:
    found = [Alarm("error", "store", f"{part}: {error}") for part, error in snap.errors.items()]
    found += _missed_runs(snap, jobs)
    found += _disagreements(snap, jobs)
    found += _tasks(snap)
    return found


def _missed_runs(snap: Snapshot, jobs: JobsFile | None) -> list[Alarm]:
    if jobs is None or snap.locks is None:
        return []
    found = []
    for job in jobs.jobs.values():
        record = snap.lock(job.lock)
        last = record.fire_times.get(job.job_id) if record is not None else None
        if record is None or last is None or record.paused or job.misfire_grace_time is None:
            continue  # never claimed: nothing to compare with; paused: skipped on purpose
        after = max(last, record.paused_at) if record.paused_at is not None else last
        horizon = snap.now - timedelta(seconds=job.misfire_grace_time)
        missed = latest_fire_time(job.trigger, after, horizon, after=after)
        if missed is not None:
            found.append(Alarm("error", "missed-run", f"job {job.job_id}: fire time {missed:%Y-%m-%d %H:%M:%S} UTC ran on "
                                                      f"no node (last claimed {last:%Y-%m-%d %H:%M:%S} UTC)"))  # fmt: skip
    return found


def _disagreements(snap: Snapshot, jobs: JobsFile | None) -> list[Alarm]:
    found = []
    live = [n for n in snap.nodes or () if snap.live(n)]
    versions = sorted({n.version or "?" for n in live})
    if len(versions) > 1:
        found.append(Alarm("warning", "nodes", f"nodes run different mutexcron versions: {', '.join(versions)}"))
    for node in live:
        if node.clock_offset is not None and abs(node.clock_offset) > CLOCK_OFFSET_ALARM:
            found.append(Alarm("warning", "nodes", f"node {node.node_id}: clock {node.clock_offset:+.3f}s off the store's "
                                                   "(fire times are judged by each node's clock: check NTP)"))  # fmt: skip
    for record in snap.locks or ():
        if record.state == "stale":
            found.append(Alarm("warning", "nodes", f"lock {record.name}: holder {record.holder} stopped renewing "
                                                   f"{record.heartbeat_age or 0:.0f}s ago (lease {record.ttl:g}s)"))  # fmt: skip
        wanted = {job.ttl for job in jobs.of_lock(record.name)} if jobs is not None else set()
        if record.state == "active" and wanted and record.ttl not in wanted:
            asked = ", ".join(f"{t:g}s" for t in sorted(wanted))
            found.append(Alarm("warning", "nodes", f"lock {record.name}: holder {record.holder} renews a lease of "
                                                   f"{record.ttl:g}s; {jobs.spec if jobs else '-'} asks {asked}"))  # fmt: skip
    return found


def _tasks(snap: Snapshot) -> list[Alarm]:
    found = []
    for summary in snap.tasks or ():
        if summary.failed:
            found.append(Alarm("warning", "tasks", f"code {summary.code}: {summary.failed} failed task"
                                                   f"{'s' if summary.failed != 1 else ''} (see the Tasks page)"))  # fmt: skip
        if summary.oldest_overdue is not None and summary.oldest_overdue > TASK_LAG_ALARM:
            found.append(Alarm("warning", "tasks", f"code {summary.code}: the oldest due task has waited "
                                                   f"{summary.oldest_overdue:.0f}s ({summary.due_now} due now)"))  # fmt: skip
    return found
