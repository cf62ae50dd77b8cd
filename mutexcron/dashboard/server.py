"""``mutexcron dashboard``'s web server: the standard library's WSGI server, one thread per connection.

Idle, slow or trickling clients can neither pile up threads nor keep theirs: at most
:data:`MAX_CONNECTIONS` connections are served at once (more are answered ``503`` with
``Retry-After`` at once, and closed), and each has :data:`REQUEST_DEADLINE` seconds for its whole
request and answer, after which its socket is shut down
(:data:`mutexcron.observability.socket_deadlines.SOCKET_DEADLINES`, as the metrics endpoint does)
and one WARNING line names the client (its address, and its request's method and path, without
the query).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..names import printable
from ..observability.capped_server import CappedServer
from ..observability.socket_deadlines import SOCKET_DEADLINES

__all__ = ["MAX_CONNECTIONS", "REQUEST_DEADLINE", "is_loopback", "make", "serve"]

log = logging.getLogger(__name__)

#: Connections served at once (each holds a thread while it is open); more are answered 503 at once.
MAX_CONNECTIONS = 32
#: Seconds a connection has for its whole request and answer: a per-read timeout would let a client
#: sending a byte every few seconds keep its thread forever. A page's refresh takes milliseconds.
REQUEST_DEADLINE = 30.0

_BUSY_BODY = b"the dashboard is serving too many connections: try again in a moment\n"
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _Server(CappedServer, WSGIServer):
    allow_reuse_address = True
    label = "dashboard"
    refusal = "answering 503 to"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit(MAX_CONNECTIONS, REQUEST_DEADLINE)

    def refuse(self, request: socket.socket) -> None:
        """Over the cap: a 503 sent without waiting (into the socket's empty buffer), then closed."""
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(_BUSY)
            request.recv(65536)  # what the client sent already: closing with it unread would reset the connection
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:  # socketserver's name
        log.debug("dashboard: connection from %s failed", client_address[0], exc_info=True)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    """One request per connection, within the server's deadline; requests are logged at DEBUG (a
    page polls every few seconds)."""

    server: _Server

    def setup(self) -> None:
        super().setup()
        self._deadline = time.monotonic() + self.server.deadline
        self._watch = SOCKET_DEADLINES.watch(self.connection, self._deadline)

    def parse_request(self) -> bool:
        """False (nothing served) for a request cut off at the deadline: what it sent is incomplete."""
        return super().parse_request() and time.monotonic() < self._deadline

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if SOCKET_DEADLINES.unwatch(self._watch):
                log.warning("dashboard: closed the connection from %s after %gs: %s was not complete by then",
                            self.client_address[0], self.server.deadline, self._what())  # fmt: skip

    def _what(self) -> str:
        """The request for a log line: method and path, no query (it is the client's text: escaped, clipped)."""
        words = str(getattr(self, "requestline", "") or "").split()
        if len(words) < 2:
            return "its request line"
        target = words[1].split("?", 1)[0]
        return f"its request ({printable(words[0][:16])} {printable(target[:120])})"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make(app: Any, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
         deadline: float = REQUEST_DEADLINE) -> _Server:  # fmt: skip
    """The server of ``app`` on ``host:port``: at most ``max_connections`` at once, each within ``deadline`` seconds."""
    server_class = _IPv6Server if ":" in host else _Server
    server: _Server = make_server(host, port, app, server_class=server_class, handler_class=_Handler)
    server.limit(max_connections, deadline)
    return server


def serve(server: _Server) -> None:
    """Serve until interrupted (SIGINT, or SIGTERM turned into an interrupt by the caller)."""
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
