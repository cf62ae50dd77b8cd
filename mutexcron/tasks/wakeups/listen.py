"""What the stores' wakers share: a waker listening on a connection of its own, and in-process notices.

:class:`ListeningWaker` holds one dedicated connection to the store (PostgreSQL ``LISTEN``, a
Redis subscription) and sleeps on that connection's socket and on a local socket pair at once, so
a store notice and :meth:`~mutexcron.tasks.wakeups.base.Waker.notify` both end a wait at once. A
connection that breaks is logged once, and the waker polls (every
:data:`~mutexcron.tasks.wakeups.base.DEFAULT_POLL` seconds) until it connects again, which it tries on
the next wait, then after 1, 2, 4... seconds (at most :data:`RECONNECT_MAX`) while that fails.

:data:`LOCAL_WAKERS` wakes the wakers of this process when a store in this process adds a task
(or hands one back): the stores whose notices come late (SQLite's ``PRAGMA data_version``,
polled) or never (MariaDB and MySQL) register their wakers in it, keyed by what the task table is
(a database file, a server's database) and the code.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
import weakref
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any

from .base import DEFAULT_POLL, Waker

__all__ = ["LOCAL_WAKERS", "RECONNECT_MAX", "ListeningWaker", "LocalWakers"]

log = logging.getLogger(__name__)

#: The longest pause between two attempts to connect a waker's listening connection again.
RECONNECT_MAX = 30.0


class LocalWakers:
    """The wakers of this process by ``(table, code)``, held weakly: an add wakes them without a round trip."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._wakers: dict[tuple[str, str], weakref.WeakSet[Waker]] = {}

    def register(self, table: str, codes: Iterable[str], waker: Waker) -> None:
        """Wake ``waker`` on every :meth:`notify` of ``table`` for one of ``codes``."""
        with self._mutex:
            for code in codes:
                self._wakers.setdefault((table, code), weakref.WeakSet()).add(waker)

    def unregister(self, waker: Waker) -> None:
        with self._mutex:
            for key, wakers in list(self._wakers.items()):
                wakers.discard(waker)
                if not wakers:
                    del self._wakers[key]

    def notify(self, table: str, code: str) -> None:
        """A task of ``code`` was added to ``table`` (or handed back, or became due sooner) in this process."""
        with self._mutex:
            wakers = list(self._wakers.get((table, code), ()))
        for waker in wakers:
            waker.notify()


#: The process's registry (see :class:`LocalWakers`).
LOCAL_WAKERS = LocalWakers()


class RegisteredPollWaker(Waker):
    """Polls every ``interval`` seconds, woken at once by an add in this process (:data:`LOCAL_WAKERS`)."""

    def __init__(self, table: str, codes: Iterable[str], interval: float = DEFAULT_POLL) -> None:
        super().__init__()
        self.interval = interval
        LOCAL_WAKERS.register(table, codes, self)

    def wait(self, timeout: float) -> bool:
        woken = self._local.wait(max(0.0, min(timeout, self.interval)))
        self._local.clear()
        return woken

    def close(self) -> None:
        LOCAL_WAKERS.unregister(self)


