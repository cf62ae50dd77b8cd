"""Tasks inside the application's own transaction (SQL stores).

``pool.add(..., transaction=conn)`` and ``pool.cancel(..., transaction=conn)`` run the task store's
own statements (:mod:`mutexcron.tasks.stores.sql_statements`, bound parameters only, after the same
input checks) on the caller's connection, inside the transaction it has open: the task exists if
and only if that transaction commits. ``task.complete(conn)`` in a handler runs the fenced
statement the worker would run (:meth:`SQLTaskStore.complete`'s) the same way: the handler's
writes and the end of its task commit together, or not at all.

This module turns the caller's transaction into one executor (:class:`CallerTransaction`: run a
statement, tell a duplicate key) and reads which database it is on. The operations are the store
contract's (:meth:`~mutexcron.tasks.TaskStore.add_many_in`, ``cancel_in``, ``complete_in``): the
SQL store runs its statements on the executor it is given, as River's driver takes an executor;
the other stores refuse. The store imports this module, never the other way.

Accepted as ``transaction``:

* a SQLAlchemy ``Connection`` (inside ``engine.begin()``, or one that began a transaction) or
  ``Session``;
* a DB-API connection of one of the drivers below (psycopg 3 or psycopg2, PyMySQL or mysqlclient,
  sqlite3);
* Django's ``connection`` (``django.db.connection`` or ``connections[alias]``) inside
  ``transaction.atomic()``.

Checked first, cheaply, so that a task never lands outside the transaction or in another
database: the connection is a transaction (not autocommit with none open), its database is the
store's kind (dialect), and its database is the store's: the same database name (PostgreSQL,
MySQL: read from the driver's connection, no round trip where the driver keeps it) or the same
SQLite file. The server (host, port) and a PostgreSQL ``search_path`` are not checked.

Wake-ups: PostgreSQL's ``pg_notify`` in the insert is transactional (sent on commit); on SQLite
the workers' change check and on MySQL/MariaDB their poll find the task once the transaction
commits. The in-process wake-up of :meth:`SQLTaskStore.add` is not sent: it would come before the
commit.

Errors of the caller's own connection (a lock wait, a lost connection) are the caller's driver's
or library's exceptions, raised as they are: the transaction is theirs to roll back or retry.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql.elements import TextClause

from ..errors import ConfigurationError

__all__ = ["CallerTransaction", "adapt", "caller_database", "own_connection"]

#: DB-API driver module -> (the store dialect it speaks, SQLAlchemy's name for it).
DRIVERS = {
    "sqlite3": ("sqlite", "sqlite.pysqlite"),
    "psycopg": ("postgresql", "postgresql.psycopg"),
    "psycopg2": ("postgresql", "postgresql.psycopg2"),
    "pymysql": ("mysql", "mysql.pymysql"),
    "MySQLdb": ("mysql", "mysql.mysqldb"),
}
_ACCEPTED = (
    "a SQLAlchemy Connection or Session in a transaction, a DB-API connection (psycopg, psycopg2, PyMySQL, "
    "mysqlclient, sqlite3), or Django's connection inside transaction.atomic()"
)


class _Rows:
    """What a DB-API cursor returned, as the store's code reads a SQLAlchemy result."""

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows, self.rowcount = rows, rowcount

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Any]:
        return list(self._rows)


@dataclass(frozen=True)
class CallerTransaction:
    """The caller's open transaction, as the task store's statements run on it.

    Attributes:
        dialect: the store dialect of its database (``sqlite``, ``mysql``, ``postgresql``).
        raw: the driver's connection underneath.
        run: runs one statement (a ``text()`` clause and its parameters) in the transaction.
        is_duplicate: says whether an exception of ``run`` is a duplicate-key error (MySQL's insert).
    """

    dialect: str
    raw: Any
    run: Callable[[TextClause, Mapping[str, Any]], Any]
    is_duplicate: Callable[[BaseException], bool]

    def execute(self, clause: TextClause, params: Mapping[str, Any]) -> Any:
        """One statement; the result has ``fetchone()``, ``fetchall()`` and ``rowcount``."""
        return self.run(clause, params)


