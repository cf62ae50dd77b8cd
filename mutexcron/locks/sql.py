"""SQL lock stores through SQLAlchemy 2 Core: ``sqlite://``, ``mysql://``/``mariadb://``, ``postgresql://``.

One row per lock. Every operation is one statement, run in autocommit (READ COMMITTED):

* acquire/renew is a conditional upsert; the lock is free when it has no holder, the caller holds
  it, or the holder's heartbeat is older than the holder's own ``ttl_ms`` **by the database
  clock** (``clock_timestamp()``, ``UTC_TIMESTAMP(6)``, SQLite ``'now'``). The per-tick fire claim
  is part of the same statement. PostgreSQL, SQLite and MariaDB return the row with
  ``RETURNING``; MySQL (no ``RETURNING``) reads it back in the same short transaction, whose row
  lock keeps other writers out until the read is done.
* heartbeat, renew_many and release are conditional UPDATEs on holder **and** token.

Failures: contention (a busy SQLite file, a lock wait timeout, a deadlock, a lost insert race)
makes an acquire *uncertain* and the other writes raise StoreUnavailableError; a database that
cannot be reached raises StoreUnavailableError; a request the database refuses (a value out of
range, too long or not encodable, a statement over MySQL's ``max_allowed_packet``) raises
StoreError, so it is never mistaken for an outage.

The schema (see :meth:`SQLLockStore.ddl`) is created if missing; teams that manage their own
schema can create it beforehand and the store will use it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from ..errors import ConfigurationError, StoreError, StoreUnavailableError
from ..record import LockRecord, dump_attrs, load_attrs
from ..urls import mask_url, pop_query, redact, url_scheme
from .base import AcquireResult, FireClaim, LockStore, Node, RunInfo, claim_won, fire_times_from_json

log = logging.getLogger(__name__)

_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")  # used with fullmatch: "$" alone accepts a trailing newline
_COLUMNS = (
    "name, holder, active_ip, token, hb, ttl_ms, attrs, fires, last_run_started, last_run_finished, last_error"
)
_NO_CLAIM = -1  # a fire time no claim can be below: "COALESCE(stored, -1) < -1" is always false

# The timeout rule, the same for every store: give up connecting after CONNECT_TIMEOUT seconds and
# any one operation (a statement, a socket read or write) after OPERATION_TIMEOUT, so a dead or
# partitioned server fails closed instead of freezing the heartbeat thread. A row lock is waited
# for LOCK_WAIT_TIMEOUT, less than an operation, so contention shows as contention, not as an outage.
CONNECT_TIMEOUT = 5
OPERATION_TIMEOUT = 10
LOCK_WAIT_TIMEOUT = 5
# PostgreSQL has no client-side read timeout. TCP keepalives (a probe after 5 s of silence, then
# every second, 5 unanswered: dead) and tcp_user_timeout (data unacknowledged for 10 s: dead) make
# the kernel drop a partitioned connection within OPERATION_TIMEOUT; the server still enforces
# statement_timeout and lock_timeout.
_PG_CONNECT_ARGS = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 1,
    "keepalives_count": 5,
    "tcp_user_timeout": OPERATION_TIMEOUT * 1000,
    "options": f"-c statement_timeout={OPERATION_TIMEOUT * 1000} -c lock_timeout={LOCK_WAIT_TIMEOUT * 1000}",
}
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
# store ask the server for its limit, on the error path only; smaller requests never trip it.
_MYSQL_PACKET_CHECK_BYTES = 1 << 20
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Dialect:
    """The SQL that differs between databases. ``{t}`` is the table name."""

    name: str
    now: str  # the database's current time, as stored in ``hb``
    age: str  # seconds since ``hb`` by the database clock
    minus_seconds: str  # ``now`` minus ``:dur`` seconds
    ddl: tuple[str, ...]
    acquire: str  # the conditional upsert
    returning: bool  # does ``acquire`` return the row?
    renew_many: str


_PG = _Dialect(
    name="postgresql",
    now="clock_timestamp()",
    age="EXTRACT(EPOCH FROM (clock_timestamp() - hb))",
    minus_seconds="clock_timestamp() - CAST(:dur AS double precision) * interval '1 second'",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    name              varchar(191) PRIMARY KEY,
    holder            varchar(255),
    active_ip         varchar(64),
    token             bigint       NOT NULL DEFAULT 0,
    hb                timestamptz,
    ttl_ms            bigint       NOT NULL DEFAULT 0,
    attrs             text         NOT NULL DEFAULT '{{}}',
    fires             jsonb        NOT NULL DEFAULT '{{}}',
    last_run_started  timestamptz,
    last_run_finished timestamptz,
    last_error        text
)""",
        "CREATE INDEX IF NOT EXISTS {t}_holder ON {t} (holder)",
    ),
    acquire="""
INSERT INTO {t} AS l (name, holder, active_ip, token, hb, ttl_ms, attrs, fires)
VALUES (:name, :me, :ip, 1, clock_timestamp(), :ttl_ms, '{{}}',
        CASE WHEN CAST(:ft AS bigint) >= 0
             THEN jsonb_build_object(CAST(:job AS text), jsonb_build_array(CAST(:ft AS bigint), CAST(:nonce AS text)))
             ELSE '{{}}'::jsonb END)
ON CONFLICT (name) DO UPDATE SET
    token = CASE WHEN l.holder IS NOT DISTINCT FROM CAST(:me AS varchar) THEN l.token ELSE l.token + 1 END,
    holder = :me, active_ip = :ip, hb = clock_timestamp(), ttl_ms = :ttl_ms,
    fires = CASE WHEN COALESCE(CAST(l.fires -> CAST(:job AS text) ->> 0 AS bigint), -1) < CAST(:ft AS bigint)
                 THEN l.fires || jsonb_build_object(CAST(:job AS text),
                                                    jsonb_build_array(CAST(:ft AS bigint), CAST(:nonce AS text)))
                 ELSE l.fires END
WHERE l.holder = :me OR l.holder IS NULL OR l.hb < clock_timestamp() - l.ttl_ms * interval '1 millisecond'
RETURNING {cols}, EXTRACT(EPOCH FROM (clock_timestamp() - l.hb)) AS age""",
    returning=True,
    renew_many="""
UPDATE {t} AS l SET hb = clock_timestamp()
FROM jsonb_to_recordset(CAST(:leases AS jsonb)) AS v(name text, token bigint)
WHERE l.name = v.name AND l.token = v.token AND l.holder = :me
RETURNING l.name""",
)

