"""The attrs a node hands from run to run, merged and written one at a time per lock, batched across locks.

Only the token holder can write a lock's attrs (every write is fenced by holder and token), so a
node that serialises its own writes per lock serialises all of them. The writes of different locks
that are due at the same moment go to the store together (:class:`HandOffBatcher`: one
``hand_off_many`` call for all of them, each item still fenced on its own). The node keeps the attrs as
stored under its current token: the record at the acquire that gave it the token, then its own
writes. A run's returned dict replaces the keys the run was given (``seen``): keys it was given
and did not return are deleted, and keys it never saw (a lock-group mate's) are kept.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import AttrsError
from ..locks import HandOff, LockStore, Node, RunInfo
from ..locks.record import LockRecord, dump_attrs

#: The most hand-offs one store call carries (a larger backlog goes in several calls, one after the other).
MAX_BATCH = 200
#: How many of the latest waits :class:`HandOffStats` keeps for its percentiles.
KEPT_WAITS = 4096


@dataclasses.dataclass
class HandOffStats:
    """What batching did: calls made, hand-offs written, and how long hand-offs waited for their
    batch to be sent (from the run's hand-off to the start of the store call that carries it)."""

    calls: int = 0
    items: int = 0
    max_wait: float = 0.0
    waits: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=KEPT_WAITS))

    def add(self, waits: Sequence[float]) -> None:
        self.calls += 1
        self.items += len(waits)
        self.waits.extend(waits)
        self.max_wait = max(self.max_wait, *waits)

    def snapshot(self) -> dict[str, float]:
        """``calls``, ``items``, ``max_wait`` and the ``p50_wait``/``p99_wait`` of the latest waits, in seconds."""
        waits = sorted(self.waits)

        def pct(p: float) -> float:
            return waits[min(len(waits) - 1, int(p / 100 * len(waits)))] if waits else 0.0

        return {"calls": self.calls, "items": self.items, "max_wait": self.max_wait, "p50_wait": pct(50), "p99_wait": pct(99)}


@dataclasses.dataclass
class _Pending:
    item: HandOff
    queued: float
    done: bool = False
    written: bool = False
    error: BaseException | None = None


class HandOffBatcher:
    """Group commit of a node's hand-offs: each caller waits for the store call that carries its item.

    A hand-off that finds no store call in flight is sent at once (with any others waiting, up to
    :data:`MAX_BATCH`); one that arrives while a call is in flight waits for it to end and goes in
    the next call with everything that arrived meanwhile. No hand-off waits for a timer: the wait
    is at most the call in flight (plus one per :data:`MAX_BATCH` items queued ahead of it), and is
    measured (:attr:`stats`). Store calls per second therefore do not grow with the number of
    hand-offs due at once. Every item stays fenced by holder and token on its own.
    """

    def __init__(self, store: LockStore, node: Node, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self.stats = HandOffStats()
        self._queue: list[_Pending] = []
        self._sending = False
        self._changed = threading.Condition()

    def hand_off(self, item: HandOff) -> bool:
        """Write ``item`` in the next store call; True if written, False if the lock moved on.

        Raises what the store call raised (StoreUnavailableError, StoreError) for the items it carried.
        """
        pending = _Pending(item, self.clock())
        with self._changed:
            self._queue.append(pending)
        while True:
            with self._changed:
                while self._sending and not pending.done:
                    self._changed.wait()
                if pending.done:
                    break
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                self._sending = True
                now = self.clock()
                self.stats.add([now - p.queued for p in batch])
            self._send(batch)
        if pending.error is not None:
            raise pending.error
        return pending.written

    def snapshot(self) -> dict[str, float]:
        """:meth:`HandOffStats.snapshot`, read while no batch is being counted."""
        with self._changed:
            return self.stats.snapshot()

    def _send(self, batch: list[_Pending]) -> None:
        """One store call for ``batch`` (then wake the waiters, whatever happened)."""
        try:
            try:
                written = self.store.hand_off_many(self.node, [p.item for p in batch])
            except AttrsError:  # checked before queuing; should one slip through, it fails alone
                written = [self._alone(p) for p in batch]
            except BaseException as exc:  # noqa: BLE001 - every caller of the batch sees the store's error
                for p in batch:
                    p.error = exc
                written = [False] * len(batch)
            for p, ok in zip(batch, written, strict=True):
                p.written = ok
        finally:
            with self._changed:
                for p in batch:
                    p.done = True
                self._sending = False
                self._changed.notify_all()

    def _alone(self, pending: _Pending) -> bool:
        try:
            return self.store.hand_off_many(self.node, [pending.item])[0]
        except BaseException as exc:  # noqa: BLE001 - this caller's own error
            pending.error = exc
            return False


class AttrsHandOff:
    """Per-lock attrs under this node's current token, and their fenced writes."""

    def __init__(self, store: LockStore, node: Node, max_attrs_bytes: int | None) -> None:
        self.store = store
        self.node = node
        self.max_attrs_bytes = max_attrs_bytes
        self._attrs: dict[str, tuple[int, dict[str, Any]]] = {}
        self._writing: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.batcher = HandOffBatcher(store, node)

    def remember(self, lock: str, token: int, record: LockRecord) -> None:
        """Start the cache for a token this node just got (later writes are its own)."""
        with self._lock:
            cached = self._attrs.get(lock)
            if cached is None or cached[0] != token:
                self._attrs[lock] = (token, dict(record.attrs))

    def forget(self, lock: str) -> None:
        """Drop what is kept of a lock this node no longer guards."""
        with self._lock:
            self._attrs.pop(lock, None)
            self._writing.pop(lock, None)

    def attrs(self, lock: str, token: int) -> dict[str, Any]:
        """The attrs stored under ``token`` as this node knows them (a copy; {} if unknown)."""
        with self._lock:
            cached = self._attrs.get(lock)
            return dict(cached[1]) if cached is not None and cached[0] == token else {}

    def check(self, attrs: Mapping[str, Any], job: str) -> None:
        """Raise AttrsError for attrs that are not JSON or too large, before any write."""
        dump_attrs(attrs, job=job, limit=self.max_attrs_bytes)

    def write(
        self, lock: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, run: RunInfo | None, job: str
    ) -> bool:
        """One fenced write of the merged attrs and the run info; False if the lock moved on.

        The run (if any) goes to ``job``'s run history in the same write (``run.job`` defaults to
        ``job``). Raises StoreUnavailableError/StoreError from the store, AttrsError for bad attrs.
        """
        if run is not None and run.job is None:
            run = dataclasses.replace(run, job=job)
        with self._lock:
            writing = self._writing.setdefault(lock, threading.Lock())
        with writing:
            merged = None
            if attrs is not None:
                merged = {k: v for k, v in self.attrs(lock, token).items() if k not in seen}
                merged.update(attrs)
                self.check(merged, job)
            if not self.batcher.hand_off(HandOff(lock, token, merged, run)):
                return False
            if merged is not None:
                with self._lock:
                    self._attrs[lock] = (token, merged)
            return True
