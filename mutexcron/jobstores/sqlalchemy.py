"""APScheduler's ``SQLAlchemyJobStore``, shared: SQLite, MySQL/MariaDB, PostgreSQL.

Same table (``apscheduler_jobs``: ``id``, ``next_run_time``, ``job_state``), same rows. Each write
is one statement conditional on the state read (``UPDATE ... WHERE id = ? AND job_state = ?``).

Notices: on PostgreSQL every write of a change sends ``pg_notify('<channel>', 'jobs')`` in its
transaction, and each node ``LISTEN``\\ s on a connection of its own (psycopg 3 engines,
``postgresql+psycopg://``; other drivers poll). SQLite: ``PRAGMA data_version`` on a connection of
the watcher's own, read every :data:`SQLITE_POLL` seconds. MySQL/MariaDB: a read every
:data:`POLL` seconds. Every family: a change made in this process wakes its watchers at once.

The change counter: a one-row table ``<job table>_changes`` whose ``version`` every announced
write bumps in its transaction; a woken watcher reads that value and reads every job only when it
moved (the holder's advances bump nothing), or at its backstop read.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, and_, event, func, inspect, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.sql.expression import null

from ..tasks.wakeups.listen import LOCAL_WAKERS, RegisteredPollWaker
from ..urls import mask_url, redact
from .base import SharedJobStore, chunks, write_timeout

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ..tasks.wakeups.base import Waker

#: Seconds between two reads of a MySQL/MariaDB job table (no notices there).
POLL = 0.5
#: Seconds between two reads of SQLite's ``data_version``.
SQLITE_POLL = 0.1
#: The payload of every notice (the watcher reads the whole table anyway).
CODE = "jobs"
#: The change counter's table: the job table's name with this suffix, one row.
CHANGES_SUFFIX = "_changes"

log = logging.getLogger(__name__)


class SharedSQLAlchemyJobStore(SharedJobStore, SQLAlchemyJobStore):  # type: ignore[misc]
    """A ``SQLAlchemyJobStore`` every node shares (made from yours by ``MutexScheduler.start()``)."""

    engine: Any
    jobs_t: Any

    @property
    def where(self) -> str:
        return f"job table {self.jobs_t.fullname} on {mask_url(self.engine.url.render_as_string(hide_password=False))}"

    @property
    def dialect(self) -> str:
        return str(self.engine.dialect.name)

    @property
    def channel(self) -> str:
        """The PostgreSQL notice channel: the table's name (a digest when that is too long for one)."""
        name = f"{self.jobs_t.fullname}"
        if len(name.encode()) <= 60:
            return name
        return "apscheduler_jobs_" + hashlib.blake2b(name.encode(), digest_size=8).hexdigest()

    @property
    def _local_key(self) -> str:
        return f"jobstore:{self.engine.url.render_as_string(hide_password=True)}:{self.jobs_t.fullname}"

    def start(self, scheduler: Any, alias: str) -> None:
        bound_lock_waits(self.engine, write_timeout(getattr(scheduler, "unactive_interval", None)))
        # APScheduler's own create (check, then create) fails on the node that loses a race with another
        # creating the table: nodes starting together on a fresh database. Made here first, it finds it.
        create_if_missing(self.jobs_t, self.engine)
        super().start(scheduler, alias)

    # -- the change counter ----------------------------------------------------------------------
    def prepare_changes(self, create: bool) -> None:
        """The one-row table ``<job table>_changes`` beside the job table: every announced write bumps
        its ``version`` in its own transaction, so a watcher reads one value when nothing changed.
        Without it (no CREATE privilege, or not made yet) the watchers read every job each time."""
        self._mc_changes: Table | None = None
        database = self.engine.url.database
        if not create and self.dialect == "sqlite" and database and database != ":memory:" and not os.path.exists(database):
            return  # looking would create the file
        t = changes_table(self.jobs_t)
        try:
            if create:
                create_if_missing(t, self.engine)
            elif not inspect(self.engine).has_table(t.name, schema=t.schema):
                return
            with self.engine.connect() as conn:
                missing = conn.execute(select(t.c.version).where(t.c.id == 1)).first() is None
            if missing:
                try:
                    with self.engine.begin() as conn:
                        conn.execute(t.insert().values(id=1, version=0))
                except IntegrityError:  # another node's row
                    pass
        except SQLAlchemyError as exc:
            log.info("%s: no change counter (%s): each node's watcher reads every job when it wakes",
                     self.where, redact(type(exc).__name__ + ": " + str(exc).splitlines()[0], self._url))  # fmt: skip
            return
        self._mc_changes = t

    def change_marker(self) -> object | None:
        t: Table | None = getattr(self, "_mc_changes", None)
        if t is None:
            return None
        with self.engine.connect() as conn:
            value: object | None = conn.execute(select(t.c.version).where(t.c.id == 1)).scalar()
        return value

    @property
    def _url(self) -> str:
        return str(self.engine.url.render_as_string(hide_password=False))

    # -- reads ---------------------------------------------------------------------------------
    def _read_states(self, ids: Collection[str] | None = None) -> dict[str, bytes]:
        t = self.jobs_t
        out: dict[str, bytes] = {}
        with self.engine.connect() as conn:
            if ids is None:
                rows = conn.execute(select(t.c.id, t.c.job_state)).all()
            else:
                query = select(t.c.id, t.c.job_state)
                rows = [r for part in chunks(sorted(ids)) for r in conn.execute(query.where(t.c.id.in_(part)))]
        for job_id, state in rows:
            out[job_id] = bytes(state)
        return out

    def _read_due(self, ts: float, ids: Collection[str]) -> list[tuple[str, bytes]]:
        t = self.jobs_t
        rows: list[tuple[str, float, bytes]] = []
        with self.engine.connect() as conn:
            for part in chunks(sorted(ids)):
                query = select(t.c.id, t.c.next_run_time, t.c.job_state).where(and_(t.c.next_run_time <= ts, t.c.id.in_(part)))
                rows.extend((r[0], r[1], bytes(r[2])) for r in conn.execute(query))
        rows.sort(key=lambda r: r[1])
        return [(job_id, state) for job_id, _ts, state in rows]

    def _earliest(self, ids: Collection[str]) -> float | None:
        t = self.jobs_t
        found: list[float] = []
        with self.engine.connect() as conn:
            for part in chunks(sorted(ids)):
                query = select(func.min(t.c.next_run_time)).where(and_(t.c.id.in_(part), t.c.next_run_time != null()))
                value = conn.execute(query).scalar()
                if value is not None:
                    found.append(float(value))
        return min(found, default=None)

    # -- writes --------------------------------------------------------------------------------
    def _insert(self, job_id: str, ts: float | None, state: bytes) -> bool:
        try:
            with self.engine.begin() as conn:
                conn.execute(self.jobs_t.insert().values(id=job_id, next_run_time=ts, job_state=state))
                self._announce(conn)
        except IntegrityError:
            return False
        self._announce_locally()
        return True

    def _replace(self, job_id: str, base: bytes, ts: float | None, state: bytes, announce: bool) -> bool:
        t = self.jobs_t
        with self.engine.begin() as conn:
            done: bool = conn.execute(
                t.update().values(next_run_time=ts, job_state=state).where(and_(t.c.id == job_id, t.c.job_state == base))
            ).rowcount == 1
            if done and announce:
                self._announce(conn)
        if done and announce:
            self._announce_locally()
        return done

    def _delete(self, job_id: str, base: bytes | None) -> bool:
        t = self.jobs_t
        condition = t.c.id == job_id if base is None else and_(t.c.id == job_id, t.c.job_state == base)
        with self.engine.begin() as conn:
            done: bool = conn.execute(t.delete().where(condition)).rowcount == 1
            if done:
                self._announce(conn)
        if done:
            self._announce_locally()
        return done

    def _delete_all(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.jobs_t.delete())
            self._announce(conn)
        self._announce_locally()

    def _announce(self, conn: Connection) -> None:
        """The change counter bumped, and a notice to every node (PostgreSQL), with the write's commit."""
        changes: Table | None = getattr(self, "_mc_changes", None)
        if changes is not None:
            conn.execute(changes.update().where(changes.c.id == 1).values(version=changes.c.version + 1))
        if self.dialect == "postgresql":
            conn.execute(select(func.pg_notify(self.channel, CODE)))

    def _announce_locally(self) -> None:
        LOCAL_WAKERS.notify(self._local_key, CODE)

    # -- the watcher's waker ---------------------------------------------------------------------
    def waker(self) -> Waker:
        if self.dialect == "postgresql" and self.engine.dialect.driver == "psycopg":
            from ..tasks.wakeups.postgresql import PostgreSQLWaker

            class _Listening(PostgreSQLWaker):
                about = "job store changes"

            waker: Waker = _Listening(_EngineSide(self), self.channel, [CODE], self.where)
            LOCAL_WAKERS.register(self._local_key, [CODE], waker)
            return waker
        path = self.engine.url.database
        if self.dialect == "sqlite" and path and path != ":memory:":
            from ..tasks.wakeups.sqlite import SQLiteWaker

            return SQLiteWaker(path, self._local_key, [CODE], None, self.where, version_poll=SQLITE_POLL)
        return RegisteredPollWaker(self._local_key, [CODE], POLL)


