"""The task stores' wakers (mutexcron/tasks/wakeups/) on real servers.

A waker wakes within a loose bound (CI is loaded) when another connection or process adds a task
due sooner or hands a claimed one back, and not for other codes, nor (Redis, SQLite) for a task behind the head of its code;
it survives a killed listening connection by polling, then listening again; ``close()`` releases
its connection. A missing server skips its tests, and fails the run under ``CI=true``.
"""

from __future__ import annotations

import logging
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from mutexcron.tasks import TaskStore, task_store_from_url
from mutexcron.tasks.wakeups.base import DEFAULT_POLL, Waker
from tests.backends import backend_params, cleanup_redis, drop_tasks_table, require_server

#: The loose bound on a wake-up's latency.
WAKE_BOUND = 1.0
NOTICE_KINDS = ("sqlite", "postgresql", "redis", "redis-cluster")
notice_backends = pytest.mark.parametrize("kind", backend_params(*NOTICE_KINDS))


@dataclass
class WakeCtx:
    """An isolated task table (or namespace) on one backend; ``make()`` opens another client on it."""

    kind: str
    url: str
    opened: list[TaskStore] = field(default_factory=list)
    wakers: list[Waker] = field(default_factory=list)

    def make(self) -> TaskStore:
        store = task_store_from_url(self.url)
        self.opened.append(store)
        return store

    def waker(self, store: TaskStore, codes: tuple[str, ...] = ("a",)) -> Waker:
        waker = store.waker(codes)
        self.wakers.append(waker)
        return waker

    def add_elsewhere(self, code: str, key: str, seconds: float) -> float:
        """Add a task due in ``seconds`` from another connection (SQLite: another process); the time it was added."""
        if self.kind != "sqlite":
            self.make().add(code, key, timedelta(seconds=seconds))
            return time.time()
        script = (
            "import sys, time; from datetime import timedelta; from mutexcron.tasks import task_store_from_url; "
            "s = task_store_from_url(sys.argv[1]); s.add(sys.argv[2], sys.argv[3], timedelta(seconds=float(sys.argv[4]))); "
            "print(time.time()); s.close()"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, self.url, code, key, str(seconds)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return float(done.stdout.strip())

    def release_elsewhere(self, node: str, code: str, key: str, token: int) -> float:
        """Hand a claimed task back from another connection (SQLite: another process); the time it was handed back."""
        if self.kind != "sqlite":
            assert self.make().release(node, [(code, key, token)]) == 1
            return time.time()
        script = (
            "import sys, time; from mutexcron.tasks import task_store_from_url; s = task_store_from_url(sys.argv[1]); "
            "assert s.release(sys.argv[2], [(sys.argv[3], sys.argv[4], int(sys.argv[5]))]) == 1; print(time.time()); s.close()"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, self.url, node, code, key, str(token)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return float(done.stdout.strip())


@pytest.fixture
def wake_ctx(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[WakeCtx]:
    tag = secrets.token_hex(4)
    cleanup: Callable[[], None] | None = None
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/wake-{tag}.db"
    elif kind == "redis":
        base = require_server(kind)
        url = f"{base}{'&' if '?' in base else '?'}namespace=wake-{tag}"
        cleanup = lambda: cleanup_redis(url)  # noqa: E731
    elif kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").namespaced_url(f"wake-{tag}")
        cleanup = lambda: cleanup_redis(url)  # noqa: E731
    else:
        base = require_server(kind)
        url = f"{base}{'&' if '?' in base else '?'}tasks_table=mc_wake_{tag}"
        cleanup = lambda: drop_tasks_table(url)  # noqa: E731
    ctx = WakeCtx(kind, url)
    try:
        yield ctx
    finally:
        for waker in ctx.wakers:
            waker.close()
        for store in ctx.opened:
            store.close()
        if cleanup is not None:
            cleanup()



class Sleeper:
    """``waker.wait(timeout)`` in a thread: what it returned, and when."""

    def __init__(self, waker: Waker, timeout: float, settle: float = 0.2) -> None:
        self.result: bool | None = None
        self.ended = 0.0
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, args=(waker, timeout), daemon=True)
        self._thread.start()
        time.sleep(settle)  # it is waiting now

    def _run(self, waker: Waker, timeout: float) -> None:
        self.result = waker.wait(timeout)
        self.ended = time.time()

    def join(self) -> Sleeper:
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()
        return self


def _latency(ctx: WakeCtx, waker: Waker, code: str, key: str, seconds: float) -> float:
    """Seconds from another connection's add to the waker's wake-up (the wait must end woken)."""
    sleeper = Sleeper(waker, 30.0)
    added = ctx.add_elsewhere(code, key, seconds)
    sleeper.join()
    assert sleeper.result is True, "not woken by the add"
    return sleeper.ended - added


# -- notices -------------------------------------------------------------------------------------
@notice_backends
def test_an_add_elsewhere_wakes_the_waker_of_its_code(wake_ctx: WakeCtx) -> None:
    store = wake_ctx.make()
    store.ping()  # the table exists before the waker looks at it
    waker = wake_ctx.waker(store, ("a", "b"))
    latencies = [_latency(wake_ctx, waker, "a", "k1", 60)]  # the first task of its code
    latencies.append(_latency(wake_ctx, waker, "b", "k2", -1))  # due now: sooner than the head
    print(f"\n{wake_ctx.kind} wake latency: " + ", ".join(f"{x * 1000:.1f} ms" for x in latencies))
    assert max(latencies) < WAKE_BOUND


@notice_backends
def test_no_wake_for_another_code_nor_for_a_task_behind_the_head(wake_ctx: WakeCtx) -> None:
    store = wake_ctx.make()
    store.add("a", "head", timedelta(hours=1))
    waker = wake_ctx.waker(store, ("a",))
    while waker.wait(0.3):  # whatever the add above left behind
        pass
    sleeper = Sleeper(waker, 1.5)
    wake_ctx.add_elsewhere("b", "other", -1)  # another code, due now
    if wake_ctx.kind != "postgresql":  # PostgreSQL notifies every insert; the others only a new head
        wake_ctx.add_elsewhere("a", "later", 7200)
    assert sleeper.join().result is False
    assert _latency(wake_ctx, waker, "a", "sooner", 60) < WAKE_BOUND  # before the head: a notice


@notice_backends
def test_a_release_elsewhere_wakes_the_waker_of_its_code(wake_ctx: WakeCtx) -> None:
    """A task claimed for 5 minutes is handed back (a node stopping): the others take it at once,
    not when its lease would have ended (SQLite: the hand-back brings the earliest run_at forward)."""
    store = wake_ctx.make()
    store.add("a", "k", timedelta(seconds=-1))
    [task] = store.claim("leaving-node", ["a"], 1, 300)
    waker = wake_ctx.waker(wake_ctx.make(), ("a",))
    while waker.wait(0.3):  # whatever the add and the claim left behind
        pass
    sleeper = Sleeper(waker, 30.0)
    released = wake_ctx.release_elsewhere("leaving-node", "a", "k", task.token)
    sleeper.join()
    assert sleeper.result is True, "not woken by the release"
    latency = sleeper.ended - released
    print(f"\n{wake_ctx.kind} release wake latency: {latency * 1000:.1f} ms")
    assert latency < WAKE_BOUND
    assert [t.key for t in store.claim("other-node", ["a"], 1, 30)] == ["k"]


@pytest.mark.parametrize("kind", backend_params("redis"))
def test_redis_publishes_a_hand_back_and_an_attempt_end_that_come_first(wake_ctx: WakeCtx) -> None:
    from mutexcron.tasks import Done, Reschedule, Retry
    from mutexcron.tasks.stores.redis import RedisTaskStore

    store = wake_ctx.make()
    assert isinstance(store, RedisTaskStore)
    pubsub = store.backend.client.pubsub()  # type: ignore[no-untyped-call]
    pubsub.subscribe(store.backend.key("task_wake"))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"

    def published() -> list[str]:
        time.sleep(0.05)
        got = []
        while (message := pubsub.get_message(timeout=0.05)) is not None:
            got.append(message["data"])
        return got

    for key in ("k1", "k2"):
        store.add("r", key, timedelta(seconds=-1))
    assert published() == ["r"]
    claimed = store.claim("n", ["r"], 2, 30)
    assert store.release("n", [(t.code, t.key, t.token) for t in claimed]) == 2
    assert published() == ["r"], "before the head (the leases' end): once per code and call"
    [task, other] = store.claim("n", ["r"], 2, 30)
    assert store.complete("n", "r", task.key, task.token, Retry(timedelta(seconds=5), "e"))
    assert published() == ["r"], "the retry comes before the head (the other's lease end)"
    assert store.claim("n", ["r"], 1, 30) == []  # the retry is not due yet
    assert store.complete("n", "r", other.key, other.token, Reschedule(timedelta(hours=1)))
    assert store.complete_many("n", [("r", other.key, other.token, Done())]) == [False]
    assert published() == [], "behind the head (the retry): nobody waits for that"
    pubsub.close()


@pytest.mark.parametrize("kind", backend_params("redis"))
def test_redis_publishes_only_for_a_new_head(wake_ctx: WakeCtx) -> None:
    from mutexcron.tasks.stores.redis import RedisTaskStore

    store = wake_ctx.make()
    assert isinstance(store, RedisTaskStore)
    client = store.backend.client
    pubsub = client.pubsub()  # type: ignore[no-untyped-call]
    pubsub.subscribe(store.backend.key("task_wake"))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"

    def published() -> list[str]:
        time.sleep(0.05)
        got = []
        while (message := pubsub.get_message(timeout=0.05)) is not None:
            got.append(message["data"])
        return got

    store.add("a", "k1", timedelta(hours=1))
    assert published() == ["a"]  # the first task
    store.add("a", "k2", timedelta(hours=2))
    store.add("a", "k1", timedelta(hours=1, minutes=30))  # the head moved later: nobody waits for that
    store.add("a", "k2", timedelta(hours=3), on_conflict="keep")
    assert published() == []
    store.add("a", "k2", timedelta(minutes=5))  # replaced: before the head
    assert published() == ["a"]
    store.add("b", "f", timedelta(seconds=-1))
    assert published() == ["b"]
    [claimed] = store.claim("n", ["b"], 1, 30)
    assert store.add("b", "f", timedelta(seconds=-1)) == "pending" and published() == []  # running: no wake
    store.add("b", "g", timedelta(seconds=-1))  # due before the running task's lease ends
    assert published() == ["b"] and claimed.key == "f"
    pubsub.close()


@notice_backends
def test_notify_wakes_a_waiting_waker_at_once(wake_ctx: WakeCtx) -> None:
    waker = wake_ctx.waker(wake_ctx.make())
    sleeper = Sleeper(waker, 10.0)
    at = time.time()
    waker.notify()
    assert sleeper.join().result is True and sleeper.ended - at < 0.5
    assert waker.wait(0.05) is False  # consumed


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql"))
def test_an_add_in_this_process_wakes_at_once(wake_ctx: WakeCtx) -> None:
    store = wake_ctx.make()
    waker = wake_ctx.waker(store)
    store.ping()
    waker.wait(0.1)
    producer = wake_ctx.make()  # another store of this process on the same table
    sleeper = Sleeper(waker, 10.0, settle=0.02)  # MySQL's waker polls every 0.2 s: add before that
    at = time.time()
    producer.add("a", "k", timedelta(hours=1))
    assert sleeper.join().result is True and sleeper.ended - at < 0.5
    print(f"\n{wake_ctx.kind} in-process wake latency: {(sleeper.ended - at) * 1000:.1f} ms")


# -- broken connections --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_postgresql_survives_a_killed_listening_connection(wake_ctx: WakeCtx, caplog: pytest.LogCaptureFixture) -> None:
    from mutexcron.tasks.wakeups.postgresql import PostgreSQLWaker

    store = wake_ctx.make()
    store.ping()
    waker = wake_ctx.waker(store)
    assert isinstance(waker, PostgreSQLWaker) and waker.listening
    pid = waker.backend_pid
    killer = wake_ctx.make()
    with caplog.at_level(logging.WARNING, logger="mutexcron"):
        with killer.backend.engine.connect() as conn:  # type: ignore[attr-defined]
            conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid or 0)})")
        started = time.monotonic()
        assert waker.wait(10.0) is False  # the loss is seen; it polls
        assert time.monotonic() - started < 2.0 and not waker.listening
    lost = [r for r in caplog.records if "was lost" in r.getMessage()]
    assert len(lost) == 1 and store.masked_url in lost[0].getMessage()
    latency = _latency(wake_ctx, waker, "a", "k", 60)  # the next wait listens again
    assert waker.listening and waker.backend_pid not in (None, pid) and latency < WAKE_BOUND


