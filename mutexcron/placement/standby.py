"""Standbys cost nothing per job: a node's APScheduler loop sees only the guarded jobs whose lock it holds.

Under balanced placement the scheduler's in-memory job stores (a jobs file's jobs) become
:class:`HeldOnlyMemoryJobStore`: their due jobs and their next run time leave out every guarded job
whose lock this node does not hold, so a standby's loop neither wakes nor ticks for them. Jobs with
``lock_else`` still tick on every node (``lock_else`` is called at the job's fire times on the nodes
that do not hold the lock); so do callable-lock jobs and unguarded ones. A job left out keeps its
place in the store; when the node takes its lock, :class:`Standby` sets its next run time from the
lock's last claimed fire time (the fire times since then are APScheduler's to run or skip, by
``misfire_grace_time`` and ``coalesce``) and wakes the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.util import datetime_to_utc_timestamp

from ..guard import apscheduler_internals as aps
from ..locks.record import LockRecord

log = logging.getLogger(__name__)


class Guard(Protocol):
    """What :class:`Standby` reads of a guarded job (``guard.job.GuardedJob``)."""

    @property
    def lock(self) -> str: ...
    @property
    def ttl(self) -> float: ...
    @property
    def ticks_on_standby(self) -> bool: ...


class Holds(Protocol):
    def held(self) -> dict[str, int]: ...


class HeldOnlyMemoryJobStore(MemoryJobStore):  # type: ignore[misc]  # APScheduler is untyped
    """A ``MemoryJobStore`` whose loop reads leave out the jobs ``left_out(job)`` names."""

    left_out: Callable[[Any], bool] = staticmethod(lambda job: False)
    before_read: Callable[[], None] = staticmethod(lambda: None)

    def get_due_jobs(self, now: datetime) -> list[Any]:
        self.before_read()
        now_timestamp = datetime_to_utc_timestamp(now)
        due = []
        for job, timestamp in self._jobs:
            if timestamp is None or timestamp > now_timestamp:
                break
            if not self.left_out(job):
                due.append(job)
        return due

    def get_next_run_time(self) -> datetime | None:
        self.before_read()
        for job, timestamp in self._jobs:
            if timestamp is None:
                return None
            if not self.left_out(job):
                return job.next_run_time  # type: ignore[no-any-return]
        return None


class Standby:
    """Leaves the guarded jobs of the locks a node does not hold out of its loop, and puts them
    back, with their next fire time, when it takes the lock."""

    def __init__(self, scheduler: Any, guards: Callable[[], Mapping[str, Guard]], leases: Holds) -> None:
        self.scheduler = scheduler
        self.guards = guards
        self.leases = leases
        self._taken: dict[str, LockRecord | None] = {}  # locks taken since the loop last read the stores
        self._held: frozenset[str] = frozenset()  # the locks held when the loop began its read
        self._mutex = threading.Lock()

    def adopt(self, store: Any) -> Any:
        """``store`` as a held-only store if it is a plain ``MemoryJobStore``, else unchanged."""
        if type(store) is MemoryJobStore:
            store.__class__ = HeldOnlyMemoryJobStore
            store.left_out = self.left_out
            store.before_read = self.before_read
        return store

    def left_out(self, job: Any) -> bool:
        """True for a guarded job whose lock this node did not hold when the loop began its read
        (and that has no ``lock_else``). A job let in whose lease lapses meanwhile still checks
        its lease before its first line; a lock taken meanwhile wakes the loop again."""
        guard = self.guards().get(job.id)
        return guard is not None and not guard.ticks_on_standby and guard.lock not in self._held

    def before_read(self) -> None:
        """On the loop's thread, before it reads a store: put back the jobs of the locks taken
        since (:meth:`put_back`), then note the locks held, once for the whole read."""
        self.put_back()
        self._held = frozenset(self.leases.held())

    def taken(self, lock: str, record: LockRecord | None) -> None:
        """This node just took ``lock``: the loop wakes and puts its jobs back (:meth:`put_back`; a
        trigger is computed on the loop's thread, never on the heartbeat thread)."""
        with self._mutex:
            self._taken[lock] = record
        if self.scheduler.running:  # before start() the loop has nothing to wake (and no event to set)
            self.scheduler.wakeup()

    def put_back(self) -> None:
        """On the loop's thread, before it reads a store: the jobs of the locks taken since get their
        next fire time from each lock's last claimed one."""
        if not self._taken:
            return
        with self._mutex:
            taken, self._taken = self._taken, {}
        guards = self.guards()
        with aps.jobstores_lock(self.scheduler):
            for job_id, guard in list(guards.items()):
                if guard.lock in taken and not guard.ticks_on_standby:
                    self._put_back(job_id, guard.ttl, taken[guard.lock])

    def _put_back(self, job_id: str, ttl: float, record: LockRecord | None) -> None:
        found = aps.lookup_stored_job(self.scheduler, job_id)
        if found is None or not isinstance(found[1], HeldOnlyMemoryJobStore):
            return
        job, store = found
        if job.next_run_time is None:  # paused by the user: stays paused
            return
        last = record.fire_times.get(job_id) if record is not None else None
        next_run = _next_fire_time(job, last, ttl)
        if next_run is not None and next_run != job.next_run_time:
            aps.modify_pending(job, next_run_time=next_run)
            store.update_job(job)


def _next_fire_time(job: Any, last: datetime | None, ttl: float, now: datetime | None = None) -> datetime | None:
    """The job's first fire time after ``last`` (the lock's last claimed one); when that claim is
    older than the job's misfire grace time, its first fire time within that grace (the loop then
    runs the latest one passed, once if coalesced, as a catch-up does); from now when none was
    claimed.

    A claim older than the grace is the rule when this node's clock is ahead of the last holder's
    (fire times are each node's own clock): from now, the fire time due just before this node took
    the lock ran on no node (seen with clocks 8 s apart at a SIGTERM hand-over)."""
    if now is None:
        now = datetime.now(job.trigger.timezone) if hasattr(job.trigger, "timezone") else datetime.now().astimezone()
    grace = timedelta(seconds=job.misfire_grace_time if job.misfire_grace_time is not None else 2 * ttl)
    if last is None:
        return job.trigger.get_next_fire_time(None, now)  # type: ignore[no-any-return]
    if now - last <= grace:
        return job.trigger.get_next_fire_time(last, now)  # type: ignore[no-any-return]
    return job.trigger.get_next_fire_time(None, now - grace)  # type: ignore[no-any-return]
