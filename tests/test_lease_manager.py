"""Issue 8, part B: no guarded run outside a valid lease.

The slow-network cases put a TCP proxy (tests/netproxy.py) between the node and a real Redis
or SQLite's write lock in the way; nothing of mutexcron's own is replaced.
"""

from __future__ import annotations

import itertools
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mutexcron import MutexScheduler, current_lease
from mutexcron.heartbeat import LeaseManager
from mutexcron.locks import Node, RunInfo, lock_store_from_url
from mutexcron.locks.memory import MemoryLockStore
from tests.backends import FakeClock, cleanup_redis, cleanup_sql, require_server, sql_url
from tests.netproxy import DelayProxy


@pytest.fixture
def redis_proxy() -> Any:
    url = require_server("redis")
    host_port = url.split("://", 1)[1].split("/", 1)[0]
    host, _, port = host_port.rpartition("@")[2].partition(":")
    proxy = DelayProxy(host, int(port or 6379))
    namespace = f"lm-{secrets.token_hex(4)}"
    db = url.split("://", 1)[1].partition("/")[2].partition("?")[0] or "0"  # the server URL's db, not always 0
    yield proxy, f"redis://127.0.0.1:{proxy.port}/{db}?namespace={namespace}", f"{url}?namespace={namespace}"
    proxy.close()
    cleanup_redis(f"{url}?namespace={namespace}")


def warm_connections(store: Any, count: int = 8) -> None:
    """Open ``count`` pooled connections now, so that later calls need no handshake through a
    slow proxy (a handshake is several round trips, each delayed)."""
    pool = store._redis.connection_pool
    conns = [pool.get_connection() for _ in range(count)]
    for conn in conns:
        pool.release(conn)


def wait_until_fraction(low: float, high: float) -> None:
    """Sleep until the wall clock's fraction of a second is in [low, high)."""
    while not low <= time.time() % 1 < high:
        time.sleep(0.005)


# -- B6 -----------------------------------------------------------------------------------------
@pytest.mark.redis
def test_shutdown_waits_for_a_tick_in_flight_and_never_runs_without_the_lease(redis_proxy: Any) -> None:
    """Before: stop() saw no running job while a tick's acquire was in flight and released the
    lease; the acquire's reply came back after the release and the job ran with holder = null."""
    proxy, via_proxy, direct_url = redis_proxy
    direct = lock_store_from_url(direct_url)
    seen: list[tuple[str | None, int, int]] = []
    sched = MutexScheduler(lock_url=via_proxy, node_id="n1", unactive_interval=3)

    @sched.mutex(lock="b6")
    @sched.cron_schedule(second="*")
    def job() -> None:
        record = direct.read("b6")
        seen.append((record.holder if record else None, record.token if record else -1, current_lease().token))

    sched.start()
    try:
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen, "the job never ran"
        warm_connections(sched.lock_store)
        proxy.reply_delay = 0.7
        wait_until_fraction(0.9, 1.0)
        wait_until_fraction(0.25, 0.4)  # this second's tick went out after the delay began: in flight now
        sched.shutdown(wait=True)
    finally:
        proxy.reply_delay = 0.0
        if sched.running:
            sched.shutdown(wait=False)
    record = direct.read("b6")
    direct.close()
    assert all(holder == "n1" and token == lease for holder, token, lease in seen), seen
    assert record is not None and record.holder is None, "the lease must be released after the last run"


# -- B7 -----------------------------------------------------------------------------------------
@pytest.mark.redis
def test_a_reply_later_than_the_lease_never_starts_the_job(redis_proxy: Any) -> None:
    """Before: nothing re-checked the lease between the store's "yours" and the job's first line."""
    proxy, via_proxy, _direct_url = redis_proxy
    runs: list[float] = []
    sched = MutexScheduler(lock_url=via_proxy, node_id="n1", unactive_interval=1)
    sched.add_job(lambda: runs.append(time.monotonic()), "cron", second="*", id="b7", mutex="b7")
    sched.start()
    try:
        deadline = time.monotonic() + 10
        while not runs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runs, "the job never ran"
        warm_connections(sched.lock_store)
        wait_until_fraction(0.3, 0.5)
        proxy.reply_delay = 1.5  # every reply now arrives after the lease it grants has run out
        slow_since = time.monotonic()
        time.sleep(4.5)
    finally:
        proxy.reply_delay = 0.0
        sched.shutdown(wait=False)
    late = [t for t in runs if t > slow_since]
    assert late == [], "a run started after its lease had run out by the node's monotonic clock"