@pytest.mark.parametrize("kind", backend_params("redis"))
def test_redis_survives_a_killed_subscription(wake_ctx: WakeCtx, caplog: pytest.LogCaptureFixture) -> None:
    from mutexcron.tasks.wakeups.redis import RedisWaker

    store = wake_ctx.make()
    waker = wake_ctx.waker(store)
    assert isinstance(waker, RedisWaker) and waker.listening
    client = store.backend.client  # type: ignore[attr-defined]
    host, port = waker._pubsub.connection._sock.getsockname()[:2]
    address = f"{host}:{port}"
    [victim] = [c for c in client.client_list() if c["addr"] == address]
    client.client_kill_filter(_id=victim["id"])
    # redis-py subscribes again by itself, or the waker polls and subscribes on a later wait.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (waker.wait(0.3) is False and waker.listening):
        pass
    assert _latency(wake_ctx, waker, "a", "k", 60) < WAKE_BOUND


def test_an_unreachable_postgresql_polls_and_masks_the_password(caplog: pytest.LogCaptureFixture) -> None:
    from mutexcron.tasks.stores.sql import SQLTaskStore

    store = SQLTaskStore("postgresql://postgres:s3cr3tpw@127.0.0.1:1/test", connect_timeout=1)
    try:
        with caplog.at_level(logging.WARNING, logger="mutexcron"):
            waker = store.waker(["a"])
            started = time.monotonic()
            assert waker.wait(5.0) is False
            assert time.monotonic() - started < DEFAULT_POLL + 0.5  # a poll, not the whole timeout
            waker.close()
        text = " ".join(r.getMessage() for r in caplog.records)
        assert "cannot open" in text and "s3cr3tpw" not in text and "***" in text
    finally:
        store.close()


