"""A node whose lease lapsed and came back wakes its loop (issue #32, A2).

A holder frozen past its lease (SIGSTOP, a long GC pause, a store outage) is handed its lock back
by the store, often with the same token. Before, the node's lease manager saw the same token and
sent no ``EVENT_LOCK_ACQUIRED``, the one event that wakes a shared store's loop: a loop that had
looked while the lease was out found nothing held and slept for good. The store-level test runs
on every store; ``tests/test_shared_freeze.py`` freezes a real ``mutexcron run`` node.
"""

from __future__ import annotations

import pytest

from mutexcron.events import EVENT_LOCK_ACQUIRED, EVENT_LOCK_LOST, EVENT_LOCK_TAKEN_OVER, MutexEvent
from mutexcron.heartbeat import LeaseManager
from mutexcron.locks import Node
from tests.backends import ALL_BACKENDS, FakeClock, StoreCtx, backend_params

pytestmark = pytest.mark.parametrize("kind", backend_params(*ALL_BACKENDS))

TTL = 1.0


def test_a_lease_held_again_after_it_lapsed_is_announced_even_with_the_same_token(ctx: StoreCtx) -> None:
    events: list[MutexEvent] = []
    lock_events = (EVENT_LOCK_ACQUIRED, EVENT_LOCK_LOST, EVENT_LOCK_TAKEN_OVER)
    clock = FakeClock()  # the node's monotonic clock: frozen nodes do not see time pass until they resume
    emit = lambda e: events.extend([e] if e.code in lock_events else [])  # noqa: E731
    manager = LeaseManager(ctx.make(), Node("frozen", "ip-f"), {"l": TTL}, emit=emit, clock=clock)
    manager.run_once()
    first = manager.held()
    assert "l" in first and [e.code for e in events] == [EVENT_LOCK_ACQUIRED]
    events.clear()

    ctx.wait_stale(TTL)  # the store's lease runs out; nobody takes the lock meanwhile
    clock.advance(TTL * 1.5 + 0.01)  # the node resumes: its deadline is past, its record not yet dropped
    manager.run_once()

    assert "l" in manager.held(), "the lock is held again"
    codes = [e.code for e in events]
    assert codes[-1] in (EVENT_LOCK_ACQUIRED, EVENT_LOCK_TAKEN_OVER), (
        f"held again after a lapse (token {first['l']} -> {manager.held()['l']}) without an event that wakes the loop: {codes}"
    )
    if manager.held()["l"] == first["l"]:
        assert codes == [EVENT_LOCK_LOST, EVENT_LOCK_ACQUIRED], "the lapse is said once, then the new hold"
    manager.stop(1.0)


def test_a_run_whose_lease_lapsed_records_nothing_even_once_the_lock_is_held_again(ctx: StoreCtx) -> None:
    """Principle: once a run's lease has lapsed, it records nothing, even if a later acquire hands
    the node the same token again (a freeze, an outage longer than the lease)."""
    from mutexcron.locks import RunInfo

    clock = FakeClock()
    store = ctx.make()
    manager = LeaseManager(store, Node("frozen", "ip-f"), {"l": TTL}, clock=clock)
    manager.run_once()
    token = manager.held()["l"]
    started = clock()  # a run begins under that lease
    assert manager.checkpoint("l", token, set(), {"step": 1}, "job", started)

    ctx.wait_stale(TTL)
    clock.advance(TTL * 1.5 + 0.01)  # the node resumes past its deadline: the run's lease lapsed
    manager.run_once()  # ... and the heartbeat takes the lock again, perhaps with the same token
    again = manager.held()["l"]

    assert not manager.checkpoint("l", again, {"step"}, {"step": 2}, "job", started)
    assert not manager.finish("l", again, {"step"}, {"step": 3}, RunInfo(0.1, None, job="job"), "job", started)
    record = store.read("l")
    assert record is not None and record.attrs.get("step") == 1, "the lapsed run wrote after its lease ran out"

    later = clock()  # a run that begins under the new hold records as usual
    assert manager.finish("l", again, {"step"}, {"step": 4}, RunInfo(0.1, None, job="job"), "job", later)
    record = store.read("l")
    assert record is not None and record.attrs.get("step") == 4
    manager.stop(1.0)