# MySQL assigns ON DUPLICATE KEY UPDATE columns left to right, and later expressions see the new
# values. So ``token`` and ``fires`` come first (they read the old holder), then ``holder``, and
# only then ``ttl_ms``/``hb``, which ``_MY_FREE`` also reads: once holder is set to :me,
# ``_MY_FREE`` stays true for the rest of the list iff it was true at the start.
_MY_FREE = "(holder = :me OR holder IS NULL OR hb < UTC_TIMESTAMP(6) - INTERVAL ttl_ms * 1000 MICROSECOND)"
_MYSQL_ACQUIRE = f"""
INSERT INTO {{t}} (name, holder, active_ip, token, hb, ttl_ms, attrs, fires)
VALUES (:name, :me, :ip, 1, UTC_TIMESTAMP(6), :ttl_ms, '{{{{}}}}',
        IF(:ft >= 0, JSON_OBJECT(:job, JSON_ARRAY(:ft, :nonce)), '{{{{}}}}'))
ON DUPLICATE KEY UPDATE
    token = IF({_MY_FREE}, IF(holder <=> :me, token, token + 1), token),
    fires = IF({_MY_FREE} AND COALESCE(CAST(JSON_EXTRACT(fires, :jpath0) AS SIGNED), -1) < :ft,
               JSON_MERGE_PATCH(fires, JSON_OBJECT(:job, JSON_ARRAY(:ft, :nonce))), fires),
    holder = IF({_MY_FREE}, :me, holder),
    active_ip = IF({_MY_FREE}, :ip, active_ip),
    ttl_ms = IF({_MY_FREE}, :ttl_ms, ttl_ms),
    hb = IF({_MY_FREE}, UTC_TIMESTAMP(6), hb)"""