def bound_lock_waits(engine: Any, seconds: float) -> None:
    """Every connection of the job store's engine waits at most ``seconds`` for a row or database
    lock another writer holds (then an error), so a writer frozen inside its transaction elsewhere
    holds one job, never this node: PostgreSQL's ``lock_timeout``, MariaDB/MySQL's
    ``innodb_lock_wait_timeout`` (whole seconds), SQLite's busy timeout. Set once per connection,
    as it is made: no statement more per write. Connections pooled before are let go of."""
    dialect = engine.dialect.name
    if dialect == "postgresql":
        statement = f"SET lock_timeout = {int(seconds * 1000)}"  # an int of ours (ms): no outside input
    elif dialect in ("mysql", "mariadb"):
        statement = f"SET SESSION innodb_lock_wait_timeout = {max(1, math.ceil(seconds))}"
    elif dialect == "sqlite":
        statement = f"PRAGMA busy_timeout = {int(seconds * 1000)}"
    else:
        return

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(statement)
        finally:
            cursor.close()
        if dialect == "postgresql" and not getattr(dbapi_connection, "autocommit", True):
            dbapi_connection.commit()  # psycopg opened a transaction for the SET: end it, the setting stays

    event.listen(engine, "connect", on_connect)
    engine.dispose()  # connections made before (APScheduler's own) get the bound when they are made again


def create_if_missing(table: Table, engine: Any) -> None:
    """Create ``table`` unless it exists; another node creating it at the same moment is no error."""
    if inspect(engine).has_table(table.name, schema=table.schema):
        return
    try:
        table.create(engine, checkfirst=True)
    except SQLAlchemyError:  # another node made it meanwhile
        if not inspect(engine).has_table(table.name, schema=table.schema):
            raise
        log.info("table %s was created by another node at the same time", table.fullname)


def changes_table(jobs_t: Table) -> Table:
    """The change counter's table of the job table ``jobs_t`` (same schema)."""
    return Table(
        f"{jobs_t.name}{CHANGES_SUFFIX}",
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("version", BigInteger, nullable=False),
        schema=jobs_t.schema,
    )


class _EngineSide:
    """The job store's engine, as the PostgreSQL waker wants a store (engine, masked URL, detail)."""

    def __init__(self, store: SharedSQLAlchemyJobStore) -> None:
        self.engine = store.engine
        self.masked_url = store.where
        self._url = store.engine.url.render_as_string(hide_password=False)

    def detail(self, exc: BaseException) -> str:
        first = (str(exc).strip().splitlines() or [""])[0]
        return redact(f"{type(exc).__name__}: {first}", self._url)

