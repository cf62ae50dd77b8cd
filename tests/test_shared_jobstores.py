"""Shared APScheduler job stores, several schedulers in one process on one store (every family).

The 3-process cluster per family is in ``tests/test_shared_cluster.py``.
"""

from __future__ import annotations

import logging
import pickle
import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from apscheduler.events import EVENT_JOB_ADDED, EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED
from apscheduler.jobstores.base import BaseJobStore
from apscheduler.jobstores.memory import MemoryJobStore

from mutexcron import ConfigurationError, MutexScheduler
from mutexcron.locks.memory import MemoryLockStore
from tests import shared_jobs
from tests.backends import backend_params
from tests.shared_jobs import JobStoreCtx, open_jobstore, runs_of

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

TICK = "tests.shared_jobs:tick"


@pytest.fixture
def jobs(kind: str, tmp_path: Path) -> Iterator[JobStoreCtx]:
    with open_jobstore(kind, tmp_path) as ctx:
        yield ctx


@pytest.fixture
def locks() -> MemoryLockStore:
    return MemoryLockStore("memory://shared-jobs")


class Nodes:
    """Schedulers on one job store and one lock store, shut down at the end of the test."""

    def __init__(self, jobs: JobStoreCtx, locks: MemoryLockStore) -> None:
        self.jobs, self.locks = jobs, locks
        self.all: list[MutexScheduler] = []

    def new(self, *, start: bool = True, paused: bool = False, **options: Any) -> MutexScheduler:
        sched = MutexScheduler(
            jobstores={"default": self.jobs.make()},
            lock_store=self.locks,
            node_id=f"n{len(self.all)}-{secrets.token_hex(2)}",
            unactive_interval=options.pop("unactive_interval", 1.5),
            triggers=False,
            **options,
        )
        self.all.append(sched)
        if start:
            sched.start(paused=paused)
        return sched

    def close(self) -> None:
        for sched in self.all:
            if sched.running:
                sched.shutdown(wait=False)


