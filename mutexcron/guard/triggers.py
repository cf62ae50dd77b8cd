"""``mutexcron trigger JOB``: run one guarded job now, through its lock, on the node that holds it.

A trigger is a durable task (:mod:`mutexcron.tasks`) with code :func:`trigger_code` of the job id
(``mutexcron.trigger.<bucket>``, the bucket a stable hash of the job id) and the job id as key,
added with ``due = now`` by the store's clock. A started scheduler with guarded jobs handles the
codes of the jobs it defines (and the plain :data:`TRIGGER_CODE` of earlier versions' requests), so
a node of another app on the same store never sees a request, unless one of its jobs hashes to the
same bucket (it then defers it, as for a job it does not define). The node that holds the job's
lock (or takes it, if nobody holds it) runs the job once with the trigger's due as its fire time.
The fire claim in the lock record makes that run happen at most once across the cluster, it is
recorded like any run (hand-off, events, run info), and the task completes only after that:
``mutexcron trigger`` waits for it. A node that does not hold the lock defers the task (a quarter
of a second, then longer) for the holder.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable
from typing import Any, Protocol

from ..errors import Defer, FailTask
from ..events import EVENT_RUN_FINISHED, MutexEvent
from ..locks import LockStore
from ..locks.base import store_text
from ..names import printable
from ..tasks.handlers import Handler, Task
from ..tasks.pool import TaskPool
from .job import GuardedJob
from .run_requests import describe_run, run_for

__all__ = [
    "CATCH_UP_DEADLINE", "NOT_DEFINED", "NOT_GUARDED", "PAUSED", "TRIGGER_BUCKETS", "TRIGGER_CODE", "UNKNOWN",
    "TriggerRoutes", "is_trigger_code", "register_triggers", "trigger_code",
]  # fmt: skip

log = logging.getLogger(__name__)

#: The task code of earlier versions' trigger requests (still served), and the prefix of the
#: routed codes (:func:`trigger_code`); the key is the job id.
TRIGGER_CODE = "mutexcron.trigger"
#: How many routed trigger codes there are: a node lists at most this many (plus the plain one)
#: in its claims, and a request reaches a node of another app only when one of that app's jobs
#: falls in the same bucket.
TRIGGER_BUCKETS = 256
#: Seconds between two looks for trigger requests where the store sends no notice (MySQL/MariaDB,
#: MongoDB; SQLite's change check): a request waits at most this long to be seen, and a node that
#: serves only triggers asks the store 5 times (SQLite 40 times) less often than for delayed tasks.
TRIGGER_POLL = 1.0
#: Seconds (store clock) a ``resume --catch-up`` request waits for a node to run it before it fails.
CATCH_UP_DEADLINE = 300.0
#: How a failed request's error starts when the run's outcome is not known (``trigger`` exits 4) ...
UNKNOWN = "outcome unknown: "
#: ... and when the job's lock is paused (``trigger`` exits 5) ...
PAUSED = "paused: "
#: ... when a node defines the job without a lock (``trigger`` exits 2) ...
NOT_GUARDED = "not guarded: "
#: ... and when the holder of the job's lock (named by the request) does not define it (exits 2).
NOT_DEFINED = "not defined: "


class _Scheduler(Protocol):
    @property
    def tasks(self) -> TaskPool: ...

    @property
    def lock_store(self) -> LockStore: ...

    def get_job(self, job_id: str) -> Any: ...

    def guard_of(self, job_id: str) -> GuardedJob | None: ...

    def running_guarded_jobs(self) -> dict[str, int]: ...


def trigger_code(job_id: str) -> str:
    """The task code of a trigger request for ``job_id``: ``mutexcron.trigger.NNN``, NNN the CRC-32
    of its UTF-8 bytes modulo :data:`TRIGGER_BUCKETS` (the same in every process and version)."""
    bucket = zlib.crc32(job_id.encode("utf-8", "surrogatepass")) % TRIGGER_BUCKETS
    return f"{TRIGGER_CODE}.{bucket:03d}"


def is_trigger_code(code: str) -> bool:
    """True for the code of a trigger request: routed (:func:`trigger_code`) or plain (an earlier version's)."""
    return code == TRIGGER_CODE or code.startswith(TRIGGER_CODE + ".")


class TriggerRoutes:
    """The trigger codes this node serves: the plain one, and one per bucket of the jobs it defines."""

    def __init__(self, sched: _Scheduler) -> None:
        self._pool = sched.tasks
        self._handler = _TriggerHandler(sched)

    def serve(self, job_id: str) -> None:
        """Serve the requests for ``job_id`` (a job this node defines) from now on."""
        self._serve_code(trigger_code(job_id))

    def _serve_code(self, code: str) -> None:
        if code in self._pool.handlers:
            return
        # Non-holders defer the request to the holder: many short attempts, never a failure by count
        # (a catch-up request fails at its deadline instead; `mutexcron trigger` withdraws its own).
        self._pool.add_handler(Handler(code, self._handler, lease=30.0, max_attempts=100_000, backoff=0.25,
                                       backoff_max=2.0, jitter=0.5, poll=TRIGGER_POLL))  # fmt: skip


def register_triggers(sched: _Scheduler, job_ids: Iterable[str]) -> TriggerRoutes:
    """Handle trigger requests on this node: the plain code, and the codes of ``job_ids`` (the jobs
    it defines; :meth:`TriggerRoutes.serve` adds a job defined later)."""
    routes = TriggerRoutes(sched)
    routes._serve_code(TRIGGER_CODE)
    for job_id in job_ids:
        routes.serve(job_id)
    return routes


class _TriggerHandler:
    def __init__(self, sched: _Scheduler) -> None:
        self.sched = sched

    def __call__(self, task: Task) -> None:
        guard = self.sched.guard_of(task.key)
        job = self.sched.get_job(task.key)
        if guard is None or job is None:
            self._check_deadline(task)
            self._check_gone(task)
            if job is not None:  # every node runs the same jobs file: none has a lock to run it through
                raise FailTask(
                    f"{NOT_GUARDED}job {printable(task.key)!r} has no lock (no mutex=): `mutexcron trigger` runs guarded "
                    "jobs only, through their lock"
                )
            raise Defer(1.0, f"job {task.key!r} is not a guarded job of this node")
        ended = guard.run_now(task.due, tuple(job.args), dict(job.kwargs))
        if ended is not None and ended.code != EVENT_RUN_FINISHED and ended.reason == "already-run":
            self._recorded_outcome(guard, task)
            return
        try:
            self._settle(ended)
        except Defer:
            self._check_deadline(task)
            raise

    @staticmethod
    def _settle(ended: MutexEvent | None) -> None:
        """Done, failed with the job's error, failed at once if paused, or deferred to the holder."""
        if ended is None:
            raise Defer(0.5, "not run here")
        if ended.code == EVENT_RUN_FINISHED:
            if ended.outcome == "error":
                raise FailTask(store_text(ended.error or "the job failed"))  # a NUL would fail the task's own write
            return
        if ended.reason == "paused":
            lock = printable(ended.lock)
            raise FailTask(f"{PAUSED}lock {lock!r} is paused: run `mutexcron resume {lock}` first")
        raise Defer(0.25, f"not run here: {ended.reason}")

    def _recorded_outcome(self, guard: GuardedJob, task: Task) -> None:
        """The claim for the request's fire time was refused: a fire time at or after it is claimed.

        That is this request's own fire time, claimed by an earlier attempt (maybe on a node since
        killed), or a later one, claimed by a scheduled run that started after the request (its slot
        came between the request and the holder seeing it: the request can no longer be claimed, and
        the run it asked for is that one). The outcome is the run history's entry for the request's
        fire time, else for the first run after it. None yet: the run may still be going, on this
        node only (this node holds the lease now; another node's run can no longer record its end),
        so the request waits while a run of the lock is going here; after that nothing can be
        recorded any more, and the outcome is unknown.
        """
        going = guard.lock in self.sched.running_guarded_jobs()  # before the history: a run ending now is in it
        run = run_for(self.sched.lock_store.history(guard.lock, task.key), task.due)
        if run is not None:
            log.info("trigger request of job %r (fire time %s), not run again: %s", printable(task.key),
                     task.due.isoformat(), describe_run(run, task.due))  # fmt: skip
            if run.outcome == "error":
                raise FailTask(store_text(run.error or "the job failed"))
            return
        if going:
            raise Defer(0.25, f"the run of job {printable(task.key)!r} at or after fire time {task.due.isoformat()} "
                              "has not ended yet")  # fmt: skip
        raise FailTask(
            f"{UNKNOWN}the run at fire time {task.due.isoformat()} started, but no end of it is recorded (the node "
            f"running it stopped, or the lock keeps no history): see `mutexcron history {printable(task.key)}`"
        )

    @staticmethod
    def _check_deadline(task: Task) -> None:
        """A request (a catch-up, a trigger) that no node ran within its deadline (store clock) fails:
        its job may be gone, or its asker stopped waiting; it never lingers for a later one."""
        deadline = task.payload.get("deadline") if isinstance(task.payload, dict) else None
        record = task.record
        if deadline is None or record.created is None or record.updated is None:
            return
        if (record.updated - record.created).total_seconds() > float(deadline):
            raise FailTask(
                f"no node ran job {printable(task.key)!r} within {float(deadline):g}s of the request: is it still "
                "defined in the jobs file?"
            )

    def _check_gone(self, task: Task) -> None:
        """A request naming the job's lock (a catch-up, or a trigger of a job the lock record
        names) that the lock's holder does not define: the job is gone from the jobs file."""
        lock = task.payload.get("lock") if isinstance(task.payload, dict) else None
        leases = getattr(self.sched, "_leases", None)
        if lock is not None and leases is not None and lock in leases.held():
            raise FailTask(
                f"{NOT_DEFINED}job {printable(task.key)!r} is not defined on {printable(lock)!r}'s holder: is it still "
                "in the jobs file?"
            )
