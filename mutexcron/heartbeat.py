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
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .backends.health import StoreHealth
from .errors import StoreError, StoreUnavailableError
from .events import (
    EVENT_LOCK_ACQUIRED,
    EVENT_LOCK_LOST,
    EVENT_LOCK_PAUSED,
    EVENT_LOCK_RELEASED,
    EVENT_LOCK_RESUMED,
    EVENT_LOCK_TAKEN_OVER,
    Emit,
    MutexEvent,
    log_event,
)
from .guard.agreement import Agreement, SharedNodeId
from .guard.handoff import AttrsHandOff, Queued
from .guard.offers import OfferListener
from .guard.views import STANDBY_REFRESH, RecordViews
from .locks import AcquireResult, FireClaim, HeldClaim, LockStore, Node, RunInfo
from .locks.base import Presence
from .locks.record import LockRecord
from .observability.clock_offset import ClockOffset
from .observability.sqlite_clocks import SQLiteClockCheck
from .placement import DEFAULT_HAND_OVER_WAIT, FirstPlacement, Placement
from .version import __version__

log = logging.getLogger(__name__)

#: Seconds between two presence records of a node that renews no lease (a standby).
PRESENCE_EVERY = 10.0

#: A round renews the held leases once this share of a period has passed since the last renewal
#: (rounds come every period, or every second on a standby, give or take a few milliseconds).
RENEW_EARLY = 0.9


#: Seconds between two rounds while a lock placed on this node is still held by another one.
HAND_OVER_POLL = 0.2

#: At most this many locks are handed over in one heartbeat round (one store write each), so that a
#: rebalance never delays the round's renewals.
MOVES_PER_ROUND = 64

#: The longest a stopping node under balanced placement keeps its locks (and runs their jobs) while
#: no live node is there to hand them to (a gunicorn reload: the new workers are still booting, which
#: takes seconds on a loaded machine); at most the scheduler's ``shutdown_timeout``, and only if the
#: node saw other nodes (a node alone stops at once).
LEAVE_WAIT = DEFAULT_HAND_OVER_WAIT  # the scheduler's hand_over_wait (--hand-over-wait) overrides it
#: Seconds until each guarded lock's next fire time on this node (the soonest of its jobs'; 0: a run
#: of it is due or going now; None: it has none, its jobs are paused or will never fire again); a
#: lock left out (its fire times are not known here) counts as due at once. The scheduler gives it
#: to :meth:`LeaseManager.hand_over_all`, so that a stopping node waits only for the fire times that need it.
NextFires = Callable[[], Mapping[str, "float | None"]]

#: A stopping node hands nothing over during its first this many seconds: the nodes stopping with
#: it (every worker of a gunicorn reload gets its signal at once) delete their presence meanwhile,
#: so none of them is named a successor.
LEAVE_SETTLE = 0.3

#: The longest a lock offered to a successor (:meth:`LockStore.hand_over`) waits for it, in seconds
#: (at most the lock's lease): then anyone may take it, so a successor that died strands nothing.
OFFER_WITHIN = 3.0


def _expired_holder(record: LockRecord | None, me: str) -> str | None:
    """The holder whose lease ran out, from the last record seen of a free lock (None: released,
    or offered to a node that never took it: no IP yet, see :meth:`LockStore.hand_over`)."""
    if record is None or record.holder in (None, me) or record.active_ip is None:
        return None
    return record.holder


@dataclass
class _Held:
    token: int
    deadline: float  # monotonic: the lease is ours until then, unless renewed
    since: float  # monotonic: when this unbroken hold began (a lapse and a new acquire start another)


