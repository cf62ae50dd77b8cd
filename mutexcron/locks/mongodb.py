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

Writes use write concern ``majority`` and reads the primary. A write whose outcome is unknown
(a write-concern error or timeout) is never assumed to have happened, nor not to have happened:
an acquire reports ``uncertain`` (with the majority-committed document as the record), a
heartbeat or renewal raises StoreUnavailableError, and a release is reported done only if the
majority-committed document shows it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NoReturn
from urllib.parse import parse_qsl, unquote, urlsplit

import pymongo
import pymongo.errors
from pymongo import ReturnDocument
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from ..errors import ConfigurationError, StoreError, StoreUnavailableError
from ..record import LockRecord, dump_attrs, load_attrs
from ..urls import mask_url, url_scheme
from .base import AcquireResult, FireClaim, LockStore, Node, RunInfo, claim_won, fire_times_from_json

logger = logging.getLogger(__name__)

__all__ = ["MongoDBLockStore", "MongoURL", "parse_url"]

URL_FORMS = (
    "mongodb://[user:password@]host1[:port][,host2[:port]...][/database][?replicaSet=NAME&w=majority...], "
    "mongodb+srv://[user:password@]cluster.example.com[/database][?...]; "
    "mutexcron option: ?collection=NAME"
)
DEFAULT_DATABASE = "mutexcron"
DEFAULT_COLLECTION = "mutexcron_locks"

# The timeout rule, the same for every store: give up connecting (here: finding a usable server)
# after CONNECT_TIMEOUT_MS and any one operation after OPERATION_TIMEOUT_MS, so a dead or
# partitioned server fails closed instead of freezing the heartbeat thread. A write waits for its
# majority less than an operation, so the server answers "write concern timeout" (an unknown
# outcome) before the socket gives up.
CONNECT_TIMEOUT_MS = 5000
OPERATION_TIMEOUT_MS = 10000

#: Client options mutexcron sets unless the URL (or a keyword option) sets them.
DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {
    "serverSelectionTimeoutMS": CONNECT_TIMEOUT_MS,
    "connectTimeoutMS": CONNECT_TIMEOUT_MS,
    "socketTimeoutMS": OPERATION_TIMEOUT_MS,
    "w": "majority",
    "wTimeoutMS": 4000,
    "appname": "mutexcron",
}
# With a client-side operation timeout (timeoutMS) the driver derives these itself.
_SUPERSEDED_BY_TIMEOUT_MS = {"sockettimeoutms", "wtimeoutms"}

#: The server's clock in every expression the store sends (MongoDB >= 4.2).
SERVER_NOW = "$$NOW"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MIN_INT64 = -(2**63)

# The server cannot be reached or is not the primary right now: fail closed.
_UNAVAILABLE: tuple[type[Exception], ...] = (
    pymongo.errors.ConnectionFailure,  # AutoReconnect, NetworkTimeout, ServerSelectionTimeoutError...
    pymongo.errors.ConfigurationError,  # raised by an operation: mongodb+srv DNS lookup failed
)


class _UnknownOutcome(Exception):
    """A write may or may not have been applied (write-concern error or timeout)."""


@dataclass(frozen=True)
class MongoURL:
    """What :func:`parse_url` makes of a lock URL."""

    client_url: str
    """The URL handed to pymongo: the lock URL without mutexcron's ``collection`` option."""
    database: str
    collection: str
    defaults: dict[str, Any] = field(default_factory=dict)
    """The :data:`DEFAULT_CLIENT_OPTIONS` the URL does not set itself."""


def parse_url(url: str, options: Iterable[str] = ()) -> MongoURL:
    """Split a lock URL into pymongo's URL, the database, the collection and the default options.

    Args:
        url: ``mongodb://...`` or ``mongodb+srv://...``.
        options: names of client options given as keywords (they count as set, like URL options).

    Raises:
        ConfigurationError: not a MongoDB URL, or a bad database or collection name.
    """
    if url_scheme(url) not in MongoDBLockStore.schemes:
        raise ConfigurationError(f"not a MongoDB lock URL: {mask_url(url)!r}; use {URL_FORMS}")
    base, sep, query = url.partition("?")
    # Drop ``collection`` textually: re-encoding the query would change values pymongo reads raw
    # (it does not unquote readPreferenceTags, authMechanismProperties...).
    kept: list[str] = []
    collection = DEFAULT_COLLECTION
    for item in query.split("&") if sep else []:
        key, _, value = item.partition("=")
        if key == "collection":
            collection = unquote(value) or DEFAULT_COLLECTION
        elif item:
            kept.append(item)
    path = urlsplit(base).path
    database = unquote(path.lstrip("/")) or DEFAULT_DATABASE
    if kept and not path:
        base += "/"  # pymongo needs the "/" between the host list and the options
    client_url = f"{base}?{'&'.join(kept)}" if kept else base
    _check_name("database", database, '/\\. "$\x00', url)
    _check_name("collection", collection, "$\x00", url)
    if collection.startswith("system."):
        raise ConfigurationError(
            f"collection {collection!r} in {mask_url(url)!r} is reserved by MongoDB; pick another ?collection="
        )
    given = {key.lower() for key, _ in parse_qsl(query, keep_blank_values=True)} | {k.lower() for k in options}
    defaults = {
        key: value
        for key, value in DEFAULT_CLIENT_OPTIONS.items()
        if key.lower() not in given and not (key.lower() in _SUPERSEDED_BY_TIMEOUT_MS and "timeoutms" in given)
    }
    return MongoURL(client_url=client_url, database=database, collection=collection, defaults=defaults)


