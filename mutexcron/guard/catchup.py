"""Catch-up after a change of holder, and the missed-run alarm.

A node that takes a lock over (its heartbeat thread, or a tick) runs each job of the lock once for
the latest fire time missed within its ``misfire_grace_time``. A fire time older than that with
no claim recorded by any node (every node was down, or every run was skipped) raises the
missed-run alarm instead (:data:`~mutexcron.events.EVENT_RUN_MISSED` and one ERROR line), found
from records the node reads anyway: the record before a takeover, and the holder's record that a
standby reads every second. Both walks over the schedule run on one thread of their own, so they
never delay renewals or a job's start.

A shared job store's job, whose stored next run time is the cluster's, is caught up only after a
hand-over, and only for a fire time that stored time was moved past without a run
(:func:`~mutexcron.guard.firetimes.passed_fire_time`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

from apscheduler.executors.base import MaxInstancesReachedError

from ..events import EVENT_CAUGHT_UP, EVENT_RUN_MISSED, Emit, MutexEvent, log_event
from ..locks.record import LockRecord
from . import apscheduler_internals as aps
from .firetimes import latest_fire_time, passed_fire_time, slot_of
from .job import GuardedJob

log = logging.getLogger(__name__)

#: Seconds between two missed-run checks of one lock's record on a standby.
MISSED_CHECK_EVERY = 5.0
#: Seconds a takeover's catch-up waits for the scheduler to run: the heartbeat starts (and may take
#: a lock over) before APScheduler's start() marks the scheduler running.
START_WAIT = 30.0


class CatchUp:
    """Catch-up runs for one scheduler.

    Args:
        scheduler: the APScheduler scheduler (``get_job``, ``running``, its executors).
        guarded: returns the guarded jobs by job id.
        skip: True for a job whose missed fire times are caught up otherwise (a shared job store's: its loop).
        skip_handed: the same after a hand-over to this node: a shared job's loop on the giver may
            have moved its stored next run time past a fire time it then did not run (a run that
            began while the lock was being handed over), so only ``skip_handed`` jobs are skipped.
        stored: True for a job whose stored next run time decides its fire times (a shared job
            store's): only a fire time on its own sequence, before that stored time, is caught up.
        clock: the time now (UTC); tests inject one.
    """

    def __init__(
        self,
        scheduler: Any,
        guarded: Callable[[], Mapping[str, GuardedJob]],
        emit: Emit = log_event,
        node_id: str = "",
        skip: Callable[[str], bool] = lambda _job_id: False,
        skip_handed: Callable[[str], bool] | None = None,
        stored: Callable[[str], bool] = lambda _job_id: False,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        self.scheduler = scheduler
        self.guarded = guarded
        self.skip = skip
        self.skip_handed = skip_handed or skip
        self.stored = stored
        self.clock = clock
        self.emit, self.node_id = emit, node_id
        self._alarmed: dict[str, datetime] = {}  # job id -> the latest fire time reported missed
        self._last_check: dict[str, float] = {}  # lock -> monotonic time of its last alarm check
        self._pending: dict[str, LockRecord] = {}  # records read, waiting for the alarm check
        self._pending_lock = threading.Lock()
        self.started_at = datetime.now(timezone.utc)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mutexcron-catch-up")
        self._stopped = False

    def queue(self, lock: str, before: LockRecord | None, *, handed: bool = False) -> None:
        """Called on a change of holder, with the record as it was before the takeover (``handed``:
        the lock was handed over to this node)."""
        try:
            self._pool.submit(self.run, lock, before, handed=handed)
        except RuntimeError:  # shut down meanwhile
            pass

    def check_missed(self, lock: str, record: LockRecord | None) -> None:
        """A record of ``lock`` was read (a standby's refresh): look for missed runs, at most every
        :data:`MISSED_CHECK_EVERY` seconds per lock, off the caller's thread (the records of one
        refresh are checked together, in one task)."""
        now = time.monotonic()
        if record is None or now - self._last_check.get(lock, -MISSED_CHECK_EVERY) < MISSED_CHECK_EVERY:
            return
        self._last_check[lock] = now
        with self._pending_lock:
            first = not self._pending
            self._pending[lock] = record
        if not first:
            return  # the task already queued checks this one too
        try:
            self._pool.submit(self._check_pending)
        except RuntimeError:  # shut down meanwhile
            pass

    def _check_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        jobs = self._jobs_by_lock(set(pending))
        for lock, record in pending.items():
            self._alarm(lock, record, jobs.get(lock, []))

    def _jobs_by_lock(self, locks: set[str]) -> dict[str, list[str]]:
        """The job ids of each of ``locks``, from one pass over the guarded jobs."""
        jobs: dict[str, list[str]] = {}
        for job_id, guard in list(self.guarded().items()):
            if guard.lock in locks:
                jobs.setdefault(guard.lock, []).append(job_id)
        return jobs

    def _alarm(self, lock: str, record: LockRecord | None, job_ids: list[str] | None = None) -> None:
        """Report each job of ``lock`` (``job_ids``; found here if None) whose latest fire time older
        than its grace time has no claim."""
        if record is None or getattr(record, "paused", False) or not self.scheduler.running:
            return
        now = self.clock()
        for job_id in self._jobs_by_lock({lock}).get(lock, []) if job_ids is None else job_ids:
            last = record.fire_times.get(job_id)
            job = self.scheduler.get_job(job_id) if last is not None else None
            if job is None or last is None or job.misfire_grace_time is None:
                continue  # never claimed: nothing to compare with
            horizon = now - timedelta(seconds=job.misfire_grace_time)
            after = max(last, self._alarmed.get(job_id, last))
            if record.paused_at is not None:  # fire times skipped while paused were not missed
                after = max(after, record.paused_at)
            if self.stored(job_id):
                missed = self._overdue(job, last, after, horizon)
            else:
                missed = latest_fire_time(job.trigger, after, horizon, after=after)
            if missed is None:
                continue
            self._alarmed[job_id] = missed
            self.emit(MutexEvent(EVENT_RUN_MISSED, lock=lock, job_id=job_id, node=self.node_id, fire_time=missed,
                                 last_claimed=last))  # fmt: skip

    def _overdue(self, job: Any, last: datetime, after: datetime, horizon: datetime) -> datetime | None:
        """A shared job's fire time after ``after`` and older than ``horizon`` that did not run: its
        stored next run time, or one that stored time was moved past (its own fire times, not its
        trigger's slots: see :meth:`_passed`)."""
        if job.next_run_time is None:
            return None
        stored = slot_of(job.trigger, job.next_run_time)
        if after < stored <= horizon:
            return stored
        return passed_fire_time(job.trigger, last, stored, after + timedelta(microseconds=1), horizon)

    def forget(self, job_id: str, lock: str | None) -> None:
        """Drop what is kept of a removed job (and of its lock, if it was the lock's last job)."""
        self._alarmed.pop(job_id, None)
        if lock is not None:
            self._last_check.pop(lock, None)

    def shutdown(self) -> None:
        self._stopped = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _wait_running(self) -> bool:
        """Wait until the scheduler runs (a takeover seen while it starts); False once it stopped."""
        deadline = time.monotonic() + START_WAIT
        while not self.scheduler.running:
            if self._stopped or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def run(self, lock: str, before: LockRecord | None, *, handed: bool = False) -> None:
        """Only fire times after the job's last claimed fire time (after this scheduler started if
        it has none) and within its ``misfire_grace_time`` count; the claim in the store still decides.
        A release by the previous holder and a takeover from a dead one are caught up alike."""
        if not self._wait_running():
            return
        self._alarm(lock, before)
        now = self.clock()
        skip = self.skip_handed if handed else self.skip
        for job_id, guard in list(self.guarded().items()):
            if guard.lock != lock or skip(job_id):
                continue
            job = self.scheduler.get_job(job_id)
            if job is None or job.next_run_time is None:
                continue
            last = before.fire_times.get(guard.job_id) if before is not None else None
            missed = self._passed(job, now, last) if self.stored(job_id) else self._missed(job, now, last)
            if missed is None:
                continue
            self.emit(MutexEvent(EVENT_CAUGHT_UP, lock=lock, job_id=job_id, node=self.node_id, fire_time=missed))
            try:
                aps.lookup_executor(self.scheduler, job.executor).submit_job(job, [missed])
            except MaxInstancesReachedError:
                log.info("job %r still running; no catch-up", job_id)

    def _passed(self, job: Any, now: datetime, last: datetime | None) -> datetime | None:
        # A job whose stored next run time is the cluster's (a shared job store's): the giver's loop
        # may have moved it past a fire time it then did not run. Only such a fire time is missed:
        # a slot of the trigger the job's own fire times do not meet (its stored time was set off
        # them: "run it now") never ran because it is not one of them. A stored time already due
        # is the loop's to run, coalesced with the fire times before it.
        stored = slot_of(job.trigger, job.next_run_time)
        if stored <= now and job.coalesce:
            return None
        floor = self.started_at if last is None else last
        if job.misfire_grace_time is not None:
            floor = max(floor, now - timedelta(seconds=job.misfire_grace_time))
        return passed_fire_time(job.trigger, last, stored, floor, now)

    def _missed(self, job: Any, now: datetime, last: datetime | None) -> datetime | None:
        # A job the record shows a claim for: every slot after that claim, whenever this node
        # started (a graceful hand-off: the previous holder stopped, and this node may have
        # started after the slot in between, as a new gunicorn worker after HUP does). A job
        # never claimed: only slots since this node started, as APScheduler would run them.
        # (A shared job store's jobs are skipped: their stored next run time stays due until the
        # holder's loop runs it, by its misfire_grace_time and coalesce.)
        floor = self.started_at if last is None else last
        if job.misfire_grace_time is not None:
            floor = max(floor, now - timedelta(seconds=job.misfire_grace_time))
        return latest_fire_time(job.trigger, floor, now, after=last)