class ListeningWaker(Waker):
    """A waker on a listening connection of its own; it polls while that connection is down.

    Subclasses open the connection (:meth:`_open`: connect, then listen), say which socket to
    watch (:meth:`_socket`), read what arrived (:meth:`_read`) and close it (:meth:`_shut`). Every
    call on the connection happens under one mutex, in the waiting thread (or in :meth:`close`).

    Args:
        codes: the task codes whose notices wake it.
        where: the store, for log lines (a masked URL).
        errors: the exceptions that mean the connection is broken (or cannot be opened).
    """

    #: What the connection listens with, for log lines ("LISTEN", "the subscription").
    what = "the listening connection"
    #: What the notices are about, for log lines.
    about = "task notices"

    def __init__(self, codes: Iterable[str], where: str, errors: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.codes = frozenset(codes)
        self.where = where
        self._errors: tuple[type[BaseException], ...] = (*errors, OSError)
        self._mutex = threading.Lock()
        self._closed = False
        self._listening = False
        self._lost = False  # broken since it last listened: log the recovery
        self._retry_at = 0.0
        self._delay = 0.0
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._reader, selectors.EVENT_READ)
        self._watched: tuple[Any, int] | None = None  # the socket watched, and its number

    # -- the subclass's connection -----------------------------------------------------------
    @abstractmethod
    def _open(self) -> None:
        """Connect and listen; raise one of ``errors`` if that fails."""

    @abstractmethod
    def _socket(self) -> Any:
        """The listening connection's socket (an object with ``fileno()``); a new object if the
        driver reconnected it by itself: the waker watches the new one."""

    @abstractmethod
    def _read(self) -> bool:
        """Read, without blocking, every notice that arrived; True if one is for one of :attr:`codes`."""

    @abstractmethod
    def _shut(self) -> None:
        """Close the connection, quietly (it may be broken already)."""

    @property
    def listening(self) -> bool:
        """True while the listening connection is up (as far as the last wait knows)."""
        return self._listening

    # -- waking ------------------------------------------------------------------------------
    def notify(self) -> None:
        super().notify()
        try:
            self._writer.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway), or closed
            pass

    def _take_local(self) -> bool:
        """True (and the local notice consumed) if :meth:`notify` was called."""
        if not self._local.is_set():
            return False
        self._local.clear()
        self._drain()
        return True

    def _drain(self) -> None:
        try:
            while self._reader.recv(4096):
                pass
        except OSError:  # BlockingIOError: empty; or closed
            pass

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._mutex:
            if self._take_local():
                return True
            if not self._closed and self._ensure_listening():
                try:
                    return self._listen(deadline)
                except self._errors as exc:
                    self._broken(exc)
        # Not listening: poll (the worker looks at the store again when this returns).
        woken = self._local.wait(max(0.0, min(deadline - time.monotonic(), DEFAULT_POLL)))
        if woken:
            self._take_local()
        return woken

    def _listen(self, deadline: float) -> bool:
        while True:
            if self._closed:
                return False
            if self._read():
                return True
            if self._take_local():
                return True
            target = self._socket()
            if self._watched is None or target is not self._watched[0]:
                self._unwatch()
                fileno = int(target.fileno())
                self._selector.register(fileno, selectors.EVENT_READ)
                self._watched = (target, fileno)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in self._selector.select(remaining):
                if key.fileobj is self._reader and not self._local.is_set():
                    self._drain()  # a stale byte of a notice already taken

    # -- the connection's life ---------------------------------------------------------------
    def _ensure_listening(self) -> bool:
        """Listen if not listening (now, or after the pause since the last failed attempt)."""
        if self._listening:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        try:
            self._open()
        except self._errors as exc:
            self._unwatch()
            self._shut()
            self._delay = min(RECONNECT_MAX, max(1.0, self._delay * 2))
            self._retry_at = now + self._delay
            if not self._lost:
                self._lost = True
                log.warning(
                    "%s: cannot open %s for %s (%s); polling every %gs, trying again in %gs",
                    self.where,
                    self.what,
                    self.about,
                    self._detail(exc),
                    DEFAULT_POLL,
                    self._delay,
                )
            else:
                log.debug("%s: %s still down (%s); next try in %gs", self.where, self.what, self._detail(exc), self._delay)
            return False
        self._listening, self._delay = True, 0.0
        if self._lost:
            self._lost = False
            log.info("%s: %s for %s is back", self.where, self.what, self.about)
        return True

    def _broken(self, exc: BaseException) -> None:
        """The listening connection failed: log one line, close it, poll; reconnect on the next wait."""
        log.warning(
            "%s: %s for %s was lost (%s); polling every %gs until it is back",
            self.where,
            self.what,
            self.about,
            self._detail(exc),
            DEFAULT_POLL,
        )
        self._lost = True
        self._listening = False
        self._unwatch()
        self._shut()
        self._retry_at, self._delay = 0.0, 0.0

    def _unwatch(self) -> None:
        if self._watched is not None:
            try:
                self._selector.unregister(self._watched[1])  # by number: a broken socket may have none
            except (KeyError, ValueError, OSError):
                pass
            self._watched = None

    def _detail(self, exc: BaseException) -> str:
        """What went wrong, for a log line; subclasses redact the store's secrets."""
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__

    def close(self) -> None:
        """Stop listening and release the connection (a waiting thread returns at once)."""
        self._closed = True
        try:
            self._writer.send(b"\0")  # a waiting thread wakes up, sees it closed, returns
        except OSError:
            pass
        with self._mutex:
            self._listening = False
            self._unwatch()
            self._shut()
            self._selector.close()
            self._reader.close()
            self._writer.close()
