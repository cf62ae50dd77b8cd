"""SQL backends through SQLAlchemy 2 Core: ``sqlite://``, ``mysql://``/``mariadb://``, ``postgresql://``.

One engine per backend. Every statement runs on a pooled connection in autocommit (READ
COMMITTED); an explicit transaction (:meth:`SQLBackend.transaction`) is the exception. The pool
(:class:`IdleTrimmingPool`) keeps as many connections as the node really uses at once, up to the
number of threads that can call the store (:meth:`SQLBackend.size_pool`), and closes the ones left
idle for minutes. What differs between databases (driver, session settings, timeouts, the clock in
SQL) is one :class:`~mutexcron.backends.sql_dialects.SQLDialect` per registry family, in
:mod:`mutexcron.backends.sql_dialects`.

SQLite lets one connection write at a time. Its busy handler makes a writer that finds the file
locked sleep 1 ms, 2 ms, 5 ms... and try again; the threads of one node (a holder's executor
handing off the runs of one second) would take turns that way, each turn a wasted wake-up and a
few system calls. So writes to a SQLite file queue on one mutex per file in this process
(:func:`write_mutex`), and reach the busy handler only when another process holds the file.

Failures: contention (a busy SQLite file, a lock wait timeout, a deadlock, a lost insert race)
raises :class:`~mutexcron.backends.base.UncertainOutcome`; a database that cannot be reached
raises StoreUnavailableError; a request the database refuses (a value out of range, too long or
not encodable, a statement over MySQL's ``max_allowed_packet``) raises StoreError, so it is never
mistaken for an outage. A pooled connection the server dropped is replaced once, silently.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import sqlalchemy
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, make_url

from ..errors import ConfigurationError, SchemaMissingError, StoreError, StoreUnavailableError
from ..urls import mask_url, pop_query, url_scheme
from . import family_of
from .base import Backend, UncertainOutcome
from .sql_dialects import CONNECT_TIMEOUT, DIALECTS
from .sql_pool import DEFAULT_POOL_SIZE, POOL_IDLE_TIMEOUT, POOL_MIN_IDLE, POOL_OVERFLOW, IdleTrimmingPool

log = logging.getLogger(__name__)

#: mutexcron's own URL options, removed before SQLAlchemy sees the URL.
# tasks_table: the task store's; history: the lock store's run-history length (same URL for both)
OWN_OPTIONS = ("table", "tasks_table", "pool_size", "history")
DEFAULT_TABLE = "mutexcron_locks"
TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")  # used with fullmatch: "$" alone accepts a trailing newline

# Errors the request caused, not the server's state: retrying cannot help and the store is up.
_MYSQL_REQUEST_ERRORS = frozenset(
    {
        1048,  # column cannot be null
        1153,  # packet bigger than max_allowed_packet
        1264,  # out of range value
        1265,  # data truncated
        1292,  # truncated incorrect value
        1366,  # incorrect string value
        1406,  # data too long
        1916,  # overflow converting a value
    }
)
_PG_REQUEST_ERROR_CLASSES = ("22", "54")  # data exception, program limit exceeded
_MYSQL_DISCONNECTS = frozenset({2006, 2013})  # server has gone away, lost connection during query
# MySQL drops the connection when a statement exceeds max_allowed_packet (no error reaches the
# client while it is still sending). A disconnect after sending at least this much makes the
# backend ask the server for its limit, on the error path only; smaller requests never trip it.
_MYSQL_PACKET_CHECK_BYTES = 1 << 20
_T = TypeVar("_T")


class WriteTurn:
    """The turns of this process's writers to one SQLite file: a re-entrant mutex in :attr:`lock`.

    A forked child gets a new mutex (:func:`_after_fork_in_child`): one held by a parent's thread
    at the fork would never be released in the child, whose every write would then wait out the
    busy timeout and fail as contention.
    """

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.RLock()


_write_turns: dict[str, WriteTurn] = {}
_write_turns_guard = threading.Lock()


def write_mutex(path: str) -> WriteTurn:
    """The turns this process's writers to the SQLite file ``path`` queue on (one per file, whatever the spelling)."""
    key = os.path.realpath(path)
    with _write_turns_guard:
        return _write_turns.setdefault(key, WriteTurn())


