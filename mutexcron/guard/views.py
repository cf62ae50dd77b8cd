"""What a node knows of the locks another node holds, so that standbys stay off the store.

A standby's ticks need not ask the store "is the holder still alive?" when the node read that
holder's record a moment ago: the store said how old the holder's heartbeat was (by the store's
clock) and how long its lease is, and the node maps that onto its own monotonic clock. The view
answers three questions:

* at a tick: is the holder's lease certainly still running? (then: ``lock_else`` with the record,
  no store call);
* for the heartbeat loop: when will the lease have run out at the latest? (then: try to take the
  lock over at that moment, not up to ``lease/3`` later);
* for ``lock_else``: the record, with ``heartbeat_age`` made honest (the age at the read plus the
  monotonic time since).

The store reported the age at some instant between the request's send and its reply, so the
lease ends between ``sent + ttl - age`` (used to trust it) and ``received + ttl - age`` (used to
try a takeover).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..locks.record import LockRecord

#: How long a view of another holder is trusted at all: a release is noticed within this time.
STANDBY_REFRESH = 1.0


@dataclass(frozen=True)
class _View:
    record: LockRecord
    sent: float
    received: float

    @property
    def remaining(self) -> float:
        """The holder's lease left at ``sent``, by the store's clock (negative: stale)."""
        return self.record.ttl - (self.record.heartbeat_age or 0.0)


class RecordViews:
    """Recent records of locks held by other nodes, with the monotonic times of their reads."""

    def __init__(self, refresh: float = STANDBY_REFRESH) -> None:
        self.refresh = refresh
        self._views: dict[str, _View] = {}
        self._lock = threading.Lock()

    def seen(self, lock: str, record: LockRecord | None, sent: float, received: float, me: str) -> None:
        """Remember a record read between ``sent`` and ``received``; forget it if it is not another
        node's live lease."""
        with self._lock:
            if record is None or record.holder in (None, me) or record.state != "active":
                self._views.pop(lock, None)
            else:
                self._views[lock] = _View(record, sent, received)

    def forget(self, lock: str) -> None:
        """Drop the view of a lock this node no longer guards."""
        with self._lock:
            self._views.pop(lock, None)

    def record(self, lock: str) -> LockRecord | None:
        """The last record seen of another node's lease on ``lock`` (ages as read), or None."""
        with self._lock:
            view = self._views.get(lock)
        return view.record if view is not None else None

    def held_elsewhere(self, lock: str, now: float) -> LockRecord | None:
        """The record if another node certainly holds ``lock`` now and the view is recent, else None.

        Its ``heartbeat_age`` is the age at the read plus the monotonic time since.
        """
        view = self._fresh(lock, now)
        if view is None:
            return None
        return view.record.aged((view.record.heartbeat_age or 0.0) + (now - view.received))

    def holds_elsewhere(self, lock: str, now: float) -> bool:
        """True if :meth:`held_elsewhere` would return a record (none is built)."""
        return self._fresh(lock, now) is not None

    def _fresh(self, lock: str, now: float) -> _View | None:
        with self._lock:
            view = self._views.get(lock)
        if view is None or now - view.received > self.refresh or now >= view.sent + view.remaining:
            return None
        return view

    def read_within(self, locks: list[str], seconds: float, now: float) -> tuple[list[str], bool]:
        """(those of ``locks`` with no view of another node's live lease, whether every other one
        was read less than ``seconds`` ago)."""
        with self._lock:
            views = {lock: self._views.get(lock) for lock in locks}
        unseen = [lock for lock, view in views.items() if view is None]
        return unseen, all(now - view.received < seconds for view in views.values() if view is not None)

    def stale(self, locks: list[str], now: float) -> tuple[list[str], list[str]]:
        """Split ``locks`` into (those whose holder's lease has run out by now at the latest, those
        with no recent view)."""
        expired, unknown = [], []
        with self._lock:
            for lock in locks:
                view = self._views.get(lock)
                if view is None or now - view.received > self.refresh:
                    unknown.append(lock)
                elif now >= view.received + view.remaining:
                    expired.append(lock)
        return expired, unknown

    def next_expiry(self, now: float) -> float | None:
        """Seconds until the first viewed lease runs out at the latest (0 if one already has)."""
        with self._lock:
            ends = [v.received + v.remaining for v in self._views.values()]
        return max(0.0, min(ends) - now) if ends else None
