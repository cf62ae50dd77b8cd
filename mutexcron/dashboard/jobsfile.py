"""What the dashboard knows from a jobs file (``--jobs jobs.py``): each guarded job's lock, lease,
schedule and misfire grace time. The file is imported, its scheduler never started."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..guard import apscheduler_internals as aps

__all__ = ["JobsFile", "ScheduledJob", "load_jobs_file"]


@dataclass(frozen=True)
class ScheduledJob:
    """A guarded job of the jobs file."""

    job_id: str
    lock: str
    ttl: float
    schedule: str
    trigger: Any
    misfire_grace_time: float | None
    #: The zone its fire times are computed in and its trigger's text, as a holder writes them in
    #: the lock record (None: a job whose fire times depend on no zone; a callable lock).
    zone: str | None = None
    trigger_text: str | None = None

    def next_fire_time(self, now: datetime) -> datetime | None:
        """The job's next fire time after ``now`` (the store's clock), by its schedule."""
        when = self.trigger.get_next_fire_time(None, now)
        return when if isinstance(when, datetime) else None


@dataclass(frozen=True)
class JobsFile:
    """The guarded jobs of one jobs file, its scheduler's lock URL and task codes, and its shared job stores."""

    spec: str
    lock_url: str
    jobs: dict[str, ScheduledJob]
    task_codes: frozenset[str]
    #: The file's scheduler (never started) and its shared job stores, as ``mutexcron jobs`` opens them.
    scheduler: Any = None
    shared: dict[str, Any] = field(default_factory=dict)

    def of_lock(self, lock: str) -> list[ScheduledJob]:
        return [job for job in self.jobs.values() if job.lock == lock]

    def lease_of(self, lock: str) -> float | None:
        """The lease a node running this file renews ``lock`` with (its jobs share one), or None."""
        return next((job.ttl for job in self.of_lock(lock)), None)

    def zone_of(self, lock: str) -> str | None:
        """The zone a node running this file computes ``lock``'s fire times in (what it writes as holder)."""
        return next((job.zone for job in self.of_lock(lock) if job.zone is not None), None)

    def triggers_of(self, lock: str) -> dict[str, str]:
        """``lock``'s jobs and their triggers, as a node running this file writes them as holder."""
        return {job.job_id: job.trigger_text for job in self.of_lock(lock) if job.trigger_text is not None}

    def shared_jobs(self) -> list[dict[str, Any]]:
        """The jobs of the shared job stores, as ``mutexcron jobs list --json`` has them (a read).

        Raises:
            Exception: the store's own error (the caller shows it without the store's URL).
        """
        from ..jobstores.admin import stored_rows

        return stored_rows(self.scheduler, self.shared) if self.shared else []


def load_jobs_file(spec: str) -> JobsFile:
    """Import ``spec`` (as ``mutexcron run`` does) and read its guarded jobs.

    Raises:
        JobsFileError: the file does not import or has no scheduler (the message names the line).
    """
    from ..jobsfile import load_scheduler

    sched: Any = load_scheduler(spec)
    grace_default = aps.job_default(sched, "misfire_grace_time")
    jobs: dict[str, ScheduledJob] = {}
    for job in sched.get_jobs():
        guard = sched.guard_of(job.id)
        if guard is None:
            continue
        # As a running node has it (2 x the lease unless the user set one), not APScheduler's 1 s default.
        grace = sched.misfire_grace_of(job.id) or getattr(job, "misfire_grace_time", grace_default)
        written = not guard.config.callable_lock  # a lock named at run time: no holder writes zone or triggers
        jobs[job.id] = ScheduledJob(job.id, guard.lock, guard.ttl, str(job.trigger), job.trigger, grace,
                                    guard.zone if written else None, guard.trigger_text if written else None)  # fmt: skip
    codes = getattr(getattr(sched, "tasks", None), "codes", None)
    from ..jobstores.admin import shared_stores

    return JobsFile(spec, sched.lock_url, jobs, frozenset(codes()) if callable(codes) else frozenset(), sched,
                    shared_stores(sched))  # fmt: skip
