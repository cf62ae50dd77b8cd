"""The lock store contract, run over every backend against real servers.

Staleness comes from the store's clock: on real servers the tests use short leases and wait them
out; on in-process stores (memory, mongomock) an injected clock is moved instead.
"""

from __future__ import annotations

import multiprocessing
import secrets
import threading
import time
from datetime import datetime, timezone

import pytest

from mutexcron.errors import AttrsError
from mutexcron.locks import FireClaim, Node, RunInfo
from tests import workers
from tests.backends import ALL_BACKENDS, StoreCtx, backend_params

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")
C = Node("node-c:3:cccc", "10.0.0.3")
TTL = 0.4

pytestmark = pytest.mark.parametrize("kind", backend_params(*ALL_BACKENDS, "redis-cluster"))


def test_first_acquire_creates_record_with_token_1(ctx: StoreCtx) -> None:
    store = ctx.make()
    result = store.acquire_or_renew("billing", A, ttl=10)
    assert result.acquired
    rec = result.record
    assert (rec.name, rec.holder, rec.active_ip, rec.token) == ("billing", A.node_id, A.ip, 1)
    assert rec["active_ip"] == A.ip and rec["holder"] == A.node_id
    assert isinstance(rec.update_time, datetime) and rec.update_time.tzinfo is not None
    assert rec.heartbeat_age is not None and 0 <= rec.heartbeat_age < 5
    assert rec.ttl == pytest.approx(10)
    assert rec.state == "active"
    assert dict(rec.attrs) == {}
    assert store.read("missing") is None


def test_refused_while_fresh_then_renewed_by_holder(ctx: StoreCtx) -> None:
    a, b = ctx.make(), ctx.make()
    assert a.acquire_or_renew("l", A, ttl=10).acquired
    refused = b.acquire_or_renew("l", B, ttl=10)
    assert not refused.acquired
    assert refused.record.holder == A.node_id and refused.record.token == 1
    renewed = a.acquire_or_renew("l", A, ttl=10)
    assert renewed.acquired and renewed.token == 1


def test_takeover_after_staleness_increments_token_and_fences_old_holder(ctx: StoreCtx) -> None:
    a, b = ctx.make(), ctx.make()
    assert a.acquire_or_renew("l", A, ttl=TTL).token == 1
    assert a.hand_off("l", A, 1, {"step": 1})
    ctx.wait_stale(TTL)
    assert a.read("l").state == "stale"  # type: ignore[union-attr]
    took = b.acquire_or_renew("l", B, ttl=10)
    assert took.acquired and took.token == 2 and took.record.holder == B.node_id
    assert dict(took.record.attrs) == {"step": 1}, "attrs are handed to the next holder"
    # The old holder is fenced out everywhere.
    assert not a.hand_off("l", A, 1, {"step": 99})
    assert a.renew_many(A, {"l": 1}) == set()
    assert not a.release("l", A, 1)
    assert not a.acquire_or_renew("l", A, ttl=TTL).acquired
    rec = b.read("l")
    assert rec is not None and rec.holder == B.node_id and rec.token == 2 and dict(rec.attrs) == {"step": 1}


def test_release_keeps_token_and_next_acquire_is_immediate(ctx: StoreCtx) -> None:
    a, b = ctx.make(), ctx.make()
    a.acquire_or_renew("l", A, ttl=60)
    a.hand_off("l", A, 1, {"k": "v"})
    assert not a.release("l", A, 7), "release with the wrong token is refused"
    assert not b.release("l", B, 1), "release by a non-holder is refused"
    assert a.read("l").holder == A.node_id  # type: ignore[union-attr]
    assert a.release("l", A, 1)
    rec = a.read("l")
    assert rec is not None and rec.holder is None and rec.token == 1 and rec.state == "released"
    assert dict(rec.attrs) == {"k": "v"}
    got = b.acquire_or_renew("l", B, ttl=60)
    assert got.acquired and got.token == 2, "no unactive_interval wait after a release; token survives"
    assert b.release("l", B, 2)
    assert a.acquire_or_renew("l", A, ttl=60).token == 3, "re-acquiring after a release is a change of holder"


