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
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import AttrsError
from ..locks import HandOff, LockStore, Node, RunInfo
from ..locks.record import LockRecord, dump_attrs

log = logging.getLogger(__name__)

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
    done: Callable[[bool, BaseException | None], None]


#: What a queued hand-off's sender is told when its store call ends: (written, the call's error or None).
Done = Callable[[bool, BaseException | None], None]


class HandOffBatcher:
    """A node's hand-offs, sent in batches by one thread: each store call carries every hand-off
    queued since the previous call began (up to :data:`MAX_BATCH`).

    A hand-off queued while no call is in flight is sent at once; one queued during a call goes in
    the next call with everything else that came meanwhile. No hand-off waits for a timer: the wait
    is at most the call in flight (plus one call per :data:`MAX_BATCH` hand-offs queued ahead of
    it), and it is measured (:meth:`snapshot`). Store calls per second therefore do not grow with
    the number of hand-offs due at once, and the queue is one FIFO, so the hand-offs of one lock
    are sent in the order they were queued. Every item stays fenced by holder and token on its own.
    """

    def __init__(self, store: LockStore, node: Node, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self.stats = HandOffStats()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._sending = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def hand_off(self, item: HandOff) -> bool:
        """Write ``item`` in the next store call and wait for it; True if written, False if the lock moved on.

        Raises what the store call raised (StoreUnavailableError, StoreError).
        """
        done = threading.Event()
        outcome: list[Any] = []

        def record(written: bool, error: BaseException | None) -> None:
            outcome.extend((written, error))
            done.set()

        self.hand_off_later(item, record)
        done.wait()
        if outcome[1] is not None:
            raise outcome[1]
        return bool(outcome[0])

    def hand_off_later(self, item: HandOff, done: Done) -> None:
        """Queue ``item``; ``done(written, error)`` is called from the sending thread once its store call ends."""
        with self._changed:
            self._queue.append(_Pending(item, self.clock(), done))
            self._closing = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._send_loop, name="mutexcron-handoff", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def snapshot(self) -> dict[str, float]:
        """:meth:`HandOffStats.snapshot`, read while no batch is being counted."""
        with self._changed:
            return self.stats.snapshot()

    def idle(self) -> bool:
        """Nothing queued and no store call in flight."""
        with self._changed:
            return not self._queue and not self._sending

    def close(self) -> None:
        """End the sending thread once everything queued is sent (a later hand-off starts it again)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._sending = False
                    if self._closing:
                        self._thread, self._closing = None, False
                        return
                    self._changed.wait()
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
                self._sending = True
                now = self.clock()
                self.stats.add([now - p.queued for p in batch])
            self._send(batch)

    def _send(self, batch: list[_Pending]) -> None:
        """One store call for ``batch``, then each sender told (a failing ``done`` is logged, never
        stops the thread)."""
        try:
            outcomes: list[tuple[bool, BaseException | None]] = [
                (written, None) for written in self.store.hand_off_many(self.node, [p.item for p in batch])
            ]
        except AttrsError:  # checked before queuing; should one slip through, it fails alone
            outcomes = [self._alone(p) for p in batch]
        except Exception as exc:  # noqa: BLE001 - every sender of the batch is told the store's error
            outcomes = [(False, exc)] * len(batch)
        for pending, (written, error) in zip(batch, outcomes, strict=True):
            try:
                pending.done(written, error)
            except Exception:
                log.exception("hand-off of lock %r: its outcome could not be reported", pending.item.lock)

    def _alone(self, pending: _Pending) -> tuple[bool, BaseException | None]:
        try:
            return self.store.hand_off_many(self.node, [pending.item])[0], None
        except Exception as exc:  # noqa: BLE001 - this sender's own error
            return False, exc


@dataclasses.dataclass
class Queued:
    """A write queued by :meth:`AttrsHandOff.write_later`, and the attrs copy it replaced."""

    item: HandOff
    replaced: tuple[int, dict[str, Any]] | None = None


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

    def write_later(
        self, lock: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, run: RunInfo | None, job: str,
        done: Callable[[Queued], Done],
    ) -> Queued:
        """:meth:`write` without waiting: the merged item is queued behind this lock's earlier
        writes, and this node's copy of the attrs moves to it at once (the lock's next run starts
        from it; :meth:`abandon` puts it back if the write is given up). ``done(queued)`` gives the
        callback that the sending thread calls with ``(written, error)``.

        Raises AttrsError before queuing.
        """
        with self._writing_lock(lock):
            merged = self._merged(lock, token, seen, attrs, job)
            queued = Queued(HandOff(lock, token, merged, _of_job(run, job)))
            with self._lock:
                queued.replaced = self._attrs.get(lock)
                if merged is not None:
                    self._attrs[lock] = (token, merged)
            self.batcher.hand_off_later(queued.item, done(queued))  # queued under the lock: in the lock's order
            return queued

    def _writing_lock(self, lock: str) -> threading.Lock:
        """The lock that orders one lock's writes: its merge and its place in the queue."""
        with self._lock:
            return self._writing.setdefault(lock, threading.Lock())

    def _merged(
        self, lock: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, job: str
    ) -> dict[str, Any] | None:
        """Under the lock's writing lock: the attrs to write, this node's copy with the run's ``seen``
        keys replaced by ``attrs`` (a group mate's kept); None if the run changes none. Checked."""
        if attrs is None:
            return None
        merged = {k: v for k, v in self.attrs(lock, token).items() if k not in seen}
        merged.update(attrs)
        self.check(merged, job)
        return merged

    def resend(self, queued: Queued, done: Done) -> None:
        """Queue a write from :meth:`write_later` again, after its store call failed."""
        self.batcher.hand_off_later(queued.item, done)

    def abandon(self, queued: Queued) -> None:
        """A write from :meth:`write_later` is given up: this node's copy of the attrs goes back to
        what it was, unless a later write moved it meanwhile."""
        if queued.item.attrs is None:
            return
        with self._lock:
            current = self._attrs.get(queued.item.lock)
            if current is not None and current[1] is queued.item.attrs:
                if queued.replaced is None:
                    self._attrs.pop(queued.item.lock, None)
                else:
                    self._attrs[queued.item.lock] = queued.replaced

    def write(
        self, lock: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, run: RunInfo | None, job: str
    ) -> bool:
        """One fenced write of the merged attrs and the run info; False if the lock moved on.

        The run (if any) goes to ``job``'s run history in the same write (``run.job`` defaults to
        ``job``). Raises StoreUnavailableError/StoreError from the store, AttrsError for bad attrs.
        """
        with self._writing_lock(lock):
            merged = self._merged(lock, token, seen, attrs, job)
            if not self.batcher.hand_off(HandOff(lock, token, merged, _of_job(run, job))):
                return False
            if merged is not None:
                with self._lock:
                    self._attrs[lock] = (token, merged)
            return True


def _of_job(run: RunInfo | None, job: str) -> RunInfo | None:
    """The run info filed under ``job`` unless it names its job already."""
    return run if run is None or run.job is not None else dataclasses.replace(run, job=job)
