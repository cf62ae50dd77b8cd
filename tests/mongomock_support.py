"""MongoDB lock stores on mongomock for the contract suite: the store's logic, an injected clock.

What this does and does not test:

* mongomock runs the store's real filters and update pipelines, so every contract test checks
  the logic (staleness by the holder's stored ttl, tokens, fencing, fire claims, attrs).
* mongomock does not know ``$$NOW``: the store's ``now=`` seam gives it a date driven by a
  :class:`~tests.backends.FakeClock` instead. ``tests/test_mongodb.py`` checks that the
  production store sends ``$$NOW``.
* mongomock's ``find_one_and_update`` is a find followed by an update, not one atomic step as on
  a real server. :class:`SerializedClient` runs every mongomock call under one lock so the
  thread-race test exercises the store's logic; it says nothing about a real server's atomicity.
  Only the contract suite against a real server (``MUTEXCRON_TEST_MONGODB_URL``) does.
* mongomock has no indexes: every query scans (and ``aggregate`` copies) the whole collection,
  which makes the 1,000-round race test take minutes. :func:`_index_by_id` gives each collection
  an ``_id`` lookup; the filter is still applied to the documents found, so results are the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import mongomock
import mongomock.aggregate
import mongomock.collection
import mongomock.command_cursor
from mongomock.filtering import filter_applies

from mutexcron.locks import LockStore
from mutexcron.locks.mongodb import MongoDBLockStore
from tests.backends import FakeClock

#: FakeClock seconds are counted from here (any date works; this one is far from the epoch).
CLOCK_ORIGIN = datetime(2030, 1, 1, tzinfo=timezone.utc)


class SerializedClient:
    """A proxy over a mongomock object that runs every method call under one shared lock.

    Databases and collections obtained through it (``get_database``, ``get_collection``,
    ``with_options``, ``client[...]``) are wrapped too and share the lock.
    """

    _WRAPPED = (mongomock.MongoClient, mongomock.Database, mongomock.Collection)

    def __init__(self, target: Any, lock: threading.RLock | None = None) -> None:
        self._target = target
        self._lock = lock or threading.RLock()

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, mongomock.Collection):
            _index_by_id(value)
        return SerializedClient(value, self._lock) if isinstance(value, self._WRAPPED) else value

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value) or isinstance(value, self._WRAPPED):
            return self._wrap(value)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                result = value(*args, **kwargs)
                # Cursors are lazy: drain them under the lock too.
                if isinstance(result, (mongomock.command_cursor.CommandCursor, mongomock.collection.Cursor)):
                    return iter(list(result))
                return self._wrap(result)

        return call

    def __getitem__(self, name: str) -> Any:
        with self._lock:
            return self._wrap(self._target[name])

    def __repr__(self) -> str:
        return f"SerializedClient({self._target!r})"


def _ids(query: Any) -> list[str] | None:
    """The string ``_id`` values a query is limited to (``_id: x`` or ``_id: {$in: [...]}``), if any."""
    if not isinstance(query, dict):
        return None
    ident = query.get("_id")
    if isinstance(ident, str):
        return [ident]
    if isinstance(ident, dict) and set(ident) == {"$in"} and all(isinstance(i, str) for i in ident["$in"]):
        return list(dict.fromkeys(ident["$in"]))
    return None


def _index_by_id(collection: mongomock.Collection) -> None:
    """Make ``_id`` queries and ``$match``-first aggregations on ``collection`` look documents up by ``_id``.

    Test speed only. Relies on mongomock 4.3 internals (``_iter_documents``, ``_store``).
    """
    if getattr(collection, "_mutexcron_indexed", False):
        return
    scan = collection._iter_documents
    store = collection._store

    def iter_documents(query: Any) -> Any:
        ids = _ids(query)
        if ids is None:
            return scan(query)
        found = [store[i] for i in ids if i in store]
        return (doc for doc in found if filter_applies(query, doc))

    def aggregate(pipeline: list[dict[str, Any]], session: Any = None, **kwargs: Any) -> Any:
        # mongomock's own aggregate is find() (all documents) then the pipeline: push a leading
        # $match into the find so it can use the _id lookup.
        if pipeline and set(pipeline[0]) == {"$match"}:
            docs = list(collection.find(pipeline[0]["$match"]))
            result = mongomock.aggregate.process_pipeline(docs, collection.database, pipeline[1:], session)
            return mongomock.command_cursor.CommandCursor(result)
        return type(collection).aggregate(collection, pipeline, session=session, **kwargs)

    collection._iter_documents = iter_documents
    collection.aggregate = aggregate
    collection._mutexcron_indexed = True


def open_mongomock(tag: str) -> tuple[Callable[[], LockStore], FakeClock]:
    """A factory of MongoDBLockStores sharing one mongomock collection, and the clock they use.

    Every store made by the factory is a separate instance (as on separate nodes) over the same
    mongomock client, database and collection ``mc_test_<tag>``, with "now" = the FakeClock.
    """
    clock = FakeClock()
    client = SerializedClient(mongomock.MongoClient(tz_aware=True))
    url = f"mongodb://mongomock.invalid/mutexcron_test?collection=mc_test_{tag}"

    def now() -> datetime:
        # Aware UTC: the tz_aware mongomock client compares it with the dates it returns.
        return CLOCK_ORIGIN + timedelta(seconds=clock())

    def factory() -> LockStore:
        return MongoDBLockStore(url, client=client, now=now)

    return factory, clock


def open_mongomock_tasks(tag: str) -> tuple[Callable[[], Any], FakeClock]:
    """A factory of MongoDBTaskStores sharing one mongomock collection, and the clock they use.

    As :func:`open_mongomock`: separate store instances (as on separate nodes) over one serialized
    mongomock client, task collection ``mc_tasks_<tag>``, "now" = the FakeClock (the store's
    clock: due times, claims and leases; a test moves it instead of sleeping).
    """
    from mutexcron.tasks.stores.mongodb import MongoDBTaskStore

    clock = FakeClock()
    client = SerializedClient(mongomock.MongoClient(tz_aware=True))
    url = f"mongodb://mongomock.invalid/mutexcron_test?tasks_collection=mc_tasks_{tag}"

    def now() -> datetime:
        return CLOCK_ORIGIN + timedelta(seconds=clock())

    def factory() -> MongoDBTaskStore:
        return MongoDBTaskStore(url, client=client, now=now)

    return factory, clock


def _bulk_update_takes_sort() -> None:
    """mongomock 4.3's bulk builder predates pymongo 4.11, whose ``UpdateOne`` passes ``sort=``
    (None here): the store's ``claim_many`` uses ``bulk_write``, so let mongomock accept it."""
    import inspect

    from mongomock.collection import BulkOperationBuilder

    original = BulkOperationBuilder.add_update
    if "sort" in inspect.signature(original).parameters:
        return

    def add_update(self: Any, *args: Any, sort: Any = None, **kwargs: Any) -> Any:
        if sort is not None:
            raise NotImplementedError("sort in a bulk update (mongomock)")
        return original(self, *args, **kwargs)

    BulkOperationBuilder.add_update = add_update


_bulk_update_takes_sort()


def assert_each_unavailable_quickly(operations: dict[str, Callable[[], Any]]) -> None:
    """Each operation on a store pointed at ``mongodb://user:s3cret@127.0.0.1:1/...`` raises
    StoreUnavailableError within 5 s, with the URL masked."""
    import time

    import pytest

    from mutexcron.errors import StoreUnavailableError

    for name, operation in operations.items():
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            operation()
        assert time.monotonic() - started < 5, f"{name} hung"
        assert "s3cret" not in str(info.value) and "user:***@127.0.0.1:1" in str(info.value), name
