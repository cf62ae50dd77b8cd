"""The finish times the task stores keep, for the Tasks page's throughput chart: a read, never a write.

A finished (or cancelled) task leaves the store. The SQL and MongoDB stores keep its *tombstone*
(state ``done``, holding the token so that tokens only go up across occurrences), whose
``updated`` is when it finished, by the store's clock: one per ``(code, key)``, for its latest
occurrence. That is all the history there is: a key that finished twice counts once (its latest
finish), a key added again since counts not at all (its tombstone became the task again), and a
cancel counts as a finish. The Redis and memory stores keep no tombstone (one store-wide token
floor): they have nothing to derive a throughput from.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..tasks import TaskStore
from ..timeutil import as_utc

__all__ = ["finished_since"]

_FINISHED = (
    "SELECT code, updated FROM {t} WHERE run_at IS NULL AND code <> '' AND state = 'done' AND updated >= :since "
    "ORDER BY updated DESC LIMIT :limit"
)


def finished_since(store: TaskStore, since: datetime, limit: int) -> list[tuple[str, datetime]]:
    """``(code, finished at)`` of the tasks whose tombstone was written at or after ``since`` (the
    store's clock), newest first, at most ``limit``.

    Raises:
        NotImplementedError: the store keeps no finished task.
        MutexcronError: the store's error.
    """
    from ..tasks.stores.sql import SQLTaskStore

    if isinstance(store, SQLTaskStore):
        return _sql(store, since, limit)
    if type(store).__module__ == "mutexcron.tasks.stores.mongodb":  # imported only for a MongoDB store (its driver)
        return _mongodb(store, since, limit)
    raise NotImplementedError(f"{store.masked_url} keeps no finished task (finished tasks are deleted)")


def _sql(store: Any, since: datetime, limit: int) -> list[tuple[str, datetime]]:
    """Tombstones have no ``run_at`` (the ``(code, run_at)`` index's NULLs); the state and time are read per row."""
    from ..tasks.stores.sql_statements import STATEMENTS

    sql = _FINISHED.replace("{t}", store.table)  # a table name the store checked (letters, digits, _)
    since_param = STATEMENTS[store.backend.dialect.name].time_param(since)
    rows, _count = store.backend.execute(sql, {"since": since_param, "limit": limit}, "finished tasks")
    return _pairs((row[0], row[1]) for row in rows)


def _mongodb(store: Any, since: datetime, limit: int) -> list[tuple[str, datetime]]:
    with store.backend.errors("finished tasks"):
        query = {"state": "done", "code": {"$ne": ""}, "updated": {"$gte": since}}
        docs = list(store.collection.find(query, {"_id": 0, "code": 1, "updated": 1}, sort=[("updated", -1)], limit=limit))
    return _pairs((doc.get("code"), doc.get("updated")) for doc in docs)


def _pairs(rows: Any) -> list[tuple[str, datetime]]:
    found = []
    for code, updated in rows:
        when = as_utc(updated)
        if code is not None and when is not None:
            found.append((str(code), when))
    return found