#: The SQL backends of this process, for :func:`_after_fork_in_child`.
_live_backends: weakref.WeakSet[SQLBackend] = weakref.WeakSet()
#: Pools a forked child inherited: kept, never used or closed (closing would end the parent's connections).
_inherited_pools: list[Any] = []


def _after_fork_in_child() -> None:
    """A forked child: new write turns, and new (empty) connection pools for the engines it inherited.

    A thread of the parent may have held a write turn or a pool's mutex at the fork, and a pooled
    connection is the parent's (two processes on one SQLite handle or one server session corrupt
    each other). The inherited pools are kept referenced so that no connection of the parent's is
    closed from here.
    """
    global _write_turns_guard
    _write_turns_guard = threading.Lock()
    for turn in list(_write_turns.values()):
        turn.lock = threading.RLock()
    for backend in list(_live_backends):
        _inherited_pools.append(backend.engine.pool)
        backend.engine.dispose(close=False)


def absolute_sqlite_url(url: str) -> str:
    """``sqlite:///relative.db`` as ``sqlite:////<working directory>/relative.db`` (its query kept).

    A relative SQLite path names a different file in each working directory; absolute, the logs and
    ``status`` show which file joins the processes of a host. Other URLs come back unchanged.
    """
    head, sep, rest = url.partition(":///")
    path, question, query = rest.partition("?")
    if not sep or url_scheme(url) != "sqlite" or not path or path.startswith(("/", "file:")) or path == ":memory:":
        return url
    return f"{head}:///{os.path.abspath(path)}{question}{query}"



