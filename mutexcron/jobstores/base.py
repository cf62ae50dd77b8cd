"""What every shared job store does, whatever its family: APScheduler's job store API over a few
atomic primitives that each family implements on its own data (:mod:`.sqlalchemy`, :mod:`.redis`,
:mod:`.mongodb`).

The data stays APScheduler's: the same table, hash or collection, the same pickled
``Job.__getstate__()`` with the **user's** function reference (``module:function``) and trigger.
What changes is how it is read and written:

* **Reads never delete.** A job whose function this node cannot import (new code not deployed
  here yet) is skipped with one warning; APScheduler's stores would delete it from the store.
* **Only the holder runs a job.** ``get_due_jobs`` and ``get_next_run_time`` see only the jobs
  whose lock this node holds (:class:`~mutexcron.jobstores.node.SharedJobs`), so one node's loop
  advances a job's ``next_run_time``, and a standby makes no store call at all for it.
* **Compare-and-set writes.** Every write is conditional on the state the writer read:

  - the loop's advance (``update_job`` of a job from ``get_due_jobs``) and its removal of a
    finished date job are made only if the stored state is still the one it read; if another
    writer changed or removed the job meanwhile, the loop's write is dropped and that change kept
    (the fire time it ran is claimed in the lock store, so it never runs twice);
  - a change through the scheduler's API (``modify_job``, ``reschedule_job``, ``pause_job``...)
    is merged field by field onto the stored state when that moved since it was read, and retried;
  - ``add_job(replace_existing=True)`` of a job whose trigger did not change keeps the stored
    ``next_run_time`` (a rolling restart neither skips nor doubles a fire time, and a paused job
    stays paused).
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Protocol

from apscheduler.job import Job
from apscheduler.jobstores.base import ConflictingIdError, JobLookupError
from apscheduler.util import datetime_to_utc_timestamp, utc_timestamp_to_datetime

from ..errors import StoreUnavailableError
from ..guard.job import GuardedJob
from .stalls import LoopErrors, PendingAdvance
from .states import LOCK_FIELD, changed_fields, dump, load, merged_state, replacement_state, stored_trigger

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

log = logging.getLogger(__name__)

#: How often an API write re-reads and re-merges a job that keeps changing under it before giving up.
MERGE_ATTEMPTS = 20
#: The longest a write waits for a lock another writer holds (a row, a database): a writer frozen
#: in its transaction holds one job, never the loop. A node's own bound is lower with a short lease.
WRITE_TIMEOUT = 5.0
#: Seconds before APScheduler's loop looks again after a store error in its pass.
LOOP_RETRY = 1.0


class SharedJob(Job):  # type: ignore[misc]
    """A job read from a shared store: it remembers the state it was read with (the base of its
    compare-and-set) and whether APScheduler's loop read it (``get_due_jobs``)."""

    __slots__ = ("_mc_base", "_mc_from_loop", "_mc_lock")


def timestamp(when: datetime | None) -> float | None:
    value: float | None = datetime_to_utc_timestamp(when)
    return value


class JobsKeeper(Protocol):
    """What a shared store asks of the node's bookkeeping of shared jobs
    (:class:`~mutexcron.jobstores.node.SharedJobs`): guards, held locks, forgetting removed jobs."""

    def attach(self, store: SharedJobStore) -> None: ...

    def detach(self, store: SharedJobStore) -> None: ...

    def held_jobs(self, store: SharedJobStore) -> set[str]: ...

    def begin_pass(self, store: SharedJobStore) -> set[str]: ...

    def due_read(self, due: Collection[str]) -> None: ...

    def unrestorable(self, store: SharedJobStore, job_id: str, exc: BaseException) -> None: ...

    def guard(self, store: SharedJobStore, job: Any) -> bool: ...

    def explicit_next_run_time(self, job_id: str) -> bool: ...

    def forget(self, store: SharedJobStore, job_id: str) -> None: ...

    def func_ref(self, job: Any) -> str: ...

    def forget_after_run(self, store: SharedJobStore, job_id: str) -> None: ...

    def keep(self, job_id: str) -> None: ...

    def lock_of(self, job: Any) -> str | None: ...

    def other_zone(self, store: SharedJobStore, job_id: str, new: Any, stored: Any) -> bool: ...