def _check_name(what: str, name: str, forbidden: str, url: str) -> None:
    bad = sorted({c for c in name if c in forbidden})
    if bad:
        raise ConfigurationError(
            f"bad MongoDB {what} name {name!r} in {mask_url(url)!r}: it must not contain {' '.join(map(repr, bad))}"
        )


def _aware(value: Any) -> datetime | None:
    """A stored date as an aware UTC datetime (pymongo returns naive ones unless tz_aware)."""
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class MongoDBLockStore(LockStore):
    """Named, leased, fenced locks in a MongoDB collection (MongoDB >= 4.2; 5.0+ recommended).

    Args:
        url: ``mongodb://`` or ``mongodb+srv://``; the database comes from the path (default
            ``mutexcron``), the collection from ``?collection=`` (default ``mutexcron_locks``).
        client: a ready client to use instead of building one from the URL (tests inject a
            ``mongomock.MongoClient``); the store then does not close it.
        now: tests only: a callable returning the date to use as "now" instead of the server's
            ``$$NOW`` (which mongomock does not know). Production code never passes it.
        **options: extra ``pymongo.MongoClient`` keyword options; they win over the URL and the
            defaults.
    """

    schemes = ("mongodb", "mongodb+srv")

    def __init__(self, url: str, *, client: Any = None, now: Callable[[], Any] | None = None, **options: Any) -> None:
        super().__init__(url)
        parsed = parse_url(url, options)
        self.database_name = parsed.database
        self.collection_name = parsed.collection
        self._now = now
        password = urlsplit(url.partition("?")[0]).password
        self._secrets = [s for s in {password, unquote(password or "")} if s]
        self._owns_client = client is None
        if client is None:
            kwargs: dict[str, Any] = {"connect": False, "tz_aware": True, **parsed.defaults, **options}
            try:
                client = pymongo.MongoClient(parsed.client_url, **kwargs)
            except (pymongo.errors.ConfigurationError, ValueError, TypeError) as exc:  # InvalidURI, bad port, no dnspython
                raise ConfigurationError(
                    f"bad MongoDB lock URL {self.masked_url!r}: {self._scrub(exc)}; use {URL_FORMS}"
                ) from exc
        self.client = client
        #: The pymongo Collection holding the lock documents (primary reads, the client's write concern).
        self.collection = client.get_database(parsed.database).get_collection(
            parsed.collection, read_preference=ReadPreference.PRIMARY
        )
        # Re-reads after an unknown write outcome see only majority-committed data.
        self._committed = self.collection.with_options(read_concern=ReadConcern("majority"))
        logger.debug("MongoDB lock store %s: database %r, collection %r", self.masked_url, parsed.database, parsed.collection)

    # -- the one seam ------------------------------------------------------------------------
    def now_expr(self) -> Any:
        """The expression every operation uses for "now": the server's ``$$NOW``.

        Only tests replace it (``now=``), with a date from an injected clock, because mongomock
        does not know ``$$NOW``. Called once per operation, so one command sees one "now".
        """
        return SERVER_NOW if self._now is None else self._now()

    # -- errors ------------------------------------------------------------------------------
    def _scrub(self, exc: BaseException) -> str:
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _unavailable(self, op: str, exc: BaseException) -> NoReturn:
        raise StoreUnavailableError(
            f"MongoDB lock store {self.masked_url} unavailable ({op}): {type(exc).__name__}: {self._scrub(exc)}"
        ) from exc

    @contextmanager
    def _errors(self, op: str, *, write: bool = False) -> Iterator[None]:
        """Translate driver errors; on a write, turn an unknown outcome into :class:`_UnknownOutcome`."""
        try:
            yield
        except pymongo.errors.DuplicateKeyError:
            raise
        except pymongo.errors.WriteConcernError as exc:  # incl. WTimeoutError
            if not write:
                raise StoreError(f"MongoDB lock store {self.masked_url} ({op}): {self._scrub(exc)}") from exc
            logger.warning(
                "MongoDB lock store %s: %s: write concern not satisfied (%s); outcome unknown",
                self.masked_url,
                op,
                type(exc).__name__,
            )
            raise _UnknownOutcome(op) from exc
        except _UNAVAILABLE as exc:
            self._unavailable(op, exc)
        except pymongo.errors.PyMongoError as exc:
            raise StoreError(f"MongoDB lock store {self.masked_url} ({op}): {type(exc).__name__}: {self._scrub(exc)}") from exc

    # -- reading -----------------------------------------------------------------------------
    def _record(self, doc: Mapping[str, Any], age_ms: Any = None) -> LockRecord:
        """A LockRecord from a stored document; ``age_ms`` defaults to the ``_age_ms`` a read added."""
        hb = _aware(doc.get("hb"))
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
            last_run_started=_aware(doc.get("last_run_started")),
            last_run_finished=_aware(doc.get("last_run_finished")),
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
        with self._errors(op):
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
        with self._errors("ping"):
            self.client.admin.command("ping")

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
            with self._errors("acquire_or_renew", write=True):
                doc = self.collection.find_one_and_update(
                    query, [{"$set": fields}], upsert=True, return_document=ReturnDocument.AFTER
                )
        except pymongo.errors.DuplicateKeyError:
            doc = None  # refused: the document exists and failed the filter (or a racing upsert made it)
        except _UnknownOutcome:
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

    def heartbeat(
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
            with self._errors("heartbeat", write=True):
                doc = self.collection.find_one_and_update(
                    query, [{"$set": fields}], projection={"_id": True}, return_document=ReturnDocument.AFTER
                )
        except _UnknownOutcome as exc:
            # A re-read cannot tell whether ``hb`` moved: neither a renewal nor a loss. The caller retries.
            self._unavailable("heartbeat: outcome unknown", exc.__cause__ or exc)
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
            with self._errors("renew_many", write=True):
                result = self.collection.update_many(query, [{"$set": {"hb": self.now_expr()}}])
        except _UnknownOutcome as exc:
            # Nothing may be counted as renewed (hb may not have moved), nor as lost.
            self._unavailable("renew_many: outcome unknown", exc.__cause__ or exc)
        if result.matched_count == len(names):
            return set(names)
        # Say which were renewed: those still ours with the same token (a token never comes back).
        with self._errors("renew_many (read)"):
            docs = list(self.collection.find({"_id": {"$in": names}, "holder": node.node_id}, {"token": True}))
        return {doc["_id"] for doc in docs if doc.get("token") == leases[doc["_id"]]}

    def release(self, name: str, node: Node, token: int) -> bool:
        query = {"_id": name, "holder": node.node_id, "token": token}
        try:
            with self._errors("release", write=True):
                result = self.collection.update_one(query, {"$set": {"holder": None, "hb": EPOCH}})
        except _UnknownOutcome as exc:
            # Released with our token can only be our release; anything else is not known yet.
            with self._errors("release (re-read)"):
                stored = self._committed.find_one({"_id": name}, {"holder": True, "token": True})
            if stored is not None and stored.get("holder") is None and stored.get("token") == token:
                return True
            self._unavailable("release: outcome unknown", exc.__cause__ or exc)
        return bool(result.matched_count == 1)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


def _claim_expr(claim: FireClaim) -> dict[str, Any]:
    """``fires`` with ``fires[job] = [fire_us, nonce]`` if ``fire_us`` is newer than the stored one.

    Job keys may hold dots, quotes and ``$``: they are only ever compared as ``$literal`` values
    (``$objectToArray``/``$arrayToObject``), never used as field paths. This form runs on MongoDB
    4.2+ and on mongomock alike (mongomock lacks ``$getField``, ``$setField``, ``$mergeObjects``
    and ``$reduce`` as expressions).
    """
    job = {"$literal": claim.job}
    pairs = {"$objectToArray": {"$ifNull": ["$fires", {}]}}
    ours = {"$filter": {"input": pairs, "cond": {"$eq": ["$$this.k", job]}}}
    stored_us = {
        "$ifNull": [{"$arrayElemAt": [{"$arrayElemAt": [{"$map": {"input": ours, "in": "$$this.v"}}, 0]}, 0]}, _MIN_INT64]
    }
    others = {"$filter": {"input": pairs, "cond": {"$ne": ["$$this.k", job]}}}
    claimed = {"$arrayToObject": {"$concatArrays": [others, {"$literal": [{"k": claim.job, "v": [claim.fire_us, claim.nonce]}]}]}}
    return {"$cond": [{"$gt": [claim.fire_us, stored_us]}, claimed, {"$ifNull": ["$fires", {}]}]}
