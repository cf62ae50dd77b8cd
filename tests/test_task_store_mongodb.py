"""MongoDB task store tests beyond the contract suite (``tests/test_task_store.py`` runs that on
mongomock, and on a real server with ``MUTEXCRON_TEST_MONGODB_URL``).

Without a server: the ``$$NOW`` seam and the commands sent (recorded), the document layout and
indexes, literal strings, the URL option, unknown write outcomes, the duplicate-key race of two
upserts, a task changing between two exclusive writes, a dead server. With a server (skipped
otherwise): the 4-process 10,000-task claim race, the claim's index range, the server's clock.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

pymongo = pytest.importorskip("pymongo")
mongomock = pytest.importorskip("mongomock")

from pymongo.errors import AutoReconnect, BulkWriteError, DuplicateKeyError, OperationFailure, WTimeoutError  # noqa: E402

from mutexcron.backends.mongodb import SERVER_NOW, MongoDBBackend  # noqa: E402
from mutexcron.errors import ConfigurationError, StoreError, StoreUnavailableError  # noqa: E402
from mutexcron.tasks import AddResult, Done, Fail, Reschedule, Retry, task_store_from_url  # noqa: E402
from mutexcron.tasks.stores.mongodb import MongoDBTaskStore, pop_option  # noqa: E402
from tests import task_workers  # noqa: E402
from tests.backends import FakeClock, require_server  # noqa: E402
from tests.mongomock_support import CLOCK_ORIGIN, assert_each_unavailable_quickly, open_mongomock_tasks  # noqa: E402

pytestmark = pytest.mark.mongodb

A, B = "node-a:1:aaaa", "node-b:2:bbbb"
URL = "mongodb://tasks.invalid/mutexcron_test"
SOON = timedelta(seconds=-1)
SERVER_TIME = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=timezone.utc)


# -- fakes ----------------------------------------------------------------------------------------
class RecordingCollection:
    """Records every call; answers as a collection whose documents all match (executes nothing)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.claimable = 0

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if name == "find_one_and_update":
                if kwargs.get("upsert"):
                    return {"last_add": "inserted"}
                if self.claimable:
                    self.claimable -= 1
                    return {"code": "c", "key": f"k{self.claimable}", "due": SERVER_TIME, "state": "running", "token": 1}
                return None
            if name == "bulk_write":
                return SimpleNamespace(matched_count=len(args[0]), deleted_count=0)
            if name in ("update_one", "delete_one"):
                return SimpleNamespace(matched_count=1, deleted_count=1)
            if name in ("find", "aggregate"):
                return iter([])
            return None

        return call

    def sent(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


class FakeClient:
    """Enough of a MongoClient: ``get_database(..).get_collection(..)``, and ``admin.command`` (hello, ping)."""

    def __init__(self, collection: Any) -> None:
        self.collection = collection
        self.commands: list[str] = []
        self.admin = SimpleNamespace(command=self._command)

    def _command(self, name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.commands.append(name)
        return {"ok": 1.0, "localTime": SERVER_TIME} if name == "hello" else {"ok": 1.0}

    def get_database(self, name: str, **kwargs: Any) -> FakeClient:
        return self

    def get_collection(self, name: str, **kwargs: Any) -> Any:
        self.collection_name = name
        return self.collection

    def close(self) -> None:  # pragma: no cover - the store does not close injected clients
        raise AssertionError("an injected client must not be closed by the store")


class FlakyCollection:
    """A mongomock collection whose next calls of a method can fail *after* applying (applied,
    unacknowledged) or *instead of* applying, as planned; ``before`` hooks run before a call."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.plan: dict[str, list[tuple[str, BaseException]]] = {}
        self.before: dict[str, list[Callable[[], None]]] = {}
        self.log: list[str] = []

    def fail(self, name: str, when: str, exc: BaseException, times: int = 1) -> None:
        self.plan.setdefault(name, []).extend([(when, exc)] * times)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.log.append(name)
            hooks = self.before.get(name)
            if hooks:
                hooks.pop(0)()
            planned = self.plan.get(name)
            when, exc = planned.pop(0) if planned else ("", None)
            if when == "instead":
                raise exc  # type: ignore[misc]
            result = method(*args, **kwargs)
            if when == "after":
                raise exc  # type: ignore[misc]
            return result

        return call


def wtimeout() -> WTimeoutError:
    return WTimeoutError("waiting for replication timed out", 64, {"code": 64, "errmsg": "waiting for replication timed out"})


def bulk_wtimeout() -> BulkWriteError:
    return BulkWriteError(
        {"writeErrors": [], "writeConcernErrors": [{"code": 64, "errmsg": "waiting for replication timed out"}]}
    )


@pytest.fixture
def recording() -> tuple[MongoDBTaskStore, RecordingCollection, FakeClient]:
    collection = RecordingCollection()
    client = FakeClient(collection)
    return MongoDBTaskStore(URL, client=client), collection, client


@pytest.fixture
def flaky() -> Iterator[SimpleNamespace]:
    clock = FakeClock()
    target = mongomock.MongoClient(tz_aware=True).get_database("db").get_collection(f"t{secrets.token_hex(3)}")
    collection = FlakyCollection(target)
    client = FakeClient(collection)

    def store() -> MongoDBTaskStore:
        return MongoDBTaskStore(URL, client=client, now=lambda: CLOCK_ORIGIN + timedelta(seconds=clock()))

    yield SimpleNamespace(store=store, collection=collection, clock=clock)


def _walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _walk(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item)


# -- (1) the production store is judged by the server's clock ---------------------------------------
def test_production_store_sends_server_now_and_reads_the_server_clock(recording: Any) -> None:
    store, collection, client = recording
    assert store.now_expr() == SERVER_NOW == "$$NOW"
    assert store.now() == SERVER_TIME and client.commands == ["hello"]
    assert store.add("c", "k", timedelta(seconds=30), {"v": 1}) is AddResult.INSERTED
    collection.claimable = 2
    assert [t.key for t in store.claim(A, ["c", "b", "c"], 5, 30)] == ["k1", "k0"]
    assert store.renew(A, {("c", "k0"): 1, ("c", "k1"): 1}, 30) == {("c", "k0"), ("c", "k1")}
    store.complete(A, "c", "k0", 1, Retry(timedelta(seconds=5), "boom"))
    store.release(A, [("c", "k1", 1)])
    store.retry("c", "k")
    store.cancel("c", "k")
    store.next_due(["c"])
    store.summary()

    (query, pipeline), kwargs = collection.sent("find_one_and_update")[0]
    assert query == {"code": "c", "key": "k"} and kwargs["upsert"] is True
    assert {"$subtract": ["$$NOW", -30_000]} in list(_walk(pipeline)), "a timedelta due is counted from $$NOW"

    claims = collection.sent("find_one_and_update")[1:]
    assert len(claims) == 3, "one command per task, and one that finds none"
    (query, pipeline), kwargs = claims[0]
    assert query == {"code": {"$in": ["b", "c"]}, "run_at": {"$lte": SERVER_TIME}}, "the server's clock, one index range"
    assert kwargs["sort"] == [("run_at", 1)]
    fields = pipeline[0]["$set"]
    assert fields["lease_until"] == fields["run_at"] == {"$subtract": ["$$NOW", -30_000]}
    assert fields["owner"] == {"$literal": A} and fields["updated"] == "$$NOW"

    [(renew_ops,), renew_kwargs] = collection.sent("bulk_write")[0]
    assert len(renew_ops) == 2 and renew_kwargs["ordered"] is False, "renew: one bulk write"
    assert all(op._filter["state"] == "running" and op._filter["owner"] == A and op._filter["token"] == 1 for op in renew_ops)
    assert len(collection.sent("bulk_write")) == 3, "renew, complete and release: one command each when all match"
    for name in ("aggregate",):
        for (pipeline,), _ in collection.sent(name):
            assert "$$NOW" in list(_walk(pipeline))
    # No client-side clock anywhere: the only date sent is the server's own (hello's localTime).
    sent_dates = {v for _, args, kwargs in collection.calls for v in _walk([args, kwargs]) if isinstance(v, datetime)}
    assert sent_dates <= {SERVER_TIME}
    assert client.commands == ["hello", "hello"]


def test_indexes_are_created_once_per_store(recording: Any) -> None:
    store, collection, _ = recording
    store.get("c", "k")
    store.list()
    created = collection.sent("create_index")
    assert [args[0] for args, _ in created] == [[("code", 1), ("key", 1)], [("code", 1), ("run_at", 1)]]
    assert [kwargs for _, kwargs in created] == [{"unique": True}, {}]


def test_now_seam_is_only_used_when_injected(flaky: Any) -> None:
    store = flaky.store()
    assert isinstance(store.now_expr(), datetime) and store.now() == CLOCK_ORIGIN + timedelta(seconds=1000)
    assert MongoDBTaskStore(URL, client=FakeClient(RecordingCollection())).now_expr() == "$$NOW"


# -- (2) the documents --------------------------------------------------------------------------------
def test_document_layout_indexes_and_run_at() -> None:
    factory, _ = open_mongomock_tasks(secrets.token_hex(4))
    store = factory()
    assert isinstance(store, MongoDBTaskStore) and store.collection_name.startswith("mc_tasks_")
    store.add("c", "k", SOON, {"$set": {"a.b": 1}, "n": 2**80})
    indexes = {name: info for name, info in store.collection.index_information().items()}
    assert indexes["code_1_key_1"]["key"] == [("code", 1), ("key", 1)] and indexes["code_1_key_1"]["unique"]
    assert indexes["code_1_run_at_1"]["key"] == [("code", 1), ("run_at", 1)]
    doc = store.collection.find_one({"code": "c", "key": "k"})
    assert doc["state"] == "queued" and doc["run_at"] == doc["due"] and doc["last_add"] == "inserted"
    assert json.loads(doc["payload"]) == {"$set": {"a.b": 1}, "n": 2**80}, "payloads are JSON text"
    assert store.get("c", "k").payload == {"$set": {"a.b": 1}, "n": 2**80}  # type: ignore[union-attr]
    [task] = store.claim("$owner.x", ["c"], 5, 30)
    doc = store.collection.find_one({"code": "c", "key": "k"})
    assert doc["run_at"] == doc["lease_until"] == task.lease_until and doc["owner"] == "$owner.x"
    assert store.complete("$owner.x", "c", "k", task.token, Fail("$boom {oops}"))
    doc = store.collection.find_one({"code": "c", "key": "k"})
    assert doc["state"] == "failed" and doc["run_at"] is None and doc["last_error"] == "$boom {oops}"
    assert store.next_due(["c"]) is None and store.claim(A, ["c"], 5, 30) == []
    assert store.collection.count_documents({}) == 1, "one document per task"


def test_key_contains_is_a_plain_substring() -> None:
    factory, _ = open_mongomock_tasks(secrets.token_hex(4))
    store = factory()
    for key in ("a.c", "abc", "x(1)", "X(1)", "$k"):
        store.add("c", key, timedelta(hours=1))
    assert [t.key for t in store.list(key_contains=".")] == ["a.c"]
    assert [t.key for t in store.list(key_contains="(1)")] == ["X(1)", "x(1)"]  # one due: by key
    assert [t.key for t in store.list(key_contains="$")] == ["$k"]
    assert store.list(limit=0) == []


# -- (3) URLs -----------------------------------------------------------------------------------------
def test_tasks_collection_option() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pymongo warns about options it does not know: it never sees ours
        store = task_store_from_url("mongodb://u:pw123@127.0.0.1:1/appdb?collection=locks&tasks_collection=my_tasks&w=1")
    try:
        assert isinstance(store, MongoDBTaskStore)
        assert (store.collection_name, store.backend.collection_name, store.backend.database_name) == (
            "my_tasks",
            "locks",
            "appdb",
        )
        assert store.collection.name == "my_tasks" and store.collection.write_concern.document["w"] == 1
        assert "pw123" not in repr(store) and "tasks_collection=my_tasks" in store.masked_url
    finally:
        store.close()
    default = MongoDBTaskStore("mongodb://127.0.0.1:1/db", tasks_collection=None)
    keyword = MongoDBTaskStore("mongodb://127.0.0.1:1/db?tasks_collection=a", tasks_collection="b")
    try:
        assert default.collection_name == "mutexcron_tasks" and keyword.collection_name == "b"
    finally:
        default.close()
        keyword.close()
    assert pop_option("mongodb://h/db?a=%2F&tasks_collection=t%24x&b=1", "tasks_collection") == (
        "mongodb://h/db?a=%2F&b=1",
        "t$x",
    )
    assert pop_option("mongodb://h?tasks_collection=t", "tasks_collection") == ("mongodb://h", "t")


def test_a_shared_backend() -> None:
    backend = MongoDBBackend(URL, client=FakeClient(RecordingCollection()))
    store = MongoDBTaskStore(backend, tasks_collection="jobs")
    assert store.backend is backend and store.collection_name == "jobs"
    with pytest.raises(TypeError, match="belong to the backend"):
        MongoDBTaskStore(backend, now=lambda: None)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mongodb://u:pw123@h/db?tasks_collection=a$b", "must not contain '\\$'"),
        ("mongodb://u:pw123@h/db?tasks_collection=system.tasks", "reserved"),
        ("mongodb://u:pw123@h/db?tasks_collection=mutexcron_locks", "is the lock collection"),
        ("mongodb://u:pw123@h/db?collection=x&tasks_collection=x", "is the lock collection"),
    ],
)
def test_bad_tasks_collections_are_configuration_errors_without_the_password(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        MongoDBTaskStore(url)
    assert "pw123" not in str(info.value) and "***" in str(info.value)


# -- (4) unknown outcomes and races ---------------------------------------------------------------------
@pytest.mark.parametrize("when", ["instead", "after"])
def test_an_unknown_write_outcome_raises_store_unavailable(flaky: Any, when: str) -> None:
    store = flaky.store()
    col = flaky.collection
    col.fail("find_one_and_update", when, wtimeout())
    with pytest.raises(StoreUnavailableError, match="add \\(outcome unknown\\)"):
        store.add("c", "k", SOON)
    store.add("c", "k", SOON)
    col.fail("find_one_and_update", when, wtimeout())
    with pytest.raises(StoreUnavailableError, match="claim \\(outcome unknown\\)"):
        store.claim(A, ["c"], 5, 30)
    if when == "instead":
        [task] = store.claim(A, ["c"], 5, 30)
    else:  # it was claimed: its lease must run out before anyone takes it again
        assert store.claim(B, ["c"], 5, 30) == []
        flaky.clock.advance(31)
        [task] = store.claim(A, ["c"], 5, 30)
    for name, call in (
        ("renew", lambda: store.renew(A, {("c", "k"): task.token}, 30)),
        ("complete", lambda: store.complete(A, "c", "k", task.token, Retry(SOON, "e"))),
        ("release", lambda: store.release(A, [("c", "k", task.token)])),
    ):
        col.fail("bulk_write", "instead", bulk_wtimeout())
        with pytest.raises(StoreUnavailableError, match=f"{name} \\(outcome unknown\\)"):
            call()
    for name, method, call in (
        ("cancel", "update_one", lambda: store.cancel("c", "k")),  # a tombstone: an update
        ("retry", "update_one", lambda: store.retry("c", "k")),
    ):
        col.fail(method, when, wtimeout())
        with pytest.raises(StoreUnavailableError, match=f"{name} \\(outcome unknown\\)"):
            call()


def test_a_claim_that_took_tasks_returns_them_when_the_store_fails(flaky: Any, caplog: pytest.LogCaptureFixture) -> None:
    store = flaky.store()
    store.add("c", "k1", timedelta(seconds=-2))
    store.add("c", "k2", SOON)
    flaky.collection.before["find_one_and_update"] = [
        lambda: None,  # the first claim command goes through, the second fails
        lambda: flaky.collection.fail("find_one_and_update", "instead", AutoReconnect("connection reset")),
    ]
    with caplog.at_level(logging.WARNING):
        assert [t.key for t in store.claim(A, ["c"], 5, 30)] == ["k1"]
    assert "stopped after 1 task" in caplog.text
    assert [t.key for t in store.claim(A, ["c"], 5, 30)] == ["k2"]


def test_two_upserts_of_a_new_task_racing_on_the_unique_index(flaky: Any) -> None:
    store = flaky.store()
    flaky.collection.fail("find_one_and_update", "instead", DuplicateKeyError("E11000 duplicate key error", 11000))
    assert store.add("c", "k", SOON) is AddResult.INSERTED, "retried once"
    flaky.collection.fail("find_one_and_update", "instead", DuplicateKeyError("E11000 duplicate key error", 11000))
    assert store.add("c", "k", SOON, {"v": 2}) is AddResult.REPLACED
    flaky.collection.fail("find_one_and_update", "instead", DuplicateKeyError("E11000 duplicate key error", 11000), times=2)
    with pytest.raises(StoreUnavailableError, match="did not settle"):
        store.add("c", "k", SOON)


def test_a_task_changing_between_two_exclusive_writes_is_settled_next_round(flaky: Any) -> None:
    """Done with a pending re-add: the delete step does not match; a cancel lands before the
    re-add step, which then does not match either. The next round drops the cancelled task."""
    store, other = flaky.store(), flaky.store()
    store.add("c", "k", SOON, {"v": 1})
    [task] = store.claim(A, ["c"], 5, 30)
    assert other.add("c", "k", SOON, {"v": 2}) is AddResult.PENDING

    def cancel() -> None:
        assert other.cancel("c", "k")

    flaky.collection.before["bulk_write"] = [lambda: None, cancel]  # a cancel lands just before the second write
    assert store.complete(A, "c", "k", task.token, Done())
    assert store.get("c", "k") is None
    assert flaky.collection.log.count("bulk_write") == 3, "delete, re-add (no match), delete"


def test_release_hands_back_many_tasks_in_one_command(flaky: Any) -> None:
    store = flaky.store()
    for i in range(5):
        store.add("c", f"k{i}", SOON)
    claimed = store.claim(A, ["c"], 10, 300)
    flaky.collection.log.clear()
    assert store.release(A, [(t.code, t.key, t.token) for t in claimed]) == 5
    assert flaky.collection.log == ["bulk_write"]
    assert {t.key: t.attempt for t in store.claim(B, ["c"], 10, 30)} == {f"k{i}": 1 for i in range(5)}


def test_complete_many_reads_the_fences_then_writes_once(flaky: Any) -> None:
    """A task taken over between the batch's read and its write gets False, the others True; a
    task named twice is completed once (the second is refused, as a second complete() would be)."""
    store, other = flaky.store(), flaky.store()
    store.add("c", "k1", timedelta(seconds=-2))
    store.add("c", "k2", SOON)
    [t1] = store.claim(A, ["c"], 1, 30)
    [t2] = store.claim(A, ["c"], 1, 300)

    def take_over() -> None:
        flaky.clock.advance(31)  # k1's lease ran out: B takes it
        mark = len(flaky.collection.log)
        assert [t.key for t in other.claim(B, ["c"], 5, 30)] == ["k1"]
        del flaky.collection.log[mark:]  # B's calls

    flaky.collection.before["bulk_write"] = [take_over]
    flaky.collection.log.clear()
    assert store.complete_many(A, [("c", "k1", t1.token, Done()), ("c", "k2", t2.token, Retry(SOON, "e"))]) == [False, True]
    assert flaky.collection.log == ["find", "bulk_write", "find"], "the read, the write, the read that tells them apart"
    k1, k2 = store.get("c", "k1"), store.get("c", "k2")
    assert k1 is not None and (k1.state, k1.owner, k1.token) == ("running", B, t1.token + 1)
    assert k2 is not None and (k2.state, k2.last_error, k2.due) == ("queued", "e", t2.due)
    [t2] = store.claim(A, ["c"], 1, 30)
    assert store.complete_many(A, [("c", "k2", t2.token, Done()), ("c", "k2", t2.token, Fail("late"))]) == [True, False]
    assert store.get("c", "k2") is None


def test_outcomes_keep_their_fields(flaky: Any) -> None:
    store = flaky.store()
    store.add("c", "k", SOON, {"v": 1})
    [task] = store.claim(A, ["c"], 5, 30)
    assert store.complete(A, "c", "k", task.token, Retry(timedelta(seconds=10), "$err"))
    got = store.get("c", "k")
    assert got is not None and (got.state, got.attempt, got.last_error, got.lease_until) == ("queued", 1, "$err", None)
    assert got.due == task.due and got.run_at == CLOCK_ORIGIN + timedelta(seconds=1010), "a retry keeps the due"
    doc = store.collection.find_one({"code": "c", "key": "k"})
    assert doc["run_at"] == got.run_at and doc["due"] == task.due
    flaky.clock.advance(10)
    [task] = store.claim(A, ["c"], 5, 30)
    assert store.complete(A, "c", "k", task.token, Reschedule(CLOCK_ORIGIN + timedelta(days=1)))
    got = store.get("c", "k")
    assert got is not None and (got.state, got.attempt, got.last_error, got.payload) == ("queued", 0, None, {"v": 1})


# -- (5) index creation without the privilege ---------------------------------------------------------------
def test_missing_privilege_to_create_indexes(flaky: Any) -> None:
    store = flaky.store()
    unauthorized = OperationFailure("not authorized on db to execute command createIndexes", 13)
    flaky.collection.fail("create_index", "instead", unauthorized)
    with pytest.raises(StoreError, match="create them yourself"):
        store.get("c", "k")
    store.get("c", "k")  # created now (the privilege came back)
    flaky.collection.fail("create_index", "instead", unauthorized)
    assert flaky.store().get("c", "k") is None, "the indexes are there: the store runs without creating them"


# -- (6) a dead server fails closed, fast ---------------------------------------------------------------------
def test_unreachable_server_raises_store_unavailable_quickly(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    store = MongoDBTaskStore("mongodb://user:s3cret@127.0.0.1:1/db?serverSelectionTimeoutMS=300&connectTimeoutMS=300")
    operations: dict[str, Callable[[], Any]] = {
        "add": lambda: store.add("c", "k", SOON),
        "cancel": lambda: store.cancel("c", "k"),
        "get": lambda: store.get("c", "k"),
        "list": store.list,
        "retry": lambda: store.retry("c", "k"),
        "claim": lambda: store.claim(A, ["c"], 5, 30),
        "renew": lambda: store.renew(A, {("c", "k"): 1}, 30),
        "complete": lambda: store.complete(A, "c", "k", 1, Done()),
        "release": lambda: store.release(A, [("c", "k", 1)]),
        "next_due": lambda: store.next_due(["c"]),
        "summary": store.summary,
        "now": store.now,
        "ping": store.ping,
    }
    try:
        assert_each_unavailable_quickly(operations)
    finally:
        store.close()
    assert "s3cret" not in caplog.text


# -- (7) against a real server (MUTEXCRON_TEST_MONGODB_URL) ---------------------------------------------------
@pytest.fixture
def server_url() -> Iterator[str]:
    base = require_server("mongodb")
    url = f"{base}{'&' if '?' in base else '?'}tasks_collection=mc_tasks_{secrets.token_hex(4)}"
    yield url
    store = MongoDBTaskStore(url)
    try:
        store.collection.drop()
    finally:
        store.close()


def _seed(store: MongoDBTaskStore, code: str, total: int, prefix: str = "k", minutes: float = -1) -> None:
    """``total`` tasks of ``code`` due ``minutes`` from the server's now, in one insert_many."""
    due = store.now() + timedelta(minutes=minutes)
    store.get(code, "-")  # the indexes
    fields = {"due": due, "run_at": due, "payload": "null", "state": "queued", "attempt": 0, "token": 0, "owner": None}
    fields.update(lease_until=None, last_error=None, pending_due=None, pending_payload=None, cancel_requested=False)
    fields.update(created=due, updated=due, last_add="inserted")
    store.collection.insert_many([{"code": code, "key": f"{prefix}{i:05d}", **fields} for i in range(total)], ordered=False)


def test_server_four_processes_claim_every_task_exactly_once(server_url: str) -> None:
    """4 racing processes claim 10,000 due tasks, 20 per claim: every task once, by one racer, at attempt 1."""
    store = MongoDBTaskStore(server_url)
    try:
        total = 10_000
        _seed(store, "race", total)
        nodes = [f"racer-{i}:{secrets.token_hex(3)}" for i in range(4)]
        claimed = task_workers.race_processes(server_url, nodes)
        keys = [key for got in claimed for key, _, _ in got]
        assert len(keys) == total and len(set(keys)) == total, f"{len(keys) - len(set(keys))} claimed twice"
        assert all(token == 1 and attempt == 1 for got in claimed for _, token, attempt in got)
        assert all(got for got in claimed), "a racer claimed nothing: not a race"
        assert store.list(state="queued", limit=10) == []
    finally:
        store.close()


def test_server_claim_reads_the_code_run_at_index(server_url: str) -> None:
    """With 3,000 tasks, 20 of them due and 1,000 of another code, the claim is an index range, sorted by it."""
    store = MongoDBTaskStore(server_url)
    try:
        _seed(store, "due", 20)
        _seed(store, "other", 1000, prefix="o")
        _seed(store, "later", 2000, minutes=60)
        query = {"code": {"$in": ["due", "other"]}, "run_at": {"$lte": store.now()}}
        plan = store.collection.find(query).sort("run_at", 1).limit(1).explain()
        text = json.dumps(plan["queryPlanner"]["winningPlan"], default=str)
        assert "code_1_run_at_1" in text and "COLLSCAN" not in text and '"SORT"' not in text, text
        assert len(store.claim(A, ["due"], 100, 30)) == 20
    finally:
        store.close()


def test_server_clock_judges_due_times_and_leases(server_url: str) -> None:
    store = MongoDBTaskStore(server_url)
    try:
        assert store.add("c", "k", timedelta(seconds=0.4), {"v": 1}) is AddResult.INSERTED
        assert store.claim(A, ["c"], 5, 0.3) == []
        time.sleep(0.6)
        [task] = store.claim(A, ["c"], 5, 0.3)
        assert task.lease_until is not None and abs((task.lease_until - store.now()).total_seconds()) < 2
        time.sleep(0.5)
        [again] = store.claim(B, ["c"], 5, 30)
        assert (again.token, again.attempt) == (task.token + 1, 2)
        assert not store.complete(A, "c", "k", task.token, Done()) and store.complete(B, "c", "k", again.token, Done())
        store.ping()
    finally:
        store.close()
