"""On SQLite the store's clock is each process's own wall clock: a node whose clock disagrees with
the other users of the file is said so, loudly.

A server store reads its own clock, so nodes' clocks play no part in leases and due times. SQLite
has no server: ``'now'`` in a statement is the wall clock of the process that runs it. Processes
on one host read one system clock, so they agree, unless one runs with a shifted clock (a
``faketime`` wrapper, a container with its own time): that one judges due times and leases by
its own time, claims tasks early and writes leases the others misjudge. Every node writes its
presence (``seen``, by its own clock) with its renewals; a node that reads another's presence
dated more than :data:`WARN_ABOVE` seconds in its future warns, once per node, naming both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone

from ..errors import StoreError
from ..locks.base import LockStore

__all__ = ["CHECK_EVERY", "WARN_ABOVE", "SQLiteClockCheck"]

log = logging.getLogger(__name__)

#: Seconds between two reads of the other nodes' presences (one read, on SQLite only).
CHECK_EVERY = 30.0
#: Seconds a presence may be dated ahead of this node's clock before it is called out.
WARN_ABOVE = 1.0


class SQLiteClockCheck:
    """Reads the presences of the other users of a SQLite file now and then; warns about a clock ahead."""

    def __init__(self, store: LockStore, node_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.node_id = node_id
        self.clock = clock
        self.enabled = store.url.startswith("sqlite")
        self._next = 0.0
        self._warned: set[str] = set()

    def maybe_check(self) -> None:
        """Look, if the store is SQLite and the last look is :data:`CHECK_EVERY` seconds old."""
        if not self.enabled or self.clock() < self._next:
            return
        self._next = self.clock() + CHECK_EVERY
        try:
            nodes = self.store.nodes(prune=False)
        except (StoreError, NotImplementedError):
            return  # the store's own errors are reported by the renewals
        now = datetime.now(timezone.utc)  # what this process writes as the store's time
        for node in nodes:
            if node.node_id == self.node_id or node.last_seen is None or node.node_id in self._warned:
                continue
            ahead = (node.last_seen - now).total_seconds()
            if ahead > WARN_ABOVE:
                self._warned.add(node.node_id)
                log.warning(
                    "%s: node %s wrote its presence %.1f s ahead of the clock of node %s: on SQLite each process's "
                    "wall clock is the store's clock, so these nodes judge due times and leases %.1f s apart (tasks "
                    "claimed early, leases misjudged). Run every process sharing the file on one clock",
                    self.store.masked_url,
                    node.node_id,
                    ahead,
                    self.node_id,
                    ahead,
                )