class SQLBackend(Backend):
    """A SQLAlchemy engine on one database, and the table name from ``?table=``.

    Args:
        url: ``sqlite:///path``, ``mysql://``, ``mysql+pymysql://``, ``mariadb://``,
            ``postgresql://`` or ``postgres://``; any driver options SQLAlchemy accepts, plus
            ``?table=`` (default ``mutexcron_locks``) and ``?pool_size=`` (keep exactly that many
            connections for good, instead of the pool rule of :class:`IdleTrimmingPool`).
        connect_timeout: seconds to wait for a connection before failing closed.
        **engine_options: passed to :func:`sqlalchemy.create_engine` (``connect_args`` are merged);
            ``pool_size``, ``poolclass`` or ``pool`` here choose the pool as ``?pool_size=`` does.
    """

    driver_errors = (sa_exc.DBAPIError, sa_exc.TimeoutError)

    def __init__(self, url: str, *, connect_timeout: float = CONNECT_TIMEOUT, **engine_options: Any) -> None:
        # Absolute from here on: what the logs and `status` show, and the same file after a chdir.
        url = absolute_sqlite_url(url)
        super().__init__(url)
        self._set_up: set[str] = set()  # tables the stores on this backend have created
        self._setup_lock = threading.Lock()
        rest, options = pop_query(url, *OWN_OPTIONS)
        if "pool_size" in options:
            size = options["pool_size"]
            if not size.isdecimal() or int(size) < 1:
                raise ConfigurationError(f"bad ?pool_size={size!r} in {mask_url(url)}: use a whole number of at least 1")
            engine_options.setdefault("pool_size", int(size))
        #: The caller chose the pool (its size or its class): :meth:`size_pool` leaves it alone.
        self.pool_fixed = any(key in engine_options for key in ("pool_size", "poolclass", "pool"))
        #: The lock table (``?table=``); other stores name their tables after it.
        self.table = options.get("table", DEFAULT_TABLE)
        if not TABLE_RE.fullmatch(self.table):
            raise ConfigurationError(
                f"bad ?table={self.table!r} in {mask_url(url)}: use letters, digits and _ (at most 63, not starting with a digit)"
            )
        family = family_of(rest).name
        if family not in DIALECTS:
            raise ConfigurationError(f"{mask_url(url)} is not a SQL URL")
        self.dialect = DIALECTS[family]
        self.kind = self.dialect.kind
        self._check_options(rest)
        #: The database's clock in SQL.
        self.clock = self.dialect.clock
        self.engine: Engine = self._create_engine(rest, connect_timeout, engine_options)
        database = self.engine.url.database
        #: Where this process's writers queue (one-writer databases), and for how long at most.
        self._write_mutex = write_mutex(database) if self.dialect.one_writer and database else None
        _live_backends.add(self)
        self._write_wait = connect_timeout
        # text() parses bind parameters with a regex on every call: build each statement once.
        self.text = functools.lru_cache(maxsize=256)(sqlalchemy.text)

    def _check_options(self, rest: str) -> None:
        """Refuse a query option neither mutexcron nor the driver knows, naming the accepted ones.

        Raises:
            ConfigurationError: ``?tabel=``, and every other typo.
        """
        given = [key for key, _ in parse_qsl(rest.partition("?")[2], keep_blank_values=True)]
        accepted = self.dialect.url_options()
        unknown = [key for key in given if key not in accepted]
        if not unknown:
            return
        close = difflib.get_close_matches(unknown[0], [*OWN_OPTIONS, *accepted], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(
            f"unknown option {unknown[0]!r} in the {self.kind} URL {self.masked_url}{hint}. mutexcron's options: "
            f"{', '.join(OWN_OPTIONS)}; the {self.kind} driver's: {', '.join(sorted(accepted))}"
        )

    def _create_engine(self, rest: str, connect_timeout: float, engine_options: dict[str, Any]) -> Engine:
        dialect = self.dialect
        try:
            sa_url = make_url(rest)
        except (sa_exc.ArgumentError, ValueError) as exc:
            raise ConfigurationError(f"cannot parse lock URL {self.masked_url}: {exc}") from None
        if dialect.file_only and (not sa_url.database or sa_url.database == ":memory:"):
            raise ConfigurationError(
                f"{self.masked_url} is an in-memory SQLite database, private to one connection: use "
                "sqlite:///path/to/file.db (shared by processes on one host) or memory:// (one process)"
            )
        sa_url = sa_url.set(drivername=dialect.driver)
        defaults = {k: v for k, v in dialect.url_query.items() if k not in sa_url.query}
        if defaults:
            sa_url = sa_url.update_query_dict(defaults)
        options: dict[str, Any] = {
            "isolation_level": "AUTOCOMMIT",
            # No pre-ping: it would add a round trip to every operation. A pooled connection the
            # server dropped fails its statement with a disconnect; run() retries that once.
            "pool_pre_ping": False,
            # Autocommit leaves no transaction open, so the ROLLBACK a pool sends on every
            # check-in would only be another round trip.
            "pool_reset_on_return": None,
            **_pool_options(engine_options, connect_timeout),
            **dialect.engine_options,
            "connect_args": {**dialect.connect_args(connect_timeout), **engine_options.pop("connect_args", {})},
        }
        options.update(engine_options)
        engine = sqlalchemy.create_engine(sa_url, **options)
        # Closing a connection "rolls back" even in autocommit, and PyMySQL sends that ROLLBACK: a
        # second round trip per operation, whose failure on a dropped connection also hides the
        # statement's own error. SQLAlchemy >= 2.0.43 skips it with this flag (older ones ignore it).
        engine.dialect.skip_autocommit_rollback = True
        session = dialect.session(connect_timeout)
        if session:

            @event.listens_for(engine, "connect")
            def _session(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                for statement in session:
                    _execute_patiently(cur, statement, connect_timeout)
                cur.close()

        return engine

    def size_pool(self, concurrency: int) -> None:
        """Keep up to ``concurrency`` pooled connections: the threads of this node that can call the store at once.

        The store is built before the scheduler knows its executors, so the scheduler calls this at
        start with its executors' threads plus its own two (the heartbeat and the catch-up thread).
        Only the connections the node really uses at once are kept (see :class:`IdleTrimmingPool`),
        so a count above the real need costs nothing. No effect when the caller chose the pool
        (``?pool_size=``, ``pool_size=``, ``poolclass=``, ``pool=``): an explicit choice wins.

        Raises:
            ValueError: ``concurrency`` is below 1.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        pool = self.engine.pool
        if self.pool_fixed or not isinstance(pool, IdleTrimmingPool):
            log.debug("%s: the pool was chosen explicitly; not resized to %d", self.masked_url, concurrency)
            return
        pool.resize(concurrency)

    # -- running statements ------------------------------------------------------------------
    def run_in_transaction(self, work: Callable[[Connection], _T], begin: str, operation: str) -> _T:
        """``work`` in one short transaction opened with ``begin`` (the dialect's; SQLite: BEGIN
        IMMEDIATE), committed, or rolled back on any error (a connection that cannot roll back is
        invalidated: never pooled with row locks held). An unknown outcome raises
        StoreUnavailableError."""
        try:
            mutex = self._queue_to_write(operation)
            try:
                return self.run(lambda conn: self.transaction(conn, work, begin), operation)
            finally:
                if mutex is not None:
                    mutex.release()
        except UncertainOutcome as exc:
            raise self.uncertain(exc) from exc

    def _queue_to_write(self, operation: str) -> threading.RLock | None:
        """Take this process's turn to write a one-writer database (held until the caller releases
        it); None elsewhere. Waiting longer than the busy timeout is contention, as in the driver.

        Raises:
            UncertainOutcome: no turn within the busy timeout.
        """
        turn = self._write_mutex
        if turn is None:
            return None
        mutex = turn.lock  # the caller releases this one, even if a fork made a new one meanwhile
        if not mutex.acquire(timeout=self._write_wait):
            raise UncertainOutcome(operation, f"other writers of this process held the file for {self._write_wait:g}s")
        return mutex

    def run(self, work: Callable[[Connection], _T], operation: str) -> _T:
        """Run ``work(connection)`` on a pooled connection, translating driver errors.

        A statement that fails because the server dropped the pooled connection (a restart, an
        idle timeout) is run once more on a fresh connection: every caller's work must be safe to
        repeat (the lock store's are: conditional on holder and token, or the same claim nonce).

        Raises:
            UncertainOutcome: contention; the caller decides what that means.
            StoreUnavailableError: the database cannot be reached.
            StoreError: the database refused the request.
        """
        for attempt in (1, 2):
            try:
                with self.engine.connect() as conn:
                    return work(conn)
            except sa_exc.DBAPIError as exc:
                if _is_lock_conflict(exc) or _is_duplicate_key(exc):
                    raise UncertainOutcome(operation, "contention") from exc
                error = self.error(exc, operation)
                if exc.connection_invalidated and attempt == 1 and isinstance(error, StoreUnavailableError):
                    log.debug("%s: pooled connection to %s was dropped; retrying once", operation, self.masked_url)
                    continue
                raise error from exc
            except sa_exc.TimeoutError as exc:  # no pooled connection came free in time
                raise self.unavailable(exc, operation) from exc
            except UnicodeError as exc:  # a value the driver cannot encode: nothing was sent
                raise self.failed(exc, operation, why=self.redact(f"a value is not valid text ({exc})")) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def execute(self, sql: str, params: Mapping[str, Any], operation: str, *, write: bool = False) -> tuple[list[Any], int]:
        """Run one statement; return the fetched rows and the rowcount.

        Raises:
            UncertainOutcome: contention on a write (``write``); on a read it is an outage.
        """

        def one(conn: Connection) -> tuple[list[Any], int]:
            result = conn.execute(self.text(sql), dict(params))
            return (list(result.fetchall()) if result.returns_rows else []), result.rowcount

        try:
            mutex = self._queue_to_write(operation) if write else None
            try:
                return self.run(one, operation)
            finally:
                if mutex is not None:
                    mutex.release()
        except UncertainOutcome as exc:
            if write:
                raise
            raise self.uncertain(exc) from exc

    def transaction(self, conn: Connection, work: Callable[[Connection], _T], begin: str = "START TRANSACTION") -> _T:
        """Run ``work`` in one explicit transaction opened with ``begin`` on an autocommit connection,
        committed, or rolled back on any error (:func:`_roll_back`)."""
        conn.exec_driver_sql(begin)
        try:
            result = work(conn)
            conn.exec_driver_sql("COMMIT")
        except BaseException:
            _roll_back(conn)
            raise
        return result

    # -- schema ------------------------------------------------------------------------------
    def setup_once(self, key: str, work: Callable[[Connection], None], operation: str, hint: str) -> None:
        """:meth:`setup` the first time a store needs ``key`` (its table) on this backend; then nothing."""
        if key in self._set_up:
            return
        with self._setup_lock:
            if key not in self._set_up:
                if self.read_only:
                    self._require_table(key)
                else:
                    self.setup(work, operation, hint)
                self._set_up.add(key)

    def _require_table(self, table: str) -> None:
        """A read-only backend's :meth:`setup_once`: the table must exist already."""
        missing = self.missing_schema(table)
        if missing is not None:
            raise SchemaMissingError(
                f"{missing} in {self.masked_url}: no node has used this store yet, or the URL names another "
                "file, database or table than the nodes use (a reader creates nothing)"
            )

    def missing_file(self) -> str | None:
        """``no such file PATH`` for a SQLite database that does not exist (connecting would create
        it), else None. Reads nothing from the store."""
        database = self.engine.url.database
        if self.dialect.file_only and database and not os.path.exists(database):
            return f"no such file {database}"
        return None

    def missing_schema(self, table: str) -> str | None:
        """What a reader of ``table`` would have to create first: ``no such file PATH`` (SQLite) or
        ``no such table 'NAME'``; None when both exist. Only reads: the one check of every reader
        that must not write (``status``, ``history``, the dashboard)."""
        missing = self.missing_file()
        if missing is not None:
            return missing
        if self.run(lambda conn: bool(sqlalchemy.inspect(conn).has_table(table)), "checking table"):
            return None
        return f"no such table {table!r}"

    def setup(self, work: Callable[[Connection], None], operation: str, hint: str) -> None:
        """Run a store's one-time set-up (its CREATE statements) on a fresh connection.

        Args:
            work: creates what the store needs (:meth:`create`).
            operation: what it does, for messages ("creating table 'x'").
            hint: what the user can do if the database refuses.
        """
        try:
            with self.engine.connect() as conn:
                work(conn)
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as exc:
            raise self.unavailable(exc, "connecting") from exc
        except sa_exc.DBAPIError as exc:
            raise self.failed(exc, operation, why=f"{self.detail(exc)}; {hint}") from exc

    def create(self, conn: Connection, statement: str) -> None:
        """Run one ``CREATE ... IF NOT EXISTS``; another node creating the same thing at once is fine."""
        try:
            conn.execute(self.text(statement))
        except (sa_exc.IntegrityError, sa_exc.ProgrammingError) as exc:
            # Two nodes creating the table at once (PostgreSQL's catalog race).
            log.debug("concurrent CREATE on %s: %s", self.masked_url, exc)

    def key_collation(self, conn: Connection) -> str:
        """The collation for names and keys on a MySQL/MariaDB server: binary and NO PAD, so
        ``'1042'`` and ``'1042 '`` are two keys (``utf8mb4_bin`` pads: it ignores trailing spaces)."""
        return "utf8mb4_nopad_bin" if self.is_mariadb(conn) else "utf8mb4_0900_bin"

    def with_key_collation(self, conn: Connection, statement: str) -> str:
        """``statement`` with :meth:`key_collation` as its tables' collation (MySQL/MariaDB only)."""
        if conn.dialect.name != "mysql":
            return statement
        return statement.replace("COLLATE=utf8mb4_bin", f"COLLATE={self.key_collation(conn)}")

    def pads_spaces(self, conn: Connection, table: str, column: str) -> bool:
        """True if ``table.column`` (MySQL/MariaDB) compares ignoring trailing spaces (a PAD SPACE
        collation, e.g. the ``utf8mb4_bin`` of a table an earlier mutexcron created); says so once in the log."""
        if conn.dialect.name != "mysql":
            return False
        row = conn.execute(
            self.text(
                "SELECT COLLATION_NAME FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t AND COLUMN_NAME = :c"
            ),
            {"t": table, "c": column},
        ).fetchone()
        name = str(row[0] or "") if row is not None else ""
        pads = bool(name) and "nopad" not in name and "_0900_" not in name and name != "binary"
        if pads:
            log.warning(
                "%s: table %s compares %s ignoring trailing spaces (created by an earlier mutexcron): names ending "
                "with a space are refused; convert it once with ALTER TABLE %s CONVERT TO CHARACTER SET utf8mb4 "
                "COLLATE utf8mb4_nopad_bin (MySQL 8: utf8mb4_0900_bin)",
                self.masked_url,
                table,
                column,
                table,
            )
        return pads

    def refuse_padded(self, names: Iterable[str], what: str, table: str) -> None:
        """ConfigurationError if a name ends with a space: on a table that pads, it is another name's row."""
        for name in names:
            if name.endswith(" "):
                raise ConfigurationError(
                    f"{what} {name!r} ends with a space, and table {table} on {self.masked_url} compares names ignoring "
                    "trailing spaces (its collation pads), so it would be the same row as "
                    f"{name.rstrip(' ')!r}. Drop the trailing space, or convert the table once: ALTER TABLE {table} "
                    "CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin (MySQL 8: utf8mb4_0900_bin)"
                )

    @staticmethod
    def is_mariadb(conn: Connection) -> bool:
        """True if ``conn`` is to a MariaDB server (the ``mysql`` dialect serves both)."""
        return conn.dialect.name == "mysql" and bool(getattr(conn.dialect, "is_mariadb", False))

    # -- errors ------------------------------------------------------------------------------
    def detail(self, exc: BaseException) -> str:
        return super().detail(getattr(exc, "orig", None) or exc)  # the DBAPI error under SQLAlchemy's wrapper

    def is_unavailable(self, exc: BaseException) -> bool:
        return isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)) or bool(
            getattr(exc, "connection_invalidated", False)
        )

    def error(self, exc: BaseException, operation: str) -> StoreError:
        refusal = self._detail_if_request_error(exc) or self._over_max_packet(exc)
        if refusal:
            return self.failed(exc, operation, why=f"refused by the database (a request error, not an outage): {refusal}")
        return super().error(exc, operation)

    def _detail_if_request_error(self, exc: BaseException) -> str | None:
        """The database refused this request's values or size: the store itself is fine."""
        sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None) or ""
        if (
            isinstance(exc, (sa_exc.DataError, sa_exc.IntegrityError))
            or _mysql_code(exc) in _MYSQL_REQUEST_ERRORS
            or sqlstate[:2] in _PG_REQUEST_ERROR_CLASSES
        ):
            return self.detail(exc)
        return None

    def _over_max_packet(self, exc: BaseException) -> str | None:
        """Why MySQL dropped the connection, if the statement was larger than its ``max_allowed_packet``."""
        if self.dialect.packet_limit is None or _mysql_code(exc) not in _MYSQL_DISCONNECTS:
            return None
        size = _request_bytes(exc)
        if size < _MYSQL_PACKET_CHECK_BYTES:
            return None
        try:
            with self.engine.connect() as conn:
                limit = int(conn.exec_driver_sql(self.dialect.packet_limit).scalar_one())
        except sa_exc.SQLAlchemyError:  # the server is really gone: an outage after all
            return None
        if size <= limit:
            return None
        return f"a statement of about {size:,} bytes is over the server's max_allowed_packet of {limit:,} bytes"

    # -- life cycle --------------------------------------------------------------------------
    def ping(self) -> None:
        self.execute("SELECT 1", {}, "ping")

    def close(self) -> None:
        self.engine.dispose()