# -- B8 -----------------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_contention_is_not_counted_as_a_renewal(tmp_path: Path) -> None:
    """Before: SQLite busy -> re-read -> "acquired" (we were the holder) -> the deadline moved on."""
    url = f"sqlite:///{tmp_path}/busy.db"
    store = lock_store_from_url(url, connect_timeout=0.3)
    clock = FakeClock()
    manager = LeaseManager(store, Node("a", "ip-a"), {"l": 3.0}, clock=clock)
    first = manager.tick("l", None)
    assert first is not None and first.acquired
    blocker = sqlite3.connect(tmp_path / "busy.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds SQLite's write lock
    try:
        clock.advance(2.0)
        busy = manager.tick("l", None)
        assert busy is not None and busy.uncertain and not busy.acquired
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert manager.holds("l", first.token), "contention is not a loss either"
    clock.advance(1.5)  # past the deadline of the last real renewal
    assert not manager.holds("l", first.token), "contention must not extend the lease"
    store.close()


# -- B9 -----------------------------------------------------------------------------------------
@pytest.mark.memory
def test_a_late_refused_finish_of_an_old_token_keeps_the_newer_lease() -> None:
    clock = FakeClock()
    store = MemoryLockStore(clock=clock)
    a = LeaseManager(store, Node("a", "ip-a"), {"l": 1.0}, clock=clock)
    b = LeaseManager(store, Node("b", "ip-b"), {"l": 1.0}, clock=clock)
    old = a.tick("l", None)
    assert old is not None and old.acquired
    clock.advance(2.0)
    assert b.tick("l", None).acquired  # type: ignore[union-attr]
    clock.advance(2.0)
    new = a.tick("l", None)
    assert new is not None and new.acquired and new.token == old.token + 2
    assert not a.finish("l", old.token, set(), {"n": 1}, RunInfo(0.1), "job"), "the old run's write is refused"
    assert a.holds("l", new.token), "a refused write of token 1 must not drop the lease of token 3"


@pytest.mark.memory
def test_expiry_does_not_drop_a_lease_renewed_meanwhile() -> None:
    clock = FakeClock()
    store = MemoryLockStore(clock=clock)
    manager = LeaseManager(store, Node("a", "ip-a"), {"l": 1.0}, clock=clock)
    first = manager.tick("l", None)
    assert first is not None
    clock.advance(0.9)
    manager.run_once()  # renews: the deadline moves to now + 1
    clock.advance(0.5)
    manager.run_once()
    assert manager.holds("l", first.token)


@pytest.mark.memory
def test_a_standby_s_refresh_rounds_renew_its_leases_once_per_period_and_never_let_them_lapse() -> None:
    """Issue 33: a node that holds one lock and watches another runs a round every second (the
    standby refresh), but renews its leases once per lease/3, not in every round."""
    clock = FakeClock()
    store = MemoryLockStore(clock=clock)
    other = LeaseManager(store, Node("b", "ip-b"), {"watched": 9.0}, clock=clock)
    manager = LeaseManager(store, Node("a", "ip-a"), {"mine": 9.0, "watched": 9.0}, clock=clock)
    assert other.tick("watched", None).acquired  # type: ignore[union-attr]
    mine = manager.tick("mine", None)
    assert mine is not None and mine.acquired
    renewals: list[float] = []
    renew_many = store.renew_many

    def counted(node: Node, *args: Any, **kwargs: Any) -> Any:
        if node.node_id == "a":
            renewals.append(clock())
        return renew_many(node, *args, **kwargs)

    store.renew_many = counted  # type: ignore[method-assign]
    waits = []
    for _ in range(30):  # 30 s of rounds, each after the wait the manager asked for
        wait = manager.run_once()
        waits.append(wait)
        other.run_once()
        clock.advance(min(wait, 1.0))
        assert manager.holds("mine", mine.token), "a lease lapsed between renewals"
    assert max(waits) <= 1.0, "a standby's rounds come every second"
    assert 9 <= len(renewals) <= 12, f"renewed {len(renewals)} times in 30 s (every 3 s expected)"
    assert all(b - a <= 3.0 for a, b in itertools.pairwise(renewals)), renewals


# -- B10 is tests/test_cli.py::test_sigterm_stops_a_blocking_scheduler_gracefully_and_releases --


# -- C15: the scheduler closes what it opened ----------------------------------------------------
@pytest.mark.postgresql
def test_shutdown_closes_a_store_built_from_the_url() -> None:
    url = require_server("postgresql")
    app = f"mcx_close_{secrets.token_hex(3)}"
    tables = sql_url(url, "t").partition("?")[2]
    sched = MutexScheduler(lock_url=f"{url}?application_name={app}&{tables}", node_id="c15", unactive_interval=1)
    sched.add_job(print, "interval", seconds=60, id="idle", mutex="c15")
    sched.start()
    probe = lock_store_from_url(f"{url}?{tables}")

    def connections() -> int:
        rows, _ = probe._execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = :app", {"app": app}, "probe"
        )
        return int(rows[0][0])

    try:
        deadline = time.monotonic() + 5
        while connections() == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert connections() > 0
        sched.shutdown(wait=True)
        deadline = time.monotonic() + 5
        while connections() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert connections() == 0, "the pool of a store built from the URL must be closed by shutdown()"
    finally:
        probe.close()
        cleanup_sql(f"{url}?{tables}")


