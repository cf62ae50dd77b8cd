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
from mutexcron.locks import FireClaim, HeldClaim, Node, Presence, RunInfo
from mutexcron.locks.base import FORGET_CLEARED, FORGET_DELETED, FORGET_MISSING, LockStore
from mutexcron.node import NodeTraits
from tests import workers
from tests.backends import ALL_BACKENDS, StoreCtx, backend_params
from tests.test_batch_claims import counted

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


# -- run history, the pause flag, node presence -------------------------------------------------------
# tests/test_history.py runs these on MySQL 8's code path too (no RETURNING), on the MariaDB server.

#: Round trips of one hand-off with a run (attrs, last run and history in one write), by backend.
HAND_OFF_TRIPS = {
    "memory": [],
    "sqlite": ["UPDATE"],
    "mysql": ["UPDATE"],
    "mysql8": ["UPDATE"],
    "postgresql": ["UPDATE"],
    "redis": ["EVALSHA"],
    "redis-cluster": ["EVALSHA"],
    "mongomock": ["find_one_and_update"],
    "mongodb": ["findAndModify"],
}
#: Round trips of one renew_many with a presence, once the node's presence exists, by backend.
RENEW_PRESENCE_TRIPS = {
    "memory": [],
    "sqlite": ["BEGIN", "INSERT", "UPDATE", "COMMIT"],  # two statements, one transaction, in-process
    "mysql": ["UPDATE"],  # the node's row joined with the renewed locks
    "mysql8": ["UPDATE"],
    "postgresql": ["WITH"],  # the renewal and the upsert as data-modifying CTEs
    "redis": ["EVALSHA"],
    "redis-cluster": ["EVALSHA"],
    "mongomock": ["bulk_write"],
    "mongodb": ["update"],  # one bulk write: the renewal and the presence upsert in one command
}
JOB = 'jobs.tick "v2"'  # dots and quotes: never a JSON path or a field path in any store


def at(minute: int) -> datetime:
    return datetime(2030, 1, 1, 0, minute, tzinfo=timezone.utc)


def test_history_keeps_the_last_20_runs_per_job_newest_first(ctx: StoreCtx) -> None:
    store = ctx.make()
    token = store.acquire_or_renew("h", A, ttl=60).token
    for i in range(25):
        error = f"ValueError: row {i} " + "x" * 600 if i % 5 == 0 else None
        assert store.hand_off("h", A, token, {"i": i}, RunInfo(0.25, error, job=JOB, fire_time=at(i)))
    ctx.wait_stale(0.01)  # the other job's runs end later by the store's clock (runs of one job keep their order)
    for i in range(3):
        assert store.hand_off("h", A, token, None, RunInfo(0.5, None, job="other", fire_time=at(30 + i)))
    runs = ctx.make().history("h", job=JOB)
    assert [r.fire_time for r in runs] == [at(i) for i in range(24, 4, -1)], "the last 20, newest first"
    newest, failed = runs[0], runs[4]
    assert (newest.lock, newest.job, newest.node, newest.ip, newest.token) == ("h", JOB, A.node_id, A.ip, token)
    assert newest.outcome == "success" and newest.error is None
    assert newest.duration == pytest.approx(0.25, abs=0.002)
    assert failed.fire_time == at(20) and failed.outcome == "error"
    assert failed.error is not None and failed.error.startswith("ValueError: row 20 xx") and len(failed.error) == 500
    last = store.history("h", job="other")[0]
    rec = store.read("h")
    assert rec is not None and rec.last_run_finished is not None and last.ended is not None
    assert abs((last.ended - rec.last_run_finished).total_seconds()) < 1, "ended is the store's clock, as last_run_finished"
    assert rec.last_error is None and dict(rec.attrs) == {"i": 24}
    everything = store.history("h")
    assert len(everything) == 23 and [r.job for r in everything[:3]] == ["other"] * 3
    assert [r.fire_time for r in store.history("h", limit=2)] == [at(32), at(31)]
    assert store.history("missing") == [] and set(store.history_many(["h", "missing"])) == {"h"}
    assert runs[0].to_json()["fire_time"] == "2030-01-01T00:24:00+00:00"


