"""Metrics and health endpoints (mutexcron.observability.metrics): real HTTP requests to real ports.

``/metrics`` after known runs on SQLite, PostgreSQL and Redis (runs counted, a fire time already run elsewhere,
the holder's and the standby's leases, the store up), ``/healthz`` turning 503 with a masked reason
when a private Redis is killed, ``/readyz`` before and after start, the task pool's gauges,
``mutexcron run --metrics-port`` in a subprocess, the missing extra, a port in use.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from mutexcron import MutexScheduler
from mutexcron.errors import ConfigurationError, StoreUnavailableError
from mutexcron.events import (
    EVENT_LOCK_ACQUIRED,
    EVENT_LOCK_LOST,
    EVENT_LOCK_TAKEN_OVER,
    EVENT_RUN_FINISHED,
    EVENT_RUN_MISSED,
    EVENT_RUN_SKIPPED,
    MutexEvent,
)
from mutexcron.guard.job import _FIRE_TIME
from mutexcron.locks import LockStore, Node, lock_store_from_url
from mutexcron.observability.metrics import MeteredLockStore, Metrics
from tests.backends import StoreCtx
from tests.redis_servers import REDIS_SERVER, PrivateRedis, free_port

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# -- helpers ----------------------------------------------------------------------------------------
def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def get_json(port: int, path: str) -> tuple[int, dict[str, Any]]:
    status, body = get(port, path)
    return status, json.loads(body)


def scrape(port: int) -> Samples:
    status, body = get(port, "/metrics")
    assert status == 200, body
    return {
        (s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(body) for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_for(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def port_of(sched: MutexScheduler) -> int:
    assert sched._observability is not None
    return sched._observability.address[1]


def make(url: str, **options: Any) -> MutexScheduler:
    """A scheduler with metrics on a free local port and one guarded every-second job counting its runs."""
    sched = MutexScheduler(lock_url=url, metrics_port=free_port(), metrics_host="127.0.0.1", **options)

    @sched.mutex(lock="tick", unactive_interval=2)
    @sched.cron_schedule(second="*", id="tick")
    def tick(**attrs: Any) -> dict[str, int]:
        return {"n": attrs.get("n", 0) + 1}

    return sched


def runs_stored(store: Any) -> int:
    record = store.read("tick")
    return int(record.attrs.get("n", 0)) if record is not None else 0


def run_guarded(sched: MutexScheduler, job_id: str, fire_time: Any) -> Any:
    """Run a guarded job's fire time by hand, as mutexcron's executor would (its real store calls)."""
    job = sched.get_job(job_id)

    def call() -> Any:
        _FIRE_TIME.set(fire_time)
        return job.func()

    return contextvars.copy_context().run(call)


# -- the listener on its own ------------------------------------------------------------------------
@pytest.mark.memory
def test_events_feed_the_metrics() -> None:
    metrics = Metrics()
    emit = metrics.on_event
    # Runs are told by the guards as they happen (GuardContext.run_stats), not through events.
    metrics.run_started("j", "L", 0.25)
    metrics.run_started("j", "L", -1.0)  # a clock stepped back: counted as 0
    metrics.run_finished("j", "L", "success", 1.5)
    metrics.run_finished("j", "L", "error", 0.5)
    emit(MutexEvent(EVENT_RUN_FINISHED, lock="L", job_id="j", outcome="success", duration=9.0))  # not counted twice
    emit(MutexEvent(EVENT_RUN_SKIPPED, lock="L", job_id="j", reason="paused"))  # counted by the guards, not here
    skipped = {("j", "L", "already-run"): 1, ("j", "L", "not-holder"): 2, ("j", "L", "paused"): 1,
               ("j", "L", "lease-expired"): 1, ("j", "L", "stopping"): 1}  # fmt: skip
    metrics.count_skips_of(SimpleNamespace(skipped_runs=lambda: skipped))  # what a scheduler's guards counted
    emit(MutexEvent(EVENT_RUN_MISSED, lock="L", job_id="j"))
    emit(MutexEvent(EVENT_LOCK_TAKEN_OVER, lock="L", token=3, previous_holder="other", stale_for=4.0))
    emit(MutexEvent(EVENT_LOCK_LOST, lock="L", token=3, reason="taken"))
    emit(MutexEvent(EVENT_LOCK_ACQUIRED, lock="L", token=4))  # no counter of its own

    sample = metrics.registry.get_sample_value
    runs = {
        outcome: sample("mutexcron_runs_total", {"job_id": "j", "lock": "L", "outcome": outcome})
        for outcome in ("success", "error", "skipped_already_run", "skipped_not_holder", "skipped_paused",
                        "skipped_lease_expired", "skipped_stopping")
    }  # fmt: skip
    assert runs == {
        "success": 1.0, "error": 1.0, "skipped_already_run": 1.0, "skipped_not_holder": 2.0, "skipped_paused": 1.0,
        "skipped_lease_expired": 1.0, "skipped_stopping": 1.0,
    }  # fmt: skip
    assert sample("mutexcron_run_duration_seconds_count", {"job_id": "j", "lock": "L"}) == 2.0
    assert sample("mutexcron_run_duration_seconds_sum", {"job_id": "j", "lock": "L"}) == 2.0
    assert sample("mutexcron_run_start_lag_seconds_sum", {"job_id": "j", "lock": "L"}) == 0.25
    assert sample("mutexcron_run_start_lag_seconds_bucket", {"job_id": "j", "lock": "L", "le": "0.005"}) == 1.0
    last = sample("mutexcron_last_success_timestamp_seconds", {"job_id": "j", "lock": "L"})
    assert last is not None and abs(last - time.time()) < 5
    assert sample("mutexcron_missed_runs_total", {"job_id": "j", "lock": "L"}) == 1.0
    assert sample("mutexcron_takeovers_total", {"lock": "L"}) == 1.0
    assert sample("mutexcron_leases_lost_total", {"lock": "L"}) == 1.0


@pytest.mark.memory
def test_series_name_their_lock_and_store_and_the_build_and_process_are_exported() -> None:
    """Issue 25 item 16: the last success is labelled by lock like its siblings (two locks may run
    jobs of one id in two schedulers of a process), store timings by store, and a node tells its
    versions (mutexcron_build_info) and its process's CPU and memory (the process collector)."""
    from importlib.metadata import version

    from mutexcron import __version__

    metrics = Metrics()
    metrics.run_finished("j", "L", "success", 1.0)
    metrics.observer("read")(0.002)
    sample = metrics.registry.get_sample_value
    assert sample("mutexcron_last_success_timestamp_seconds", {"job_id": "j", "lock": "L"}) is not None
    assert sample("mutexcron_store_operation_seconds_count", {"store": "lock", "operation": "read"}) == 1.0
    build = {"version": __version__, "apscheduler": version("APScheduler"), "python": platform.python_version()}
    assert sample("mutexcron_build_info", build) == 1.0
    if sys.platform.startswith("linux"):  # the process collector reads /proc
        assert (sample("process_cpu_seconds_total") or 0.0) > 0.0
        assert (sample("process_resident_memory_bytes") or 0.0) > 0.0