class LeaseManager:
    """Tracks this node's leases and runs the heartbeat thread.

    Args:
        store: the lock store.
        node: this node.
        locks: lock name -> lease length in seconds, for every guarded lock of this scheduler.
        on_acquired: called from the heartbeat thread after it takes over a lock, with the
            lock name and the record as it was before the takeover.
        on_read: called with each record a standby's refresh reads (the missed-run alarm); must
            return at once.
        clock: monotonic clock for this node's own deadlines (injectable for tests).
        max_attrs_bytes: the largest attrs (as JSON) a run may store; larger ones raise AttrsError.
        emit: where lease and store events go (:mod:`mutexcron.events`; default: the log lines alone).
        zones: lock name -> the time zone this node computes the lock's fire times in (locks with
            cron or date jobs; see :meth:`zone_refusal`).
        triggers: lock name -> its jobs on this node and their triggers (``{job: trigger text}``),
            written with the zone on taking the lock and compared with the holder's by the others
            (:mod:`mutexcron.guard.agreement`).
        placement: which locks this node asks for (:mod:`mutexcron.placement`; default: every lock).
    """

    def __init__(
        self,
        store: LockStore,
        node: Node,
        locks: Mapping[str, float],
        *,
        on_acquired: Callable[[str, LockRecord | None], None] | None = None,
        on_read: Callable[[str, LockRecord | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_attrs_bytes: int | None = None,
        emit: Emit | None = None,
        zones: Mapping[str, str] | None = None,
        triggers: Mapping[str, Mapping[str, str]] | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.store = store
        self.placement: Placement = placement or FirstPlacement(node.node_id)
        self.emit: Emit = emit or log_event
        self.node = node
        self._locks = dict(locks)
        self.on_acquired = on_acquired
        self.on_read = on_read
        self.clock = clock
        self._stopping = False
        self._held: dict[str, _Held] = {}
        self._mutex = threading.Lock()
        self.handoff = AttrsHandOff(store, node, max_attrs_bytes)
        self.health = StoreHealth(store.masked_url, node.node_id, emit=self.emit)
        self._running: dict[str, int] = {}
        self.views = RecordViews()  # other holders' records: standbys' ticks need no store call
        self._idle = threading.Condition(self._mutex)
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and by participants
        self._rounds: list[Callable[[], float | None]] = []  # other users of the thread (task renewals)
        self._thread: threading.Thread | None = None
        self.last_round_ok: float | None = None  # monotonic: the last heartbeat round the store answered
        self.offset = ClockOffset()  # this node's wall clock against the store's, from records it reads
        self.sqlite_clocks = SQLiteClockCheck(store, self.node.node_id)  # SQLite: the others' clocks against ours
        self._paused: dict[str, bool] = {}  # lock -> paused, as this node last saw it
        self._presence_at: float | None = None  # monotonic: when this node last published its presence
        self._renewed_at: float | None = None  # monotonic: when this node last renewed its leases
        self._retiring: set[str] = set()  # locks to release once their running jobs end (remove_lock)
        self._letting_go: set[str] = set()  # of those, the locks whose record is forgotten then (let_go)
        self._gave_up: str | None = None  # why this node can run no guarded job any more (give_up)
        self._awaiting_hand_over = False  # a lock placed here is still held by another node
        self._handing: set[str] = set()  # locks being handed over: no run begins on them
        self._offered = threading.Event()  # a store notice: a lock was handed over to this node
        self._left = False  # this node's presence was deleted (it stops): it publishes none again
        self._leaving: float | None = None  # monotonic: since when this node hands every held lock over (it stops)
        self.offers = OfferListener(store, node.node_id, self._offer_noticed)
        self._listening = False  # the offers listener was started (once this node had a guarded lock)
        self._zones: dict[str, str] = dict(zones or {})  # lock -> the zone this node computes its fire times in
        self._zone_refused: dict[str, str] = {}  # lock -> the other zone its live holder computes them in
        self._triggers: dict[str, dict[str, str]] = {k: dict(v) for k, v in (triggers or {}).items()}
        self.agreement = Agreement(node.node_id)  # this node's jobs file against the holders' records
        self.node_id_check = SharedNodeId(node.node_id)  # another process with this node's id

    # -- state ---------------------------------------------------------------------------------
    @property
    def period(self) -> float:
        return max(0.05, min(self.locks().values(), default=10.0) / 3)

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` began: no guarded run starts any more."""
        return self._stopping

    def locks(self) -> dict[str, float]:
        """The guarded locks of this node: name -> lease length in seconds (a copy)."""
        with self._mutex:
            return dict(self._locks)

    def add_lock(self, name: str, ttl: float) -> None:
        """Guard one more lock (a job added after ``start()``); starts the thread if needed."""
        with self._mutex:
            self._locks.setdefault(name, ttl)
            self._retiring.discard(name)
        self.start()

    def remove_lock(self, name: str, *, let_go: bool = False) -> None:
        """Stop guarding ``name`` (its last job was removed, or a paused scheduler's shared job):
        release it if held, at once or when its running jobs end. ``let_go``: the lock of a
        finished one-off job; once this node released it, its record is forgotten too."""
        with self._mutex:
            if name not in self._locks:
                return
            if self._running.get(name):
                self._retiring.add(name)  # end_run releases it
                if let_go:
                    self._letting_go.add(name)
                return
            del self._locks[name]
            held = self._held.pop(name, None)
            self._paused.pop(name, None)
            self._zones.pop(name, None)
            self._triggers.pop(name, None)
            self._zone_refused.pop(name, None)
        self.views.forget(name)  # no view left to wake the thread for
        self.handoff.forget(name)
        if held is not None and self._release(name, held.token) and let_go:
            self._forget_record(name)

    def _forget_record(self, name: str) -> None:
        """The record of a finished one-off job's lock, just released by this node: forgotten (its
        token stays spent, see ``LockStore.forget``). A failure keeps it; `mutexcron forget` can."""
        try:
            outcome = self.store.forget(name)
        except (StoreUnavailableError, StoreError, NotImplementedError) as exc:
            log.info("the record of lock %r (a finished one-off job) is kept: %s", name, exc)
            return
        log.debug("the record of lock %r (a finished one-off job): %s", name, outcome)

    def _release(self, name: str, token: int, **details: Any) -> bool:
        try:
            if self.store.release(name, self.node, token):
                self._emit(EVENT_LOCK_RELEASED, name, token, **details)
                return True
        except (StoreUnavailableError, StoreError) as exc:
            log.warning("could not release lock %r (%s); it will expire after its lease", name, exc)
        return False

    def ttl(self, name: str) -> float:
        with self._mutex:
            return self._locks[name]

    def holds(self, name: str, token: int, since: float | None = None) -> bool:
        """True while this node holds ``name`` with ``token`` and its lease has not run out; with
        ``since`` (a run's monotonic start), only if the lease has not lapsed since then either: a
        run whose lease ran out records nothing, even once the same token is held again."""
        with self._mutex:
            held = self._held.get(name)
            if held is None or held.token != token or self.clock() >= held.deadline:
                return False
            return since is None or held.since <= since

    def holds_any(self, name: str) -> bool:
        """True while this node holds ``name`` with any token and its lease has not run out."""
        with self._mutex:
            held = self._held.get(name)
            return held is not None and self.clock() < held.deadline

    def held(self) -> dict[str, int]:
        """The leases this node holds now: name -> token."""
        now = self.clock()
        with self._mutex:
            return {n: h.token for n, h in self._held.items() if now < h.deadline}

    def _set_held(
        self, name: str, token: int, sent_at: float, ttl: float, previous: LockRecord | None, *, guarded_only: bool = False,
        reason: str | None = None,
    ) -> bool | None:
        """Record a held lease; True if this node just became the holder (then logs it once).

        ``guarded_only``: None, and nothing recorded, if no job guards ``name`` any more (its last
        job was removed while the acquire was in flight): the caller releases it.
        """
        with self._mutex:
            if guarded_only and (name not in self._locks or name in self._retiring):
                return None
            old = self._held.get(name)
            lapsed = old is not None and self.clock() >= old.deadline
            unbroken = old is not None and old.token == token and not lapsed
            self._held[name] = _Held(token, sent_at + ttl, old.since if old is not None and unbroken else sent_at)
        if old is not None and old.token == token and not lapsed:
            return False
        if old is not None and lapsed:
            # Held again after its lease ran out (a freeze, an outage), perhaps with the same token:
            # the loop may have looked meanwhile and found nothing held, so this wakes it like a new lock.
            self._emit(EVENT_LOCK_LOST, name, old.token, reason="no renewal within the lease; held again now")
        moved = {"moved": why} if (why := self.placement.move_reason(name)) else {}
        if previous is not None and previous.holder and previous.holder != self.node.node_id:
            self._emit(
                EVENT_LOCK_TAKEN_OVER,
                name,
                token,
                previous_holder=previous.holder,
                previous_ip=previous.active_ip,
                stale_for=previous.heartbeat_age or 0.0,
                **moved,
            )
        else:
            self._emit(EVENT_LOCK_ACQUIRED, name, token, **moved, **({"reason": reason} if reason else {}))
        return True

    def _emit(self, code: int, lock: str, token: int | None, **details: Any) -> None:
        self.emit(MutexEvent(code, lock=lock, node=self.node.node_id, token=token, **details))

    def _acquired(self, name: str, before: LockRecord | None) -> None:
        """A change of holder, by a tick or by the heartbeat thread: let the scheduler catch up."""
        if self.on_acquired is not None:
            try:
                self.on_acquired(name, before)
            except Exception:
                log.exception("catch-up after acquiring %r failed", name)

    def _drop(self, name: str, why: str, token: int | None = None, *, expired: bool = False) -> None:
        """Forget a lease: only the one with ``token`` (any if None), and with ``expired`` only if
        its deadline has really passed (a renewal may have landed since the caller looked)."""
        with self._mutex:
            old = self._held.get(name)
            if old is None or (token is not None and old.token != token):
                return
            if expired and self.clock() < old.deadline:
                return
            del self._held[name]
        self._emit(EVENT_LOCK_LOST, name, old.token, reason=why)

    # -- operations used by guarded jobs ----------------------------------------------------------
    def tick(self, name: str, claim: FireClaim | None) -> AcquireResult | None:
        """One atomic acquire-or-renew (with the fire claim). None if the store is unreachable.

        An ``uncertain`` answer (contention, unknown outcome) neither extends nor drops the lease.
        """
        with self._mutex:
            ttl = self._locks.get(name)
            if ttl is None or name in self._retiring:  # a run in flight of a job removed meanwhile
                return None
        sent_at = self.clock()
        held_before = self.holds_any(name)
        # Placed here but held elsewhere: a hand-over under way, so ask the store, not the view.
        if not held_before and not self.placement.placed_here(name, sent_at):
            elsewhere = self.views.held_elsewhere(name, sent_at)
            if elsewhere is not None:  # a standby that read the record a moment ago: no store call
                return AcquireResult(False, elsewhere)
            if not self.placement.asks(name, sent_at):  # placed on another node: it asks, not this one
                return self._read_placed_elsewhere(name)
        if claim is not None:
            self.node_id_check.sent(name, claim)
        wall = time.time()
        try:
            result = self.store.acquire_or_renew(name, self.node, ttl, claim)
        except (StoreUnavailableError, StoreError) as exc:
            self.health.report(False, exc)
            return None
        self.offset.observe(result.record, wall, time.time())
        self.health.report(True)
        self.views.seen(name, result.record, sent_at, self.clock(), self.node.node_id)
        self.observe_paused(name, result.record)
        self.observe_zone(name, result.record)
        if result.uncertain:
            log.info("lock %r: the store could not settle this acquire (contention); not counted", name)
        elif result.acquired:
            self.handoff.remember(name, result.token, result.record)
            if self._set_held(name, result.token, sent_at, ttl, None):
                self._write_zone(name, result.token, result.record)
                # Another job of the same lock group may have missed a fire time during the
                # failover; this job's own fire time is already claimed, so it is not repeated.
                self._acquired(name, result.record)
            elif held_before and claim is not None and not result.claimed and not result.record.paused:
                self.node_id_check.lost(name, claim, result.claimed_by, result.token)
        else:
            self._drop(name, f"held by {result.record.holder} (token {result.record.token})")
        return result

    def _read_placed_elsewhere(self, name: str) -> AcquireResult | None:
        """A tick of a free lock placed on another node: the record for ``lock_else``, no acquire
        (the heartbeat thread takes the lock over if its placed node does not)."""
        try:
            record = self.store.read(name)
        except (StoreUnavailableError, StoreError) as exc:
            self.health.report(False, exc)
            return None
        self.health.report(True)
        return AcquireResult(False, record or LockRecord(name))

    def claim_batch(self, claims: Sequence[HeldClaim]) -> set[str] | None:
        """One ``claim_many`` round trip for fire claims on locks this node holds.

        Renewed locks get a new deadline (send time + lease); locks no longer held with the token
        are dropped. Returns the nonces of the claims won, or None if the store is unreachable.
        """
        sent_at = self.clock()
        for item in claims:
            self.node_id_check.sent(item.lock, item.claim)
        try:
            result = self.store.claim_many(self.node, claims)
        except (StoreUnavailableError, StoreError) as exc:
            self.health.report(False, exc)
            return None
        self.health.report(True)
        tokens = {c.lock: c.token for c in claims}
        for lock in result.renewed:
            self._set_paused(lock, lock in result.paused, None)
        with self._mutex:
            for lock in result.renewed:
                held = self._held.get(lock)
                ttl = self._locks.get(lock)  # None: removed meanwhile (remove_lock drops its lease too)
                if held is not None and held.token == tokens.get(lock) and ttl is not None:
                    held.deadline = sent_at + ttl
        for lock in set(tokens) - set(result.renewed):
            self._drop(lock, "another node holds it now", tokens[lock])
        for item in claims:  # lost on a lock still held: by another writer with this node's id?
            if item.lock in result.renewed and item.lock not in result.paused and item.claim.nonce not in result.won:
                self.node_id_check.lost(item.lock, item.claim, result.lost_to.get(item.claim.nonce), item.token)
        return set(result.won)

    # -- time zones ----------------------------------------------------------------------------------
    def set_zone(self, name: str, zone: str | None, triggers: Mapping[str, str] | None = None) -> None:
        """The zone this node computes ``name``'s fire times in (None: they do not depend on one),
        and ``name``'s jobs on this node with their triggers (None: left as they are)."""
        with self._mutex:
            if zone is None:
                self._zones.pop(name, None)
            else:
                self._zones[name] = zone
            changed = triggers is not None and self._triggers.get(name) != dict(triggers)
            if triggers is not None:
                self._triggers[name] = dict(triggers)
            held = self._held.get(name) if changed else None
        if held is not None:  # a job added to a lock this node holds: its record names it at once
            try:
                self.store.set_zone(name, self.node, held.token, zone, triggers)
            except (NotImplementedError, StoreUnavailableError, StoreError):
                pass  # written again at the next acquisition

    def zone_refusal(self, name: str) -> str | None:
        """Why this node refuses ``name``'s jobs, or None: its live holder computes their fire times
        in another zone (the record says which), so the two nodes would name different instants."""
        with self._mutex:
            theirs, mine = self._zone_refused.get(name), self._zones.get(name)
        if theirs is None:
            return None
        return (
            f"lock {name!r}: its holder computes fire times in time zone {theirs}, this node "
            f"({self.node.node_id}) in {mine}; this node runs none of its jobs and does not take it over. "
            f"Give every node the same zone: timezone={theirs!r} (or the zone you mean) on the scheduler or on the job's trigger"
        )

    def observe_zone(self, name: str, record: LockRecord) -> None:
        """Compare a record's zone with this node's: one ERROR line when they start to differ while
        another node holds the lock, one INFO line when they agree again."""
        with self._mutex:
            mine = self._zones.get(name)
            other = record.holder is not None and record.holder != self.node.node_id
            theirs = record.zone if other and mine is not None and record.zone not in (None, mine) else None
            before = self._zone_refused.get(name)
            if theirs is None:
                self._zone_refused.pop(name, None)
            else:
                self._zone_refused[name] = theirs
        if theirs is not None and theirs != before:
            log.error("%s", self.zone_refusal(name))
        elif theirs is None and before is not None:
            log.info("lock %r: the time zones agree again (%s)", name, record.zone or mine)
        if other:  # the rest of the jobs file: the lease and the jobs' triggers (one WARNING per change)
            with self._mutex:
                lease, jobs = self._locks.get(name), self._triggers.get(name)
            self.agreement.check(record, lease, jobs, record.triggers)

    def _write_zone(self, name: str, token: int, record: LockRecord) -> None:
        """Just became the holder: record the zone this node computes the lock's fire times in, and
        the lock's jobs with their triggers (what the other nodes compare their jobs file with)."""
        with self._mutex:
            mine, jobs = self._zones.get(name), self._triggers.get(name) or None
        if (mine is None or record.zone == mine) and (jobs is None or record.triggers == jobs):
            return
        try:
            self.store.set_zone(name, self.node, token, mine if mine is not None else record.zone, jobs)
        except NotImplementedError:  # a store without zones (a test double): no zone rule
            return
        except (StoreUnavailableError, StoreError) as exc:
            log.warning("lock %r: could not record time zone %s (%s); written at the next acquisition", name, mine, exc)

    # -- pause ---------------------------------------------------------------------------------------
    def paused(self, name: str) -> bool:
        """True if this node last saw ``name`` paused (``mutexcron pause``)."""
        with self._mutex:
            return self._paused.get(name, False)

    def observe_paused(self, name: str, record: LockRecord) -> None:
        """Note the pause flag of a record the store returned; an event (and a log line) on a change."""
        self._set_paused(name, record.paused, record)

    def _set_paused(self, name: str, paused: bool, record: LockRecord | None) -> None:
        with self._mutex:
            before = self._paused.get(name)
            self._paused[name] = paused
        if paused is (before is True):  # no change (a first sight of "not paused" is none either)
            return
        if record is None:  # a batched claim says only "paused" or not: read who and why, once per change
            try:
                record = self.store.read(name)
            except (StoreUnavailableError, StoreError):
                record = None
        if paused:
            self._emit(EVENT_LOCK_PAUSED, name, None, paused_by=record.paused_by if record is not None else None)
        else:  # `mutexcron resume --catch-up` asks the holder for the catch-up runs itself (triggers)
            self._emit(EVENT_LOCK_RESUMED, name, None, catch_up=bool(record is not None and record.resume_catch_up),
                       paused_by=record.paused_by if record is not None else None)  # who resumed it

    def begin_run(self, name: str) -> bool:
        """Count a guarded run as started, from before its store call to its hand-off.

        Returns False (and counts nothing) once :meth:`stop` began, so a stop never releases a
        lease under a tick that is still in flight.
        """
        with self._mutex:
            if self._stopping or name in self._handing:
                return False
            self._running[name] = self._running.get(name, 0) + 1
            return True

    def pin(self, names: Collection[str]) -> set[str]:
        """Of ``names``, those this node holds now, each counted as running until :meth:`unpin`: no
        hand-over, release or stop lets it go meanwhile (none once :meth:`stop` began).

        A shared job store's loop pass pins the locks whose due jobs it reads: it writes their next
        run times before their runs claim. A lock handed over in between would let the successor
        see the old next run time (due: its loop's to run, no catch-up) and then the giver move it
        past a fire time that neither node runs."""
        now = self.clock()
        with self._mutex:
            if self._stopping:
                return set()
            pinned = {n for n in names if (h := self._held.get(n)) is not None and now < h.deadline and n not in self._handing}
            for name in pinned:
                self._running[name] = self._running.get(name, 0) + 1
        return pinned

    def unpin(self, names: Collection[str]) -> None:
        for name in names:
            self.end_run(name)

    def end_run(self, name: str) -> None:
        with self._mutex:
            self._running[name] -= 1
            if not self._running[name]:
                del self._running[name]
            self._idle.notify_all()
            retire = name in self._retiring and name not in self._running
            let_go = retire and name in self._letting_go
            if retire:
                self._retiring.discard(name)
                self._letting_go.discard(name)
        if retire:
            self.remove_lock(name, let_go=let_go)

    # -- attrs -------------------------------------------------------------------------------------
    def attrs(self, name: str, token: int) -> dict[str, Any]:
        """The attrs stored under ``token`` as this node knows them (a copy; {} if unknown)."""
        return self.handoff.attrs(name, token)

    def checkpoint(
        self, name: str, token: int, seen: set[str], attrs: Mapping[str, Any], job: str, started: float | None = None
    ) -> bool:
        """Store attrs during a run, conditional on holder and token (``Lease.save``); never once the
        lease lapsed after ``started`` (the run's monotonic start)."""
        self.handoff.check(attrs, job)  # bad attrs raise before any write
        if not self.holds(name, token, started):
            return False
        try:
            saved = self.handoff.write(name, token, seen, attrs, None, job)
        except (StoreUnavailableError, StoreError) as exc:
            log.warning("checkpoint of lock %r not saved: %s", name, exc)
            return False
        if not saved:
            self._drop(name, "taken over during a run", token)
        else:
            seen.update(attrs)
        return saved

    def finish(
        self, name: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, run: RunInfo, job: str,
        started: float | None = None,
    ) -> bool:
        """Save a run's attrs and run info, conditional on holder and token; nothing if the lease
        lapsed after ``started`` (the run's monotonic start), even if it is held again now.

        Retries while the lease is still ours if the store is briefly unreachable, so a result
        is not lost to a blip; never longer than one lease. Returns True if saved.
        """
        if self._lapsed_during(name, token, started, job):
            return False
        delay, give_up = 0.2, self.clock() + self.ttl(name)
        while True:
            try:
                if self.handoff.write(name, token, seen, attrs, run, job):
                    return True
                log.warning(
                    "job %r finished after lock %r (token %d) passed to another node: its attrs and run info "
                    "were NOT saved, the new holder's state is kept",
                    job,
                    name,
                    token,
                )
                self._drop(name, "taken over during a run", token)
                return False
            except StoreUnavailableError as exc:
                if not self.holds(name, token) or self._stop.is_set() or self.clock() + delay > give_up:
                    log.error("job %r: could not save attrs of lock %r (%s); the previous attrs are kept", job, name, exc)
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except StoreError as exc:  # the request itself was refused: retrying cannot help
                log.error("job %r: the store refused the attrs of lock %r (%s); the previous attrs are kept", job, name, exc)
                return False

    def finish_later(
        self, name: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, run: RunInfo, job: str,
        then: Callable[[bool], None], started: float | None = None,
    ) -> None:
        """:meth:`finish` without waiting: the hand-off is queued (the next batch of the node's
        hand-offs carries it) and ``then(saved)`` is called from the hand-off thread once it is
        settled, with the same retries, log lines and lease drop as :meth:`finish`. A retry waits
        on a timer, never on the hand-off thread. Raises AttrsError before queuing.
        """
        if self._lapsed_during(name, token, started, job):
            then(False)
            return
        give_up = self.clock() + self.ttl(name)

        def settle(queued: Queued, delay: float) -> Callable[[bool, BaseException | None], None]:
            def settled(written: bool, error: BaseException | None) -> None:
                if error is None:
                    if not written:
                        log.warning("job %r finished after lock %r (token %d) passed to another node: its attrs and "
                                    "run info were NOT saved, the new holder's state is kept", job, name, token)  # fmt: skip
                        self._drop(name, "taken over during a run", token)
                    then(written)
                elif isinstance(error, StoreUnavailableError) and self.holds(name, token) and not self._stop.is_set() \
                        and self.clock() + delay <= give_up:  # fmt: skip
                    retry = threading.Timer(delay, self.handoff.resend, (queued, settle(queued, min(delay * 2, 2.0))))
                    retry.daemon = True
                    retry.start()
                else:
                    self.handoff.abandon(queued)
                    unreachable = isinstance(error, StoreUnavailableError)
                    what = "could not save attrs of" if unreachable else "the store refused the attrs of"
                    log.error("job %r: %s lock %r (%s); the previous attrs are kept", job, what, name, error)
                    then(False)

            return settled

        self.handoff.write_later(name, token, seen, attrs, run, job, lambda queued: settle(queued, 0.2))

    def _lapsed_during(self, name: str, token: int, started: float | None, job: str) -> bool:
        """True (and said) if the lease of a run that began at ``started`` lapsed since: its end is not recorded."""
        if started is None or self.holds(name, token, started):
            return False
        log.warning(
            "job %r: the lease of lock %r (token %d) lapsed during the run: its attrs and run info are NOT saved, "
            "even if this node holds the lock again",
            job,
            name,
            token,
        )
        return True

    # -- the heartbeat thread -------------------------------------------------------------------
    def start(self) -> None:
        with self._mutex:
            thread = None
            if self._thread is None and (self._locks or self._rounds) and not self._stop.is_set():
                thread = self._thread = threading.Thread(target=self._loop, name="mutexcron-heartbeat", daemon=True)
            # Only placement hands locks over to a named node, and only a node with guarded locks
            # listens for offers (a node running tasks alone does not poll the live nodes).
            listen = self.placement.mode != "first" and bool(self._locks) and not self._listening and not self._stop.is_set()
            self._listening = self._listening or listen
        if thread is not None:
            thread.start()
        if listen:
            self.offers.start()

    def attach(self, round_: Callable[[], float | None]) -> None:
        """Run ``round_`` in every heartbeat round (the task worker's renewals); it returns the
        seconds until it needs the next round, or None. Starts the thread if needed."""
        with self._mutex:
            self._rounds.append(round_)
        self.start()

    def wake(self) -> None:
        """Run a round now (a participant needs one sooner than planned)."""
        self._wake.set()

    def _offer_noticed(self) -> None:
        """The store says a lock was handed over to this node (or a node left): read and take it now."""
        self._offered.set()
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            wait = self.run_once()
            self._wake.wait(wait)
            self._wake.clear()

    def run_once(self) -> float:
        """One heartbeat round; returns how long to wait before the next one."""
        if self.locks():
            self._lock_round()
        wait = self._run_participants()
        if not self.locks():
            return wait
        if self.health.up is False:
            return min(wait, self.health.backoff(self.period, holding=bool(self.held())))
        return min(wait, self._next_round())

    def _lock_round(self) -> None:
        try:
            if self._gave_up is not None:
                self._release_all(self.held(), self.running(), quiet=True)
            self._renew()
            # An offer noticed (or a node gone): the live nodes are read again now, not in a second.
            self.placement.refresh(self.store, self.locks(), self.clock(), force=self._offered.is_set())
            if self._leaving is not None and not self._stopping:
                self._hand_over_leaving()
            elif not self._stopping:
                self._hand_over_surplus()
                self._take_over()
            self.health.report(True)
            self.last_round_ok = self.clock()
        except (StoreUnavailableError, StoreError) as exc:
            self.health.report(False, exc)
        except Exception:  # never let the heartbeat thread die
            log.exception("heartbeat round failed")
        self._expire()

    def _run_participants(self) -> float:
        wait = 10.0
        for round_ in list(self._rounds):
            try:
                want = round_()
            except Exception:  # never let the heartbeat thread die
                log.exception("heartbeat participant failed")
                want = 1.0
            if want is not None:
                wait = min(wait, want)
        return max(0.0, wait)

    def _next_round(self) -> float:
        """Renew every lease/3; with locks held elsewhere, also refresh their view every second and
        wake up the moment a viewed lease runs out, to take it over then."""
        wait = self.period
        if self._leaving is not None:
            return HAND_OVER_POLL
        if len(self.held()) < len(self.locks()):
            wait = min(wait, HAND_OVER_POLL if self._awaiting_hand_over else STANDBY_REFRESH)
            expiry = self.views.next_expiry(self.clock())
            if expiry is not None:
                wait = min(wait, expiry + 0.005)
        return max(0.0, wait)

    def _renew(self) -> None:
        """Renew every held lease in one round trip, once per period: a round that comes sooner (a
        standby's refresh every second) renews nothing unless the presence is due."""
        leases = self.held()
        renewal_due = bool(leases) and self._renewal_due()
        presence = self._presence(renewal_due)
        if not renewal_due and presence is None:
            return
        sent_at = self.clock()
        renewed = self.store.renew_many(self.node, leases, presence=presence)
        self._renewed_at = sent_at
        if presence is not None:
            self._presence_at = sent_at
            self.sqlite_clocks.maybe_check()
        with self._mutex:
            for name in renewed:
                held = self._held.get(name)
                ttl = self._locks.get(name)  # None: removed meanwhile
                if held is not None and held.token == leases[name] and ttl is not None:
                    held.deadline = sent_at + ttl
        for name in set(leases) - renewed:
            self._drop(name, "another node holds it now", leases[name])

    def _renewal_due(self) -> bool:
        """True once a period has passed since the last renewal (a little before: rounds are not
        exact), or a held lease has less than two periods left."""
        now, period = self.clock(), self.period
        if self._renewed_at is None or now - self._renewed_at >= period * RENEW_EARLY:
            return True
        with self._mutex:
            return any(h.deadline - now < 2 * period for h in self._held.values())

    def _presence(self, renewing: bool) -> Presence | None:
        """This node's presence, published with every renewal, and every PRESENCE_EVERY s otherwise
        (every lease/3 under balanced placement, which judges a node live by its presence)."""
        every = PRESENCE_EVERY if self.placement.mode == "first" else self.period
        due = self._presence_at is None or self.clock() - self._presence_at >= every
        if self._left or (not renewing and not due):
            return None
        return Presence(__version__, self.offset.value, traits=self.placement.traits)

    def _take_over(self) -> None:
        held = self.held()
        locks = self.locks()
        with self._mutex:
            wanted = [n for n in locks if n not in held and n not in self._retiring]
        if not wanted:
            return
        due, unknown = self.views.stale(wanted, self.clock())
        now = self.clock()
        if self._offered.is_set():  # a store notice: a lock was offered here, read every one not held
            self._offered.clear()
            unknown += [n for n in wanted if n not in due and n not in unknown]
        else:
            unknown = self._without_recent_elsewhere(unknown)
        # A lock placed here that another node holds: read again each round, and rounds come every
        # HAND_OVER_POLL seconds, until it is handed over (a hand-over is noticed before the next fire time).
        looked_at = {*due, *unknown}
        awaited = [n for n in wanted if n not in looked_at and self.placement.placed_here(n, now)]
        unknown += awaited
        before = {name: self.views.record(name) for name in due}
        if unknown:
            sent, wall = self.clock(), time.time()
            records = self.store.read_many(unknown)
            received, wall_received = self.clock(), time.time()
            # One round trip is one clock sample: its records all say the same store time.
            self.offset.observe(next((r for r in records.values() if r.update_time is not None), None), wall, wall_received)
            for name in unknown:
                record = records.get(name)
                if record is not None:
                    self.observe_paused(name, record)
                    self.observe_zone(name, record)
                if self.on_read is not None:
                    self.on_read(name, record)
                self.views.seen(name, record, sent, received, self.node.node_id)
                if record is None or record.state != "active" or record.holder == self.node.node_id:
                    due.append(name)
                    before[name] = record
        # Counted after the reads too: a lock read now for the first time, held by another node, is
        # awaited from the next round on (not only from the round after its view was made).
        now = self.clock()
        self._awaiting_hand_over = any(n not in due and self.placement.placed_here(n, now) for n in unknown)
        # A lock handed over to this node: its record names it already, it only has to take it.
        offered = {n for n in due if (r := before.get(n)) is not None and r.holder == self.node.node_id and r.state == "active"}
        free = {name: _expired_holder(before.get(name), self.node.node_id) for name in due if name not in offered}
        asked = set(self.placement.to_take(self.store, free, self.clock())) | offered
        for name in [n for n in due if n in asked]:
            if self._stopping:
                return
            with self._mutex:
                refused = name in self._zone_refused
            if not refused:  # a node in another zone than the lock's holder never takes it over
                self._try_take_over(name, locks[name], before.get(name), "handed over to this node" if name in offered else None)

    def _without_recent_elsewhere(self, unknown: list[str]) -> list[str]:
        """``unknown`` without the records placed on other nodes while none of them is due.

        A record placed on another node is read every lease/3, not every second: only its expiry
        matters here, and its view wakes the round when the lease runs out. They are read all
        together, in one round trip per lease/3, rather than each when its own view ages.
        """
        now = self.clock()
        elsewhere = [n for n in unknown if self.placement.placed_elsewhere(n, now)]
        unseen, recent = self.views.read_within(elsewhere, self.period, now)
        if not elsewhere or not recent:
            return unknown
        skipped = set(elsewhere) - set(unseen)  # a free one has no view: read each round, as any other
        return [n for n in unknown if n not in skipped]

    def _hand_over_surplus(self) -> None:
        """Hand the held locks placed on another live node over to it, each at a fire-time
        boundary: once no run of it is going (its hand-off written), and no run begins meanwhile."""
        if not self.placement.surplus(self.held(), self.clock()):
            return
        # Moves are rare: the live nodes are read again first, so that a lock is never offered to a
        # node that has just left (or that is stopping: its presence goes first).
        self.placement.refresh(self.store, self.locks(), self.clock(), force=True)
        self._move(self.placement.surplus(self.held(), self.clock()), "placement rebalanced")

    def _hand_over_leaving(self) -> None:
        """A stopping node: hand each held lock to the node placed for it without this one (the
        live nodes read again each round), each at a fire-time boundary; keep the others."""
        held = self.held()
        if held and self._leaving is not None and self.clock() - self._leaving >= LEAVE_SETTLE:
            self._move(self.placement.successors(self.store, list(held), self.clock()), "this node stops")

    def _move(self, moves: Mapping[str, str], reason: str) -> None:
        """Hand each lock of ``moves`` (lock -> successor) over, once no run of it is going."""
        for name, successor in list(moves.items())[:MOVES_PER_ROUND]:
            with self._mutex:
                held = self._held.get(name)
                if held is None or self._running.get(name) or name in self._retiring:
                    continue
                del self._held[name]
                self._handing.add(name)
            self.views.forget(name)
            why = self.placement.move_reason(name)  # why placement moved it (n3 joined, n1 left...)
            self._hand_over(name, held.token, successor, f"{reason}: {why}" if why and why != "rebalanced" else reason)

    def _hand_over(self, name: str, token: int, successor: str, reason: str) -> None:
        """Offer a lock this node gives up to ``successor`` (one fenced store write; the lock's
        record keeps its last claimed fire times); a store that cannot offer releases it."""
        try:
            within = min(self.locks().get(name, OFFER_WITHIN), OFFER_WITHIN)
            if self.store.hand_over(name, self.node, token, successor, within):
                self._emit(EVENT_LOCK_RELEASED, name, token, successor=successor, reason=reason)
        except NotImplementedError:
            self._release(name, token)
        except (StoreUnavailableError, StoreError) as exc:
            log.warning("could not hand lock %r over to %s (%s); it will expire after its lease", name, successor, exc)
        finally:
            with self._mutex:
                self._handing.discard(name)

    def _try_take_over(self, name: str, ttl: float, before: LockRecord | None, reason: str | None = None) -> None:
        sent_at, wall = self.clock(), time.time()
        result = self.store.acquire_or_renew(name, self.node, ttl)
        self.offset.observe(result.record, wall, time.time())
        self.views.seen(name, result.record, sent_at, self.clock(), self.node.node_id)
        if not result.acquired:
            return
        self.handoff.remember(name, result.token, result.record)
        became = self._set_held(name, result.token, sent_at, ttl, before, guarded_only=True, reason=reason)
        if became is None:
            # Its last job was removed while the acquire was in flight: nothing here guards it any
            # more, so it is not kept (it would be renewed with no job, and never released).
            self.handoff.forget(name)
            self._release(name, result.token)
        elif became:
            self._write_zone(name, result.token, result.record)
            self._acquired(name, before)

    def _expire(self) -> None:
        now = self.clock()
        with self._mutex:
            expired = [n for n, h in self._held.items() if now >= h.deadline]
        for name in expired:
            self._drop(name, "no successful renewal within the lease; this node demotes itself", expired=True)

    # -- stopping ---------------------------------------------------------------------------------
    def hand_over_all(self, timeout: float, next_fires: NextFires | None = None) -> None:
        """Before a stop, under balanced placement: this node leaves (its presence goes), hands each
        held lock over to the node placed for it without this one, at a fire-time boundary, and
        runs the jobs of the locks not handed over yet meanwhile (a gunicorn reload's new workers
        may still be booting). Returns once it holds none, or after ``timeout`` seconds (the rest
        are released by :meth:`stop`); at once if its last read of the live nodes showed no other.

        With ``next_fires``, it waits only for the fire times that need it: a held lock none of whose
        jobs fires within the wait is released at once (its record kept: whoever takes it later
        computes its next fire time from it), and it returns as soon as no held lock has a fire time
        left within the wait (every node stopping at once waits for nothing)."""
        if self.placement.mode == "first" or not self.held() or not self.placement.others_seen():
            return  # a node alone does not wait for a successor
        with self._mutex:
            self._leaving = self.clock()
        self._leave()
        self.wake()
        deadline = self.clock() + max(0.0, timeout)
        recheck_at = self.clock()
        while self.held() and self.clock() < deadline:
            if next_fires is not None and self.clock() >= recheck_at:
                due = self._release_unless_due(next_fires, deadline)
                if not due:
                    return
                # Read again once the soonest fire time has passed (its run done, the next one known).
                recheck_at = max(min(due.values()), self.clock() + HAND_OVER_POLL)
            if self._stop.wait(0.05):
                return

    def _release_unless_due(self, next_fires: NextFires, deadline: float) -> dict[str, float]:
        """A stopping node: release at once each held lock with no fire time before ``deadline``
        (this node's clock); returns the others: lock -> when (this node's clock) its next fire time is."""
        try:
            fires = next_fires()
        except Exception:  # never stop differently because of it: wait for every lock, as without it
            log.exception("could not read the next fire times; waiting for a successor for every lock")
            fires = {}
        now = self.clock()
        due: dict[str, float] = {}
        for name in self.held():
            seconds = fires.get(name, 0.0)
            if seconds is not None and now + seconds < deadline:
                due[name] = now + max(0.0, seconds)
        self._release_now([name for name in self.held() if name not in due], "this node stops; no fire time due before then")
        return due

    def _release_now(self, names: Sequence[str], reason: str) -> None:
        """Release each of ``names`` (no successor named), once no run of it is going, and no run
        begins meanwhile; a lock with a run going is kept (:meth:`stop` releases it after the run)."""
        for name in names:
            with self._mutex:
                held = self._held.get(name)
                if held is None or self._running.get(name) or name in self._handing or name in self._retiring:
                    continue
                del self._held[name]
                self._handing.add(name)
            self.views.forget(name)
            try:
                self._release(name, held.token, reason=reason)
            finally:
                with self._mutex:
                    self._handing.discard(name)

    def begin_stop(self) -> None:
        """No takeover and no new guarded run from now on; leases (and attached rounds) are still
        renewed until :meth:`stop`. This node's presence goes at once: the others place its locks
        on themselves and watch them, to take each the moment it is handed over."""
        with self._mutex:
            self._stopping = True
        self._leave()

    def _leave(self) -> None:
        with self._mutex:
            if self._left:
                return
            self._left = True
        self.placement.leave(self.store)

    def stop(self, timeout: float) -> None:
        """Stop takeovers, wait up to ``timeout`` s for running guarded jobs, release leases, stop.

        Runs count from before their store call, so a tick in flight is waited for, and its
        lease is released with the others.
        """
        deadline = self.clock() + max(0.0, timeout)
        self.begin_stop()
        with self._idle:
            while self._running and self.clock() < deadline:
                self._idle.wait(min(0.5, max(0.01, deadline - self.clock())))
            busy = dict(self._running)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=15)  # longer than one store operation's timeout
        self.offers.close()
        held = {**self._offered_here(), **self.held()}
        successors = self.placement.successors(self.store, [n for n in held if n not in busy], self.clock())
        self._release_all(held, busy, successors)
        with self._mutex:
            self._held.clear()
        self.handoff.batcher.close()

    def _offered_here(self) -> dict[str, int]:
        """A stopping node: the locks offered to it that it has not taken (name -> the offer's
        token), so that it passes them on instead of letting them lapse."""
        if self.placement.mode == "first":  # only placement offers locks
            return {}
        with self._mutex:
            wanted = [n for n in self._locks if n not in self._held]
        try:
            records = self.store.read_many(wanted) if wanted else {}
        except (StoreUnavailableError, StoreError):
            return {}
        me = self.node.node_id
        return {n: r.token for n, r in records.items() if r.holder == me and r.active_ip is None and r.state == "active"}

    def _release_all(
        self, held: Mapping[str, int], busy: Mapping[str, int], successors: Mapping[str, str] | None = None, *,
        quiet: bool = False,
    ) -> None:
        """Release the leases in ``held``, each handed over to its node in ``successors`` if it has
        one, except those with a guarded run still going (``busy``; said once at a stop, ``quiet``
        when given up: asked again every round until the run ends)."""
        for name, token in held.items():
            if name in busy:
                if quiet:
                    continue
                log.warning(
                    "not releasing lock %r: a job is still running after the shutdown timeout; the lease will expire on its own",
                    name,
                )
                continue
            successor = (successors or {}).get(name)
            if successor is None:
                self._release(name, token)
            else:
                self._hand_over(name, token, successor, "this node stops")
            with self._mutex:
                if name in self._held and self._held[name].token == token:
                    del self._held[name]

    def give_up(self, reason: str) -> None:
        """This node can run no guarded job any more (its scheduler loop died): no takeover and no
        new run from now on, its leases are released by the heartbeat thread (each once its running
        job, if any, has ended), and :meth:`unhealthy` says ``reason``."""
        with self._mutex:
            self._stopping = True
            self._gave_up = reason
        self.wake()

    @property
    def clock_offset(self) -> float | None:
        """This node's wall clock minus the store's clock, in seconds (None until a record was read)."""
        return self.offset.value

    def unhealthy(self) -> str | None:
        """Why this node cannot be trusted to run guarded jobs now, or None if it can: the store
        is unreachable, the heartbeat thread is not running, or no round succeeded for 3 periods."""
        if self._gave_up is not None:
            return self._gave_up
        if self.health.up is False:
            return f"lock store {self.store.masked_url} is unreachable"
        if self.locks() and (self._thread is None or not self._thread.is_alive()):
            return "the heartbeat thread is not running"
        if self.locks() and self.last_round_ok is not None:
            late = self.clock() - self.last_round_ok
            if late > 3 * self.period + 1.0:
                return f"no heartbeat round succeeded for {late:.1f}s (every {self.period:.1f}s expected)"
        return None

    def running(self) -> dict[str, int]:
        with self._mutex:
            return dict(self._running)