def test_renew_many_renews_only_what_is_still_held(ctx: StoreCtx) -> None:
    a, b = ctx.make(), ctx.make()
    for name in ("x", "y", "z"):
        assert a.acquire_or_renew(name, A, ttl=TTL).acquired
    ctx.wait_stale(TTL)
    assert b.acquire_or_renew("y", B, ttl=60).acquired
    renewed = a.renew_many(A, {"x": 1, "y": 1, "z": 1})
    assert renewed == {"x", "z"}
    assert a.read("x").heartbeat_age < TTL  # type: ignore[operator,union-attr]
    assert a.renew_many(A, {"x": 5}) == set(), "wrong token is not renewed"
    assert a.renew_many(A, {}) == set()
    many = {f"n{i}": 1 for i in range(300)}
    for name in many:
        a.acquire_or_renew(name, A, ttl=60)
    assert a.renew_many(A, many) == set(many)


def test_attrs_round_trip_unicode_nested_and_64kb(ctx: StoreCtx) -> None:
    store = ctx.make()
    token = store.acquire_or_renew("attrs", A, ttl=60).token
    attrs = {
        "cursor": 12345678901234,
        "ratio": 0.25,
        "ok": True,
        "none": None,
        "text": "naïve café – 日本語 – emoji 🚀 – quote \" and ' and \\",
        "nested": {"list": [1, [2, {"deep": "x"}]], "empty": {}},
        "$dollar": {"$set": 1, "a.b": 2},
        "blob": "x" * 64_000,
    }
    assert store.hand_off("attrs", A, token, attrs, RunInfo(duration=1.5, error=None))
    rec = ctx.make().read("attrs")
    assert rec is not None and dict(rec.attrs) == attrs
    assert rec["cursor"] == 12345678901234
    assert rec.last_run_started is not None and rec.last_run_finished is not None
    assert 1.0 < (rec.last_run_finished - rec.last_run_started).total_seconds() < 2.0
    assert rec.last_error is None
    # attrs=None keeps the attrs; the error is recorded.
    assert store.hand_off("attrs", A, token, None, RunInfo(duration=0.1, error="ValueError: boom"))
    rec = store.read("attrs")
    assert rec is not None and dict(rec.attrs) == attrs and rec.last_error == "ValueError: boom"


def test_attrs_that_are_not_json_are_refused_and_record_unchanged(ctx: StoreCtx) -> None:
    store = ctx.make()
    token = store.acquire_or_renew("bad", A, ttl=60).token
    store.hand_off("bad", A, token, {"good": 1})
    with pytest.raises(AttrsError, match=r"'when'.*datetime"):
        store.hand_off("bad", A, token, {"when": datetime.now(timezone.utc)})
    with pytest.raises(AttrsError, match="non-string key"):
        store.hand_off("bad", A, token, {1: "x"})  # type: ignore[dict-item]
    assert dict(store.read("bad").attrs) == {"good": 1}  # type: ignore[union-attr]


def test_fire_claims_are_won_once_and_only_with_the_lease(ctx: StoreCtx) -> None:
    a, b = ctx.make(), ctx.make()
    job = 'jobs.tick "v2"'  # dots and quotes must not break the store's JSON paths
    first = a.acquire_or_renew("f", A, ttl=TTL, claim=FireClaim.new(job, 1_000_000))
    assert first.acquired and first.claimed
    assert first.record.fire_times[job] == datetime(1970, 1, 1, 0, 0, 1, tzinfo=timezone.utc)
    again = a.acquire_or_renew("f", A, ttl=TTL, claim=FireClaim.new(job, 1_000_000))
    assert again.acquired and not again.claimed, "the same fire time is claimed once"
    older = a.acquire_or_renew("f", A, ttl=TTL, claim=FireClaim.new(job, 500_000))
    assert not older.claimed, "fire times only move forward"
    other_job = a.acquire_or_renew("f", A, ttl=TTL, claim=FireClaim.new("other", 1_000_000))
    assert other_job.claimed, "claims are per job"
    refused = b.acquire_or_renew("f", B, ttl=TTL, claim=FireClaim.new(job, 2_000_000))
    assert not refused.acquired and not refused.claimed
    assert a.read("f").fire_times[job].timestamp() == 1.0  # type: ignore[union-attr]
    ctx.wait_stale(TTL)
    # The new holder cannot claim a fire time the old holder already ran...
    took = b.acquire_or_renew("f", B, ttl=60, claim=FireClaim.new(job, 1_000_000))
    assert took.acquired and not took.claimed
    # ...but claims the next one.
    nxt = b.acquire_or_renew("f", B, ttl=60, claim=FireClaim.new(job, 2_000_000))
    assert nxt.claimed and nxt.record.last_fire_time is not None
    assert nxt.record.last_fire_time.timestamp() == 2.0