@pytest.fixture
def nodes(jobs: JobStoreCtx, locks: MemoryLockStore) -> Iterator[Nodes]:
    shared_jobs.clear_runs()
    made = Nodes(jobs, locks)
    try:
        yield made
    finally:
        made.close()


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> float:
    """Seconds it took for ``predicate`` to hold (AssertionError after ``timeout``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def stored_state(sched: MutexScheduler, job_id: str) -> dict[str, Any] | None:
    state = sched._jobstores["default"]._read_states([job_id]).get(job_id)
    return None if state is None else pickle.loads(state)


def no_duplicates(rows: list[tuple[str, float, str, str]]) -> None:
    seen: dict[tuple[str, float], str] = {}
    for job, fire, node, _tag in rows:
        assert (job, fire) not in seen, f"{job} at {fire} ran on {seen[(job, fire)]} and {node}"
        seen[(job, fire)] = node


ALL = backend_params(*shared_jobs.KINDS)


@pytest.mark.parametrize("kind", ALL)
def test_a_guarded_job_stores_the_users_function_and_restores_on_another_node(nodes: Nodes) -> None:
    web = nodes.new(paused=True)
    web.add_job(shared_jobs.tick, "interval", seconds=1, id="report", kwargs={"job": "report"}, mutex=True)
    state = stored_state(web, "report")
    assert state is not None and state["func"] == TICK  # not mutexcron's wrapper
    worker = nodes.new()
    wait_for(lambda: len(runs_of("report")) >= 2, timeout=8)
    assert {r[2] for r in runs_of("report")} == {worker.node_id}  # the paused web process runs nothing
    assert stored_state(worker, "report") is not None


@pytest.mark.parametrize("kind", ALL)
def test_each_fire_time_runs_once_across_three_nodes(nodes: Nodes) -> None:
    cluster = [nodes.new() for _ in range(3)]
    for i in range(4):
        cluster[i % 3].add_job(
            shared_jobs.tick, "interval", seconds=1, id=f"j{i}", kwargs={"job": f"j{i}"}, replace_existing=True
        )
    wait_for(lambda: all(len(runs_of(f"j{i}")) >= 3 for i in range(4)), timeout=15)
    no_duplicates(shared_jobs.RUNS)


@pytest.mark.parametrize("kind", ALL)
def test_changes_from_a_paused_process_reach_a_running_node_with_apscheduler_events(nodes: Nodes) -> None:
    worker = nodes.new()
    seen: list[tuple[int, str]] = []
    worker.add_listener(lambda e: seen.append((e.code, e.job_id)), EVENT_JOB_ADDED | EVENT_JOB_MODIFIED | EVENT_JOB_REMOVED)
    web = nodes.new(paused=True)
    web.add_job(shared_jobs.tick, "interval", seconds=1, id="w", kwargs={"job": "w"})
    assert wait_for(lambda: (EVENT_JOB_ADDED, "w") in seen, timeout=3) < 1.5
    wait_for(lambda: runs_of("w"), timeout=5)
    web.modify_job("w", kwargs={"job": "w", "tag": "v2"})
    assert wait_for(lambda: (EVENT_JOB_MODIFIED, "w") in seen, timeout=3) < 1.5
    wait_for(lambda: any(r[3] == "v2" for r in runs_of("w")), timeout=5)
    web.pause_job("w")
    wait_for(lambda: seen.count((EVENT_JOB_MODIFIED, "w")) >= 2, timeout=3)
    time.sleep(0.3)
    paused_at = len(runs_of("w"))
    time.sleep(2.2)
    assert len(runs_of("w")) == paused_at
    web.resume_job("w")
    wait_for(lambda: len(runs_of("w")) > paused_at, timeout=5)
    assert worker._leases is not None and "w" in worker._leases.held()
    web.remove_job("w")
    assert wait_for(lambda: (EVENT_JOB_REMOVED, "w") in seen, timeout=3) < 1.5
    wait_for(lambda: "w" not in worker._leases.held(), timeout=3)  # its lock is let go
    record = nodes.locks.read("w")
    assert record is not None and record.state != "active"
    assert web._leases is not None and not web._leases.held()  # the paused process never took a lock


@pytest.mark.parametrize("kind", ALL)
def test_the_loops_update_does_not_undo_a_concurrent_change(nodes: Nodes) -> None:
    worker = nodes.new()
    web = nodes.new(paused=True)
    web.add_job(shared_jobs.tick, "interval", seconds=60, id="c", kwargs={"job": "c"})
    store = worker._jobstores["default"]
    wait_for(lambda: "c" in store._known, timeout=3)
    state = store._read_states(["c"])["c"]
    loop_copy = store.restore("c", state, from_loop=True)  # what get_due_jobs hands the loop
    api_copy = web._jobstores["default"].lookup_job("c")  # what modify_job reads
    web.modify_job("c", kwargs={"job": "c", "tag": "changed"})  # another writer, meanwhile
    loop_copy._modify(next_run_time=loop_copy.next_run_time + timedelta(seconds=60))
    store.update_job(loop_copy)  # the loop's advance of a stale copy
    assert stored_state(worker, "c")["kwargs"]["tag"] == "changed"
    # A change through the API over a copy read before the loop's advance merges onto it.
    advanced = loop_copy.next_run_time + timedelta(seconds=60)
    fresh = store.restore("c", store._read_states(["c"])["c"], from_loop=True)
    fresh._modify(next_run_time=advanced)
    store.update_job(fresh)
    api_copy._modify(name="renamed")
    web._jobstores["default"].update_job(api_copy)
    state_after = stored_state(worker, "c")
    assert state_after["name"] == "renamed" and state_after["kwargs"]["tag"] == "changed"
    assert state_after["next_run_time"] == advanced


@pytest.mark.parametrize("kind", ALL)
def test_a_date_job_runs_once_and_is_removed_once(nodes: Nodes, caplog: pytest.LogCaptureFixture) -> None:
    cluster = [nodes.new() for _ in range(3)]
    when = datetime.now(timezone.utc) + timedelta(seconds=1.5)
    cluster[0].add_job(shared_jobs.tick, "date", run_date=when, id="once", kwargs={"job": "once"})
    # Room for a loaded machine: a node must take the job's lock first; the count below is exact.
    wait_for(lambda: runs_of("once"), timeout=20)
    wait_for(lambda: stored_state(cluster[0], "once") is None, timeout=10)
    time.sleep(1.0)
    assert len(runs_of("once")) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    for sched in cluster:
        sched.remove_job("once")  # already gone: not an error on a shared store


@pytest.mark.parametrize("kind", ALL)
def test_every_node_adding_its_jobs_at_start_up_keeps_the_stored_next_run_time(nodes: Nodes) -> None:
    first = nodes.new(paused=True)
    first.add_job(shared_jobs.tick, "interval", seconds=30, id="r", kwargs={"job": "r"}, replace_existing=True)
    earlier = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=5)
    first.modify_job("r", next_run_time=earlier)  # a fire time due now (its holder restarted)
    again = nodes.new(start=False)
    again.add_job(shared_jobs.tick, "interval", seconds=30, id="r", kwargs={"job": "r"}, replace_existing=True)
    again.start(paused=True)
    assert stored_state(first, "r")["next_run_time"] == earlier  # neither skipped nor moved
    first.pause_job("r")
    third = nodes.new(start=False)
    third.add_job(shared_jobs.tick, "interval", seconds=30, id="r", kwargs={"job": "r"}, replace_existing=True)
    third.start(paused=True)
    assert stored_state(first, "r")["next_run_time"] is None  # a paused job stays paused
    fourth = nodes.new(start=False)
    fourth.add_job(shared_jobs.tick, "interval", seconds=10, id="r", kwargs={"job": "r"}, replace_existing=True)
    fourth.start(paused=True)
    assert stored_state(first, "r")["next_run_time"] is not None  # a new trigger: its own next run time


@pytest.mark.parametrize("kind", ALL)
def test_a_job_this_node_cannot_import_is_skipped_with_one_warning_and_kept(
    nodes: Nodes, caplog: pytest.LogCaptureFixture
) -> None:
    worker = nodes.new()
    store = worker._jobstores["default"]
    web = nodes.new(paused=True)
    web.add_job(shared_jobs.tick, "interval", seconds=1, id="ok", kwargs={"job": "ok"})
    state = pickle.loads(store._read_states(["ok"])["ok"])
    state.update(id="new-code", func="tests.not_deployed_here:job")
    assert store._insert("new-code", state["next_run_time"].timestamp(), pickle.dumps(state))
    caplog.set_level(logging.WARNING)
    wait_for(lambda: len(runs_of("ok")) >= 2, timeout=8)
    assert [j.id for j in worker.get_jobs()] == ["ok"]
    assert worker.get_job("new-code") is None
    assert "new-code" in store._read_states()  # never deleted
    time.sleep(1.2)  # more loop passes and reads: still one warning per node
    warnings = [r for r in caplog.records if "new-code" in r.getMessage()]
    assert len(warnings) == len(nodes.all), caplog.text


@pytest.mark.parametrize("kind", ALL)
def test_after_the_whole_cluster_was_down_a_job_catches_up_once(nodes: Nodes) -> None:
    web = nodes.new(paused=True)
    missed = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=50)
    # Stored as a scheduler leaves it: its next run time one of its trigger's fire times (a hand-over
    # while the nodes join catches up the trigger's fire times after the last one run).
    web.add_job(shared_jobs.tick, "interval", seconds=20, id="late", kwargs={"job": "late"}, misfire_grace_time=120,
                start_date=missed, next_run_time=missed)  # fmt: skip
    web.shutdown()
    started = time.time()
    for _ in range(3):
        nodes.new()
    wait_for(lambda: runs_of("late"), timeout=6)
    time.sleep(1.5)
    caught_up = [r for r in runs_of("late") if r[1] <= started]
    assert len(caught_up) == 1, runs_of("late")  # coalesced: one run, on one node
    assert started - 20 < caught_up[0][1] <= started  # the latest fire time missed


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "mongomock"))
def test_a_standby_reads_every_job_only_when_a_change_was_announced(nodes: Nodes) -> None:
    """The holder advances an every-second job (no change for the others): a standby's watcher
    wakes on SQLite's data version or its poll, reads the change counter, and not every job; an
    announced change is still read (and its event sent) at once."""
    holder = nodes.new()
    holder.add_job(shared_jobs.tick, "interval", seconds=1, id="busy", kwargs={"job": "busy"})
    wait_for(lambda: runs_of("busy"), timeout=8)
    standby = nodes.new()
    store = standby._jobstores["default"]
    watcher = standby._shared_jobs.watcher(store)
    assert watcher is not None
    time.sleep(0.5)
    reads, checks, ran = watcher.reads, watcher.checks, len(runs_of("busy"))
    time.sleep(3.2)
    assert len(runs_of("busy")) >= ran + 2  # the holder advanced it meanwhile
    assert watcher.checks >= checks + 2, "the watcher did not wake"
    assert watcher.reads - reads <= 1, f"{watcher.reads - reads} reads of every job in 3 s with no change announced"
    seen: list[Any] = []
    standby.add_listener(seen.append, EVENT_JOB_MODIFIED)
    holder.modify_job("busy", kwargs={"job": "busy", "tag": "v2"})
    wait_for(lambda: any(e.job_id == "busy" for e in seen), timeout=2)


@pytest.mark.parametrize("kind", backend_params("sqlite", "redis", "mongomock"))
def test_update_job_of_the_job_object_this_store_added_changes_it(nodes: Nodes) -> None:
    """APScheduler's job store API: ``update_job(job)`` of the object ``add_job`` was given writes
    its changes (a new Job object for the id is a replacement, which keeps the stored next run time)."""
    web = nodes.new(paused=True)
    job = web.add_job(shared_jobs.tick, "interval", hours=1, id="obj", kwargs={"job": "obj"})
    store = web._jobstores["default"]
    later = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=2)
    job._modify(next_run_time=later)
    store.update_job(job)
    assert (stored_state(web, "obj") or {})["next_run_time"] == later
    job._modify(next_run_time=None)  # paused, the same way
    store.update_job(job)
    assert (stored_state(web, "obj") or {})["next_run_time"] is None


@pytest.mark.parametrize("kind", backend_params("sqlite", "redis"))
def test_a_change_the_holders_loop_reads_first_is_still_reported_on_the_holder(nodes: Nodes) -> None:
    """Another writer changes a job; the holder's loop reads the changed job (it is due) and
    advances it before the holder's watcher has read the change: the watcher still reports it
    (EVENT_JOB_MODIFIED), instead of taking the loop's write for the change."""
    holder = nodes.new()
    holder.add_job(shared_jobs.tick, "interval", seconds=1, id="busy", kwargs={"job": "busy"})
    wait_for(lambda: runs_of("busy"), timeout=8)
    store = holder._jobstores["default"]
    watcher = holder._shared_jobs.watcher(store)
    assert watcher is not None
    watcher.stop()  # the holder learns of other writers' changes only when this test says so
    seen: list[Any] = []
    holder.add_listener(seen.append, EVENT_JOB_MODIFIED)
    web = nodes.new(paused=True)
    web.modify_job("busy", kwargs={"job": "busy", "tag": "v2"})
    wait_for(lambda: any(r[3] == "v2" for r in runs_of("busy")), timeout=5)  # the loop ran (and advanced) the new one
    time.sleep(0.3)
    holder._shared_jobs.refresh(store)
    assert [e.job_id for e in seen] == ["busy"]


