"""What differs between the SQL databases, one :class:`SQLDialect` per registry family.

A new database is one more row of :data:`DIALECTS` (and of the lock store's statements table,
:mod:`mutexcron.locks.sql_statements`): its SQLAlchemy driver, the connect arguments and session
settings that carry the timeout rule, and its clock in SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The timeout rule, the same for every store: give up connecting after CONNECT_TIMEOUT seconds and
# any one operation (a statement, a socket read or write) after OPERATION_TIMEOUT, so a dead or
# partitioned server fails closed instead of freezing the heartbeat thread. A row lock is waited
# for LOCK_WAIT_TIMEOUT, less than an operation, so contention shows as contention, not as an outage.
CONNECT_TIMEOUT = 5
OPERATION_TIMEOUT = 10
LOCK_WAIT_TIMEOUT = 5


@dataclass(frozen=True)
class SQLClock:
    """The database's clock in SQL: every time a store writes or judges is the server's.

    ``{hb}`` and ``{ttl_ms}`` stand for column names (qualified or not).
    """

    now: str  # the current time, as stored in timestamp columns
    age: str  # seconds since {hb}
    stale: str  # true if {hb} is older than {ttl_ms} milliseconds
    minus_seconds: str  # now minus the bound :dur seconds (or :dur_us microseconds)

    def age_of(self, hb: str = "hb") -> str:
        return self.age.format(hb=hb)

    def stale_of(self, hb: str = "hb", ttl_ms: str = "ttl_ms") -> str:
        return self.stale.format(hb=hb, ttl_ms=ttl_ms)


def _sqlite_args(connect_timeout: float) -> dict[str, Any]:
    return {"timeout": connect_timeout, "check_same_thread": False}


def _sqlite_session(connect_timeout: float) -> tuple[str, ...]:
    return (f"PRAGMA busy_timeout = {int(connect_timeout * 1000)}", "PRAGMA journal_mode = WAL")


def _mysql_args(connect_timeout: float) -> dict[str, Any]:
    # PyMySQL reads the server's greeting under read_timeout: a server that accepts the TCP
    # connection and never answers fails after OPERATION_TIMEOUT, not connect_timeout.
    return {
        "connect_timeout": max(1, int(connect_timeout)),
        "read_timeout": OPERATION_TIMEOUT,
        "write_timeout": OPERATION_TIMEOUT,
    }


def _mysql_session(_connect_timeout: float) -> tuple[str, ...]:
    return (
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
        f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT_TIMEOUT}",
        "SET SESSION time_zone = '+00:00'",
    )


def _postgresql_args(connect_timeout: float) -> dict[str, Any]:
    # PostgreSQL has no client-side read timeout. TCP keepalives (a probe after 5 s of silence,
    # then every second, 5 unanswered: dead) and tcp_user_timeout (data unacknowledged for 10 s:
    # dead) make the kernel drop a partitioned connection within OPERATION_TIMEOUT; the server
    # still enforces statement_timeout and lock_timeout.
    return {
        "connect_timeout": max(1, int(connect_timeout)),
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 1,
        "keepalives_count": 5,
        "tcp_user_timeout": OPERATION_TIMEOUT * 1000,
        "options": f"-c statement_timeout={OPERATION_TIMEOUT * 1000} -c lock_timeout={LOCK_WAIT_TIMEOUT * 1000}",
    }


def _no_session(_connect_timeout: float) -> tuple[str, ...]:
    return ()


# The URL query options each driver stack accepts (SQLAlchemy's dialect, then the driver): any
# other name is a typo, refused with this list instead of a driver traceback, a misleading
# "create the table yourself", or (SQLite) a warning while the store runs on the default table.
_PYSQLITE_OPTIONS = ("uri", "timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements")
#: SQLite's own URI parameters, read only with ``?uri=true``.
_SQLITE_URI_OPTIONS = ("mode", "cache", "vfs", "immutable", "nolock", "psow", "modeof")
#: What the URL's user, password, host, port and path already say, or values a URL cannot carry.
_NOT_URL_OPTIONS = frozenset({"self", "user", "password", "passwd", "host", "port", "database", "db", "dbname", "conv",
                              "cursorclass", "ssl", "auth_plugin_map"})  # fmt: skip


def _sqlite_options() -> frozenset[str]:
    return frozenset((*_PYSQLITE_OPTIONS, *_SQLITE_URI_OPTIONS))


def _mysql_options() -> frozenset[str]:
    import inspect

    import pymysql

    names = set(inspect.signature(pymysql.connections.Connection.__init__).parameters)
    # SQLAlchemy folds these into PyMySQL's ssl= dict
    names |= {"ssl_ca", "ssl_key", "ssl_cert", "ssl_capath", "ssl_cipher", "ssl_check_hostname"}
    return frozenset(names - _NOT_URL_OPTIONS)


def _postgresql_options() -> frozenset[str]:
    import psycopg

    # libpq's own list of connection parameters (what it would refuse as "invalid connection option")
    names = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    return frozenset(names - _NOT_URL_OPTIONS)


@dataclass(frozen=True)
class SQLDialect:
    """What the backend needs to know about one database (one registry family)."""

    name: str  # the registry family: sqlite, mysql, postgresql
    kind: str  # its name in messages
    driver: str  # SQLAlchemy's drivername
    clock: SQLClock
    connect_args: Callable[[float], dict[str, Any]]  # DBAPI connect() arguments, from connect_timeout
    session: Callable[[float], tuple[str, ...]]  # run on every new connection
    url_query: Mapping[str, str] = field(default_factory=dict)  # driver options the URL gets unless it sets them
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    packet_limit: str | None = None  # asks the server for its statement size limit
    file_only: bool = False  # an in-memory database would be private to one connection
    #: One writer at a time for the whole database (a SQLite file): this process's writers queue on
    #: a mutex of the file's (:func:`mutexcron.backends.sql.write_mutex`) instead of in the driver.
    one_writer: bool = False
    #: The names of the URL query options the driver stack accepts (imports the driver).
    url_options: Callable[[], frozenset[str]] = frozenset


DIALECTS: dict[str, SQLDialect] = {
    "sqlite": SQLDialect(
        name="sqlite",
        kind="SQLite",
        driver="sqlite+pysqlite",
        clock=SQLClock(
            now="strftime('%Y-%m-%d %H:%M:%f', 'now')",
            age="(julianday('now') - julianday({hb})) * 86400.0",
            stale="{hb} < strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%.3f seconds', {ttl_ms} / 1000.0))",
            minus_seconds="strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%.6f seconds', :dur))",
        ),
        connect_args=_sqlite_args,
        session=_sqlite_session,
        file_only=True,
        one_writer=True,
        url_options=_sqlite_options,
    ),
    "mysql": SQLDialect(  # MySQL and MariaDB
        name="mysql",
        kind="MySQL",
        driver="mysql+pymysql",
        clock=SQLClock(
            now="UTC_TIMESTAMP(6)",
            age="TIMESTAMPDIFF(MICROSECOND, {hb}, UTC_TIMESTAMP(6)) / 1000000.0",
            stale="{hb} < UTC_TIMESTAMP(6) - INTERVAL {ttl_ms} * 1000 MICROSECOND",
            minus_seconds="UTC_TIMESTAMP(6) - INTERVAL :dur_us MICROSECOND",
        ),
        connect_args=_mysql_args,
        session=_mysql_session,
        url_query={"charset": "utf8mb4"},
        engine_options={"pool_recycle": 1800},
        packet_limit="SELECT @@max_allowed_packet",
        url_options=_mysql_options,
    ),
    "postgresql": SQLDialect(
        name="postgresql",
        kind="PostgreSQL",
        driver="postgresql+psycopg",
        clock=SQLClock(
            now="clock_timestamp()",
            age="EXTRACT(EPOCH FROM (clock_timestamp() - {hb}))",
            stale="{hb} < clock_timestamp() - {ttl_ms} * interval '1 millisecond'",
            minus_seconds="clock_timestamp() - CAST(:dur AS double precision) * interval '1 second'",
        ),
        connect_args=_postgresql_args,
        session=_no_session,
        url_options=_postgresql_options,
    ),
}
