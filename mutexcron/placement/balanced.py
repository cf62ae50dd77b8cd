"""``balanced`` placement: every live node asks for its fair share of the locks, and only those.

The live nodes are the presence records the nodes already write with their renewals (read at
most once a second), younger than the shortest lease plus a second. A holder whose lease ran out
is not placed until it publishes its presence again, so the survivors agree at once on who takes
each of its locks. A lock placed on another
node that stays free longer than :data:`FREE_GRACE` is taken anyway (its placed node may not
guard it, or cannot take it): placement never costs availability.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping

from ..errors import StoreError, StoreUnavailableError
from ..locks import LockStore
from ..node import NodeTraits
from .base import Restrictions
from .rendezvous import assign, shares

log = logging.getLogger(__name__)

#: Seconds between two reads of the live nodes.
NODES_EVERY = 1.0
#: A lock released and placed on another node makes the nodes be read again if they were read
#: longer ago than this (a node that stops deletes its presence, then releases its locks).
NODES_FRESH = 0.1
#: A node whose presence is older than its shortest lease plus this (by the store's clock) is not
#: placed: under balanced placement every node publishes its presence at least every lease/3.
LIVE_MARGIN = 1.0
#: Seconds a lock placed on another node may stay free before this node takes it anyway: longer
#: than the placed node needs to notice (its view of the record is trusted for a second, its
#: nodes are read every second).
FREE_GRACE = 3.0
#: Seconds a lock taken that way is kept before placement may move it again (no back and forth
#: with a placed node that does not take it).
KEEP_AFTER_GRACE = 60.0
#: Seconds the reason of a move is kept for the log line of the acquire or hand-over that makes it.
REASON_KEPT = 30.0


class BalancedPlacement(Restrictions):
    """Rendezvous placement over the live nodes (see :mod:`mutexcron.placement.rendezvous`)."""

    mode = "balanced"

    def __init__(self, node_id: str, traits: NodeTraits | None = None) -> None:
        super().__init__(node_id, traits)
        self._mutex = threading.Lock()
        self._read_at: float | None = None  # monotonic: the last read of the live nodes
        self._seen: dict[str, float] = {}  # live node id -> its presence's age at the read
        self._gone: dict[str, float] = {}  # holder whose lease ran out -> monotonic time noticed
        self._locks: frozenset[str] = frozenset()
        self._placed_over: frozenset[str] = frozenset()  # the nodes of the current placement
        self._traits: dict[str, NodeTraits] = {node_id: self.traits}  # live node -> its weight and tags, as last read
        self._placed_traits: dict[str, NodeTraits] = {}  # the traits of the current placement
        self._reasons: dict[str, str] = {}  # lock -> why it moved at the last change of placement (said once)
        self._reasons_at = 0.0  # monotonic: when they were found
        self._owners: dict[str, str | None] = {}
        self._free_since: dict[str, tuple[float, float]] = {}  # lock -> (first, last) seen free, without a gap
        self._kept: dict[str, float] = {}  # lock -> monotonic time until it is kept here anyway
        self._leases: dict[str, float] = {}  # lock -> lease, as last refreshed

    # -- reading the nodes ---------------------------------------------------------------------
    def refresh(self, store: LockStore, locks: Mapping[str, float], now: float, *, force: bool = False) -> None:
        self._leases = dict(locks)
        if force or self._read_at is None or now - self._read_at >= NODES_EVERY:
            try:
                presences = store.nodes(prune=False)
            except NotImplementedError:  # a store that keeps no presence: this node alone is known
                presences = []
            with self._mutex:
                self._read_at = now
                live_within = min(locks.values(), default=10.0) + LIVE_MARGIN
                self._seen = {p.node_id: p.age or 0.0 for p in presences if (p.age or 0.0) <= live_within}
                self._traits = {p.node_id: p.traits for p in presences if p.node_id in self._seen}
                self._traits[self.node_id] = self.traits
                self._tags = {node_id: traits.tags for node_id, traits in self._traits.items()}
                # A holder noticed gone that has published its presence since is back.
                self._gone = {n: at for n, at in self._gone.items() if n in self._seen and self._seen[n] >= now - at}
        with self._mutex:
            self._place(frozenset(locks), now)

    def _live(self) -> frozenset[str]:
        return frozenset(n for n in self._seen if n not in self._gone) | {self.node_id}

    def _place(self, locks: frozenset[str], now: float) -> None:
        """Recompute the owners if the locks, the live nodes or their weights and tags changed; log
        the change once, and keep why each lock moved (:meth:`move_reason`)."""
        live = self._live()
        traits = {n: self._traits.get(n, NodeTraits()) for n in live}
        if locks == self._locks and live == self._placed_over and traits == self._placed_traits:
            return
        joined, left = sorted(live - self._placed_over), sorted(self._placed_over - live)
        expired = [n for n in left if n in self._gone]
        before = self._owners
        self._owners = assign(locks, live, self.allows, {n: t.weight for n, t in traits.items()})
        nodes_changed = live != self._placed_over
        traits_changed = bool(self._placed_traits) and any(self._placed_traits.get(n, t) != t for n, t in traits.items())
        first = not self._placed_over  # this node's own start: its moves are the others' to log
        self._reasons = {} if first else self._moves(before, live, joined, left, expired)
        self._reasons_at = now
        self._locks, self._placed_over, self._placed_traits = locks, live, traits
        if nodes_changed or traits_changed:
            mine = sum(1 for owner in self._owners.values() if owner == self.node_id)
            log.info(
                "placement: %d live node(s)%s%s%s%s; this node is placed for %d of %d lock(s) (weight %g); %d lock(s) move",
                len(live),
                f"; joined: {', '.join(joined)}" if joined else "",
                f"; left: {', '.join(n for n in left if n not in expired)}" if len(left) > len(expired) else "",
                f"; lease ran out: {', '.join(expired)}" if expired else "",
                "; weights or tags changed: rebalanced" if traits_changed else "",
                mine,
                len(locks),
                self.traits.weight,
                sum(1 for lock, owner in self._owners.items() if before.get(lock) not in (None, owner)),
            )

    def _moves(
        self, before: Mapping[str, str | None], live: Collection[str], joined: list[str], left: list[str], expired: list[str]
    ) -> dict[str, str]:
        """Why each lock moved, for the node that logs the move: the one that hands it over, or the
        one that takes it when its last node is gone (left, or its lease ran out)."""
        reasons = {}
        for lock, owner in self._owners.items():
            was = before.get(lock)
            if was is None or owner == was:
                continue
            if was == self.node_id or (owner == self.node_id and was not in live):
                reasons[lock] = _why_moved(was, owner, joined, left, expired)
        return reasons

    # -- decisions -----------------------------------------------------------------------------
    def asks(self, lock: str, now: float) -> bool:
        with self._mutex:
            if not self.allows(lock, self.node_id):
                return False
            if self._read_at is None:  # the nodes not read yet (the store was down at start): ask, rebalance later
                return True
            return self._owners.get(lock) == self.node_id or self._kept.get(lock, 0.0) > now

    def placed_here(self, lock: str, now: float) -> bool:
        with self._mutex:
            if self._read_at is None or not self.allows(lock, self.node_id):
                return False
            return self._owners.get(lock) == self.node_id or self._kept.get(lock, 0.0) > now

    def placed_elsewhere(self, lock: str, now: float) -> bool:
        with self._mutex:
            owner = self._owners.get(lock)
            return self._read_at is not None and owner not in (None, self.node_id) and self._kept.get(lock, 0.0) <= now

    def to_take(self, store: LockStore, free: Mapping[str, str | None], now: float) -> list[str]:
        with self._mutex:
            released = [lock for lock, holder in free.items() if holder is None and lock not in self._free_since]
            elsewhere = any(self._owners.get(lock) not in (None, self.node_id) for lock in released)
            stale = self._read_at is not None and now - self._read_at > NODES_FRESH
        if elsewhere and stale:  # released by a node that may have left since the nodes were read: read them again
            self.refresh(store, self._leases, now, force=True)
        with self._mutex:
            for holder in free.values():
                if holder is not None and holder != self.node_id:
                    self._gone.setdefault(holder, now)
            self._place(self._locks, now)
            self._free_since = {lock: self._free_from(lock, now) for lock in free}
            wanted = []
            for lock in free:
                if not self.allows(lock, self.node_id):
                    continue
                owner = self._owners.get(lock)
                if owner == self.node_id or self._kept.get(lock, 0.0) > now:
                    wanted.append(lock)
                elif now - self._free_since[lock][0] >= FREE_GRACE:
                    free_for = now - self._free_since[lock][0]
                    log.info("lock %r: placed on %s but free for %.1fs; this node takes it", lock, owner, free_for)
                    self._kept[lock] = now + KEEP_AFTER_GRACE
                    wanted.append(lock)
            return wanted

    def _free_from(self, lock: str, now: float) -> tuple[float, float]:
        """(since when, last seen) ``lock`` has been free, counting only an unbroken stretch."""
        first, last = self._free_since.get(lock, (now, now))
        if now - last > 2 * NODES_EVERY:  # not seen free in between: a new stretch
            first = now
        return first, now

    def surplus(self, held: Collection[str], now: float) -> dict[str, str]:
        with self._mutex:
            if self._read_at is None:
                return {}
            self._kept = {lock: until for lock, until in self._kept.items() if until > now}
            moves = {}
            for lock in held:
                owner = self._owners.get(lock)
                if owner is not None and owner != self.node_id and lock not in self._kept:
                    moves[lock] = owner
            return moves

    def successors(self, store: LockStore, held: Collection[str], now: float) -> dict[str, str]:
        try:
            self.refresh(store, self._leases, now, force=True)
        except (StoreUnavailableError, StoreError) as exc:
            log.info("could not read the live nodes (%s); the locks are handed over as last placed", exc)
        with self._mutex:
            others = self._live() - {self.node_id}
            owners = assign(self._locks, others, self.allows) if others else {}
        return {lock: owner for lock in held if (owner := owners.get(lock)) is not None}

    def others_seen(self) -> bool:
        with self._mutex:
            return any(node != self.node_id for node in self._seen)

    def leave(self, store: LockStore) -> None:
        try:
            store.forget_node(self.node_id)
        except (StoreUnavailableError, StoreError, NotImplementedError) as exc:
            log.info("could not delete this node's presence (%s); the others place its locks when it ages out", exc)

    def shares(self) -> dict[str, int]:
        with self._mutex:
            return shares(self._owners)

    def nodes_traits(self) -> dict[str, NodeTraits]:
        with self._mutex:
            return {n: self._traits.get(n, NodeTraits()) for n in sorted(self._live())}

    def move_reason(self, lock: str) -> str | None:
        with self._mutex:
            reason = self._reasons.pop(lock, None)
            # A move follows its change within a few rounds: a reason older than that is not this acquire's.
            fresh = self._read_at is not None and self._read_at - self._reasons_at <= REASON_KEPT
            return reason if fresh else None


def _why_moved(was: str, now: str | None, joined: Collection[str], left: Collection[str], expired: Collection[str]) -> str:
    """Why a lock placed on ``was`` is now placed on ``now``: the change of nodes behind it."""
    if was in expired:
        return f"the lease of {was} ran out"
    if was in left:
        return f"{was} left"
    if now in joined:
        return f"{now} joined"
    return "rebalanced"
