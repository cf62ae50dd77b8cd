"""Whether this node can reach its store: one log line per change of state, and the retry backoff."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0


class StoreHealth:
    """Store reachability as seen by one node's ticks and heartbeat thread.

    Args:
        masked_url: the store URL, already masked.
        node_id: this node, for the first log line.
    """

    def __init__(self, masked_url: str, node_id: str) -> None:
        self.masked_url = masked_url
        self.node_id = node_id
        self.up: bool | None = None  # None until the first answer: log the first state too
        self.failures = 0
        self._lock = threading.Lock()

    def report(self, up: bool, exc: BaseException | None = None) -> None:
        """Record an answer (``up``) or a failure; logs only when the state changes."""
        with self._lock:  # ticks on executor threads and the heartbeat thread both report
            if up:
                self.failures = 0
                if self.up is False:
                    log.warning("lock store %s is reachable again; guarded jobs resume", self.masked_url)
                elif self.up is None:
                    log.info("lock store %s is reachable (node %s)", self.masked_url, self.node_id)
            else:
                self.failures += 1
                if self.up is not False:
                    log.error(
                        "lock store %s is unreachable: guarded jobs will not run until it is back; retrying (%s)",
                        self.masked_url,
                        exc,
                    )
            self.up = up

    def backoff(self, period: float, holding: bool) -> float:
        """How long to wait before the next try while the store is down (never longer than one
        renewal period while this node still holds leases)."""
        wait = min(MAX_BACKOFF, period * 2.0 ** min(self.failures, 8))
        return min(wait, period) if holding else wait
