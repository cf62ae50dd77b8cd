"""The holder claims all guarded jobs due at one instant in one store round trip, and standbys
make no store call at their ticks (issue "make the lock nearly free per tick").

The store is a real SQLite file; a thin wrapper counts the calls that reach it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from mutexcron import MutexScheduler, current_lease
from mutexcron.locks import LockStore, lock_store_from_url

pytestmark = pytest.mark.sqlite

JOBS = 50


class Counted:
    """Counts calls to a real store (nothing is replaced: every call goes through)."""

    def __init__(self, store: LockStore) -> None:
        self.store = store
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.calls[name] += 1
            return attr(*args, **kwargs)

        return call


def node(url: str, node_id: str, locks: int, runs: list[tuple[str, int, datetime]]) -> tuple[MutexScheduler, Counted]:
    counted = Counted(lock_store_from_url(url))
    # placement="first": the node started first holds every lock and the other is its standby, which is
    # what this test counts the calls of (balanced placement would share the locks between them).
    sched = MutexScheduler(lock_store=counted, node_id=node_id, unactive_interval=6, placement="first")  # type: ignore[arg-type]
    for j in range(JOBS):
        def job(j: int = j) -> None:
            runs.append((node_id, j, current_lease().fire_time))
        sched.add_job(job, "cron", second="*", id=f"job{j}", mutex=f"batch-{j % locks}")
    return sched, counted


@pytest.mark.parametrize("locks", [JOBS, 5], ids=["own-lock-each", "5-lock-groups"])
def test_the_holder_makes_one_claim_call_per_instant_and_standbys_none(tmp_path: Path, locks: int) -> None:
    url = f"sqlite:///{tmp_path}/batch.db"
    runs: list[tuple[str, int, datetime]] = []
    holder, holder_calls = node(url, "holder", locks, runs)
    holder.start()
    time.sleep(2.5)  # the holder takes every lock first
    standby, standby_calls = node(url, "standby", locks, runs)
    standby.start()
    try:
        time.sleep(2.5)
        before = Counter(holder_calls.calls), Counter(standby_calls.calls)
        measured_from = time.time()
        time.sleep(4.0)
        after = Counter(holder_calls.calls), Counter(standby_calls.calls)
    finally:
        standby.shutdown(wait=True)
        holder.shutdown(wait=True)
    held_calls, standby_made = after[0] - before[0], after[1] - before[1]
    fires = Counter((j, fire) for _node, j, fire in runs)
    assert max(fires.values()) == 1, "a fire time ran twice"
    window = [r for r in runs if r[2].timestamp() >= measured_from]
    assert {n for n, _j, _f in window} == {"holder"}
    assert held_calls["claim_many"] <= 5, f"about one claim call per second for {JOBS} jobs: {held_calls}"
    assert held_calls["acquire_or_renew"] == 0, f"no per-job acquire on the holder: {held_calls}"
    # No claim and no per-job tick on the standby. A loaded machine can delay the holder's renewals
    # enough for the standby to try a takeover now and then (6 acquires in 4 s once on CI with a
    # lock per job; 5, one per lock, with 5 locks); per-job work would be one call per job per tick
    # (50 x 4 here).
    takeover_tries = max(2, locks // 4, min(locks, 6))
    assert standby_made["claim_many"] == 0, f"standby claims: {standby_made}"
    assert standby_made["acquire_or_renew"] <= takeover_tries, f"standby ticks: {standby_made}"
    assert standby_made["read_many"] <= 6, f"one view refresh per second: {standby_made}"
