"""``mutexcron trigger JOB``: run one guarded job now, through its lock, on the node that holds it.

A trigger is a durable task (:mod:`mutexcron.tasks`) with code :data:`TRIGGER_CODE` and the job id
as key, added with ``due = now`` by the store's clock. Every started scheduler with guarded jobs
handles that code: the node that holds the job's lock (or takes it, if nobody holds it) runs the
job once with the trigger's due as its fire time. The fire claim in the lock record makes that
run happen at most once across the cluster, it is recorded like any run (hand-off, events, run
info), and the task completes only after that: ``mutexcron trigger`` waits for it. A node that
does not hold the lock defers the task (a quarter of a second, then longer) for the holder.
"""

from __future__ import annotations

from typing import Any, Protocol

from .errors import Defer, FailTask
from .events import EVENT_RUN_FINISHED, MutexEvent
from .guard import GuardedJob
from .tasks.handlers import Handler, Task
from .tasks.pool import TaskPool

__all__ = ["TRIGGER_CODE", "register_triggers"]

#: The task code of trigger requests; the key is the job id.
TRIGGER_CODE = "mutexcron.trigger"
#: Seconds between two looks for trigger requests where the store sends no notice (MySQL/MariaDB,
#: MongoDB; SQLite's change check): a request waits at most this long to be seen, and a node that
#: serves only triggers asks the store 5 times (SQLite 40 times) less often than for delayed tasks.
TRIGGER_POLL = 1.0


class _Scheduler(Protocol):
    @property
    def tasks(self) -> TaskPool: ...

    def get_job(self, job_id: str) -> Any: ...

    def guard_of(self, job_id: str) -> GuardedJob | None: ...


def register_triggers(sched: _Scheduler) -> None:
    """Handle trigger requests on this node (once per scheduler)."""
    if TRIGGER_CODE in sched.tasks.handlers:
        return
    handler = _TriggerHandler(sched)
    # Non-holders defer the request to the holder: many short attempts, never a failure by count.
    sched.tasks.add_handler(Handler(TRIGGER_CODE, handler, lease=30.0, max_attempts=100_000, backoff=0.25,
                                    backoff_max=2.0, jitter=0.5, poll=TRIGGER_POLL))  # fmt: skip


class _TriggerHandler:
    def __init__(self, sched: _Scheduler) -> None:
        self.sched = sched

    def __call__(self, task: Task) -> None:
        guard = self.sched.guard_of(task.key)
        job = self.sched.get_job(task.key)
        if guard is None or job is None:
            raise Defer(1.0, f"job {task.key!r} is not a guarded job of this node")
        ended = guard.run_now(task.due, tuple(job.args), dict(job.kwargs))
        self._settle(ended)

    @staticmethod
    def _settle(ended: MutexEvent | None) -> None:
        """Done, failed with the job's error, or deferred to the node that holds the lock."""
        if ended is None:
            raise Defer(0.5, "not run here")
        if ended.code == EVENT_RUN_FINISHED:
            if ended.outcome == "error":
                raise FailTask(ended.error or "the job failed")
            return
        if ended.reason == "already-run":
            return  # another node ran this fire time: the trigger is served
        raise Defer(0.25, f"not run here: {ended.reason}")