def test_history_length_caps_each_job_on_every_write(ctx: StoreCtx) -> None:
    store = ctx.make()
    store.history_length = 3  # what ?history=3 sets (tests/test_history.py checks the option itself)
    token = store.acquire_or_renew("cap", A, ttl=60).token
    for i in range(5):
        assert store.hand_off("cap", A, token, None, RunInfo(0.1, None, job="a", fire_time=at(i)))
    assert store.hand_off("cap", A, token, None, RunInfo(0.1, None, job="b", fire_time=at(9)))
    assert [r.fire_time for r in store.history("cap", job="a")] == [at(4), at(3), at(2)]
    store.history_length = 2
    assert store.hand_off("cap", A, token, None, RunInfo(0.1, None, job="a", fire_time=at(5)))
    assert [r.fire_time for r in store.history("cap", job="a")] == [at(5), at(4)], "a shorter length applies at once"
    assert [r.fire_time for r in store.history("cap", job="b")] == [at(9)], "each job has its own list"


def test_history_zero_writes_no_history_and_keeps_what_is_there(ctx: StoreCtx) -> None:
    """``?history=0``: a hand-off still records the last run, and appends nothing to the history."""
    store = ctx.make()
    token = store.acquire_or_renew("h0", A, ttl=60).token
    assert store.hand_off("h0", A, token, None, RunInfo(0.1, None, job="a", fire_time=at(1)))
    store.history_length = 0  # what ?history=0 sets
    assert store.hand_off("h0", A, token, {"n": 2}, RunInfo(0.2, "boom", job="a", fire_time=at(2)))
    assert store.hand_off("h0", A, token, None, RunInfo(0.2, None, job="b", fire_time=at(3)))
    assert [r.fire_time for r in store.history("h0")] == [at(1)], "runs from before stay; none is added"
    rec = store.read("h0")
    assert rec is not None and rec.last_run_finished is not None and rec.last_error is None and dict(rec.attrs) == {"n": 2}


def test_refused_hand_off_writes_no_history(ctx: StoreCtx) -> None:
    a, b = ctx.make(), ctx.make()
    assert a.acquire_or_renew("r", A, ttl=TTL).token == 1
    assert a.hand_off("r", A, 1, None, RunInfo(0.1, None, job="j", fire_time=at(1)))
    ctx.wait_stale(TTL)
    assert b.acquire_or_renew("r", B, ttl=60).token == 2
    assert not a.hand_off("r", A, 1, {"late": True}, RunInfo(0.1, "late", job="j", fire_time=at(2)))
    assert not b.hand_off("r", B, 1, None, RunInfo(0.1, "old token", job="j", fire_time=at(3)))
    assert [(r.node, r.token, r.fire_time) for r in b.history("r")] == [(A.node_id, 1, at(1))]
    rec = b.read("r")
    assert rec is not None and rec.last_error is None and dict(rec.attrs) == {}


