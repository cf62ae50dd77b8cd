"""``mongodb://`` and ``mongodb+srv://``: the MongoDB lock store.

One document per lock in one collection, ``_id`` = the lock name::

    {_id, holder, active_ip, hb: <date>, ttl: <ms>, token, attrs: <JSON text>,
     fires: {<job>: [fire_us, nonce]}, last_run_started, last_run_finished, last_error,
     paused, paused_at, paused_by, resume_catch_up, history: {<job>: [<run>, ...]},
     retired: <date> | null}

The run history is written by ``hand_off`` in the same update pipeline (each job's list cut to the
last ``?history=N`` runs by ``$slice``); reads of records leave it out. Nodes' presence documents
live in the same collection under an object ``_id`` (``{_id: {node: <node id>}, ip, version,
seen: <date>, clock_offset, locks}``), so that ``renew_many`` writes a presence in the same
``bulk_write`` as the renewal; lock reads only ever match string ``_id`` values. The
collection's token floor is the document ``{_id: {floor: "tokens"}, token}``: the highest token of
a lock ``forget`` let go.

A release never deletes the document (holder null, hb at the epoch), so the fencing token keeps
growing. ``forget`` cannot raise the floor and delete a record in one atomic step (no
multi-document atomicity), so it *retires* the record: it raises the floor to the record's token,
then clears the record to a released one marked ``retired`` (the server's time), left out of
``list()``; a later ``forget`` deletes the records retired at least ``retired_keep`` seconds
(default :data:`~mutexcron.locks.base.RETIRED_KEEP`) ago. An acquire or ``set_paused`` un-retires a
record. A record is created (or first taken, if ``set_paused`` made it) only by an acquire that
read the floor just before: its token is above the floor (see
:meth:`MongoDBLockStore.acquire_or_renew`). Every write is one command (``find_one_and_update`` with an update pipeline, or an
``update_many``/``update_one``) judged by the server's clock, ``$$NOW``: a holder is stale when
``hb < $$NOW - ttl``, with the ttl the *holder* stored. Attrs are stored as the JSON text
:func:`~mutexcron.locks.record.dump_attrs` makes, so every JSON value round-trips exactly (``$``-prefixed
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

import builtins
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pymongo.errors
from pymongo import ReturnDocument, UpdateMany, UpdateOne

from ..backends.base import UncertainOutcome
from ..backends.mongodb import MongoDBBackend
from ..node import NodeTraits
from ..timeutil import EPOCH, as_utc
from .base import (
    FORGET_CLEARED,
    FORGET_DELETED,
    FORGET_HELD,
    FORGET_MISSING,
    PRESENCE_TTL,
    AcquireResult,
    BatchClaimResult,
    FireClaim,
    HandOff,
    HeldClaim,
    LockStore,
    Node,
    Presence,
    RunInfo,
    claim_won,
    fire_times_from_json,
    group_claims,
    history_option,
    lost_claims,
    stored_nonce,
    won_claims,
)
from .record import (
    LockRecord,
    NodePresence,
    dump_attrs,
    dump_triggers,
    load_attrs,
    load_locks,
    load_triggers,
    optional_float,
)

log = logging.getLogger(__name__)

__all__ = ["MongoDBLockStore"]

_MIN_INT64 = -(2**63)

#: Reads and writes one ``forget`` tries before it reports contention: the record taken and
#: released again each time between its read and its conditional write.
_FORGET_TRIES = 3


# Each call builds its own filter or projection: mongomock adds keys to the ones it is given.
def _locks() -> dict[str, Any]:
    """Lock documents in use: a string ``_id`` (presence documents and the floor have an object
    one), not retired."""
    return {"_id": {"$type": "string"}, "retired": None}


def _nodes() -> dict[str, Any]:
    """Presence documents (``{_id: {node: <node id>}}``; not the floor's ``{_id: {floor: ...}}``)."""
    return {"_id.node": {"$type": "string"}}


def _floor_id() -> dict[str, Any]:
    """The token floor document's ``_id``: an object, so no lock name (a string) can be it."""
    return {"floor": "tokens"}


def _no_history() -> dict[str, Any]:
    """What record reads leave out of a lock document."""
    return {"history": 0}


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
        history: runs kept per job in the run history (wins over ``?history=``; default 20).
        **options: with a URL: extra ``pymongo.MongoClient`` keyword options; they win over the URL
            and the defaults.
    """

    def __init__(
        self,
        url: str | MongoDBBackend,
        *,
        client: Any = None,
        now: Callable[[], Any] | None = None,
        history: int | None = None,
        **options: Any,
    ) -> None:
        if isinstance(url, MongoDBBackend):
            if client is not None or now is not None or options:
                raise TypeError("connection options belong to the backend: MongoDBBackend(url, client=..., now=...)")
            backend = url
            _, self.history_length = history_option(url.url, history)
        else:
            url, self.history_length = history_option(url, history)  # pymongo must not see ?history=
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
            paused=bool(doc.get("paused")),
            paused_at=as_utc(doc.get("paused_at")),
            paused_by=doc.get("paused_by"),
            resume_catch_up=bool(doc.get("resume_catch_up")),
            zone=doc.get("zone"),
            triggers=load_triggers(doc.get("triggers")),
        )

    def _aggregate(self, match: Mapping[str, Any] | None, op: str, *, committed: bool = False) -> list[dict[str, Any]]:
        """Lock documents (without their history) plus ``_age_ms`` (server clock minus ``hb``), by name, in one round trip."""
        pipeline: list[dict[str, Any]] = [{"$match": match if match is not None else _locks()}]
        pipeline += [
            {"$project": _no_history()},
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
        """One ``find_one_and_update`` of a record held before (token above 0): a renewal, a
        takeover (the token + 1) or a refusal (then one read). A record that is missing, or was
        never held (made by ``set_paused``), gets its first token from the collection's floor: the
        read after the refusal fetches the floor too, and one upsert creates or takes the record
        with ``max(token, floor) + 1``. Three round trips, once per record's life.

        Why a record held before needs no floor: its token is above every token of the name's
        earlier records, deleted by ``forget`` (it was created above the floor, which held them),
        and tokens only go up while it lives. Why the floor read just before an upsert is enough: a
        record is deleted only ``retired_keep`` seconds after ``forget`` raised the floor for it; a
        floor read before that raise is followed by the upsert within one write's bound (socket
        and server timeouts, seconds), long before the deletion, so the upsert meets the retired
        record (and takes it over above its token) instead of creating one. Any record deleted
        before the upsert was let go before the read, which saw its token in the floor.
        """
        try:
            doc = self._acquire_write(name, node, ttl, claim, floor=None)
        except UncertainOutcome:
            return self._acquire_uncertain(name)
        if doc is not None and doc.get("holder") == node.node_id:
            return self._acquired(doc, claim)
        stored, floor = self._read_with_floor(name)
        if stored is None or not stored.get("token"):  # new, or never held: the first token comes from the floor
            try:
                doc = self._acquire_write(name, node, ttl, claim, floor=floor)
            except UncertainOutcome:
                return self._acquire_uncertain(name)
            if doc is not None and doc.get("holder") == node.node_id:
                return self._acquired(doc, claim)
            stored = self._read_doc(name, "acquire_or_renew (read)")
        record = self._record(stored) if stored else LockRecord(name=name)
        # Refused, yet held by this node: another call of this node took it in between (two
        # upserts of a new lock race). Not this call's renewal, and not a loss.
        return AcquireResult(False, record, False, uncertain=record.holder == node.node_id)

    def _acquire_write(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None, *, floor: int | None
    ) -> dict[str, Any] | None:
        """The acquire's one conditional write: the record after it, or None if refused.

        ``floor`` None: only a record held before (token above 0), no upsert. Else an upsert whose
        new holder's token is ``max(token, floor) + 1``. Raises UncertainOutcome.
        """
        now = self.now_expr()
        me = {"$literal": node.node_id}
        # Free, ours, or stale by the ttl the current holder stored, judged by the server clock.
        # On an existing document that fails this, the upsert raises DuplicateKeyError.
        query: dict[str, Any] = {
            "_id": name,
            "$or": [
                {"holder": node.node_id},
                {"holder": None},
                {"$expr": {"$lt": ["$hb", {"$subtract": [now, "$ttl"]}]}},
            ],
        }
        taken: Any = {"$add": [{"$ifNull": ["$token", 0]}, 1]}
        if floor is None:
            query["token"] = {"$gt": 0}
        else:
            taken = {"$add": [{"$max": [{"$ifNull": ["$token", 0]}, floor]}, 1]}
        # One $set stage: every expression sees the document as it was before the update.
        fields: dict[str, Any] = {
            "token": {"$cond": [{"$eq": ["$holder", me]}, "$token", taken]},
            "holder": me,
            "active_ip": {"$literal": node.ip},
            "hb": now,
            "ttl": _ms(ttl),
            "retired": None,  # in use again: a later forget must not delete it
        }
        if claim is not None:
            fields["fires"] = _claim_expr(claim)
        try:
            with self.backend.errors("acquire_or_renew", write=True):
                doc: dict[str, Any] | None = self.collection.find_one_and_update(
                    query,
                    [{"$set": fields}],
                    upsert=floor is not None,
                    return_document=ReturnDocument.AFTER,
                    projection=_no_history(),
                )
        except pymongo.errors.DuplicateKeyError:
            return None  # refused: the document exists and failed the filter (or a racing upsert made it)
        return doc

    def _acquired(self, doc: Mapping[str, Any], claim: FireClaim | None) -> AcquireResult:
        fires = doc.get("fires")
        return AcquireResult(True, self._record(doc, 0), claim_won(fires, claim), claimed_by=stored_nonce(fires, claim))

    def _acquire_uncertain(self, name: str) -> AcquireResult:
        """Taken, renewed or not: unknown. Show the majority-committed document, claim nothing."""
        stored = self._read_doc(name, "acquire_or_renew (re-read)", committed=True)
        return AcquireResult(False, self._record(stored) if stored else LockRecord(name=name), False, uncertain=True)

    def _read_with_floor(self, name: str) -> tuple[dict[str, Any] | None, int]:
        """The lock's document (or None) and the collection's token floor (0 if none), in one read."""
        docs = self._aggregate({"_id": {"$in": [name, _floor_id()]}}, "acquire_or_renew (read)")
        stored = next((doc for doc in docs if doc["_id"] == name), None)
        floor = next((int(doc.get("token") or 0) for doc in docs if doc["_id"] == _floor_id()), 0)
        return stored, floor

    def hand_off(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        query, fields = self._hand_off_update(node, HandOff(name, token, attrs, run))  # AttrsError: nothing sent
        try:
            with self.backend.errors("hand_off", write=True):
                doc = self.collection.find_one_and_update(
                    query, [{"$set": fields}], projection={"_id": True}, return_document=ReturnDocument.AFTER
                )
        except UncertainOutcome as exc:
            # A re-read cannot tell whether ``hb`` moved: neither a renewal nor a loss. The caller retries.
            raise self.backend.uncertain(exc) from exc
        return doc is not None

    def hand_off_many(self, node: Node, items: Sequence[HandOff]) -> builtins.list[bool]:
        """One ordered ``bulk_write`` of every item's fenced update (each document's update is
        atomic, and applied in order); if not every item matched, one read says which did (a
        token never comes back, so a record still naming this node with the item's token was written)."""
        if not items:
            return []
        updates = [self._hand_off_update(node, item) for item in items]  # AttrsError: nothing sent
        ops = [UpdateOne(query, [{"$set": fields}]) for query, fields in updates]
        try:
            with self.backend.errors("hand_off", write=True):
                matched = self._bulk(ops, "hand_off", ordered=True)
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc
        if matched == len(items):
            return [True] * len(items)
        names = list(dict.fromkeys(item.lock for item in items))
        with self.backend.errors("hand_off (read)"):
            docs = list(self.collection.find({"_id": {"$in": names}, "holder": node.node_id}, {"token": True}))
        held = {doc["_id"]: doc.get("token") for doc in docs}
        return [held.get(item.lock) == item.token for item in items]

    def _hand_off_update(self, node: Node, item: HandOff) -> tuple[dict[str, Any], dict[str, Any]]:
        """The filter and the ``$set`` of one fenced hand-off. Raises AttrsError for bad attrs."""
        name, token, run = item.lock, item.token, item.run
        text = dump_attrs(item.attrs, job=name) if item.attrs is not None else None
        now = self.now_expr()
        fields: dict[str, Any] = {"hb": now}
        if text is not None:
            fields["attrs"] = {"$literal": text}
        if run is not None:
            fields["last_run_finished"] = now
            fields["last_run_started"] = {"$subtract": [now, _ms(run.duration)]}
            fields["last_error"] = {"$literal": run.error}
            if self.history_length:
                fields["history"] = self._history_expr(name, node, token, run, now)
        return {"_id": name, "holder": node.node_id, "token": token}, fields

    def _history_expr(self, name: str, node: Node, token: int, run: RunInfo, now: Any) -> dict[str, Any]:
        """``history`` with the run appended to its job's list, cut to the last ``history_length``.

        The job is only ever compared as a ``$literal`` value (``$objectToArray``), as in
        :func:`_claim_expr`: a job id with dots or ``$`` is never a field path.
        """
        entry: dict[str, Any] = {k: {"$literal": v} for k, v in run.history_entry(node, token).items()}
        entry.update(started={"$subtract": [now, _ms(max(0.0, run.duration))]}, ended=now)
        job = {"$literal": run.job or name}
        pairs = {"$objectToArray": {"$ifNull": ["$history", {}]}}
        ours = {"$filter": {"input": pairs, "cond": {"$eq": ["$$this.k", job]}}}
        runs = {"$ifNull": [{"$arrayElemAt": [{"$map": {"input": ours, "in": "$$this.v"}}, 0]}, []]}
        others = {"$filter": {"input": pairs, "cond": {"$ne": ["$$this.k", job]}}}
        kept = {"$slice": [{"$concatArrays": [runs, _one(entry)]}, -self.history_length]}
        return {"$arrayToObject": {"$concatArrays": [others, _one({"k": job, "v": kept})]}}

    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        """One ``update_many``; with a presence, one ``bulk_write`` of it and the presence's upsert."""
        if not leases and presence is None:
            return set()
        names = list(leases)
        query = {
            "_id": {"$in": names},
            "holder": node.node_id,
            "$or": [{"_id": name, "token": token} for name, token in leases.items()],
        }
        now = self.now_expr()
        try:
            with self.backend.errors("renew_many", write=True):
                if presence is None:
                    matched = self.collection.update_many(query, [{"$set": {"hb": now}}]).matched_count
                else:
                    ops: list[Any] = [UpdateMany(query, [{"$set": {"hb": now}}])] if leases else []
                    ops.append(self._presence_op(node, leases, presence, now))
                    matched = self._bulk(ops, "renew_many", ordered=True, presence=True)
        except UncertainOutcome as exc:
            # Nothing may be counted as renewed (hb may not have moved), nor as lost.
            raise self.backend.uncertain(exc) from exc
        if not names:
            return set()
        if matched == len(names):
            return set(names)
        # Say which were renewed: those still ours with the same token (a token never comes back).
        with self.backend.errors("renew_many (read)"):
            docs = list(self.collection.find({"_id": {"$in": names}, "holder": node.node_id}, {"token": True}))
        return {doc["_id"] for doc in docs if doc.get("token") == leases[doc["_id"]]}

    def _bulk(self, ops: Sequence[Any], operation: str, *, ordered: bool, presence: bool = False) -> int:
        """One ``bulk_write``: the documents its updates matched (with ``presence``, the last op's own not counted)."""
        try:
            result = self.collection.bulk_write(ops, ordered=ordered)
        except pymongo.errors.BulkWriteError as exc:
            # A bulk write reports a write concern failure in its details, not as WriteConcernError.
            if exc.details.get("writeConcernErrors") and not exc.details.get("writeErrors"):
                raise UncertainOutcome(operation, "outcome unknown") from exc
            raise
        return int(result.matched_count) - int(presence and not result.upserted_count)

    def _presence_op(self, node: Node, leases: Mapping[str, int], presence: Presence, now: Any) -> UpdateOne:
        fields = {
            "ip": node.ip,
            "version": presence.version,
            "clock_offset": presence.clock_offset,
            "locks": presence.held(leases),
            "traits": presence.traits.to_json(),
        }
        values = {k: {"$literal": v} for k, v in fields.items()}
        return UpdateOne({"_id": {"node": node.node_id}}, [{"$set": {**values, "seen": now}}], upsert=True)

    def nodes(self, *, prune: bool = True) -> builtins.list[NodePresence]:
        """One ``aggregate`` of the presence documents; those older than the TTL are deleted (a second command, if ``prune``)."""
        pipeline = [
            {"$match": _nodes()},
            {"$addFields": {"_age_ms": {"$subtract": [self.now_expr(), "$seen"]}}},
            {"$sort": {"_id.node": 1}},
        ]
        with self.backend.errors("nodes"):
            docs = [dict(doc) for doc in self.collection.aggregate(pipeline)]
        old = [doc for doc in docs if doc.get("_age_ms") is None or float(doc["_age_ms"]) > PRESENCE_TTL * 1000]
        if old and prune:
            with self.backend.errors("nodes (prune)"):  # a node that wrote again since keeps its document
                self.collection.delete_many({"$or": [{"_id": doc["_id"], "seen": doc.get("seen")} for doc in old]})
        return [_presence(doc) for doc in docs if doc not in old]

    def set_paused(self, name: str, paused: bool, by: str, *, catch_up: bool = False) -> LockRecord:
        """One ``find_one_and_update`` (an upsert), then one read of the record for its heartbeat age."""
        fields = {
            "paused": bool(paused),
            "paused_at": self.now_expr(),
            "paused_by": {"$literal": by},
            "resume_catch_up": bool(catch_up and not paused),
            # A new document: released, token 0 (the first acquire makes it 1), no heartbeat.
            "token": {"$ifNull": ["$token", 0]},
            "ttl": {"$ifNull": ["$ttl", 0]},
            "hb": {"$ifNull": ["$hb", EPOCH]},
            "retired": None,  # in use again: a later forget must not delete it
        }
        try:
            with self.backend.errors("set_paused", write=True):
                self.collection.find_one_and_update({"_id": name}, [{"$set": fields}], upsert=True, projection={"_id": True})
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc
        doc = self._read_doc(name, "set_paused (read)")
        if doc is None:
            raise self.backend.failed(None, "set_paused", why=f"lock {name!r} vanished right after it was written")
        return self._record(doc)

    def forget(self, name: str, *, force: bool = False) -> str:
        """Let the record go with its tokens spent: a read of its token, then conditional writes,
        each deciding alone (no multi-document atomicity).

        A record never held (token 0) is deleted (``delete_one`` conditional on token 0). Any other
        is *retired*: the floor is raised to its token (``$max``), then one ``update_one``
        conditional on that token (not a later holder's) and, unless ``force``, on no live lease,
        clears it to a released record marked ``retired`` (server time), out of ``list()``. Then one
        ``delete_many`` deletes the records retired at least ``retired_keep`` seconds ago and not
        taken again. A record taken and released again between the read and the write is read
        again (a few times, then StoreUnavailableError: contention). Four round trips in all.
        """
        for _ in range(_FORGET_TRIES):
            with self.backend.errors("forget (read)"):
                doc = self.collection.find_one({"_id": name}, {"token": True})
            if doc is None:
                return FORGET_MISSING
            try:
                outcome, floor = self._forget_write(name, int(doc.get("token") or 0), force)
            except UncertainOutcome as exc:
                raise self.backend.uncertain(exc) from exc
            if outcome == FORGET_CLEARED:
                self._delete_retired(floor)
            if outcome is not None:
                return outcome
            if not force:
                live = {"$expr": {"$gte": ["$hb", {"$subtract": [self.now_expr(), "$ttl"]}]}}
                with self.backend.errors("forget (read)"):
                    if self.collection.find_one({"_id": name, "holder": {"$ne": None}, **live}, {"_id": True}):
                        return FORGET_HELD
        raise self.backend.uncertain(UncertainOutcome("forget", "the lock was taken again while it was forgotten"))

    def _forget_write(self, name: str, token: int, force: bool) -> tuple[str | None, int]:
        """Delete a record never held, or raise the floor to ``token`` and retire the record if it
        still has that token: the outcome (None if nothing matched) and the floor it saw (0 if
        none). Raises UncertainOutcome."""
        with self.backend.errors("forget", write=True):
            if token == 0:
                deleted = self.collection.delete_one({"_id": name, "token": {"$in": [0, None]}}).deleted_count
                return (FORGET_DELETED if deleted else None), 0
            floor = self._raise_floor(token)
            now = self.now_expr()
            query: dict[str, Any] = {"_id": name, "token": {"$lte": token}}
            if not force:
                query["$or"] = [{"holder": None}, {"$expr": {"$lt": ["$hb", {"$subtract": [now, "$ttl"]}]}}]
            retired = self.collection.update_one(query, [{"$set": _retired_fields(now)}]).matched_count
            return (FORGET_CLEARED if retired else None), floor

    def _raise_floor(self, token: int) -> int:
        """The floor raised to at least ``token`` (one ``$max`` upsert; a racing upsert's duplicate
        key: again, as an update): its value after."""
        update = {"$max": {"token": token}}
        try:
            doc = self.collection.find_one_and_update(
                {"_id": _floor_id()}, update, upsert=True, return_document=ReturnDocument.AFTER
            )
        except pymongo.errors.DuplicateKeyError:
            doc = self.collection.find_one_and_update({"_id": _floor_id()}, update, return_document=ReturnDocument.AFTER)
        return int((doc or {}).get("token") or token)

    def _delete_retired(self, floor: int) -> None:
        """Delete the records retired at least ``retired_keep`` seconds ago (server clock) and not
        taken again since (an acquire or ``set_paused`` clears ``retired``; a holder is never
        retired), whose token the floor holds (``floor``, as this forget saw it: a token above it
        was given after the retirement by a writer that left ``retired`` alone, an earlier
        mutexcron version during an upgrade; that record stays)."""
        cutoff = {"$subtract": [self.now_expr(), _ms(self.retired_keep)]}
        query = {"_id": {"$type": "string"}, "holder": None, "retired": {"$type": "date"}, "token": {"$lte": floor},
                 "$expr": {"$lte": ["$retired", cutoff]}}  # fmt: skip
        try:
            with self.backend.errors("forget (delete retired)", write=True):
                self.collection.delete_many(query)
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc

    def forget_node(self, node_id: str, *, min_age: float = 0.0) -> bool:
        old = {"$expr": {"$lte": ["$seen", {"$subtract": [self.now_expr(), int(min_age * 1000)]}]}}
        try:
            with self.backend.errors("forget_node", write=True):
                return bool(self.collection.delete_one({"_id": {"node": node_id}, **old}).deleted_count)
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc

    def _stored_history(self, locks: Sequence[str]) -> dict[str, Mapping[str, Any]]:
        with self.backend.errors("history"):
            docs = list(self.collection.find({"_id": {"$in": list(locks)}}, {"history": True}))
        return {doc["_id"]: dict(doc.get("history") or {}) for doc in docs}

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
                matched = self._bulk(ops, "claim_many", ordered=False)
        except UncertainOutcome as exc:
            # Nothing may be counted as renewed or claimed (nor lost): the caller retries.
            raise self.backend.uncertain(exc) from exc
        if matched == 0:
            return BatchClaimResult()
        names = list(groups)
        with self.backend.errors("claim_many (read)"):
            docs = list(
                self.collection.find(
                    {"_id": {"$in": names}, "holder": node.node_id},
                    {"token": True, "fires": True, "paused": True},
                    batch_size=len(names),
                )
            )
        ours = [doc for doc in docs if doc.get("token") == groups[doc["_id"]].token]
        fires = {doc["_id"]: doc.get("fires") for doc in ours}
        paused = frozenset(doc["_id"] for doc in ours if doc.get("paused"))
        lost = lost_claims(groups, {name: value for name, value in fires.items() if name not in paused})
        return BatchClaimResult(frozenset(fires), won_claims(groups, fires), paused, lost)

    def set_zone(
        self, name: str, node: Node, token: int, zone: str | None, triggers: Mapping[str, str] | None = None
    ) -> bool:
        query = {"_id": name, "holder": node.node_id, "token": token}
        fields = {"zone": zone, "triggers": dump_triggers(triggers)}
        try:
            with self.backend.errors("set_zone", write=True):
                return bool(self.collection.update_one(query, {"$set": fields}).matched_count == 1)
        except UncertainOutcome as exc:  # written again at the next acquisition
            raise self.backend.uncertain(exc) from exc

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

    def hand_over(self, name: str, node: Node, token: int, successor: str, within: float) -> bool:
        query = {"_id": name, "holder": node.node_id, "token": token}
        fields = {"holder": {"$literal": successor}, "active_ip": None, "token": token + 1, "hb": self.now_expr()}
        fields["ttl"] = _ms(within)
        try:
            with self.backend.errors("hand_over", write=True):
                result = self.collection.update_one(query, [{"$set": fields}])
        except UncertainOutcome as exc:
            # Offered to the successor with the next token can only be our hand-over.
            with self.backend.errors("hand_over (re-read)"):
                stored = self._committed.find_one({"_id": name}, {"holder": True, "token": True})
            if stored is not None and stored.get("holder") == successor and stored.get("token") == token + 1:
                return True
            raise self.backend.uncertain(exc) from exc
        return bool(result.matched_count == 1)

    def close(self) -> None:
        self.backend.close()


def _claim_expr(claim: FireClaim) -> dict[str, Any]:
    """``fires`` with ``fires[job] = [fire_us, nonce]`` if ``fire_us`` is newer than the stored one and the lock is not paused.

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
    newer = {"$and": [{"$gt": [claim.fire_us, stored_us]}, {"$ne": [{"$ifNull": ["$paused", False]}, True]}]}
    return {"$cond": [newer, claimed, {"$ifNull": ["$fires", {}]}]}


def _retired_fields(now: Any) -> dict[str, Any]:
    """A retired record: released, its token kept (the floor holds it too), everything else cleared, ``retired`` at ``now``."""
    cleared: dict[str, Any] = {"holder": None, "hb": EPOCH, "attrs": {"$literal": "{}"}, "fires": {"$literal": {}},
               "history": {"$literal": {}}, "paused": False, "resume_catch_up": False, "retired": now}  # fmt: skip
    gone = ("last_run_started", "last_run_finished", "last_error", "paused_at", "paused_by", "zone", "triggers")
    return {**cleared, **dict.fromkeys(gone)}


def _one(expression: dict[str, Any]) -> dict[str, Any]:
    """An array of the one document ``expression`` evaluates to (``[expression]`` would be a literal on mongomock)."""
    return {"$map": {"input": [0], "in": expression}}


def _presence(doc: Mapping[str, Any]) -> NodePresence:
    age_ms = doc.get("_age_ms")
    return NodePresence(
        node_id=str(doc["_id"].get("node")),
        ip=doc.get("ip"),
        version=doc.get("version"),
        last_seen=as_utc(doc.get("seen")),
        age=None if age_ms is None else max(0.0, float(age_ms) / 1000),
        clock_offset=optional_float(doc.get("clock_offset")),
        locks=load_locks(doc.get("locks")),
        traits=NodeTraits.from_json(doc.get("traits")),
    )
