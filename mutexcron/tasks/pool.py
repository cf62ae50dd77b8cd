"""``TaskPool``: what producers use to add, cancel, inspect and retry tasks. No scheduler needed.

A web app, a script or a Celery task writes tasks with it; the nodes that run handlers claim
them (the worker side comes with the scheduler integration).
"""

from __future__ import annotations

import os
from datetime import datetime
from types import TracebackType
from typing import Any

from ..locks import DEFAULT_LOCK_URL
from . import task_store_from_url
from .base import AddResult, Due, TaskRecord, TaskStore

__all__ = ["TaskPool"]

#: The environment variable every mutexcron command reads the store URL from.
URL_ENV = "MUTEXCRON_LOCK_URL"


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
        if isinstance(url, TaskStore):
            if options:
                raise TypeError("options belong to the store: build it with them, or pass a URL")
            self.store = url
        else:
            self.store = task_store_from_url(url or os.environ.get(URL_ENV) or DEFAULT_LOCK_URL, **options)

    def __repr__(self) -> str:
        return f"TaskPool({self.store.masked_url!r})"

    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        """Add the task ``(code, key)`` or update it (see :meth:`TaskStore.add`): inserted, replaced, kept or pending."""
        return self.store.add(code, key, due, payload, on_conflict=on_conflict)

    def cancel(self, code: str, key: str) -> bool:
        """Drop the task (a running one when its attempt ends). False if there is no such task."""
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

    def close(self) -> None:
        """Release the store's connections."""
        self.store.close()

    def __enter__(self) -> TaskPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
