"""Issue 32 B5, store by store: ``forget`` lets a record go while a store-wide token floor keeps its
tokens spent (the shared behaviour is in ``tests/test_contract.py``).

* Redis: the script deletes every key of the name, its token counter included, and raises the
  namespace's floor key: 300 forgotten locks leave one key.
* A forget racing acquires of the same name never lets a token come back, and any name acquired
  after a forget gets a token above every token the forgotten name had before it.
* MongoDB (mongomock): the floor document is never a lock or a node; a record is retired, then
  deleted by a forget ``retired_keep`` seconds later by the store's clock; a record is created
  above the floor read just before (no cached floor: another node's forget counts at once), and
  a record held before is renewed or taken in one command.
* memory: the record goes at once; ``memory://NAME`` stores share the floor.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from mutexcron.errors import StoreUnavailableError
from mutexcron.locks import Node, RunInfo
from mutexcron.locks.base import FORGET_CLEARED, FORGET_DELETED, FORGET_MISSING, LockStore, Presence
from tests.backends import StoreCtx, backend_params

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")


def _finish(store: LockStore, name: str, node: Node = A) -> int:
    """Run ``name``'s one job once (a run in the history) and release it: its token."""
    token = store.acquire_or_renew(name, node, ttl=60).token
    assert store.hand_off(name, node, token, {"done": True}, RunInfo(0.01, job=f"{name}.job"))
    assert store.release(name, node, token)
    return token


# -- Redis ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("redis"))
def test_redis_300_forgotten_locks_leave_only_the_floor_key(ctx: StoreCtx) -> None:
    from mutexcron.locks.redis import RedisLockStore

    store = ctx.make()
    assert isinstance(store, RedisLockStore)
    tokens = [_finish(store, f"once-{i}") for i in range(300)]
    _finish(store, "once-0")  # a second record of one name: token 2
    assert all(store.forget(f"once-{i}") == FORGET_DELETED for i in range(300))
    client = store.backend.client
    keys = sorted(client.scan_iter(match=store.backend.key("*"), count=1000))
    floor_key = store.backend.key("lock_token_floor")
    assert keys == [floor_key], f"{len(keys)} keys left, e.g. {keys[:3]}"
    assert int(client.get(floor_key)) == max(tokens) + 1 == 2
    assert store.acquire_or_renew("once-0", A, ttl=60).token == 3, "above the floor, not from a fresh counter"
    assert store.acquire_or_renew("another", A, ttl=60).token == 3


@pytest.mark.parametrize("kind", backend_params("redis"))
def test_redis_hand_over_gives_a_token_above_the_floor(ctx: StoreCtx) -> None:
    store = ctx.make()
    held = store.acquire_or_renew("kept", A, ttl=60).token
    for _ in range(4):
        _finish(store, "once")
    assert store.forget("once") == FORGET_DELETED  # floor 4
    assert store.hand_over("kept", A, held, B.node_id, within=30)
    assert store.acquire_or_renew("kept", B, ttl=60).token == 5


