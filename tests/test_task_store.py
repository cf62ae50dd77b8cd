"""The task store contract (mutexcron/tasks/base.py), run over every backend that has a task store.

Due times, claims and leases come from the store's clock: on the memory store a fake clock is
moved (and a test moves it away from this process's clock to show the node's clock plays no
part); on real servers due times are set from the store's own clock and short leases are waited
out. A missing server skips its tests, and fails the run under ``CI=true`` (tests/backends.py).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from mutexcron import TaskPool, TaskRecord
from mutexcron.errors import AttrsError, ConfigurationError
from mutexcron.tasks import AddResult, Done, Fail, Outcome, Reschedule, Retry, TaskStore, task_store_from_url
from mutexcron.tasks.stores.memory import MemoryTaskStore
from tests import task_workers
from tests.backends import FakeClock, backend_params, cleanup_redis, drop_tasks_table, require_server

TASK_BACKENDS = ("memory", "sqlite", "mysql", "postgresql", "redis", "redis-cluster", "mongomock", "mongodb")
every_backend = pytest.mark.parametrize("kind", backend_params(*TASK_BACKENDS))

A, B = "node-a:1:aaaa", "node-b:2:bbbb"
LEASE = 1.0
SOON = timedelta(seconds=-1)  # already due by the store's clock


@dataclass
class TaskCtx:
    """An isolated task store on one backend; ``make()`` opens another client on the same tasks."""

    kind: str
    url: str | None
    factory: Callable[[], TaskStore]
    clock: FakeClock | None = None
    opened: list[TaskStore] = field(default_factory=list)

    def make(self) -> TaskStore:
        store = self.factory()
        self.opened.append(store)
        return store

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock: move the fake clock, or sleep on a real server."""
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            time.sleep(seconds)


@pytest.fixture
def tasks_ctx(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TaskCtx]:
    """A task store on backend ``kind`` with a table (or memory space) of its own, dropped afterwards."""
    tag = secrets.token_hex(4)
    cleanup: Callable[[], None] | None = None
    if kind == "memory":
        clock = FakeClock()
        ctx = TaskCtx(kind, None, lambda: MemoryTaskStore(f"memory://tasks-{tag}", clock=clock), clock)
    elif kind == "sqlite":
        url = f"sqlite:///{tmp_path}/tasks-{tag}.db"
        ctx = TaskCtx(kind, url, lambda: task_store_from_url(url))
    elif kind in ("redis", "redis-cluster"):
        if kind == "redis":
            base = require_server(kind)
            url = f"{base}{'&' if '?' in base else '?'}namespace=tasks-{tag}"
        else:  # the session's cluster, started on first use
            url = request.getfixturevalue("redis_cluster").namespaced_url(f"tasks-{tag}")
        ctx = TaskCtx(kind, url, lambda: task_store_from_url(url))
        cleanup = lambda: cleanup_redis(url)  # noqa: E731
    elif kind in ("mongomock", "mongodb"):
        if request.function.__name__ == "test_four_racers_claim_every_task_exactly_once":
            pytest.skip(
                "mongomock is in-process and serializes every call: no race to run"
                if kind == "mongomock"
                else "MongoDB's 4-process race is tests/test_task_store_mongodb.py (seeded with insert_many)"
            )
        if kind == "mongomock":
            pytest.importorskip("mongomock")
            from tests.mongomock_support import open_mongomock_tasks

            factory, clock = open_mongomock_tasks(tag)
            ctx = TaskCtx(kind, None, factory, clock)
        else:
            base = require_server(kind)
            url = f"{base}{'&' if '?' in base else '?'}tasks_collection=mc_tasks_{tag}"
            ctx = TaskCtx(kind, url, lambda: task_store_from_url(url))

            def cleanup_mongodb() -> None:
                store = task_store_from_url(url)
                try:
                    store.collection.drop()  # type: ignore[attr-defined]
                finally:
                    store.close()

            cleanup = cleanup_mongodb
    else:
        base = require_server(kind)
        url = f"{base}{'&' if '?' in base else '?'}tasks_table=mc_tasks_{tag}"
        ctx = TaskCtx(kind, url, lambda: task_store_from_url(url))
        cleanup = lambda: drop_tasks_table(url)  # noqa: E731
    try:
        yield ctx
    finally:
        for store in ctx.opened:
            store.close()
        if cleanup is not None:
            cleanup()


def _claim_keys(store: TaskStore, node: str = A, codes: tuple[str, ...] = ("c",), lease: float = 30) -> list[str]:
    return [t.key for t in store.claim(node, codes, 100, lease)]


def _close(a: datetime | None, b: datetime, within: float = 2.0) -> bool:
    return a is not None and abs((a - b).total_seconds()) <= within