@pytest.mark.memory
def test_queued_updates_stay_bounded_without_scrapes_and_none_is_lost_across_threads() -> None:
    """Runs and store timings are queued on their path and folded in at scrape time, or by the
    update that finds FOLD_AT waiting: nobody scraping never grows the queues past that, and
    updates from many threads racing folds and scrapes are all counted."""
    import threading

    from mutexcron.observability.instruments import FOLD_AT

    metrics = Metrics()
    timing = metrics.observer("hand_off")
    cells = metrics.store_seconds.child(("hand_off",))
    per_thread = 3 * FOLD_AT

    def work() -> None:
        for i in range(per_thread):
            metrics.run_started("j", "L", 0.001)
            metrics.run_finished("j", "L", "success" if i % 2 else "error", 0.002)
            timing(0.003)
            assert len(metrics._run_news) <= FOLD_AT + 8 and len(cells.queued) <= FOLD_AT + 8  # a few in flight

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        metrics.registry.get_sample_value("mutexcron_runs_total", {"job_id": "j", "lock": "L", "outcome": "success"})
    for thread in threads:
        thread.join()
    sample = metrics.registry.get_sample_value
    runs = sample("mutexcron_runs_total", {"job_id": "j", "lock": "L", "outcome": "success"})
    errors = sample("mutexcron_runs_total", {"job_id": "j", "lock": "L", "outcome": "error"})
    assert runs == errors == 4 * per_thread / 2
    assert sample("mutexcron_run_start_lag_seconds_count", {"job_id": "j", "lock": "L"}) == 4 * per_thread
    assert sample("mutexcron_store_operation_seconds_count", {"store": "lock", "operation": "hand_off"}) == 4 * per_thread
    assert sample("mutexcron_store_operation_seconds_bucket", {"store": "lock", "operation": "hand_off", "le": "0.001"}) == 0.0


