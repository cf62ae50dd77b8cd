"""``mutexcron dashboard``'s web server: the standard library's WSGI server, one thread per request."""

from __future__ import annotations

import ipaddress
import logging
import socket
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

__all__ = ["is_loopback", "serve"]

log = logging.getLogger(__name__)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Requests are logged at DEBUG (a page polls every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make(app: Any, host: str, port: int) -> _Server:
    server_class = _IPv6Server if ":" in host else _Server
    server: _Server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    return server


def serve(server: _Server) -> None:
    """Serve until interrupted (SIGINT, or SIGTERM turned into an interrupt by the caller)."""
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
