"""Removing a guarded job undoes what adding it registered (scheduler.py ``forget_job``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from mutexcron import MutexScheduler
from tests.schedulers import shut_down_after, wait_for

pytestmark = pytest.mark.memory


@pytest.fixture
def made() -> Iterator[list[MutexScheduler]]:
    yield from shut_down_after()




def node(made: list[MutexScheduler], url: str, node_id: str) -> MutexScheduler:
    sched = MutexScheduler(lock_url=url, node_id=node_id, unactive_interval=3)
    made.append(sched)
    return sched


def test_a_node_that_removed_a_job_releases_its_lock_to_a_node_that_still_has_it(made: list[MutexScheduler]) -> None:
    """A feature flag or a rolling deploy: the holder removes the job, the other node runs it."""
    url = f"memory://remove-{secrets.token_hex(4)}"
    runs: list[str] = []
    remover, keeper = node(made, url, "remover"), node(made, url, "keeper")
    for sched in (remover, keeper):
        sched.add_job(lambda n=sched.node_id: runs.append(n), "interval", seconds=0.2, id="report", mutex="report")
    remover.start()
    assert wait_for(lambda: "remover" in runs)
    keeper.start()
    remover.remove_job("report")
    assert wait_for(lambda: (remover.lock_store.read("report") or object()).holder != "remover", timeout=3), "released"
    assert wait_for(lambda: "keeper" in runs, timeout=5), "the node that still has the job runs it"
    assert remover._leases is not None and "report" not in remover._leases.locks(), "no longer guarded by the remover"
    assert remover.guard_of("report") is None
    time.sleep(1.0)  # heartbeat rounds: the remover neither renews nor takes it back
    record = remover.lock_store.read("report")
    assert record is not None and record.holder == "keeper"


def test_finished_one_off_jobs_leave_no_lock_behind(made: list[MutexScheduler]) -> None:
    """APScheduler removes a date job once it ran: its lock is released and forgotten."""
    url = f"memory://one-off-{secrets.token_hex(4)}"
    sched = node(made, url, "a")
    ran: list[int] = []
    sched.start()
    soon = datetime.now(timezone.utc) + timedelta(seconds=0.3)
    for i in range(20):
        sched.add_job(lambda i=i: ran.append(i), "date", run_date=soon, id=f"once-{i}", mutex=f"once-{i}")
    assert wait_for(lambda: len(ran) == 20)
    assert wait_for(lambda: sched._leases is not None and not sched._leases.locks(), timeout=5), "every lock forgotten"
    assert not sched._leases.held()  # type: ignore[union-attr]
    assert all(r.holder is None for r in sched.lock_store.list()), "every lock released"
    assert sched.skipped_runs() == {} and not sched._guard_context.jobs_per_lock


def test_removing_one_job_of_a_lock_group_keeps_the_lock_until_the_last(made: list[MutexScheduler]) -> None:
    url = f"memory://group-{secrets.token_hex(4)}"
    sched = node(made, url, "a")
    for job_id in ("first", "second"):
        sched.add_job(lambda: None, "interval", seconds=0.2, id=job_id, mutex="group")
    sched.start()
    leases = sched._leases
    assert leases is not None and wait_for(lambda: "group" in leases.held())
    sched.remove_job("first")
    time.sleep(0.5)
    assert "group" in leases.held(), "the group's other job still needs the lock"
    sched.remove_all_jobs()
    assert wait_for(lambda: "group" not in leases.locks())
    assert (sched.lock_store.read("group") or object()).holder is None  # type: ignore[union-attr]
    sched.add_job(lambda: None, "interval", seconds=0.2, id="first", mutex="group")
    assert wait_for(lambda: "group" in leases.held()), "a re-added job takes its lock again"
    assert sched.get_job("first") is not None


def test_a_removed_jobs_metrics_series_are_forgotten() -> None:
    pytest.importorskip("prometheus_client")
    from mutexcron.observability.metrics import Metrics

    metrics = Metrics()
    for job, lock in (("gone", "alone"), ("kept", "shared"), ("gone2", "shared")):
        metrics.run_started(job, lock, 0.1)
        metrics.run_finished(job, lock, "success", 0.5)
    metrics.leases_lost.inc(("alone",))
    metrics.forget("gone", "alone")
    metrics.forget("gone2", None)  # the lock still has a job

    def labelled(value: str) -> list[str]:
        out = []
        for family in metrics.instruments.collect():
            out += [s.name for s in family.samples if value in s.labels.values()]
        return out

    assert labelled("gone") == [] and labelled("alone") == [] and labelled("gone2") == []
    assert labelled("kept") and labelled("shared")