# -- close ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_postgresql_close_releases_the_listening_connection(wake_ctx: WakeCtx) -> None:
    store = wake_ctx.make()
    store.ping()
    waker = store.waker(["a"])
    pid = waker.backend_pid  # type: ignore[attr-defined]
    assert pid

    def alive() -> bool:
        with store.backend.engine.connect() as conn:  # type: ignore[attr-defined]
            return bool(conn.exec_driver_sql(f"SELECT count(*) FROM pg_stat_activity WHERE pid = {int(pid)}").scalar())

    assert alive()
    sleeper = Sleeper(waker, 10.0)
    waker.close()
    assert sleeper.join().ended - sleeper.started < 2.0  # a waiting thread returns at once
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


@pytest.mark.parametrize("kind", backend_params("redis", "redis-cluster"))
def test_redis_close_releases_the_subscription(wake_ctx: WakeCtx) -> None:
    store = wake_ctx.make()
    waker = store.waker(["a"])
    channel = store.backend.key("task_wake")  # type: ignore[attr-defined]
    client = store.backend.client  # type: ignore[attr-defined]

    def subscribers() -> int:
        if wake_ctx.kind == "redis":
            return sum(int(n) for _, n in client.pubsub_numsub(channel))
        # Each node of a cluster counts its own subscribers.
        return sum(int(n) for node in client.get_nodes() for _, n in node.redis_connection.pubsub_numsub(channel))

    assert subscribers() == 1
    waker.close()
    deadline = time.monotonic() + 5
    while subscribers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert subscribers() == 0