# -- add -----------------------------------------------------------------------------------------
@every_backend
def test_add_inserts_a_queued_task_and_get_returns_it(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    due = store.now() + timedelta(hours=1)
    assert store.add("end_promotion", "sku-123", due, {"pct": 20, "tags": ["a", "é"]}) is AddResult.INSERTED
    task = store.get("end_promotion", "sku-123")
    assert isinstance(task, TaskRecord)
    assert (task.code, task.key, task.state) == ("end_promotion", "sku-123", "queued")
    assert (task.attempt, task.token, task.owner) == (0, 0, None)
    assert task.due == due and task.due.tzinfo is not None
    assert task.payload == {"pct": 20, "tags": ["a", "é"]}
    assert task.idempotency_key == f"end_promotion:sku-123:{due.isoformat()}#{task.occurrence}"
    assert task.created is not None and task.updated is not None and task.lease_until is None
    assert task.run_at == due  # claimable at its due
    assert not task.pending and not task.cancel_requested
    assert store.get("end_promotion", "missing") is None
    assert store.add("x", "y", timedelta(minutes=5)) == "inserted"  # a str, too


@every_backend
@pytest.mark.parametrize(
    ("mode", "offset", "result", "kept_first"),
    [
        ("replace", +60, AddResult.REPLACED, False),
        ("keep", -60, AddResult.KEPT, True),
        ("earliest", -60, AddResult.REPLACED, False),
        ("earliest", +60, AddResult.KEPT, True),
        ("latest", +60, AddResult.REPLACED, False),
        ("latest", -60, AddResult.KEPT, True),
    ],
)
def test_add_on_a_queued_task_follows_on_conflict(
    tasks_ctx: TaskCtx, mode: str, offset: int, result: AddResult, kept_first: bool
) -> None:
    store = tasks_ctx.make()
    first = store.now() + timedelta(hours=1)
    second = first + timedelta(seconds=offset)
    store.add("c", "k", first, {"v": 1})
    assert store.add("c", "k", second, {"v": 2}, on_conflict=mode) is result
    task = store.get("c", "k")
    assert task is not None and task.state == "queued"
    assert (task.due, task.payload) == ((first, {"v": 1}) if kept_first else (second, {"v": 2}))


@every_backend
def test_a_timedelta_due_is_measured_from_the_store_clock(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "k", timedelta(days=3))
    task = store.get("c", "k")
    assert task is not None and _close(task.due, store.now() + timedelta(days=3))


@every_backend
def test_add_revives_a_failed_task_unless_keep(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "k", SOON, {"v": 1})
    [task] = store.claim(A, ["c"], 10, 30)
    assert store.complete(A, "c", "k", task.token, Fail("boom"))
    assert store.add("c", "k", SOON, {"v": 2}, on_conflict="keep") is AddResult.KEPT
    assert store.get("c", "k").state == "failed"  # type: ignore[union-attr]
    assert store.add("c", "k", SOON, {"v": 3}, on_conflict="latest") is AddResult.REPLACED
    revived = store.get("c", "k")
    assert revived is not None and (revived.state, revived.attempt, revived.last_error) == ("queued", 0, None)
    assert revived.payload == {"v": 3}
    assert _claim_keys(store) == ["k"]


@every_backend
def test_a_readd_while_running_is_pending_never_a_second_run(tasks_ctx: TaskCtx) -> None:
    a, b = tasks_ctx.make(), tasks_ctx.make()
    a.add("c", "k", SOON, {"v": 1})
    [task] = a.claim(A, ["c"], 10, 30)
    assert b.add("c", "k", SOON, {"v": 2}) is AddResult.PENDING
    assert b.add("c", "k", timedelta(hours=1), {"v": 3}, on_conflict="earliest") is AddResult.KEPT  # the pending one is earlier
    assert b.add("c", "k", timedelta(hours=1), {"v": 3}, on_conflict="keep") is AddResult.KEPT
    current = b.get("c", "k")
    assert current is not None and current.state == "running" and current.payload == {"v": 1}
    assert current.pending and current.pending_payload == {"v": 2}
    assert b.claim(B, ["c"], 10, 30) == []  # due, but running: no second concurrent run
    assert a.complete(A, "c", "k", task.token, Done())
    queued = b.get("c", "k")
    assert queued is not None and (queued.state, queued.payload, queued.attempt, queued.pending) == ("queued", {"v": 2}, 0, False)
    [again] = b.claim(B, ["c"], 10, 30)
    assert again.payload == {"v": 2} and again.token == task.token + 1


@every_backend
def test_a_pending_readd_wins_over_any_outcome(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    outcomes: dict[str, Outcome] = {"k0": Reschedule(timedelta(hours=5)), "k1": Retry(timedelta(hours=5), "e"), "k2": Fail("e")}
    for key in outcomes:
        store.add("c", key, SOON, {"v": 1})
    for task in store.claim(A, ["c"], 10, 30):
        assert store.add("c", task.key, timedelta(seconds=-2), {"v": 2}) is AddResult.PENDING
        assert store.complete(A, "c", task.key, task.token, outcomes[task.key])
    assert {t.key: (t.state, t.payload, t.last_error) for t in store.list(code="c")} == {
        key: ("queued", {"v": 2}, None) for key in outcomes
    }
    assert sorted(_claim_keys(store)) == ["k0", "k1", "k2"]


# -- cancel ---------------------------------------------------------------------------------------
@every_backend
def test_cancel_drops_a_queued_task_and_a_running_one_when_its_attempt_ends(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "queued", timedelta(hours=1))
    store.add("c", "running", SOON)
    assert store.cancel("c", "queued") and store.get("c", "queued") is None
    assert not store.cancel("c", "queued") and not store.cancel("c", "never")
    [task] = store.claim(A, ["c"], 10, 30)
    store.add("c", "running", SOON, {"v": 2})  # a pending re-add: the cancel drops it too
    assert store.cancel("c", "running")
    marked = store.get("c", "running")
    assert marked is not None and marked.state == "running" and marked.cancel_requested and not marked.pending
    assert store.complete(A, "c", "running", task.token, Retry(SOON, "would retry"))
    assert store.get("c", "running") is None


@every_backend
def test_an_add_after_a_cancel_wins(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "k", SOON)
    [task] = store.claim(A, ["c"], 10, 30)
    assert store.cancel("c", "k")
    assert store.add("c", "k", SOON, {"v": 2}) is AddResult.PENDING
    assert store.complete(A, "c", "k", task.token, Done())
    assert store.get("c", "k").payload == {"v": 2}  # type: ignore[union-attr]


@every_backend
def test_a_cancelled_task_whose_worker_died_is_dropped_never_run(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "k", SOON)
    store.claim(A, ["c"], 10, LEASE)
    assert store.cancel("c", "k")
    tasks_ctx.wait(LEASE * 1.5)
    assert store.claim(B, ["c"], 10, 30) == []
    assert store.get("c", "k") is None


@every_backend
def test_every_way_a_cancel_ends_an_occurrence_is_recorded_as_a_cancel_not_a_finish(tasks_ctx: TaskCtx) -> None:
    """The write that ends an occurrence records how (the dashboard's finished and cancelled per
    minute): a cancel of a queued or a failed task, a cancel asked during the attempt (whatever its
    outcome) or before a dead worker's task is rescued, and a hand-back of a cancelled claim are
    cancels; only an attempt done without a cancel is a finish. Tokens still go up across them."""
    from mutexcron.dashboard.finished import finished_since

    store = tasks_ctx.make()
    since = store.now() - timedelta(minutes=1)
    for code in ("done", "queued", "failed", "running", "handed", "dead"):
        store.add(code, "k", timedelta(hours=1) if code == "queued" else SOON)
    assert store.cancel("queued", "k")
    claimed = {t.code: t for t in store.claim(A, ["done", "failed", "running", "handed"], 10, 30)}
    assert store.complete(A, "done", "k", claimed["done"].token, Done())
    assert store.complete(A, "failed", "k", claimed["failed"].token, Fail("no"))
    assert store.cancel("failed", "k")
    assert store.cancel("running", "k") and store.cancel("handed", "k")
    assert store.complete(A, "running", "k", claimed["running"].token, Done())
    assert store.release(A, [("handed", "k", claimed["handed"].token)]) == 1
    assert len(store.claim(A, ["dead"], 10, LEASE)) == 1
    assert store.cancel("dead", "k")
    tasks_ctx.wait(LEASE * 1.5)
    assert store.claim(B, ["dead"], 10, 30) == []
    ended: dict[tuple[str, bool], int] = {}
    for end in finished_since(tasks_ctx.make(), since, 100):
        ended[(end.code, end.cancelled)] = ended.get((end.code, end.cancelled), 0) + end.occurrences
    assert ended == {("done", False): 1, **{(code, True): 1 for code in ("queued", "failed", "running", "handed", "dead")}}
    store.add("running", "k", SOON)  # a new occurrence after a cancelled one: the token goes on
    [again] = store.claim(A, ["running"], 10, 30)
    assert again.token > claimed["running"].token


# -- claim -----------------------------------------------------------------------------------------
@every_backend
def test_claim_takes_only_due_tasks_of_the_given_codes_earliest_first(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    now = store.now()
    store.add("c", "second", now - timedelta(seconds=5))
    store.add("c", "first", now - timedelta(seconds=50))
    store.add("c", "later", now + timedelta(hours=1))
    store.add("other", "o", now - timedelta(seconds=60))
    assert [t.key for t in store.claim(A, ["c", "unknown"], 1, 30)] == ["first"]
    [task] = store.claim(A, ["c"], 10, 30)
    after = store.now()
    assert (task.key, task.state, task.owner, task.token, task.attempt) == ("second", "running", A, 1, 1)
    assert task.lease_until is not None and _close(task.lease_until, after + timedelta(seconds=30))
    assert store.claim(A, ["c"], 10, 30) == []
    assert store.get("other", "o").state == "queued"  # type: ignore[union-attr]
    assert store.claim(A, [], 10, 30) == []


@every_backend
def test_claim_waits_for_the_due_time_by_the_store_clock(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "absolute", store.now() + timedelta(seconds=1.5))
    store.add("c", "relative", timedelta(seconds=1.5))
    assert store.claim(A, ["c"], 10, 30) == []
    wait = store.next_due(["c"])
    assert wait is not None and 0 < wait <= 1.5
    tasks_ctx.wait(1.7)
    assert store.next_due(["c"]) == 0.0
    assert sorted(_claim_keys(store)) == ["absolute", "relative"]


@pytest.mark.memory
def test_the_client_clock_plays_no_part() -> None:
    """The store's clock runs an hour ahead of this process's: due times follow the store's."""
    clock = FakeClock()
    store = MemoryTaskStore(f"memory://skew-{secrets.token_hex(4)}", clock=clock)
    client_now = datetime.now(timezone.utc)
    store.add("c", "in-30-min-by-the-client", client_now + timedelta(minutes=30))
    assert store.claim(A, ["c"], 10, 30) == []
    clock.advance(3600)
    assert _claim_keys(store) == ["in-30-min-by-the-client"]
    store.add("c", "relative", timedelta(seconds=10))
    task = store.get("c", "relative")
    assert task is not None and _close(task.due, client_now + timedelta(seconds=3610))


@every_backend
def test_an_expired_lease_makes_the_task_claimable_again_and_fences_the_old_worker(tasks_ctx: TaskCtx) -> None:
    a, b = tasks_ctx.make(), tasks_ctx.make()
    a.add("c", "k", SOON, {"v": 1})
    [first] = a.claim(A, ["c"], 10, LEASE)
    assert a.start(A, [("c", "k", first.token)]) == 1  # its handler started
    assert b.claim(B, ["c"], 10, LEASE) == []  # the lease runs
    tasks_ctx.wait(LEASE * 1.5)
    [second] = b.claim(B, ["c"], 10, 30)
    assert (second.owner, second.token, second.attempt) == (B, first.token + 1, 2)  # the attempt count is kept
    # The stale worker wakes up: every write it makes is refused and changes nothing.
    assert a.renew(A, {("c", "k"): first.token}, 30) == set()
    for outcome in (Done(), Reschedule(SOON), Retry(SOON, "late"), Fail("late")):
        assert not a.complete(A, "c", "k", first.token, outcome)
    assert a.release(A, [("c", "k", first.token)]) == 0
    current = a.get("c", "k")
    assert current is not None and (current.state, current.owner, current.token) == ("running", B, second.token)
    assert b.complete(B, "c", "k", second.token, Done())
    assert b.get("c", "k") is None
    assert not b.complete(B, "c", "k", second.token, Done())  # gone: nothing to record


@every_backend
def test_renew_extends_only_the_callers_current_leases(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    for key in ("k1", "k2", "k3"):
        store.add("c", key, SOON)
    tasks = {t.key: t for t in store.claim(A, ["c"], 10, LEASE)}
    tokens = {("c", key): t.token for key, t in tasks.items()}
    tokens["c", "k3"] += 1  # not the token it holds
    tokens["c", "missing"] = 1
    assert store.renew(A, tokens, 30) == {("c", "k1"), ("c", "k2")}
    assert store.renew(B, {("c", "k1"): tasks["k1"].token}, 30) == set()
    assert store.renew(A, {}, 30) == set()
    tasks_ctx.wait(LEASE * 1.5)
    assert _claim_keys(store, B) == ["k3"]  # k1 and k2 were renewed for 30 s
    renewed = store.get("c", "k1")
    assert renewed is not None and renewed.lease_until is not None and renewed.lease_until > store.now() + timedelta(seconds=20)


# -- outcomes ------------------------------------------------------------------------------------------
@every_backend
def test_retry_then_fail_then_retry_by_hand(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    pool = TaskPool(store)
    pool.add("c", "k", SOON, {"v": 1})
    [task] = store.claim(A, ["c"], 10, 30)
    due = task.due
    assert task.run_at == task.lease_until
    assert store.complete(A, "c", "k", task.token, Retry(timedelta(seconds=-1), "ValueError: boom"))
    queued = pool.get("c", "k")
    assert queued is not None and (queued.state, queued.attempt, queued.last_error) == ("queued", 1, "ValueError: boom")
    assert queued.due == due and _close(queued.run_at, store.now() - timedelta(seconds=1))  # the same occurrence
    [task] = store.claim(A, ["c"], 10, 30)
    assert task.attempt == 2 and task.due == due
    assert store.complete(A, "c", "k", task.token, Fail("x" * 10_000))
    failed = pool.get("c", "k")
    assert failed is not None and failed.state == "failed" and failed.attempt == 2 and failed.lease_until is None
    assert failed.run_at is None and failed.due == due
    assert failed.last_error is not None and len(failed.last_error) == 4000  # kept, bounded
    assert store.claim(A, ["c"], 10, 30) == [] and store.next_due(["c"]) is None
    assert [t.key for t in pool.list(state="failed")] == ["k"]
    assert pool.retry("c", "k") and not pool.retry("c", "k") and not pool.retry("c", "missing")
    retried = pool.get("c", "k")
    assert retried is not None and (retried.state, retried.attempt) == ("queued", 0)
    assert retried.due == due and _close(retried.run_at, store.now())  # claimable now; the occurrence is kept
    assert retried.idempotency_key == task.idempotency_key
    assert _claim_keys(store) == ["k"]


@every_backend
def test_reschedule_queues_a_new_occurrence(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "k", SOON, {"v": 1})
    [task] = store.claim(A, ["c"], 10, 30)
    at = store.now() + timedelta(hours=2)
    assert store.complete(A, "c", "k", task.token, Reschedule(at))
    again = store.get("c", "k")
    assert again is not None and (again.state, again.due, again.attempt, again.payload) == ("queued", at, 0, {"v": 1})
    assert again.idempotency_key != task.idempotency_key
    assert store.claim(A, ["c"], 10, 30) == []  # not due for two hours
    assert not store.complete(A, "c", "k", task.token, Done())  # the attempt is over: nothing left to record


@every_backend
def test_reschedule_with_a_payload_replaces_it_in_the_same_fenced_write(tasks_ctx: TaskCtx) -> None:
    """Issue 25 item 14: a handler carries a cursor from run to run in one return value."""
    store = tasks_ctx.make()
    store.add("c", "k", SOON, {"cursor": 1})
    [task] = store.claim(A, ["c"], 10, 30)
    at = store.now() + timedelta(hours=2)
    with pytest.raises(AttrsError, match="payload of task 'c'/'k'"):  # checked before anything is written
        store.complete(A, "c", "k", task.token, Reschedule(at, payload={"when": datetime.now(timezone.utc)}))
    assert store.complete(A, "c", "k", task.token, Reschedule(at, payload={"cursor": 2, "é": [None, 1.5]}))
    again = store.get("c", "k")
    assert again is not None and (again.state, again.due, again.attempt) == ("queued", at, 0)
    assert again.payload == {"cursor": 2, "é": [None, 1.5]}
    # A stale worker's reschedule changes nothing, payload included.
    assert not store.complete(A, "c", "k", task.token, Reschedule(at, payload={"cursor": 99}))
    # None is a payload (JSON null); the default keeps the payload.
    store.add("c", "n", SOON, {"cursor": 1})
    store.add("c", "kept", SOON, {"cursor": 1})
    claimed = {t.key: t for t in store.claim(A, ["c"], 10, 30)}
    assert store.complete_many(A, [("c", "n", claimed["n"].token, Reschedule(at, payload=None)),
                                   ("c", "kept", claimed["kept"].token, Reschedule(at))]) == [True, True]  # fmt: skip
    nulled, kept = store.get("c", "n"), store.get("c", "kept")
    assert nulled is not None and nulled.payload is None
    assert kept is not None and kept.payload == {"cursor": 1}


@every_backend
def test_every_attempt_of_one_occurrence_has_one_idempotency_key(tasks_ctx: TaskCtx) -> None:
    """A Retry, a hand-back and a retry by hand keep the due (the occurrence) and move only run_at;
    a Reschedule starts a new occurrence: a new key."""
    store = tasks_ctx.make()
    store.add("c", "k", timedelta(seconds=-5), {"v": 1})
    added = store.get("c", "k")
    assert added is not None and added.run_at == added.due
    due = added.due
    [first] = store.claim(A, ["c"], 10, 30)
    assert first.due == due and first.run_at == first.lease_until and first.run_at is not None
    assert store.complete(A, "c", "k", first.token, Retry(timedelta(seconds=1), "boom"))
    waiting = store.get("c", "k")
    assert waiting is not None and (waiting.state, waiting.due, waiting.attempt) == ("queued", due, 1)
    assert waiting.run_at is not None and _close(waiting.run_at, store.now() + timedelta(seconds=1), 0.5)
    assert store.claim(A, ["c"], 10, 30) == []  # its due has long passed: the retry's time counts
    wait = store.next_due(["c"])
    # <= 1 s, give or take SQLite's julianday arithmetic (about 40 µs of float resolution): read in
    # the same millisecond as the retry was written, the wait came back as 1.0000348 once.
    assert wait is not None and 0 < wait <= 1.001
    assert [t.key for t in store.list(due_before=due + timedelta(milliseconds=1))] == ["k"]  # list filters on due
    tasks_ctx.wait(1.2)
    [listed] = store.list(code="c")
    assert listed.run_at == waiting.run_at
    [overdue] = store.summary(["c"])
    assert overdue.due_now == 1 and overdue.oldest_overdue is not None and overdue.oldest_overdue >= 5.0  # since the due
    [second] = store.claim(A, ["c"], 10, 30)
    assert second.attempt == 2 and second.idempotency_key == first.idempotency_key
    assert store.release(A, [("c", "k", second.token)]) == 1  # a hand-back: the same occurrence, claimable now
    [third] = store.claim(B, ["c"], 10, 30)
    assert third.attempt == 2 and third.idempotency_key == first.idempotency_key
    assert store.complete(B, "c", "k", third.token, Reschedule(timedelta(seconds=-1)))  # a new occurrence
    [fourth] = store.claim(A, ["c"], 10, 30)
    assert fourth.attempt == 1 and fourth.due > due and fourth.idempotency_key != first.idempotency_key


@every_backend
def test_release_hands_unstarted_tasks_back_at_once(tasks_ctx: TaskCtx) -> None:
    a, b = tasks_ctx.make(), tasks_ctx.make()
    for key in ("plain", "pending", "cancelled"):
        a.add("c", key, SOON, {"v": 1})
    claimed = {t.key: t for t in a.claim(A, ["c"], 10, 300)}
    a.add("c", "pending", SOON, {"v": 2})
    a.cancel("c", "cancelled")
    assert a.release(A, [("c", k, t.token) for k, t in claimed.items()]) == 3
    assert a.get("c", "cancelled") is None
    plain, pending = a.get("c", "plain"), a.get("c", "pending")
    assert plain is not None and (plain.state, plain.attempt, plain.token) == ("queued", 0, claimed["plain"].token + 1)
    assert plain.due == claimed["plain"].due and _close(plain.run_at, a.now()) and plain.lease_until is None
    assert pending is not None and (pending.state, pending.payload) == ("queued", {"v": 2})
    retaken = {t.key: t for t in b.claim(B, ["c"], 10, 30)}  # no lease to wait out
    assert sorted(retaken) == ["pending", "plain"] and retaken["plain"].attempt == 1
    assert not a.complete(A, "c", "plain", claimed["plain"].token, Done())


# -- complete_many -----------------------------------------------------------------------------------------
def _ms(at: datetime) -> datetime:
    """``at`` to the millisecond: every store keeps that exactly (MongoDB keeps no more)."""
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


def _batch(store: TaskStore, code: str, times: dict[str, datetime]) -> list[tuple[str, str, int, Outcome]]:
    """Tasks of ``code`` claimed by A (``stale``: taken over by B since), cancelled or re-added while
    running, and the completions A records for them (one of each kind, one with a stale token)."""
    for key in ("done", "retry", "resched", "fail", "cancelled", "pending"):
        store.add(code, key, times["due"], {"v": 1})
    tokens = {t.key: t.token for t in store.claim(A, [code], 10, 30)}
    assert store.cancel(code, "cancelled")
    assert store.add(code, "pending", times["pending"], {"v": 2}) is AddResult.PENDING
    [stale] = [t for t in store.list(code=f"{code}-stale")]
    return [
        (code, "done", tokens["done"], Done()),
        (code, "retry", tokens["retry"], Retry(times["retry"], "e1")),
        (code, "resched", tokens["resched"], Reschedule(times["resched"])),
        (code, "fail", tokens["fail"], Fail("e2")),
        (f"{code}-stale", "s", stale.token - 1, Done()),  # A's claim, taken over by B since
        (code, "cancelled", tokens["cancelled"], Retry(times["retry"], "dropped anyway")),
        (code, "pending", tokens["pending"], Fail("the pending re-add wins")),
    ]


def _end_state(store: TaskStore, code: str) -> dict[str, Any]:
    """Each task's fields that do not depend on when it was written (a running task's run_at is its lease's end)."""
    return {
        t.key: (t.state, t.due, t.run_at if t.state != "running" else None, t.attempt, t.payload, t.last_error, t.owner)
        for c in (code, f"{code}-stale")
        for t in store.list(code=c)
    }


class RoundTrips:
    """Counts what one store sends: Redis commands, SQL statements and commits, MongoDB collection calls."""

    def __init__(self, kind: str, store: TaskStore) -> None:
        self.kind, self.store = kind, store
        self.calls: list[str] = []

    def __enter__(self) -> RoundTrips:
        store: Any = self.store
        if self.kind in ("redis", "redis-cluster"):
            client = store.backend.client
            original = client.execute_command

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(str(args[0]).upper())
                return original(*args, **kwargs)

            client.execute_command = counted
            self._undo: Callable[[], None] = lambda: delattr(client, "execute_command")
        elif self.kind in ("sqlite", "mysql", "postgresql"):
            import sqlalchemy

            def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
                self.calls.append(statement.split()[0].upper())

            engine = store.backend.engine
            sqlalchemy.event.listen(engine, "before_cursor_execute", before)
            self._undo = lambda: sqlalchemy.event.remove(engine, "before_cursor_execute", before)
        elif self.kind in ("mongomock", "mongodb"):
            collection, calls = store.collection, self.calls

            class Counted:
                def __getattr__(self, name: str) -> Any:
                    calls.append(name)
                    return getattr(collection, name)

            store.collection = Counted()
            self._undo = lambda: setattr(store, "collection", collection)
        else:
            self._undo = lambda: None
        return self

    def __exit__(self, *exc: object) -> None:
        self._undo()


@every_backend
def test_complete_many_is_complete_for_each_in_one_round_trip(tasks_ctx: TaskCtx) -> None:
    """Mixed outcomes, a stale token, a task cancelled while running and one re-added while running:
    complete_many gives the results and the end state of one complete() after the other, and
    sends one script call (Redis), one transaction (SQL), one find and one bulk write (MongoDB)."""
    store = tasks_ctx.make()
    now = store.now()
    times = {
        "due": _ms(now - timedelta(seconds=5)),
        "pending": _ms(now - timedelta(seconds=2)),
        "retry": _ms(now + timedelta(minutes=10)),
        "resched": _ms(now + timedelta(hours=2)),
    }
    for code in ("one", "many"):
        store.add(f"{code}-stale", "s", times["due"])
        [stale] = store.claim(A, [f"{code}-stale"], 10, LEASE)
        store.start(A, [(stale.code, stale.key, stale.token)])
    tasks_ctx.wait(LEASE * 1.5)
    assert len(store.claim(B, ["one-stale", "many-stale"], 10, 30)) == 2  # A's claims are taken over
    one, many = _batch(store, "one", times), _batch(store, "many", times)
    expected = [True, True, True, True, False, True, True]

    assert [store.complete(A, *item) for item in one] == expected
    with RoundTrips(tasks_ctx.kind, store) as sent:
        assert store.complete_many(A, many) == expected
    assert _end_state(store, "many") == _end_state(store, "one")
    assert _end_state(store, "many") == {
        "retry": ("queued", times["due"], times["retry"], 1, {"v": 1}, "e1", A),
        "resched": ("queued", times["resched"], times["resched"], 0, {"v": 1}, None, A),
        "fail": ("failed", times["due"], None, 1, {"v": 1}, "e2", A),
        "s": ("running", times["due"], None, 2, None, None, B),
        "pending": ("queued", times["pending"], times["pending"], 0, {"v": 2}, None, A),
    }
    if tasks_ctx.kind in ("redis", "redis-cluster"):
        assert sent.calls == ["EVALSHA"], sent.calls
    elif tasks_ctx.kind in ("sqlite", "postgresql"):  # every Done in one statement, then the rest in one transaction
        assert sent.calls.count("COMMIT") == 1 and sent.calls[-1] == "COMMIT", sent.calls
        assert sent.calls[0] == "UPDATE" and sent.calls[1] in ("BEGIN", "START"), sent.calls
    elif tasks_ctx.kind == "mysql":
        assert sent.calls.count("COMMIT") == 1 and sent.calls[-1] == "COMMIT", sent.calls  # one transaction
        assert sent.calls[0] in ("BEGIN", "START"), sent.calls
    elif tasks_ctx.kind in ("mongomock", "mongodb"):
        assert sent.calls == ["find", "bulk_write"], sent.calls
    assert store.complete_many(A, []) == []
    with pytest.raises(ConfigurationError):
        store.complete_many(A, [("many", "retry", 1, Done()), ("many", "retry", 1, "done")])  # type: ignore[list-item]


@every_backend
def test_a_stale_completion_in_a_batch_of_dones_is_refused_while_the_others_count(tasks_ctx: TaskCtx) -> None:
    """The busy worker's case: a batch of Done. PostgreSQL and SQLite end them in one statement,
    each fenced on owner and token; a stale one (taken over by B) is refused and B's attempt kept."""
    store = tasks_ctx.make()
    due = store.now() - timedelta(seconds=5)
    store.add("d-stale", "s", due)
    store.claim(A, ["d-stale"], 1, LEASE)
    tasks_ctx.wait(LEASE * 1.5)
    [taken] = store.claim(B, ["d-stale"], 1, 30)
    for i in range(5):
        store.add("d", f"k{i}", due)
    claimed = sorted(store.claim(A, ["d"], 10, 30), key=lambda t: t.key)
    batch: list[tuple[str, str, int, Outcome]] = [("d", t.key, t.token, Done()) for t in claimed]
    batch.insert(2, ("d-stale", "s", taken.token - 1, Done()))
    with RoundTrips(tasks_ctx.kind, store) as sent:
        assert store.complete_many(A, batch) == [True, True, False, True, True, True]
    assert store.list(code="d") == []
    after = store.get("d-stale", "s")
    assert after is not None and (after.state, after.owner, after.token) == ("running", B, taken.token)
    if tasks_ctx.kind in ("sqlite", "postgresql"):
        assert sent.calls[0] == "UPDATE" and "BEGIN" not in sent.calls, sent.calls  # one statement, then the stale one alone


# -- reads ------------------------------------------------------------------------------------------------
@every_backend
def test_list_filters_and_orders_by_due(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    now = store.now()
    store.add("remind", "user-1:Morning", now + timedelta(hours=3))
    store.add("remind", "user-2:evening", now + timedelta(hours=1))
    store.add("close_order", "order-9", now - timedelta(seconds=1))
    store.claim(A, ["close_order"], 10, 30)
    assert [t.key for t in store.list()] == ["order-9", "user-2:evening", "user-1:Morning"]
    assert [t.key for t in store.list(code="remind")] == ["user-2:evening", "user-1:Morning"]
    assert [t.key for t in store.list(key_contains="user-")] == ["user-2:evening", "user-1:Morning"]
    assert [t.key for t in store.list(key_contains="morning")] == []  # case-sensitive on every store
    assert [t.key for t in store.list(key_contains="%")] == []  # no wildcards
    assert [t.key for t in store.list(due_before=now + timedelta(hours=2))] == ["order-9", "user-2:evening"]
    assert [t.key for t in store.list(state="running")] == ["order-9"]
    assert [t.key for t in store.list(limit=1)] == ["order-9"]
    assert store.next_due(["remind"]) == pytest.approx(3600, abs=5)
    assert store.next_due(["nothing"]) is None


@every_backend
def test_bad_input_is_refused_and_stores_nothing(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    naive = datetime.now() + timedelta(hours=1)  # the mistake under test
    with pytest.raises(ConfigurationError, match=r"naive datetime.*aware"):
        store.add("c", "k", naive)
    for due in (30, "2030-01-01T00:00:00Z", None):
        with pytest.raises(ConfigurationError, match="aware datetime"):
            store.add("c", "k", due)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on_conflict='upsert' is not one of"):
        store.add("c", "k", SOON, on_conflict="upsert")
    bad_payloads = (
        ({"at": datetime.now(timezone.utc)}, "datetime"),
        ({1: "x"}, "key 1"),
        ([float("nan")], "nan"),
        ({"s": {1}}, "set"),
    )
    for payload, where in bad_payloads:
        with pytest.raises(AttrsError, match=where):
            store.add("c", "k", SOON, payload)
    for code, key in (("", "k"), ("c", ""), ("c" * 192, "k"), ("c", "k" * 192), ("c", "a\nb"), (None, "k")):
        with pytest.raises(ConfigurationError, match=r"task (code|key)"):
            store.add(code, key, SOON)  # type: ignore[arg-type]
    for bad in (Reschedule(naive), "done"):
        with pytest.raises(ConfigurationError):
            store.complete(A, "c", "k", 1, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="limit"):
        store.claim(A, ["c"], 0, 30)
    with pytest.raises(ConfigurationError, match="lease"):
        store.claim(A, ["c"], 1, 0)
    with pytest.raises(ConfigurationError, match="due_before"):
        store.list(due_before=timedelta(hours=1))  # type: ignore[arg-type]
    assert store.list() == []
    assert store.add("c", "k" * 191, SOON) is AddResult.INSERTED  # the longest key fits


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql"))
def test_the_claim_is_an_index_range_scan(tasks_ctx: TaskCtx) -> None:
    """With 3,000 tasks, 20 of them due and 1,000 of another code, the claim reads the (code, run_at) index."""
    from mutexcron.tasks.stores.sql_statements import STATEMENTS

    store = tasks_ctx.make()
    task_workers.seed_due(tasks_ctx.kind, store, "due", 20)
    task_workers.seed_due(tasks_ctx.kind, store, "other", 1000, prefix="o")
    task_workers.seed_due(tasks_ctx.kind, store, "later", 2000, minutes=60)
    table = store.table  # type: ignore[attr-defined]
    sql = STATEMENTS[store.backend.dialect.name].bind(table)  # type: ignore[attr-defined]
    pick = sql.claim or sql.claim_pick
    pick, params = sql.codes_shape(pick, sql.claim_part, ["due", "other"])
    explain = {"sqlite": "EXPLAIN QUERY PLAN ", "postgresql": "EXPLAIN ", "mysql": "EXPLAIN "}[tasks_ctx.kind]
    import sqlalchemy

    with store.backend.engine.connect() as conn:  # type: ignore[attr-defined]
        conn.exec_driver_sql(f"ANALYZE {'TABLE ' if tasks_ctx.kind == 'mysql' else ''}{table}")
        rows = conn.execute(sqlalchemy.text(explain + pick), {**params, "me": A, "n": 10, "lease": 30}).fetchall()
    plan = " ".join(str(value) for row in rows for value in row)
    assert f"{table}_run_at" in plan, plan
    assert len(store.claim(A, ["due"], 100, 30)) == 20


def test_task_store_urls() -> None:
    with pytest.raises(ConfigurationError, match="scheme"):
        task_store_from_url("ftp://x")
    with pytest.raises(ConfigurationError, match="bad tasks table"):
        task_store_from_url("sqlite:///x.db?tasks_table=1bad")


# -- concurrency ----------------------------------------------------------------------------------------
@every_backend
def test_concurrent_adds_of_one_task_insert_it_once(tasks_ctx: TaskCtx) -> None:
    """8 clients add the same new task 10 times each at once: one insert, every other add a replace, no error."""
    stores = [tasks_ctx.make() for _ in range(8)]
    barrier = threading.Barrier(len(stores))
    results: list[Any] = []

    def run(i: int) -> None:
        barrier.wait(timeout=30)
        for n in range(10):
            try:
                results.append(stores[i].add("c", "same", timedelta(minutes=5), {"client": i, "n": n}))
            except Exception as exc:
                results.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [r for r in results if not isinstance(r, AddResult)] == []
    assert results.count(AddResult.INSERTED) == 1 and results.count(AddResult.REPLACED) == 79
    assert [t.key for t in stores[0].list()] == ["same"]


RACE_TASKS = {"memory": 10_000, "sqlite": 10_000, "mysql": 10_000, "postgresql": 10_000, "redis": 10_000, "redis-cluster": 10_000}


@every_backend
def test_four_racers_claim_every_task_exactly_once(tasks_ctx: TaskCtx) -> None:
    """4 racers (processes; threads on the in-process store) claim 10,000 due tasks, 20 per claim,
    with a lease that outlasts the test: every task is claimed once, by one racer, at attempt 1."""
    store = tasks_ctx.make()
    total = RACE_TASKS[tasks_ctx.kind]
    task_workers.seed_due(tasks_ctx.kind, store, "race", total)
    nodes = [f"racer-{i}:{secrets.token_hex(3)}" for i in range(4)]
    if tasks_ctx.url is None:
        claimed = task_workers.race_threads([tasks_ctx.make() for _ in nodes], nodes)
    else:
        claimed = task_workers.race_processes(tasks_ctx.url, nodes)
    keys = [key for got in claimed for key, _, _ in got]
    assert len(keys) == total and len(set(keys)) == total, f"{len(keys) - len(set(keys))} claimed twice"
    assert all(token == 1 and attempt == 1 for got in claimed for _, token, attempt in got)
    # The race happened: at least two racers claimed. SQLite serialises writers and its busy wait is
    # not fair, so under load one of four processes can find the tasks gone (seen once in CI).
    assert sum(1 for got in claimed if got) >= 2, "fewer than two racers claimed anything: not a race"
    assert store.list(state="queued", limit=10) == [] and len(store.list(state="running", limit=total + 1)) == total


# -- Redis-specific ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("redis"))
def test_redis_task_keys_share_the_namespace_slot_and_colons_never_collide(tasks_ctx: TaskCtx) -> None:
    """The documented layout (a hash per task, a due ZSET per code, scored by when a claim may take
    the task); a code with ':' never meets another task's hash."""
    from mutexcron.tasks.stores.redis import RedisTaskStore

    store = tasks_ctx.make()
    assert isinstance(store, RedisTaskStore)
    assert store.add("a:b", "c", SOON, 1) is AddResult.INSERTED
    assert store.add("a", "b:c", SOON, 2) is AddResult.INSERTED
    got_1, got_2 = store.get("a:b", "c"), store.get("a", "b:c")
    assert got_1 is not None and got_1.payload == 1 and got_2 is not None and got_2.payload == 2
    client, key = store.backend.client, store.backend.key
    assert client.exists(key("task:a%3Ab:c"), key("task:a:b:c")) == 2
    claimed = store.claim(A, ["a"], 10, 30)
    assert [t.key for t in claimed] == ["b:c"] and claimed[0].lease_until is not None
    assert client.zscore(key("due:a"), "b:c") == store_us(claimed[0].lease_until)
    assert store.complete(A, "a", "b:c", 1, Fail("boom")) and client.zscore(key("due:a"), "b:c") == float("inf")
    assert store.next_due(["a"]) is None and store.next_due(["a:b"]) == 0


def store_us(at: datetime) -> float:
    return float(round(at.timestamp() * 1_000_000))


# -- summary -------------------------------------------------------------------------------------
@every_backend
def test_summary_counts_each_code_by_the_store_clock(tasks_ctx: TaskCtx) -> None:
    from mutexcron.tasks import CodeSummary

    store = tasks_ctx.make()
    assert store.summary() == [] and store.summary(["a"]) == [CodeSummary("a")] and store.summary([]) == []
    store.add("a", "failed", SOON)
    [task] = store.claim(A, ["a"], 1, 30)
    assert store.complete(A, "a", "failed", task.token, Fail("boom"))
    store.add("a", "running", SOON)
    assert _claim_keys(store, codes=("a",), lease=30) == ["running"]
    store.add("a", "expired", SOON)
    assert _claim_keys(store, codes=("a",), lease=LEASE) == ["expired"]
    tasks_ctx.wait(LEASE + 0.5)  # its worker died: due again, by its lease
    store.add("a", "due", timedelta(seconds=-5))
    store.add("a", "later", timedelta(hours=1))
    store.add("b", "later", timedelta(hours=1))
    store.add("gone", "x", SOON)
    assert store.cancel("gone", "x")  # a code whose tasks are all gone is not listed

    a, b = store.summary()
    assert (a.code, a.queued, a.due_now, a.running, a.failed) == ("a", 2, 2, 2, 1)
    assert a.oldest_overdue is not None and 4.0 <= a.oldest_overdue <= 15.0  # "due", 5 s ago
    assert b == CodeSummary("b", queued=1)
    listed = store.summary(["zz", "b", "a", "b"])
    assert [s.code for s in listed] == ["a", "b", "zz"] and listed[1] == b and listed[2] == CodeSummary("zz")
    assert listed[0].due_now == 2 and listed[0].failed == 1
    assert store.summary("b") == [b]  # a lone code is one code


# -- retention: tombstones purged, tokens still only go up ---------------------------------------
def _purge_all(store: TaskStore, older_than: float = 0.0, code: str | None = None) -> int:
    """Every purge batch until none is left (the stores here settle their floor at once)."""
    removed = 0
    for _ in range(100):
        batch = store.purge_batch(older_than, code=code, limit=2)
        removed += batch.removed
        if batch.ready_in is None:
            return removed
        assert batch.ready_in == 0.0  # floor_settle is 0: never a wait
    raise AssertionError("the purge did not end")


@every_backend
def test_a_purged_task_added_again_gets_a_higher_token_and_its_old_attempt_is_refused(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.floor_settle = 0.0  # one client, no concurrent add: no wait for the floor to settle
    keeps_tombstones = tasks_ctx.kind not in ("memory", "redis", "redis-cluster")
    for key in ("k", "other", "third"):
        store.add("c", key, SOON)
    claimed = {t.key: t for t in store.claim(A, ["c"], 10, 30)}
    old = claimed.pop("k")
    assert all(store.complete(A, "c", t.key, t.token, Done()) for t in claimed.values())
    # The stale attempt of "k" (token 1, node A) is what a store resetting tokens would hand out again.
    assert store.cancel("c", "k") and store.complete(A, "c", "k", old.token, Done())
    store.add("d", "live", SOON)
    tasks_ctx.wait(0.05)  # the tombstones are older than "now" by the store's clock

    stored = store.count_stored()  # the metrics' rows: Redis does not count (a scan of the namespace)
    kept = 3 if keeps_tombstones else 0
    assert stored == ({} if tasks_ctx.kind.startswith("redis") else {"rows": 1 + kept, "tombstones": kept})
    assert store.count_purgeable(3600) == 0  # nothing finished an hour ago
    assert store.count_purgeable(0, code="c") == (3 if keeps_tombstones else 0)
    assert _purge_all(store, code="zz") == 0
    assert _purge_all(store) == (3 if keeps_tombstones else 0)
    assert store.count_purgeable(0) == 0 and _purge_all(store) == 0
    assert [t.key for t in store.list()] == ["live"]  # only tombstones go
    assert store.count_stored() in ({}, {"rows": 1, "tombstones": 0})

    assert store.add("c", "k", SOON) is AddResult.INSERTED
    again = store.get("c", "k")
    assert again is not None and again.token >= old.token and again.occurrence is not None and again.occurrence >= old.token
    [new] = store.claim(A, ["c"], 10, 30)
    assert new.key == "k" and new.token > old.token
    for outcome in (Done(), Reschedule(SOON), Retry(SOON, "late"), Fail("late")):
        assert not store.complete(A, "c", "k", old.token, outcome)  # the old attempt is refused
    assert store.release(A, [("c", "k", old.token)]) == 0
    assert store.complete(A, "c", "k", new.token, Done())


# -- attempts count handlers that started (issue 31, M1) -----------------------------------------------
@every_backend
def test_a_rescued_claim_counts_an_attempt_only_if_its_handler_started(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("c", "unstarted", SOON)
    store.add("c", "started", SOON)
    claimed = {t.key: t for t in store.claim(A, ["c"], 10, LEASE)}
    assert {k: t.attempt for k, t in claimed.items()} == {"unstarted": 1, "started": 1}
    assert store.start(A, [("c", "started", claimed["started"].token)]) == 1
    assert store.start(B, [("c", "unstarted", claimed["unstarted"].token)]) == 0  # fenced: not B's claim
    assert store.start(A, [("c", "unstarted", claimed["unstarted"].token + 1)]) == 0  # nor that token
    assert store.start(A, []) == 0
    tasks_ctx.wait(LEASE + 0.5)  # A died holding both
    rescued = {t.key: t for t in store.claim(B, ["c"], 10, 30)}
    # decided in the claim itself: the claim that never reached a handler cost no attempt
    assert {k: (t.attempt, t.token) for k, t in rescued.items()} == {"unstarted": (1, 2), "started": (2, 2)}
    tasks_ctx.wait(0)
    store.start(B, [("c", "unstarted", 2)])
    assert store.release(B, [("c", "started", 2)]) == 1  # a hand-back: the claim is not counted
    [again] = store.claim(B, ["c"], 1, 30)
    assert (again.key, again.attempt) == ("started", 2)


# -- names a store cannot encode (issue 31, m1) ----------------------------------------------------------
@every_backend
def test_a_name_with_a_lone_surrogate_is_refused_before_anything_is_written(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    for code, key in (("c", "k\ud800"), ("c\udfff", "k")):
        with pytest.raises(ConfigurationError, match="lone surrogate"):
            store.add(code, key, SOON)
    batch = [("c", f"ok{i:04d}", SOON) for i in range(1500)] + [("c", "bad\ud800", SOON)]  # past Redis's 1,000 per script
    with pytest.raises(ConfigurationError, match=r"task 1501 of add_many.*lone surrogate"):
        store.add_many(batch)
    assert store.list(limit=10) == [] and store.summary() == []  # nothing written
    with pytest.raises(ConfigurationError, match="lone surrogate"):
        store.cancel("c", "k\ud800")


@every_backend
def test_a_claim_of_every_trigger_code_at_once_takes_the_due_ones_earliest_first(tasks_ctx: TaskCtx) -> None:
    """A node with a thousand guarded jobs serves up to 257 trigger codes (mutexcron/guard/triggers.py):
    its claim and its look for the next due one list them all in one call (SQL: one statement, or
    MySQL's pick-and-take transaction, with bound parameters; SQLite allows 500 parts)."""
    from mutexcron.guard.triggers import TRIGGER_CODE, trigger_code

    store = tasks_ctx.make()
    codes = [TRIGGER_CODE, *sorted({trigger_code(f"job-{i}") for i in range(5000)})]
    assert len(codes) == 257
    now = store.now()
    for i in range(6):
        store.add(trigger_code(f"job-{i}"), f"job-{i}", now - timedelta(seconds=60 - i))
    store.add(trigger_code("job-9"), "job-9", now + timedelta(hours=1))
    store.add("email", "not-a-trigger", now - timedelta(hours=1))
    assert store.next_due(codes) == 0.0
    assert [t.key for t in store.claim(A, codes, 4, 30)] == ["job-0", "job-1", "job-2", "job-3"]
    assert [t.key for t in store.claim(B, codes, 10, 30)] == ["job-4", "job-5"]
    assert store.claim(B, codes, 10, 30) == [] and 0 < (store.next_due(codes) or 0) <= 30  # the leases' end
