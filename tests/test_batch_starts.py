"""A run of a claim batch that cannot start gives back what was counted for it (mutexcron/batch.py)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from mutexcron.guard.batch import _Entry, run_batch
from mutexcron.heartbeat import LeaseManager
from mutexcron.locks import Node
from mutexcron.locks.memory import MemoryLockStore

pytestmark = pytest.mark.memory

NODE = Node("a", "10.0.0.1")


class Executor:
    """What the batch calls of an executor: the instances APScheduler counted, given back."""

    def __init__(self) -> None:
        self.given_back: Counter[str] = Counter()

    def _run_job_success(self, job_id: str, events: list[Any]) -> None:
        self.given_back[job_id] += 1


def entries(manager: LeaseManager, executor: Executor, jobs: dict[str, str]) -> list[_Entry]:
    """One due run per job id (job id -> lock), as one pass of APScheduler's loop collects them."""
    context = SimpleNamespace(leases=manager)
    now = datetime.now(timezone.utc)
    made = []
    for job_id, lock in jobs.items():
        func = SimpleNamespace(lock=lock, job_id=job_id, context=context)
        job = SimpleNamespace(id=job_id, func=func, misfire_grace_time=60, trigger=None)
        made.append(_Entry(executor, job, now, now))
    return made


@pytest.mark.parametrize("failing", ["held-1", "free"])
def test_a_run_that_cannot_start_gives_back_its_instance_and_leaks_no_counted_run(failing: str) -> None:
    """One start fails ("can't start new thread"): its instance is given back, the batch's other
    runs still start, and no run stays counted (a stop would wait for it, and not release)."""
    store = MemoryLockStore("memory://batch-starts")
    manager = LeaseManager(store, NODE, {"held": 60.0, "free": 60.0})
    result = manager.tick("held", None)
    assert result is not None and result.acquired
    store.acquire_or_renew("free", Node("b", "10.0.0.2"), 60)  # held elsewhere: the ordinary path
    executor = Executor()
    started: list[tuple[str, int | None]] = []

    def start_one(entry: _Entry, token: int | None) -> None:
        if entry.job.id == failing:
            raise RuntimeError("can't start new thread")
        started.append((entry.job.id, token))

    run_batch(entries(manager, executor, {"held-1": "held", "held-2": "held", "free": "free"}), start_one)
    assert sorted(job for job, _ in started) == sorted({"free", "held-1", "held-2"} - {failing})
    assert executor.given_back == Counter({failing: 1}), "the failed run's instance is given back, once"
    started_held = [job for job, token in started if token is not None]
    assert manager.running() == {"held": len(started_held)}, "only the started runs stay counted (each ends its own)"