@pytest.mark.memory
def test_jobs_added_while_the_heartbeat_runs_are_guarded(caplog: pytest.LogCaptureFixture) -> None:
    sched = MutexScheduler(lock_url=f"memory://c15-{secrets.token_hex(3)}", node_id="n", unactive_interval=0.3)
    sched.add_job(print, "interval", seconds=60, id="first", mutex="first")
    sched.start()
    try:
        adders = [
            threading.Thread(
                target=lambda k=k: [
                    sched.add_job(print, "interval", seconds=60, id=f"j{k}-{i}", mutex=f"l{k}-{i}") for i in range(100)
                ]
            )
            for k in range(3)
        ]
        for thread in adders:
            thread.start()
        for thread in adders:
            thread.join()
        time.sleep(0.5)
        assert len(sched.running_guarded_jobs()) == 0
        assert "heartbeat round failed" not in caplog.text
        assert sched._leases is not None and len(sched._leases.held()) == 301, "every added lock is taken"
    finally:
        sched.shutdown(wait=False)


def test_a_takeover_that_lands_after_the_locks_last_job_was_removed_is_released_at_once() -> None:
    """remove_lock while the heartbeat's acquire is in flight: the lease it then wins is not kept
    (renewed with no job, never released), it is released to the other nodes at once."""
    store = MemoryLockStore(f"memory://takeover-{secrets.token_hex(4)}")
    clock = FakeClock()
    manager = LeaseManager(store, Node("a", "ip-a"), {"l": 3.0}, clock=clock)
    acquire = store.acquire_or_renew

    def removed_meanwhile(name: str, node: Node, ttl: float, *args: Any, **kwargs: Any) -> Any:
        manager.remove_lock(name)  # another thread: the job's removal, between the choice and the reply
        return acquire(name, node, ttl, *args, **kwargs)

    store.acquire_or_renew = removed_meanwhile  # type: ignore[method-assign]
    manager._try_take_over("l", 3.0, None)
    assert "l" not in manager.held(), "a lease no job guards is not kept"
    record = store.read("l")
    assert record is not None and record.holder is None, "it is released in the store"
    manager._renew()  # the next round renews nothing and does not fail on the removed lock
