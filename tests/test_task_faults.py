"""The task pool under faults (issue 31): worker rules checked on every task store.

Each test runs a real :class:`TaskWorker` on the contract suite's stores (tests/test_task_store.py's
``tasks_ctx``: every backend), with this node's monotonic clock injected so a lease runs out by the
node's clock without sleeping, while the store's lease (long) still holds: what a node sees after
a stall that nobody else used to take its task.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from mutexcron.tasks import Done, TaskStore
from mutexcron.tasks.handlers import Handler, Task
from mutexcron.tasks.worker import TaskWorker
from tests import test_task_store
from tests.backends import FakeClock, backend_params, backend_params_full_matrix
from tests.test_task_cluster import NOW, SLACK, TaskCluster, cluster
from tests.test_task_store import TASK_BACKENDS, TaskCtx
from tests.test_task_worker import wait_for as wait_until

tasks_ctx = test_task_store.tasks_ctx  # the contract suite's fixture: a store of its own per test
__all__ = ["cluster", "tasks_ctx"]  # fixtures shared with the contract suite and the task cluster tests

every_backend = pytest.mark.parametrize("kind", backend_params(*TASK_BACKENDS))
NODE = "n1:1:aaaa"
SOON = timedelta(seconds=-1)
LEASE = 30.0  # the store's lease outlives the test: only the node's clock runs it out


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    return wait_until(condition, timeout)


class Workers:
    """Workers on one store with one injected monotonic clock, stopped at the end."""

    def __init__(self, store: TaskStore) -> None:
        self.store, self.clock, self.made = store, FakeClock(), []  # type: list[TaskWorker]

    def start(self, *handlers: Handler, **options: Any) -> TaskWorker:
        worker = TaskWorker(self.store, {h.code: h for h in handlers}, NODE, clock=self.clock, backstop=0.05, **options)
        self.made.append(worker)
        worker.start()
        return worker


@pytest.fixture
def workers(tasks_ctx: TaskCtx) -> Iterator[Workers]:
    made = Workers(tasks_ctx.make())
    yield made
    for worker in made.made:
        worker.stop(2)


class Stepper:
    """A handler in steps: ``look`` lets it read ``task.lost`` once (and stop if set), ``finish`` lets it return."""

    def __init__(self) -> None:
        self.started, self.looked = threading.Event(), threading.Event()
        self.look, self.finish = threading.Event(), threading.Event()
        self.saw: list[bool] = []
        self.tokens: list[int] = []

    def __call__(self, task: Task) -> None:
        self.tokens.append(task.token)
        self.started.set()
        if len(self.tokens) > 1:  # the run after the hand-back: to its end
            return None
        self.look.wait(10)
        self.saw.append(task.lost)  # the documented pattern: stop when lost...
        self.looked.set()
        self.finish.wait(10)  # ...after some clean-up, during which a late renewal lands
        return None


# -- S1: lost is sticky ------------------------------------------------------------------------------
@every_backend
@pytest.mark.parametrize("first", ["handler looks", "renewal lands"])
def test_a_run_whose_lease_ran_out_records_nothing_even_after_a_late_renewal(workers: Workers, first: str) -> None:
    store, handler = workers.store, Stepper()
    store.add("c", "k", SOON)
    worker = workers.start(Handler("c", handler, lease=LEASE))
    assert handler.started.wait(10)
    [claimed] = handler.tokens
    workers.clock.advance(LEASE + 1)  # the node stalled past its lease by its own clock; nobody took the task
    if first == "renewal lands":
        worker.renew_round()  # the store renews it (still this node's): the run must stay lost
    handler.look.set()
    assert handler.looked.wait(10)
    worker.renew_round()  # a renewal after the handler saw lost: the store takes it, the run stays lost
    handler.finish.set()
    assert handler.saw == [True]
    assert wait_for(lambda: len(handler.tokens) == 2)  # handed back, fenced, and run again to its end
    assert handler.tokens[1] > claimed
    assert wait_for(lambda: worker.stats.done == 1)
    assert worker.stats.released == 1 and store.get("c", "k") is None


# -- the same rules on real `mutexcron run` nodes --------------------------------------------------
@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params_full_matrix(("sqlite", "postgresql"), ("mysql", "redis")))
def test_a_node_frozen_mid_handler_never_records_the_half_done_run(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    """S1: lease 1.5 s, SIGSTOP 2.5 s in a 15-step handler that cleans up 0.3 s after it sees lost.

    The stalled run stops half-way; whatever renewal lands afterwards, it is handed back (or, if
    the node claimed the task again meanwhile, its hand-back is refused), never recorded as done:
    the task only goes once a run reached its last step.
    """
    c = cluster(kind, lease=1.5, concurrency=2)
    c.start("n0")
    c.pool.add("work", "steps", NOW, {"steps": 15, "step": 0.2, "cleanup": 0.3})
    first = c.wait_event(lambda e: e["key"] == "steps" and e["event"] == "start", 10)
    time.sleep(0.5)
    c.signal("n0", signal.SIGSTOP)
    time.sleep(2.5)
    c.signal("n0", signal.SIGCONT)
    c.wait_event(lambda e: e["event"] == "lost" and e["token"] == first["token"], 10)
    assert wait_for(lambda: c.pool.get("work", "steps") is None, 30), c.output("n0")[-3000:]
    ends = [e for e in c.events() if e["key"] == "steps" and e["event"] == "end"]
    assert ends and all(e["token"] > first["token"] for e in ends), c.events()  # done only by a run that finished


# -- M3: a free thread wakes the claim thread -------------------------------------------------------
def test_without_claim_ahead_a_freed_thread_wakes_the_claim_thread() -> None:
    """``claim_ahead=0``: each thread that frees asks for its next task at once, not at the backstop."""
    from mutexcron.tasks.stores.memory import MemoryTaskStore

    store = MemoryTaskStore("memory://faults-m3")
    for i in range(40):
        store.add("c", f"k{i}", SOON)
    ran: list[str] = []
    worker = TaskWorker(
        store, {"c": Handler("c", lambda task: (ran.append(task.key), time.sleep(0.02))[0], poll=60)}, NODE,
        concurrency=2, claim_ahead=0, backstop=60,
    )  # fmt: skip
    worker.start()
    try:
        assert wait_for(lambda: len(ran) == 40, 10), f"{len(ran)} of 40 ran: the claim thread waited for its backstop"
        assert worker.stats.claimed == 40
    finally:
        worker.stop(2)
        store.close()


# -- M4: a hand-back goes to an idle node ------------------------------------------------------------
def test_a_busy_node_does_not_claim_again_what_it_handed_back_until_a_thread_frees() -> None:
    from mutexcron.tasks.stores.memory import MemoryTaskStore

    clock, store = FakeClock(), MemoryTaskStore("memory://faults-m4")
    long_one, ran = threading.Event(), []  # type: threading.Event, list[tuple[str, str]]

    def handle(node: str) -> Callable[[Task], None]:
        def run(task: Task) -> None:
            ran.append((node, task.key))
            if task.key == "long":
                long_one.wait(10)

        return run

    store.add("c", "long", timedelta(seconds=-2))
    store.add("c", "short", SOON)
    busy = TaskWorker(
        store, {"c": Handler("c", handle("busy"), lease=3)}, "busy", clock=clock, concurrency=1, claim_ahead=1, backstop=0.05
    )
    busy.start()
    idle: TaskWorker | None = None
    try:
        assert wait_for(lambda: ("busy", "long") in ran and busy.stats.claimed == 2)  # short claimed ahead, waiting
        clock.advance(1.1)  # a third of the lease: the waiting claim is handed back
        busy.renew_round()
        assert busy.stats.released == 1
        time.sleep(0.5)  # ten looks of the busy node's claim thread
        short = store.get("c", "short")
        assert short is not None and short.state == "queued", short  # not claimed again by the busy node
        idle = TaskWorker(store, {"c": Handler("c", handle("idle"), lease=3)}, "idle", clock=clock, backstop=0.05)
        idle.start()
        assert wait_for(lambda: ("idle", "short") in ran)
        assert ("busy", "short") not in ran
    finally:
        long_one.set()
        busy.stop(2)
        if idle is not None:
            idle.stop(2)
        store.close()


# -- M5: endless overruns end --------------------------------------------------------------------------
@every_backend
def test_a_handler_that_always_outlives_its_lease_fails_naming_the_lease(
    workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[int] = []

    def overrun(task: Task) -> None:
        runs.append(task.token)
        workers.clock.advance(4)  # the handler held the node past its 3 s lease (no renewal could run)

    workers.store.add("c", "k", SOON)
    worker = workers.start(Handler("c", overrun, lease=3, max_attempts=1))
    assert wait_for(lambda: getattr(workers.store.get("c", "k"), "state", None) == "failed")
    task = workers.store.get("c", "k")
    assert task is not None and task.last_error is not None
    assert "outlived its 3 s lease 3 times" in task.last_error and "raise the handler's lease" in task.last_error
    assert len(runs) == 3 and worker.stats.released == 2 and worker.stats.failed == 1
    assert "taken over" not in caplog.text


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql"))
def test_a_handler_that_holds_the_gil_past_its_lease_ends_failed_on_a_real_node(
    kind: str, cluster: Callable[..., TaskCluster]
) -> None:
    """M5: each run holds the node's GIL 2.5 s past its 1.5 s lease (no renewal can run); the third
    such run counts (max_attempts=1: failed), with the lease named, and no "taken over"."""
    c = cluster(kind, lease=1.5, concurrency=2)
    c.start("n0")
    c.pool.add("overrun", "gil", NOW, {"hold_gil": 2.5})
    failed = lambda: getattr(c.pool.get("overrun", "gil"), "state", None) == "failed"  # noqa: E731
    assert wait_for(failed, 40), c.output("n0")[-3000:]
    task = c.pool.get("overrun", "gil")
    assert task is not None and task.last_error is not None and "outlived its 1.5 s lease" in task.last_error
    starts = [e for e in c.events() if e["key"] == "gil" and e["event"] == "start"]
    assert 1 <= len(starts) <= 3, starts  # fewer when the node claimed it again itself (the attempt then counted)
    assert "taken over" not in c.output("n0")


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql"))
def test_a_task_handed_back_by_a_busy_node_starts_on_the_idle_one(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    """M4: 2 nodes of 1 thread, lease 3 s. The node running the long task claimed the short one
    ahead; it hands it back at a third of its lease, and the idle node (no notices on SQLite and
    MariaDB: its poll) runs it, instead of the busy node claiming it again and again."""
    c = cluster(kind, lease=3.0, concurrency=1)
    c.start("n0", "n1")
    c.pool.add_many([("work", "long", NOW, {"sleep": 6}), ("work", "short", timedelta(seconds=-0.4), {"sleep": 0.1})])
    long_start = c.wait_event(lambda e: e["key"] == "long" and e["event"] == "start", 10)
    short = c.wait_event(lambda e: e["key"] == "short" and e["event"] == "start", 10)
    waited = short["t"] - long_start["t"]
    print(f"{kind}: the short task started {waited:.2f} s after the long one, on the idle node, token {short['token']}")
    assert short["node"] != long_start["node"]
    assert waited < 3.0 / 3 + 0.5 + SLACK and short["token"] <= 3


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql"))
def test_sigkill_with_claims_ahead_fails_no_task_that_never_ran(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    """M1: a node of 20 threads claims 20 more ahead, then is SIGKILLed; with max_attempts=1, the
    node that rescues them fails only the tasks whose handler had started: 0 fail without running."""
    c = cluster(kind, lease=3.0, concurrency=20)
    c.pool.add_many([("overrun", f"t{i:02d}", NOW, {"sleep": 3}) for i in range(60)])
    c.start("n0")
    assert wait_for(lambda: len([e for e in c.events() if e["event"] == "start"]) >= 20)
    time.sleep(0.3)  # the started marks are batched: written within milliseconds
    held = [t.key for t in c.pool.list(state="running") if t.owner == "n0"]
    c.signal("n0", signal.SIGKILL)
    c.nodes["n0"].wait(10)
    started = {e["key"] for e in c.events() if e["event"] == "start"}
    assert len(held) > len(started), (held, started)  # claims ahead that never reached a handler
    c.start("n1")
    settled = lambda: not c.pool.list(state="running") and not c.pool.list(state="queued")  # noqa: E731
    assert wait_for(settled, 60), c.output("n1")[-3000:]
    failed = [t.key for t in c.pool.list(state="failed")]
    print(f"{kind}: n0 held {len(held)} claims, {len(started)} started; {len(failed)} failed after the rescue")
    assert set(failed) <= started, sorted(set(failed) - started)  # 0 failed without running
    ran_on_n1 = {e["key"] for e in c.events() if e["event"] == "start" and e["node"] == "n1"}
    assert set(held) - started <= ran_on_n1


# -- M2: a row the pool cannot read fails alone ------------------------------------------------------
def corrupt_due(ctx: TaskCtx, store: TaskStore, code: str, key: str) -> None:
    """Give the task a due time its store's driver (or record) cannot read, as a hand edit would:
    PostgreSQL ``-infinity``, text on SQLite, Redis and MongoDB; a payload no JSON reader takes
    where the column's type allows no such time (MySQL's DATETIME, the memory store)."""
    from tests.test_task_hardening import corrupt_payload

    if ctx.kind in ("redis", "redis-cluster"):
        backend = store.backend  # type: ignore[attr-defined]
        backend.client.hset(backend.key(f"task:{code}:{key}"), "due", "not a time")
    elif ctx.kind in ("mongomock", "mongodb"):
        store.collection.update_one({"code": code, "key": key}, {"$set": {"due": "not a time"}})  # type: ignore[attr-defined]
    elif ctx.kind in ("postgresql", "sqlite"):
        value = "-infinity" if ctx.kind == "postgresql" else "not a time"
        sql = f"UPDATE {store.table} SET due = :d WHERE code = :c AND task_key = :k"  # type: ignore[attr-defined]
        store.backend.execute(sql, {"d": value, "c": code, "k": key}, "test", write=True)  # type: ignore[attr-defined]
    else:
        corrupt_payload(ctx, store, code, key)


@every_backend
def test_a_claimed_row_whose_time_cannot_be_read_fails_alone(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    for i in range(4):
        store.add("c", f"ok{i}", SOON)
    store.add("c", "bad", timedelta(seconds=-5))
    corrupt_due(tasks_ctx, store, "c", "bad")
    claimed = store.claim(NODE, ["c"], 10, 30)
    assert sorted(t.key for t in claimed) == ["ok0", "ok1", "ok2", "ok3"]  # the batch runs
    counts = [(s.running, s.failed) for s in store.summary(["c"])]
    assert counts == [(4, 1)], counts  # the bad one kept as failed, never claimed again
    assert store.claim(NODE, ["c"], 10, 30) == []


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql"))
def test_a_row_the_node_cannot_read_fails_alone_on_a_real_node(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    """M2: lease 1 s, one row with an unreadable due among 20 healthy ones: the 20 run once each, the
    bad one is kept as failed (never claimed again), and the node never reports the store down."""
    c = cluster(kind, lease=1.0, concurrency=4)
    c.pool.add_many([("work", f"ok{i:02d}", NOW, None) for i in range(20)] + [("work", "bad", NOW, None)])
    corrupt_due(TaskCtx(kind, c.url, lambda: c.pool.store), c.pool.store, "work", "bad")
    c.start("n0")
    ends = lambda: len([e for e in c.events() if e["event"] == "end"])  # noqa: E731
    assert wait_for(lambda: ends() == 20, 30), (ends(), c.output("n0")[-3000:])
    counts = lambda: [(s.queued, s.running, s.failed) for s in c.pool.store.summary(["work"])]  # noqa: E731
    assert wait_for(lambda: counts() == [(0, 0, 1)], 10), counts()
    time.sleep(2.5)  # two more leases: the bad row is not claimed again
    starts = [e["key"] for e in c.events() if e["event"] == "start"]
    assert sorted(starts) == [f"ok{i:02d}" for i in range(20)]
    assert counts() == [(0, 0, 1)] and "unreachable" not in c.output("n0")


# -- Redis: an eviction policy would drop tasks silently ----------------------------------------------
@pytest.mark.redis
def test_a_worker_on_a_redis_that_may_evict_any_key_warns_at_start(private_redis: Any, caplog: pytest.LogCaptureFixture) -> None:
    from mutexcron.tasks import task_store_from_url

    store: Any = task_store_from_url(private_redis.url)  # a server of the test's own: its policy is changed
    client = store.backend.client
    try:
        assert store.warn_if_evicting() == "noeviction" and not caplog.records
        client.config_set("maxmemory-policy", "allkeys-lru")
        assert store.warn_if_evicting() == "allkeys-lru"
        store.waker(["c"]).close()  # a worker's start: one warning, not one per look
        warnings = [r for r in caplog.records if "maxmemory-policy is allkeys-lru" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelname == "WARNING" and "noeviction" in warnings[0].getMessage()
    finally:
        store.close()


@pytest.mark.parametrize("kind", backend_params("memory", "redis"))
def test_tokens_of_two_tasks_added_at_one_floor_fence_each_task_not_the_store(tasks_ctx: TaskCtx) -> None:
    """What the docs say: after a delete raised the floor, two new tasks both start above it (each
    task's attempts are fenced), and may share a token (a token does not name a task store-wide)."""
    store = tasks_ctx.make()
    store.add("c", "old", SOON)
    [old] = store.claim(NODE, ["c"], 1, 30)
    assert store.complete(NODE, "c", "old", old.token, Done())
    store.add("c", "a", SOON)
    store.add("c", "b", SOON)
    tokens = {t.key: t.token for t in store.claim(NODE, ["c"], 2, 30)}
    assert tokens["a"] > old.token and tokens["b"] > old.token and tokens["a"] == tokens["b"]


# -- m3: on SQLite, a node whose clock is ahead of the others' is called out --------------------------
def test_a_sqlite_node_warns_about_another_whose_clock_is_ahead(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from datetime import datetime, timezone

    from mutexcron.locks import lock_store_from_url
    from mutexcron.locks.record import NodePresence
    from mutexcron.observability.sqlite_clocks import SQLiteClockCheck

    store: Any = lock_store_from_url(f"sqlite:///{tmp_path}/clocks.db")
    now = datetime.now(timezone.utc)
    seen = {"in-step": now, "ahead": now + timedelta(hours=1), "me": now + timedelta(hours=2)}
    store.nodes = lambda prune=True: [NodePresence(n, last_seen=at) for n, at in seen.items()]  # what the file holds
    clock = FakeClock()
    check = SQLiteClockCheck(store, "me", clock=clock)
    try:
        check.maybe_check()
        check.maybe_check()  # not before CHECK_EVERY
        clock.advance(31)
        check.maybe_check()  # once per node
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "node ahead wrote its presence 3600" in warnings[0] and "node me" in warnings[0]
        assert not SQLiteClockCheck(lock_store_from_url("memory://clocks"), "me").enabled  # a server's clock: no look
    finally:
        store.close()


# -- a claim a handler thread took as the stop began is handed back by the stop -----------------------
def test_stop_hands_back_a_claim_a_thread_took_as_the_stop_began() -> None:
    from mutexcron.tasks.stores.memory import MemoryTaskStore

    class SlowToBegin(TaskWorker):
        """The handler thread took the claim from the queue, and reaches its start check after the stop began."""

        gate = threading.Event()
        taken = threading.Event()

        def _begin(self, run: Any) -> bool:
            self.taken.set()
            self.gate.wait(10)
            return super()._begin(run)

    store = MemoryTaskStore("memory://faults-stop")
    store.add("c", "k", SOON)
    ran: list[str] = []
    worker = SlowToBegin(store, {"c": Handler("c", lambda t: ran.append(t.key), lease=30)}, NODE, concurrency=1, backstop=0.05)
    worker.start()
    try:
        assert worker.taken.wait(10)
        stopper = threading.Thread(target=worker.stop, args=(5,))
        stopper.start()
        assert wait_for(lambda: worker.stopping)
        time.sleep(0.1)  # the stop has collected what was queued: nothing, the thread holds the claim
        SlowToBegin.gate.set()
        stopper.join(10)
        task = store.get("c", "k")
        assert ran == [] and worker.stats.released == 1
        assert task is not None and (task.state, task.token) == ("queued", 2)  # at once, not after its 30 s lease
    finally:
        SlowToBegin.gate.set()
        store.close()
