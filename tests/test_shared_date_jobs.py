"""APScheduler's semantics kept on a shared store (issue #32): a date job rescheduled while its
holder's loop runs it keeps its lock and runs again (A8); a bare next run time change wakes the holder (B1).

A8: the loop reads the due date job, submits its run and removes it, only if nobody changed it
meanwhile. Before, when another writer rescheduled it in between, the removal was rightly refused,
but the holder still sent ``EVENT_JOB_REMOVED``, dropped the job's guard and released its lock:
the rescheduled run never happened, and the job stayed in the store.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from apscheduler.events import EVENT_JOB_REMOVED
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

from mutexcron import MutexScheduler
from mutexcron.jobstores.sqlalchemy import SharedSQLAlchemyJobStore
from mutexcron.locks.memory import MemoryLockStore
from tests import shared_jobs
from tests.backends import backend_params
from tests.shared_jobs import open_jobstore


def _paused_pair(tmp_path: Path, name: str) -> tuple[MutexScheduler, MutexScheduler]:
    """Two processes' schedulers on one SQLite job store, started paused (as web apps are)."""
    url, locks = f"sqlite:///{tmp_path}/jobs.db", MemoryLockStore(f"memory://{name}")
    pair = tuple(MutexScheduler(jobstores={"default": SQLAlchemyJobStore(url=url)}, lock_store=locks, node_id=node,
                                triggers=False) for node in ("a", "b"))  # fmt: skip
    for sched in pair:
        sched.start(paused=True)
    return pair[0], pair[1]


def _wait(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)


@pytest.mark.sqlite
def test_a_date_job_rescheduled_during_its_loop_pass_runs_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, locks = f"sqlite:///{tmp_path}/jobs.db", MemoryLockStore("memory://date-jobs")
    node = MutexScheduler(jobstores={"default": SQLAlchemyJobStore(url=url)}, lock_store=locks, unactive_interval=2,
                          node_id="holder", triggers=False)  # fmt: skip
    admin = MutexScheduler(jobstores={"default": SQLAlchemyJobStore(url=url)}, lock_store=locks, node_id="admin", triggers=False)
    removed: list[str] = []
    node.add_listener(lambda e: removed.append(e.job_id), EVENT_JOB_REMOVED)
    real_delete = SharedSQLAlchemyJobStore._delete
    again = {"at": None}

    def delete(store: Any, job_id: str, base: bytes | None) -> bool:
        if base is not None and again["at"] is None:  # the loop's removal: another writer reschedules first
            again["at"] = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=2)
            admin.reschedule_job(job_id, trigger="date", run_date=again["at"])
        return real_delete(store, job_id, base)

    monkeypatch.setattr(SharedSQLAlchemyJobStore, "_delete", delete)
    shared_jobs.clear_runs()
    admin.start(paused=True)
    node.start()
    try:
        first = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=2)
        admin.add_job(shared_jobs.tick, "date", run_date=first, id="once-more", kwargs={"job": "once-more"})
        _wait(lambda: len(shared_jobs.runs_of("once-more")) >= 2, 20)
        fires = [r[1] for r in shared_jobs.runs_of("once-more")]
        assert again["at"] is not None and fires == [first.timestamp(), again["at"].timestamp()]
        _wait(lambda: admin.get_job("once-more") is None, 10)  # removed after its last run
        assert removed == ["once-more"], "EVENT_JOB_REMOVED once, for the real removal"
    finally:
        node.shutdown(wait=False)
        admin.shutdown(wait=False)
        shared_jobs.clear_runs()


@pytest.mark.parametrize("kind", backend_params("sqlite", "redis"))
def test_a_bare_next_run_time_change_from_another_writer_wakes_the_holder(kind: str, tmp_path: Path) -> None:
    """B1: APScheduler's "run it now" (``modify_job(next_run_time=...)`` alone) from another process
    looks like the holder's advance, so it sent no event and, before, woke no loop."""
    with open_jobstore(kind, tmp_path) as jobs:
        locks = MemoryLockStore("memory://run-it-now")
        node = MutexScheduler(jobstores={"default": jobs.make()}, lock_store=locks, unactive_interval=2, node_id="holder",
                              triggers=False)  # fmt: skip
        admin = MutexScheduler(jobstores={"default": jobs.make()}, lock_store=locks, node_id="admin", triggers=False)
        shared_jobs.clear_runs()
        admin.start(paused=True)
        node.start()
        try:
            admin.add_job(shared_jobs.tick, "interval", minutes=10, id="later", kwargs={"job": "later"})
            _wait(lambda: node._shared_jobs.held_jobs(node._jobstores["default"]) == {"later"}, 20)
            time.sleep(0.5)  # the holder's loop now sleeps until the job's next run, 10 minutes away
            soon = datetime.now(timezone.utc) + timedelta(seconds=1)
            admin.modify_job("later", next_run_time=soon)
            _wait(lambda: shared_jobs.runs_of("later"), 10)
            assert [r[1] for r in shared_jobs.runs_of("later")] == [soon.timestamp()]
        finally:
            node.shutdown(wait=False)
            admin.shutdown(wait=False)
            shared_jobs.clear_runs()


