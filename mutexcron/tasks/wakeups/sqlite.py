"""SQLite task notices: ``PRAGMA data_version`` on a connection of the waker's own, and in-process notices.

SQLite has no notices between processes. ``PRAGMA data_version`` on a connection changes when
*another* connection commits to the file (any process, any table), and reading it touches no page:
:class:`SQLiteWaker` reads it every :data:`VERSION_POLL` seconds (or as its worker asks). When it
changed, the waker reads the earliest claim time of its codes (``MIN(run_at)``, one index seek per
code, on its own connection) and wakes only if that is earlier than the last one it saw: a claim, a
renewal or a heartbeat of the lock store in the same file changes the version without waking
anybody. A hand-back makes its task claimable now, before the lease's end it had (its ``run_at``
when the waker last looked): that is earlier, so it wakes; so does a Retry or Reschedule due before
the earliest claim time seen.

An add or a hand-back in this process wakes the waiting wakers at once, without the version's
poll, through :data:`~mutexcron.tasks.wakeups.listen.LOCAL_WAKERS` (keyed by the database file and
the table).

A connection that fails (the file removed, a disk error) is logged once; the waker then polls
every :data:`~mutexcron.tasks.wakeups.base.DEFAULT_POLL` seconds and opens it again on a later wait.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .base import DEFAULT_POLL, Waker
from .listen import LOCAL_WAKERS, RECONNECT_MAX

__all__ = ["VERSION_POLL", "SQLiteWaker"]

log = logging.getLogger(__name__)

#: Seconds between two reads of ``PRAGMA data_version``.
VERSION_POLL = 0.025


class SQLiteWaker(Waker):
    """Woken by commits of other connections that bring a task of ``codes`` forward, and by adds in this process.

    Args:
        path: the database file.
        table: the registry key of the task table (:data:`~mutexcron.tasks.wakeups.listen.LOCAL_WAKERS`).
        codes: the codes it wakes for.
        earliest: ``(sql, parameters)`` reading the earliest ``run_at`` of ``codes`` (NULL if none);
            None: every commit of another connection wakes it (a shared job store's watcher).
        where: the store, for log lines.
        busy_timeout: seconds a read waits for a lock (a checkpoint) before failing.
        version_poll: seconds between two reads of the version (None: :data:`VERSION_POLL`).
    """

    def __init__(
        self,
        path: str,
        table: str,
        codes: Iterable[str],
        earliest: tuple[str, Mapping[str, Any]] | None,
        where: str,
        *,
        busy_timeout: float = 5.0,
        version_poll: float | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.codes = tuple(codes)
        self.where = where
        self._earliest_sql: str | None = earliest[0] if earliest else None
        self._earliest_params: dict[str, Any] = dict(earliest[1]) if earliest else {}
        self._busy_timeout = busy_timeout
        self.version_poll = version_poll or VERSION_POLL
        self._conn: sqlite3.Connection | None = None
        self._version: int | None = None
        self._head: str | None = None
        self._lost = False
        self._retry_at = 0.0
        self._delay = 0.0
        self._closed = False
        self._mutex = threading.Lock()  # the connection: the waiting thread, or close()
        LOCAL_WAKERS.register(table, self.codes, self)
        self._look()  # the version and the earliest task now: any later change is seen

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self._local.is_set():
                self._local.clear()
                return True
            if self._closed:  # polls, as a waker without notices
                woken = self._local.wait(max(0.0, min(deadline - time.monotonic(), DEFAULT_POLL)))
                self._local.clear()
                return woken
            if self._look():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            step = self.version_poll if self._conn is not None else DEFAULT_POLL
            if self._local.wait(min(remaining, step)):
                continue
            if self._conn is None:
                return False  # polling while the connection is down: the worker looks at the store

    def _look(self) -> bool:
        """True if another connection committed a change that brings a task of the codes forward."""
        with self._mutex:
            return self._look_locked()

    def _look_locked(self) -> bool:
        if self._closed or (self._conn is None and not self._connect()):
            return False
        assert self._conn is not None
        try:
            version = int(self._conn.execute("PRAGMA data_version").fetchone()[0])
            if version == self._version:
                return False
            first, self._version = self._version is None, version
            if self._earliest_sql is None:
                return not first
            row = self._conn.execute(self._earliest_sql, self._earliest_params).fetchone()
        except sqlite3.Error as exc:
            self._broken(exc)
            return False
        head = None if row is None or row[0] is None else str(row[0])
        sooner = head is not None and (self._head is None or head < self._head)  # one text form: text order is time order
        self._head = head
        return sooner

    def _connect(self) -> bool:
        now = time.monotonic()
        if self._closed or now < self._retry_at:
            return False
        try:
            conn = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA query_only = 1")
            except sqlite3.Error:
                conn.close()
                raise
        except sqlite3.Error as exc:
            self._delay = min(RECONNECT_MAX, max(1.0, self._delay * 2))
            self._retry_at = now + self._delay
            if not self._lost:
                self._lost = True
                log.warning("%s: cannot open the file for task notices (%s); polling every %gs", self.where, exc, DEFAULT_POLL)
            return False
        self._conn, self._delay = conn, 0.0
        if self._lost:
            self._lost = False
            log.info("%s: task notices are back", self.where)
        return True

    def _broken(self, exc: BaseException) -> None:
        log.warning("%s: reading task notices failed (%s); polling every %gs until it works again", self.where, exc, DEFAULT_POLL)
        self._lost = True
        self._shut()

    def _shut(self) -> None:
        conn, self._conn = self._conn, None
        self._version = None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error:
                pass

    def close(self) -> None:
        self._closed = True
        LOCAL_WAKERS.unregister(self)
        with self._mutex:  # a waiting thread sees it closed within VERSION_POLL
            self._shut()