# -- any store: a forget racing acquires ---------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("memory", "redis", "mongomock", "sqlite", "postgresql", "mysql"))
def test_a_forget_racing_acquires_never_lets_a_token_come_back(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread takes and releases ``race`` over and over; another forgets it (forced) over and
    over, and after each forget takes a name never used: that token is above every token ``race``
    had before the forget began (the floor holds them), and ``race``'s own tokens only go up.

    SQL and MongoDB: records retired 0.2 s ago are deleted by each forget (far above any statement
    here, as 600 s is above any statement's bound in production); the taker pauses now and then
    for longer, so ``race`` is deleted and created again."""
    keep = 0.2
    monkeypatch.setattr(LockStore, "retired_keep", keep)
    taker, forgetter = ctx.make(), ctx.make()
    rounds = 300
    issued: list[int] = []  # race's tokens, in order: appended by the taker only
    fresh: list[tuple[int, int]] = []  # (token of a new name after a forget, race's highest before it)
    contention = 0
    errors: list[BaseException] = []

    def take() -> None:
        for i in range(rounds):
            token = taker.acquire_or_renew("race", A, ttl=60).token
            issued.append(token)
            taker.release("race", A, token)
            if i % 60 == 59:
                time.sleep(keep * 2)  # left retired long enough for the next forget to delete it

    def forget() -> None:
        nonlocal contention
        for i in range(rounds):
            before = max(issued, default=0)
            try:
                forgetter.forget("race", force=True)
            except StoreUnavailableError:  # MongoDB: taken again between its read and its write, 3 times
                contention += 1
                continue
            fresh.append((forgetter.acquire_or_renew(f"fresh-{i}", B, ttl=60).token, before))

    threads = [threading.Thread(target=_catching(run, errors)) for run in (take, forget)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert all(later > earlier for earlier, later in itertools.pairwise(issued)), "race's tokens only go up"
    assert len(issued) == rounds and len(fresh) + contention == rounds and contention < rounds / 2
    beaten = [(token, before) for token, before in fresh if token <= before]
    assert not beaten, f"{len(beaten)} new names got a token at or below a forgotten one, e.g. {beaten[:3]}"


def _catching(run: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    def wrapped() -> None:
        try:
            run()
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    return wrapped


# -- MongoDB (mongomock) ---------------------------------------------------------------------------
class _Counted:
    """A collection proxy that records the name of every command sent."""

    def __init__(self, target: Any, sent: list[str]) -> None:
        self._target, self._sent = target, sent

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self._sent.append(name)
            return value(*args, **kwargs)

        return call


@pytest.fixture
def counted() -> Iterator[Callable[[Any], list[str]]]:
    def count(store: Any) -> list[str]:
        sent: list[str] = []
        store.collection = _Counted(store.collection, sent)
        return sent

    yield count


def _raw_ids(store: Any) -> list[str]:
    """The string ``_id`` of every document: the lock records, retired ones included."""
    return sorted(doc["_id"] for doc in store.collection.find({}, {"_id": True}) if isinstance(doc["_id"], str))


@pytest.mark.parametrize("kind", backend_params("mongomock"))
def test_mongodb_floor_document_is_never_a_lock_nor_a_node(ctx: StoreCtx) -> None:
    store = ctx.make()
    assert store.renew_many(A, {}, presence=Presence("1")) == set()
    spent = max(_finish(store, "once") for _ in range(3))
    _finish(store, "kept")
    assert store.forget("once") == FORGET_CLEARED
    assert store.collection.find_one({"_id": {"floor": "tokens"}}) == {"_id": {"floor": "tokens"}, "token": spent}
    assert [r.name for r in store.list()] == ["kept"], "neither the floor nor the retired record is a lock in use"
    assert [n.node_id for n in store.nodes()] == [A.node_id], "the floor is not a node's presence"
    assert set(store.read_many(["once", "kept"])) == {"once", "kept"}, "a retired record can still be read"
    assert store.read("once").token == spent and store.read("once").holder is None  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", backend_params("mongomock"))
def test_mongodb_retired_records_are_deleted_after_retired_keep_by_the_store_clock(ctx: StoreCtx) -> None:
    assert ctx.clock is not None
    store, a = ctx.make(), ctx.make()
    assert store.retired_keep == 600.0
    _finish(a, "first")
    assert store.forget("first") == FORGET_CLEARED
    ctx.clock.advance(599)
    _finish(a, "second")
    assert store.forget("second") == FORGET_CLEARED
    assert store.collection.find_one({"_id": "first"}) is not None, "retired 599 s ago: kept"
    _finish(a, "revived")
    assert store.forget("revived") == FORGET_CLEARED
    _finish(a, "revived")  # taken again: in use, never deleted
    ctx.clock.advance(1)
    _finish(a, "third")
    assert store.forget("third") == FORGET_CLEARED
    assert "first" not in _raw_ids(store), "retired 600 s ago: deleted by the next forget"
    assert {"second", "third", "revived"} <= set(_raw_ids(store))
    ctx.clock.advance(601)
    assert store.forget("revived") == FORGET_CLEARED, "retired only now"
    assert _raw_ids(store) == ["revived"]


@pytest.mark.parametrize("kind", backend_params("mongomock"))
def test_mongodb_a_new_record_reads_the_floor_at_once_and_a_held_one_is_one_command(
    ctx: StoreCtx, counted: Callable[[Any], list[str]]
) -> None:
    """No cached floor: a floor another node raised a moment ago counts for this node's next new
    record. A record held before is renewed or taken in one command; a new one takes three (the
    refused write, the read of the record and the floor, the upsert), once per record's life."""
    a, ops = ctx.make(), ctx.make()
    ops.retired_keep = 0.0
    sent = counted(a)
    spent = _finish(a, "once")
    assert sent[:3] == ["find_one_and_update", "aggregate", "find_one_and_update"], sent
    sent.clear()
    for _ in range(3):
        spent = _finish(a, "once")
    assert sent == ["find_one_and_update", "find_one_and_update", "update_one"] * 3, sent
    assert ops.forget("once") == FORGET_CLEARED
    assert "once" not in _raw_ids(ops), "retired_keep 0: deleted by the same forget"
    assert a.acquire_or_renew("once", A, ttl=60).token == spent + 1, "the floor read just now, not a copy"
    ops.set_paused("made-by-pause", True, "ops")
    assert a.acquire_or_renew("made-by-pause", B, ttl=60).token == spent + 1


@pytest.mark.parametrize("kind", backend_params("mongomock"))
def test_mongodb_forget_retires_only_the_token_it_raised_the_floor_to(
    ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record taken and released again between forget's read and its write keeps the later
    token; the forget reads again, raises the floor to that token and then retires the record."""
    store, other = ctx.make(), ctx.make()
    _finish(store, "l")
    raise_floor = store._raise_floor  # type: ignore[attr-defined]
    raised: list[int] = []

    def meanwhile(token: int) -> None:
        raised.append(token)
        if len(raised) == 1:
            _finish(other, "l", B)  # token 2, after forget read token 1
        raise_floor(token)

    monkeypatch.setattr(store, "_raise_floor", meanwhile)
    assert store.forget("l") == FORGET_CLEARED
    assert raised == [1, 2]
    assert store.collection.find_one({"_id": {"floor": "tokens"}})["token"] == 2
    assert store.read("l").token == 2  # type: ignore[union-attr]
    assert store.forget("missing") == FORGET_MISSING


@pytest.mark.parametrize("kind", backend_params("mongomock"))
def test_mongodb_a_retired_record_given_a_token_above_the_floor_is_not_deleted(ctx: StoreCtx) -> None:
    """A writer that takes a retired record without clearing ``retired`` (an earlier mutexcron
    version during an upgrade) gives it a token the floor does not hold: that record stays."""
    store = ctx.make()
    store.retired_keep = 0.0
    _finish(store, "old")
    assert store.forget("old") == FORGET_CLEARED and "old" not in _raw_ids(store)
    _finish(store, "kept")
    store.collection.update_one({"_id": "kept"}, {"$set": {"retired": datetime(2030, 1, 1, tzinfo=timezone.utc)}})
    store.collection.update_one({"_id": "kept"}, {"$set": {"token": 99}})  # taken and released by that writer
    _finish(store, "other")
    assert store.forget("other") == FORGET_CLEARED
    assert _raw_ids(store) == ["kept"], "token 99 is above the floor (2): not deleted"


# -- memory ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("memory"))
def test_memory_forget_deletes_at_once_and_named_stores_share_the_floor(ctx: StoreCtx) -> None:
    a, ops = ctx.make(), ctx.make()  # the same memory://NAME: one space
    spent = max(_finish(a, "once") for _ in range(3))
    assert ops.forget("once") == FORGET_DELETED
    assert ops.read("once") is None and ops.history("once") == []
    assert "once" not in a._rows  # type: ignore[attr-defined]
    assert a.acquire_or_renew("brand-new", A, ttl=60).token == spent + 1
