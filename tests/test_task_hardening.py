"""Task pool hardening (issue 21): tokens across occurrences, no deletion of unfinished work, no
poison batches, due ranges, names with trailing spaces, handler BaseExceptions, and what the user
is told.

Store-level tests run on every task store (tests/test_task_store.py's ``tasks_ctx``). The chaos
tests run real :class:`TaskWorker` threads on every store, each node on a store wrapper that a test
can cut off (a partition, an outage), with one-second leases waited out on the real servers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, cast

import pytest

from mutexcron import Defer
from mutexcron.errors import ConfigurationError, StoreUnavailableError
from mutexcron.locks import Node as LockNode
from mutexcron.tasks import Done, Reschedule, Retry, TaskRecord, TaskStore
from mutexcron.tasks.handlers import Handler, Task
from mutexcron.tasks.stores.memory import MemoryTaskStore
from mutexcron.tasks.worker import TaskWorker
from tests import test_task_store
from tests.backends import ALL_BACKENDS, FakeClock, StoreCtx, backend_params
from tests.test_task_store import TASK_BACKENDS, TaskCtx
from tests.test_task_worker import wait_for as wait_until

tasks_ctx = test_task_store.tasks_ctx  # the contract suite's fixture: a store of its own per test

every_backend = pytest.mark.parametrize("kind", backend_params(*TASK_BACKENDS))
N1, N2 = "n1:1:aaaa", "n2:2:bbbb"
SOON = timedelta(seconds=-1)
LEASE = 1.0


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    return wait_until(condition, timeout)


def let_pass(ctx: TaskCtx, seconds: float) -> None:
    """``seconds`` on the node's clock (a sleep) and on the store's (the fake one moved too)."""
    time.sleep(seconds)
    if ctx.clock is not None:
        ctx.clock.advance(seconds)


# -- A1: tokens only go up across occurrences ------------------------------------------------------
@every_backend
def test_a_stale_attempt_of_a_finished_occurrence_never_passes_the_fence_of_the_next(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("remind", "u1", SOON)
    [stale] = store.claim(N1, ["remind"], 1, LEASE)  # n1 is cut off past its lease...
    let_pass(tasks_ctx, LEASE + 0.2)
    [taken] = store.claim(N2, ["remind"], 1, 30)  # ...n2 takes the task over and finishes it
    assert store.complete(N2, "remind", "u1", taken.token, Done())
    store.add("remind", "u1", SOON, {"gen": 2})  # a producer adds it again
    [live] = store.claim(N1, ["remind"], 1, 30)  # the partition heals: n1 runs the new occurrence
    assert live.token > taken.token > stale.token
    assert not store.complete(N1, "remind", "u1", stale.token, Done())  # the stale attempt's end: refused
    assert store.get("remind", "u1") is not None
    assert store.complete(N1, "remind", "u1", live.token, Reschedule(timedelta(hours=4)))
    again = store.get("remind", "u1")
    assert again is not None and again.state == "queued" and again.payload == {"gen": 2}


@every_backend
def test_tokens_go_on_after_a_cancel_and_the_occurrence_names_each_run(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    due = store.now() - timedelta(seconds=5)
    store.add("charge", "inv-7", due, {"amount": 100})
    [first] = store.claim(N1, ["charge"], 1, 30)
    assert store.complete(N1, "charge", "inv-7", first.token, Done())
    store.add("charge", "inv-7", due, {"amount": 150})  # the same absolute due, a new occurrence
    [second] = store.claim(N1, ["charge"], 1, 30)
    assert second.token > first.token
    assert second.idempotency_key != first.idempotency_key  # B9: 150 is charged too
    assert store.complete(N1, "charge", "inv-7", second.token, Retry(SOON, "busy"))
    [retried] = store.claim(N1, ["charge"], 1, 30)
    assert retried.idempotency_key == second.idempotency_key  # every attempt of one occurrence: one key
    assert store.release(N1, [("charge", "inv-7", retried.token)]) == 1
    assert store.cancel("charge", "inv-7") and store.get("charge", "inv-7") is None
    assert store.list(code="charge") == [] and all(s.queued == 0 for s in store.summary(["charge"]))
    assert store.add("charge", "inv-7", due) == "inserted"
    [third] = store.claim(N1, ["charge"], 1, 30)
    assert third.token > retried.token + 1 and third.idempotency_key not in {first.idempotency_key, second.idempotency_key}


# -- A4, B7: due times ------------------------------------------------------------------------------
@every_backend
def test_a_task_due_before_1970_is_due_and_does_not_hide_the_others(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "old", datetime(1960, 1, 1, tzinfo=timezone.utc))
    store.add("c", "new", SOON)
    assert store.next_due(["c"]) == 0
    assert sorted(t.key for t in store.claim(N1, ["c"], 10, 30)) == ["new", "old"]


@every_backend
@pytest.mark.parametrize(
    "due",
    [
        datetime(9999, 1, 1, tzinfo=timezone.utc),
        datetime.max.replace(tzinfo=timezone.utc),
        datetime(1800, 1, 1, tzinfo=timezone.utc),
        timedelta.max,
        timedelta(days=365 * 10_000),
    ],
    ids=["year-9999", "datetime.max", "1800", "timedelta.max", "10000-years"],
)
def test_a_due_time_a_store_cannot_hold_is_refused_everywhere(tasks_ctx: TaskCtx, due: Any) -> None:
    store = tasks_ctx.make()
    with pytest.raises(ConfigurationError, match="outside the due times every store holds"):
        store.add("c", "k", due)
    assert store.get("c", "k") is None and store.list() == []
    store.add("c", "k", SOON)
    [task] = store.claim(N1, ["c"], 1, 30)
    for outcome in (Reschedule(due), Retry(due, "e")):
        with pytest.raises(ConfigurationError, match="outside the due times"):
            store.complete(N1, "c", "k", task.token, outcome)
    assert store.complete(N1, "c", "k", task.token, Done())


# -- B5: names differing by trailing spaces ---------------------------------------------------------
@every_backend
def test_keys_and_codes_differing_by_trailing_spaces_are_two_tasks(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    assert store.add("mail", "1042", SOON, {"n": 1}) == "inserted"
    assert store.add("mail", "1042 ", SOON, {"n": 2}) == "inserted"
    assert store.add("mail ", "1042", SOON, {"n": 3}) == "inserted"
    assert store.cancel("mail", "1042 ")
    task = store.get("mail", "1042")
    assert task is not None and task.payload == {"n": 1}
    assert [t.key for t in store.claim(N1, ["mail"], 10, 30)] == ["1042"]


@pytest.mark.parametrize("kind", backend_params("mysql"))
def test_mysql_a_table_that_pads_refuses_names_ending_with_a_space(tasks_ctx: TaskCtx) -> None:
    import sqlalchemy

    assert tasks_ctx.url is not None
    store = tasks_ctx.make()
    table = store.table  # type: ignore[attr-defined]
    engine = sqlalchemy.create_engine(tasks_ctx.url.split("?")[0].replace("mysql://", "mysql+pymysql://"))
    with engine.begin() as conn:  # the table as an earlier mutexcron created it: utf8mb4_bin pads
        conn.execute(sqlalchemy.text(store.ddl()[0].replace("utf8mb4_nopad_bin", "utf8mb4_bin")))
    engine.dispose()
    store.add("mail", "1042", SOON)
    with pytest.raises(ConfigurationError, match=r"ends with a space.*ALTER TABLE"):
        store.add("mail", "1042 ", SOON)
    assert table


# -- B8: Redis list reads pages --------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("redis"))
def test_redis_list_reads_bounded_pages_in_due_order(tasks_ctx: TaskCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    from mutexcron.tasks.stores import redis as redis_tasks

    store = tasks_ctx.make()
    base = store.now()
    for i in range(60):
        store.add("c", f"k{i:03d}", base + timedelta(minutes=60 - i))  # the last added is due first
    store.add("d", "other", base)
    monkeypatch.setattr(redis_tasks, "LIST_PAGE", 7)
    script = store._scripts["list"]  # type: ignore[attr-defined]
    rows_per_call: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        reply = script(*args, **kwargs)
        rows_per_call.append(len(json.loads(reply)[0]))
        return reply

    monkeypatch.setitem(store._scripts, "list", counting)  # type: ignore[attr-defined]
    listed = store.list(code="c", limit=10)
    assert [t.key for t in listed] == [f"k{i:03d}" for i in range(59, 49, -1)]
    assert max(rows_per_call) <= 10 and sum(rows_per_call) <= 10
    rows_per_call.clear()
    assert [t.key for t in store.list(code="c", key_contains="k00", limit=3)] == ["k009", "k008", "k007"]
    assert max(rows_per_call) <= 3
    assert [t.key for t in store.list(limit=2)] == ["other", "k059"]
    assert len(store.list(code="c", due_before=base + timedelta(minutes=5, seconds=30))) == 5
    # A namespace written by an earlier mutexcron has no due index: it is built on first list.
    store.backend.client.delete(store.backend.key("dues:c"))  # type: ignore[attr-defined]
    assert [t.key for t in store.list(code="c", limit=2)] == ["k059", "k058"]


# -- the worker: A2, A3, B6, B7, C10, C11 (memory store, injected clocks) -------------------------
class Harness:
    def __init__(self, name: str) -> None:
        self.store_clock, self.node_clock = FakeClock(), FakeClock()
        self.store = MemoryTaskStore(f"memory://hardening-{name}", clock=self.store_clock)
        self.workers: list[TaskWorker] = []

    def worker(self, *handlers: Handler, store: TaskStore | None = None) -> TaskWorker:
        worker = TaskWorker(store or self.store, {h.code: h for h in handlers}, N1, clock=self.node_clock, backstop=0.05)
        self.workers.append(worker)
        worker.start()
        return worker


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = Harness(request.node.name)
    yield h
    for worker in h.workers:
        worker.stop(2)
    h.store.close()


class FlakyRenewals(MemoryTaskStore):
    """Renewals fail while ``down`` is set (an outage seen by the heartbeat only)."""

    down = False

    def renew(self, node: str, tokens: Any, lease: float) -> set[tuple[str, str]]:
        if self.down:
            raise StoreUnavailableError("store down (test)")
        return super().renew(node, tokens, lease)


def test_a_handler_that_stops_because_lost_is_handed_back_not_recorded_done(harness: Harness) -> None:
    store = FlakyRenewals("memory://hardening-lost", clock=harness.store_clock)
    steps: list[int] = []
    started = threading.Event()

    runs: list[int] = []

    def long_job(task: Task) -> None:
        runs.append(task.token)
        started.set()
        for step in range(1000 if len(runs) == 1 else 3):
            if task.lost:  # the documented pattern
                return None
            steps.append(step)
            time.sleep(0.01)
        return None

    store.add("c", "k", SOON)
    worker = harness.worker(Handler("c", long_job, lease=10), store=store)
    assert started.wait(5)
    store.down = True
    harness.node_clock.advance(11)  # no renewal got through within the lease: lost, but nobody took it
    worker.renew_round()
    assert wait_for(lambda: worker.stats.released == 1)
    assert store.get("c", "k") is not None and worker.stats.done == 0  # handed back, not deleted half-done
    store.down = False
    assert wait_for(lambda: worker.stats.done == 1)  # run again, to its end
    assert len(runs) == 2 and runs[1] > runs[0] and store.get("c", "k") is None
    store.close()


class ExtraClaims(MemoryTaskStore):
    """A claim that also returns a task of a code no handler here runs (as a MySQL table that pads does)."""

    def claim(self, node: str, codes: Any, limit: int, lease: float) -> list[TaskRecord]:
        return super().claim(node, [*codes, "mail "], limit, lease)


def test_a_claimed_task_without_a_handler_is_failed_alone_and_the_batch_runs(harness: Harness) -> None:
    store = ExtraClaims("memory://hardening-extra", clock=harness.store_clock)
    ran: list[str] = []
    store.add("mail ", "odd", timedelta(seconds=-5))
    for i in range(3):
        store.add("mail", f"ok{i}", SOON)
    worker = harness.worker(Handler("mail", lambda task: ran.append(task.key)), store=store)
    assert wait_for(lambda: worker.stats.done == 3)
    odd = store.get("mail ", "odd")
    assert odd is not None and odd.state == "failed" and odd.last_error is not None and "'mail '" in odd.last_error
    assert sorted(ran) == ["ok0", "ok1", "ok2"]
    store.close()


@pytest.mark.parametrize(
    "signal",
    [asyncio.CancelledError(), SystemExit(3), KeyboardInterrupt()],
    ids=["CancelledError", "SystemExit", "KeyboardInterrupt"],
)
def test_a_base_exception_from_a_handler_is_a_recorded_failed_attempt(harness: Harness, signal: BaseException) -> None:
    def handler(task: Task) -> None:
        raise signal

    harness.store.add("c", "k", SOON)
    worker = harness.worker(Handler("c", handler, max_attempts=3))
    assert wait_for(lambda: worker.stats.retried == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "queued" and task.attempt == 1
    assert task.last_error is not None and type(signal).__name__ in task.last_error
    assert worker._thread is not None and worker._thread.is_alive()


def test_a_coroutine_handler_whose_await_is_cancelled_is_recorded(harness: Harness) -> None:
    async def handler(task: Task) -> None:
        raise asyncio.CancelledError()

    harness.store.add("c", "k", SOON)
    worker = harness.worker(Handler("c", handler, max_attempts=1))
    assert wait_for(lambda: worker.stats.failed == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "failed" and "CancelledError" in (task.last_error or "")


@pytest.mark.parametrize(
    "result", [timedelta(days=4_000_000), datetime(9999, 1, 1, tzinfo=timezone.utc)], ids=["timedelta", "datetime"]
)
def test_a_handler_returning_a_due_no_store_holds_fails_the_task_at_once(harness: Harness, result: Any) -> None:
    harness.store.add("c", "k", SOON)
    worker = harness.worker(Handler("c", lambda task: result))
    assert wait_for(lambda: worker.stats.failed == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "failed" and "outside the due times" in (task.last_error or "")


def test_a_defer_of_ten_thousand_years_fails_the_task_at_once(harness: Harness) -> None:
    def handler(task: Task) -> None:
        raise Defer(365 * 86400 * 10_000, "much later")

    harness.store.add("c", "k", SOON)
    worker = harness.worker(Handler("c", handler))
    assert wait_for(lambda: worker.stats.failed == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "failed" and "outside the due times" in (task.last_error or "")


def test_running_out_of_attempts_by_deferring_says_so(harness: Harness) -> None:
    def handler(task: Task) -> None:
        raise Defer(0, "partner API in maintenance")

    harness.store.add("c", "k", SOON)
    worker = harness.worker(Handler("c", handler, max_attempts=3))
    assert wait_for(lambda: worker.stats.failed == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "failed" and task.attempt == 3
    error = task.last_error or ""
    assert "deferred attempt 3 of max_attempts=3" in error and "partner API in maintenance" in error
    assert "workers died" not in error


class RenewDuringCompletion(MemoryTaskStore):
    """The heartbeat's renewal lands just after the completion (``hook`` runs inside complete)."""

    hook: Callable[[], None] | None = None

    def complete_many(self, node: str, completions: Any) -> list[bool]:
        results = super().complete_many(node, completions)
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return results