@pytest.mark.parametrize("kind", backend_params("sqlite"))
def test_taking_a_shared_jobs_lock_logs_no_failover_catch_up(nodes: Nodes, caplog: pytest.LogCaptureFixture) -> None:
    """A shared job's missed fire times are the loop's (its stored next run time), not the takeover
    catch-up's: a node taking the lock of a job added after it started says nothing of a failover."""
    caplog.set_level(logging.INFO)
    worker = nodes.new()
    web = nodes.new(paused=True)
    time.sleep(1.2)  # a fire time of the job below falls between the worker's start and its first lock
    web.add_job(shared_jobs.tick, "interval", seconds=1, id="fresh", kwargs={"job": "fresh"},
                start_date=datetime.now(timezone.utc) - timedelta(seconds=30))  # fmt: skip
    wait_for(lambda: len(runs_of("fresh")) >= 2, timeout=8)
    assert {r[2] for r in runs_of("fresh")} == {worker.node_id}
    assert not [r for r in caplog.records if "catching up" in r.getMessage()], caplog.text
    no_duplicates(runs_of("fresh"))


@pytest.mark.parametrize("kind", backend_params("sqlite"))
def test_mutex_false_and_add_job_options_are_refused_in_a_shared_store(nodes: Nodes) -> None:
    sched = nodes.new(start=False)
    with pytest.raises(ConfigurationError, match="every node"):
        sched.add_job(shared_jobs.tick, "interval", seconds=1, id="x", kwargs={"job": "x"}, mutex=False)
    with pytest.raises(ConfigurationError, match=r"@sched\.mutex"):
        sched.add_job(shared_jobs.tick, "interval", seconds=1, id="x", kwargs={"job": "x"}, mutex={"lock": "l"})
    sched.add_job(shared_jobs.tick, "interval", seconds=1, id="y", kwargs={"job": "y"}, jobstore="local", mutex=False)