_MYSQL_DDL = (
    """CREATE TABLE IF NOT EXISTS {t} (
    name              VARCHAR(191) NOT NULL PRIMARY KEY,
    holder            VARCHAR(255) NULL,
    active_ip         VARCHAR(64)  NULL,
    token             BIGINT       NOT NULL DEFAULT 0,
    hb                DATETIME(6)  NULL,
    ttl_ms            BIGINT       NOT NULL DEFAULT 0,
    attrs             LONGTEXT     NOT NULL,
    fires             LONGTEXT     NOT NULL,
    last_run_started  DATETIME(6)  NULL,
    last_run_finished DATETIME(6)  NULL,
    last_error        TEXT         NULL,
    INDEX {t}_holder (holder)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
)

_MYSQL = _Dialect(
    name="mysql",
    now="UTC_TIMESTAMP(6)",
    age="TIMESTAMPDIFF(MICROSECOND, hb, UTC_TIMESTAMP(6)) / 1000000.0",
    minus_seconds="UTC_TIMESTAMP(6) - INTERVAL :dur_us MICROSECOND",
    ddl=_MYSQL_DDL,
    acquire=_MYSQL_ACQUIRE,
    returning=False,
    renew_many="UPDATE {t} SET hb = UTC_TIMESTAMP(6) WHERE holder = :me AND (name, token) IN ({pairs})",
)

_MARIADB = _Dialect(
    **{
        **_MYSQL.__dict__,
        "name": "mariadb",
        # MariaDB returns the row as updated, even from ON DUPLICATE KEY UPDATE.
        "acquire": _MYSQL_ACQUIRE + "\nRETURNING {cols}, TIMESTAMPDIFF(MICROSECOND, hb, UTC_TIMESTAMP(6)) / 1000000.0",
        "returning": True,
    }
)

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_SQLITE = _Dialect(
    name="sqlite",
    now=_SQLITE_NOW,
    age="(julianday('now') - julianday(hb)) * 86400.0",
    minus_seconds="strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%.6f seconds', :dur))",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    name              TEXT    NOT NULL PRIMARY KEY,
    holder            TEXT,
    active_ip         TEXT,
    token             INTEGER NOT NULL DEFAULT 0,
    hb                TEXT,
    ttl_ms            INTEGER NOT NULL DEFAULT 0,
    attrs             TEXT    NOT NULL DEFAULT '{{}}',
    fires             TEXT    NOT NULL DEFAULT '{{}}',
    last_run_started  TEXT,
    last_run_finished TEXT,
    last_error        TEXT
)""",
        "CREATE INDEX IF NOT EXISTS {t}_holder ON {t} (holder)",
    ),
    acquire=f"""
INSERT INTO {{t}} (name, holder, active_ip, token, hb, ttl_ms, attrs, fires)
VALUES (:name, :me, :ip, 1, {_SQLITE_NOW}, :ttl_ms, '{{{{}}}}',
        CASE WHEN :ft >= 0 THEN json_object(:job, json_array(:ft, :nonce)) ELSE '{{{{}}}}' END)
ON CONFLICT (name) DO UPDATE SET
    token = CASE WHEN holder IS :me THEN token ELSE token + 1 END,
    holder = :me, active_ip = :ip, hb = {_SQLITE_NOW}, ttl_ms = :ttl_ms,
    fires = CASE WHEN COALESCE((SELECT json_extract(value, '$[0]') FROM json_each(fires) WHERE key = :job), -1) < :ft
                 THEN json_patch(fires, json_object(:job, json_array(:ft, :nonce))) ELSE fires END
WHERE holder = :me OR holder IS NULL
   OR hb < strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%.3f seconds', ttl_ms / 1000.0))
RETURNING {{cols}}, (julianday('now') - julianday(hb)) * 86400.0""",
    returning=True,
    renew_many=f"""
UPDATE {{t}} SET hb = {_SQLITE_NOW}
WHERE holder = :me AND (name || char(31) || token) IN (SELECT value FROM json_each(:keys))
RETURNING name""",
)