def adapt(transaction: Any) -> CallerTransaction:
    """The caller's transaction, whatever form it came in (see the module docstring).

    Raises:
        ConfigurationError: not a form accepted, or a connection with no transaction open.
    """
    if isinstance(transaction, Connection):
        return _from_sqlalchemy(transaction)
    kind = type(transaction).__module__
    if kind.startswith("sqlalchemy."):
        from sqlalchemy.orm import Session

        if isinstance(transaction, Session):
            return _from_sqlalchemy(transaction.connection())
        raise ConfigurationError(
            f"transaction={type(transaction).__name__}: pass the Connection or Session your transaction runs on "
            "(with engine.begin() as conn: ...): an Engine has no transaction, and asyncio connections are not "
            "supported; accepted: " + _ACCEPTED
        )
    if kind.startswith("django.") and hasattr(transaction, "in_atomic_block"):
        return _from_django(transaction)
    driver = kind.split(".")[0]
    if driver in DRIVERS:
        return _from_dbapi(transaction, driver)
    raise ConfigurationError(
        f"transaction={type(transaction).__name__}: not a connection mutexcron can use; accepted: {_ACCEPTED}"
    )


def _from_sqlalchemy(conn: Connection) -> CallerTransaction:
    raw = conn.connection.dbapi_connection  # the pooled connection of this transaction (no round trip)
    driver = _driver(raw)
    dialect = "mysql" if conn.dialect.name == "mariadb" else conn.dialect.name
    if driver in DRIVERS:
        _check_open(raw, driver, "this SQLAlchemy connection")

    def run(clause: TextClause, params: Mapping[str, Any]) -> Any:
        return conn.execute(clause, dict(params))

    return CallerTransaction(dialect, raw, run, _is_duplicate)


def _from_django(wrapper: Any) -> CallerTransaction:
    if not wrapper.in_atomic_block:
        raise ConfigurationError(
            f"Django's connection {wrapper.alias!r} is in autocommit mode here: the task would be committed at once, "
            "whatever happens to your writes. Add it inside `with transaction.atomic():` (or an atomic view)"
        )
    wrapper.ensure_connection()
    raw = wrapper.connection
    driver = _driver(raw)
    if driver not in DRIVERS:
        raise ConfigurationError(
            f"Django's connection {wrapper.alias!r} uses the driver {driver!r}; accepted: {', '.join(DRIVERS)}"
        )
    return _from_dbapi(raw, driver)


def _from_dbapi(raw: Any, driver: str) -> CallerTransaction:
    _check_open(raw, driver, f"this {driver} connection")
    dialect, sa_name = DRIVERS[driver]
    compiled_for = _compiler(sa_name)

    def run(clause: TextClause, params: Mapping[str, Any]) -> Any:
        sql, positional = compiled_for(clause)
        values: Any = tuple(params[name] for name in positional) if positional is not None else dict(params)
        cursor = raw.cursor()
        try:
            cursor.execute(sql, values)
            rows = list(cursor.fetchall()) if cursor.description else []
            return _Rows(rows, cursor.rowcount)
        finally:
            cursor.close()

    return CallerTransaction(dialect, raw, run, _is_duplicate)


@functools.lru_cache(maxsize=16)
def _dialect(sa_name: str) -> Dialect:
    from sqlalchemy.dialects import registry

    family, driver = sa_name.split(".")
    dialect: Dialect = registry.load(f"{family}.{driver}")()
    return dialect


def _compiler(sa_name: str) -> Callable[[TextClause], tuple[str, tuple[str, ...] | None]]:
    """The statement in the driver's own parameter style, and the parameter order if positional."""
    dialect = _dialect(sa_name)
    return functools.partial(_compile, dialect)


