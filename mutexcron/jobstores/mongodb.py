"""APScheduler's ``MongoDBJobStore``, shared.

Same collection and documents (``_id``, ``next_run_time``, ``job_state``). Each write is one
operation with a filter on the state read (``update_one({_id, job_state: <read>})``), an add is
``insert_one`` (a duplicate id is refused by the server). No notices: each node reads a change
counter (``<collection>_changes``, bumped after each announced write) every :data:`POLL` seconds,
and the collection when it moved; a change made in this process wakes its watchers at once.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from apscheduler.jobstores.mongodb import MongoDBJobStore
from bson.binary import Binary
from pymongo import ASCENDING
from pymongo.errors import DuplicateKeyError

from ..tasks.wakeups.listen import LOCAL_WAKERS, RegisteredPollWaker
from .base import SharedJobStore

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

#: Seconds between two reads of the collection by each node.
POLL = 0.5
CODE = "jobs"


class SharedMongoDBJobStore(SharedJobStore, MongoDBJobStore):  # type: ignore[misc]
    """A ``MongoDBJobStore`` every node shares (made from yours by ``MutexScheduler.start()``)."""

    collection: Any

    @property
    def where(self) -> str:
        return f"MongoDB job collection {self.collection.full_name}"

    @property
    def _local_key(self) -> str:
        return f"jobstore:mongodb:{self.collection.full_name}"

    # -- the change counter ----------------------------------------------------------------------
    @property
    def _changes(self) -> Any:
        """``<collection>_changes``: one document whose ``v`` every announced write bumps (after the write)."""
        return self.collection.database[f"{self.collection.name}_changes"]

    def change_marker(self) -> object | None:
        doc = self._changes.find_one({"_id": "version"})
        return None if doc is None else doc.get("v")

    # -- reads ---------------------------------------------------------------------------------
    def _read_states(self, ids: Collection[str] | None = None) -> dict[str, bytes]:
        query: dict[str, Any] = {} if ids is None else {"_id": {"$in": sorted(ids)}}
        return {doc["_id"]: bytes(doc["job_state"]) for doc in self.collection.find(query, ["_id", "job_state"])}

    def _read_due(self, ts: float, ids: Collection[str]) -> list[tuple[str, bytes]]:
        query = {"_id": {"$in": sorted(ids)}, "next_run_time": {"$lte": ts}}
        found = self.collection.find(query, ["_id", "job_state"], sort=[("next_run_time", ASCENDING)])
        return [(doc["_id"], bytes(doc["job_state"])) for doc in found]

    def _earliest(self, ids: Collection[str]) -> float | None:
        doc = self.collection.find_one(
            {"_id": {"$in": sorted(ids)}, "next_run_time": {"$ne": None}},
            projection=["next_run_time"],
            sort=[("next_run_time", ASCENDING)],
        )
        return None if doc is None else float(doc["next_run_time"])

    # -- writes --------------------------------------------------------------------------------
    def _insert(self, job_id: str, ts: float | None, state: bytes) -> bool:
        try:
            self.collection.insert_one({"_id": job_id, "next_run_time": ts, "job_state": Binary(state)})
        except DuplicateKeyError:
            return False
        self._announce()
        return True

    def _replace(self, job_id: str, base: bytes, ts: float | None, state: bytes, announce: bool) -> bool:
        result = self.collection.update_one(
            {"_id": job_id, "job_state": Binary(base)}, {"$set": {"next_run_time": ts, "job_state": Binary(state)}}
        )
        done: bool = result.matched_count == 1
        if done and announce:
            self._announce()
        return done

    def _delete(self, job_id: str, base: bytes | None) -> bool:
        query: dict[str, Any] = {"_id": job_id} if base is None else {"_id": job_id, "job_state": Binary(base)}
        done: bool = self.collection.delete_one(query).deleted_count == 1
        if done:
            self._announce()
        return done

    def _delete_all(self) -> None:
        self.collection.delete_many({})
        self._announce()

    def _announce(self) -> None:
        # After the write: a watcher that reads the new counter reads the new jobs.
        self._changes.update_one({"_id": "version"}, {"$inc": {"v": 1}}, upsert=True)
        LOCAL_WAKERS.notify(self._local_key, CODE)

    def waker(self) -> Waker:
        return RegisteredPollWaker(self._local_key, [CODE], POLL)