class SharedJobStore:
    """Mixed in before an APScheduler job store class (see :func:`mutexcron.jobstores.share`)."""

    #: Set by :meth:`start`: the scheduler's shared-jobs bookkeeping.
    shared: JobsKeeper
    #: Seconds a write may wait for another writer's lock (a third of the node's lease, at most :data:`WRITE_TIMEOUT`).
    write_timeout: float = WRITE_TIMEOUT
    pickle_protocol: int
    _alias: str | None
    _scheduler: Any

    # -- the family's primitives: one atomic store operation each ---------------------------------
    @abstractmethod
    def _read_states(self, ids: Collection[str] | None = None) -> dict[str, bytes]:
        """``{job id: pickled state}`` of every job (or of ``ids``)."""

    @abstractmethod
    def _read_due(self, ts: float, ids: Collection[str]) -> list[tuple[str, bytes]]:
        """Jobs of ``ids`` due at ``ts`` (epoch seconds), by next run time."""

    @abstractmethod
    def _earliest(self, ids: Collection[str]) -> float | None:
        """The earliest next run time of ``ids`` (paused jobs left out)."""

    @abstractmethod
    def _insert(self, job_id: str, ts: float | None, state: bytes) -> bool:
        """Add the job if its id is free; False if it exists. Announces the change."""

    @abstractmethod
    def _replace(self, job_id: str, base: bytes, ts: float | None, state: bytes, announce: bool) -> bool:
        """Write the job only if its stored state is exactly ``base``; True if written."""

    @abstractmethod
    def _delete(self, job_id: str, base: bytes | None) -> bool:
        """Delete the job (only if its state is ``base``, when given); True if deleted. Announces it."""

    @abstractmethod
    def _delete_all(self) -> None:
        """Delete every job. Announces it."""

    def prepare_changes(self, create: bool) -> None:
        """Find (or, with ``create``, make) the store's change counter, if the family keeps one."""

    def change_marker(self) -> object | None:
        """A cheap read that differs after every change another writer announced (a change counter
        that each announced write bumps), so a watcher skips reading every job when nothing changed;
        None: no such read here, the watcher reads every job each time it wakes."""
        return None

    @abstractmethod
    def waker(self) -> Waker:
        """What this node's watcher sleeps on: the store's notice, or a poll."""

    @property
    @abstractmethod
    def where(self) -> str:
        """The store, for log lines (no secrets)."""

    # -- life ----------------------------------------------------------------------------------------
    def start(self, scheduler: Any, alias: str) -> None:
        super().start(scheduler, alias)  # type: ignore[misc]  # the table or index, as APScheduler makes it
        self.prepare_changes(create=True)
        self._loop_reads = threading.local()
        self._known: dict[str, bytes] = {}  # what this node last read or wrote, for the watcher's diff
        self._known_lock = threading.Lock()
        self._writes = 0  # this node's writes: a watcher's read that overlaps one is read again
        # Job objects this store added, with the state they were written with: an update_job() of
        # the same object changes that state (a new object for the id is a replacement).
        self._added: dict[str, tuple[Job, bytes]] = {}
        self.shared = scheduler._shared_jobs
        self.write_timeout = write_timeout(getattr(scheduler, "unactive_interval", None))
        self._loop_errors = LoopErrors(lambda: self.where)
        self.shared.attach(self)

    def shutdown(self) -> None:
        shared = getattr(self, "shared", None)
        if shared is not None:
            shared.detach(self)
        super().shutdown()  # type: ignore[misc]

    # -- reads -----------------------------------------------------------------------------------------
    def lookup_job(self, job_id: str) -> Job | None:
        state = self._read_states([job_id]).get(job_id)
        return None if state is None else self.restore(job_id, state, from_loop=False)

    def get_all_jobs(self) -> list[Job]:
        jobs = [job for job_id, state in self._read_states().items() if (job := self.restore(job_id, state)) is not None]
        jobs.sort(key=lambda job: (job.next_run_time is None, timestamp(job.next_run_time) or 0.0))
        return jobs

    def get_due_jobs(self, now: datetime) -> list[Job]:
        """The due jobs whose lock this node holds (APScheduler's loop runs and advances these)."""
        due: dict[str, bytes] = {}
        self._loop_reads.due = due
        held = self.shared.begin_pass(self)  # their locks pinned until due_read
        if not held:
            return []
        jobs = []
        try:
            rows = self._read_due(float(timestamp(now) or 0.0), held)
        except BaseException:
            self.shared.due_read(())
            raise
        for job_id, state in rows:
            if job_id in self._loop_errors.pending and self._advance_again(job_id, state):
                continue  # its fire time ran: held back until its advance is written
            job = self.restore(job_id, state, from_loop=True)
            if job is not None:
                due[job_id] = state
                jobs.append(job)
        self.shared.due_read(due)  # their locks stay pinned until their runs are counted
        return jobs

    def get_next_run_time(self) -> datetime | None:
        self._loop_reads.due = {}  # the loop pass over this store is over
        held = self.shared.held_jobs(self)
        try:
            earliest = self._earliest(held) if held else None
        except Exception as exc:  # noqa: BLE001 - APScheduler's loop dies of any error here: look again soon
            self._loop_errors.failed("the next run time", "could not read the next run time", exc)
            return datetime.now(timezone.utc) + timedelta(seconds=LOOP_RETRY)
        self._loop_errors.ok("the next run time")
        when: datetime | None = utc_timestamp_to_datetime(earliest)
        return when

    def restore(self, job_id: str, state: bytes, *, from_loop: bool = False) -> SharedJob | None:
        """The job from its stored state, with its guard as ``func``; None (and one warning) if this
        node cannot restore it. Never deletes it."""
        try:
            fields = load(state)
            job = SharedJob.__new__(SharedJob)
            job.__setstate__(fields)
            job._mc_lock = fields.get(LOCK_FIELD)
        except Exception as exc:  # noqa: BLE001 - any failure to unpickle or import: skip, keep the job
            self.shared.unrestorable(self, job_id, exc)
            return None
        job._scheduler = self._scheduler
        job._jobstore_alias = self._alias
        if not self.shared.guard(self, job):
            return None
        job._mc_base, job._mc_from_loop = state, from_loop
        return job

    # -- writes ----------------------------------------------------------------------------------------
    def add_job(self, job: Job) -> None:
        state = self._dump(job)
        if not self._insert(job.id, timestamp(job.next_run_time), state):
            raise ConflictingIdError(job.id)
        self._added[job.id] = (job, state)
        self._wrote(job.id, state)

    def update_job(self, job: Job) -> None:
        if getattr(job, "_mc_from_loop", False):
            self._advance(job)
            return
        base: bytes | None = getattr(job, "_mc_base", None)
        added = self._added.get(job.id)
        if base is None and added is not None and added[0] is job:
            base = added[1]  # the object this store added: a change of it, not a replacement
        new = self._fields(job)

        def fields_for(current: bytes) -> dict[str, Any]:
            if base is None:  # a new Job object for an existing id: add_job(replace_existing=True)
                stored = load(current)
                if self.shared.other_zone(self, job.id, new.get("trigger"), stored.get("trigger")):
                    return stored  # computed in another zone here: not rewritten (said once)
                if "trigger" in changed_fields({"trigger": stored.get("trigger")}, {"trigger": new.get("trigger")}):
                    # Nodes starting together with different jobs files: the last writer wins; said, not silent.
                    log.warning("job %r in %s: this node's add_job(replace_existing=True) replaces its trigger %s with %s",
                                job.id, self.where, stored.get("trigger"), new.get("trigger"))  # fmt: skip
                return replacement_state(new, stored, self.shared.explicit_next_run_time(job.id))
            if current == base:
                return new
            return merged_state(load(base), new, load(current))  # changed since this writer read it: merged onto it

        written = self.compare_and_set(job.id, fields_for)
        if written is None:
            raise JobLookupError(job.id)
        state, fields = written
        assert state is not None and fields is not None  # fields_for never removes
        self._wrote(job.id, state)
        job._modify(next_run_time=fields["next_run_time"])
        if isinstance(job, SharedJob):
            job._mc_base = state
        if added is not None and added[0] is job:
            self._added[job.id] = (job, state)

    def compare_and_set(
        self, job_id: str, fields_for: Callable[[bytes], dict[str, Any] | None], *, announce: bool = True
    ) -> tuple[bytes | None, dict[str, Any] | None] | None:
        """One change of a stored job, written only over the state it was made from: read the job's
        state, ``fields_for(state)`` gives the fields to store (None: delete the job), written (or
        deleted) only if the stored state is still the one read; else read and made again, up to
        :data:`MERGE_ATTEMPTS` times. Used by :meth:`update_job` and by a writer that runs no
        scheduler (:mod:`mutexcron.jobstores.admin`); it does not tell this node's watcher.

        Returns:
            ``(state, fields)`` written (``(None, None)``: deleted), or None if no job ``job_id`` is stored.

        Raises:
            StoreUnavailableError: the job kept changing under the write (try again); a store error.
        """
        for _ in range(MERGE_ATTEMPTS):
            current = self._read_states([job_id]).get(job_id)
            if current is None:
                return None
            fields = fields_for(current)
            if fields is None:
                if self._delete(job_id, current):
                    return None, None
                continue
            state = dump(fields, self.pickle_protocol)
            if state == current or self._replace(job_id, current, timestamp(fields["next_run_time"]), state, announce):
                return state, fields
        raise StoreUnavailableError(f"job {job_id!r} in {self.where} kept changing while it was written; try again")

    def _advance(self, job: Job) -> None:
        """The loop's write of a job it read: only over the state it read, else the other change wins.
        A store error (a lock wait timed out) leaves the job due: its fire time stays claimed, so it
        is not run again, and the next pass writes the advance again. The loop carries on."""
        base = job._mc_base
        state = self._dump(job)
        try:
            done = self._replace(job.id, base, timestamp(job.next_run_time), state, False)
        except Exception as exc:  # noqa: BLE001 - APScheduler's loop dies of any error here
            self._loop_errors.pending[job.id] = PendingAdvance(base, state, timestamp(job.next_run_time))
            self._loop_errors.failed(f"job {job.id!r}", f"could not write the next run time of job {job.id!r}", exc)
            return
        if done:
            job._mc_base = state
            # Another writer's change that the loop read before this node's watcher did is still
            # reported (and its events sent) by the watcher: then its base is not what the watcher knows.
            self._wrote(job.id, state, announce=False, if_known=base)
        else:
            log.info("job %r changed or was removed in %s while this node ran it: that change is kept", job.id, self.where)

    def _advance_again(self, job_id: str, state: bytes) -> bool:
        """Write again an advance the store refused with an error; False if the job changed since
        (that change wins, and the job is the loop's again)."""
        pending = self._loop_errors.pending[job_id]
        if state != pending.base:
            del self._loop_errors.pending[job_id]
            return False
        try:
            done = self._replace(job_id, pending.base, pending.ts, pending.state, False)
        except Exception as exc:  # noqa: BLE001 - still failing: said once already
            self._loop_errors.failed(f"job {job_id!r}", f"could not write the next run time of job {job_id!r}", exc)
            return True
        del self._loop_errors.pending[job_id]
        self._loop_errors.ok(f"job {job_id!r}")
        if done:
            self._wrote(job_id, pending.state, announce=False, if_known=pending.base)
        return True

    def remove_job(self, job_id: str) -> None:
        base = getattr(self._loop_reads, "due", {}).pop(job_id, None)
        try:
            deleted = self._delete(job_id, base)
        except Exception as exc:
            if base is None:
                raise  # an API call: its caller sees the error
            self._loop_errors.failed(f"job {job_id!r}", f"could not remove finished job {job_id!r}", exc)  # kept for now
            return
        if deleted:
            self._wrote(job_id, None)
            return
        if base is not None:  # the loop's removal of a finished date job that was changed meanwhile: kept
            log.info("job %r was changed in %s after its last run: not removed", job_id, self.where)
            self.shared.keep(job_id)  # no EVENT_JOB_REMOVED, and its guard and lock stay
        raise JobLookupError(job_id)

    def remove_all_jobs(self) -> None:
        self._delete_all()
        with self._known_lock:
            self._writes += 1
            removed = list(self._known)
            self._known.clear()
            self._added.clear()
        for job_id in removed:
            self.shared.forget(self, job_id)

    # -- helpers ---------------------------------------------------------------------------------------
    def _fields(self, job: Job) -> dict[str, Any]:
        """The state to store: APScheduler's, with the user's function and trigger, never the guard's."""
        fields: dict[str, Any] = job.__getstate__()
        if isinstance(job.func, GuardedJob):  # a change of args or kwargs made APScheduler look the guard up
            fields["func"] = self.shared.func_ref(job)
        fields["trigger"] = stored_trigger(job.trigger)
        lock = getattr(job, "_mc_lock", None) or self.shared.lock_of(job)
        if lock is not None:
            fields[LOCK_FIELD] = lock
        return fields

    def _dump(self, job: Job) -> bytes:
        return dump(self._fields(job), self.pickle_protocol)

    def _wrote(self, job_id: str, state: bytes | None, *, announce: bool = True, if_known: bytes | None = None) -> None:
        """Remember this node's own write, so its watcher does not report it as another's (with
        ``if_known``: only if the watcher knew the job as that). A removal forgets the job (a
        finished date job's guard and lock stay until its submitted run ends)."""
        with self._known_lock:
            self._writes += 1
            if if_known is not None and self._known.get(job_id) != if_known:
                pass  # the watcher has yet to see what this write was made over
            elif state is None:
                self._known.pop(job_id, None)
                self._added.pop(job_id, None)
            else:
                self._known[job_id] = state
        if state is None:
            self.shared.forget(self, job_id)

    def snapshot(self) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """Read every job: ``(before, now)``, ``before`` as this node last knew them. A read that
        overlapped a write of this node is made again, so that write is not taken for another's."""
        for _ in range(3):
            with self._known_lock:
                writes = self._writes
            states = self._read_states()
            with self._known_lock:
                if writes == self._writes:
                    return self._took(states), states
        with self._known_lock:
            return self._took(states), states

    def _took(self, states: dict[str, bytes]) -> dict[str, bytes]:
        """``states`` are what this node knows now (under ``_known_lock``); returns what it knew. A job
        another writer removed (a one-off job run by another node) is let go of: memory stays bounded."""
        before, self._known = self._known, dict(states)
        for job_id in before.keys() - states.keys():
            self._added.pop(job_id, None)
        return before


def write_timeout(lease: float | None) -> float:
    """How long a node's job store write waits for another writer's lock: well below its lease."""
    if not lease:
        return WRITE_TIMEOUT
    return max(0.5, min(WRITE_TIMEOUT, lease / 3))


def ids_in(rows: Iterable[tuple[str, Any]], wanted: Collection[str]) -> list[tuple[str, Any]]:
    return [row for row in rows if row[0] in wanted]


def chunks(items: Sequence[str], size: int = 500) -> Iterable[Sequence[str]]:
    """Bounded ``IN (...)`` lists."""
    for start in range(0, len(items), size):
        yield items[start : start + size]

