"""Issue 33, part 2: a lock given up under balanced placement is offered to a named successor.

Lease managers on one in-memory store with an injected clock (the same store semantics as every
backend: ``tests/test_contract.py`` runs the store operation itself on each). Real nodes, every
server store and gunicorn reloads: ``tests/test_placement_cluster.py`` and ``tests/test_contrib_flask.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta

import pytest

from mutexcron import MutexScheduler
from mutexcron.heartbeat import LEAVE_SETTLE, LEAVE_WAIT, OFFER_WITHIN, LeaseManager
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


DAY = 86_400.0


def _leaving(manager: LeaseManager, fires: Callable[[], Mapping[str, float | None]]) -> threading.Thread:
    """``manager.hand_over_all(LEAVE_WAIT, fires)`` on a thread of its own (the scheduler's stop)."""
    thread = threading.Thread(target=manager.hand_over_all, args=(LEAVE_WAIT, fires), daemon=True)
    thread.start()
    return thread


def _returns(thread: threading.Thread, manager: LeaseManager) -> bool:
    """True if the wait ended within 10 s of real time (the injected clock does not move meanwhile)."""
    thread.join(timeout=10)
    if thread.is_alive():
        manager._stop.set()  # ends the wait: the test fails, but does not hang
        thread.join(timeout=10)
        return False
    return True


def _two_nodes() -> tuple[Cluster, LeaseManager]:
    cluster = Cluster()
    a = cluster.join("a")
    cluster.join("b")
    cluster.rounds(3)
    assert a.held() and a.placement.others_seen()
    return cluster, a


def test_every_node_stopping_at_once_with_no_fire_time_due_releases_everything_at_once() -> None:
    """docker compose down: no successor comes, and no job fires within the wait: each node
    releases its locks at once, each with its record (token, last claimed fire time)."""
    cluster, a = _two_nodes()
    b = cluster.nodes["b"]
    lock = next(iter(a.held()))
    claimed = a.tick(lock, FireClaim.new("job", 1_000_000))
    assert claimed is not None and claimed.claimed
    tokens = {**a.held(), **b.held()}
    fires = dict.fromkeys(LOCKS, DAY)
    fires["lock-11"] = None  # paused: no fire time at all
    leaving = [_leaving(a, lambda: fires), _leaving(b, lambda: fires)]
    assert all(_returns(thread, node) for thread, node in zip(leaving, (a, b))), "no node waits out LEAVE_WAIT"
    assert not a.held() and not b.held()
    for name, token in tokens.items():
        record = cluster.store.read(name)
        assert record is not None and record.holder is None and record.token == token, "released, not handed on"
    record = cluster.store.read(lock)
    assert record is not None and record.fire_times["job"].timestamp() == 1.0, "its last claimed fire time kept"


def test_a_stopping_node_waits_only_for_the_locks_with_a_fire_time_within_the_wait() -> None:
    cluster, a = _two_nodes()
    due, unknown, *others = sorted(a.held())
    fires: dict[str, float | None] = {name: DAY for name in others}
    fires[due] = 5.0  # fires within the wait; ``unknown`` is left out: its fire times are not known here
    thread = _leaving(a, lambda: dict(fires))
    deadline = time.monotonic() + 10
    while any(cluster.store.read(name).holder == "a" for name in others):  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the locks with no fire time within the wait are released at once"
        time.sleep(0.02)
    thread.join(timeout=0.3)
    assert thread.is_alive(), "it waits for the fire time due in 5 s"
    assert set(a.held()) == {due, unknown}, "a lock due within the wait, or with unknown fire times, is kept"
    fires[due], fires[unknown] = DAY, None  # ``due`` fired; the next fire time of each is beyond the wait
    cluster.clock.advance(5.0)
    assert _returns(thread, a), "no fire time left within the wait: it stops waiting (15 s before LEAVE_WAIT)"
    assert set(a.held()) == set(), "both released once no fire time needs them"
    a.stop(timeout=0)


def test_a_stopping_node_keeps_a_lock_whose_run_is_going_until_it_ends() -> None:
    cluster, a = _two_nodes()
    busy = next(iter(a.held()))
    assert a.begin_run(busy)
    thread = _leaving(a, lambda: dict.fromkeys(LOCKS, DAY))
    assert _returns(thread, a), "nothing due within the wait"
    assert set(a.held()) == {busy}, "not released under its run: stop() releases it after the run"
    a.end_run(busy)
    a.stop(timeout=0)
    assert cluster.store.read(busy).holder in (None, "b")  # type: ignore[union-attr]


def test_a_lock_pinned_by_a_loop_pass_is_neither_handed_over_nor_released_until_unpinned() -> None:
    """A shared job store's loop pass pins the locks of the jobs it read due (their next run times
    are written before their runs claim): a stopping node keeps each until it is unpinned."""
    cluster, a = _two_nodes()
    held = sorted(a.held())
    pinned = a.pin({held[0], "not-held-here"})
    assert pinned == {held[0]}, "only a lock this node holds is pinned"
    thread = _leaving(a, lambda: dict.fromkeys(LOCKS, DAY))
    assert _returns(thread, a), "nothing due within the wait"
    assert set(a.held()) == {held[0]}, "every lock released but the pinned one"
    a.unpin(pinned)
    a.stop(timeout=0)
    assert cluster.store.read(held[0]).holder in (None, "b")  # type: ignore[union-attr]
    assert a.pin({held[0]}) == set(), "nothing is pinned once the stop began"


def test_the_scheduler_tells_the_seconds_to_each_locks_soonest_fire_time() -> None:
    store = MemoryLockStore()
    sched = MutexScheduler(lock_store=store, node_id="a", unactive_interval=2, placement="balanced")
    started, release = threading.Event(), threading.Event()

    def busy() -> None:
        started.set()
        release.wait(10)

    in_12h = datetime.now() + timedelta(hours=12)
    sched.add_job(print, "cron", hour=in_12h.hour, minute=in_12h.minute, id="daily", mutex="daily")
    sched.add_job(print, "interval", hours=1, id="hourly", mutex="shared")
    sched.add_job(print, "interval", hours=2, id="two-hourly", mutex="shared")
    sched.add_job(print, "interval", hours=1, id="paused", mutex="paused").pause()
    sched.add_job(busy, "interval", seconds=1, id="busy", mutex="busy")
    sched.start()
    try:
        assert started.wait(20)
        fires = sched._next_fires()
        assert fires["daily"] == pytest.approx(12 * 3600, abs=120)
        soonest = min(sched.get_job(job_id).next_run_time for job_id in ("hourly", "two-hourly"))
        assert 0 < fires["shared"] == pytest.approx((soonest - datetime.now(soonest.tzinfo)).total_seconds(), abs=5), (
            "the soonest of its jobs"
        )
        assert fires["paused"] is None, "a paused job has no fire time"
        assert fires["busy"] == 0.0, "a run going: due now"
    finally:
        release.set()
        sched.shutdown()
        store.close()


def test_only_a_node_with_guarded_locks_listens_for_offers() -> None:
    """Balanced placement is the default: a node that runs tasks alone (a heartbeat round, no
    guarded lock) does not poll the live nodes for offers; it starts to once it guards a lock."""
    store = MemoryLockStore()
    manager = LeaseManager(store, Node("a", "ip-a"), {}, placement=BalancedPlacement("a"))
    manager.attach(lambda: None)  # a task worker's renewals
    try:
        assert manager._thread is not None and manager.offers._thread is None
        manager.add_lock("lock-00", TTL)
        assert manager.offers._thread is not None
    finally:
        manager.stop(timeout=0)
        store.close()