def test_hand_off_with_history_is_one_round_trip(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    with counted(ctx, monkeypatch) as (store, sent):
        token = store.acquire_or_renew("rt", A, ttl=60).token
        assert store.hand_off("rt", A, token, {"w": 0}, RunInfo(0.1, None, job="j"))  # loads a Redis script once
        sent.clear()
        assert store.hand_off("rt", A, token, {"w": 1}, RunInfo(0.1, "boom", job="j", fire_time=at(1)))
        trips = list(sent)
    assert trips == HAND_OFF_TRIPS[ctx.kind], f"{ctx.kind}: {trips}"
    assert [r.outcome for r in store.history("rt", job="j")] == ["error", "success"]


def test_history_of_a_locks_only_job(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """The only job of its lock (``RunInfo.sole_job``; SQL stores keep it in a column of its own):
    the same history, one round trip, cut on every write, merged with runs it had in a group."""
    store = ctx.make()
    token = store.acquire_or_renew("solo", A, ttl=60).token
    assert store.hand_off("solo", A, token, None, RunInfo(0.5, None, job=JOB, fire_time=at(0)))  # in a group then
    ctx.wait_stale(0.01)
    with counted(ctx, monkeypatch) as (counting, sent):
        for i in range(1, 25):
            error = f"KeyError: {i} " + "y" * 600 if i % 7 == 0 else None
            sent.clear()
            assert counting.hand_off("solo", A, token, {"i": i}, RunInfo(0.25, error, job=JOB, fire_time=at(i), sole_job=True))
        trips = list(sent)
    assert trips == HAND_OFF_TRIPS[ctx.kind], f"{ctx.kind}: {trips}"
    runs = ctx.make().history("solo", job=JOB)
    assert [r.fire_time for r in runs] == [at(i) for i in range(24, 4, -1)], "the last 20, newest first"
    assert (runs[0].lock, runs[0].job, runs[0].node, runs[0].token, runs[0].outcome) == ("solo", JOB, A.node_id, token, "success")
    failed = runs[3]
    assert failed.fire_time == at(21) and failed.outcome == "error" and failed.error is not None and len(failed.error) == 500
    store.history_length = 2
    assert store.hand_off("solo", A, token, None, RunInfo(0.1, None, job=JOB, fire_time=at(25), sole_job=True))
    assert [r.fire_time for r in store.history("solo")] == [at(25), at(24)], "a shorter length applies at once"
    rec = store.read("solo")
    assert rec is not None and dict(rec.attrs) == {"i": 24} and rec.last_run_finished is not None
    b = ctx.make()
    assert not b.acquire_or_renew("solo", B, ttl=60).acquired  # still A's
    assert not b.hand_off("solo", B, token, None, RunInfo(0.1, "not mine", job=JOB, sole_job=True))
    assert [r.node for r in store.history("solo")] == [A.node_id] * 2, "a refused hand-off writes nothing"


def test_pause_is_an_operators_write_that_every_write_and_read_keeps(ctx: StoreCtx) -> None:
    a, ops = ctx.make(), ctx.make()
    got = a.acquire_or_renew("p", A, ttl=60, claim=FireClaim.new("job", 1_000_000))
    assert got.claimed and not got.record.paused and got.record.paused_at is None
    ctx.wait_stale(0.2)  # let the heartbeat age: a pause must not renew it
    paused = ops.set_paused("p", True, "alice@ops")
    assert (paused.holder, paused.token, paused.active_ip, paused.ttl) == (A.node_id, 1, A.ip, 60)
    assert paused.heartbeat_age is not None and paused.heartbeat_age >= 0.2, "the lease is not renewed by a pause"
    assert paused.paused and paused.paused_by == "alice@ops" and paused.paused_at is not None
    assert not paused.resume_catch_up and paused["paused"] is True and paused.to_json()["paused"] is True
    # The holder keeps its lease through every write; no fire time is claimed while paused.
    renewed = a.acquire_or_renew("p", A, ttl=60, claim=FireClaim.new("job", 2_000_000))
    assert renewed.acquired and renewed.token == 1 and not renewed.claimed and renewed.record.paused
    assert a.renew_many(A, {"p": 1}) == {"p"}
    assert a.hand_off("p", A, 1, {"k": "v"}, RunInfo(0.1, None, job="job"))
    batch = a.claim_many(A, [HeldClaim("p", 1, FireClaim.new("job", 3_000_000))])
    assert batch.renewed == {"p"} and batch.won == frozenset() and batch.paused == {"p"}
    listed = {r.name: r for r in a.list()}
    for rec in (a.read("p"), a.read_many(["p"])["p"], listed["p"]):
        assert rec is not None and rec.paused and rec.paused_by == "alice@ops" and rec.paused_at is not None
        assert abs((rec.paused_at - paused.paused_at).total_seconds()) < 0.01  # memory:// derives wall times per read
        assert (rec.holder, rec.token, dict(rec.attrs)) == (A.node_id, 1, {"k": "v"})
        assert rec.fire_times["job"].timestamp() == 1.0, "no claim was written while paused"
    # A resume with catch-up: the claims go on, and the nodes see the catch-up flag.
    resumed = ops.set_paused("p", False, "bob", catch_up=True)
    assert not resumed.paused and resumed.resume_catch_up and resumed.paused_by == "bob" and resumed.token == 1
    nxt = a.acquire_or_renew("p", A, ttl=60, claim=FireClaim.new("job", 2_000_000))
    assert nxt.claimed and not nxt.record.paused and nxt.record.resume_catch_up
    batch = a.claim_many(A, [HeldClaim("p", 1, FireClaim.new("job", 3_000_000))])
    assert len(batch.won) == 1 and batch.paused == frozenset()
    again = ops.set_paused("p", True, "carol")
    assert again.paused and not again.resume_catch_up, "a pause clears the last resume's catch-up"


def test_a_lock_can_be_paused_before_any_node_ran_it_and_stays_paused_across_takeovers(ctx: StoreCtx) -> None:
    ops, a, b = ctx.make(), ctx.make(), ctx.make()
    created = ops.set_paused("fresh", True, "ops")
    assert (created.name, created.holder, created.token, created.state, created.paused) == ("fresh", None, 0, "released", True)
    assert [r.name for r in ops.list()] == ["fresh"]
    got = a.acquire_or_renew("fresh", A, ttl=TTL, claim=FireClaim.new("j", 1_000))
    assert got.acquired and got.token == 1 and not got.claimed and got.record.paused
    ctx.wait_stale(TTL)
    took = b.acquire_or_renew("fresh", B, ttl=60, claim=FireClaim.new("j", 2_000))
    assert took.acquired and took.token == 2 and not took.claimed and took.record.paused
    assert b.release("fresh", B, 2)
    rec = ops.read("fresh")
    assert rec is not None and rec.paused and rec.state == "released" and rec.token == 2
    assert not ops.set_paused("fresh", False, "ops").paused
    assert a.acquire_or_renew("fresh", A, ttl=60, claim=FireClaim.new("j", 2_000)).claimed


def test_presence_is_published_with_the_renewals(ctx: StoreCtx) -> None:
    a, b, viewer = ctx.make(), ctx.make(), ctx.make()
    for name in ("x", "y"):
        assert a.acquire_or_renew(name, A, ttl=60).acquired
    assert viewer.nodes() == []
    assert a.renew_many(A, {"x": 1, "y": 1}, presence=Presence("1.2.3", 0.25)) == {"x", "y"}
    assert b.renew_many(B, {}, presence=Presence("1.2.4")) == set(), "a presence alone: nothing held"
    nodes = {n.node_id: n for n in viewer.nodes()}
    assert list(nodes) == sorted([A.node_id, B.node_id])
    na, nb = nodes[A.node_id], nodes[B.node_id]
    assert (na.ip, na.version, na.clock_offset, na.locks) == (A.ip, "1.2.3", 0.25, ("x", "y"))
    assert na.last_seen is not None and na.age is not None and 0 <= na.age < 5
    assert (nb.ip, nb.version, nb.clock_offset, nb.locks) == (B.ip, "1.2.4", None, ())
    # A later presence replaces the earlier one; a lease not held is not renewed.
    assert a.renew_many(A, {"x": 1, "y": 5}, presence=Presence("1.2.3", -0.5, locks=("x",))) == {"x"}
    na = next(n for n in viewer.nodes() if n.node_id == A.node_id)
    assert (na.clock_offset, na.locks) == (-0.5, ("x",))
    assert a.renew_many(A, {"x": 1}) == {"x"}, "renew_many without a presence works as before"
    assert na.to_json()["locks"] == ["x"]


def test_a_presence_carries_the_nodes_weight_and_tags(ctx: StoreCtx) -> None:
    """Placement reads every node's weight and tags from its presence (issue 33): each store keeps them."""
    a, viewer = ctx.make(), ctx.make()
    assert a.acquire_or_renew("x", A, ttl=60).acquired
    traits = NodeTraits.checked(2.5, ["reports", "eu"])
    assert a.renew_many(A, {"x": 1}, presence=Presence("1.2.3", traits=traits)) == {"x"}
    assert a.renew_many(B, {}, presence=Presence("1.2.3")) == set()
    nodes = {n.node_id: n for n in viewer.nodes(prune=False)}
    assert nodes[A.node_id].traits == NodeTraits(2.5, ("eu", "reports"))
    assert nodes[B.node_id].traits == NodeTraits(), "a node without --weight or --tag: weight 1, no tags"
    assert nodes[A.node_id].to_json()["weight"] == 2.5 and nodes[A.node_id].to_json()["tags"] == ["eu", "reports"]
    assert a.renew_many(A, {"x": 1}, presence=Presence("1.2.3")) == {"x"}, "a later presence replaces them"
    assert next(n for n in viewer.nodes() if n.node_id == A.node_id).traits == NodeTraits()


def test_presence_older_than_its_ttl_is_pruned(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    for module in ("memory", "sql", "redis", "mongodb"):
        monkeypatch.setattr(importlib.import_module(f"mutexcron.locks.{module}"), "PRESENCE_TTL", 1)

    def outlive_ttl() -> None:
        if ctx.clock is not None:
            ctx.clock.advance(1.5)
        else:
            time.sleep(1.5)

    a, b, viewer = ctx.make(), ctx.make(), ctx.make()
    assert a.acquire_or_renew("x", A, ttl=60).acquired
    assert a.renew_many(A, {"x": 1}, presence=Presence("1")) == {"x"}
    outlive_ttl()
    assert b.renew_many(B, {}, presence=Presence("1")) == set()
    assert [n.node_id for n in viewer.nodes()] == [B.node_id]
    outlive_ttl()
    assert viewer.nodes() == []
    # A node whose presence was pruned (silent for longer than the TTL) comes back with its next renewal.
    assert a.renew_many(A, {"x": 1}, presence=Presence("1")) == {"x"}
    assert [(n.node_id, n.locks) for n in viewer.nodes()] == [(A.node_id, ("x",))]


def test_nodes_without_prune_reads_the_same_and_deletes_nothing(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dashboard's read: the fresh presences only, and an old one stays in the store."""
    import importlib

    modules = [importlib.import_module(f"mutexcron.locks.{module}") for module in ("memory", "sql", "redis", "mongodb")]

    def presence_ttl(seconds: int) -> None:
        for module in modules:
            monkeypatch.setattr(module, "PRESENCE_TTL", seconds)

    def wait() -> None:
        if ctx.clock is not None:
            ctx.clock.advance(1.2)
        else:
            time.sleep(1.2)

    presence_ttl(2)
    a, b, viewer = ctx.make(), ctx.make(), ctx.make()
    assert a.acquire_or_renew("x", A, ttl=60).acquired
    assert a.renew_many(A, {"x": 1}, presence=Presence("1")) == {"x"}
    wait()
    assert b.renew_many(B, {}, presence=Presence("1")) == set()  # A's presence is still fresh: not pruned by it
    wait()  # A's is 2.4 s old, B's 1.2 s
    assert [n.node_id for n in viewer.nodes(prune=False)] == [B.node_id], "an old presence is not shown"
    presence_ttl(600)
    assert [n.node_id for n in viewer.nodes(prune=False)] == sorted([A.node_id, B.node_id]), "and it was not deleted"
    presence_ttl(2)
    assert [n.node_id for n in viewer.nodes()] == [B.node_id]
    presence_ttl(600)
    assert [n.node_id for n in viewer.nodes(prune=False)] == [B.node_id], "nodes() prunes as before"


def test_renewal_with_a_presence_is_one_round_trip(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    with counted(ctx, monkeypatch) as (store, sent):
        tokens = {name: store.acquire_or_renew(name, A, ttl=60).token for name in ("r1", "r2", "r3")}
        assert store.renew_many(A, tokens, presence=Presence("1", 0.0)) == set(tokens)  # the node's row, scripts
        sent.clear()
        assert store.renew_many(A, tokens, presence=Presence("1", 0.1)) == set(tokens)
        trips = list(sent)
    assert trips == RENEW_PRESENCE_TRIPS[ctx.kind], f"{ctx.kind}: {trips}"
    assert [n.clock_offset for n in store.nodes()] == [0.1]


def test_the_holder_records_its_time_zone_fenced_and_every_read_shows_it(ctx: StoreCtx) -> None:
    """The zone rule: the holder writes the zone it computes fire times in; only the holder, with its token."""
    a, b = ctx.make(), ctx.make()
    token = a.acquire_or_renew("zoned", A, ttl=10).token
    assert a.read("zoned").zone is None  # type: ignore[union-attr]
    assert not b.set_zone("zoned", B, token, "Asia/Tokyo"), "not the holder"
    assert not a.set_zone("zoned", A, token + 1, "Asia/Tokyo"), "not its token"
    assert a.set_zone("zoned", A, token, "America/New_York")
    assert b.read("zoned").zone == "America/New_York"  # type: ignore[union-attr]
    assert b.read_many(["zoned"])["zoned"].zone == "America/New_York"
    assert [r.zone for r in b.list() if r.name == "zoned"] == ["America/New_York"]
    renewed = a.acquire_or_renew("zoned", A, ttl=10)
    assert renewed.record.zone == "America/New_York" and renewed.record.to_json()["zone"] == "America/New_York"
    assert a.release("zoned", A, token)
    assert b.read("zoned").zone == "America/New_York", "a release keeps the zone"  # type: ignore[union-attr]
    assert not a.set_zone("missing", A, 1, "UTC")


def test_forget_deletes_a_lock_never_held_clears_any_other_and_tokens_never_go_back(ctx: StoreCtx) -> None:
    """Issue 25 item 6: `mutexcron forget LOCK`. A record paused by a typo (never held) goes; a
    live lease is refused unless forced; a forgotten lock's next holder gets a greater token."""
    from mutexcron.locks.base import FORGET_HELD

    ops, a, b = ctx.make(), ctx.make(), ctx.make()
    ops.set_paused("biling", True, "ops")
    assert ops.forget("biling") == FORGET_DELETED and ops.read("biling") is None
    assert ops.forget("biling") == FORGET_MISSING and [r.name for r in ops.list()] == []

    got = a.acquire_or_renew("billing", A, ttl=TTL, claim=FireClaim.new("invoice", 1_000_000))
    assert got.claimed and a.hand_off("billing", A, 1, {"k": 1}, RunInfo(0.1, "boom", job="invoice"))
    ops.set_paused("billing", True, "ops")
    assert ops.forget("billing") == FORGET_HELD, "a live lease is not forgotten unless forced"
    held = ops.read("billing")
    assert held is not None and (held.holder, held.paused, dict(held.attrs)) == (A.node_id, True, {"k": 1})

    ctx.wait_stale(TTL)  # the holder died: its lease ran out
    assert ops.forget("billing") in (FORGET_CLEARED, FORGET_DELETED)
    rec = ops.read("billing")
    if rec is not None:  # the store keeps the token in the record: a bare released record
        assert (rec.holder, rec.token, rec.paused, dict(rec.attrs), rec.fire_times) == (None, 1, False, {}, {})
        assert (rec.last_error, rec.last_run_finished, rec.paused_by) == (None, None, None)
    assert ops.history("billing") == []
    assert not a.hand_off("billing", A, 1, {"late": True}), "the old holder's writes stay fenced"
    again = b.acquire_or_renew("billing", B, ttl=60, claim=FireClaim.new("invoice", 500))
    assert again.acquired and again.token == 2 and again.claimed, "tokens go on from the forgotten record's"

    # A live lease, forced: the holder loses it (its renewal fails), the next token is still greater.
    assert ops.forget("billing", force=True) in (FORGET_CLEARED, FORGET_DELETED)
    assert b.renew_many(B, {"billing": 2}) == set()
    assert a.acquire_or_renew("billing", A, ttl=60).token == 3


def _token_after_cycles(a: LockStore, b: LockStore, name: str, cycles: int) -> int:
    """Take and release ``name`` by turns ``cycles`` times; the last token."""
    token = 0
    for i in range(cycles):
        store, node = (a, A) if i % 2 == 0 else (b, B)
        token = store.acquire_or_renew(name, node, ttl=60).token
        assert store.release(name, node, token)
    return token


def test_a_forgotten_record_is_let_go_and_its_tokens_stay_spent(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32 B5: the lock records of finished one-off jobs are let go. A forgotten record leaves
    ``list()`` at once and the store (at once, or ``retired_keep`` seconds later, by the next
    forget); the store-wide token floor keeps every token it issued spent: the name taken again,
    created by a pause, or any other new name, gets a greater token."""
    monkeypatch.setattr(LockStore, "retired_keep", 0.0)  # every store: the next forget deletes what was retired before it
    ops, a, b = ctx.make(), ctx.make(), ctx.make()
    spent = _token_after_cycles(a, b, "once-1", 5)
    assert spent == 5 and ops.forget("once-1") in (FORGET_CLEARED, FORGET_DELETED)
    assert [r.name for r in ops.list()] == [], "a forgotten record is out of the list at once"
    _token_after_cycles(a, b, "once-2", 1)
    assert ops.forget("once-2") in (FORGET_CLEARED, FORGET_DELETED)  # deletes once-1 if it was retired
    assert ops.read("once-1") is None, "deleted by the next forget"

    again = b.acquire_or_renew("once-1", B, ttl=60, claim=FireClaim.new("once-1", 1))
    assert again.acquired and again.claimed and again.token > spent, "the same name, added again"
    assert not a.hand_off("once-1", A, spent, {"late": True}), "the old holder's token stays fenced"
    ops.set_paused("created-by-pause", True, "ops")  # a record made at token 0
    assert a.acquire_or_renew("created-by-pause", A, ttl=60).token > spent
    assert a.acquire_or_renew("brand-new", A, ttl=60).token > spent


def test_forgetting_many_records_leaves_a_bounded_store(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thirty one-off jobs finished: their records do not pile up (``retired_keep`` 0: each forget
    deletes those retired before it)."""
    monkeypatch.setattr(LockStore, "retired_keep", 0.0)
    ops, a = ctx.make(), ctx.make()
    for i in range(30):
        token = a.acquire_or_renew(f"job-{i}", A, ttl=60).token
        assert a.hand_off(f"job-{i}", A, token, {"n": i}, RunInfo(0.01, job=f"job-{i}"))
        assert a.release(f"job-{i}", A, token)
        assert ops.forget(f"job-{i}") in (FORGET_CLEARED, FORGET_DELETED)
    assert ops.list() == []
    assert sum(ops.read(f"job-{i}") is not None for i in range(30)) <= 1, "at most the last one is still retired"
    assert ops.history("job-29") == []


def test_a_retired_record_is_revived_by_an_acquire_or_a_pause(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record forgotten and then taken again (or paused) before it is deleted stays: it is a lock
    in use again, with its token above the floor."""
    ops, a = ctx.make(), ctx.make()
    spent = _token_after_cycles(a, a, "revived", 1)
    assert ops.forget("revived") in (FORGET_CLEARED, FORGET_DELETED)
    token = a.acquire_or_renew("revived", A, ttl=60).token
    assert token > spent and a.release("revived", A, token)
    assert ops.forget("paused-later") == FORGET_MISSING
    _token_after_cycles(a, a, "paused-later", 1)
    assert ops.forget("paused-later") in (FORGET_CLEARED, FORGET_DELETED)
    ops.set_paused("paused-later", True, "ops")
    monkeypatch.setattr(LockStore, "retired_keep", 0.0)
    _token_after_cycles(a, a, "other", 1)
    assert ops.forget("other") in (FORGET_CLEARED, FORGET_DELETED)
    assert {r.name for r in ops.list()} == {"revived", "paused-later"}, "in use again: neither is deleted"
    assert ops.read("paused-later").paused  # type: ignore[union-attr]


def test_forget_node_deletes_a_presence_seen_long_enough_ago(ctx: StoreCtx) -> None:
    a, b, ops = ctx.make(), ctx.make(), ctx.make()
    assert a.renew_many(A, {}, presence=Presence("1")) == set()
    assert b.renew_many(B, {}, presence=Presence("1")) == set()
    assert not ops.forget_node(A.node_id, min_age=300), "seen just now"
    assert ops.forget_node(A.node_id) and not ops.forget_node(A.node_id) and not ops.forget_node("nobody")
    assert [n.node_id for n in ops.nodes()] == [B.node_id]


def test_the_holder_records_its_jobs_triggers_with_its_zone_fenced(ctx: StoreCtx) -> None:
    """Issue 25 item 3: what the other nodes compare their jobs file with."""
    a, b = ctx.make(), ctx.make()
    token = a.acquire_or_renew("agreed", A, ttl=10).token
    triggers = {"report": "cron[minute='*/2']", "jöb": "interval[0:00:05]"}
    assert not b.set_zone("agreed", B, token, "UTC", triggers), "not the holder"
    assert a.set_zone("agreed", A, token, None, triggers)
    got = b.read("agreed")
    assert got is not None and got.zone is None and dict(got.triggers or {}) == triggers
    assert dict(b.list()[0].triggers or {}) == triggers and got.to_json()["triggers"] == triggers
    assert a.set_zone("agreed", A, token, "UTC", {"report": "cron[minute='*/3']"})
    again = a.acquire_or_renew("agreed", A, ttl=10).record
    assert again.zone == "UTC" and dict(again.triggers or {}) == {"report": "cron[minute='*/3']"}
    assert a.forget("agreed", force=True) in ("cleared", "deleted")
    gone = a.read("agreed")
    assert gone is None or (gone.zone, gone.triggers) == (None, None)


def test_hand_over_offers_the_lock_to_one_node_keeps_its_claims_and_lapses(ctx: StoreCtx) -> None:
    a, b, c = ctx.make(), ctx.make(), ctx.make()
    took = a.acquire_or_renew("h", A, ttl=60, claim=FireClaim("job", 1_000_000, "n1"))
    assert took.acquired and took.claimed
    assert a.hand_off("h", A, took.token, {"k": "v"})
    assert not a.hand_over("h", A, took.token + 5, B.node_id, TTL), "a wrong token is refused"
    assert not c.hand_over("h", C, took.token, B.node_id, TTL), "a non-holder is refused"
    assert a.hand_over("h", A, took.token, B.node_id, TTL)
    offered = a.read("h")
    assert offered is not None and offered.holder == B.node_id and offered.token == took.token + 1
    assert offered.state == "active" and offered.ttl == pytest.approx(TTL)
    assert dict(offered.attrs) == {"k": "v"} and offered.fire_times["job"].timestamp() == 1.0
    assert not a.hand_off("h", A, took.token, {"k": "late"}), "the giver is fenced out"
    assert not a.hand_over("h", A, took.token, C.node_id, TTL), "and cannot offer it twice"
    assert not c.acquire_or_renew("h", C, ttl=60).acquired, "nobody else takes it while the offer stands"
    got = b.acquire_or_renew("h", B, ttl=60)
    assert got.acquired and got.token == took.token + 1 and got.record.ttl == pytest.approx(60)
    assert got.record.active_ip == B.ip
    # An offer the successor never takes lapses, and then anyone may take it, with a higher token.
    assert b.hand_over("h", B, got.token, "gone:9:dead", TTL)
    ctx.wait_stale(TTL)
    late = c.acquire_or_renew("h", C, ttl=60)
    assert late.acquired and late.token == got.token + 2 and dict(late.record.attrs) == {"k": "v"}
