"""What :meth:`~mutexcron.mutex.lock.Mutex.hold` yields, and the one thread per Mutex that renews them all.

A HeldLease is ours until its *deadline*: the send time of the last successful acquire or
renewal plus the lease length, by this process's monotonic clock. The deadline is counted from
when the request was **sent**, so a slow reply can only make us give the lease up early, never
late. ``lost`` is computed from the clock on every read, so it is exact even while the renewer
thread is stuck in a slow store call; the renewer adds the callback and the verdict "another
holder took it".
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable

from ..errors import LeaseError, StoreError
from ..locks import LockStore, Node
from ..locks.record import LockRecord

log = logging.getLogger(__name__)

#: Never renew more often than this, whatever the leases (protects the store from tiny leases).
MIN_PERIOD = 0.05

OnLost = Callable[["HeldLease"], None]


class HeldLease:
    """What ``Mutex.hold()`` yields: a held lease (truthy) or the answer "someone else holds it" (falsy).

    Attributes:
        name: the lock name.
        node_id: the id of the :class:`~mutexcron.mutex.lock.Mutex` that asked (the holder, if acquired).
        lease: the lease length in seconds.
        acquired: True if this hold took the lock. ``bool(lease)`` is the same.
        record: the lock record as the store returned it when acquiring; when not acquired, it
            shows the current holder (``record.holder``, ``record.active_ip``, ``record.token``).
        released: after the block, True if the store released the lock, False if it was not ours
            any more (or the release could not reach the store); None before the block ends.
    """

    def __init__(
        self,
        name: str,
        node_id: str,
        lease: float,
        record: LockRecord,
        *,
        acquired: bool,
        clock: Callable[[], float],
        sent_at: float = 0.0,
        on_lost: OnLost | None = None,
    ) -> None:
        self.name = name
        self.node_id = node_id
        self.lease = lease
        self.record = record
        self.acquired = acquired
        self.released: bool | None = None
        self._clock = clock
        self._deadline = sent_at + lease
        self._on_lost = on_lost
        self._lost_reason: str | None = None if acquired else "never acquired"
        self._closed = not acquired
        self._notified = False
        self._superseded = False  # the store showed another holder or token: nothing of ours to release
        self._mutex = threading.Lock()

    def __bool__(self) -> bool:
        return self.acquired

    def __repr__(self) -> str:
        if not self.acquired:
            return f"<HeldLease {self.name!r} not acquired: held by {self.record.holder} (token {self.record.token})>"
        return f"<HeldLease {self.name!r} token={self.record.token} lost={self.lost}>"

    @property
    def token(self) -> int:
        """The fencing token: pass it to systems that can refuse writes from an older holder.

        Raises:
            LeaseError: the lock was not acquired (there is no token of ours to fence with).
        """
        if not self.acquired:
            raise LeaseError(f"lock {self.name!r} was not acquired: it is held by {self.record.holder}; there is no token")
        return self.record.token

    @property
    def lost(self) -> bool:
        """True once this lease is no longer ours (sticky; also True if it was never acquired).

        Lost means: renewals failed for longer than the lease by the monotonic clock, or the store
        says another holder (or another token) has the lock. Check it before side effects. After
        the block it keeps its last value: whether the lease was lost during the block.
        """
        with self._mutex:
            return self._lost_locked()

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost, or None while it is held."""
        with self._mutex:
            return self._lost_reason if self._lost_locked() else None

    @property
    def remaining(self) -> float:
        """Seconds until the lease runs out unless a renewal lands (0 once lost)."""
        with self._mutex:
            return 0.0 if self._lost_locked() else max(0.0, self._deadline - self._clock())

    def check(self) -> None:
        """Raise :class:`~mutexcron.errors.LeaseError` if the lease is lost: a guard before a side effect."""
        reason = self.lost_reason
        if reason is not None:
            raise LeaseError(f"lease of lock {self.name!r} (token {self.record.token}) is lost: {reason}")

    # -- used by the Mutex and the renewer -----------------------------------------------------
    def _lost_locked(self) -> bool:
        if self._lost_reason is None and not self._closed and self._clock() >= self._deadline:
            # Sticky from the first moment it is seen: a renewal sent earlier but answered later
            # must not bring back a lease that someone already saw as lost. Frozen once closed.
            self._lost_reason = f"no successful renewal within the lease ({self.lease:g}s)"
        return self._lost_reason is not None

    def _renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` succeeded: extend the deadline, unless already lost."""
        with self._mutex:
            if not self._lost_locked():
                self._deadline = max(self._deadline, sent_at + self.lease)

    def _lose(self, reason: str, *, superseded: bool = False) -> None:
        """Mark the lease lost (if it is not already) and call ``on_lost`` once, while the block runs."""
        with self._mutex:
            self._superseded = self._superseded or superseded
            if self._closed or self._notified:
                return
            if not self._lost_locked():
                self._lost_reason = reason
            self._notified = True
            callback, why = self._on_lost, self._lost_reason
        log.warning("lost lock %r (token %d): %s", self.name, self.record.token, why)
        if callback is not None:
            # A thread of its own: a slow callback must not hold up the renewals of the other
            # holds, and sys.exit() in it must not end the renewer.
            threading.Thread(target=self._call_on_lost, args=(callback,), name="mutexcron-on-lost", daemon=True).start()

    def _call_on_lost(self, callback: OnLost) -> None:
        try:
            callback(self)
        except BaseException:  # SystemExit too: it would end only this thread, silently
            log.exception("on_lost callback of lock %r failed", self.name)

    def _close(self) -> None:
        """The block ended: no callback from now on, and the renewer skips this lease."""
        with self._mutex:
            self._lost_locked()  # settle the verdict first: after the block, lost says "lost during it"
            self._closed = True

    def _forked(self) -> None:
        """In a child forked during the block: the lease is the parent's, not this process's."""
        self._mutex = threading.Lock()  # a parent's thread may have held it at the fork
        if self._lost_reason is None and not self._closed:
            self._lost_reason = "this process was forked from the holder: the lease is the parent's"
        self._notified = True  # no on_lost here: the parent's renewer decides about its lease
        self._closed = True

    def _state(self) -> tuple[bool, float, float]:
        """(still renewable, deadline, when the next renewal is due), read together."""
        with self._mutex:
            due = self._deadline - self.lease + max(MIN_PERIOD, self.lease / 3)
            return not self._closed and not self._lost_locked(), self._deadline, due


class Renewer:
    """One daemon thread per Mutex that renews every open lease of it in one ``renew_many`` call.

    It starts with the first lease, sleeps on an Event (woken early when a lease is added or on
    stop), and runs a round every shortest-lease/3, or sooner when a deadline is nearer (so the
    ``on_lost`` callback comes on time during an outage). When the store is unreachable it keeps
    trying every period: backing off longer than that would let the leases run out.
    """

    def __init__(self, store: LockStore, node: Node, clock: Callable[[], float]) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self._holds: set[HeldLease] = set()
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._store_up = True
        self._planned = math.inf  # when the thread wakes next (clock); inf while a round runs or idle

    def add(self, hold: HeldLease) -> None:
        """Renew ``hold`` from now on (starts the thread on first use)."""
        _, deadline, renew_at = hold._state()
        with self._mutex:
            if self._stopping:
                raise LeaseError("this Mutex is closed")
            self._holds.add(hold)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="mutexcron-mutex-renewer", daemon=True)
                self._thread.start()
            # Wake the thread only if this lease is due before its planned round: back-to-back
            # short holds then cost no thread switch each.
            wake = min(renew_at, deadline) < self._planned
        if wake:
            self._wake.set()

    def remove(self, hold: HeldLease) -> None:
        with self._mutex:
            self._holds.discard(hold)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the thread (waits up to ``timeout`` s for a round in flight)."""
        with self._mutex:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _forked(self) -> None:
        """In a forked child: this renewer is the parent's; its thread is not here, its holds are not ours."""
        self._mutex, self._wake = threading.Lock(), threading.Event()  # a parent's thread may have held them
        self._stopping, self._thread = True, None
        for hold in self._holds:
            hold._forked()
        self._holds = set()

    def _loop(self) -> None:
        while True:
            self._wake.clear()  # before the round: a lease added during it wakes the next wait
            with self._mutex:
                if self._stopping:
                    return
                self._planned = math.inf  # a lease added during the round wakes the next wait
            try:
                wait = self.run_once()
            except BaseException:  # never let the renewer die: every hold of this Mutex depends on it
                log.exception("a renewal round of %s failed; next round in %gs", self.node.node_id, MIN_PERIOD)
                wait = MIN_PERIOD
            with self._mutex:
                self._planned = math.inf if wait is None else self.clock() + wait
            self._wake.wait(wait)

    def run_once(self) -> float | None:
        """One round: expire, then renew the open leases in one round trip if any is due.

        Returns:
            How long to wait before the next round (None: no open lease, wait to be woken).
        """
        with self._mutex:
            holds = list(self._holds)
        live, due = [], []
        for hold in holds:
            renewable, _, renew_at = hold._state()
            if renewable:
                live.append(hold)
                due.append(renew_at)
            else:
                hold._lose("no successful renewal within the lease")  # no-op once closed or notified
        # All of them in one round trip, even those not due yet: the round trip is the cost.
        # A lease just added is not due: waking up for it only recomputes the wait.
        if live and min(due) <= self.clock():
            self._renew(live)
        return self._next_wait(live)

    def _renew(self, live: list[HeldLease]) -> None:
        sent_at = self.clock()
        try:
            renewed = self.store.renew_many(self.node, {h.name: h.record.token for h in live})
        except StoreError as exc:  # unreachable or contended: neither a renewal nor a loss
            self._report(False, exc)
            return
        except Exception:  # never let the renewer die; the deadlines still run out
            log.exception("renewing the leases of %s failed", self.node.node_id)
            return
        self._report(True, None)
        for hold in live:
            if hold.name in renewed:
                hold._renewed(sent_at)
            else:
                hold._lose("the store no longer has this holder and token: another holder took the lock", superseded=True)

    def _next_wait(self, live: list[HeldLease]) -> float | None:
        """Until the next renewal is due (a period after a failed one), or a deadline, if sooner."""
        now, waits = self.clock(), []
        for hold in live:
            renewable, deadline, renew_at = hold._state()
            if renewable:
                period = max(MIN_PERIOD, hold.lease / 3)
                waits += [renew_at - now if renew_at > now else period, deadline - now]
        return max(0.005, min(waits)) if waits else None

    def _report(self, up: bool, exc: BaseException | None) -> None:
        """Log one line per change of the store's state, not one per round."""
        if up and not self._store_up:
            log.warning("lock store %s is reachable again; leases of %s renewed", self.store.masked_url, self.node.node_id)
        elif not up and self._store_up:
            log.warning(
                "lock store %s is unreachable: leases of %s are not renewed and are lost once their lease runs out (%s)",
                self.store.masked_url,
                self.node.node_id,
                exc,
            )
        self._store_up = up


class _Release:
    """One release on the releaser thread: the caller waits for ``done`` for a while at most."""

    __slots__ = ("done", "result", "then", "work")

    def __init__(self, work: Callable[[], bool], then: Callable[[], None]) -> None:
        self.work, self.then = work, then
        self.done = threading.Lock()
        self.done.acquire()  # released by the releaser thread when the work is over
        self.result = False


class Releaser:
    """One daemon thread per Mutex that runs the releases at the end of the blocks.

    A block's end waits for its release at most a deadline: a store that stops answering would
    otherwise keep the caller for whole operation timeouts. A release still in flight after the
    deadline lands or fails on this thread, and runs ``then`` (which frees the name for this
    Mutex's other holds) only when it is over, so a later hold of the same name cannot be let in
    as "the holder renewing" and then freed by the late release.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Release | None] = queue.SimpleQueue()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def release(self, work: Callable[[], bool], then: Callable[[], None], deadline: float) -> bool | None:
        """Run ``work`` then ``then`` on the releaser thread; its result, or None if not over within ``deadline`` s."""
        job = _Release(work, then)
        with self._mutex:
            queued = not self._stopped
            if queued:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name="mutexcron-mutex-releaser", daemon=True)
                    self._thread.start()
                self._jobs.put(job)
        if not queued:  # the Mutex is closed: the thread is ending, so in the caller's thread
            self._run(job)
            return job.result
        return job.result if job.done.acquire(timeout=deadline) else None

    def stop(self, timeout: float = 0.0) -> None:
        """End the thread once the releases queued so far are over (waits up to ``timeout`` s)."""
        with self._mutex:
            self._stopped, thread = True, self._thread
            if thread is None:
                return
            self._jobs.put(None)  # after every release queued so far; later ones run in their callers
        if timeout and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(job)

    @staticmethod
    def _run(job: _Release) -> None:
        try:
            job.result = job.work()
        except BaseException:  # never let the releaser die; the lease then expires on its own
            log.exception("a release failed")
        finally:
            try:
                job.then()
            finally:
                job.done.release()
