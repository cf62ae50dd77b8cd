"""The ends of task occurrences the task stores keep, finished and cancelled apart, for the Tasks
page's throughput chart: a read, never a write.

An occurrence that ends leaves the store. The SQL and MongoDB stores keep its *tombstone* (state
``done``, holding the token so that tokens only go up across occurrences), whose ``updated`` is
when it ended, by the store's clock, and whose ``cancel_requested`` says a cancel ended it (set in
the same write that made the tombstone). One per ``(code, key)``, for its latest occurrence: that
is all the history there is: a key that finished twice counts once (its latest end), and a key
added again since counts not at all (its tombstone became the task again). The Redis and memory
stores keep no tombstone: the script (or call) that ends an occurrence counts it in a per-minute
counter of its code, finished or cancelled, kept two hours (every end counts).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from ..tasks import TaskStore
from ..timeutil import as_utc

__all__ = ["Finish", "finished_since"]

_FINISHED = (
    "SELECT code, updated, cancel_requested FROM {t} "
    "WHERE run_at IS NULL AND code <> '' AND state = 'done' AND updated >= :since "
    "ORDER BY updated DESC LIMIT :limit"
)


class Finish(NamedTuple):
    """``occurrences`` of ``code`` that ended at ``at`` (a tombstone's time, or the start of a
    counted minute), finished or ``cancelled``."""

    code: str
    at: datetime
    cancelled: bool
    occurrences: int = 1


def finished_since(store: TaskStore, since: datetime, limit: int) -> list[Finish]:
    """The occurrences that ended at or after ``since`` (the store's clock; a counting store: from
    the start of its minute), newest first, at most ``limit`` entries.

    Raises:
        NotImplementedError: the store keeps no ended occurrence.
        MutexcronError: the store's error.
    """
    from ..tasks.stores.sql import SQLTaskStore

    if isinstance(store, SQLTaskStore):
        return _sql(store, since, limit)
    if type(store).__module__ == "mutexcron.tasks.stores.mongodb":  # imported only for a MongoDB store (its driver)
        return _mongodb(store, since, limit)
    counted = getattr(store, "finished_per_minute", None)  # the Redis and memory stores' counters
    if counted is not None:
        found = [Finish(code, at, cancelled, n) for code, cancelled, at, n in counted(since)]
        return sorted(found, key=lambda finish: (finish.at, finish.code, finish.cancelled), reverse=True)[:limit]
    raise NotImplementedError(f"{store.masked_url} keeps no finished task (finished tasks are deleted)")


def _sql(store: Any, since: datetime, limit: int) -> list[Finish]:
    """Tombstones have no ``run_at`` (the ``(code, run_at)`` index's NULLs); the state and time are read per row."""
    from ..tasks.stores.sql_statements import STATEMENTS

    sql = _FINISHED.replace("{t}", store.table)  # a table name the store checked (letters, digits, _)
    since_param = STATEMENTS[store.backend.dialect.name].time_param(since)
    rows, _count = store.backend.execute(sql, {"since": since_param, "limit": limit}, "finished tasks")
    return _finishes((row[0], row[1], row[2]) for row in rows)


def _mongodb(store: Any, since: datetime, limit: int) -> list[Finish]:
    with store.backend.errors("finished tasks"):
        query = {"state": "done", "code": {"$ne": ""}, "updated": {"$gte": since}}
        shown = {"_id": 0, "code": 1, "updated": 1, "cancel_requested": 1}
        docs = list(store.collection.find(query, shown, sort=[("updated", -1)], limit=limit))
    return _finishes((doc.get("code"), doc.get("updated"), doc.get("cancel_requested")) for doc in docs)


def _finishes(rows: Any) -> list[Finish]:
    found = []
    for code, updated, cancelled in rows:
        when = as_utc(updated)
        if code is not None and when is not None:
            found.append(Finish(str(code), when, bool(cancelled)))
    return found
