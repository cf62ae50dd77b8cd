"""Hand-overs to this node: the store's notice that a lock was offered here wakes the heartbeat.

A node that gives a lock up under balanced placement offers it to the node placement names
(:meth:`mutexcron.locks.base.LockStore.hand_over`). The stores with notices tell that node at once
(PostgreSQL ``NOTIFY``, a Redis publish): :class:`OfferListener` holds the listening connection
(:meth:`~mutexcron.locks.base.LockStore.hand_over_waker`) on a thread of its own and calls
``on_offer`` for each notice, so the heartbeat reads the offered record and takes it in the same
moment. Elsewhere (SQLite, MySQL/MariaDB, MongoDB) it reads the live nodes every
:data:`NODES_POLL` seconds instead (one small read): when a node leaves (a stopping node deletes
its presence first), ``on_offer`` is called too, the heartbeat places that node's locks again at
once, and the locks placed on this node are then read every round until they are handed over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import StoreError, StoreUnavailableError
from ..locks import LockStore

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

log = logging.getLogger(__name__)

#: Longest wait on the listening connection before looking at the stop flag again.
WAIT = 5.0
#: Seconds between two reads of the live nodes on a store that sends no notices.
NODES_POLL = 0.25


class OfferListener:
    """Calls ``on_offer`` whenever the store says a lock was handed over to ``node_id`` (or, on a
    store without notices, whenever a node left)."""

    def __init__(self, store: LockStore, node_id: str, on_offer: Callable[[], None]) -> None:
        self.store = store
        self.node_id = node_id
        self.on_offer = on_offer
        self._waker: Waker | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        """Open the listening connection (if the store sends notices) and start listening."""
        if self._thread is not None or self._stopped.is_set():
            return
        try:
            self._waker = self.store.hand_over_waker(self.node_id)
        except Exception as exc:  # noqa: BLE001 - the refresh still finds every offer, later
            log.warning("no hand-over notices from %s (%s); offers are found at the next refresh", self.store.masked_url, exc)
            return
        loop = self._loop if self._waker is not None else self._poll_nodes
        self._thread = threading.Thread(target=loop, name="mutexcron-offers", daemon=True)
        self._thread.start()

    def _poll_nodes(self) -> None:
        """A store without notices: a node that left is seen within :data:`NODES_POLL` seconds."""
        known: set[str] | None = None
        while not self._stopped.wait(NODES_POLL):
            try:
                live = {p.node_id for p in self.store.nodes(prune=False)}
            except NotImplementedError:  # a store that keeps no presence: nothing to watch
                return
            except (StoreUnavailableError, StoreError):  # the heartbeat says when the store is down
                continue
            if known is not None and known - live:
                self.on_offer()
            known = live

    def _loop(self) -> None:
        waker = self._waker
        assert waker is not None
        while not self._stopped.is_set():
            try:
                woken = waker.wait(WAIT)
            except Exception:  # never let the listener die: the refresh is the backstop
                log.exception("hand-over listener failed")
                self._stopped.wait(1.0)
                continue
            if woken and not self._stopped.is_set():
                self.on_offer()

    def close(self) -> None:
        """Stop listening and close the connection."""
        self._stopped.set()
        waker, thread = self._waker, self._thread
        if waker is not None:
            waker.notify()
        if thread is not None:
            thread.join(timeout=10)
        if waker is not None:
            waker.close()
