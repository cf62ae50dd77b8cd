"""A threading server that serves at most so many connections at once: the metrics endpoint's and
the dashboard's.

Each connection holds a thread while it is open; idle or slow clients must not pile them up. Over
the cap a connection is refused at once (:meth:`CappedServer.refuse`: closed, or answered first),
with one WARNING line when the server fills up and one when it accepts again. A connection's slot
is given back before its socket is closed, so a client that saw its answer end can connect again
at once. Each server bounds a connection's whole request with
:data:`~mutexcron.observability.socket_deadlines.SOCKET_DEADLINES`.
"""

from __future__ import annotations

import logging
import threading
from socketserver import ThreadingMixIn
from typing import Any

__all__ = ["CappedServer"]

log = logging.getLogger(__name__)


class CappedServer(ThreadingMixIn):
    """Mixed in before a socketserver server class; call :meth:`limit` before serving."""

    daemon_threads = True
    #: What the log lines call this server.
    label = "server"
    #: What happens to a connection over the cap, for the log line ("closing", "answering 503 to").
    refusal = "closing"

    def limit(self, max_connections: int, deadline: float) -> None:
        """At most ``max_connections`` served at once, each for at most ``deadline`` seconds."""
        self.max_connections, self.deadline = max_connections, deadline
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        self._full = False

    def process_request(self, request: Any, client_address: Any) -> None:  # socketserver's name
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if not self._full:  # one line per change of state
                self._full = True
                log.warning("%s: %d connections open, %s new ones until one ends (or its %gs deadline)",
                            self.label, self.max_connections, self.refusal, self.deadline)  # fmt: skip
            self.refuse(request)
            return
        if self._full:
            self._full = False
            log.warning("%s: accepting connections again (%d were refused meanwhile)", self.label, self.refused)
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def refuse(self, request: Any) -> None:
        """A connection over the cap: closed at once (a subclass may answer it first)."""
        self.shutdown_request(request)  # type: ignore[attr-defined]

    def process_request_thread(self, request: Any, client_address: Any) -> None:  # socketserver's name
        """ThreadingMixIn's, with the slot given back before the socket is closed."""
        try:
            self.finish_request(request, client_address)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - socketserver's own handling (handle_error)
            self.handle_error(request, client_address)  # type: ignore[attr-defined]
        finally:
            self._slots.release()
            self.shutdown_request(request)  # type: ignore[attr-defined]