@pytest.mark.memory
def test_the_timed_store_times_its_calls_and_passes_everything_through() -> None:
    inner = lock_store_from_url("memory://metrics-proxy")
    metrics = Metrics()
    store = MeteredLockStore(inner, metrics)
    node = Node("n1", "10.0.0.1")
    assert store.acquire_or_renew("a", node, 5.0).acquired
    assert store.renew_many(node, {"a": 1}) == {"a"}
    assert store.read("a") is not None and store.masked_url == inner.masked_url
    sample = metrics.registry.get_sample_value
    assert sample("mutexcron_store_operation_seconds_count", {"store": "lock", "operation": "acquire_or_renew"}) == 1.0
    assert sample("mutexcron_store_operation_seconds_count", {"store": "lock", "operation": "read"}) == 1.0
    assert sample("mutexcron_lease_renew_seconds_count") == 1.0

    # Arguments pass through as given (a keyword the interface gains later included), failures count.
    seen: list[Any] = []
    inner.renew_many = lambda *args, **kwargs: seen.append((args, kwargs)) or set()  # type: ignore[method-assign]
    store.renew_many(node, {}, presence="p")
    assert seen == [((node, {}), {"presence": "p"})]

    def down(*_args: Any, **_kwargs: Any) -> set[str]:
        raise StoreUnavailableError("down")

    inner.renew_many = down  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailableError):
        store.renew_many(node, {"a": 1})
    assert sample("mutexcron_lease_renew_failures_total") == 1.0
    assert sample("mutexcron_lease_renew_seconds_count") == 3.0

    # Whatever the class does not time is the wrapped store's: a store's own attributes, and every
    # method or default of the LockStore interface (none is left to the interface's own default).
    inner.custom = 42  # type: ignore[attr-defined]
    assert store.custom == 42  # type: ignore[attr-defined]
    for name, value in vars(LockStore).items():
        if not name.startswith(("__", "_abc")):
            assert vars(MeteredLockStore).get(name) is not value, name
    store.close()


