"""The dashboard's actions: pause, resume (with catch-up), trigger now, pause, resume and remove of a
shared job, and task retry and cancel, one at a time or for a filtered selection.

Each is the store operation the matching command makes (``mutexcron pause/resume/trigger``,
``mutexcron tasks retry/cancel``), on a store of its own opened for the action and closed after
it (the dashboard's reading stores never write). Input is checked before anything reaches the
store: a lock must exist, a job must be known, a bulk action must still match the count the
operator confirmed; a refused action changes nothing. Every action is logged (logger
``mutexcron.dashboard.actions``) with who did it, and kept in :class:`AuditLog` for the Overview;
pause and resume also record it in the lock (``paused_by``), a trigger in its request.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from ..errors import ConfigurationError
from ..guard.run_requests import request_runs, run_for, withdraw_stale_request
from ..guard.triggers import trigger_code
from ..locks import LockStore, lock_store_from_url
from ..names import check_name
from ..observability.feed import FeedEvent, feed_store_for
from ..tasks import STATES, TaskStore, task_store_from_url
from ..tasks.checks import check_task
from ..timeutil import as_utc
from .reads import StoreReader

__all__ = ["ActionError", "Actions", "AuditEntry", "AuditLog"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: At most this many tasks in one bulk action (the operator narrows the filter for more).
BULK_LIMIT = 10_000


class ActionError(Exception):
    """An action refused before it changed anything; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AuditEntry:
    at: datetime
    by: str
    action: str
    target: str
    result: str


class AuditLog:
    """The dashboard's recent actions (this process's), newest first."""

    def __init__(self, size: int = 50) -> None:
        self._entries: deque[AuditEntry] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, by: str, action: str, target: str, result: str) -> None:
        entry = AuditEntry(datetime.now(timezone.utc), by, action, target, result)
        log.info("%s: %s %s: %s", by, action, target, result)
        with self._lock:
            self._entries.appendleft(entry)

    def entries(self) -> list[AuditEntry]:
        with self._lock:
            return list(self._entries)


def _checked(check: Callable[[], _T]) -> _T:
    try:
        return check()
    except ConfigurationError as exc:
        raise ActionError(str(exc)) from None


