"""The feed of a MongoDB store: the collection ``<lock collection>_feed``, one document per event
stamped with the server's ``$$NOW`` (an update pipeline: an insert cannot use it); each append
drops the documents past the newest :attr:`~.FeedStore.max_events` and those older than
:data:`~.RETENTION`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from bson import ObjectId

from ...timeutil import as_utc
from . import RETENTION, FeedEvent, FeedStore

__all__ = ["MongoDBFeedStore"]


class MongoDBFeedStore(FeedStore):
    """The feed beside the lock collection of a MongoDB ``backend`` (:class:`mutexcron.backends.mongodb.MongoDBBackend`)."""

    ages_on_host = False  # stamped with the server's clock

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.collection = backend.collection(f"{backend.collection_name}_feed")

    def append(self, events: list[FeedEvent]) -> None:
        if not events:
            return
        with self.backend.errors("appending to the event feed"):
            for event in events:
                now = self.backend.now_expr()
                fields = {"at": now, "kind": event.kind, "node": event.node, "subject": event.subject, "body": event.body()}
                self.collection.update_one({"_id": ObjectId()}, [{"$set": fields}], upsert=True)
            newest = self.collection.find_one({}, {"at": 1}, sort=[("at", -1)])
            past = list(self.collection.find({}, {"_id": 1}, sort=[("at", -1), ("_id", -1)], skip=self.max_events, limit=1))
            if past:  # the newest max_events stay
                self.collection.delete_many({"_id": {"$lte": past[0]["_id"]}})
            stamp = as_utc(newest.get("at")) if newest is not None else None  # the store's clock: the newest stamp
            if stamp is not None:
                self.collection.delete_many({"at": {"$lt": stamp - timedelta(seconds=RETENTION)}})

    def recent(self, limit: int, *, kinds: tuple[str, ...] = (), node: str | None = None,
               subject: str | None = None) -> list[FeedEvent]:  # fmt: skip
        query: dict[str, Any] = {}
        if kinds:
            query["kind"] = {"$in": list(kinds)}
        if node:
            query["node"] = node
        if subject:
            query["subject"] = subject
        with self.backend.errors("reading the event feed"):
            docs = list(self.collection.find(query, {"_id": 0}, sort=[("at", -1), ("_id", -1)], limit=limit))
        return [FeedEvent.from_stored(d["kind"], d.get("node"), d.get("subject"), d["body"], as_utc(d.get("at"))) for d in docs]