def test_a_renewal_racing_a_completion_is_not_a_lost_lease(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    store = RenewDuringCompletion("memory://hardening-race", clock=harness.store_clock)
    store.add("c", "k", SOON)
    started: list[TaskWorker] = []

    def renew_now() -> None:
        harness.node_clock.advance(5)  # the run is due for renewal
        started[0].renew_round()

    store.hook = renew_now
    release = threading.Event()
    worker = harness.worker(Handler("c", lambda task: release.wait(5) and None, lease=10), store=store)
    started.append(worker)
    release.set()
    assert wait_for(lambda: worker.stats.done == 1)
    assert store.hook is None  # the renewal ran after the completion landed
    assert worker.stats.lost == 0 and "lease lost" not in caplog.text
    store.close()


# -- chaos: real workers on every store --------------------------------------------------------------
class Cut:
    """A node's view of a store that a test can cut off: every call raises StoreUnavailableError."""

    def __init__(self, store: TaskStore) -> None:
        self._store, self.cut = store, False

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if not callable(value) or name in ("waker", "close", "masked_url"):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.cut:
                raise StoreUnavailableError(f"{name}: partitioned (test)")
            return value(*args, **kwargs)

        return call


class Node:
    """A TaskWorker on a cuttable store, with a heartbeat thread renewing its tasks."""

    def __init__(self, ctx: TaskCtx, node_id: str, *handlers: Handler) -> None:
        self.view = Cut(ctx.make())
        self.worker = TaskWorker(cast(TaskStore, self.view), {h.code: h for h in handlers}, node_id, backstop=0.1)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(0.05):
            self.worker.renew_round()

    def start(self) -> Node:
        self.worker.start()
        self._beat.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.view.cut = False
        self.worker.stop(5)


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


@every_backend
def test_chaos_partition_then_readd_the_stale_run_never_ends_the_new_occurrence(tasks_ctx: TaskCtx, nodes: list[Node]) -> None:
    stale_gate, live_gate = threading.Event(), threading.Event()
    runs: list[tuple[str, int, int]] = []

    def remind(task: Task) -> timedelta | None:
        gen = task.payload["gen"]
        runs.append((task.record.owner or "", gen, task.token))
        if gen == 1 and len(runs) == 1:
            stale_gate.wait(30)  # n1's first run: stalls through the partition
            return None
        if gen == 2:
            live_gate.wait(30)
            return timedelta(hours=4)  # the reminder reschedules itself
        return None

    producer = tasks_ctx.make()
    producer.add("remind", "u1", SOON, {"gen": 1})
    n1 = Node(tasks_ctx, N1, Handler("remind", remind, lease=LEASE)).start()
    nodes.append(n1)
    assert wait_for(lambda: len(runs) == 1)
    n1.view.cut = True  # partition: n1's renewals fail, its lease runs out
    let_pass(tasks_ctx, LEASE + 0.5)
    n2 = Node(tasks_ctx, N2, Handler("remind", remind, lease=LEASE)).start()
    nodes.append(n2)
    assert wait_for(lambda: n2.worker.stats.done == 1)  # n2 finishes the task
    n2.stop()
    producer.add("remind", "u1", SOON, {"gen": 2})  # a producer adds it again
    n1.view.cut = False  # the partition heals: n1 claims the new occurrence
    assert wait_for(lambda: any(gen == 2 for _, gen, _ in runs))
    stale_gate.set()  # the stale run ends
    assert wait_for(lambda: n1.worker.stats.refused + n1.worker.stats.released >= 1)
    live_gate.set()
    assert wait_for(lambda: n1.worker.stats.rescheduled == 1)
    task = producer.get("remind", "u1")
    assert task is not None and task.state == "queued" and task.payload == {"gen": 2}
    assert (task.due - producer.now()).total_seconds() > 3 * 3600
    tokens = [token for _, _, token in runs]
    assert tokens == sorted(set(tokens))  # every run had a token above the ones before


@every_backend
def test_chaos_an_outage_past_the_lease_never_deletes_a_half_done_task(tasks_ctx: TaskCtx, nodes: list[Node]) -> None:
    finished: list[int] = []
    started: list[int] = []

    def long_job(task: Task) -> None:
        started.append(task.token)
        for _ in range(40 if len(started) == 1 else 3):
            if task.lost:
                return None  # the documented pattern: stop, write nothing
            time.sleep(0.05)
        finished.append(task.token)
        return None

    producer = tasks_ctx.make()
    producer.add("c", "k", SOON)
    n1 = Node(tasks_ctx, N1, Handler("c", long_job, lease=LEASE)).start()
    nodes.append(n1)
    assert wait_for(lambda: len(started) == 1)
    n1.view.cut = True  # a 1.5 s outage: no renewal gets through within the lease
    let_pass(tasks_ctx, LEASE + 0.5)
    n1.view.cut = False
    assert wait_for(lambda: len(finished) == 1, 30)  # handed back (or its lease ran out): it ran again, all of it
    assert wait_for(lambda: producer.get("c", "k") is None)
    assert len(started) >= 2 and finished == [started[-1]]


@every_backend
def test_chaos_a_poison_row_among_healthy_ones_fails_alone(tasks_ctx: TaskCtx, nodes: list[Node]) -> None:
    producer = tasks_ctx.make()
    for i in range(4):
        producer.add("c", f"ok{i}", SOON)
    producer.add("c", "bad", timedelta(seconds=-5))
    corrupt_payload(tasks_ctx, producer, "c", "bad")
    ran: list[str] = []
    n1 = Node(tasks_ctx, N1, Handler("c", lambda task: ran.append(task.key), lease=5)).start()
    nodes.append(n1)
    assert wait_for(lambda: len(ran) == 4), ran
    counts = lambda: [(s.queued, s.running, s.failed) for s in producer.summary(["c"])]  # noqa: E731
    assert wait_for(lambda: counts() == [(0, 0, 1)]), counts()  # the bad one kept as failed, the others done
    assert sorted(ran) == ["ok0", "ok1", "ok2", "ok3"]


def corrupt_payload(ctx: TaskCtx, store: TaskStore, code: str, key: str) -> None:
    """Write a payload no JSON reader takes, straight into the store (as a bug or a hand edit would)."""
    garbage = "{not json"
    if ctx.kind == "memory":
        store._rows[code, key].payload = garbage  # type: ignore[attr-defined]
    elif ctx.kind in ("redis", "redis-cluster"):
        backend = store.backend  # type: ignore[attr-defined]
        backend.client.hset(backend.key(f"task:{code}:{key}"), "payload", garbage)
    elif ctx.kind in ("mongomock", "mongodb"):
        store.collection.update_one({"code": code, "key": key}, {"$set": {"payload": garbage}})  # type: ignore[attr-defined]
    else:
        sql = f"UPDATE {store.table} SET payload = :p WHERE code = :c AND task_key = :k"  # type: ignore[attr-defined]
        store.backend.execute(sql, {"p": garbage, "c": code, "k": key}, "test", write=True)  # type: ignore[attr-defined]


# -- B5 on the lock table: lock names and job ids ---------------------------------------------------
@pytest.mark.parametrize("kind", backend_params(*ALL_BACKENDS))
def test_lock_names_differing_by_trailing_spaces_are_two_locks(ctx: StoreCtx) -> None:
    store = ctx.make()
    a, b = LockNode("node-a:1:aaaa", "10.0.0.1"), LockNode("node-b:2:bbbb", "10.0.0.2")
    assert store.acquire_or_renew("report", a, ttl=60).acquired
    assert store.acquire_or_renew("report ", b, ttl=60).acquired  # another lock, not "report" held by a
    held = store.read("report")
    assert held is not None and held.holder == a.node_id
