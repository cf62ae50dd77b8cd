"""``hand_off_many``: many fenced hand-offs in one store operation, over every backend.

Each item is conditional on holder and token on its own (a refused one changes nothing while the
others are written), the items of one lock are applied in the order given, bad attrs are refused
before anything is sent, and the number of round trips does not grow with the number of items.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from mutexcron.errors import AttrsError
from mutexcron.locks import HandOff, LockStore, Node, RunInfo
from tests.backends import StoreCtx
from tests.test_batch_claims import KINDS, counted, held

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")
TTL = 0.4

#: Round trips of one hand_off_many whose items name each lock once, whatever their number.
ONE_ROUND = {
    "memory": [],
    "sqlite": ["UPDATE"],
    "mysql": ["UPDATE"],
    "mysql8": ["UPDATE"],
    "postgresql": ["UPDATE"],
    "redis": ["EVALSHA"],
    "redis-cluster": ["EVALSHA"],
    "mongomock": ["bulk_write"],
    "mongodb": ["update"],
}


def at(second: int) -> datetime:
    return datetime(2030, 1, 1, 0, 0, second, tzinfo=timezone.utc)


def run(job: str, second: int, error: str | None = None, *, sole: bool = True) -> RunInfo:
    return RunInfo(0.25, error, job=job, fire_time=at(second), sole_job=sole)


def taken_over(ctx: StoreCtx, store: LockStore, name: str) -> int:
    """``name`` held by A, then taken over by B once A's short lease is stale: A's token, now refused."""
    token = store.acquire_or_renew(name, A, ttl=TTL).token
    ctx.wait_stale(TTL)
    assert ctx.make().acquire_or_renew(name, B, ttl=60).acquired
    return token


@KINDS
def test_each_item_is_fenced_on_its_own_a_stale_one_refused_while_the_others_count(ctx: StoreCtx) -> None:
    store = ctx.make()
    stale = taken_over(ctx, store, "moved")
    tokens = held(store, ["one", "two", "group"])
    items = [
        HandOff("one", tokens["one"], {"n": 1}, run("one", 1)),
        HandOff("moved", stale, {"late": True}, run("moved", 1, "late")),  # B holds it now
        HandOff("two", tokens["two"] + 1, {"wrong": "token"}, run("two", 1)),  # a token it never had
        HandOff("two", tokens["two"], None, run("two", 2, "boom")),  # attrs kept, the run recorded
        HandOff("group", tokens["group"], {"g": [1, "é"]}, run("job-a", 3, sole=False)),
        HandOff("group", tokens["group"], None, None),  # a bare refresh
    ]
    assert store.hand_off_many(A, items) == [True, False, False, True, True, True]
    one, moved, two, group = (store.read(n) for n in ("one", "moved", "two", "group"))
    assert one is not None and dict(one.attrs) == {"n": 1} and one.last_error is None and one.last_run_finished
    assert moved is not None and moved.holder == B.node_id and dict(moved.attrs) == {} and moved.last_error is None
    assert store.history("moved") == [], "a refused item writes no history"
    assert two is not None and dict(two.attrs) == {} and two.last_error == "boom"
    assert [(r.fire_time, r.outcome) for r in store.history("two")] == [(at(2), "error")]
    assert group is not None and dict(group.attrs) == {"g": [1, "é"]}
    assert [(r.job, r.node, r.token) for r in store.history("group")] == [("job-a", A.node_id, tokens["group"])]
    assert store.hand_off_many(A, []) == []


@KINDS
def test_the_items_of_one_lock_are_applied_in_order(ctx: StoreCtx) -> None:
    store = ctx.make()
    token = held(store, ["ordered"])["ordered"]
    other = held(store, ["other"])["other"]
    items = [HandOff("ordered", token, {"step": i}, run("ordered", i)) for i in range(1, 5)]
    items.insert(2, HandOff("other", other, {"x": 1}, run("other", 9)))
    assert store.hand_off_many(A, items) == [True] * 5
    rec = store.read("ordered")
    assert rec is not None and dict(rec.attrs) == {"step": 4}, "the last item of the lock wins"
    assert [r.fire_time for r in store.history("ordered")] == [at(4), at(3), at(2), at(1)], "newest first"
    assert [r.fire_time for r in store.history("other")] == [at(9)]


@KINDS
def test_bad_attrs_in_any_item_are_refused_before_anything_is_written(ctx: StoreCtx) -> None:
    store = ctx.make()
    tokens = held(store, ["good", "bad"])
    items = [HandOff("good", tokens["good"], {"ok": 1}, run("good", 1)), HandOff("bad", tokens["bad"], {"x": object()})]
    with pytest.raises(AttrsError):
        store.hand_off_many(A, items)
    good = store.read("good")
    assert good is not None and dict(good.attrs) == {} and good.last_run_finished is None
    assert store.history("good") == []


@KINDS
def test_one_round_trip_whatever_the_number_of_items(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    with counted(ctx, monkeypatch) as (store, sent):
        names = [f"many-{i:03d}" for i in range(120)]
        tokens = held(store, names)
        store.hand_off_many(A, [HandOff(names[0], tokens[names[0]])])  # loads a Redis script once
        for count in (2, 120):
            sent.clear()
            items = [HandOff(n, tokens[n], {"i": i}, run(n, i % 60, sole=i % 2 == 0)) for i, n in enumerate(names[:count])]
            assert store.hand_off_many(A, items) == [True] * count
            assert sent == ONE_ROUND[ctx.kind], f"{ctx.kind}, {count} items: {sent}"
    rec = store.read(names[119])
    assert rec is not None and dict(rec.attrs) == {"i": 119}
    assert [r.fire_time for r in store.history(names[118], job=names[118])] == [at(118 % 60)]
