"""``mongodb://`` and ``mongodb+srv://``: the MongoDB backend.

One ``pymongo.MongoClient`` per backend (or one a test injects), the database from the URL's path
(default ``mutexcron``) and the lock collection from ``?collection=`` (default
``mutexcron_locks``). Writes use write concern ``majority`` and reads the primary; re-reads after
an unknown write outcome see only majority-committed data (:meth:`MongoDBBackend.committed`).
The store's clock is the server's ``$$NOW`` (:meth:`MongoDBBackend.now_expr`), which only tests
replace, because mongomock does not know it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pymongo
import pymongo.errors
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from ..errors import ConfigurationError
from ..urls import mask_url, url_scheme
from . import family
from .base import Backend, UncertainOutcome

log = logging.getLogger(__name__)

__all__ = ["MongoDBBackend", "MongoURL", "parse_url"]

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

#: The server's clock in every expression a store sends (MongoDB >= 4.2).
SERVER_NOW = "$$NOW"

# The server cannot be reached or is not the primary right now: fail closed.
_UNAVAILABLE: tuple[type[Exception], ...] = (
    pymongo.errors.ConnectionFailure,  # AutoReconnect, NetworkTimeout, ServerSelectionTimeoutError...
    pymongo.errors.ConfigurationError,  # raised by an operation: mongodb+srv DNS lookup failed
)


@dataclass(frozen=True)
class MongoURL:
    """What :func:`parse_url` makes of a store URL."""

    client_url: str
    """The URL handed to pymongo: the store URL without mutexcron's ``collection`` option."""
    database: str
    collection: str
    defaults: dict[str, Any] = field(default_factory=dict)
    """The :data:`DEFAULT_CLIENT_OPTIONS` the URL does not set itself."""


def parse_url(url: str, options: Iterable[str] = ()) -> MongoURL:
    """Split a store URL into pymongo's URL, the database, the collection and the default options.

    Args:
        url: ``mongodb://...`` or ``mongodb+srv://...``.
        options: names of client options given as keywords (they count as set, like URL options).

    Raises:
        ConfigurationError: not a MongoDB URL, or a bad database or collection name.
    """
    if url_scheme(url) not in family("mongodb").schemes:
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
        elif key in ("tasks_collection", "history"):
            continue  # the task store's and the lock store's options, not pymongo's
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


class MongoDBBackend(Backend):
    """A MongoDB client, database and lock collection name, from one URL (MongoDB >= 4.2; 5.0+ recommended).

    Args:
        url: ``mongodb://`` or ``mongodb+srv://``; the database comes from the path (default
            ``mutexcron``), the lock collection from ``?collection=`` (default ``mutexcron_locks``).
        client: a ready client to use instead of building one from the URL (tests inject a
            ``mongomock.MongoClient``); the backend then does not close it.
        now: tests only: a callable returning the date to use as "now" instead of the server's
            ``$$NOW`` (which mongomock does not know). Production code never passes it.
        **options: extra ``pymongo.MongoClient`` keyword options; they win over the URL and the
            defaults.
    """

    kind = "MongoDB"
    driver_errors = (pymongo.errors.PyMongoError,)

    def __init__(self, url: str, *, client: Any = None, now: Callable[[], Any] | None = None, **options: Any) -> None:
        super().__init__(url)
        parsed = parse_url(url, options)
        self.database_name = parsed.database
        #: The lock collection (``?collection=``).
        self.collection_name = parsed.collection
        self._now = now
        self._owns_client = client is None
        if client is None:
            kwargs: dict[str, Any] = {"connect": False, "tz_aware": True, **parsed.defaults, **options}
            try:
                client = pymongo.MongoClient(parsed.client_url, **kwargs)
            except (pymongo.errors.ConfigurationError, ValueError, TypeError) as exc:  # InvalidURI, bad port, no dnspython
                raise ConfigurationError(
                    f"bad MongoDB lock URL {self.masked_url!r}: {self.redact(str(exc))}; use {URL_FORMS}"
                ) from exc
        self.client = client
        self.database = client.get_database(parsed.database)
        log.debug("MongoDB backend %s: database %r, collection %r", self.masked_url, parsed.database, parsed.collection)

    def collection(self, name: str) -> Any:
        """The collection ``name``: primary reads, the client's write concern (``majority`` by default)."""
        return self.database.get_collection(name, read_preference=ReadPreference.PRIMARY)

    @staticmethod
    def committed(collection: Any) -> Any:
        """``collection`` reading only majority-committed data (for re-reads after an unknown outcome)."""
        return collection.with_options(read_concern=ReadConcern("majority"))

    # -- the clock, and its one seam -----------------------------------------------------------
    def now_expr(self) -> Any:
        """The expression every operation uses for "now": the server's ``$$NOW``.

        Only tests replace it (``now=``), with a date from an injected clock, because mongomock
        does not know ``$$NOW``. Call it once per operation, so one command sees one "now".
        """
        return SERVER_NOW if self._now is None else self._now()

    # -- errors ------------------------------------------------------------------------------
    def is_unavailable(self, exc: BaseException) -> bool:
        return isinstance(exc, _UNAVAILABLE)

    @contextmanager
    def errors(self, operation: str, *, write: bool = False) -> Iterator[None]:
        """Translate driver errors; on a write, an unknown outcome raises :class:`UncertainOutcome`.

        A DuplicateKeyError passes through: to an upsert it means "refused", not a failure.
        """
        try:
            yield
        except pymongo.errors.DuplicateKeyError:
            raise
        except pymongo.errors.WriteConcernError as exc:  # incl. WTimeoutError
            if not write:
                raise self.error(exc, operation) from exc
            log.warning(
                "MongoDB store %s: %s: write concern not satisfied (%s); outcome unknown",
                self.masked_url,
                operation,
                type(exc).__name__,
            )
            raise UncertainOutcome(operation, "outcome unknown") from exc
        except pymongo.errors.PyMongoError as exc:
            raise self.error(exc, operation) from exc

    # -- life cycle --------------------------------------------------------------------------
    def ping(self) -> None:
        with self.errors("ping"):
            self.client.admin.command("ping")

    def close(self) -> None:
        if self._owns_client:
            self.client.close()