def _compile(dialect: Dialect, clause: TextClause) -> tuple[str, tuple[str, ...] | None]:
    return _compile_text(dialect, clause.text)


@functools.lru_cache(maxsize=512)
def _compile_text(dialect: Dialect, sql: str) -> tuple[str, tuple[str, ...] | None]:
    compiled = _text(sql).compile(dialect=dialect)
    order = compiled.positiontup
    return compiled.string, (tuple(order) if compiled.positional and order is not None else None)


def _check_open(raw: Any, driver: str, what: str) -> None:
    """Refuse a connection on which each statement commits by itself (no transaction open)."""
    if driver == "sqlite3":
        mode = getattr(raw, "autocommit", -1)  # Python 3.12's attribute; -1: the legacy transaction control
        implicit = mode is False or (mode not in (True, False) and raw.isolation_level is not None)
        committing = not raw.in_transaction and not implicit
    elif driver in ("psycopg", "psycopg2"):
        committing = bool(raw.autocommit) and int(raw.info.transaction_status) == 0  # IDLE: no BEGIN sent
    elif driver == "pymysql":
        committing = bool(raw.get_autocommit()) and not raw.server_status & 1  # SERVER_STATUS_IN_TRANS
    else:
        committing = bool(raw.get_autocommit())
    if committing:
        raise ConfigurationError(
            f"{what} is in autocommit mode with no transaction open: the task would be committed at once, whatever "
            "happens to your writes. Open the transaction first (SQLAlchemy: with engine.begin() as conn; psycopg: "
            "with conn.transaction(); Django: with transaction.atomic()), or add without transaction="
        )


def _is_duplicate(exc: BaseException) -> bool:
    """MySQL's duplicate key (1062), raised by the driver or wrapped by SQLAlchemy."""
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    return bool(args) and args[0] == 1062


# -- what the SQL store needs to run on it ------------------------------------------------------
def caller_database(caller: CallerTransaction) -> str | None:
    """The caller's database name (SQLite: the real path of its main file): from the driver where it
    keeps it (psycopg, PyMySQL), else asked on the caller's connection (one cheap statement)."""
    if caller.dialect == "sqlite":
        pragma = "PRAGMA database_list"  # in-process: microseconds, on sqlite3's own connection
        rows = (
            caller.raw.execute(pragma).fetchall()
            if _driver(caller.raw) == "sqlite3"
            else caller.execute(_text(pragma), {}).fetchall()
        )
        main = next((row[2] for row in rows if row[1] == "main"), "")
        return os.path.realpath(main) if main else ""  # "": an in-memory database, never the store's
    raw = caller.raw
    if caller.dialect == "postgresql":
        known = getattr(getattr(raw, "info", None), "dbname", None)  # psycopg 3, psycopg2
        query = "SELECT current_database()"
    else:
        known = getattr(raw, "db", None)  # PyMySQL's (bytes); mysqlclient keeps none
        query = "SELECT DATABASE()"
    if isinstance(known, bytes):
        return known.decode()
    if known:
        return str(known)
    rows = caller.execute(_text(query), {}).fetchall()
    return None if not rows or rows[0][0] is None else str(rows[0][0])


def _driver(raw: Any) -> str:
    """The top-level module of a DB-API connection's class: its driver (``sqlite3``, ``psycopg``...)."""
    return type(raw).__module__.split(".")[0]


def _text(sql: str) -> TextClause:
    from sqlalchemy import text

    return text(sql)


def own_connection(conn: Connection) -> CallerTransaction:
    """The store's own connection, in a transaction the store opened, as the caller's are used."""
    dialect = "mysql" if conn.dialect.name == "mariadb" else conn.dialect.name
    return CallerTransaction(dialect, None, lambda clause, params: conn.execute(clause, dict(params)), _is_duplicate)
