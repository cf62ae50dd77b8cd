"""Issue 33, part 3: standbys cost nothing per job. Under balanced placement a node's APScheduler
loop sees only the guarded jobs whose lock it holds (jobs with ``lock_else`` still tick), and a
job whose lock it takes gets its next fire time from the lock's last claimed one.

Two schedulers in one process share one memory store: each holds the lock placed on it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from mutexcron import MutexScheduler, current_lease
from mutexcron.locks.memory import MemoryLockStore
from mutexcron.placement import assign
from mutexcron.placement.standby import HeldOnlyMemoryJobStore

pytestmark = pytest.mark.memory

LOCKS = ["alpha", "beta", "gamma", "delta"]


def wait_for(what: str, predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)


class Node:
    def __init__(self, store: MemoryLockStore, node_id: str, runs: Counter[tuple[str, datetime]], placement: str) -> None:
        self.sched = MutexScheduler(lock_store=store, node_id=node_id, unactive_interval=2, placement=placement)
        self.ran: Counter[str] = Counter()
        self.lock_else_calls = 0
        mutex = threading.Lock()
        for lock in LOCKS:

            def job(lock: str = lock) -> None:
                with mutex:
                    runs[(lock, current_lease().fire_time)] += 1
                    self.ran[lock] += 1

            self.sched.add_job(job, "interval", seconds=1, id=lock, mutex=lock)

        def watched() -> None:
            pass

        def on_standby(_record: Any) -> None:
            self.lock_else_calls += 1

        self.sched.add_job(watched, "interval", seconds=1, id="watched", mutex={"lock": "watched", "lock_else": on_standby})

    def skipped(self) -> int:
        return sum(n for (job, _lock, _reason), n in self.sched.skipped_runs().items() if job != "watched")


@pytest.fixture
def balanced() -> Iterator[tuple[Node, Node]]:
    """Nodes a and b, started under balanced placement; afterwards, no fire time ran twice."""
    store = MemoryLockStore()
    runs: Counter[tuple[str, datetime]] = Counter()
    a, b = Node(store, "a", runs, "balanced"), Node(store, "b", runs, "balanced")
    a.sched.start()
    b.sched.start()
    try:
        yield a, b
    finally:
        for node in (a, b):
            if node.sched.running:
                node.sched.shutdown()
        store.close()
    assert not [k for k, n in runs.items() if n > 1], "a fire time ran twice"


def test_a_standby_loop_skips_nothing_for_a_lock_it_does_not_hold_and_lock_else_still_ticks(balanced: tuple[Node, Node]) -> None:
    a, b = balanced
    assert isinstance(a.sched._jobstores["default"], HeldOnlyMemoryJobStore)
    owners = assign([*LOCKS, "watched"], ["a", "b"])
    wait_for("each node holds its share", lambda: all(
        set(n.sched._leases.held()) == {lock for lock, o in owners.items() if o == node}  # type: ignore[union-attr]
        for n, node in ((a, "a"), (b, "b"))
    ))  # fmt: skip
    a_before, b_before = a.skipped(), b.skipped()
    time.sleep(3.2)
    assert (a.skipped(), b.skipped()) == (a_before, b_before), "no tick of a job whose lock the node does not hold"
    assert all(a.ran[lock] >= 2 for lock in LOCKS if owners[lock] == "a")
    assert all(b.ran[lock] >= 2 for lock in LOCKS if owners[lock] == "b")
    assert a.lock_else_calls + b.lock_else_calls >= 2, "a job with lock_else still ticks where the lock is not held"


def test_a_node_that_takes_a_lock_runs_its_next_fire_times(balanced: tuple[Node, Node]) -> None:
    a, b = balanced
    wait_for("b holds a lock", lambda: len(b.sched._leases.held()) >= 2)  # type: ignore[union-attr]
    taken = [lock for lock in LOCKS if lock in b.sched._leases.held()]  # type: ignore[union-attr]
    b.sched.shutdown()  # SIGTERM-like: b's locks go to a
    wait_for("a holds every lock", lambda: set(LOCKS) <= set(a.sched._leases.held()))  # type: ignore[union-attr]
    before = {lock: a.ran[lock] for lock in taken}
    wait_for("a runs b's jobs", lambda: all(a.ran[lock] >= before[lock] + 2 for lock in taken), timeout=10)


def test_first_placement_keeps_every_job_in_the_loop() -> None:
    store = MemoryLockStore()
    runs: Counter[tuple[str, datetime]] = Counter()
    a, b = Node(store, "a", runs, "first"), Node(store, "b", runs, "first")
    a.sched.start()
    wait_for("a holds every lock", lambda: set(LOCKS) <= set(a.sched._leases.held()))  # type: ignore[union-attr]
    b.sched.start()
    try:
        assert type(b.sched._jobstores["default"]).__name__ == "MemoryJobStore"
        wait_for("b's standby ticks", lambda: b.skipped() >= len(LOCKS))
    finally:
        b.sched.shutdown()
        a.sched.shutdown()
        store.close()
