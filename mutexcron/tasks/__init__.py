"""The durable task pool: one-off tasks the whole cluster shares, chosen by URL scheme.

Drivers are imported only when a store is built. Each store family's task store is the
``task_store`` slot of its row in :data:`mutexcron.backends.FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from ..backends import FAMILIES, build, family_of
from ..errors import ConfigurationError
from .base import (
    ON_CONFLICT,
    STATES,
    AddResult,
    CodeSummary,
    Done,
    Due,
    Fail,
    NewTask,
    Outcome,
    Reschedule,
    Retry,
    TaskRecord,
    TaskStore,
)
from .wakeups.base import Waker

__all__ = [
    "ON_CONFLICT",
    "STATES",
    "AddResult",
    "CodeSummary",
    "Done",
    "Due",
    "Fail",
    "NewTask",
    "Outcome",
    "Reschedule",
    "Retry",
    "TaskRecord",
    "TaskStore",
    "Waker",
    "task_store_from_url",
]


def task_store_from_url(url: str, **options: Any) -> TaskStore:
    """Build the task store for ``url`` (the same URL as the lock store's).

    Args:
        url: the store URL; its scheme selects the family (:data:`mutexcron.backends.FAMILIES`).
        **options: passed to the store class (and from there to its backend).

    Raises:
        ConfigurationError: the URL has no known scheme, its family has no task store yet, or its
            driver is not installed.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError("empty store URL for the task pool; use e.g. sqlite:///mutexcron.db or postgresql://...")
    url = url.strip()
    row = family_of(url, "task store")
    if row.task_store is None:
        served = ", ".join(r.name for r in FAMILIES if r.task_store)
        raise ConfigurationError(
            f"the {row.name} store has no task pool yet: use one of {served} for tasks (the lock store can stay on {row.name})"
        )
    store: TaskStore = build(row, row.task_store, url, **options)
    return store
