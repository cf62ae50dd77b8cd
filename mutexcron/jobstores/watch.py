"""The watcher of one shared job store: one thread per store and node that sleeps on the store's
notice (PostgreSQL ``LISTEN``, a Redis subscription), SQLite's ``PRAGMA data_version`` or a short
poll, through the task pool's wakers (:mod:`mutexcron.tasks.wakeups.base`), and reads the store when
woken. Where the store keeps a change counter (:meth:`~mutexcron.jobstores.base.SharedJobStore.change_marker`:
SQL and MongoDB), a wake-up reads that one value, and every job only when it moved: the holder's
advances of next run times (every second for an every-second job) cost a standby one small read.
A notice only makes it read: a lost one costs latency, and the backstop read of every job every
:data:`BACKSTOP` seconds remains.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

log = logging.getLogger(__name__)

#: Seconds between two reads of a store whose notices never came.
BACKSTOP = 5.0
#: Seconds between two tries to read a store that failed.
RETRY = 2.0


class Watched(Protocol):
    """What the watcher needs of a shared store: its waker, its change marker, its name for log lines."""

    @property
    def where(self) -> str: ...

    def waker(self) -> Waker: ...

    def change_marker(self) -> object | None: ...


S = TypeVar("S", bound=Watched)


class Watcher(Generic[S]):
    """Reads ``store`` whenever its waker says it may have changed, and hands it to ``refresh``."""

    def __init__(self, store: S, refresh: Callable[[S], None], name: str) -> None:
        self.store = store
        self._refresh = refresh
        self.waker = store.waker()
        self._stop = threading.Event()
        self._failing = False
        self._marker: object | None = None  # the store's change marker at the last read of every job
        self._read_at = float("-inf")  # time.monotonic() of that read
        self.reads = 0  # how many times it read every job of the store (tests, benchmarks)
        self.checks = 0  # how many times it woke and looked (tests, benchmarks)
        self._thread = threading.Thread(target=self._loop, name=f"mutexcron-jobs-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.waker.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def poke(self) -> None:
        """Read the store now (a change made in this process)."""
        self.waker.notify()

    def _loop(self) -> None:
        wait = BACKSTOP
        while not self._stop.is_set():
            self.waker.wait(wait)
            if self._stop.is_set():
                return
            wait = BACKSTOP if self._read() else RETRY

    def _read(self) -> bool:
        """Read every job, unless the store's change marker says nothing changed since the last read
        (and that read is less than :data:`BACKSTOP` seconds old: a writer that bumps no counter,
        a plain APScheduler process, is seen then)."""
        try:
            self.checks += 1
            marker = self.store.change_marker()  # before the read: a change landing after it is seen next time
            if marker is not None and marker == self._marker and time.monotonic() - self._read_at < BACKSTOP:
                return True
            self._refresh(self.store)
            self._marker, self._read_at = marker, time.monotonic()
        except Exception as exc:  # noqa: BLE001 - a store down must not end the thread
            if not self._failing:
                self._failing = True
                log.warning("%s: cannot read the shared jobs (%s); trying again every %gs", self.store.where, exc, RETRY)
            return False
        self.reads += 1
        if self._failing:
            self._failing = False
            log.info("%s: reading the shared jobs again", self.store.where)
        return True
