"""A TCP proxy for tests: put it between a client and a real server to delay its replies.

It stands for a slow network, a paused VM or a GC pause without touching mutexcron's code:
the client talks to ``127.0.0.1:<proxy.port>``, the proxy to the real server.
"""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    """Forwards every connection to ``(host, port)``; ``reply_delay``/``request_delay`` seconds
    are added to each chunk in that direction (order is kept)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.reply_delay = 0.0
        self.request_delay = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets_lock = threading.Lock()  # a connection accepted as close() runs is closed too
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()

    def url(self, template: str) -> str:
        """``template`` with ``{port}`` filled in, e.g. ``redis://127.0.0.1:{port}/0``."""
        return template.format(port=self.port)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._sockets_lock:
                if self._closed.is_set():
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for source, sink, delay in ((client, server, "request_delay"), (server, client, "reply_delay")):
                chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(source, chunks, delay), daemon=True).start()
                threading.Thread(target=self._write, args=(sink, chunks), daemon=True).start()

    def _read(self, source: socket.socket, chunks: queue.Queue[tuple[float, bytes]], delay: str) -> None:
        """Stamp each chunk with the moment it may leave: arrival + the delay (never cumulative)."""
        try:
            while chunk := source.recv(65536):
                chunks.put((time.monotonic() + getattr(self, delay), chunk))
        except OSError:
            pass
        chunks.put((0.0, b""))

    def _write(self, sink: socket.socket, chunks: queue.Queue[tuple[float, bytes]]) -> None:
        try:
            while True:
                due, chunk = chunks.get()
                if not chunk:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                sink.sendall(chunk)
        except OSError:
            pass
        try:
            sink.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        with self._sockets_lock:
            self._closed.set()
        self._listener.close()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass
