"""Whole-request deadlines for sockets: a socket timeout bounds each read, not a request.

A peer that sends (or takes) a byte every few seconds never trips a per-read timeout, and holds
the thread serving it for as long as it likes. :data:`SOCKET_DEADLINES` shuts such a socket down
at its deadline, which wakes the blocked read or write at once. Used by the ping sender (each
ping's whole request) and the metrics server (each connection's whole request).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

__all__ = ["SOCKET_DEADLINES", "SocketDeadlines"]


class SocketDeadlines:
    """Shuts down every watched socket still open at its deadline (one thread, started when needed).

    ``deadline`` is a :func:`time.monotonic` time. A thread that cannot be started (the process is
    out of threads) leaves the sockets to their per-read timeouts, and is tried again next time.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a lock held by another thread at fork

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._watched: dict[int, tuple[float, socket.socket]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, deadline: float) -> int:
        """Shut ``sock`` down at ``deadline`` unless :meth:`unwatch` comes first; returns the key."""
        with self._cond:
            self._next += 1
            self._watched[self._next] = (deadline, sock)
            if self._thread is None or not self._thread.is_alive():  # first socket, or after an idle end
                thread = threading.Thread(target=self._serve, name="mutexcron-socket-deadlines", daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except RuntimeError:  # can't start new thread
                    self._thread = None
            self._cond.notify_all()
            return self._next

    def unwatch(self, key: int) -> bool:
        """Stop watching; True if the deadline had passed (the socket was shut down)."""
        with self._cond:
            return self._watched.pop(key, None) is None

    def _serve(self) -> None:
        with self._cond:
            while True:
                if not self._watched:
                    if not self._cond.wait(10.0) and not self._watched:  # idle: end, a later request restarts it
                        self._thread = None
                        return
                    continue
                now = time.monotonic()
                for key, (deadline, sock) in list(self._watched.items()):
                    if deadline <= now:
                        del self._watched[key]
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                soonest = min((d for d, _s in self._watched.values()), default=now + 10.0)
                self._cond.wait(max(0.0, soonest - now))


#: The one watcher of the process.
SOCKET_DEADLINES = SocketDeadlines()