@pytest.mark.sqlite
def test_a_process_adding_one_off_jobs_lets_go_of_them_once_they_are_gone(tmp_path: Path) -> None:
    """B5: the store kept every Job it added (``_added``), for ever, even after another node ran and removed it."""
    adder, other = _paused_pair(tmp_path, "bounded")
    try:
        later = datetime.now(timezone.utc) + timedelta(hours=1)
        for i in range(50):
            adder.add_job(shared_jobs.tick, "date", run_date=later, id=f"one-off-{i}", kwargs={"job": "x" * 1000})
        store = adder._jobstores["default"]
        assert len(store._added) == 50
        for i in range(50):
            other.remove_job(f"one-off-{i}")  # as a node removes a one-off job after its run
        _wait(lambda: not store._added, 15)
    finally:
        adder.shutdown(wait=False)
        other.shutdown(wait=False)


@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql"))
def test_finished_one_off_jobs_let_their_lock_records_go(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B5: the lock store kept a record per one-off job ever run. Now the holder forgets the record
    of a finished one-off job's own lock (its token stays spent), and keeps a lock that other jobs
    share or that a recurring job uses."""
    from mutexcron.locks.base import LockStore
    from tests.backends import open_backend

    monkeypatch.setattr(LockStore, "retired_keep", 0.0)  # a forget deletes the records retired before it
    with open_backend(kind, tmp_path) as ctx:
        locks = ctx.make()
        node = MutexScheduler(jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{tmp_path}/jobs.db")},
                              lock_store=locks, node_id="holder", triggers=False)  # fmt: skip
        shared_jobs.clear_runs()
        node.start()
        try:
            node.add_job(shared_jobs.tick, "interval", seconds=30, id="recurring", kwargs={"job": "recurring"},
                         next_run_time=datetime.now(timezone.utc))  # fmt: skip
            soon = datetime.now(timezone.utc) + timedelta(seconds=1)
            for i in range(20):
                node.add_job(shared_jobs.tick, "date", run_date=soon, id=f"once-{i}", kwargs={"job": f"once-{i}"})
            _wait(lambda: all(shared_jobs.runs_of(f"once-{i}") for i in range(20)), 30)
            _wait(lambda: {r.name for r in locks.list()} == {"recurring"}, 15)
            left = [i for i in range(20) if locks.read(f"once-{i}") is not None]
            assert len(left) <= 1, f"records deleted but the last one retired at most: {left}"
            node.add_job(shared_jobs.tick, "date", run_date=datetime.now(timezone.utc), id="once-0", kwargs={"job": "again"})
            _wait(lambda: shared_jobs.runs_of("again"), 15)
            assert all(r[0] != "again" or r[2] == "holder" for r in shared_jobs.RUNS)
        finally:
            node.shutdown(wait=False)
            shared_jobs.clear_runs()


@pytest.mark.sqlite
def test_job_defaults_coalesce_is_honoured_for_a_guarded_job(tmp_path: Path) -> None:
    """B2: ``job_defaults={"coalesce": False}`` was silently replaced by coalesce=True."""
    sched = MutexScheduler(jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{tmp_path}/jobs.db")},
                           lock_store=MemoryLockStore("memory://defaults"), job_defaults={"coalesce": False},
                           triggers=False)  # fmt: skip
    sched.start(paused=True)
    try:
        sched.add_job(shared_jobs.tick, "interval", seconds=30, id="every-fire-time", kwargs={"job": "x"})
        assert sched.get_job("every-fire-time").coalesce is False
        sched.add_job(shared_jobs.tick, "interval", seconds=30, id="coalesced", kwargs={"job": "y"}, coalesce=True)
        assert sched.get_job("coalesced").coalesce is True
    finally:
        sched.shutdown(wait=False)


@pytest.mark.sqlite
def test_a_start_up_writer_replacing_another_nodes_trigger_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """B4: nodes starting together with different trigger arguments: the last writer won, silently."""
    first, second = _paused_pair(tmp_path, "start-up-writers")
    try:
        first.add_job(shared_jobs.tick, "interval", seconds=3, id="r", kwargs={"job": "r"}, replace_existing=True)
        caplog.clear()
        second.add_job(shared_jobs.tick, "interval", seconds=3, id="r", kwargs={"job": "r"}, replace_existing=True)
        assert "replaces its trigger" not in caplog.text, "the same trigger: nothing to say"
        second.add_job(shared_jobs.tick, "interval", seconds=5, id="r", kwargs={"job": "r"}, replace_existing=True)
        assert "'r'" in caplog.text and "replaces its trigger interval[0:00:03] with interval[0:00:05]" in caplog.text
    finally:
        first.shutdown(wait=False)
        second.shutdown(wait=False)