class Actions:
    """The actions on the store of ``reader`` (its URL), recorded in ``audit``."""

    def __init__(
        self,
        reader: StoreReader,
        audit: AuditLog,
        known_jobs: Callable[[], set[str]],
        shared_stores: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.reader = reader
        self.audit = audit
        self.known_jobs = known_jobs
        self.shared_stores = shared_stores

    @contextmanager
    def _locks(self) -> Iterator[LockStore]:
        store = lock_store_from_url(self.reader.url)
        try:
            yield store
        finally:
            store.close()

    @contextmanager
    def _tasks(self) -> Iterator[TaskStore]:
        if not self.reader.has_tasks:
            raise ActionError("this store has no task pool")
        store = task_store_from_url(self.reader.lock_store().url)
        try:
            yield store
        finally:
            store.close()

    # -- locks ------------------------------------------------------------------------------
    def _existing_lock(self, store: LockStore, lock: Any) -> str:
        name = _checked(lambda: check_name(lock, "lock name"))
        if store.read(name) is None:
            raise ActionError(f"no lock {name!r} in {store.masked_url}", 404)
        return name

    def pause(self, lock: Any, by: str) -> dict[str, Any]:
        """``mutexcron pause LOCK --by BY``: no node starts the lock's fire times until resumed."""
        with self._locks() as store:
            name = self._existing_lock(store, lock)
            record = store.set_paused(name, True, by)
            _tell_feed(store, FeedEvent("lock_paused", None, name, f"lock {name} paused by {by}", fields={"by": by}))
        message = f"{name}: paused by {record.paused_by}"
        self.audit.add(by, "pause", name, "paused")
        return {"message": message, "lock": record.to_json()}

    def resume(self, lock: Any, catch_up: bool, by: str) -> dict[str, Any]:
        """``mutexcron resume LOCK [--catch-up] --by BY``; with catch-up, each job that ran under the
        lock runs once now on its holder (a trigger request per job, as the command makes). The
        answer says the requests were made, with their fire times, not that they ran: the page
        follows each with :meth:`trigger_outcome` (ran, merged into a later run, or why not)."""
        with self._locks() as store:
            name = self._existing_lock(store, lock)
            before = store.read(name)
            record = store.set_paused(name, False, by, catch_up=catch_up)
            how = " with catch-up" if catch_up else ""
            _tell_feed(store, FeedEvent("lock_resumed", None, name, f"lock {name} resumed{how} by {by}", fields={"by": by}))
        jobs = sorted(before.fire_times) if before is not None and catch_up else []
        requests = request_runs(self.reader.lock_store().url, name, jobs) if jobs else {}
        after = f"; catch-up requested: {', '.join(jobs)}" if jobs else ""
        self.audit.add(by, "resume" + (" --catch-up" if catch_up else ""), name, "resumed" + after)
        fire_times = {job: when.isoformat() for job, when in requests.items()}
        return {"message": f"{name}: resumed by {record.paused_by}{after}", "lock": record.to_json(), "catch_up": jobs,
                "fire_times": fire_times}  # fmt: skip

    # -- trigger ----------------------------------------------------------------------------
    def trigger(self, job: Any, by: str) -> dict[str, Any]:
        """``mutexcron trigger JOB`` without the wait: the request is a task the holder runs; the
        page follows it with :meth:`trigger_outcome`. An earlier request that failed (its outcome
        was shown), or is still queued past its deadline, is withdrawn first, so this one runs."""
        job_id = _checked(lambda: check_name(job, "job id"))
        if job_id not in self.known_jobs():
            raise ActionError(f"no guarded job {job_id!r} has run on this store (nor is it in the jobs file)", 404)
        with self._tasks() as store:
            code = trigger_code(job_id)  # the nodes that define the job serve it
            withdraw_stale_request(store, code, job_id)
            result = store.add(code, job_id, timedelta(0), {"requested_by": by}, on_conflict="keep")
            request = store.get(code, job_id)
        fire_time = request.due.isoformat() if request is not None else None
        shown = "a trigger was already pending" if result == "kept" else "requested"
        self.audit.add(by, "trigger", job_id, shown)
        return {"message": f"{job_id}: {shown}", "job": job_id, "fire_time": fire_time}

    def trigger_outcome(self, job: str, lock: str, fire_time: str | None) -> dict[str, Any]:
        """A read: the request's state, or, once it is gone, the run recorded for its fire time (else the
        first run after it: a scheduled run that claimed a later fire time first is the run it asked for)."""
        request = self.reader.task(trigger_code(job), job)
        if request is not None and (fire_time is None or request.due.isoformat() == fire_time):
            if request.state == "failed":
                return {"state": "error", "error": request.last_error, "node": request.owner}
            return {"state": request.state, "node": request.owner}
        wanted = as_utc(fire_time) if fire_time else None
        runs = self.reader.history(lock, job)
        run = (runs[0] if runs else None) if wanted is None else run_for(runs, wanted)
        if run is not None:
            merged = wanted is not None and run.fire_time != wanted  # a scheduled run that claimed a later fire time first
            return {"state": run.outcome, "node": run.node, "duration": run.duration, "error": run.error,
                    "fire_time": run.fire_time.isoformat() if run.fire_time else None, "merged": merged}  # fmt: skip
        return {"state": "done", "note": "the request is complete; no run history is kept for it"}

    # -- shared jobs ------------------------------------------------------------------------
    def shared_job(self, how: str, job: Any, by: str) -> dict[str, Any]:
        """``mutexcron jobs pause|resume|remove JOBS JOB``: the same compare-and-set write and notice."""
        from ..jobstores.admin import change_shared_job

        return self._shared_change(job, how, by, lambda stores, name: change_shared_job(stores, name, how))

    def _shared_change(self, job: Any, what: str, by: str, change: Callable[[dict[str, Any], str], str | None]) -> dict[str, Any]:
        """``change`` of the shared job ``job`` (its outcome; None: no store has it), recorded as ``job <what>``."""
        if not isinstance(job, str) or not job:
            raise ActionError("job: give the shared job's id")
        stores = self.shared_stores()
        if not stores:
            raise ActionError("no shared job store: start the dashboard with --jobs jobs.py naming one", 404)
        outcome = _checked(lambda: change(stores, job))
        if outcome is None:
            raise ActionError(f"no job {job!r} in the shared job stores", 404)
        self.audit.add(by, f"job {what}", job, outcome)
        return {"message": outcome}

    def reschedule(self, job: Any, schedule: Any, by: str) -> dict[str, Any]:
        """A shared job on a new schedule (a crontab line or ``every N`` seconds), the same write as pause."""
        from ..jobstores.admin import reschedule_shared_job

        return self._shared_change(job, "reschedule", by, lambda stores, name: reschedule_shared_job(stores, name, schedule))

    # -- tasks ------------------------------------------------------------------------------
    def retry(self, code: Any, key: Any, by: str) -> dict[str, Any]:
        """``mutexcron tasks retry CODE KEY``: a failed task is queued again, due now, attempts reset."""
        code, key = _checked(lambda: check_task(code, key))
        with self._tasks() as store:
            if not store.retry(code, key):
                task = store.get(code, key)
                why = "there is no such task" if task is None else f"it is {task.state}, not failed"
                raise ActionError(f"cannot retry {code}/{key}: {why}", 409)
        self.audit.add(by, "retry", f"{code}/{key}", "queued, due now")
        return {"message": f"retried: {code}/{key} is queued, due now"}

    def cancel(self, code: Any, key: Any, by: str) -> dict[str, Any]:
        """``mutexcron tasks cancel CODE KEY``: the task is dropped (a running one when its attempt ends)."""
        code, key = _checked(lambda: check_task(code, key))
        with self._tasks() as store:
            if not store.cancel(code, key):
                raise ActionError(f"no task {code}/{key}", 404)
        self.audit.add(by, "cancel", f"{code}/{key}", "cancelled")
        return {"message": f"cancelled: {code}/{key}"}

    def bulk(self, action: Any, selection: dict[str, Any], expected: Any, by: str) -> dict[str, Any]:
        """Retry or cancel every task the filter selects, if they are still the ``expected`` count
        the operator confirmed (else nothing is done: the selection changed under them)."""
        if action not in ("retry", "cancel"):
            raise ActionError(f"bulk action {action!r}: use retry or cancel")
        code, state, contains = (str(selection.get(k) or "") or None for k in ("code", "state", "key_contains"))
        if state is not None and state not in STATES:
            raise ActionError(f"state {state!r}: use one of {', '.join(STATES)}")
        if not isinstance(expected, int) or isinstance(expected, bool) or expected < 1:
            raise ActionError("confirm the count of tasks: expected must be a whole number of at least 1")
        with self._tasks() as store:
            tasks = store.list(code=code, key_contains=contains, state=state, limit=BULK_LIMIT + 1)
            if len(tasks) > BULK_LIMIT:
                raise ActionError(f"more than {BULK_LIMIT} tasks match: narrow the filter", 409)
            if len(tasks) != expected:
                raise ActionError(f"the selection changed: {len(tasks)} tasks match now, not the {expected} you confirmed; "
                                  "review it and confirm again", 409)  # fmt: skip
            apply = store.retry if action == "retry" else store.cancel
            done = sum(1 for task in tasks if apply(task.code, task.key))
        target = f"{expected} tasks ({_describe(code, state, contains)})"
        result = f"{done} {'retried' if action == 'retry' else 'cancelled'}, {expected - done} skipped"
        self.audit.add(by, f"bulk {action}", target, result)
        return {"message": f"{action}: {result}", "done": done, "skipped": expected - done}


def _describe(code: str | None, state: str | None, contains: str | None) -> str:
    parts = [f"code {code}" if code else "every code", f"state {state}" if state else "every state"]
    if contains:
        parts.append(f"key contains {contains!r}")
    return ", ".join(parts)


def _tell_feed(store: LockStore, event: FeedEvent) -> None:
    """Keep a pause or resume in the event feed at once, by whom (a node sees it only at its next
    read of the lock, and a quick pause and resume not at all). The action is done: a feed that
    cannot be written is logged, never an error."""
    try:
        feed = feed_store_for(store)
        if feed is not None:
            feed.append([event])
    except Exception:
        log.warning("%s: not kept in the event feed", event.text, exc_info=True)
