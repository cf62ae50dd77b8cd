"""MongoDB-specific tests: the ``$$NOW`` seam, literal keys, unknown outcomes, URLs, a dead server.

The shared behaviour is in ``tests/test_contract.py`` (``mongomock`` and ``mongodb`` cases). These
tests need no server, except the last ones, which skip without ``MUTEXCRON_TEST_MONGODB_URL``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

pymongo = pytest.importorskip("pymongo")
mongomock = pytest.importorskip("mongomock")

from pymongo.errors import DuplicateKeyError, WTimeoutError  # noqa: E402
from pymongo.read_preferences import ReadPreference  # noqa: E402

from mutexcron.backends.mongodb import SERVER_NOW, parse_url  # noqa: E402
from mutexcron.errors import AttrsError, ConfigurationError, StoreUnavailableError  # noqa: E402
from mutexcron.locks import FireClaim, Node, RunInfo, lock_store_from_url  # noqa: E402
from mutexcron.locks.mongodb import MongoDBLockStore  # noqa: E402
from mutexcron.timeutil import EPOCH  # noqa: E402
from tests.backends import FakeClock, require_server  # noqa: E402
from tests.mongomock_support import CLOCK_ORIGIN, assert_each_unavailable_quickly  # noqa: E402

pytestmark = pytest.mark.mongodb

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")
URL = "mongodb://locks.invalid/mutexcron_test"


# -- fakes ------------------------------------------------------------------------------------
class RecordingCollection:
    """Records every call and answers as an empty collection; executes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.read_concerns: list[Any] = []

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls.append((name, args, kwargs))

    def with_options(self, **kwargs: Any) -> RecordingCollection:
        self.read_concerns.append(kwargs.get("read_concern"))
        return self

    def find_one_and_update(self, *args: Any, **kwargs: Any) -> None:
        self._record("find_one_and_update", args, kwargs)

    def update_many(self, *args: Any, **kwargs: Any) -> Any:
        self._record("update_many", args, kwargs)
        return SimpleNamespace(matched_count=0, modified_count=0)

    def update_one(self, *args: Any, **kwargs: Any) -> Any:
        self._record("update_one", args, kwargs)
        return SimpleNamespace(matched_count=0, modified_count=0)

    def aggregate(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        self._record("aggregate", args, kwargs)
        return iter([])

    def find(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        self._record("find", args, kwargs)
        return iter([])

    def find_one(self, *args: Any, **kwargs: Any) -> None:
        self._record("find_one", args, kwargs)

    def sent(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


class FakeClient:
    """Enough of a MongoClient for the store: ``get_database(..).get_collection(..)`` and ``admin``."""

    def __init__(self, collection: Any) -> None:
        self.collection = collection
        self.collection_args: dict[str, Any] = {}
        self.admin = SimpleNamespace(command=lambda *a, **k: {"ok": 1.0})

    def get_database(self, name: str, **kwargs: Any) -> FakeClient:
        self.database = name
        return self

    def get_collection(self, name: str, **kwargs: Any) -> Any:
        self.collection_name, self.collection_args = name, kwargs
        return self.collection

    def close(self) -> None:  # pragma: no cover - the store does not close injected clients
        raise AssertionError("an injected client must not be closed by the store")


class FlakyCollection:
    """A mongomock collection whose next write can fail *after* applying (applied, unacknowledged)
    or *instead of* applying (never happened), as a write-concern timeout leaves it unknown. A
    list of such steps plans the next calls of that method in turn (``("", None)``: it works)."""

    def __init__(self, target: Any, plan: dict[str, Any], log: list[str], label: str = "primary"):
        self._target, self._plan, self._log, self._label = target, plan, log, label

    def with_options(self, **kwargs: Any) -> FlakyCollection:
        label = "majority" if getattr(kwargs.get("read_concern"), "level", None) == "majority" else self._label
        return FlakyCollection(self._target.with_options(**kwargs), self._plan, self._log, label)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._target, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append(f"{self._label}:{name}")
            step = self._plan.pop(name, ("", None))
            if isinstance(step, list):
                step, later = step[0], step[1:]
                if later:
                    self._plan[name] = later
            when, exc = step
            if when == "instead":
                raise exc  # type: ignore[misc]
            result = method(*args, **kwargs)
            if when == "after":
                raise exc  # type: ignore[misc]
            return result

        return call


def wtimeout() -> WTimeoutError:
    return WTimeoutError("waiting for replication timed out", 64, {"code": 64, "errmsg": "waiting for replication timed out"})


@pytest.fixture
def recording() -> tuple[MongoDBLockStore, RecordingCollection]:
    collection = RecordingCollection()
    return MongoDBLockStore(URL, client=FakeClient(collection)), collection


@pytest.fixture
def flaky() -> Iterator[SimpleNamespace]:
    clock = FakeClock()
    target = mongomock.MongoClient(tz_aware=True).get_database("db").get_collection(f"c{secrets.token_hex(3)}")
    plan: dict[str, Any] = {}
    log: list[str] = []
    client = FakeClient(FlakyCollection(target, plan, log))

    def store() -> MongoDBLockStore:
        return MongoDBLockStore(URL, client=client, now=lambda: CLOCK_ORIGIN + timedelta(seconds=clock()))

    yield SimpleNamespace(store=store, plan=plan, log=log, clock=clock)


def _walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _walk(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item)


def _outside_literals(value: Any) -> Iterator[Any]:
    """Every key and value of an expression except what sits inside a ``$literal``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            if key != "$literal":
                yield from _outside_literals(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _outside_literals(item)
    else:
        yield value


# -- (1) the production store uses the server's clock ------------------------------------------
def test_production_store_sends_server_now_in_filters_and_updates(recording: Any) -> None:
    store, collection = recording
    assert store.now_expr() == SERVER_NOW == "$$NOW"
    store.acquire_or_renew("l", A, ttl=30, claim=FireClaim("job", 1_000_000, "n1"))
    store.hand_off("l", A, 1, {"k": 1}, RunInfo(duration=1.5, error="boom"))
    store.renew_many(A, {"l": 1, "m": 2})
    store.release("l", A, 1)
    store.read("l")
    store.read_many(["l", "m"])
    store.list()

    # A record held before is renewed or taken in one write; a missing one (this empty collection
    # answers none) is then created by an upsert whose token is above the floor read just before.
    (query, update), kwargs = collection.sent("find_one_and_update")[0]
    assert kwargs["upsert"] is False
    stale = {"$expr": {"$lt": ["$hb", {"$subtract": ["$$NOW", "$ttl"]}]}}
    assert query == {"_id": "l", "$or": [{"holder": A.node_id}, {"holder": None}, stale], "token": {"$gt": 0}}
    assert update[0]["$set"]["hb"] == "$$NOW"
    assert update[0]["$set"]["ttl"] == 30_000
    (create_query, create_update), create_kwargs = collection.sent("find_one_and_update")[1]
    assert create_kwargs["upsert"] is True
    assert create_query == {"_id": "l", "$or": [{"holder": A.node_id}, {"holder": None}, stale]}
    taken = {"$add": [{"$max": [{"$ifNull": ["$token", 0]}, 0]}, 1]}
    assert create_update[0]["$set"]["token"]["$cond"][2] == taken and create_update[0]["$set"]["hb"] == "$$NOW"

    (_, hb_update), hb_kwargs = collection.sent("find_one_and_update")[2]
    assert hb_kwargs.get("upsert") is not True, "a heartbeat never creates a lock"
    fields = hb_update[0]["$set"]
    assert fields["hb"] == fields["last_run_finished"] == "$$NOW"
    assert fields["last_run_started"] == {"$subtract": ["$$NOW", 1500]}

    (_, renew_update), _ = collection.sent("update_many")[0]
    assert renew_update == [{"$set": {"hb": "$$NOW"}}]

    pipelines = [args[0] for args, _ in collection.sent("aggregate")]
    assert len(pipelines) == 5  # the record with the floor, not-acquired re-read, read, read_many, list
    for pipeline in pipelines:
        assert {"$addFields": {"_age_ms": {"$subtract": ["$$NOW", "$hb"]}}} in pipeline

    # No client-side clock reading anywhere: the only date ever sent is the release's epoch.
    sent_dates = {v for _, args, kwargs in collection.calls for v in _walk([args, kwargs]) if isinstance(v, datetime)}
    assert sent_dates <= {EPOCH}


def test_now_seam_is_only_used_when_injected(flaky: Any) -> None:
    store = flaky.store()
    assert isinstance(store.now_expr(), datetime)
    assert MongoDBLockStore(URL, client=FakeClient(RecordingCollection())).now_expr() == "$$NOW"


# -- (2) user strings never become expressions or paths ----------------------------------------
def test_attrs_node_ids_and_job_keys_are_sent_as_literals(recording: Any) -> None:
    store, collection = recording
    attrs = {"$set": {"a.b": 1}, "$$NOW": "$hb", "x.y": ["$literal"]}
    odd = Node("$holder.x", "$ip")
    store.acquire_or_renew("l", odd, ttl=30, claim=FireClaim("$job.with.dots", 5, "$nonce"))
    store.hand_off("l", odd, 1, attrs)

    (_, update), _ = collection.sent("find_one_and_update")[0]
    fields = update[0]["$set"]
    assert fields["holder"] == {"$literal": "$holder.x"}
    assert fields["active_ip"] == {"$literal": "$ip"}
    assert fields["token"]["$cond"][0] == {"$eq": ["$holder", {"$literal": "$holder.x"}]}
    # The job key is only ever inside a $literal: never a field path, a variable or a dotted key.
    assert "$job.with.dots" not in list(_outside_literals(fields["fires"]))
    literals = [v["$literal"] for v in _walk(fields["fires"]) if isinstance(v, dict) and "$literal" in v]
    assert "$job.with.dots" in literals
    assert [{"k": "$job.with.dots", "v": [5, "$nonce"]}] in literals

    (_, hb_update), _ = collection.sent("find_one_and_update")[2]  # after the acquire's two writes (see above)
    sent_attrs = hb_update[0]["$set"]["attrs"]
    assert set(sent_attrs) == {"$literal"}
    assert json.loads(sent_attrs["$literal"]) == attrs


def test_odd_keys_round_trip_on_mongomock(flaky: Any) -> None:
    store = flaky.store()
    odd = Node("$holder.x", "$ip")
    jobs = ["$job", "a.b.c", 'q"uote', "$$NOW"]
    for i, job in enumerate(jobs):
        got = store.acquire_or_renew("l", odd, ttl=30, claim=FireClaim(job, 1_000_000 + i, f"n{i}"))
        assert got.acquired and got.claimed and got.token == 1
    rec = store.read("l")
    assert rec is not None and rec.holder == "$holder.x" and rec.active_ip == "$ip"
    assert set(rec.fire_times) == set(jobs)
    attrs = {"$set": {"a.b": 1}, "$$NOW": "$hb", "n": 2**80}
    assert store.hand_off("l", odd, 1, attrs)
    assert dict(store.read("l").attrs) == attrs  # type: ignore[union-attr]


def test_bad_attrs_send_nothing(recording: Any) -> None:
    store, collection = recording
    with pytest.raises(AttrsError):
        store.hand_off("l", A, 1, {"when": datetime.now(timezone.utc)})
    assert collection.calls == []


# -- (3) DuplicateKeyError: another node holds a fresh lease -----------------------------------
def test_duplicate_key_is_not_acquired_and_returns_the_stored_record(flaky: Any) -> None:
    a, b = flaky.store(), flaky.store()
    assert a.acquire_or_renew("l", A, ttl=30).acquired
    flaky.log.clear()
    # On mongomock as on a server, the failed filter on an existing _id makes the upsert insert: E11000.
    with pytest.raises(DuplicateKeyError):
        b.collection.find_one_and_update({"_id": "l", "holder": B.node_id}, [{"$set": {"holder": B.node_id}}], upsert=True)
    flaky.log.clear()
    got = b.acquire_or_renew("l", B, ttl=30, claim=FireClaim("job", 5, "nb"))
    assert not got.acquired and not got.claimed
    assert got.record.holder == A.node_id and got.record.token == 1 and got.record.state == "active"
    assert flaky.log == ["primary:find_one_and_update", "primary:aggregate"], "one write, then one read"


def test_duplicate_key_from_the_driver_is_handled(flaky: Any) -> None:
    a, b = flaky.store(), flaky.store()
    a.acquire_or_renew("l", A, ttl=30)
    flaky.plan["find_one_and_update"] = ("instead", DuplicateKeyError("E11000 duplicate key error", 11000))
    got = b.acquire_or_renew("l", B, ttl=30)
    assert not got.acquired and not got.uncertain and got.record.holder == A.node_id


def test_refused_acquire_while_this_node_holds_the_lock_is_uncertain(flaky: Any) -> None:
    """Two calls of one node race (two upserts of a new lock): the loser's re-read shows this node.

    That is the other call's lease, not this call's renewal, and not a loss either.
    """
    store = flaky.store()
    assert store.acquire_or_renew("l", A, ttl=30).acquired
    flaky.plan["find_one_and_update"] = ("instead", DuplicateKeyError("E11000 duplicate key error", 11000))
    got = store.acquire_or_renew("l", A, ttl=30, claim=FireClaim("job", 5, "n1"))
    assert got.uncertain and not got.acquired and not got.claimed, got
    assert got.record.holder == A.node_id and got.token == 1


# -- (4) write-concern timeout: unknown outcome, never assumed, never a renewal or a loss --------
@pytest.mark.parametrize("write", ["take", "create"])
@pytest.mark.parametrize("when", ["instead", "after"])
def test_wtimeout_on_acquire_is_uncertain(flaky: Any, when: str, write: str) -> None:
    """Whether or not the write applied, the call reports uncertain: not acquired, not claimed.
    ``take``: the one write taking a released record; ``create``: the upsert creating a new one
    (the acquire's second write, after the refused first and the read of the floor)."""
    store = flaky.store()
    if write == "take":
        assert store.release("l", B, store.acquire_or_renew("l", B, ttl=30).token)
        flaky.plan["find_one_and_update"] = (when, wtimeout())
    else:
        flaky.plan["find_one_and_update"] = [("", None), (when, wtimeout())]
    got = store.acquire_or_renew("l", A, ttl=30, claim=FireClaim("job", 5, "n1"))
    assert got.uncertain and not got.acquired and not got.claimed, got
    assert flaky.log[-1] == "majority:aggregate", "the record shown is majority-committed data"
    token = 2 if write == "take" else 1
    if when == "after":
        assert got.record.holder == A.node_id, "the re-read shows what the store holds"
        again = store.acquire_or_renew("l", A, ttl=30, claim=FireClaim("job", 5, "n2"))
        assert again.acquired and not again.uncertain and again.token == token and not again.claimed
    else:
        assert got.record.holder is None


def test_wtimeout_on_renewing_acquire_is_not_a_renewal(flaky: Any) -> None:
    store = flaky.store()
    assert store.acquire_or_renew("l", A, ttl=30).acquired
    flaky.plan["find_one_and_update"] = ("instead", wtimeout())
    got = store.acquire_or_renew("l", A, ttl=30)
    assert got.uncertain and not got.acquired and got.record.holder == A.node_id


@pytest.mark.parametrize("when", ["instead", "after"])
def test_wtimeout_on_heartbeat_and_renew_many_raises_unavailable(flaky: Any, when: str) -> None:
    """Nothing is reported renewed (the write may not have applied), nothing lost (it may have)."""
    store = flaky.store()
    token = store.acquire_or_renew("l", A, ttl=30).token
    flaky.plan["find_one_and_update"] = (when, wtimeout())
    with pytest.raises(StoreUnavailableError, match="outcome unknown"):
        store.hand_off("l", A, token, {"k": 1})
    flaky.plan["update_many"] = (when, wtimeout())
    with pytest.raises(StoreUnavailableError, match="outcome unknown"):
        store.renew_many(A, {"l": token, "gone": 3})
    assert store.read("l").holder == A.node_id  # type: ignore[union-attr]
    assert store.renew_many(A, {"l": token}) == {"l"}


def test_wtimeout_on_release(flaky: Any) -> None:
    store = flaky.store()
    token = store.acquire_or_renew("l", A, ttl=30).token
    flaky.plan["update_one"] = ("instead", wtimeout())
    with pytest.raises(StoreUnavailableError, match="outcome unknown"):
        store.release("l", A, token)  # not applied: not reported as released, nor as not held
    assert store.read("l").holder == A.node_id  # type: ignore[union-attr]
    flaky.plan["update_one"] = ("after", wtimeout())
    assert store.release("l", A, token), "the majority-committed document shows the release"
    assert flaky.log[-1] == "majority:find_one"
    assert store.read("l").holder is None  # type: ignore[union-attr]


def test_released_record_shows_no_heartbeat(flaky: Any) -> None:
    store = flaky.store()
    token = store.acquire_or_renew("l", A, ttl=30).token
    store.release("l", A, token)
    rec = store.read("l")
    assert rec is not None and rec.state == "released" and rec.update_time is None and rec.heartbeat_age is None
    assert store.collection.find_one({"_id": "l"})["hb"] == EPOCH, "released: hb at the epoch, document kept"


# -- (5) URLs ---------------------------------------------------------------------------------
def test_url_defaults() -> None:
    parsed = parse_url("mongodb://h")
    assert (parsed.client_url, parsed.database, parsed.collection) == ("mongodb://h", "mutexcron", "mutexcron_locks")
    assert parsed.defaults == {
        "serverSelectionTimeoutMS": 5000,
        "connectTimeoutMS": 5000,
        "socketTimeoutMS": 10000,
        "w": "majority",
        "wTimeoutMS": 4000,
        "appname": "mutexcron",
    }


def test_url_database_collection_and_options_pass_through() -> None:
    url = "mongodb://u:p%40ss@h1:27017,h2:27018/locksdb?replicaSet=rs0&collection=my_locks&W=2&readPreferenceTags=dc:ny,rack:1"
    parsed = parse_url(url)
    assert parsed.database == "locksdb" and parsed.collection == "my_locks"
    assert parsed.client_url == "mongodb://u:p%40ss@h1:27017,h2:27018/locksdb?replicaSet=rs0&W=2&readPreferenceTags=dc:ny,rack:1"
    assert "w" not in parsed.defaults and "wTimeoutMS" in parsed.defaults
    assert parse_url("mongodb://h/?timeoutMS=2000").defaults.keys() == {
        "serverSelectionTimeoutMS",
        "connectTimeoutMS",
        "w",
        "appname",
    }
    assert parse_url("mongodb://h?collection=c&w=1").client_url == "mongodb://h/?w=1"


def test_store_client_settings() -> None:
    store = MongoDBLockStore("mongodb://u:s3cret@h1,h2/locksdb?replicaSet=rs0&readPreference=secondary")
    try:
        assert store.client.options.replica_set_name == "rs0"
        assert store.collection.database.name == "locksdb" and store.collection.name == "mutexcron_locks"
        assert store.collection.write_concern.document == {"w": "majority", "wtimeout": 4000}
        assert store.collection.read_preference == ReadPreference.PRIMARY, "locks are always read on the primary"
        assert store.client.options.server_selection_timeout == 5
        assert store.client.options.pool_options.connect_timeout == 5
        assert store.client.options.pool_options.socket_timeout == 10
        assert store.client.codec_options.tz_aware
    finally:
        store.close()
    store = MongoDBLockStore("mongodb://h/?w=1&serverSelectionTimeoutMS=700", socketTimeoutMS=9000)
    try:
        assert store.collection.write_concern.document["w"] == 1
        assert store.client.options.server_selection_timeout == 0.7
        assert store.client.options.pool_options.socket_timeout == 9
    finally:
        store.close()


def test_srv_url_builds_without_dns_until_used() -> None:
    pytest.importorskip("dns")  # dnspython: pymongo's extra for mongodb+srv
    store = lock_store_from_url("mongodb+srv://app:pw123@cluster0.example.invalid/appdb?collection=jobs_locks")
    try:
        assert isinstance(store, MongoDBLockStore)
        assert store.database_name == "appdb" and store.collection_name == "jobs_locks"
        assert store.masked_url == "mongodb+srv://app:***@cluster0.example.invalid/appdb?collection=jobs_locks"
        assert "pw123" not in repr(store)
    finally:
        store.close()


@pytest.mark.parametrize(
    "url, message",
    [
        ("mongodb://u:pw123@h/bad.db", "database"),
        ("mongodb://u:pw123@h/db?collection=a$b", "collection"),
        ("mongodb://u:pw123@h/db?collection=system.users", "reserved"),
        ("mongodb://u:pw123@h:notaport/db", "bad MongoDB lock URL"),
        ("mongodb://u:pw123@h1,h2:99999/db", "bad MongoDB lock URL"),
        ("mongodb://u:pw123@/db", "bad MongoDB lock URL"),
    ],
)
def test_bad_urls_are_configuration_errors_without_the_password(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        MongoDBLockStore(url)
    assert "pw123" not in str(info.value) and "***" in str(info.value)


# -- (6) a dead server fails closed, fast ------------------------------------------------------
def test_unreachable_server_raises_store_unavailable_quickly(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    store = MongoDBLockStore("mongodb://user:s3cret@127.0.0.1:1/db?serverSelectionTimeoutMS=300&connectTimeoutMS=300")
    operations = {
        "acquire_or_renew": lambda: store.acquire_or_renew("l", A, ttl=30, claim=FireClaim("j", 1, "n")),
        "heartbeat": lambda: store.hand_off("l", A, 1, {"k": 1}, RunInfo(1.0)),
        "renew_many": lambda: store.renew_many(A, {"l": 1}),
        "release": lambda: store.release("l", A, 1),
        "read": lambda: store.read("l"),
        "read_many": lambda: store.read_many(["l"]),
        "list": store.list,
        "ping": store.ping,
    }
    try:
        assert_each_unavailable_quickly(operations)
    finally:
        store.close()
    assert "s3cret" not in caplog.text


# -- against a real server (MUTEXCRON_TEST_MONGODB_URL) -----------------------------------------
@pytest.fixture
def server_store() -> Iterator[MongoDBLockStore]:
    base = require_server("mongodb")
    url = f"{base}{'&' if '?' in base else '?'}collection=mc_test_{secrets.token_hex(4)}"
    store = MongoDBLockStore(url)
    try:
        yield store
    finally:
        store.collection.drop()
        store.close()


def test_server_stores_odd_job_keys_attrs_and_node_ids(server_store: MongoDBLockStore) -> None:
    """What mongomock cannot tell: the server accepts ``$``/dotted job keys from the pipeline."""
    odd = Node("$holder.x", "$ip")
    jobs = ["$job", "a.b.c", 'q"uote', "$$NOW"]
    for i, job in enumerate(jobs):
        got = server_store.acquire_or_renew("odd", odd, ttl=30, claim=FireClaim(job, 1_000_000 + i, f"n{i}"))
        assert got.acquired and got.claimed
        assert not server_store.acquire_or_renew("odd", odd, ttl=30, claim=FireClaim(job, 1_000_000 + i, "x")).claimed
    attrs = {"$set": {"a.b": 1}, "$$NOW": "$hb", "n": 2**80}
    assert server_store.hand_off("odd", odd, 1, attrs)
    rec = server_store.read("odd")
    assert rec is not None and rec.holder == "$holder.x" and set(rec.fire_times) == set(jobs) and dict(rec.attrs) == attrs


def test_server_clock_judges_staleness(server_store: MongoDBLockStore) -> None:
    assert server_store.acquire_or_renew("s", A, ttl=0.3).acquired
    assert not server_store.acquire_or_renew("s", B, ttl=30).acquired
    time.sleep(0.5)
    took = server_store.acquire_or_renew("s", B, ttl=30)
    assert took.acquired and took.token == 2
    rec = server_store.read("s")
    assert rec is not None and rec.update_time is not None and rec.heartbeat_age is not None and rec.heartbeat_age < 5
    server_store.ping()