# -- runs, skips and leases on a real store ---------------------------------------------------------
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
def test_scrape_after_known_runs(ctx: StoreCtx) -> None:
    assert ctx.url is not None
    # placement="first": the node started first keeps the lock (balanced placement could hand it to
    # the other one), so that the figures below are the holder's and the standby's.
    holder, standby = make(ctx.url, node_id="holder", placement="first"), make(ctx.url, node_id="standby", placement="first")
    store = ctx.make()
    try:
        holder.start()
        wait_for("the holder's lease", lambda: holder._leases is not None and "tick" in holder._leases.held())
        standby.start()
        wait_for("3 runs", lambda: runs_stored(store) >= 3)
        wait_for("a standby tick", lambda: value(scrape(port_of(standby)), "mutexcron_runs_total", job_id="tick", lock="tick",
                                                 outcome="skipped_not_holder"))  # fmt: skip

        holder.pause()  # no new fire time: the runs counted and the runs stored must agree
        time.sleep(0.3)
        wait_for("the last run to end", lambda: not holder.running_guarded_jobs())
        runs = runs_stored(store)
        record = store.read("tick")
        assert record is not None

        h, s = scrape(port_of(holder)), scrape(port_of(standby))
        assert value(h, "mutexcron_runs_total", job_id="tick", lock="tick", outcome="success") == runs
        assert value(h, "mutexcron_run_duration_seconds_count", job_id="tick", lock="tick") == runs
        assert value(h, "mutexcron_run_start_lag_seconds_count", job_id="tick", lock="tick") == runs
        assert (value(h, "mutexcron_last_success_timestamp_seconds", job_id="tick", lock="tick") or 0) > time.time() - 30
        assert value(h, "mutexcron_lease_held", lock="tick") == 1.0
        assert value(s, "mutexcron_lease_held", lock="tick") == 0.0
        assert value(h, "mutexcron_locks_held", node="holder") == 1.0
        assert value(h, "mutexcron_node_weight", node="holder", tags="") == 1.0, "first placement: this node alone"
        assert value(s, "mutexcron_locks_held", node="standby") == 0.0
        assert value(s, "mutexcron_runs_total", job_id="tick", lock="tick", outcome="success") is None
        assert value(h, "mutexcron_store_up", store="lock") == 1.0
        assert value(s, "mutexcron_store_up", store="lock") == 1.0
        assert (value(h, "mutexcron_lease_renew_seconds_count") or 0) >= 1  # renewed every lease/3
        assert value(h, "mutexcron_lease_renew_failures_total") == 0.0
        assert (value(h, "mutexcron_store_operation_seconds_count", store="lock", operation="claim_many") or 0) >= 1
        assert (value(h, "mutexcron_store_operation_seconds_count", store="lock", operation="hand_off") or 0) >= runs
        assert value(h, "mutexcron_tasks", code="x", state="queued") is None  # no task handlers: no task metrics

        # The holder stops (releasing the lease); the standby takes the lock and is handed the
        # fire time the holder ran last: already run, not run again.
        last_fire = record.fire_times["tick"]
        holder.shutdown()
        wait_for("the standby's lease", lambda: "tick" in standby._leases.held())  # type: ignore[union-attr]
        assert run_guarded(standby, "tick", last_fire) is None
        s = scrape(port_of(standby))
        assert value(s, "mutexcron_runs_total", job_id="tick", lock="tick", outcome="skipped_already_run") == 1.0
        assert value(s, "mutexcron_lease_held", lock="tick") == 1.0
    finally:
        for sched in (holder, standby):
            if sched.running:
                sched.shutdown()


# -- health and readiness ---------------------------------------------------------------------------
@pytest.fixture
def redis_with_password() -> Iterator[PrivateRedis]:
    """A private redis-server with a password (to check it never shows), killed afterwards."""
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="mc-redis-"))
    server = PrivateRedis(workdir, password="s3cret-pw")
    try:
        server.start()
        yield server
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.redis
def test_healthz_turns_503_with_a_masked_reason_when_the_store_goes_away(redis_with_password: PrivateRedis) -> None:
    sched = MutexScheduler(lock_url=redis_with_password.url, metrics_port=free_port(), metrics_host="127.0.0.1")

    @sched.mutex(lock="beat", unactive_interval=1)
    @sched.interval_schedule(hours=1)
    def beat() -> None:
        pass

    sched.start()
    try:
        port = port_of(sched)
        wait_for("a healthy node", lambda: get(port, "/healthz")[0] == 200 and "beat" in sched._leases.held())  # type: ignore[union-attr]
        assert get_json(port, "/healthz") == (200, {"status": "ok"})
        assert value(scrape(port), "mutexcron_store_up", store="lock") == 1.0

        redis_with_password.kill()
        wait_for("the lock store seen down", lambda: value(scrape(port), "mutexcron_store_up", store="lock") == 0.0)
        status, body = get_json(port, "/healthz")
        assert status == 503 and body["status"] == "unhealthy", body
        assert body["reason"] == f"lock store redis://:***@127.0.0.1:{redis_with_password.port}/0 is unreachable", body
        raw = get(port, "/metrics")[1] + get(port, "/healthz")[1] + get(port, "/readyz")[1]
        assert "s3cret" not in raw
        wait_for("a failed renewal", lambda: (value(scrape(port), "mutexcron_lease_renew_failures_total") or 0) >= 1)
        assert get(port, "/readyz")[0] == 200  # still running: ready, but not healthy
    finally:
        sched.shutdown(wait=False)


