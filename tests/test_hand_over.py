"""Issue 33, part 2: a lock given up under balanced placement is offered to a named successor.

Lease managers on one in-memory store with an injected clock (the same store semantics as every
backend: ``tests/test_contract.py`` runs the store operation itself on each). Real nodes, every
server store and gunicorn reloads: ``tests/test_placement_cluster.py`` and ``tests/test_contrib_flask.py``.
"""

from __future__ import annotations

import logging

import pytest

from mutexcron.heartbeat import LEAVE_SETTLE, OFFER_WITHIN, LeaseManager
from mutexcron.locks import FireClaim, Node
from mutexcron.locks.memory import MemoryLockStore
from mutexcron.placement import BalancedPlacement, assign
from tests.backends import FakeClock

pytestmark = pytest.mark.memory

LOCKS = [f"lock-{i:02d}" for i in range(12)]
TTL = 3.0


class Cluster:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.store = MemoryLockStore(clock=self.clock)
        self.nodes: dict[str, LeaseManager] = {}

    def join(self, node_id: str) -> LeaseManager:
        manager = LeaseManager(
            self.store, Node(node_id, f"ip-{node_id}"), dict.fromkeys(LOCKS, TTL), clock=self.clock,
            placement=BalancedPlacement(node_id),
        )  # fmt: skip
        self.nodes[node_id] = manager
        return manager

    def rounds(self, count: int, every: float = 1.0) -> None:
        for _ in range(count):
            for manager in list(self.nodes.values()):
                manager.run_once()
            self.clock.advance(every)


def test_a_rebalance_offers_each_lock_to_its_placed_node_with_its_last_claimed_fire_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = Cluster()
    a = cluster.join("a")
    cluster.rounds(2)
    assert set(a.held()) == set(LOCKS)
    token = a.held()["lock-00"]
    claimed = a.tick("lock-00", FireClaim.new("job-00", 1_000_000))
    assert claimed is not None and claimed.claimed
    cluster.join("b")
    placed_on_b = [lock for lock, owner in assign(LOCKS, ["a", "b"]).items() if owner == "b"]
    caplog.set_level(logging.INFO)
    for manager in (cluster.nodes["b"], a):  # b publishes its presence; a reads it and rebalances
        manager.run_once()
    moved = [lock for lock in placed_on_b if lock not in a.held()]
    assert moved == placed_on_b, "a gives up every lock placed on b in one round"
    for lock in moved:
        record = cluster.store.read(lock)
        assert record is not None and record.holder == "b" and record.active_ip is None, "offered to b, not released"
        assert record.state == "active" and record.ttl == pytest.approx(min(TTL, OFFER_WITHIN))
    assert any("to b (placement rebalanced" in r.getMessage() for r in caplog.records), "each move is logged with its reason"
    if "lock-00" in moved:
        record = cluster.store.read("lock-00")
        assert record is not None and record.token == token + 1 and record.fire_times["job-00"].timestamp() == 1.0
    # Nobody else may take an offer; b takes each with its ordinary acquire (a holder's renewal).
    intruder = Node("c", "ip-c")
    assert not cluster.store.acquire_or_renew(moved[0], intruder, TTL).acquired
    cluster.nodes["b"].run_once()
    assert set(cluster.nodes["b"].held()) == set(moved)
    assert all(cluster.store.read(lock).active_ip == "ip-b" for lock in moved)  # type: ignore[union-attr]
    assert any("(handed over to this node)" in r.getMessage() for r in caplog.records)


def test_a_stopping_node_hands_each_lock_to_the_node_placed_for_it_without_it() -> None:
    cluster = Cluster()
    for node_id in ("a", "b", "c"):
        cluster.join(node_id)
    cluster.rounds(4)
    a = cluster.nodes.pop("a")
    held = set(a.held())
    assert held
    a.stop(timeout=0)
    expected = assign(LOCKS, ["b", "c"])
    for lock in held:
        record = cluster.store.read(lock)
        assert record is not None and record.holder == expected[lock], "offered to its placed node, not released"
    cluster.rounds(1)
    assert {lock for lock in held if cluster.store.read(lock).holder in ("b", "c")} == held  # type: ignore[union-attr]
    assert sum(len(m.held()) for m in cluster.nodes.values()) == len(LOCKS)


def test_an_offer_its_successor_never_takes_lapses_and_then_anyone_takes_it() -> None:
    cluster = Cluster()
    a, b = cluster.join("a"), cluster.join("b")
    cluster.rounds(3)
    lock, token = next(iter(a.held().items()))
    assert cluster.store.hand_over(lock, a.node, token, "gone", OFFER_WITHIN)
    del a._held[lock]  # a gave it up (as its hand-over does)
    cluster.rounds(1)
    assert cluster.store.read(lock).holder == "gone"  # type: ignore[union-attr]
    cluster.rounds(int(OFFER_WITHIN) + 5)  # the offer lapses; its placed node (or, after the grace, anyone) takes it
    record = cluster.store.read(lock)
    assert record is not None and record.holder in ("a", "b") and record.token > token + 1
    assert "gone" not in b.placement._gone, "an offer never taken is not a holder whose lease ran out"  # type: ignore[attr-defined]


def test_no_run_begins_while_its_lock_is_handed_over() -> None:
    cluster = Cluster()
    a = cluster.join("a")
    cluster.rounds(1)
    with a._mutex:
        a._handing.add("lock-00")
    assert not a.begin_run("lock-00"), "a run that began now would claim a fire time the successor also runs"
    with a._mutex:
        a._handing.discard("lock-00")
    assert a.begin_run("lock-00")
    a.end_run("lock-00")


def test_a_leaving_node_keeps_its_locks_until_a_successor_is_live_then_hands_them_over() -> None:
    cluster = Cluster()
    a = cluster.join("a")
    cluster.join("b")
    cluster.rounds(3)
    cluster.nodes.pop("b").stop(timeout=0)  # b goes first: a alone holds everything, and saw b
    cluster.rounds(2)
    assert set(a.held()) == set(LOCKS)
    with a._mutex:
        a._leaving = cluster.clock()
    a._leave()
    cluster.rounds(2)
    assert set(a.held()) == set(LOCKS), "no live successor: a keeps its locks (and runs their jobs)"
    c = cluster.join("c")
    cluster.rounds(1)  # c publishes its presence
    cluster.clock.advance(LEAVE_SETTLE)
    a.run_once()
    assert not a.held(), "every lock offered to c"
    c.run_once()
    assert set(c.held()) == set(LOCKS)
