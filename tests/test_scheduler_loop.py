"""APScheduler's loop and mutexcron's hook around its passes (scheduler.py ``_process_jobs``).

An error in the hook never ends APScheduler's loop; a node whose loop did end anyway gives up its
leases and says so in its health.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from apscheduler.schedulers.base import BaseScheduler

from mutexcron import MutexScheduler
from mutexcron.guard import apscheduler_internals as aps
from tests.schedulers import wait_for

pytestmark = pytest.mark.memory



@pytest.fixture
def sched() -> Iterator[MutexScheduler]:
    made = MutexScheduler(lock_url=f"memory://loop-{secrets.token_hex(4)}", node_id="a", unactive_interval=3)
    yield made
    if made.running:
        made.shutdown(wait=False)


def guarded_counter(sched: MutexScheduler) -> list[float]:
    runs: list[float] = []
    sched.add_job(lambda: runs.append(time.monotonic()), "interval", seconds=0.2, id="tick", mutex="loop")
    return runs


def test_a_failed_batch_submit_does_not_end_apschedulers_loop(sched: MutexScheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """``can't start new thread`` while handing a pass's guarded runs to the pool: those runs do
    not start, and the loop goes on with the next pass."""
    runs = guarded_counter(sched)
    failed = threading.Event()
    submit = aps.submit_work

    def failing_once(executor: Any, work: Callable[[], Any]) -> None:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("can't start new thread")
        submit(executor, work)

    monkeypatch.setattr(aps, "submit_work", failing_once)
    sched.start()
    assert wait_for(failed.is_set)
    after = time.monotonic()
    assert wait_for(lambda: len([t for t in runs if t > after]) >= 3), "the job runs again after the failed pass"
    assert sched._thread is not None and sched._thread.is_alive(), "APScheduler's loop is alive"
    assert sched._leases is not None and sched._leases.unhealthy() is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's thread ends with it
def test_a_node_whose_loop_died_releases_its_leases_and_is_unhealthy(
    sched: MutexScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = guarded_counter(sched)
    sched.start()
    assert wait_for(lambda: len(runs) >= 2)
    original = BaseScheduler._process_jobs

    def dying(self: Any) -> Any:
        if self is sched:
            raise MemoryError("out of memory in the loop")
        return original(self)

    monkeypatch.setattr(BaseScheduler, "_process_jobs", dying)
    assert wait_for(lambda: not sched._thread.is_alive()), "the loop ends, as APScheduler's does"  # type: ignore[union-attr]
    record = sched.lock_store.read("loop")
    assert wait_for(lambda: (sched.lock_store.read("loop") or record).holder is None, timeout=5), "the lease is released"
    reason = sched._leases.unhealthy()  # type: ignore[union-attr]
    assert reason is not None and "scheduler loop died" in reason and "MemoryError" in reason
    time.sleep(1.5)  # a few heartbeat rounds: no takeover by the node that gave up
    assert (sched.lock_store.read("loop") or record).holder is None
