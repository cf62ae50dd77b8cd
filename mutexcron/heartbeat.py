"""The lease manager: the leases this node holds, and the heartbeat thread that renews them.

One daemon thread per scheduler wakes every ``min(unactive_interval) / 3``. Each round it

1. renews **all** held leases in one store round trip (``renew_many``), so a lease never depends on
   how often its jobs fire;
2. on a standby, reads the locks of its guarded jobs in one round trip and takes over any that
   are released or stale by the store's clock, then asks the scheduler to catch up a fire time
   missed during the failover;
3. demotes any lease whose renewals have failed for longer than the lease, measured with this
   node's monotonic clock.

When the store cannot be reached, no guarded job runs, the thread backs off (up to 30 s, never
longer than the shortest lease/3 while it holds leases) and logs one line per change of state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import StoreError, StoreUnavailableError
from .locks import AcquireResult, FireClaim, LockStore, Node, RunInfo
from .record import LockRecord, dump_attrs

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0


@dataclass
class _Held:
    token: int
    deadline: float  # monotonic: the lease is ours until then, unless renewed


class LeaseManager:
    """Tracks this node's leases and runs the heartbeat thread.

    Args:
        store: the lock store.
        node: this node.
        locks: lock name -> lease length in seconds, for every guarded lock of this scheduler.
        on_acquired: called from the heartbeat thread after it takes over a lock, with the
            lock name and the record as it was before the takeover.
        clock: monotonic clock for this node's own deadlines (injectable for tests).
    """

    def __init__(
        self,
        store: LockStore,
        node: Node,
        locks: Mapping[str, float],
        *,
        on_acquired: Callable[[str, LockRecord | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.node = node
        self.locks = dict(locks)
        self.on_acquired = on_acquired
        self.clock = clock
        self.stopping = False
        self._held: dict[str, _Held] = {}
        self._mutex = threading.Lock()
        self._running: dict[str, int] = {}
        self._idle = threading.Condition(self._mutex)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_up: bool | None = None  # None until the first answer: log the first state too
        self._failures = 0

    # -- state ---------------------------------------------------------------------------------
    @property
    def period(self) -> float:
        return max(0.05, min(self.locks.values(), default=10.0) / 3)

    def holds(self, name: str, token: int) -> bool:
        """True while this node holds ``name`` with ``token`` and its lease has not run out."""
        with self._mutex:
            held = self._held.get(name)
            return held is not None and held.token == token and self.clock() < held.deadline

    def held(self) -> dict[str, int]:
        """The leases this node holds now: name -> token."""
        now = self.clock()
        with self._mutex:
            return {n: h.token for n, h in self._held.items() if now < h.deadline}

    def _store_state(self, up: bool, exc: BaseException | None = None) -> None:
        if up:
            self._failures = 0
            if self._store_up is False:
                log.warning("lock store %s is reachable again; guarded jobs resume", self.store.masked_url)
            elif self._store_up is None:
                log.info("lock store %s is reachable (node %s)", self.store.masked_url, self.node.node_id)
        else:
            self._failures += 1
            if self._store_up is not False:
                log.error(
                    "lock store %s is unreachable: guarded jobs will not run until it is back; retrying (%s)",
                    self.store.masked_url,
                    exc,
                )
        self._store_up = up

    def _set_held(self, name: str, token: int, sent_at: float, ttl: float, previous: LockRecord | None) -> bool:
        """Record a held lease; True if this node just became the holder (then logs it once)."""
        with self._mutex:
            old = self._held.get(name)
            self._held[name] = _Held(token, sent_at + ttl)
        if old is not None and old.token == token:
            return False
        if previous is not None and previous.holder and previous.holder != self.node.node_id:
            log.warning(
                "took over lock %r (token %d) from %s (%s), whose heartbeat was %.1fs old",
                name,
                token,
                previous.holder,
                previous.active_ip,
                previous.heartbeat_age or 0.0,
            )
        else:
            log.info("acquired lock %r (token %d)", name, token)
        return True

    def _acquired(self, name: str, before: LockRecord | None) -> None:
        """A change of holder, by a tick or by the heartbeat thread: let the scheduler catch up."""
        if self.on_acquired is not None:
            try:
                self.on_acquired(name, before)
            except Exception:
                log.exception("catch-up after acquiring %r failed", name)

    def _drop(self, name: str, why: str) -> None:
        with self._mutex:
            old = self._held.pop(name, None)
        if old is not None:
            log.warning("lost lock %r (token %d): %s", name, old.token, why)

    # -- operations used by guarded jobs ----------------------------------------------------------
    def tick(self, name: str, claim: FireClaim | None) -> AcquireResult | None:
        """One atomic acquire-or-renew (with the fire claim). None if the store is unreachable."""
        ttl = self.locks[name]
        sent_at = self.clock()
        try:
            result = self.store.acquire_or_renew(name, self.node, ttl, claim)
        except (StoreUnavailableError, StoreError) as exc:
            self._store_state(False, exc)
            return None
        self._store_state(True)
        if result.acquired:
            if self._set_held(name, result.token, sent_at, ttl, None):
                # Another job of the same lock group may have missed a fire time during the
                # failover; this job's own fire time is already claimed, so it is not repeated.
                self._acquired(name, result.record)
        else:
            self._drop(name, f"held by {result.record.holder} (token {result.record.token})")
        return result

    def begin_run(self, name: str) -> None:
        with self._mutex:
            self._running[name] = self._running.get(name, 0) + 1

    def end_run(self, name: str) -> None:
        with self._mutex:
            self._running[name] -= 1
            if not self._running[name]:
                del self._running[name]
            self._idle.notify_all()

    def checkpoint(self, name: str, token: int, attrs: Mapping[str, Any]) -> bool:
        """Store attrs during a run, conditional on holder and token (``Lease.save``)."""
        dump_attrs(attrs, job=name)  # bad attrs raise before any write, even without a lease
        if not self.holds(name, token):
            return False
        try:
            saved = self.store.heartbeat(name, self.node, token, attrs)
        except StoreUnavailableError as exc:
            log.warning("checkpoint of lock %r not saved: store unreachable (%s)", name, exc)
            return False
        if not saved:
            self._drop(name, "taken over during a run")
        return saved

    def finish(self, name: str, token: int, attrs: Mapping[str, Any] | None, run: RunInfo, job: str) -> bool:
        """Save a run's attrs and run info, conditional on holder and token.

        Retries while the lease is still ours if the store is briefly unreachable, so a result
        is not lost to a blip. Returns True if saved.
        """
        delay = 0.2
        while True:
            try:
                if self.store.heartbeat(name, self.node, token, attrs, run):
                    return True
                log.warning(
                    "job %r finished after lock %r (token %d) passed to another node: its attrs and run info "
                    "were NOT saved, the new holder's state is kept",
                    job,
                    name,
                    token,
                )
                self._drop(name, "taken over during a run")
                return False
            except StoreUnavailableError as exc:
                if not self.holds(name, token) or self._stop.is_set():
                    log.error(
                        "job %r: could not save attrs of lock %r, store unreachable and lease gone: %s", job, name, exc
                    )
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # -- the heartbeat thread -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None or not self.locks:
            return
        self._thread = threading.Thread(target=self._loop, name="mutexcron-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            wait = self.run_once()
            self._stop.wait(wait)

    def run_once(self) -> float:
        """One heartbeat round; returns how long to wait before the next one."""
        try:
            self._renew()
            if not self.stopping:
                self._take_over()
            self._store_state(True)
        except (StoreUnavailableError, StoreError) as exc:
            self._store_state(False, exc)
        except Exception:  # never let the heartbeat thread die
            log.exception("heartbeat round failed")
        self._expire()
        if self._store_up is False:
            backoff = min(MAX_BACKOFF, self.period * 2.0 ** min(self._failures, 8))
            return min(backoff, self.period) if self.held() else backoff
        return self.period

    def _renew(self) -> None:
        leases = self.held()
        if not leases:
            return
        sent_at = self.clock()
        renewed = self.store.renew_many(self.node, leases)
        with self._mutex:
            for name in renewed:
                held = self._held.get(name)
                if held is not None and held.token == leases[name]:
                    held.deadline = sent_at + self.locks[name]
        for name in set(leases) - renewed:
            self._drop(name, "another node holds it now")

    def _take_over(self) -> None:
        held = self.held()
        wanted = [n for n in self.locks if n not in held]
        if not wanted:
            return
        records = self.store.read_many(wanted)
        for name in wanted:
            record = records.get(name)
            if record is not None and record.state == "active" and record.holder != self.node.node_id:
                continue
            sent_at = self.clock()
            result = self.store.acquire_or_renew(name, self.node, self.locks[name])
            if result.acquired and self._set_held(name, result.token, sent_at, self.locks[name], record):
                self._acquired(name, record)

    def _expire(self) -> None:
        now = self.clock()
        with self._mutex:
            expired = [n for n, h in self._held.items() if now >= h.deadline]
        for name in expired:
            self._drop(name, "no successful renewal within the lease; this node demotes itself")

    # -- stopping ---------------------------------------------------------------------------------
    def stop(self, timeout: float) -> None:
        """Stop takeovers, wait up to ``timeout`` s for running guarded jobs, release leases, stop."""
        self.stopping = True
        deadline = self.clock() + max(0.0, timeout)
        with self._idle:
            while self._running and self.clock() < deadline:
                self._idle.wait(min(0.5, max(0.01, deadline - self.clock())))
            busy = dict(self._running)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for name, token in self.held().items():
            if name in busy:
                log.warning(
                    "not releasing lock %r: a job is still running after the shutdown timeout; "
                    "the lease will expire on its own",
                    name,
                )
                continue
            try:
                if self.store.release(name, self.node, token):
                    log.info("released lock %r (token %d)", name, token)
            except (StoreUnavailableError, StoreError) as exc:
                log.warning("could not release lock %r (%s); it will expire after its lease", name, exc)
        with self._mutex:
            self._held.clear()

    def running(self) -> dict[str, int]:
        with self._mutex:
            return dict(self._running)
