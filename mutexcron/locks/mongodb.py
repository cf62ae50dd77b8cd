"""``mongodb://`` and ``mongodb+srv://``: the MongoDB lock store.

One document per lock in one collection, ``_id`` = the lock name::

    {_id, holder, active_ip, hb: <date>, ttl: <ms>, token, attrs: <JSON text>,
     fires: {<job>: [fire_us, nonce]}, last_run_started, last_run_finished, last_error}

A release never deletes the document (holder null, hb at the epoch), so the fencing token keeps
growing. Every write is one command (``find_one_and_update`` with an update pipeline, or an
``update_many``/``update_one``) judged by the server's clock, ``$$NOW``: a holder is stale when
``hb < $$NOW - ttl``, with the ttl the *holder* stored. Attrs are stored as the JSON text
:func:`~mutexcron.record.dump_attrs` makes, so every JSON value round-trips exactly (``$``-prefixed
and dotted keys, integers beyond 64 bits) on every server version.

``claim_many`` is one ``bulk_write`` (one ``update`` command): per lock an ``update_one`` filtered on
holder and token whose pipeline renews ``hb`` and writes each newer claim, then one ``find`` of
the claimed documents to say which claims are ours. Two round trips: a bulk write reports only
how many documents matched, not which ones, nor what they hold now (see
:meth:`MongoDBLockStore.claim_many`).

Writes use write concern ``majority`` and reads the primary. A write whose outcome is unknown
(a write-concern error or timeout) is never assumed to have happened, nor not to have happened:
an acquire reports ``uncertain`` (with the majority-committed document as the record), a
heartbeat or renewal raises StoreUnavailableError, and a release is reported done only if the
majority-committed document shows it.

The client, the collection, the clock and the error translation are the
:class:`~mutexcron.backends.mongodb.MongoDBBackend`'s; this module holds the lock documents'
filters, update pipelines and parsing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pymongo.errors
from pymongo import ReturnDocument, UpdateOne

from ..backends.base import UncertainOutcome
from ..backends.mongodb import MongoDBBackend
from ..record import LockRecord, dump_attrs, load_attrs
from ..timeutil import EPOCH, as_utc
from .base import (
    AcquireResult,
    BatchClaimResult,
    FireClaim,
    HeldClaim,
    LockStore,
    Node,
    RunInfo,
    claim_won,
    fire_times_from_json,
    group_claims,
    won_claims,
)

log = logging.getLogger(__name__)

__all__ = ["MongoDBLockStore"]

_MIN_INT64 = -(2**63)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class MongoDBLockStore(LockStore):
    """Named, leased, fenced locks in a MongoDB collection (MongoDB >= 4.2; 5.0+ recommended).

    Args:
        url: ``mongodb://`` or ``mongodb+srv://``; the database comes from the path (default
            ``mutexcron``), the collection from ``?collection=`` (default ``mutexcron_locks``).
            Or a ready :class:`MongoDBBackend`.
        client: with a URL: a ready client to use instead of building one (tests inject a
            ``mongomock.MongoClient``); the store then does not close it.
        now: with a URL, tests only: a callable returning the date to use as "now" instead of the
            server's ``$$NOW`` (which mongomock does not know). Production code never passes it.
        **options: with a URL: extra ``pymongo.MongoClient`` keyword options; they win over the URL
            and the defaults.
    """

    def __init__(
        self, url: str | MongoDBBackend, *, client: Any = None, now: Callable[[], Any] | None = None, **options: Any
    ) -> None:
        if isinstance(url, MongoDBBackend):
            if client is not None or now is not None or options:
                raise TypeError("connection options belong to the backend: MongoDBBackend(url, client=..., now=...)")
            backend = url
        else:
            backend = MongoDBBackend(url, client=client, now=now, **options)
        super().__init__(backend.url)
        self.backend = backend
        #: The pymongo Collection holding the lock documents (primary reads, the client's write concern).
        self.collection = backend.collection(backend.collection_name)
        # Re-reads after an unknown write outcome see only majority-committed data.
        self._committed = backend.committed(self.collection)

    # -- the backend's, under the names tests use ----------------------------------------------
    @property
    def client(self) -> Any:
        return self.backend.client

    @property
    def database_name(self) -> str:
        return self.backend.database_name

    @property
    def collection_name(self) -> str:
        return self.backend.collection_name

    def now_expr(self) -> Any:
        """The expression every operation uses for "now": the backend's (the server's ``$$NOW``)."""
        return self.backend.now_expr()

    # -- reading -----------------------------------------------------------------------------
    def _record(self, doc: Mapping[str, Any], age_ms: Any = None) -> LockRecord:
        """A LockRecord from a stored document; ``age_ms`` defaults to the ``_age_ms`` a read added."""
        hb = as_utc(doc.get("hb"))
        if age_ms is None:
            age_ms = doc.get("_age_ms")
        if hb is not None and hb <= EPOCH:  # released: no heartbeat to show
            hb, age_ms = None, None
        return LockRecord(
            name=doc["_id"],
            holder=doc.get("holder"),
            active_ip=doc.get("active_ip"),
            token=int(doc.get("token") or 0),
            update_time=hb,
            heartbeat_age=None if hb is None or age_ms is None else max(0.0, float(age_ms) / 1000),
            ttl=float(doc.get("ttl") or 0) / 1000,
            fire_times=fire_times_from_json(doc.get("fires")),
            last_run_started=as_utc(doc.get("last_run_started")),
            last_run_finished=as_utc(doc.get("last_run_finished")),
            last_error=doc.get("last_error"),
            attrs=load_attrs(doc.get("attrs")),
        )

    def _aggregate(self, match: Mapping[str, Any] | None, op: str, *, committed: bool = False) -> list[dict[str, Any]]:
        """Lock documents plus ``_age_ms`` (the server clock minus ``hb``), sorted by name, in one round trip."""
        pipeline: list[dict[str, Any]] = [{"$match": match}] if match is not None else []
        pipeline += [
            {"$addFields": {"_age_ms": {"$subtract": [self.now_expr(), "$hb"]}}},
            {"$sort": {"_id": 1}},
        ]
        collection = self._committed if committed else self.collection
        with self.backend.errors(op):
            return [dict(doc) for doc in collection.aggregate(pipeline)]

    def _read_doc(self, name: str, op: str, *, committed: bool = False) -> dict[str, Any] | None:
        docs = self._aggregate({"_id": name}, op, committed=committed)
        return docs[0] if docs else None

    def read(self, name: str) -> LockRecord | None:
        doc = self._read_doc(name, "read")
        return None if doc is None else self._record(doc)

    def read_many(self, names: Iterable[str]) -> dict[str, LockRecord]:
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        return {doc["_id"]: self._record(doc) for doc in self._aggregate({"_id": {"$in": wanted}}, "read_many")}

    def list(self) -> list[LockRecord]:
        return [self._record(doc) for doc in self._aggregate(None, "list")]

    def ping(self) -> None:
        self.backend.ping()

    # -- writing -----------------------------------------------------------------------------
    def acquire_or_renew(self, name: str, node: Node, ttl: float, claim: FireClaim | None = None) -> AcquireResult:
        now = self.now_expr()
        me = {"$literal": node.node_id}
        # Free, ours, or stale by the ttl the current holder stored, judged by the server clock.
        # On an existing document that fails this, the upsert raises DuplicateKeyError.
        query = {
            "_id": name,
            "$or": [
                {"holder": node.node_id},
                {"holder": None},
                {"$expr": {"$lt": ["$hb", {"$subtract": [now, "$ttl"]}]}},
            ],
        }
        # One $set stage: every expression sees the document as it was before the update.
        fields: dict[str, Any] = {
            "token": {"$cond": [{"$eq": ["$holder", me]}, "$token", {"$add": [{"$ifNull": ["$token", 0]}, 1]}]},
            "holder": me,
            "active_ip": {"$literal": node.ip},
            "hb": now,
            "ttl": _ms(ttl),
        }
        if claim is not None:
            fields["fires"] = _claim_expr(claim)
        try:
            with self.backend.errors("acquire_or_renew", write=True):
                doc = self.collection.find_one_and_update(
                    query, [{"$set": fields}], upsert=True, return_document=ReturnDocument.AFTER
                )
        except pymongo.errors.DuplicateKeyError:
            doc = None  # refused: the document exists and failed the filter (or a racing upsert made it)
        except UncertainOutcome:
            # Taken, renewed or not: unknown. Show the majority-committed document, claim nothing.
            stored = self._read_doc(name, "acquire_or_renew (re-read)", committed=True)
            return AcquireResult(False, self._record(stored) if stored else LockRecord(name=name), False, uncertain=True)
        if doc is not None and doc.get("holder") == node.node_id:
            return AcquireResult(True, self._record(doc, 0), claim_won(doc.get("fires"), claim))
        stored = self._read_doc(name, "acquire_or_renew (read)")
        record = self._record(stored) if stored else LockRecord(name=name)
        # Refused, yet held by this node: another call of this node took it in between (two
        # upserts of a new lock race). Not this call's renewal, and not a loss.
        return AcquireResult(False, record, False, uncertain=record.holder == node.node_id)

    def hand_off(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        text = dump_attrs(attrs, job=name) if attrs is not None else None  # AttrsError: nothing sent
        now = self.now_expr()
        fields: dict[str, Any] = {"hb": now}
        if text is not None:
            fields["attrs"] = {"$literal": text}
        if run is not None:
            fields["last_run_finished"] = now
            fields["last_run_started"] = {"$subtract": [now, _ms(run.duration)]}
            fields["last_error"] = {"$literal": run.error}
        query = {"_id": name, "holder": node.node_id, "token": token}
        try:
            with self.backend.errors("hand_off", write=True):
                doc = self.collection.find_one_and_update(
                    query, [{"$set": fields}], projection={"_id": True}, return_document=ReturnDocument.AFTER
                )
        except UncertainOutcome as exc:
            # A re-read cannot tell whether ``hb`` moved: neither a renewal nor a loss. The caller retries.
            raise self.backend.uncertain(exc) from exc
        return doc is not None

    def renew_many(self, node: Node, leases: Mapping[str, int]) -> set[str]:
        if not leases:
            return set()
        names = list(leases)
        query = {
            "_id": {"$in": names},
            "holder": node.node_id,
            "$or": [{"_id": name, "token": token} for name, token in leases.items()],
        }
        try:
            with self.backend.errors("renew_many", write=True):
                result = self.collection.update_many(query, [{"$set": {"hb": self.now_expr()}}])
        except UncertainOutcome as exc:
            # Nothing may be counted as renewed (hb may not have moved), nor as lost.
            raise self.backend.uncertain(exc) from exc
        if result.matched_count == len(names):
            return set(names)
        # Say which were renewed: those still ours with the same token (a token never comes back).
        with self.backend.errors("renew_many (read)"):
            docs = list(self.collection.find({"_id": {"$in": names}, "holder": node.node_id}, {"token": True}))
        return {doc["_id"] for doc in docs if doc.get("token") == leases[doc["_id"]]}

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        """One ``bulk_write``, then one ``find`` of the claimed documents: two round trips.

        Each lock is one ``update_one`` (filter: holder and token), so each lock's renewal and
        claims are one atomic document write; its pipeline sets ``hb`` and then applies each claim
        in its own ``$set`` stage (each stage sees the fires the one before left). A bulk write
        reports only how many documents matched, so the ``find`` says which locks are still ours
        and which of our nonces they hold. It follows the write at once; only a newer fire time of
        the same job claimed in between (by this node, or by a node that took the lock over in
        between) can hide one of our claims from it, and the claim is then reported lost: a fire
        time may be reported lost, never won twice.
        """
        groups = group_claims(claims)
        if not groups:
            return BatchClaimResult()
        now = self.now_expr()
        ops = [
            UpdateOne(
                {"_id": name, "holder": node.node_id, "token": group.token},
                [{"$set": {"hb": now}}, *({"$set": {"fires": _claim_expr(c)}} for c in group.claims.values())],
            )
            for name, group in groups.items()
        ]
        try:
            with self.backend.errors("claim_many", write=True):
                try:
                    result = self.collection.bulk_write(ops, ordered=False)
                except pymongo.errors.BulkWriteError as exc:
                    # A bulk write reports a write concern failure in its details, not as WriteConcernError.
                    if exc.details.get("writeConcernErrors") and not exc.details.get("writeErrors"):
                        raise UncertainOutcome("claim_many", "outcome unknown") from exc
                    raise
        except UncertainOutcome as exc:
            # Nothing may be counted as renewed or claimed (nor lost): the caller retries.
            raise self.backend.uncertain(exc) from exc
        if result.matched_count == 0:
            return BatchClaimResult()
        names = list(groups)
        with self.backend.errors("claim_many (read)"):
            docs = list(
                self.collection.find(
                    {"_id": {"$in": names}, "holder": node.node_id}, {"token": True, "fires": True}, batch_size=len(names)
                )
            )
        fires = {doc["_id"]: doc.get("fires") for doc in docs if doc.get("token") == groups[doc["_id"]].token}
        return BatchClaimResult(frozenset(fires), won_claims(groups, fires))

    def release(self, name: str, node: Node, token: int) -> bool:
        query = {"_id": name, "holder": node.node_id, "token": token}
        try:
            with self.backend.errors("release", write=True):
                result = self.collection.update_one(query, {"$set": {"holder": None, "hb": EPOCH}})
        except UncertainOutcome as exc:
            # Released with our token can only be our release; anything else is not known yet.
            with self.backend.errors("release (re-read)"):
                stored = self._committed.find_one({"_id": name}, {"holder": True, "token": True})
            if stored is not None and stored.get("holder") is None and stored.get("token") == token:
                return True
            raise self.backend.uncertain(exc) from exc
        return bool(result.matched_count == 1)

    def close(self) -> None:
        self.backend.close()


def _claim_expr(claim: FireClaim) -> dict[str, Any]:
    """``fires`` with ``fires[job] = [fire_us, nonce]`` if ``fire_us`` is newer than the stored one.

    Job keys may hold dots, quotes and ``$``: they are only ever compared as ``$literal`` values
    (``$objectToArray``/``$arrayToObject``), never used as field paths. This form runs on MongoDB
    4.2+ and on mongomock alike (mongomock lacks ``$getField``, ``$setField``, ``$mergeObjects``
    and ``$reduce`` as expressions).
    """
    job = {"$literal": claim.job_id}
    pairs = {"$objectToArray": {"$ifNull": ["$fires", {}]}}
    ours = {"$filter": {"input": pairs, "cond": {"$eq": ["$$this.k", job]}}}
    stored_us = {
        "$ifNull": [{"$arrayElemAt": [{"$arrayElemAt": [{"$map": {"input": ours, "in": "$$this.v"}}, 0]}, 0]}, _MIN_INT64]
    }
    others = {"$filter": {"input": pairs, "cond": {"$ne": ["$$this.k", job]}}}
    mine = {"$literal": [{"k": claim.job_id, "v": [claim.fire_us, claim.nonce]}]}
    claimed = {"$arrayToObject": {"$concatArrays": [others, mine]}}
    return {"$cond": [{"$gt": [claim.fire_us, stored_us]}, claimed, {"$ifNull": ["$fires", {}]}]}