def _pool_options(engine_options: Mapping[str, Any], connect_timeout: float) -> dict[str, Any]:
    """The engine options of the pool rule (:class:`IdleTrimmingPool`), or none for a pool the caller brings."""
    if "poolclass" in engine_options or "pool" in engine_options:
        return {}  # the caller's pool: its options are the caller's too
    explicit = engine_options.get("pool_size")
    return {
        "poolclass": IdleTrimmingPool,
        "pool_size": DEFAULT_POOL_SIZE,
        "max_overflow": POOL_OVERFLOW,
        # Waiting longer for a pooled connection than for a new one would hide an outage.
        "pool_timeout": connect_timeout,
        "idle_timeout": POOL_IDLE_TIMEOUT,
        # An explicit ?pool_size= keeps that many for good, as SQLAlchemy's QueuePool did.
        "min_idle": POOL_MIN_IDLE if explicit is None else explicit,
    }


def _is_lock_conflict(exc: BaseException) -> bool:
    """Lost a race for a row: a deadlock, a lock wait timeout, or SQLite's write lock held too long.

    SQLite serialises writers: "database is locked" after the busy timeout means another process
    held the write lock (for instance one frozen mid-write), not that the file is unreachable.
    """
    orig = getattr(exc, "orig", None)
    text = str(orig or exc).lower()
    if "database is locked" in text or "database is busy" in text:
        return True
    if _mysql_code(exc) in (1213, 1205):  # MySQL deadlock, lock wait timeout
        return True
    return getattr(orig, "sqlstate", None) in ("40P01", "40001", "55P03")