def test_a_job_store_mutexcron_cannot_share_is_used_as_it_is_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Custom(MemoryJobStore):
        pass

    class Other(BaseJobStore):  # type: ignore[misc]
        lookup_job = get_due_jobs = get_next_run_time = get_all_jobs = add_job = update_job = remove_job = remove_all_jobs = (
            lambda *a: None
        )

    other = Other()
    unshared = MutexScheduler(jobstores={"default": other}, lock_store=MemoryLockStore(), triggers=False)
    unshared.add_job(shared_jobs.tick, "interval", seconds=1, id="y", kwargs={"job": "y"})
    warnings = [r for r in caplog.records if "mutexcron shares SQLAlchemyJobStore" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING", "one loud line per store, not a refusal (drop-in)"
    assert type(other) is Other, "used as it is, unshared"
    ok = MutexScheduler(jobstores={"default": Custom()}, lock_store=MemoryLockStore(), triggers=False)
    ok.add_job(shared_jobs.tick, "interval", seconds=1, id="x", kwargs={"job": "x"})


@pytest.mark.redis
def test_a_redis_job_store_error_is_masked_by_the_one_rule() -> None:
    """The password in a driver's error text, raw or URL-encoded, and any URL quoted in it."""
    import redis
    from apscheduler.jobstores.redis import RedisJobStore

    from mutexcron.jobstores.redis import SharedRedisJobStore, _RedisSide

    store = RedisJobStore(password="p@ss/w0rd")
    store.__class__ = SharedRedisJobStore  # as the scheduler switches it; no connection is made
    side = _RedisSide(store)
    text = side.detail(redis.ConnectionError("auth p@ss/w0rd (p%40ss%2Fw0rd) refused by redis://u:p@ss/w0rd@h:1"))
    assert "p@ss" not in text and "p%40ss" not in text and "***" in text, text
