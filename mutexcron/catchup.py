"""Catch-up after a change of holder: run each job of the lock once for the latest fire time missed.

A node that takes a lock over (its heartbeat thread, or a tick) hands the work to one thread of
its own, so the walk over the schedule never delays renewals or a job's start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

from apscheduler.executors.base import MaxInstancesReachedError

from . import apscheduler_internals as aps
from .firetimes import latest_fire_time
from .guard import GuardedJob
from .record import LockRecord

log = logging.getLogger(__name__)


class CatchUp:
    """Catch-up runs for one scheduler.

    Args:
        scheduler: the APScheduler scheduler (``get_job``, ``running``, its executors).
        guarded: returns the guarded jobs by job id.
    """

    def __init__(self, scheduler: Any, guarded: Callable[[], Mapping[str, GuardedJob]]) -> None:
        self.scheduler = scheduler
        self.guarded = guarded
        self.started_at = datetime.now(timezone.utc)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mutexcron-catch-up")

    def queue(self, lock: str, before: LockRecord | None) -> None:
        """Called on a change of holder, with the record as it was before the takeover."""
        try:
            self._pool.submit(self.run, lock, before)
        except RuntimeError:  # shut down meanwhile
            pass

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, lock: str, before: LockRecord | None) -> None:
        """Only fire times after this scheduler started, after the job's last claimed fire time and
        within its ``misfire_grace_time`` count; the claim in the store still decides."""
        if not self.scheduler.running:
            return
        now = datetime.now(timezone.utc)
        for job_id, guard in list(self.guarded().items()):
            if guard.lock != lock:
                continue
            job = self.scheduler.get_job(job_id)
            if job is None or job.next_run_time is None:
                continue
            missed = self._missed(job, now, before.fire_times.get(guard.job_id) if before is not None else None)
            if missed is None:
                continue
            log.warning("job %r: catching up fire time %s missed during the failover of lock %r", job_id, missed, lock)
            try:
                aps.lookup_executor(self.scheduler, job.executor).submit_job(job, [missed])
            except MaxInstancesReachedError:
                log.info("job %r still running; no catch-up", job_id)

    def _missed(self, job: Any, now: datetime, last: datetime | None) -> datetime | None:
        floor = self.started_at
        if job.misfire_grace_time is not None:
            floor = max(floor, now - timedelta(seconds=job.misfire_grace_time))
        return latest_fire_time(job.trigger, floor, now, after=last)
