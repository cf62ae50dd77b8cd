"""Lease and run events through APScheduler's listeners (mutexcron/events.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mutexcron import (
    EVENT_LOCK_ACQUIRED,
    EVENT_LOCK_LOST,
    EVENT_LOCK_RELEASED,
    EVENT_LOCK_TAKEN_OVER,
    EVENT_MUTEX_ALL,
    EVENT_RUN_FINISHED,
    EVENT_RUN_SKIPPED,
    EVENT_RUN_STARTED,
    EVENT_STORE_DOWN,
    EVENT_STORE_UP,
    MutexEvent,
    MutexScheduler,
)
from mutexcron.events import log_event
from mutexcron.heartbeat import LeaseManager
from mutexcron.locks import Node, lock_store_from_url
from tests.backends import FakeClock


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


class Recorder:
    def __init__(self) -> None:
        self.events: list[MutexEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: MutexEvent) -> None:
        with self._lock:
            self.events.append(event)

    def named(self, name: str) -> list[MutexEvent]:
        with self._lock:
            return [e for e in self.events if e.name == name]


def _node(url: str, node_id: str, recorder: Recorder, fail: bool = False, lease: float = 2.0) -> MutexScheduler:
    # placement="first": the node started first keeps the lock and the other ticks as its standby, which
    # is what this test watches (balanced placement could hand the lock over, and keeps a standby's
    # jobs without lock_else out of its loop).
    sched = MutexScheduler(lock_url=url, node_id=node_id, placement="first")

    @sched.mutex(lock="ev", unactive_interval=lease)
    @sched.interval_schedule(seconds=1)
    def job() -> None:
        if fail:
            raise ValueError("boom")

    sched.add_listener(recorder, EVENT_MUTEX_ALL)
    return sched


def test_a_holder_and_a_standby_see_their_lease_and_run_events(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ev.db"
    holder_events, standby_events = Recorder(), Recorder()
    holder = _node(url, "holder", holder_events)
    holder.start()
    try:
        assert wait_for(lambda: bool(holder_events.named("run_finished")))
        standby = _node(url, "standby", standby_events)
        standby.start()
        try:
            assert wait_for(lambda: len(standby_events.named("run_skipped")) >= 2)
        finally:
            standby.shutdown()
    finally:
        holder.shutdown()
    [acquired] = holder_events.named("lock_acquired")
    assert (acquired.code, acquired.lock, acquired.node, acquired.token) == (EVENT_LOCK_ACQUIRED, "ev", "holder", 1)
    started, finished = holder_events.named("run_started")[0], holder_events.named("run_finished")[0]
    assert started.code == EVENT_RUN_STARTED and started.job_id == finished.job_id and started.job_id
    assert started.fire_time == finished.fire_time and started.fire_time is not None and started.fire_time.tzinfo
    assert 0 <= started.lag < 1.0 and finished.outcome == "success" and finished.duration >= 0
    assert finished.code == EVENT_RUN_FINISHED and finished.token == 1 and finished.error is None
    skipped = standby_events.named("run_skipped")
    assert {e.reason for e in skipped} == {"not-holder"} and all(e.code == EVENT_RUN_SKIPPED for e in skipped)
    assert not standby_events.named("run_started")
    [released] = holder_events.named("lock_released")
    assert released.code == EVENT_LOCK_RELEASED and released.token == 1


def test_a_failing_run_finishes_with_its_error(tmp_path: Path) -> None:
    recorder = Recorder()
    sched = _node(f"sqlite:///{tmp_path}/ev.db", "n", recorder, fail=True)
    sched.start()
    try:
        assert wait_for(lambda: bool(recorder.named("run_finished")))
    finally:
        sched.shutdown()
    finished = recorder.named("run_finished")[0]
    assert finished.outcome == "error" and finished.error == "ValueError: boom"


def test_a_takeover_names_the_previous_holder_and_the_lost_lease_is_an_event() -> None:
    url = "memory://events-takeover"
    store = lock_store_from_url(url)
    a_events, b_events = Recorder(), Recorder()
    a = LeaseManager(store, Node("a", "10.0.0.1"), {"l": 1.0}, emit=a_events)
    b = LeaseManager(lock_store_from_url(url), Node("b", "10.0.0.2"), {"l": 1.0}, emit=b_events)
    assert a.tick("l", None) is not None and a.held() == {"l": 1}
    time.sleep(1.3)  # a does not renew: its lease runs out by the store's clock
    b.run_once()
    [taken] = b_events.named("lock_taken_over")
    assert taken.code == EVENT_LOCK_TAKEN_OVER and taken.previous_holder == "a" and taken.previous_ip == "10.0.0.1"
    assert taken.stale_for >= 1.0 and taken.token == 2
    a.run_once()  # a's lease ran out by its own clock (and a renewal would be refused)
    [lost] = a_events.named("lock_lost")
    assert lost.code == EVENT_LOCK_LOST and lost.token == 1 and "renewal" in lost.reason


class FlakyStore:
    """A lock store proxy whose calls fail while ``down`` is set."""

    def __init__(self, url: str) -> None:
        self.store = lock_store_from_url(url)
        self.down = False

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.store, name)
        if not callable(attr) or name in ("masked_url",):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            if self.down:
                from mutexcron.errors import StoreUnavailableError

                raise StoreUnavailableError("store down (test)")
            return attr(*args, **kwargs)

        return call


def test_store_down_and_up_are_one_event_each_per_change() -> None:
    recorder = Recorder()
    flaky = FlakyStore("memory://events-flaky")
    clock = FakeClock()
    manager = LeaseManager(flaky, Node("a", "10.0.0.1"), {"l": 5.0}, emit=recorder, clock=clock)  # type: ignore[arg-type]

    def round_() -> None:  # a round a period after the last, as the heartbeat thread paces them (it renews then)
        manager.run_once()
        clock.advance(manager.period)

    round_()
    flaky.down = True
    for _ in range(3):
        round_()
    flaky.down = False
    round_()
    round_()
    assert [e.name for e in recorder.events if e.code in (EVENT_STORE_DOWN, EVENT_STORE_UP)] == [
        "store_up",
        "store_down",
        "store_up",
    ]
    down = recorder.named("store_down")[0]
    assert down.what == "lock" and "store down (test)" in down.error and down.store == "memory://events-flaky"


def test_the_log_lines_are_a_listener_of_the_events(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One source of truth: without the log listener the state-change lines are gone, events are not."""
    recorder = Recorder()
    sched = _node(f"sqlite:///{tmp_path}/ev.db", "n", recorder)
    sched.remove_listener(log_event)
    with caplog.at_level(logging.INFO, logger="mutexcron"):
        sched.start()
        try:
            assert wait_for(lambda: bool(recorder.named("lock_acquired")))
        finally:
            sched.shutdown()
    assert recorder.named("lock_acquired") and recorder.named("lock_released")
    assert not [r for r in caplog.records if "acquired lock" in r.getMessage() or "released lock" in r.getMessage()]
