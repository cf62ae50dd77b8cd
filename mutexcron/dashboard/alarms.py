"""The Overview's alarms, from one snapshot (and the jobs file, if given): no store call of their own.

* a store part that could not be read (the store unreachable);
* missed runs: a guarded job's latest fire time older than its misfire grace time and later than
  the last fire time any node claimed (the nodes' own alarm, ``EVENT_RUN_MISSED``, judged here by
  the store's clock); only with the jobs file, which says the schedules;
* nodes that disagree: mutexcron versions, a clock offset over 1 s, a lock whose holder stopped
  renewing; with the jobs file, a holder whose lock record says it runs another jobs file (another
  time zone, lease, or job triggers for the lock: what each holder writes, compared by the nodes'
  own rule, :mod:`mutexcron.guard.agreement`);
* tasks: failed tasks, a backlog that waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..guard.agreement import differences, zone_difference
from ..guard.firetimes import latest_fire_time
from ..locks.record import LockRecord
from ..names import printable
from .jobsfile import JobsFile
from .reads import Snapshot

__all__ = ["Alarm", "alarms"]

#: A node's clock offset beyond this is an alarm (the nodes log a warning at the same threshold).
CLOCK_OFFSET_ALARM = 1.0
#: Seconds the oldest due task may wait before the backlog is an alarm.
TASK_LAG_ALARM = 60.0


@dataclass(frozen=True)
class Alarm:
    """One line of the alarm list: ``level`` is ``error`` or ``warning``; ``kind`` groups them;
    ``link`` is the page it is about (a lock, a job, a task code, a node): a path and its query."""

    level: str
    kind: str
    text: str
    link: tuple[str, dict[str, str]] | None = None


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
                                                      f"no node (last claimed {last:%Y-%m-%d %H:%M:%S} UTC)",
                               ("history", {"lock": job.lock, "job": job.job_id})))  # fmt: skip
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
                                                   "(fire times are judged by each node's clock: check NTP)",
                                   ("", {"node": node.node_id})))  # fmt: skip
    for record in snap.locks or ():
        if record.state == "stale":
            found.append(Alarm("warning", "nodes", f"lock {record.name}: holder {record.holder} stopped renewing "
                                                   f"{record.heartbeat_age or 0:.0f}s ago (lease {record.ttl:g}s)",
                                   ("lock", {"name": record.name})))  # fmt: skip
        if jobs is not None and record.state == "active":
            found += _other_jobs_file(record, jobs)
    return found


def _other_jobs_file(record: LockRecord, jobs: JobsFile) -> list[Alarm]:
    """The lock's holder against the jobs file, by what the holder wrote in the record (its lease,
    zone and jobs' triggers) and the rule the nodes themselves apply (:mod:`mutexcron.guard.agreement`)."""
    if not jobs.of_lock(record.name):
        return []
    here = f"in {jobs.spec}"
    zone = zone_difference(record, jobs.zone_of(record.name), here=here)
    found = differences(record, jobs.lease_of(record.name), jobs.triggers_of(record.name), record.triggers, here=here)
    if zone is None and not found:
        return []
    holder, said = printable(record.holder or "?"), "; ".join([zone, *found] if zone is not None else found)
    text = f"lock {record.name}: its holder {holder} runs another jobs file than {jobs.spec}: {said}"
    link = ("lock", {"name": record.name})
    if zone is not None:  # the nodes running this file refuse the lock's jobs and never take it over
        return [Alarm("error", "nodes", f"{text}. A node with {jobs.spec} runs none of the lock's jobs and does not "
                                        "take the lock over", link)]  # fmt: skip
    return [Alarm("warning", "nodes", f"{text}. The lock's fire times and failover follow whichever node holds it", link)]


def _tasks(snap: Snapshot) -> list[Alarm]:
    found = []
    for summary in snap.tasks or ():
        if summary.failed:
            found.append(Alarm("warning", "tasks", f"code {summary.code}: {summary.failed} failed task"
                                                   f"{'s' if summary.failed != 1 else ''}",
                                   ("tasks", {"code": summary.code, "state": "failed"})))  # fmt: skip
        if summary.oldest_overdue is not None and summary.oldest_overdue > TASK_LAG_ALARM:
            found.append(Alarm("warning", "tasks", f"code {summary.code}: the oldest due task has waited "
                                                   f"{summary.oldest_overdue:.0f}s ({summary.due_now} due now)",
                                   ("tasks", {"code": summary.code, "state": "queued"})))  # fmt: skip
    return found