@pytest.mark.parametrize("kind", backend_params("sqlite"))
def test_sqlite_close_releases_its_connection(wake_ctx: WakeCtx) -> None:
    from mutexcron.tasks.wakeups.listen import LOCAL_WAKERS
    from mutexcron.tasks.wakeups.sqlite import SQLiteWaker

    store = wake_ctx.make()
    waker = store.waker(["a"])
    assert isinstance(waker, SQLiteWaker) and waker._conn is not None
    waker.close()
    assert waker._conn is None and waker.wait(5.0) is False
    assert not LOCAL_WAKERS._wakers.get((store._wake_key, "a"))


@pytest.mark.parametrize("kind", backend_params("sqlite"))
def test_sqlite_looks_as_often_as_its_poll_asks_on_a_busy_file(wake_ctx: WakeCtx) -> None:
    """On a file that another connection writes all the time (the lock store's claims and
    hand-offs), the version changes at every read: each read is followed by a ``MIN(run_at)``.
    A worker that asks for a 1 s poll (a node that only serves triggers) reads about once a second,
    where the default reads every 25 ms."""
    store = wake_ctx.make()
    eager, lazy = store.waker(["a"]), store.waker(["a"], poll=1.0)
    wake_ctx.wakers += [eager, lazy]
    statements = {"eager": 0, "lazy": 0}
    for name, waker in (("eager", eager), ("lazy", lazy)):
        assert waker._conn is not None  # type: ignore[attr-defined]
        waker._conn.set_trace_callback(lambda _sql, name=name: statements.__setitem__(name, statements[name] + 1))  # type: ignore[attr-defined]
    stop = threading.Event()

    def write_all_the_time() -> None:
        import sqlite3

        conn = sqlite3.connect(wake_ctx.url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("CREATE TABLE IF NOT EXISTS busy (n INTEGER)")
        while not stop.is_set():
            conn.execute("INSERT INTO busy VALUES (1)")
            time.sleep(0.005)
        conn.close()

    writer = threading.Thread(target=write_all_the_time, daemon=True)
    writer.start()
    try:
        sleepers = [Sleeper(w, 2.5, settle=0) for w in (eager, lazy)]
        for sleeper in sleepers:
            assert sleeper.join().result is False  # nothing to wake for: the writes are not tasks
    finally:
        stop.set()
        writer.join(timeout=10)
    assert statements["lazy"] <= 2 * 5, statements  # a version and a MIN per look: one look a second, and one at the end
    assert statements["eager"] >= 5 * statements["lazy"], statements


# -- MariaDB / MySQL -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("mysql"))
def test_mysql_polls_with_an_index_only_next_due(wake_ctx: WakeCtx) -> None:
    from mutexcron.tasks.stores.sql import SQLTaskStore
    from mutexcron.tasks.wakeups.listen import RegisteredPollWaker

    store = wake_ctx.make()
    assert isinstance(store, SQLTaskStore)
    waker = wake_ctx.waker(store)
    assert isinstance(waker, RegisteredPollWaker) and waker.interval == DEFAULT_POLL
    slow = store.waker(["a"], poll=1.0)
    wake_ctx.wakers.append(slow)
    assert isinstance(slow, RegisteredPollWaker) and slow.interval == 1.0
    for i in range(40):
        store.add(f"c{i % 4}", f"k{i}", timedelta(seconds=i))
    started = time.monotonic()
    while waker.wait(1.0):  # the adds above woke it; then it polls
        pass
    assert time.monotonic() - started < 1.0
    sql, params = store._sql.codes_shape(store._sql.next_due, store._sql.next_due_part, ["c1", "c2"])
    with store.backend.engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.exec_driver_sql("EXPLAIN " + _inline(sql, params))]
    scans = [r for r in rows if r["table"] == store.table]
    assert len(scans) == 2 and all("Using index" in (r["Extra"] or "") for r in scans), rows
    assert all(r["key"] == f"{store.table}_run_at" for r in scans), rows


def _inline(sql: str, params: dict[str, object]) -> str:
    for name, value in sorted(params.items(), key=lambda item: -len(item[0])):
        sql = sql.replace(f":{name}", f"'{value}'")
    return sql
