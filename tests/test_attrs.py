"""Issue 8, parts C, E and F: attrs hand-off, names, sizes and APScheduler's shutdown contract.

Each test runs real schedulers on a real store (a SQLite file unless marked otherwise).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mutexcron import AttrsError, ConfigurationError, MutexScheduler
from mutexcron.locks import lock_store_from_url
from tests.backends import cleanup_sql, require_server, sql_url

pytestmark = pytest.mark.sqlite


def wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/attrs.db"


# -- C12 ----------------------------------------------------------------------------------------
def test_stored_attrs_never_collide_with_positional_args(url: str) -> None:
    """Before: once a job returned {"region": ...}, every later run failed with "multiple values"."""
    sched = MutexScheduler(lock_url=url, node_id="n", unactive_interval=2)
    calls: list[tuple[str, int]] = []

    def report(region: str, cursor: int = 0) -> dict[str, Any]:
        calls.append((region, cursor))
        return {"region": "stored", "cursor": cursor + 1}

    errors: list[BaseException] = []
    sched.add_listener(lambda event: errors.append(event.exception) if event.exception else None, 1 << 13)  # EVENT_JOB_ERROR
    sched.add_job(report, "interval", seconds=1, args=["eu"], id="report", mutex="report")
    sched.start()
    try:
        wait_for(lambda: len(calls) >= 3)
    finally:
        sched.shutdown(wait=True)
    assert errors == []
    assert calls[:3] == [("eu", 0), ("eu", 1), ("eu", 2)], "the positional arg wins; the stored cursor is passed"


# -- C13 ----------------------------------------------------------------------------------------
def test_jobs_of_one_lock_keep_each_others_attrs(url: str) -> None:
    """Before: a job that returned only its own keys wiped its group mate's, and concurrent
    finishers under one token overwrote each other."""
    sched = MutexScheduler(lock_url=url, node_id="n", unactive_interval=2)
    started = threading.Barrier(2, timeout=5)

    def extract(extracted: int = 0) -> dict[str, int]:
        started.wait()  # both jobs of the group run at once, and finish at once
        return {"extracted": extracted + 1}

    def load(loaded: int = 0) -> dict[str, int]:
        started.wait()
        return {"loaded": loaded + 1}

    sched.add_job(extract, "cron", second="*", id="extract", mutex="etl")
    sched.add_job(load, "cron", second="*", id="load", mutex="etl")
    sched.start()
    store = lock_store_from_url(url)
    try:
        wait_for(lambda: (rec := store.read("etl")) is not None and rec.attrs.get("loaded", 0) >= 3)
    finally:
        sched.shutdown(wait=True)
    attrs = dict(store.read("etl").attrs)  # type: ignore[union-attr]
    store.close()
    assert abs(attrs["extracted"] - attrs["loaded"]) <= 1, attrs
    assert attrs["loaded"] >= 3 and attrs["extracted"] >= 3, attrs


def test_a_job_with_kwargs_still_replaces_the_attrs_it_was_given(url: str) -> None:
    sched = MutexScheduler(lock_url=url, node_id="n", unactive_interval=2)
    seen: list[dict[str, Any]] = []

    def job(**attrs: Any) -> dict[str, Any]:
        seen.append(dict(attrs))
        return {"step": 2} if attrs.get("step") == 1 else {"step": 1, "tmp": True}

    sched.add_job(job, "interval", seconds=1, id="job", mutex="replace")
    sched.start()
    try:
        wait_for(lambda: len(seen) >= 3)
    finally:
        sched.shutdown(wait=True)
    assert seen[:3] == [{}, {"step": 1, "tmp": True}, {"step": 2}], "keys it was given and did not return are gone"


# -- C15: a non-dict return ---------------------------------------------------------------------
def test_a_non_dict_return_keeps_the_attrs_and_is_not_a_failure(url: str, caplog: pytest.LogCaptureFixture) -> None:
    sched = MutexScheduler(lock_url=url, node_id="n", unactive_interval=2)
    runs: list[int] = []

    def job(n: int = 0) -> Any:
        runs.append(n)
        return {"n": n + 1} if n == 0 else 42

    sched.add_job(job, "interval", seconds=1, id="job", mutex="nd")
    sched.start()
    try:
        wait_for(lambda: len(runs) >= 3)
    finally:
        sched.shutdown(wait=True)
    store = lock_store_from_url(url)
    record = store.read("nd")
    store.close()
    assert record is not None and dict(record.attrs) == {"n": 1} and record.last_error is None
    assert runs[:3] == [0, 1, 1]
    assert caplog.text.count("returned int, not a dict") == 1, "warned once per job"


# -- F19 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lock", "problem"),
    [("", "non-empty"), ("x" * 192, "192 characters"), ("a\x00b", r"U\+0000"), ("report\n", r"U\+000A")],
)
def test_bad_lock_names_are_refused_before_any_store_call(lock: str, problem: str) -> None:
    sched = MutexScheduler(lock_url="memory://names")
    with pytest.raises(ConfigurationError, match=problem):
        sched.add_job(print, "interval", seconds=5, id="job", mutex=lock if lock else {"lock": ""})
    with pytest.raises(ConfigurationError, match="job id"):
        sched.add_job(print, "interval", seconds=5, id="j\x00b", mutex=True)
    with pytest.raises(ConfigurationError, match="lock name"):
        sched.mutex(lock="x" * 500)
    assert sched.get_jobs() == []


def test_the_longest_valid_name_works_on_every_server_store() -> None:
    from mutexcron.locks import Node
    from mutexcron.names import MAX_NAME_LENGTH

    name = "é" * MAX_NAME_LENGTH  # characters, not bytes: utf8mb4 and varchar count characters
    for kind in ("mysql", "postgresql", "redis"):
        base = require_server(kind)
        option = "namespace" if kind == "redis" else "table"
        store = lock_store_from_url(f"{base}?{option}=names_{secrets.token_hex(3)}")
        try:
            assert store.acquire_or_renew(name, Node("n", "ip"), 5).acquired
            assert store.read(name) is not None
        finally:
            if kind == "redis":
                store.destroy_namespace()  # type: ignore[attr-defined]
            else:
                cleanup_sql(store.url)
            store.close()


# -- F20 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sqlite", "mysql"])
def test_oversized_attrs_fail_the_run_keep_the_previous_attrs_and_do_not_stall(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: 20 MB of attrs on MariaDB looked like an outage; the run never finished, every later
    fire time was skipped and the lease was kept renewed."""
    url = f"sqlite:///{tmp_path}/big.db" if kind == "sqlite" else sql_url(require_server("mysql"), "big")
    sched = MutexScheduler(lock_url=url, node_id="n", unactive_interval=2, max_attrs_bytes=100_000)
    runs: list[int] = []

    def job(n: int = 0) -> dict[str, Any]:
        runs.append(n)
        return {"n": n + 1} if n == 0 else {"n": n + 1, "blob": "x" * 20_000_000}

    sched.add_job(job, "interval", seconds=1, id="big", mutex="big")
    sched.start()
    store = lock_store_from_url(url)
    try:
        wait_for(lambda: len(runs) >= 4, timeout=20)
    finally:
        sched.shutdown(wait=True)
    record = store.read("big")
    store.close()
    if kind == "mysql":
        cleanup_sql(url)
    assert runs[:4] == [0, 1, 1, 1], "later fire times still run, with the previous attrs"
    assert record is not None and dict(record.attrs) == {"n": 1}
    assert record.last_error is not None and "over the limit of 100,000 bytes" in record.last_error
    assert "unreachable" not in caplog.text
    assert record.holder is None, "the lease was released at shutdown: no run was stuck"


