"""Helpers of the in-process scheduler tests: waiting for a condition, and schedulers shut down after the test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from mutexcron import MutexScheduler


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` every 20 ms until it holds or ``timeout`` seconds passed; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def shut_down_after() -> Iterator[list[MutexScheduler]]:
    """A fixture's body: a list the test adds its schedulers to; those still running are shut down after it."""
    schedulers: list[MutexScheduler] = []
    yield schedulers
    for sched in schedulers:
        if sched.running:
            sched.shutdown(wait=False)
