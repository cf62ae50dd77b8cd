"""Trigger requests go only to the nodes that define the job (mutexcron/guard/triggers.py): each
request's code is ``mutexcron.trigger.<bucket>`` of its job id, and a node serves the buckets of the
jobs it defines (a job added after start included) and the plain code of earlier versions."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mutexcron import MutexScheduler, TaskPool
from mutexcron.guard.triggers import TRIGGER_BUCKETS, TRIGGER_CODE, is_trigger_code, trigger_code
from mutexcron.tasks import TaskRecord

pytestmark = pytest.mark.sqlite


def test_a_jobs_code_is_its_crc32_bucket_the_same_everywhere() -> None:
    assert trigger_code("nightly_report") == f"mutexcron.trigger.{zlib.crc32(b'nightly_report') % 256:03d}"
    assert (trigger_code("nightly_report"), trigger_code("billing_sync")) == ("mutexcron.trigger.178", "mutexcron.trigger.189")
    assert trigger_code("rapport-été") == f"mutexcron.trigger.{zlib.crc32('rapport-été'.encode()) % 256:03d}"
    assert trigger_code("\udcff") == trigger_code("\udcff")  # a lone surrogate (an odd file name) is hashed too
    buckets = {trigger_code(f"job-{i}") for i in range(5000)}
    assert len(buckets) == TRIGGER_BUCKETS == 256  # every bucket used, each code three digits
    assert all(len(code) == len("mutexcron.trigger.000") for code in buckets)
    assert all(is_trigger_code(code) for code in buckets) and is_trigger_code(TRIGGER_CODE)
    assert not is_trigger_code("mutexcron.triggered") and not is_trigger_code("email")


def other_bucket(*jobs: str) -> str:
    """A job id whose request code is none of ``jobs``'."""
    taken = {trigger_code(job) for job in jobs}
    return next(f"other-{i}" for i in range(1000) if trigger_code(f"other-{i}") not in taken)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[MutexScheduler, list[str]]]:
    ran: list[str] = []
    sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/routing.db")
    sched.add_job(lambda: ran.append("a"), "interval", hours=1, id="a", mutex="lock-a")
    sched.add_job(print, "interval", hours=1, id="unguarded")
    sched.start()
    try:
        yield sched, ran
    finally:
        sched.shutdown()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def request(sched: MutexScheduler, job: str, code: str | None = None) -> float:
    sched.tasks.store.add(code or trigger_code(job), job, timedelta(0), {"requested_by": "test"})
    return time.monotonic()


def test_a_node_serves_the_codes_of_the_jobs_it_defines_and_the_plain_one(node: tuple[MutexScheduler, list[str]]) -> None:
    sched, _ = node
    worker = wait_for("the task worker", lambda: sched._tasks.worker)
    served = {code for code in worker.codes if is_trigger_code(code)}
    assert served == {TRIGGER_CODE, trigger_code("a"), trigger_code("unguarded")}
    assert sched.tasks.codes() == []  # still mutexcron's own: not listed, not announced


def test_a_request_for_a_job_this_node_lacks_is_never_claimed_here(node: tuple[MutexScheduler, list[str]]) -> None:
    """Before, every node claimed every request and deferred the ones of jobs it lacks (another
    app's): the request's attempts counted up under this node."""
    sched, ran = node
    wait_for("the lock of a", lambda: sched.running_guarded_jobs() is not None and sched.lock_store.read("lock-a"))
    other = other_bucket("a", "unguarded")
    request(sched, other)
    time.sleep(2.5)  # the worker looks once a second: twice at least
    record = sched.tasks.get(trigger_code(other), other)
    assert record is not None and record.state == "queued" and record.attempt == 0 and record.owner is None, record
    started = request(sched, "a")  # a request of its own job runs at once, beside it
    wait_for("the request of a", lambda: sched.tasks.get(trigger_code("a"), "a") is None)
    assert ran == ["a"] and time.monotonic() - started < 10


def test_an_earlier_versions_plain_request_is_still_served(node: tuple[MutexScheduler, list[str]]) -> None:
    sched, ran = node
    request(sched, "a", TRIGGER_CODE)
    wait_for("the plain request of a", lambda: sched.tasks.get(TRIGGER_CODE, "a") is None)
    assert ran == ["a"]


def test_an_unguarded_job_still_fails_a_forced_request_on_the_node_that_defines_it(
    node: tuple[MutexScheduler, list[str]],
) -> None:
    sched, _ = node
    request(sched, "unguarded")
    failed: TaskRecord = wait_for("the failed request", lambda: _failed(sched, "unguarded"))
    assert failed.last_error is not None and failed.last_error.startswith("not guarded: "), failed


def _failed(sched: MutexScheduler, job: str) -> TaskRecord | None:
    record = sched.tasks.get(trigger_code(job), job)
    return record if record is not None and record.state == "failed" else None