@pytest.mark.sqlite
def test_readyz_503_before_start_200_after_and_nothing_after_shutdown(tmp_path: Path) -> None:
    sched = make(f"sqlite:///{tmp_path}/ready.db")
    obs = sched._observability
    assert obs is not None
    port = obs.address[1]
    obs.start(sched, sched.lock_store)  # serve before start(), as start() itself does first
    try:
        assert get_json(port, "/readyz") == (503, {"status": "not ready", "reason": "the scheduler is not running"})
        assert get_json(port, "/healthz") == (503, {"status": "unhealthy", "reason": "the scheduler has not started"})
        assert get(port, "/nowhere")[0] == 404
        sched.start()  # the same server goes on
        assert get_json(port, "/readyz") == (200, {"status": "ok"})
        wait_for("healthy", lambda: get(port, "/healthz")[0] == 200)
    finally:
        sched.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)


# -- the task pool ----------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_task_gauges_and_worker_counts(tmp_path: Path) -> None:
    sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/tasks.db", metrics_port=free_port(), metrics_host="127.0.0.1")
    done: list[str] = []

    @sched.tasks.handler("mail", lease=5)
    def mail(task: Any) -> None:
        done.append(task.key)

    sched.tasks.add("mail", "now", due=timedelta(0))
    sched.tasks.add("mail", "later-1", due=timedelta(hours=1))
    sched.tasks.add("mail", "later-2", due=timedelta(hours=2))
    sched.start()
    try:
        port = port_of(sched)
        wait_for("the due task to be done", lambda: sched._tasks.worker is not None and sched._tasks.worker.stats.done >= 1)
        samples = scrape(port)
        assert done == ["now"]
        assert value(samples, "mutexcron_tasks", code="mail", state="queued") == 2.0
        assert value(samples, "mutexcron_tasks", code="mail", state="running") == 0.0
        assert value(samples, "mutexcron_tasks", code="mail", state="failed") == 0.0
        assert value(samples, "mutexcron_task_oldest_overdue_seconds", code="mail") == 0.0
        # The table's rows: two queued, and the tombstone of "now".
        assert value(samples, "mutexcron_task_store_rows", kind="rows") == 3.0
        assert value(samples, "mutexcron_task_store_rows", kind="tombstones") == 1.0
        assert value(samples, "mutexcron_worker_tasks_total", event="done") == 1.0
        assert value(samples, "mutexcron_worker_tasks_total", event="claimed") == 1.0
        assert value(samples, "mutexcron_task_lag_seconds_count", code="mail") == 1.0
        lag = value(samples, "mutexcron_task_lag_seconds_sum", code="mail")
        assert lag is not None and 0.0 <= lag < 5.0  # due when the scheduler started: the lag is its start-up
        assert value(samples, "mutexcron_store_up", store="task") == 1.0
        assert value(samples, "mutexcron_store_up", store="lock") is None  # no guarded lock: never asked
        # Counted at most every 15 s: a task added now shows at the next refresh, not at this scrape.
        sched.tasks.add("mail", "later-3", due=timedelta(hours=3))
        assert value(scrape(port), "mutexcron_tasks", code="mail", state="queued") == 2.0
        assert get_json(port, "/healthz") == (200, {"status": "ok"})
    finally:
        sched.shutdown()


