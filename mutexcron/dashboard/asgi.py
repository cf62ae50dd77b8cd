"""A tiny ASGI adapter for the dashboard's WSGI application (HTTP only, no dependency).

Each request's body is read whole (actions are small), the WSGI app runs on a worker thread
(its store reads block), and the response is sent in one piece. ``root_path`` (where a framework
mounted it) becomes ``SCRIPT_NAME``, so links stay under the mount point.
"""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

__all__ = ["WsgiToAsgi"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class WsgiToAsgi:
    """``WsgiToAsgi(wsgi_app)``: an ASGI application serving ``wsgi_app``."""

    def __init__(
        self, wsgi_app: Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]], *, max_body: int = 64 * 1024
    ) -> None:
        self.wsgi_app = wsgi_app
        #: Bytes of a request body it buffers at most (413 beyond): the app's own limit.
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            raise RuntimeError(f"the mutexcron dashboard serves HTTP, not {scope['type']}")
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > self.max_body:  # refused before it is buffered whole (no action needs more)
                await _too_large(send)
                return
            if not message.get("more_body"):
                break
        status, headers, data = await asyncio.to_thread(self._run, _environ(scope, bytes(body)))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    def _run(self, environ: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            started[:] = [int(status.split(" ", 1)[0]), [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]]

        chunks = self.wsgi_app(environ, start_response)
        try:
            data = b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        return started[0], started[1], data


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _environ(scope: Scope, body: bytes) -> dict[str, Any]:
    root = scope.get("root_path", "") or ""
    path = scope.get("path", "/")
    if root and path.startswith(root):  # Starlette passes the full path with the mount's root_path
        path = path[len(root) :]
    server = scope.get("server") or ("localhost", 80)
    client = scope.get("client") or ("", 0)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope.get("method", "GET"),
        "SCRIPT_NAME": root,
        "PATH_INFO": path or "/",
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "REMOTE_ADDR": str(client[0]),
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    for name, value in scope.get("headers", []):
        key = name.decode("latin-1").upper().replace("-", "_")
        text = value.decode("latin-1")
        if key == "CONTENT_TYPE":
            environ["CONTENT_TYPE"] = text
        elif key != "CONTENT_LENGTH":
            header = f"HTTP_{key}"
            environ[header] = f"{environ[header]},{text}" if header in environ else text
    return environ


async def _too_large(send: Send) -> None:
    body = b'{"error": "request too large"}'
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
