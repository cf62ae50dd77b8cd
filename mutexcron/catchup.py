"""Catch-up after a change of holder, and the missed-run alarm.

A node that takes a lock over (its heartbeat thread, or a tick) runs each job of the lock once for
the latest fire time missed within its ``misfire_grace_time``. A fire time older than that with
no claim recorded by any node (every node was down, or every run was skipped) raises the
missed-run alarm instead (:data:`~mutexcron.events.EVENT_RUN_MISSED` and one ERROR line), found
from records the node reads anyway: the record before a takeover, and the holder's record that a
standby reads every second. Both walks over the schedule run on one thread of their own, so they
never delay renewals or a job's start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

from apscheduler.executors.base import MaxInstancesReachedError

from . import apscheduler_internals as aps
from .events import EVENT_CAUGHT_UP, EVENT_RUN_MISSED, Emit, MutexEvent, log_event
from .firetimes import latest_fire_time
from .guard import GuardedJob
from .record import LockRecord

log = logging.getLogger(__name__)

#: Seconds between two missed-run checks of one lock's record on a standby.
MISSED_CHECK_EVERY = 5.0


class CatchUp:
    """Catch-up runs for one scheduler.

    Args:
        scheduler: the APScheduler scheduler (``get_job``, ``running``, its executors).
        guarded: returns the guarded jobs by job id.
    """

    def __init__(
        self, scheduler: Any, guarded: Callable[[], Mapping[str, GuardedJob]], emit: Emit = log_event, node_id: str = ""
    ) -> None:
        self.scheduler = scheduler
        self.guarded = guarded
        self.emit, self.node_id = emit, node_id
        self._alarmed: dict[str, datetime] = {}  # job id -> the latest fire time reported missed
        self._last_check: dict[str, float] = {}  # lock -> monotonic time of its last alarm check
        self.started_at = datetime.now(timezone.utc)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mutexcron-catch-up")

    def queue(self, lock: str, before: LockRecord | None) -> None:
        """Called on a change of holder, with the record as it was before the takeover."""
        try:
            self._pool.submit(self.run, lock, before)
        except RuntimeError:  # shut down meanwhile
            pass

    def check_missed(self, lock: str, record: LockRecord | None) -> None:
        """A record of ``lock`` was read (a standby's refresh): look for missed runs, at most every
        :data:`MISSED_CHECK_EVERY` seconds per lock, off the caller's thread."""
        now = time.monotonic()
        if record is None or now - self._last_check.get(lock, -MISSED_CHECK_EVERY) < MISSED_CHECK_EVERY:
            return
        self._last_check[lock] = now
        try:
            self._pool.submit(self._alarm, lock, record)
        except RuntimeError:  # shut down meanwhile
            pass

    def _alarm(self, lock: str, record: LockRecord | None) -> None:
        """Report each job of ``lock`` whose latest fire time older than its grace time has no claim."""
        if record is None or getattr(record, "paused", False) or not self.scheduler.running:
            return
        now = datetime.now(timezone.utc)
        for job_id, guard in list(self.guarded().items()):
            job = self.scheduler.get_job(job_id) if guard.lock == lock else None
            last = record.fire_times.get(job_id)
            if job is None or last is None or job.misfire_grace_time is None:
                continue  # never claimed: nothing to compare with
            horizon = now - timedelta(seconds=job.misfire_grace_time)
            after = max(last, self._alarmed.get(job_id, last))
            if record.paused_at is not None:  # fire times skipped while paused were not missed
                after = max(after, record.paused_at)
            missed = latest_fire_time(job.trigger, after, horizon, after=after)
            if missed is None:
                continue
            self._alarmed[job_id] = missed
            self.emit(MutexEvent(EVENT_RUN_MISSED, lock=lock, job_id=job_id, node=self.node_id, fire_time=missed,
                                 last_claimed=last))  # fmt: skip

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, lock: str, before: LockRecord | None) -> None:
        """Only fire times after this scheduler started, after the job's last claimed fire time and
        within its ``misfire_grace_time`` count; the claim in the store still decides."""
        if not self.scheduler.running:
            return
        self._alarm(lock, before)
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
            self.emit(MutexEvent(EVENT_CAUGHT_UP, lock=lock, job_id=job_id, node=self.node_id, fire_time=missed))
            try:
                aps.lookup_executor(self.scheduler, job.executor).submit_job(job, [missed])
            except MaxInstancesReachedError:
                log.info("job %r still running; no catch-up", job_id)

    def _missed(self, job: Any, now: datetime, last: datetime | None) -> datetime | None:
        floor = self.started_at
        if job.misfire_grace_time is not None:
            floor = max(floor, now - timedelta(seconds=job.misfire_grace_time))
        return latest_fire_time(job.trigger, floor, now, after=last)