def _json_path(job: str) -> str:
    """A JSON path to the key ``job`` (quoted, so dots and spaces are literal)."""
    return '$."' + job.replace("\\", "\\\\").replace('"', '\\"') + '"'


class SQLLockStore(LockStore):
    """Lock records in one SQL table (``?table=``, default ``mutexcron_locks``).

    Args:
        url: ``sqlite:///path``, ``mysql://``, ``mysql+pymysql://``, ``mariadb://``,
            ``postgresql://`` or ``postgres://``; any driver options SQLAlchemy accepts.
        connect_timeout: seconds to wait for a connection before failing closed.
    """

    schemes = (
        "sqlite",
        "mysql",
        "mysql+pymysql",
        "mariadb",
        "mariadb+pymysql",
        "postgresql",
        "postgresql+psycopg",
        "postgres",
    )

    #: Use ``RETURNING`` when the server turns out to be MariaDB. Tests set it False in a subclass to
    #: run the MySQL 8 path (upsert and read-back in one transaction) on MariaDB.
    _use_mariadb_returning = True

    def __init__(self, url: str, *, connect_timeout: float = CONNECT_TIMEOUT, **engine_options: Any) -> None:
        super().__init__(url)
        import sqlalchemy
        from sqlalchemy import event
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        rest, options = pop_query(url, "table", "pool_size")
        if "pool_size" in options:
            try:
                engine_options.setdefault("pool_size", int(options["pool_size"]))
            except ValueError:
                raise ConfigurationError(
                    f"bad ?pool_size={options['pool_size']!r} in {mask_url(url)}: use a whole number"
                ) from None
        self.table = options.get("table", "mutexcron_locks")
        if not _TABLE_RE.fullmatch(self.table):
            raise ConfigurationError(
                f"bad ?table={self.table!r} in {mask_url(url)}: use letters, digits and _ (at most 63, not starting with a digit)"
            )
        scheme = url_scheme(rest)
        try:
            sa_url = make_url(rest)
        except (ArgumentError, ValueError) as exc:
            raise ConfigurationError(f"cannot parse lock URL {mask_url(url)}: {exc}") from None
        connect_args: dict[str, Any] = {}
        options_: dict[str, Any] = {
            "isolation_level": "AUTOCOMMIT",
            # No pre-ping: it would add a round trip to every operation. A pooled connection the
            # server dropped fails its statement with a disconnect; _execute retries that once.
            "pool_pre_ping": False,
            # Autocommit leaves no transaction open, so the ROLLBACK a pool sends on every
            # check-in would only be another round trip.
            "pool_reset_on_return": None,
            # SQLAlchemy's default pool (5 kept + 10 overflow). Many every-second jobs firing
            # together churn the overflow connections: ?pool_size=12 (above the executor's 10
            # threads) avoids that, at the price of more idle server connections per node.
            "pool_timeout": connect_timeout,
        }
        if scheme == "sqlite":
            if not sa_url.database or sa_url.database == ":memory:":
                raise ConfigurationError(
                    f"{mask_url(url)} is an in-memory SQLite database, private to one connection: use "
                    "sqlite:///path/to/file.db (shared by processes on one host) or memory:// (one process)"
                )
            sa_url = sa_url.set(drivername="sqlite+pysqlite")
            connect_args.update(timeout=connect_timeout, check_same_thread=False)
            self._dialect = _SQLITE
        elif scheme.startswith(("mysql", "mariadb")):
            sa_url = sa_url.set(drivername="mysql+pymysql")
            if "charset" not in sa_url.query:
                sa_url = sa_url.update_query_dict({"charset": "utf8mb4"})
            # PyMySQL reads the server's greeting under read_timeout: a server that accepts the
            # TCP connection and never answers fails after OPERATION_TIMEOUT, not connect_timeout.
            connect_args.update(
                connect_timeout=max(1, int(connect_timeout)), read_timeout=OPERATION_TIMEOUT, write_timeout=OPERATION_TIMEOUT
            )
            options_.update(pool_recycle=1800)
            self._dialect = _MYSQL  # refined to _MARIADB on first connect
        elif scheme.startswith("postgres"):
            sa_url = sa_url.set(drivername="postgresql+psycopg")
            connect_args.update(connect_timeout=max(1, int(connect_timeout)), **_PG_CONNECT_ARGS)
            self._dialect = _PG
        else:  # pragma: no cover - the registry only routes the schemes above here
            raise ConfigurationError(f"unsupported SQL scheme {scheme!r} in {mask_url(url)}")
        options_["connect_args"] = {**connect_args, **engine_options.pop("connect_args", {})}
        options_.update(engine_options)
        self.engine = sqlalchemy.create_engine(sa_url, **options_)
        # Closing a connection "rolls back" even in autocommit, and PyMySQL sends that ROLLBACK: a
        # second round trip per operation, whose failure on a dropped connection also hides the
        # statement's own error. SQLAlchemy >= 2.0.43 skips it with this flag (older ones ignore it).
        self.engine.dialect.skip_autocommit_rollback = True
        # text() parses bind parameters with a regex on every call: build each statement once.
        self._text = functools.lru_cache(maxsize=256)(sqlalchemy.text)
        self._bindparam = sqlalchemy.bindparam
        self._ready = False
        self._ready_lock = threading.Lock()

        if self._dialect is _SQLITE:

            @event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute(f"PRAGMA busy_timeout = {int(connect_timeout * 1000)}")
                cur.execute("PRAGMA journal_mode = WAL")
                cur.close()

        elif self._dialect is _MYSQL:

            @event.listens_for(self.engine, "connect")
            def _mysql_session(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                cur.execute(f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT_TIMEOUT}")
                cur.execute("SET SESSION time_zone = '+00:00'")
                cur.close()

    # -- plumbing ----------------------------------------------------------------------------
    def ddl(self) -> list[str]:
        """The CREATE statements for this table and database (also printed in the README)."""
        return [s.format(t=self.table) for s in self._dialect.ddl]

    def _sql(self, template: str, **extra: str) -> str:
        return template.format(t=self.table, cols=_COLUMNS, **extra)

    def _detail(self, exc: BaseException) -> str:
        """The driver's message, first line, without the password."""
        lines = str(getattr(exc, "orig", None) or exc).splitlines() or [type(exc).__name__]
        return redact(lines[0][:300], self.url)

    def _unavailable(self, exc: BaseException, what: str) -> StoreUnavailableError:
        return StoreUnavailableError(f"{what} failed on {self.masked_url}: {self._detail(exc)}")

    def _execute(self, sql: str, params: Mapping[str, Any], what: str, *, write: bool = False) -> Any:
        """Run one statement on a pooled autocommit connection; return the fetched rows and rowcount.

        Raises _Conflict on contention if ``write``; a read that meets contention is an outage.
        """

        def one(conn: Any) -> tuple[list[Any], int]:
            result = conn.execute(self._text(sql), dict(params))
            return (result.fetchall() if result.returns_rows else []), result.rowcount

        try:
            return self._run(one, what)
        except _Conflict as exc:
            if write:
                raise
            raise self._unavailable(exc.__cause__ or exc, what) from exc

    def _run(self, work: Callable[[Any], _T], what: str) -> _T:
        """Run ``work(connection)`` on a pooled connection, translating driver errors.

        A statement that fails because the server dropped the pooled connection (a restart, an
        idle timeout) is run once more on a fresh connection. Every operation here may be repeated:
        an acquire repeats with the same claim nonce, the others are conditional on holder and token.
        """
        from sqlalchemy import exc as sa_exc

        self._ensure_table()
        for attempt in (1, 2):
            try:
                with self.engine.connect() as conn:
                    return work(conn)
            except sa_exc.DBAPIError as exc:
                failure = self._failure(exc, what)
                if failure is None and attempt == 1:
                    log.debug("%s: pooled connection to %s was dropped; retrying once", what, self.masked_url)
                    continue
                raise (failure or self._unavailable(exc, what)) from exc
            except sa_exc.TimeoutError as exc:  # no pooled connection came free in time
                raise self._unavailable(exc, what) from exc
            except UnicodeError as exc:  # a value the driver cannot encode: nothing was sent
                raise StoreError(f"{what} refused by {self.masked_url}: a value is not valid text ({exc})") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _failure(self, exc: Any, what: str) -> BaseException | None:
        """The error to raise for a driver error, or None to retry on a fresh connection."""
        from sqlalchemy import exc as sa_exc

        if _is_lock_conflict(exc) or _is_duplicate_key(exc):
            return _Conflict()
        refusal = self._detail(exc) if _is_request_error(exc) else self._over_max_packet(exc)
        if refusal:
            return StoreError(f"{what} refused by {self.masked_url} (a request error, not an outage): {refusal}")
        if exc.connection_invalidated:
            return None
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
            return self._unavailable(exc, what)
        return StoreError(f"{what} failed on {self.masked_url}: {self._detail(exc)}")

    def _over_max_packet(self, exc: Any) -> str | None:
        """Why MySQL dropped the connection, if the statement was larger than its ``max_allowed_packet``."""
        if self._dialect not in (_MYSQL, _MARIADB) or _mysql_code(exc) not in _MYSQL_DISCONNECTS:
            return None
        size = _request_bytes(exc)
        if size < _MYSQL_PACKET_CHECK_BYTES:
            return None
        from sqlalchemy import exc as sa_exc

        try:
            with self.engine.connect() as conn:
                limit = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
        except sa_exc.SQLAlchemyError:  # the server is really gone: an outage after all
            return None
        if size <= limit:
            return None
        return f"a statement of about {size:,} bytes is over the server's max_allowed_packet of {limit:,} bytes"

    def _ensure_table(self) -> None:
        if self._ready:
            return
        from sqlalchemy import exc as sa_exc

        with self._ready_lock:
            if self._ready:
                return
            try:
                with self.engine.connect() as conn:
                    if self._use_mariadb_returning and self._dialect is _MYSQL and conn.dialect.name == "mysql" and getattr(
                        conn.dialect, "is_mariadb", False
                    ):
                        self._dialect = _MARIADB
                    for statement in self.ddl():
                        try:
                            conn.execute(self._text(statement))
                        except (sa_exc.IntegrityError, sa_exc.ProgrammingError) as exc:
                            # Two nodes creating the table at once (PostgreSQL's catalog race).
                            log.debug("concurrent CREATE on %s: %s", self.table, exc)
            except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as exc:
                raise self._unavailable(exc, "connecting") from exc
            except sa_exc.DBAPIError as exc:
                raise StoreError(
                    f"cannot create or use table {self.table!r} on {self.masked_url}: {self._detail(exc)}; "
                    "create it yourself with the DDL in the README (or `mutexcron ddl`)"
                ) from exc
            self._ready = True

    def _parse(self, row: Any) -> tuple[LockRecord, dict[str, Any]]:
        """A row -> (record, raw fires JSON incl. claim nonces)."""
        (name, holder, ip, token, hb, ttl_ms, attrs, fires, started, finished, error, age) = tuple(row)
        if isinstance(fires, (str, bytes)):
            fires = json.loads(fires or "{}")
        record = LockRecord(
            name=name,
            holder=holder,
            active_ip=ip,
            token=int(token),
            update_time=_utc(hb),
            heartbeat_age=None if age is None else max(0.0, float(age)),
            ttl=int(ttl_ms) / 1000.0,
            fire_times=fire_times_from_json(fires),
            last_run_started=_utc(started),
            last_run_finished=_utc(finished),
            last_error=error,
            attrs=load_attrs(attrs),
        )
        return record, fires or {}

    def _record(self, row: Any) -> LockRecord:
        return self._parse(row)[0]

    def _select(self, where: str = "", order: str = "") -> str:
        return f"SELECT {_COLUMNS}, {self._dialect.age} AS age FROM {self.table} {where} {order}"

    # -- LockStore ---------------------------------------------------------------------------
    def acquire_or_renew(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None = None
    ) -> AcquireResult:
        job = claim.job if claim else ""
        params = {
            "name": name,
            "me": node.node_id,
            "ip": node.ip,
            "ttl_ms": max(1, int(ttl * 1000)),
            "job": job,
            "jpath0": _json_path(job) + "[0]",
            "ft": claim.fire_us if claim else _NO_CLAIM,
            "nonce": claim.nonce if claim else "",
        }
        try:
            rows = self._upsert(params)
        except _Conflict:
            # Contention: a lost insert race, a lock wait timeout, a deadlock, a busy database.
            log.debug("acquire of %r met contention; uncertain", name)
            return AcquireResult(False, self._reread(name) or LockRecord(name=name), False, uncertain=True)
        if rows:  # the row as this statement left it (RETURNING, or MySQL's read in the same transaction)
            record, fires = self._parse(rows[0])
            acquired = record.holder == node.node_id
            return AcquireResult(acquired, record, acquired and claim_won(fires, claim))
        # Refused (PostgreSQL and SQLite return no row): re-read to show the holder.
        current = self._reread(name)
        if current is None:  # the first acquire creates the row; only a DELETE by hand removes it
            raise StoreError(f"lock {name!r} vanished from {self.table} on {self.masked_url} during acquire")
        # Held by this node although this statement was refused: another call of this node took it
        # in between. Not this call's renewal.
        return AcquireResult(False, current, False, uncertain=current.holder == node.node_id)

    def _upsert(self, params: Mapping[str, Any]) -> list[Any]:
        """Run the conditional upsert; return the row it left, or [] if refused without RETURNING."""
        sql = self._sql(self._dialect.acquire)
        if self._dialect.returning:
            return list(self._execute(sql, params, "acquire", write=True)[0])
        return self._run(lambda conn: self._upsert_and_read(conn, sql, params), "acquire")

    def _upsert_and_read(self, conn: Any, sql: str, params: Mapping[str, Any]) -> list[Any]:
        """MySQL 8 has no RETURNING: upsert, then read the row back, in one short transaction.

        The upsert keeps the row locked until COMMIT, so the read (READ COMMITTED, set per session)
        sees exactly what this upsert left. Two autocommit statements would let another claim of
        the same lock land in between, and this call would read that claim's nonce as a loss.
        """
        conn.exec_driver_sql("START TRANSACTION")
        try:
            conn.execute(self._text(sql), dict(params))
            rows = conn.execute(self._text(self._select("WHERE name = :name")), {"name": params["name"]}).fetchall()
            conn.exec_driver_sql("COMMIT")
        except BaseException:
            _roll_back(conn)
            raise
        return list(rows)

    def _reread(self, name: str) -> LockRecord | None:
        rows, _ = self._execute(self._select("WHERE name = :name"), {"name": name}, "read")
        return self._record(rows[0]) if rows else None

    def heartbeat(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        params: dict[str, Any] = {"name": name, "me": node.node_id, "token": token}
        sets = [f"hb = {self._dialect.now}"]
        if attrs is not None:
            params["attrs"] = dump_attrs(attrs, job=name)
            sets.append("attrs = :attrs")
        if run is not None:
            params.update(dur=max(0.0, run.duration), dur_us=int(max(0.0, run.duration) * 1e6), err=run.error)
            sets += [
                f"last_run_started = {self._dialect.minus_seconds}",
                f"last_run_finished = {self._dialect.now}",
                "last_error = :err",
            ]
        sql = f"UPDATE {self.table} SET {', '.join(sets)} WHERE name = :name AND holder = :me AND token = :token"
        try:
            _, count = self._execute(sql, params, "heartbeat", write=True)
        except _Conflict as exc:  # contention is not a refusal: the caller retries
            raise self._unavailable(exc.__cause__ or exc, "heartbeat") from exc
        return bool(count == 1)

    def renew_many(self, node: Node, leases: Mapping[str, int]) -> set[str]:
        if not leases:
            return set()
        params: dict[str, Any] = {"me": node.node_id}
        dialect = self._dialect
        if dialect is _PG:
            params["leases"] = json.dumps([{"name": n, "token": t} for n, t in leases.items()])
            sql = self._sql(dialect.renew_many)
        elif dialect is _SQLITE:
            params["keys"] = json.dumps([f"{n}\x1f{t}" for n, t in leases.items()])
            sql = self._sql(dialect.renew_many)
        else:
            pairs = []
            for i, (n, t) in enumerate(leases.items()):
                params[f"n{i}"], params[f"t{i}"] = n, t
                pairs.append(f"(:n{i}, :t{i})")
            sql = self._sql(dialect.renew_many, pairs=", ".join(pairs))
        try:
            rows, count = self._execute(sql, params, "renew", write=True)
        except _Conflict as exc:
            raise self._unavailable(exc.__cause__ or exc, "renew") from exc
        if dialect.returning and dialect is not _MARIADB:
            return {r[0] for r in rows}
        if count == len(leases):
            return set(leases)
        # MySQL/MariaDB UPDATE has no RETURNING: one read says which ones were renewed.
        current = self.read_many(leases)
        return {n for n, rec in current.items() if rec.holder == node.node_id and rec.token == leases[n]}

    def release(self, name: str, node: Node, token: int) -> bool:
        sql = f"UPDATE {self.table} SET holder = NULL WHERE name = :name AND holder = :me AND token = :token"
        try:
            _, count = self._execute(sql, {"name": name, "me": node.node_id, "token": token}, "release", write=True)
        except _Conflict as exc:  # contention is not a refusal: the caller retries
            raise self._unavailable(exc.__cause__ or exc, "release") from exc
        return bool(count == 1)

    def read(self, name: str) -> LockRecord | None:
        return self._reread(name)

    def read_many(self, names: Iterable[str]) -> dict[str, LockRecord]:
        names = list(names)
        if not names:
            return {}
        params = {f"n{i}": n for i, n in enumerate(names)}
        where = "WHERE name IN (" + ", ".join(f":n{i}" for i in range(len(names))) + ")"
        rows, _ = self._execute(self._select(where), params, "read")
        return {rec.name: rec for rec in map(self._record, rows)}

    def list(self) -> list[LockRecord]:
        rows, _ = self._execute(self._select(order="ORDER BY name"), {}, "list")
        return [self._record(r) for r in rows]

    def ping(self) -> None:
        self._execute("SELECT 1", {}, "ping")

    def close(self) -> None:
        self.engine.dispose()


class _Conflict(Exception):
    """Contention on a write (a duplicate key, a deadlock, a lock wait): the outcome is uncertain."""


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
    """Another session inserted the same lock first (any other integrity error is the request's)."""
    orig = getattr(exc, "orig", None)
    return (
        _mysql_code(exc) == 1062
        or getattr(orig, "sqlstate", None) == "23505"
        or "unique constraint failed" in str(orig or exc).lower()
    )


def _is_request_error(exc: BaseException) -> bool:
    """The database refused this request's values or size: the store itself is fine."""
    from sqlalchemy import exc as sa_exc

    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None) or ""
    return (
        isinstance(exc, (sa_exc.DataError, sa_exc.IntegrityError))
        or _mysql_code(exc) in _MYSQL_REQUEST_ERRORS
        or sqlstate[:2] in _PG_REQUEST_ERROR_CLASSES
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


def _roll_back(conn: Any) -> None:
    """End a failed explicit transaction, or drop the connection so no pooled one keeps row locks."""
    from sqlalchemy import exc as sa_exc

    try:
        conn.exec_driver_sql("ROLLBACK")
    except sa_exc.SQLAlchemyError:
        conn.invalidate()


def _utc(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    return None