def test_list_returns_every_record_sorted(ctx: StoreCtx) -> None:
    store = ctx.make()
    for name in ("b", "a", "c/with spaces"):
        store.acquire_or_renew(name, A, ttl=60)
    store.release("b", A, 1)
    records = store.list()
    assert [r.name for r in records] == ["a", "b", "c/with spaces"]
    assert [r.state for r in records] == ["active", "released", "active"]
    assert set(store.read_many(["a", "b", "zz"])) == {"a", "b"}
    store.ping()


def test_skewed_client_clock_changes_nothing(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's wall clock is never consulted: skew it by hours and the outcomes stay the same."""
    a, b = ctx.make(), ctx.make()
    assert a.acquire_or_renew("skew", A, ttl=TTL).acquired
    real_time = time.time
    for skew in (+3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda s=skew: real_time() + s)
        monkeypatch.setattr(time, "time_ns", lambda s=skew: int((real_time() + s) * 1e9))
        assert not b.acquire_or_renew("skew", B, ttl=TTL).acquired, f"skew {skew:+}s must not make a fresh lease stale"
        assert a.acquire_or_renew("skew", A, ttl=TTL).acquired
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600.0)
    ctx.wait_stale(TTL)
    took = b.acquire_or_renew("skew", B, ttl=TTL)
    assert took.acquired and took.token == 2, "a stale lease is taken over even with the client clock an hour behind"
    assert took.record.heartbeat_age is not None and took.record.heartbeat_age < 5


def test_concurrent_threads_one_winner_per_round(ctx: StoreCtx) -> None:
    """1,000 rounds, 4 threads each: half race to create the lock, half race for a released one."""
    rounds, racers = 1000, 4
    stores = [ctx.make() for _ in range(racers)]
    nodes = [Node(f"racer-{i}:{i}:{secrets.token_hex(2)}", "127.0.0.1") for i in range(racers)]
    prefix = secrets.token_hex(3)
    for r in range(rounds // 2, rounds):  # pre-create, then release: the race is over a released row
        name = f"{prefix}-{r}"
        token = stores[0].acquire_or_renew(name, nodes[0], ttl=60).token
        assert stores[0].release(name, nodes[0], token)
    barrier = threading.Barrier(racers)
    wins = [[0] * rounds for _ in range(racers)]
    errors: list[BaseException] = []

    def race(i: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(timeout=30)
                if stores[i].acquire_or_renew(f"{prefix}-{r}", nodes[i], ttl=60).acquired:
                    wins[i][r] = 1
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    per_round = [sum(w[r] for w in wins) for r in range(rounds)]
    bad = [r for r, n in enumerate(per_round) if n != 1]
    assert not bad, f"rounds without exactly one winner: {bad[:10]} ({len(bad)} of {rounds})"


def test_concurrent_processes_one_winner_per_round(ctx: StoreCtx) -> None:
    if ctx.in_process:
        pytest.skip(f"{ctx.kind} is an in-process store: there are no other processes to race")
    rounds, procs = 1000, 4
    prefix = secrets.token_hex(3)
    mp = multiprocessing.get_context("spawn")
    with mp.Pool(procs) as pool:
        pending = [pool.apply_async(workers.race_rounds, (ctx.url, prefix, rounds, i)) for i in range(procs)]
        results = [p.get(timeout=300) for p in pending]
    winners: dict[int, list[int]] = {}
    for i, won in enumerate(results):
        for r in won:
            winners.setdefault(r, []).append(i)
    missing = [r for r in range(rounds) if r not in winners]
    doubled = {r: w for r, w in winners.items() if len(w) > 1}
    assert not doubled, f"rounds won by several processes: {list(doubled.items())[:5]}"
    assert not missing, f"rounds nobody won: {missing[:10]}"
    store = ctx.make()
    holders = {rec.name: rec.holder for rec in store.list() if rec.name.startswith(prefix)}
    assert len(holders) == rounds
