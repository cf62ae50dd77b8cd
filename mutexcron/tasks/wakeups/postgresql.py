"""PostgreSQL task notices: ``LISTEN``/``NOTIFY`` on a channel named after the task table.

The store's ``add`` sends ``pg_notify('<table>', code)`` in the statement (an insert) or the
transaction (a replace) that queues the task, ``retry`` in its update, and ``release`` (a
hand-back: the task is claimable at once) once per code in its transaction, so the notice leaves
only if the write commits; a pending re-add (the task is running) sends none, nor does an
attempt's end (a Retry or Reschedule: the worker that ends it looks at the store again itself,
and the others at their next look; telling whether it comes before the code's head would cost a
read per completion). PostgreSQL delivers
it to every session listening on the channel in that database once the writer commits.

:class:`PostgreSQLWaker` holds one connection of its own, out of the store's pool (opened as the
pool opens its connections: the same URL, driver options and timeouts, then detached from the
pool), ``LISTEN``\\ s, and sleeps on its socket and on the local notices at once. The channel is
the table's name, so notices of other tables (other task stores on the database) never wake it;
a notice for a code it does not handle is read and ignored.

A connection pooler in transaction mode (PgBouncer's default) does not carry ``LISTEN``: there,
point the URL at the server, or expect the poll's latency (:data:`~mutexcron.tasks.wakeups.base.BACKSTOP_POLL`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import psycopg
from sqlalchemy import exc as sa_exc

from .listen import ListeningWaker

__all__ = ["PostgreSQLWaker"]


class Listenable(Protocol):
    """What the waker needs of a store: its SQLAlchemy engine (a psycopg one), and its log wording
    (a :class:`~mutexcron.backends.sql.SQLBackend`, or a shared job store's side)."""

    engine: Any

    @property
    def masked_url(self) -> str: ...

    def detail(self, exc: BaseException) -> str: ...


class PostgreSQLWaker(ListeningWaker):
    """Woken by ``NOTIFY`` on ``channel`` (the task table's name) with one of ``codes`` as payload.

    Args:
        backend: the store's backend (its engine opens the connection).
        channel: the channel, a checked table name.
        codes: the codes it wakes for.
        where: the store, for log lines (a masked URL; default: the backend's).
    """

    what = "the LISTEN connection"

    def __init__(self, backend: Listenable, channel: str, codes: Iterable[str], where: str | None = None) -> None:
        super().__init__(codes, where or backend.masked_url, (sa_exc.SQLAlchemyError, psycopg.Error))
        self.backend = backend
        self.channel = channel
        self._conn: psycopg.Connection[Any] | None = None
        with self._mutex:
            self._ensure_listening()  # from now on no notice is missed, even before the first wait

    @property
    def backend_pid(self) -> int | None:
        """The server process of the listening connection, while it listens."""
        conn = self._conn
        return None if conn is None or conn.closed else int(conn.info.backend_pid)

    def _open(self) -> None:
        pooled = self.backend.engine.raw_connection()  # built as the pool builds its connections
        pooled.detach()  # ours now: the pool opens another in its place when it needs one
        conn = pooled.dbapi_connection
        if not isinstance(conn, psycopg.Connection):  # pragma: no cover - the dialect's driver is psycopg
            pooled.close()
            raise TypeError(f"expected a psycopg connection, got {type(conn).__name__}")
        self._conn = conn
        conn.autocommit = True
        conn.execute(f'LISTEN "{self.channel}"')  # the channel is a checked table name

    def _socket(self) -> Any:
        assert self._conn is not None
        return self._conn  # it has fileno()

    def _read(self) -> bool:
        assert self._conn is not None
        pgconn = self._conn.pgconn
        pgconn.consume_input()  # raises OperationalError once the server closed the connection
        woken = False
        while (notice := pgconn.notifies()) is not None:
            if notice.extra.decode("utf-8", "replace") in self.codes:
                woken = True
        return woken

    def _shut(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def _detail(self, exc: BaseException) -> str:
        return self.backend.detail(exc)