@pytest.mark.sqlite
def test_the_trigger_requests_code_stays_internal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25 item 15: `mutexcron.trigger` (the code of `mutexcron trigger`'s requests) is served,
    but neither listed by sched.tasks.codes(), nor announced at start-up, nor a metrics series."""
    import logging

    from mutexcron.guard.triggers import TRIGGER_CODE

    sched = make(f"sqlite:///{tmp_path}/internal.db")

    @sched.tasks.handler("mail", lease=5)
    def mail(task: Any) -> None:
        pass

    sched.tasks.add("mail", "now", due=timedelta(0))
    caplog.set_level(logging.INFO, logger="mutexcron")
    sched.start()
    try:
        assert TRIGGER_CODE in sched.tasks.handlers  # served
        assert sched.tasks.codes() == ["mail"]
        worker = wait_for("the task worker", lambda: sched._tasks.worker)
        sched.tasks.store.add(TRIGGER_CODE, "no-such-job", timedelta(hours=1), {})  # one request waiting
        routed = next(code for code in worker.codes if code.startswith(TRIGGER_CODE + "."))  # a job's own code
        sched.tasks.store.add(routed, "no-such-job", timedelta(hours=1), {})
        wait_for("the mail task", lambda: worker.stats.done >= 1)
        codes = {dict(labels).get("code") for (_name, labels) in scrape(port_of(sched))}
        assert "mail" in codes and not {c for c in codes if c and c.startswith(TRIGGER_CODE)}
        started = [r.getMessage() for r in caplog.records if "runs task handlers" in r.getMessage()]
        assert started and all(TRIGGER_CODE not in line for line in started), started
    finally:
        sched.shutdown()


# -- configuration ----------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_without_prometheus_client_a_port_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # `import prometheus_client` raises ImportError
    with pytest.raises(ConfigurationError, match=r'pip install "mutexcron\[metrics\]"'):
        MutexScheduler(lock_url=f"sqlite:///{tmp_path}/x.db", metrics_port=9464)
    MutexScheduler(lock_url=f"sqlite:///{tmp_path}/x.db")  # no port: nothing needed

    jobs = tmp_path / "jobs.py"
    jobs.write_text("from mutexcron import MutexScheduler\nsched = MutexScheduler()\n")
    from mutexcron.cli.main import main

    result = CliRunner().invoke(main, ["run", str(jobs), "--lock-url", f"sqlite:///{tmp_path}/x.db", "--metrics-port", "9464"])
    assert result.exit_code == 2, result.output
    assert 'pip install "mutexcron[metrics]"' in result.output


@pytest.mark.sqlite
def test_port_from_the_environment_and_bad_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    monkeypatch.setenv("MUTEXCRON_METRICS_PORT", "9555")
    monkeypatch.setenv("MUTEXCRON_METRICS_HOST", "127.0.0.1")
    sched = MutexScheduler(lock_url=url)
    assert sched._observability is not None and sched._observability.address == ("127.0.0.1", 9555)
    sched.configure_mutex(metrics_port=9556)  # the command line's flag wins; the host stays
    assert sched._observability.address == ("127.0.0.1", 9556)
    monkeypatch.setenv("MUTEXCRON_METRICS_PORT", "nine")
    with pytest.raises(ConfigurationError, match="MUTEXCRON_METRICS_PORT='nine'"):
        MutexScheduler(lock_url=url)
    monkeypatch.delenv("MUTEXCRON_METRICS_PORT")
    assert MutexScheduler(lock_url=url)._observability is None
    with pytest.raises(ConfigurationError, match="metrics_port=70000"):
        MutexScheduler(lock_url=url, metrics_port=70000)


@pytest.mark.sqlite
def test_a_port_in_use_fails_the_start_before_anything_runs(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/x.db", metrics_port=port, metrics_host="127.0.0.1")
        with pytest.raises(ConfigurationError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            sched.start()
        assert not sched.running and sched._leases is None


@pytest.mark.sqlite
def test_nothing_is_imported_without_a_port(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        from mutexcron import MutexScheduler
        sched = MutexScheduler(lock_url="sqlite:///{tmp_path}/x.db")
        @sched.mutex(lock="a")
        @sched.cron_schedule(second="*")
        def a():
            pass
        sched.start(); sched.shutdown()
        loaded = [m for m in ("prometheus_client", "mutexcron.observability.metrics", "http.server") if m in sys.modules]
        print(loaded)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the command ------------------------------------------------------------------------------------
JOBS = """
from mutexcron import MutexScheduler
sched = MutexScheduler()

@sched.mutex(lock="tick", unactive_interval=2)
@sched.cron_schedule(second="*")
def tick(**attrs):
    return {"n": attrs.get("n", 0) + 1}
"""


@pytest.mark.sqlite
def test_mutexcron_run_serves_the_endpoints(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mutexcron", "run", str(jobs), "--lock-url", f"sqlite:///{tmp_path}/run.db",
         "--node-id", "solo", "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")},
    )  # fmt: skip
    try:

        def ready() -> bool:
            try:
                return get(port, "/readyz")[0] == 200
            except OSError:
                return False

        wait_for("/readyz", ready, timeout=30)
        wait_for("a run", lambda: value(scrape(port), "mutexcron_runs_total", job_id="tick", lock="tick", outcome="success"))
        samples = scrape(port)
        assert value(samples, "mutexcron_lease_held", lock="tick") == 1.0
        assert get_json(port, "/healthz") == (200, {"status": "ok"})
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert f"metrics and health endpoints on http://127.0.0.1:{port}" in out
    store = lock_store_from_url(f"sqlite:///{tmp_path}/run.db")
    record = store.read("tick")
    store.close()
    assert record is not None and record.holder is None  # stopped gracefully, lease released


# -- the server's exposure and bounds (issue 22, item 9) ------------------------------------------------
def _serving(tmp_path: Path, **options: Any) -> Any:
    sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/bind.db", metrics_port=0, **options)
    obs = sched._observability
    assert obs is not None
    obs.start(sched, sched.lock_store)
    return obs


@pytest.mark.sqlite
def test_the_endpoints_bind_this_host_only_unless_told_otherwise(tmp_path: Path) -> None:
    obs = _serving(tmp_path)
    try:
        assert obs._server.server_address[0] == "127.0.0.1" and obs.address[0] == "127.0.0.1"
    finally:
        obs.stop()
    exposed = _serving(tmp_path, metrics_host="0.0.0.0")  # the explicit choice
    try:
        assert exposed._server.server_address[0] == "0.0.0.0"
        assert get(exposed.address[1], "/readyz")[0] == 503
    finally:
        exposed.stop()


def _connection_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


@pytest.mark.sqlite
def test_idle_and_trickling_clients_are_capped_and_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 idle clients held 300 threads: now at most MAX_CONNECTIONS, each for REQUEST_DEADLINE at most."""
    from mutexcron.observability import metrics

    monkeypatch.setattr(metrics, "MAX_CONNECTIONS", 4, raising=False)
    monkeypatch.setattr(metrics, "REQUEST_DEADLINE", 1.0, raising=False)
    before = _connection_threads()
    obs = _serving(tmp_path)
    port = obs.address[1]
    clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(12)]
    try:
        stop = threading.Event()

        def trickle() -> None:  # a byte of the request line every 0.2 s: no read ever times out
            while not stop.wait(0.2):
                for client in clients:
                    with contextlib.suppress(OSError):
                        client.send(b"G")

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(0.5)
        assert _connection_threads() - before <= 4
        started = time.monotonic()
        for client in clients:  # each is closed by the server: at once (over the cap) or at its deadline
            with contextlib.suppress(OSError):
                while client.recv(1024):
                    pass
        assert time.monotonic() - started < 4.0
        stop.set()
        wait_for("connection threads ended", lambda: _connection_threads() == before)
        assert get(port, "/readyz")[0] == 503, "the server still answers (not started: 503)"
    finally:
        for client in clients:
            client.close()
        obs.stop()


@pytest.mark.sqlite
def test_the_share_gauges_show_every_live_nodes_weight_and_tags(tmp_path: Path) -> None:
    """Issue 33: under balanced placement each node's scrape shows every live node's placed share,
    weight and tags, as it read them from the presences."""
    url = f"sqlite:///{tmp_path}/m.db"
    big = make(url, node_id="big", placement="balanced", weight=2, tags=["eu", "reports"])
    small = make(url, node_id="small", placement="balanced")
    try:
        big.start()
        small.start()

        def both_seen() -> bool:
            scraped = scrape(port_of(small))
            return value(scraped, "mutexcron_node_weight", node="big", tags="eu,reports") == 2.0

        wait_for("small to read big's weight and tags", both_seen)
        scraped = scrape(port_of(small))
        assert value(scraped, "mutexcron_node_weight", node="small", tags="") == 1.0
        placed = {node: value(scraped, "mutexcron_locks_placed", node=node) for node in ("big", "small")}
        assert placed in ({"big": 1.0, "small": None}, {"big": None, "small": 1.0}), placed
    finally:
        small.shutdown()
        big.shutdown()
