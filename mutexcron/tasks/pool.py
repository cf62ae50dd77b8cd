"""``TaskPool``: add, cancel, inspect and retry tasks, and register the handlers that run them.

Producers (a web app, a script, a Celery task) need no scheduler: ``TaskPool(url).add(...)``.
Workers are the nodes that run ``mutexcron run jobs.py``: the handlers registered on the
scheduler's pool (``sched.tasks``) are run there by a :class:`~mutexcron.tasks.worker.TaskWorker`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

from ..errors import ConfigurationError
from ..locks import default_lock_url
from ..urls import mask_url
from . import task_store_from_url
from .base import AddResult, Due, NewTask, TaskRecord, TaskStore
from .handlers import DEFAULT_MAX_ATTEMPTS, DEFAULT_TASK_LEASE, Handler, Task, public_codes

F = TypeVar("F", bound=Callable[[Task], Any])

__all__ = ["TaskPool"]

#: Tasks a bulk operation (``retry_failed``, ``cancel_many``) lists at a time.
BULK_PAGE = 1000


#: Serializes handler additions (rare), so that two threads adding codes at once lose neither.
_ADDING_HANDLERS = threading.Lock()


class TaskPool:
    """The durable task pool on one store.

    Args:
        url: a store URL (``postgresql://app@db/ops``, ``sqlite:///path.db``...) or a ready
            :class:`~mutexcron.tasks.TaskStore`. Default: ``$MUTEXCRON_LOCK_URL``, else
            ``sqlite:///mutexcron.db``: the same store as the cron locks.
        **options: passed to the store (with a URL only).

    Example::

        pool = TaskPool("postgresql://app@db/ops")
        pool.add("end_promotion", "sku-123", due=timedelta(days=3), payload={"pct": 20})
    """

    def __init__(self, url: str | TaskStore | None = None, **options: Any) -> None:
        self._store: TaskStore | None = None
        self._url = ""
        self._options = options
        self._build_lock = threading.Lock()
        self.handlers: dict[str, Handler] = {}
        self._on_add: Callable[[str], None] | None = None  # wakes this process's worker
        self._on_handler: Callable[[Handler], None] | None = None  # a handler added once the worker runs
        if isinstance(url, TaskStore):
            if options:
                raise TypeError("options belong to the store: build it with them, or pass a URL")
            self._store = url
        else:
            self._url = url or default_lock_url("TaskPool()")
            self.store  # noqa: B018 - a bad URL fails here, not at the first add

    @classmethod
    def _bound(cls, url: str) -> TaskPool:
        """A pool whose store is built on first use (a scheduler's: its URL may still change)."""
        pool = cls.__new__(cls)
        pool._store, pool._url, pool._options, pool._build_lock = None, url, {}, threading.Lock()
        pool.handlers, pool._on_add, pool._on_handler = {}, None, None
        return pool

    def _rebind(self, url: str) -> None:
        if self._store is not None and self._url != url:
            raise ConfigurationError("the task pool's store is already in use: set the store URL before using sched.tasks")
        self._url = url

    @property
    def store(self) -> TaskStore:
        """The task store (built from the URL on first use)."""
        if self._store is None:
            with self._build_lock:
                if self._store is None:
                    self._store = task_store_from_url(self._url, **self._options)
        return self._store

    @property
    def masked_url(self) -> str:
        return self._store.masked_url if self._store is not None else mask_url(self._url)

    def __repr__(self) -> str:
        return f"TaskPool({self.masked_url!r})"

    # -- handlers (run by the nodes' workers) ---------------------------------------------------
    def handler(
        self,
        code: str,
        *,
        lease: float = DEFAULT_TASK_LEASE,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff: float = 10.0,
        backoff_max: float = 3600.0,
        jitter: float = 0.5,
        poll: float | None = None,
    ) -> Callable[[F], F]:
        """Register ``func(task)`` as the handler of task code ``code`` (see :class:`Handler`).

        Example::

            @sched.tasks.handler("end_promotion", lease=30, max_attempts=5)
            def end_promotion(task):
                promotions.end(task.key, pct=task.payload["pct"])
        """

        def register(func: F) -> F:
            self.add_handler(Handler(code, func, lease, max_attempts, backoff, backoff_max, jitter, poll))
            return func

        return register

    def add_handler(self, handler: Handler) -> None:
        """Register a ready :class:`Handler`. One handler per code. Once the scheduler's worker
        runs, it serves the new code too (from its next look at the store)."""
        with _ADDING_HANDLERS:  # the heartbeat thread adds trigger codes while the app may add jobs
            existing = self.handlers.get(handler.code)
            if existing is not None and existing.func is not handler.func:
                raise ConfigurationError(
                    f"task code {handler.code!r} already has a handler ({existing.name}); one handler per code"
                )
            self.handlers = {**self.handlers, handler.code: handler}  # replaced: a reader on another thread iterates it
        if self._on_handler is not None:
            self._on_handler(handler)

    def codes(self) -> list[str]:
        """The codes with a handler in this pool (mutexcron's own, such as the trigger requests', left out)."""
        return public_codes(self.handlers)

    def add(
        self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace", transaction: Any = None
    ) -> AddResult:
        """Add the task ``(code, key)`` or update it (see :meth:`TaskStore.add`): inserted, replaced, kept or pending.

        Args:
            transaction: your open transaction on the store's database (SQL stores): a SQLAlchemy
                ``Connection`` or ``Session``, a DB-API connection (psycopg, PyMySQL, sqlite3...), or
                Django's ``connection`` inside ``transaction.atomic()``. The task is written with
                your writes and exists if and only if your transaction commits
                (:mod:`mutexcron.tasks.transactions`).
        """
        if transaction is not None:
            return self.store.add_many_in(transaction, [NewTask(code, key, due, payload)], on_conflict=on_conflict)[0]
        result = self.store.add(code, key, due, payload, on_conflict=on_conflict)
        if self._on_add is not None and code in self.handlers:
            self._on_add(code)
        return result

    def add_many(
        self, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace", transaction: Any = None
    ) -> list[AddResult]:
        """:meth:`add` many tasks at once, each a :class:`~mutexcron.tasks.NewTask` or a tuple
        ``(code, key, due)`` / ``(code, key, due, payload)``; one result per task, in order.

        Every task is checked first: a bad one, or the same ``(code, key)`` twice, raises and adds
        nothing. SQL stores write the batch in one transaction (all or nothing); Redis sends it in
        one script call per 1,000 tasks; MongoDB adds one task at a time (:meth:`TaskStore.add_many`).

        Args:
            transaction: your open transaction on the store's database, as for :meth:`add`: the
                whole batch commits with your writes, or not at all.

        Example::

            pool.add_many([("email", f"user-{u.id}", timedelta(minutes=5), {"to": u.email}) for u in users])
        """
        batch = tasks if isinstance(tasks, (str, bytes, Mapping)) else list(tasks)  # the store refuses the former
        if transaction is not None:
            return self.store.add_many_in(transaction, batch, on_conflict=on_conflict)
        results = self.store.add_many(batch, on_conflict=on_conflict)
        if self._on_add is not None:
            for code in {task[0] for task in batch} & set(self.handlers):
                self._on_add(code)
        return results

    def cancel(self, code: str, key: str, *, transaction: Any = None) -> bool:
        """Drop the task (a running one when its attempt ends). False if there is no such task.

        ``transaction``: your open transaction on the store's database, as for :meth:`add`: the
        cancel commits with it, or not at all.
        """
        if transaction is not None:
            return self.store.cancel_in(transaction, code, key)
        return self.store.cancel(code, key)

    def get(self, code: str, key: str) -> TaskRecord | None:
        """The task, or None."""
        return self.store.get(code, key)

    def list(
        self,
        *,
        code: str | None = None,
        key_contains: str | None = None,
        due_before: datetime | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> list[TaskRecord]:
        """Tasks by due time, filtered (see :meth:`TaskStore.list`)."""
        return self.store.list(code=code, key_contains=key_contains, due_before=due_before, state=state, limit=limit)

    def retry(self, code: str, key: str) -> bool:
        """Queue a failed task again, due now. False if it is not failed."""
        return self.store.retry(code, key)

    def retry_failed(self, *, code: str | None = None, key_contains: str | None = None) -> int:
        """Queue every failed task (of ``code``, whose key contains ``key_contains``) again, due
        now, attempts reset, one :meth:`retry` each. Returns how many were queued again."""
        return self._each(lambda t: self.store.retry(t.code, t.key), code=code, key_contains=key_contains, state="failed")

    def cancel_many(self, *, code: str, key_contains: str | None = None, state: str | None = None) -> int:
        """:meth:`cancel` every task of ``code`` whose key contains ``key_contains`` (in ``state``,
        if given); running ones are dropped when their attempt ends. Returns how many were cancelled."""
        return self._each(lambda t: self.store.cancel(t.code, t.key), code=code, key_contains=key_contains, state=state)

    def _each(self, act: Callable[[TaskRecord], bool], **where: Any) -> int:
        """``act`` on every task :meth:`list` finds with ``where``, a page at a time, each task once."""
        done, seen = 0, set[tuple[str, str]]()
        while True:
            # Acted-on tasks usually leave the filter, but not all (a running task being cancelled,
            # an act that changed nothing): ask for the seen ones plus a page, so a page of seen
            # tasks never hides the rest.
            rows = self.store.list(**where, limit=len(seen) + BULK_PAGE)
            page = [t for t in rows if (t.code, t.key) not in seen]
            if not page:  # fewer rows than the limit, all seen: nothing left
                return done
            for task in page:
                seen.add((task.code, task.key))
                done += bool(act(task))

    def purge(self, older_than: timedelta, *, code: str | None = None) -> int:
        """Remove the finished and cancelled tasks' tombstones older than ``older_than`` by the
        store's clock (of ``code`` only, if given), in batches of at most 1,000, each one short
        statement; never a queued, running or failed task. Tokens still only go up: a key added
        again after its purge gets a token above every one it had (see
        :mod:`mutexcron.tasks.retention`). Returns how many were removed (0 on Redis and memory,
        which keep no tombstone).

        A running cluster does it by itself (``MutexScheduler(task_retention=...)``, 7 days by default).
        """
        from .retention import purge

        return purge(self.store, older_than, code=code)

    def close(self) -> None:
        """Release the store's connections."""
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> TaskPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