def _is_duplicate_key(exc: BaseException) -> bool:
    """Another session inserted the same row first (any other integrity error is the request's)."""
    orig = getattr(exc, "orig", None)
    return (
        _mysql_code(exc) == 1062
        or getattr(orig, "sqlstate", None) == "23505"
        or "unique constraint failed" in str(orig or exc).lower()
    )


def _mysql_code(exc: BaseException) -> int | None:
    """The MySQL error number of a PyMySQL error (its first argument), else None."""
    args = getattr(getattr(exc, "orig", None), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _request_bytes(exc: BaseException) -> int:
    """About how many bytes the failed statement and its parameters took on the wire."""
    while getattr(exc, "statement", None) is None and exc.__context__ is not None:
        exc = exc.__context__  # a failed ROLLBACK at close (older SQLAlchemy) hides the statement's error
    params = getattr(exc, "params", None)
    values = params.values() if isinstance(params, Mapping) else params or ()
    size = len((getattr(exc, "statement", None) or "").encode())
    for value in values:
        size += len(value) if isinstance(value, (bytes, bytearray)) else len(str(value).encode(errors="replace"))
    return size


def _roll_back(conn: Connection) -> None:
    """End a failed explicit transaction, or drop the connection so no pooled one keeps row locks."""
    try:
        conn.exec_driver_sql("ROLLBACK")
    except sa_exc.SQLAlchemyError:
        conn.invalidate()


def _execute_patiently(cur: Any, statement: str, timeout: float) -> None:
    """Run a session statement, retrying while SQLite says "database is locked".

    Switching a new SQLite file to WAL needs an exclusive lock that SQLite's busy handler does not
    wait for: nodes starting at the same moment on a fresh file would fail at once otherwise.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            cur.execute(statement)
            return
        except Exception as exc:  # the driver's own error type; re-raised unless "locked"
            if "database is locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


if hasattr(os, "register_at_fork"):  # POSIX: prefork servers, multiprocessing's fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
