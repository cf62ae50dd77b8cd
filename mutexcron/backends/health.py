"""Whether this node can reach its store: one log line per change of state, and the retry backoff."""

from __future__ import annotations

import threading
from typing import Any

from ..events import EVENT_STORE_DOWN, EVENT_STORE_UP, Emit, MutexEvent, log_event

MAX_BACKOFF = 30.0


class StoreHealth:
    """Store reachability as seen by one node's ticks and heartbeat thread.

    Args:
        masked_url: the store URL, already masked.
        node_id: this node, for the first log line.
        what: what the store serves, for the log lines (``lock`` or ``task``).
        emit: where the store down/up events go (default: the log lines alone).
    """

    def __init__(self, masked_url: str, node_id: str, what: str = "lock", emit: Emit | None = None) -> None:
        self.masked_url = masked_url
        self.node_id = node_id
        self.what = what
        self.emit: Emit = emit or log_event
        self.up: bool | None = None  # None until the first answer: log the first state too
        #: The store answered at least once since start (``mutexcron run --startup-timeout`` waits for it).
        self.reached = False
        self.failures = 0
        self._lock = threading.Lock()

    def report(self, up: bool, exc: BaseException | None = None) -> None:
        """Record an answer (``up``) or a failure; emits an event only when the state changes."""
        with self._lock:  # ticks on executor threads and the heartbeat thread both report
            before = self.up
            self.failures = 0 if up else self.failures + 1
            self.up = up
            self.reached = self.reached or up
        if up and before is not True:
            self._emit(EVENT_STORE_UP, first=before is None)
        elif not up and before is not False:
            self._emit(EVENT_STORE_DOWN, error=str(exc) if exc is not None else None)

    def _emit(self, code: int, **details: Any) -> None:
        self.emit(MutexEvent(code, node=self.node_id, store=self.masked_url, what=self.what, **details))

    def backoff(self, period: float, holding: bool) -> float:
        """How long to wait before the next try while the store is down (never longer than one
        renewal period while this node still holds leases)."""
        wait = min(MAX_BACKOFF, period * 2.0 ** min(self.failures, 8))
        return min(wait, period) if holding else wait
