"""django-apscheduler's ``DjangoJobStore``, shared: every node on the same ``django_apscheduler_djangojob``
table, through Django's ORM and its configured database.

The atomic primitives are ORM statements, each in one transaction: ``filter(id=..., job_state=base)
.update(...)`` for a compare-and-set write, ``filter(...).delete()`` for a removal (which takes the
job's ``DjangoJobExecution`` rows with it, as django-apscheduler's own removal does). Reads never
delete a job this node cannot restore (django-apscheduler's store does).

Notices and the change counter are those of the SQLAlchemy store (:mod:`.sqlalchemy`): on
PostgreSQL every announced write sends ``pg_notify('<job table>', 'jobs')`` in its transaction and
each node ``LISTEN``\\ s (on a psycopg 3 connection of its own, made from the Django database's
settings; without psycopg 3 it polls); SQLite: ``PRAGMA data_version``; MySQL/MariaDB: a poll. The
one-row table ``<job table>_changes`` counts the announced writes.

Run history: instead of django-apscheduler's listeners (every node's APScheduler events, which a
node that skips a claimed fire time also sends), the ``DjangoJobExecution`` rows are written from
mutexcron's run events, by the node that ran the fire time: one row per fire time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.models import Min
from django.utils import timezone as django_timezone
from django_apscheduler.jobstores import DjangoJobStore
from django_apscheduler.models import DjangoJob, DjangoJobExecution
from django_apscheduler.util import get_django_internal_datetime

from ..errors import StoreUnavailableError
from ..events import EVENT_RUN_FINISHED, EVENT_RUN_MISSED, EVENT_RUN_STARTED, MutexEvent
from ..tasks.wakeups.listen import LOCAL_WAKERS, RegisteredPollWaker
from ..urls import mask_url, redact
from .base import SharedJobStore, chunks
from .sqlalchemy import CHANGES_SUFFIX, CODE, POLL, SQLITE_POLL

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

__all__ = ["SharedDjangoJobStore", "database_url"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often a removal is tried again when a run's DjangoJobExecution row lands during it (the rows
#: are deleted by Django before the job, in the same transaction: a row added meanwhile fails the commit).
DELETE_ATTEMPTS = 5
#: Seconds a write that found SQLite's file locked is tried again.
SQLITE_LOCKED_RETRY = 2.0

#: The change counter's statements, by name; ``{t}`` is the quoted ``<job table>_changes``.
CHANGES_SQL = {
    # create: the one-row table, made by the first node
    "create": "CREATE TABLE {t} (id INTEGER PRIMARY KEY, version BIGINT NOT NULL)",
    # read: the counter's value (a watcher's cheap look)
    "read": "SELECT version FROM {t} WHERE id = %s",
    # insert: its one row
    "insert": "INSERT INTO {t} (id, version) VALUES (%s, %s)",
    # bump: one more change, in the write's transaction
    "bump": "UPDATE {t} SET version = version + 1 WHERE id = %s",
}

#: Django's database engine -> (the lock store's URL scheme, the SQLAlchemy one of a LISTEN connection).
_SCHEMES = {
    "django.db.backends.postgresql": ("postgresql", "postgresql+psycopg"),
    "django.db.backends.mysql": ("mysql+pymysql", "mysql+pymysql"),
    "django.db.backends.sqlite3": ("sqlite", "sqlite"),
}


def database_url(alias: str = "default", *, for_listening: bool = False) -> str:
    """A mutexcron store URL on Django's database ``alias`` (``DATABASES[alias]``): its host, port,
    name, user and password (``OPTIONS`` are not carried over).

    Raises:
        ConfigurationError: an engine mutexcron has no store for, or an in-memory SQLite database.
    """
    from django.conf import settings
    from sqlalchemy.engine import URL

    from ..errors import ConfigurationError

    db = settings.DATABASES[alias]
    schemes = _SCHEMES.get(str(db.get("ENGINE", "")))
    name = str(db.get("NAME") or "")
    if schemes is None or (schemes[0] == "sqlite" and (name in ("", ":memory:") or "mode=memory" in name)):
        raise ConfigurationError(
            f"DATABASES[{alias!r}] ({db.get('ENGINE')}, {name or 'no NAME'}) cannot hold locks every node shares: "
            "set MUTEXCRON_LOCK_URL in the settings (or the environment) to a store URL"
        )
    if schemes[0] == "sqlite":
        return f"sqlite:///{name}"
    url = URL.create(
        schemes[1] if for_listening else schemes[0], username=db.get("USER") or None, password=db.get("PASSWORD") or None,
        host=db.get("HOST") or None, port=int(db["PORT"]) if db.get("PORT") else None, database=name,
    )  # fmt: skip
    rendered: str = url.render_as_string(hide_password=False)
    return rendered


class SharedDjangoJobStore(SharedJobStore, DjangoJobStore):  # type: ignore[misc]
    """A ``DjangoJobStore`` every node shares (made from yours by ``MutexScheduler.start()``)."""

    pickle_protocol: int
    #: The Django database alias the jobs are read and written through.
    using = "default"

    @property
    def table(self) -> str:
        return str(DjangoJob._meta.db_table)

    def lock_url(self) -> str:
        """The lock store on the same Django database (a scheduler given no lock URL keeps its locks there)."""
        return database_url(self.using)

    @property
    def where(self) -> str:
        try:
            shown = mask_url(database_url(self.using))
        except Exception:  # noqa: BLE001 - only for a log line
            shown = f"Django database {self.using!r}"
        return f"job table {self.table} on {shown}"

    @property
    def _vendor(self) -> str:
        return str(connections[self.using].vendor)

    @property
    def _local_key(self) -> str:
        return f"jobstore:django:{self.using}:{self.table}"

    @property
    def _changes_table(self) -> str:
        return f"{self.table}{CHANGES_SUFFIX}"

    def _sql(self, name: str) -> str:
        """The change counter's statement ``name`` (:data:`CHANGES_SQL`) on this store's table."""
        return CHANGES_SQL[name].format(t=connections[self.using].ops.quote_name(self._changes_table))

    def _jobs(self) -> Any:
        return DjangoJob.objects.using(self.using)

    # -- the change counter ----------------------------------------------------------------------
    def prepare_changes(self, create: bool) -> None:
        """The one-row table ``<job table>_changes`` (see :meth:`SharedSQLAlchemyJobStore.prepare_changes`)."""
        self._mc_changes = False
        table = self._changes_table
        try:
            conn = connections[self.using]
            if table not in conn.introspection.table_names():
                if not create:
                    return
                try:
                    with transaction.atomic(using=self.using), conn.cursor() as cursor:
                        cursor.execute(self._sql("create"))
                except DatabaseError:  # another node made it meanwhile
                    if table not in conn.introspection.table_names():
                        raise
            with conn.cursor() as cursor:
                cursor.execute(self._sql("read"), [1])
                missing = cursor.fetchone() is None
            if missing:
                try:
                    with transaction.atomic(using=self.using), conn.cursor() as cursor:
                        cursor.execute(self._sql("insert"), [1, 0])
                except IntegrityError:  # another node's row
                    pass
        except DatabaseError as exc:
            log.info("%s: no change counter (%s): each node's watcher reads every job when it wakes", self.where,
                     redact(type(exc).__name__ + ": " + str(exc).splitlines()[0], self._url()))  # fmt: skip
            return
        self._mc_changes = True

    def change_marker(self) -> object | None:
        if not getattr(self, "_mc_changes", False):
            return None

        def read() -> object | None:
            with connections[self.using].cursor() as cursor:
                cursor.execute(self._sql("read"), [1])
                row = cursor.fetchone()
            return None if row is None else row[0]

        return self._db(read)

    def _url(self) -> str:
        try:
            return database_url(self.using)
        except Exception:  # noqa: BLE001 - only to redact a message
            return ""

    # -- reads ---------------------------------------------------------------------------------
    def _read_states(self, ids: Collection[str] | None = None) -> dict[str, bytes]:
        def read() -> dict[str, bytes]:
            rows: list[tuple[str, Any]] = []
            if ids is None:
                rows = list(self._jobs().values_list("id", "job_state"))
            else:
                for part in chunks(sorted(ids)):
                    rows.extend(self._jobs().filter(id__in=part).values_list("id", "job_state"))
            return {job_id: bytes(state) for job_id, state in rows}

        return self._db(read)

    def _read_due(self, ts: float, ids: Collection[str]) -> list[tuple[str, bytes]]:
        def read() -> list[tuple[str, bytes]]:
            rows: list[tuple[str, Any, Any]] = []
            for part in chunks(sorted(ids)):
                due = self._jobs().filter(next_run_time__lte=_stored(ts), id__in=part)
                rows.extend(due.values_list("id", "next_run_time", "job_state"))
            rows.sort(key=lambda r: _epoch(r[1]))
            return [(job_id, bytes(state)) for job_id, _when, state in rows]

        return self._db(read)

    def _earliest(self, ids: Collection[str]) -> float | None:
        def read() -> float | None:
            found = []
            for part in chunks(sorted(ids)):
                value = self._jobs().filter(id__in=part, next_run_time__isnull=False).aggregate(t=Min("next_run_time"))["t"]
                if value is not None:
                    found.append(_epoch(value))
            return min(found, default=None)

        return self._db(read)

    # -- writes --------------------------------------------------------------------------------
    def _insert(self, job_id: str, ts: float | None, state: bytes) -> bool:
        def write() -> bool:
            try:
                with transaction.atomic(using=self.using):
                    self._jobs().create(id=job_id, next_run_time=_stored(ts), job_state=state)
                    self._announce()
            except IntegrityError:
                return False
            return True

        done = self._db(write)
        if done:
            self._announce_locally()
        return done

    def _replace(self, job_id: str, base: bytes, ts: float | None, state: bytes, announce: bool) -> bool:
        def write() -> bool:
            with transaction.atomic(using=self.using):
                written = self._jobs().filter(id=job_id, job_state=base).update(next_run_time=_stored(ts), job_state=state)
                done: bool = written == 1
                if done and announce:
                    self._announce()
            return done

        done = self._db(write)
        if done and announce:
            self._announce_locally()
        return done

    def _delete(self, job_id: str, base: bytes | None) -> bool:
        query = self._jobs().filter(id=job_id) if base is None else self._jobs().filter(id=job_id, job_state=base)
        done = self._db(lambda: self._cascade(query) == 1)
        if done:
            self._announce_locally()
        return done

    def _delete_all(self) -> None:
        self._db(lambda: self._cascade(self._jobs().all()))
        self._announce_locally()

    def _cascade(self, query: Any) -> int:
        """Delete the jobs of ``query`` with their DjangoJobExecution rows (``on_delete=CASCADE``, done
        by Django before the jobs, in the same transaction), announced when any went; tried again when
        a holder wrote a run's row meanwhile (that fails the commit). How many jobs went."""
        for _ in range(DELETE_ATTEMPTS):
            try:
                with transaction.atomic(using=self.using):
                    _, per_model = query.delete()
                    deleted = int(per_model.get(DjangoJob._meta.label, 0))
                    if deleted:
                        self._announce()
                return deleted
            except IntegrityError:
                continue
        raise StoreUnavailableError(f"{self.where}: runs kept being recorded while their jobs were removed; try again")

    def _announce(self) -> None:
        """The change counter bumped, and a notice to every node (PostgreSQL), in the write's transaction."""
        with connections[self.using].cursor() as cursor:
            if getattr(self, "_mc_changes", False):
                cursor.execute(self._sql("bump"), [1])
            if self._vendor == "postgresql":
                cursor.execute("SELECT pg_notify(%s, %s)", [self.table, CODE])

    def _announce_locally(self) -> None:
        LOCAL_WAKERS.notify(self._local_key, CODE)

    def _db(self, work: Callable[[], T]) -> T:
        """``work`` (one transaction, or one read) on this thread's Django connection. SQLite's "database
        is locked" is tried again for up to :data:`SQLITE_LOCKED_RETRY` seconds (a deferred transaction
        that reads, then writes after another connection's commit, fails at once whatever the busy
        timeout); any other database error closes the connection (the next call opens a fresh one) and
        is raised as :class:`StoreUnavailableError`."""
        deadline = time.monotonic() + SQLITE_LOCKED_RETRY
        while True:
            try:
                return work()
            except IntegrityError:
                raise
            except DatabaseError as exc:
                if self._retry_locked(exc, deadline):
                    time.sleep(0.02)
                    continue
                connections[self.using].close_if_unusable_or_obsolete()
                detail = redact(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}", self._url())
                raise StoreUnavailableError(f"{self.where}: {detail}") from exc

    def _retry_locked(self, exc: DatabaseError, deadline: float) -> bool:
        """SQLite's lock, outside the caller's own transaction, before the deadline."""
        conn = connections[self.using]
        return self._vendor == "sqlite" and "locked" in str(exc) and not conn.in_atomic_block and time.monotonic() < deadline

    # -- the watcher's waker ---------------------------------------------------------------------
    def waker(self) -> Waker:
        if self._vendor == "postgresql":
            listening = self._listening_waker()
            if listening is not None:
                return listening
        path = str(connections[self.using].settings_dict["NAME"])
        if self._vendor == "sqlite" and path != ":memory:" and "mode=memory" not in path:
            from ..tasks.wakeups.sqlite import SQLiteWaker

            return SQLiteWaker(path, self._local_key, [CODE], None, self.where, version_poll=SQLITE_POLL)
        return RegisteredPollWaker(self._local_key, [CODE], POLL)

    def _listening_waker(self) -> Waker | None:
        try:
            from ..tasks.wakeups.postgresql import PostgreSQLWaker
        except ImportError:
            log.info("%s: no psycopg 3 (pip install 'mutexcron[postgresql]'): the watcher polls every %gs", self.where, POLL)
            return None
        from sqlalchemy import create_engine

        from .sqlalchemy import _EngineSide

        class _Listening(PostgreSQLWaker):
            about = "job store changes"

        self.engine = create_engine(database_url(self.using, for_listening=True))
        waker: Waker = _Listening(_EngineSide(self), self.table, [CODE], self.where)
        LOCAL_WAKERS.register(self._local_key, [CODE], waker)
        return waker

    # -- run history: one DjangoJobExecution row per fire time, by the node that ran it ------------
    def register_event_listeners(self) -> None:
        """django-apscheduler's listeners replaced: see the module docstring."""
        self._scheduler.add_listener(self._record_run, EVENT_RUN_STARTED | EVENT_RUN_FINISHED | EVENT_RUN_MISSED)

    def _record_run(self, event: MutexEvent) -> None:
        if event.job_id is None or event.fire_time is None or event.job_id not in self.shared.held_jobs(self):
            return  # another store's job, or one this node does not run
        if event.code == EVENT_RUN_STARTED:
            status, error = DjangoJobExecution.SENT, None
        elif event.code == EVENT_RUN_MISSED:
            status, error = DjangoJobExecution.MISSED, f"Run time of job '{event.job_id}' was missed!"
        else:
            ok = event.details.get("outcome") == "success"
            status, error = (DjangoJobExecution.SUCCESS, None) if ok else (DjangoJobExecution.ERROR, event.details.get("error"))
        try:
            DjangoJobExecution.atomic_update_or_create(self.lock, event.job_id, event.fire_time, status, exception=error)
        except IntegrityError:  # the job was removed meanwhile: its history went with it
            log.info("job %r was removed: no DjangoJobExecution row for %s", event.job_id, event.fire_time)
        except Exception as exc:  # noqa: BLE001 - the history must never fail a run
            log.warning("job %r: its DjangoJobExecution row for %s was not written (%s)", event.job_id, event.fire_time, exc)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}(using={self.using!r}, pickle_protocol={self.pickle_protocol})>"


def _stored(ts: float | None) -> datetime | None:
    """An epoch time as Django stores a ``DateTimeField`` (aware UTC, or naive local without ``USE_TZ``)."""
    if ts is None:
        return None
    stored: datetime = get_django_internal_datetime(datetime.fromtimestamp(ts, timezone.utc))
    return stored


def _epoch(value: datetime) -> float:
    if django_timezone.is_naive(value):
        value = django_timezone.make_aware(value)
    return value.timestamp()
