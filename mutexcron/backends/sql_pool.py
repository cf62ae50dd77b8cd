"""The SQL stores' connection pool: as many connections as the node uses at once, idle ones trimmed.

SQLAlchemy's default pool keeps 5 connections and opens and closes the rest on demand: every-second
jobs firing together on the executor's threads made each node open and close hundreds of
connections a minute (and PyMySQL builds a TLS context for each). This pool keeps up to
``size`` connections, hands out the most recently returned one first, and closes connections left
unused for ``POOL_IDLE_TIMEOUT`` seconds, down to ``POOL_MIN_IDLE``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import ConnectionPoolEntry, Pool

# The pool rule (see IdleTrimmingPool). Kept connections: up to the threads that can call the store
# at once, which the scheduler tells size_pool() at start; until then APScheduler's default
# executor (10 threads) + the heartbeat thread + the catch-up thread.
DEFAULT_POOL_SIZE = 12
# Connections opened beyond that for a burst of unexpected callers (a user's own threads), closed
# on check-in; SQLAlchemy's default overflow, so no caller waits where it did not wait before.
POOL_OVERFLOW = 10
# A kept connection unused this long is closed, down to POOL_MIN_IDLE. Five minutes outlasts the gap
# between the bursts of every-minute jobs (so they reuse their connections), while a node whose
# peak has passed gives its idle server connections back instead of holding them for good.
POOL_IDLE_TIMEOUT = 300.0
# Idle connections always kept: the heartbeat's renewal and the next tick find one open.
POOL_MIN_IDLE = 2


# SQLAlchemy logs every pool re-creation (each engine.dispose(), e.g. at shutdown) at INFO on a
# logger named after the pool class: noise in `mutexcron run --log-level info`.
logging.getLogger(f"{__name__}.IdleTrimmingPool").setLevel(logging.WARNING)


class IdleTrimmingPool(Pool):
    """A last-in-first-out connection pool that keeps what the node really uses and lets the rest go.

    SQLAlchemy's QueuePool keeps ``pool_size`` connections for good and closes every overflow
    connection on check-in: a pool smaller than the node's burst of store calls (every-second jobs
    firing together on the executor's threads) opens and closes connections every second, and a
    pool as large as the burst keeps that many idle server connections per node forever. This pool
    keeps up to ``pool_size`` returned connections, but hands out the most recently returned one
    first, so the connections a quiet node does not need sink to the bottom unused; on each
    check-in, those unused for ``idle_timeout`` seconds are closed, down to ``min_idle``. A node
    keeps what it used at once within the last ``idle_timeout`` seconds, never more than
    ``pool_size`` idle. Beyond ``pool_size`` it opens up to ``max_overflow`` more (-1: no limit),
    closed on check-in as in QueuePool, then waits ``timeout`` seconds for one to come back.

    Trimming happens when a connection comes back (the heartbeat's renewals do that regularly); a
    store nobody calls keeps its connections until it is called or closed.
    """

    _clock = staticmethod(time.monotonic)  # when a connection came back; tests replace it to age them

    def __init__(
        self,
        creator: Any,
        pool_size: int = DEFAULT_POOL_SIZE,
        max_overflow: int = POOL_OVERFLOW,
        timeout: float = 30.0,
        idle_timeout: float = POOL_IDLE_TIMEOUT,
        min_idle: int = POOL_MIN_IDLE,
        **kw: Any,
    ) -> None:
        super().__init__(creator, **kw)
        self._size = pool_size
        self._max_overflow = max_overflow
        self._timeout = timeout
        self._idle_timeout = idle_timeout
        self._min_idle = min_idle
        self._idle: deque[tuple[float, ConnectionPoolEntry]] = deque()  # (returned at, record), newest last
        self._open = 0  # records of this pool not closed yet: idle + checked out
        self._cond = threading.Condition()

    def _do_get(self) -> ConnectionPoolEntry:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while not self._idle and not self._room():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise sa_exc.TimeoutError(
                        f"connection pool limit of {self._size} kept + {self._max_overflow} overflow reached, "
                        f"timed out after {self._timeout:g} s"
                    )
                self._cond.wait(remaining)
            if self._idle:
                return self._idle.pop()[1]
            self._open += 1
        try:
            return self._create_connection()
        except BaseException:
            self._closed(1)
            raise

    def _room(self) -> bool:
        return self._max_overflow < 0 or self._open < self._size + self._max_overflow

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        now = self._clock()
        with self._cond:
            if len(self._idle) < self._size:
                self._idle.append((now, record))
                surplus = self._trim(now)
                self._cond.notify()  # a caller waiting for a connection takes this one
            else:
                surplus = [record]  # over pool_size: an overflow connection, closed as in QueuePool
        self._close(surplus)

    def _trim(self, now: float) -> list[ConnectionPoolEntry]:
        """Take the connections left unused for ``idle_timeout`` (the oldest first) down to ``min_idle``."""
        surplus = []
        while len(self._idle) > self._min_idle and now - self._idle[0][0] >= self._idle_timeout:
            surplus.append(self._idle.popleft()[1])
        return surplus

    def _close(self, records: list[ConnectionPoolEntry]) -> None:
        """Close ``records`` outside the lock (closing talks to the server) and make room for new ones."""
        if not records:
            return
        try:
            for record in records:
                record.close()
        finally:
            self._closed(len(records))

    def _closed(self, count: int) -> None:
        with self._cond:
            self._open -= count
            self._cond.notify(count)  # a caller waiting for room may open a connection now

    def resize(self, pool_size: int) -> None:
        """Keep up to ``pool_size`` connections from now on (idle ones beyond it are closed now)."""
        with self._cond:
            self._size = pool_size
            surplus = [self._idle.popleft()[1] for _ in range(max(0, len(self._idle) - pool_size))]
            self._cond.notify_all()  # more room: callers waiting for a connection may open one
        self._close(surplus)

    def dispose(self) -> None:
        with self._cond:
            records = [record for _, record in self._idle]
            self._idle.clear()
        self._close(records)

    def recreate(self) -> IdleTrimmingPool:
        self.logger.info("Pool recreating")
        return self.__class__(
            self._creator,
            pool_size=self._size,
            max_overflow=self._max_overflow,
            timeout=self._timeout,
            idle_timeout=self._idle_timeout,
            min_idle=self._min_idle,
            recycle=self._recycle,
            echo=self.echo,
            logging_name=self._orig_logging_name,
            reset_on_return=self._reset_on_return,
            pre_ping=self._pre_ping,
            _dispatch=self.dispatch,
            dialect=self._dialect,
        )

    def size(self) -> int:
        """The most connections kept."""
        return self._size

    def checkedin(self) -> int:
        """Idle connections kept now."""
        with self._cond:
            return len(self._idle)

    def checkedout(self) -> int:
        """Connections in use now."""
        with self._cond:
            return self._open - len(self._idle)

    def status(self) -> str:
        return (
            f"IdleTrimmingPool: keeps up to {self._size} (at least {self._min_idle} idle), "
            f"{self.checkedin()} idle, {self.checkedout()} checked out"
        )