def test_a_job_added_after_start_is_served_at_once(node: tuple[MutexScheduler, list[str]]) -> None:
    """The worker claims the new job's code from its next look (its waker listens for it too)."""
    sched, _ = node
    worker = wait_for("the task worker", lambda: sched._tasks.worker)
    ran = threading.Event()
    job = other_bucket("a", "unguarded")  # a bucket nobody served before
    sched.add_job(ran.set, "interval", hours=1, id=job, mutex="lock-late")
    assert trigger_code(job) in worker.handlers
    wait_for("the lock of the new job", lambda: sched.lock_store.read("lock-late") is not None)
    started = request(sched, job)
    assert ran.wait(15), "the request of the job added after start never ran"
    assert time.monotonic() - started < 10
    wait_for("the request's end", lambda: sched.tasks.get(trigger_code(job), job) is None)


def test_the_holder_fails_at_once_a_request_of_a_job_removed_from_its_jobs_file(tmp_path: Path) -> None:
    """A request naming a lock reaches its holder even for a job the holder no longer defines (the
    lock record names the jobs that ran under it): it fails "not defined" at once, not at the deadline."""
    url = f"sqlite:///{tmp_path}/removed.db"
    gone = other_bucket("a")
    before = MutexScheduler(lock_url=url)
    before.add_job(print, "interval", hours=1, id="a", mutex="reports")
    before.add_job(print, "interval", hours=1, id=gone, mutex="reports")
    before.start()
    try:
        request(before, gone)
        wait_for("the run of the job about to be removed", lambda: before.tasks.get(trigger_code(gone), gone) is None)
    finally:
        before.shutdown()
    after = MutexScheduler(lock_url=url)
    after.add_job(print, "interval", hours=1, id="a", mutex="reports")
    after.start()
    try:
        wait_for("the holder to serve the removed job's requests", lambda: trigger_code(gone) in after.tasks.handlers)
        after.tasks.store.add(trigger_code(gone), gone, timedelta(0), {"requested_by": "test", "lock": "reports"})
        failed: TaskRecord = wait_for("the failed request", lambda: _failed(after, gone))
        assert failed.last_error is not None and failed.last_error.startswith("not defined: "), failed
    finally:
        after.shutdown()


@pytest.mark.parametrize("kind", [pytest.param("sqlite"), pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_the_store_notice_for_a_job_added_after_start_wakes_the_worker(kind: str, tmp_path: Path) -> None:
    """The worker's waker listens for the codes it was built with (PostgreSQL NOTIFY, SQLite's
    change check): it is rebuilt with the new job's code, so a request made elsewhere wakes it,
    long before the backstop."""
    from tests.backends import cleanup_sql, require_server

    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/notice.db"
    else:
        base = require_server(kind)
        tag = f"{time.time_ns() % 10**9}"
        url = f"{base}{'&' if '?' in base else '?'}table=mc_route_{tag}&tasks_table=mc_route_{tag}_tasks"
    sched = MutexScheduler(lock_url=url)
    sched.add_job(print, "interval", hours=1, id="a", mutex="lock-a")
    sched.start()
    try:
        worker = wait_for("the task worker", lambda: sched._tasks.worker)
        worker.backstop = 60.0
        ran = threading.Event()
        job = other_bucket("a")
        sched.add_job(ran.set, "interval", hours=1, id=job, mutex="lock-late")
        wait_for("the lock of the new job", lambda: sched.lock_store.read("lock-late") is not None)
        time.sleep(1.5)  # the worker asleep again, on its new waker
        producer = TaskPool(url)  # another client: no wake-up inside this process
        try:
            started = time.monotonic()
            producer.store.add(trigger_code(job), job, timedelta(0), {"requested_by": "test"})
        finally:
            producer.close()
        assert ran.wait(20), "the request of the job added after start never ran"
        assert time.monotonic() - started < 5, "woken by the store's notice, not the 60 s backstop"
    finally:
        sched.shutdown()
        if kind != "sqlite":
            cleanup_sql(url)


@pytest.mark.memory
def test_an_earlier_request_queued_past_its_deadline_never_answers_a_new_one() -> None:
    """Issue 32 ("a stale or failed request never blocks a new one"): a catch-up request for a job no
    running node defined stayed queued; once a node that defines it started, it failed it (past its
    deadline), and that failure answered the `mutexcron trigger` made meanwhile, which had joined it."""
    from mutexcron.guard.run_requests import withdraw_stale_request
    from mutexcron.tasks.stores.memory import MemoryTaskStore

    now = [1000.0]
    store = MemoryTaskStore(f"memory://stale-requests-{id(now)}", clock=lambda: now[0])
    code = trigger_code("nightly")
    store.add(code, "nightly", timedelta(0), {"deadline": 300.0})
    withdraw_stale_request(store, code, "nightly")
    assert store.get(code, "nightly") is not None, "within its deadline: kept (a new request joins it)"
    now[0] += 301.0
    withdraw_stale_request(store, code, "nightly")
    assert store.get(code, "nightly") is None, "queued past its deadline: withdrawn"
    store.add(code, "nightly", timedelta(0), {"requested_by": "an earlier version"})  # no deadline
    now[0] += 10_000.0
    withdraw_stale_request(store, code, "nightly")
    assert store.get(code, "nightly") is not None, "a request with no deadline is never judged stale"