def test_attrs_limit_names_the_job_and_the_sizes() -> None:
    from mutexcron.locks.record import dump_attrs

    with pytest.raises(AttrsError, match=r"job 'export' returned attrs of 2,000,0\d\d bytes.*limit of 1,000,000"):
        dump_attrs({"blob": "y" * 2_000_000}, job="export", limit=1_000_000)


# -- E17 ----------------------------------------------------------------------------------------
def test_shutdown_wait_true_waits_for_unguarded_jobs_as_apscheduler_does(url: str) -> None:
    sched = MutexScheduler(lock_url=url, node_id="n")
    finished: list[bool] = []
    began = threading.Event()

    def slow_unguarded() -> None:
        began.set()
        time.sleep(1.0)
        finished.append(True)

    sched.add_job(slow_unguarded, "date", id="slow")
    sched.start()
    assert began.wait(5)
    time.sleep(0.1)  # let APScheduler's loop finish its round (it removes the date job)
    sched.shutdown(wait=True)
    assert finished == [True], "shutdown(wait=True) returned while an unguarded job was still running"


def test_shutdown_wait_is_bounded_for_guarded_jobs(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    sched = MutexScheduler(lock_url=url, node_id="n", shutdown_timeout=0.5)
    began, release = threading.Event(), threading.Event()

    def stuck() -> None:
        began.set()
        release.wait(10)

    sched.add_job(stuck, "date", id="stuck", mutex="stuck")
    sched.start()
    assert began.wait(5)
    t0 = time.monotonic()
    sched.shutdown(wait=True)
    assert time.monotonic() - t0 < 3
    release.set()
    assert "not releasing lock 'stuck'" in caplog.text


def test_text_that_is_not_valid_unicode_is_an_attrs_error_before_any_write() -> None:
    from mutexcron.locks.record import dump_attrs

    with pytest.raises(AttrsError, match="not valid Unicode"):
        dump_attrs({"path": "caf\udce9.txt"}, job="scan")


# -- issue 25, item 11 -------------------------------------------------------------------------------
def test_attrs_that_are_not_json_log_one_error_line_then_count(url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Before: every fire time printed APScheduler's 'Job raised an exception' with a traceback
    through 15 library frames. Now: one ERROR line with the problem, a count, and listeners still
    get EVENT_JOB_ERROR with the AttrsError."""
    from datetime import datetime, timezone

    sched = MutexScheduler(lock_url=url, node_id="n", unactive_interval=2)
    runs: list[int] = []

    def stamp() -> dict[str, Any]:
        runs.append(1)
        return {"when": datetime.now(timezone.utc)}

    errors: list[BaseException] = []
    sched.add_listener(lambda event: errors.append(event.exception), 1 << 13)  # EVENT_JOB_ERROR
    sched.add_job(stamp, "interval", seconds=1, id="stamp", mutex="stamp")
    caplog.set_level("DEBUG", logger="mutexcron")
    sched.start()
    try:
        wait_for(lambda: len(errors) >= 3)
    finally:
        sched.shutdown(wait=True)
    assert all(isinstance(e, AttrsError) for e in errors) and "'when'" in str(errors[0])
    failing = [r for r in caplog.records if r.levelname == "ERROR" and "stamp" in r.getMessage()]
    assert len(failing) == 1 and "the previous attrs are kept" in failing[0].getMessage(), [r.getMessage() for r in failing]
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
    assert "raised an exception" not in caplog.text
    assert sched.guard_of("stamp").attrs_errors >= 3  # type: ignore[union-attr]
    store = lock_store_from_url(url)
    record = store.read("stamp")
    store.close()
    assert record is not None and record.last_error is not None and "AttrsError" in record.last_error
