"""``LockStore.claim_many``: a holder claims many fire times in one round trip, on every backend.

Run like the contract suite (``tests/test_contract.py``, same backends and ``open_backend``): real
servers, short leases waited out, an injected clock on the in-process stores; plus ``mysql8``,
MySQL 8's statements (no RETURNING) run on the MariaDB server. Round trips are counted where the
store talks to a server: SQL statements (``before_cursor_execute`` on the store's engine, as
``benchmarks/overhead.py`` counts them), Redis packets sent (``send_packed_command``), MongoDB
commands (command monitoring on a real server; calls on the collection on mongomock). The memory
store has no server to count.

mongomock 4.3 cannot run pymongo >= 4.11's ``UpdateOne`` in a ``bulk_write`` (it passes ``sort=``):
``tests/mongomock_support.py`` lets it, for every suite that runs ``claim_many`` on mongomock.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from mutexcron.drill import TimedLockStore
from mutexcron.errors import StoreUnavailableError
from mutexcron.locks import BatchClaimResult, FireClaim, HeldClaim, LockStore, Node, lock_store_from_url
from mutexcron.locks.memory import MemoryLockStore
from tests import workers
from tests.backends import ALL_BACKENDS, StoreCtx, backend_params

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")
TTL = 0.4
#: Every backend of the contract suite, plus MySQL 8's code path run on the MariaDB server.
KINDS = pytest.mark.parametrize(
    "kind", [*backend_params(*ALL_BACKENDS, "redis-cluster"), pytest.param("mysql8", marks=pytest.mark.mysql, id="mysql8")]
)
SQL_KINDS = ("sqlite", "mysql", "mysql8", "postgresql")
#: Round trips of one claim_many, by backend: what the store's docs promise.
ROUND_TRIPS = {
    "sqlite": ["WITH"],  # one UPDATE ... FROM ... RETURNING (led by its WITH)
    "postgresql": ["WITH"],
    "mysql": ["INSERT"],  # MariaDB: INSERT ... SELECT ... ON DUPLICATE KEY UPDATE ... RETURNING
    "mysql8": ["START", "UPDATE", "SELECT", "COMMIT"],  # no RETURNING: read back in the same transaction
    "redis": ["EVALSHA"],
    "redis-cluster": ["EVALSHA"],
    "mongomock": ["bulk_write", "find"],  # a bulk write says how many matched, not which: one read
    "mongodb": ["update", "find"],
}


def us(seconds: float) -> int:
    return int(seconds * 1_000_000)


def at(fire_us: int) -> datetime:
    return datetime.fromtimestamp(fire_us / 1_000_000, tz=timezone.utc)


def held(store: LockStore, names: list[str], node: Node = A, ttl: float = 60) -> dict[str, int]:
    tokens = {}
    for name in names:
        result = store.acquire_or_renew(name, node, ttl)
        assert result.acquired
        tokens[name] = result.token
    return tokens


# -- counting round trips ------------------------------------------------------------------------------
class _CountingCollection:
    """A collection proxy that records the name of every method called on it (one command each)."""

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


@contextlib.contextmanager
def counted(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LockStore, list[str]]]:
    """A new store on ``ctx``'s data and the list its round trips are appended to (one word each)."""
    sent: list[str] = []
    if ctx.kind == "mongodb":  # command monitoring: every command the driver sends, getMore included
        from pymongo import monitoring

        class Listener(monitoring.CommandListener):
            def started(self, event: monitoring.CommandStartedEvent) -> None:
                sent.append(event.command_name)

            def succeeded(self, event: Any) -> None:
                pass

            def failed(self, event: Any) -> None:
                pass

        store = lock_store_from_url(ctx.url or "", event_listeners=[Listener()])
        ctx.opened.append(store)
    else:
        store = ctx.make()
    s: Any = store
    if ctx.kind in SQL_KINDS:

        def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            sent.append(statement.split(None, 1)[0].upper())

        sqlalchemy.event.listen(s.engine, "before_cursor_execute", on_execute)
    elif ctx.kind in ("redis", "redis-cluster"):
        from redis.connection import AbstractConnection

        original = AbstractConnection.send_packed_command

        def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
            first = command[0] if isinstance(command, list) else command
            sent.append(bytes(first).split(b"\r\n")[2].decode().upper())  # *N, $len, NAME
            original(self, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", send_packed_command)
    elif ctx.kind == "mongomock":
        s.collection = _CountingCollection(s.collection, sent)
    try:
        yield store, sent
    finally:
        if ctx.kind in SQL_KINDS:
            sqlalchemy.event.remove(s.engine, "before_cursor_execute", on_execute)


# -- the contract -------------------------------------------------------------------------------------
@KINDS
def test_200_jobs_over_50_locks_in_one_call_all_won_recorded_renewed(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    with counted(ctx, monkeypatch) as (store, sent):
        names = [f"group-{i:02d}" for i in range(50)]
        tokens = held(store, names)
        for name in names[1::3] + names[2::3] * 2:  # tokens 1, 2, 3 side by side: each lock is judged on its own
            assert store.release(name, A, tokens[name])
            tokens[name] = held(store, [name])[name]
        assert set(tokens.values()) == {1, 2, 3}
        store.hand_off("group-07", A, tokens["group-07"], {"cursor": 7})
        jobs = ["plain", 'jobs.tick "v2"', "a.b c", "$dollar\\back"]  # keys JSON paths and Mongo must take literally
        base = us(time.time())
        claims = [
            HeldClaim(name, tokens[name], FireClaim.new(f"{job}-{i}", base + i * 10 + k))
            for i, name in enumerate(names)
            for k, job in enumerate(jobs)
        ]
        assert len(claims) == 200
        store.claim_many(A, [HeldClaim("not-held", 1, FireClaim.new("warm-up", 1))])  # loads a Redis script once
        ctx.wait_stale(0.2)  # let the heartbeats age, to see them renewed
        sent.clear()
        result = store.claim_many(A, claims)
        trips = list(sent)
    assert result == BatchClaimResult(frozenset(names), frozenset(c.claim.nonce for c in claims))
    if ctx.kind == "memory":
        assert trips == [], "in-process: nothing to count"
    else:
        assert trips == ROUND_TRIPS[ctx.kind], f"{ctx.kind}: {trips}"
    records = store.read_many(names)
    for i, name in enumerate(names):
        rec = records[name]
        assert rec.holder == A.node_id and rec.token == tokens[name] and rec.active_ip == A.ip
        assert rec.ttl == pytest.approx(60)
        assert rec.heartbeat_age is not None and rec.heartbeat_age < 0.15, f"{name}: lease not renewed ({rec.heartbeat_age})"
        assert rec.fire_times == {f"{job}-{i}": at(base + i * 10 + k) for k, job in enumerate(jobs)}
    assert dict(records["group-07"].attrs) == {"cursor": 7}, "attrs are kept"


@KINDS
def test_a_fire_time_that_already_ran_is_refused_while_the_others_win(ctx: StoreCtx) -> None:
    store = ctx.make()
    first = FireClaim.new("tick", 2_000_000)
    got = store.acquire_or_renew("g", A, ttl=60, claim=first)
    assert got.claimed
    later = FireClaim.new("report", 5_000_000)
    assert store.acquire_or_renew("g", A, ttl=60, claim=later).claimed
    token = got.token
    h_token = held(store, ["h"])["h"]
    same = FireClaim.new("tick", 2_000_000)  # equal: this fire time already ran
    older = FireClaim.new("report", 4_000_000)  # older than the stored one
    new_job = FireClaim.new("fresh", 1_000_000)
    other_lock = FireClaim.new("tick", 1_500_000)  # fire times are per lock: "tick" on h is a job of its own
    batch = [HeldClaim("g", token, c) for c in (same, older, new_job)] + [HeldClaim("h", h_token, other_lock)]
    result = store.claim_many(A, batch)
    assert result.renewed == {"g", "h"}
    assert result.won == {new_job.nonce, other_lock.nonce}
    # Issue 32, C5: each refused claim names the claim that beat it (a diagnosis of who wrote it).
    assert dict(result.lost_to) == {same.nonce: first.nonce, older.nonce: later.nonce}
    beaten = store.acquire_or_renew("g", A, ttl=60, claim=FireClaim.new("report", 4_500_000))
    assert not beaten.claimed and beaten.claimed_by == later.nonce and got.claimed_by == first.nonce
    rec = store.read("g")
    assert rec is not None and rec.fire_times == {"tick": at(2_000_000), "report": at(5_000_000), "fresh": at(1_000_000)}
    # The refused ones left the stored claims as they were: a retry of the winners' claims (same
    # nonces) finds them theirs, the losers' are still not.
    retry = store.claim_many(A, [HeldClaim("g", token, c) for c in (first, later, same, older)])
    assert retry.renewed == {"g"} and retry.won == {first.nonce, later.nonce}


@KINDS
def test_two_claims_for_one_job_in_one_call_the_greater_fire_time_wins(ctx: StoreCtx) -> None:
    store = ctx.make()
    token = held(store, ["dup"])["dup"]
    small, big, middle = (FireClaim("job", t, secrets.token_hex(8)) for t in (3_000_000, 5_000_000, 4_000_000))
    tie_first, tie_second = FireClaim("other", 7_000_000, "tie-first"), FireClaim("other", 7_000_000, "tie-second")
    result = store.claim_many(A, [HeldClaim("dup", token, c) for c in (small, big, middle, tie_first, tie_second)])
    assert result.won == {big.nonce, tie_first.nonce}, "the greater fire time; of equal ones, the first"
    rec = store.read("dup")
    assert rec is not None and rec.fire_times == {"job": at(5_000_000), "other": at(7_000_000)}


@KINDS
def test_a_lease_lost_between_batches_refuses_that_lock_only(ctx: StoreCtx) -> None:
    a, b = ctx.make(), ctx.make()
    tokens = held(a, ["x", "y", "z"], ttl=TTL)
    jobs = {name: [f"{name}-1", f"{name}-2"] for name in tokens}
    first = [HeldClaim(n, t, FireClaim.new(job, 1_000_000)) for n, t in tokens.items() for job in jobs[n]]
    assert a.claim_many(A, first).won == {c.claim.nonce for c in first}
    ctx.wait_stale(TTL)
    took = b.acquire_or_renew("y", B, ttl=60, claim=FireClaim.new("y-1", 2_000_000))
    assert took.acquired and took.claimed and took.token == tokens["y"] + 1
    ctx.wait_stale(0.1)  # B's heartbeat ages: a renewal by A would show
    before = b.read("y")
    second = [HeldClaim(n, t, FireClaim.new(job, 2_000_000 + k)) for n, t in tokens.items() for k, job in enumerate(jobs[n])]
    result = a.claim_many(A, second)
    # x and z are stale by the store's clock but still name A with its token: renewed, as by renew_many.
    assert result.renewed == {"x", "z"}
    assert result.won == {c.claim.nonce for c in second if c.lock != "y"}
    after = b.read("y")
    assert after is not None and before is not None
    assert (after.holder, after.token, after.fire_times) == (B.node_id, tokens["y"] + 1, before.fire_times)
    assert after.fire_times == {"y-1": at(2_000_000), "y-2": at(1_000_000)}, "A wrote nothing on the lock it lost"
    assert after.heartbeat_age >= before.heartbeat_age > 0.1, "nor renewed it"  # type: ignore[operator]
    for name in ("x", "z"):
        rec = a.read(name)
        assert rec is not None and rec.state == "active" and rec.fire_times[f"{name}-2"] == at(2_000_001)
    # A lock released, a wrong token, a lock that does not exist: refused, untouched, not created.
    assert a.release("z", A, tokens["z"])
    z_before = a.read("z")
    refused = a.claim_many(
        A,
        [
            HeldClaim("z", tokens["z"], FireClaim.new("z-1", 9_000_000)),
            HeldClaim("x", tokens["x"] + 5, FireClaim.new("x-1", 9_000_000)),
            HeldClaim("ghost", 1, FireClaim.new("g", 9_000_000)),
        ],
    )
    assert refused == BatchClaimResult()
    z_after = a.read("z")
    assert z_after is not None and z_before is not None
    assert (z_after.holder, z_after.fire_times, z_after.ttl) == (None, z_before.fire_times, z_before.ttl)
    assert a.read("x").fire_times["x-1"] == at(2_000_000)  # type: ignore[union-attr]
    assert a.read("ghost") is None


@KINDS
def test_nothing_to_claim_sends_nothing_and_one_lock_with_two_tokens_is_refused(
    ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch
) -> None:
    with counted(ctx, monkeypatch) as (store, sent):
        token = held(store, ["one"])["one"]
        sent.clear()
        assert store.claim_many(A, []) == BatchClaimResult()
        two_tokens = [HeldClaim("one", token, FireClaim.new("a", 1)), HeldClaim("one", token + 1, FireClaim.new("b", 1))]
        with pytest.raises(ValueError, match="tokens"):  # nothing is sent
            store.claim_many(A, two_tokens)
        assert sent == []


@KINDS
def test_a_concurrent_writer_is_waited_for_and_its_result_judged(ctx: StoreCtx) -> None:
    """An open transaction holds the row: claim_many waits, then judges the row it left (SQL only).

    Redis (one script), MongoDB (one document write per lock) and memory (one mutex) cannot be
    interleaved inside one lock's part; SQL can, and must re-read the row it waits for.
    """
    if ctx.kind not in SQL_KINDS:
        pytest.skip(f"{ctx.kind}: each lock's part is one indivisible step (script, document write, mutex)")
    store: Any = ctx.make()
    tokens = held(store, ["w", "v"])
    mine = FireClaim.new("job", 5_000_000)
    other = FireClaim.new("free", 5_000_000)
    # What the other session writes to "w": it claims "job" at the same fire time first, then it
    # takes "w" over. Either way claim_many must not write "w"; it still renews "v" and claims there.
    for what in ("fires", "takeover"):
        mine, other = FireClaim.new("job", mine.fire_us + 1), FireClaim.new("free", other.fire_us + 1)
        stored = f'{{"job": [{mine.fire_us}, "theirs"]}}'
        job_before = store.read("w").fire_times.get("job")
        sets = {"fires": "fires = :fires", "takeover": "holder = 'someone', token = token + 1"}[what]
        update = sqlalchemy.text(f"UPDATE {store.table} SET {sets} WHERE name = 'w'")
        outcome: list[Any] = []
        with store.engine.connect() as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if ctx.kind == "sqlite" else "START TRANSACTION")
            conn.execute(update, {"fires": stored})
            batch = [HeldClaim("w", tokens["w"], mine), HeldClaim("v", tokens["v"], other)]
            worker = threading.Thread(target=lambda: outcome.append(_or_error(lambda: store.claim_many(A, batch))))
            worker.start()
            time.sleep(0.5)
            assert worker.is_alive(), f"claim_many did not wait for the open transaction: {outcome}"
            conn.exec_driver_sql("COMMIT")
        worker.join(timeout=30)
        if isinstance(outcome[0], StoreUnavailableError):  # contention may be reported as such, never as a result
            assert ctx.kind == "sqlite", outcome[0]
            continue
        renewed = {"w", "v"} if what == "fires" else {"v"}
        assert outcome[0] == BatchClaimResult(frozenset(renewed), frozenset({other.nonce})), what
        rec = store.read("w")
        assert rec is not None
        assert rec.fire_times["job"] == (at(mine.fire_us) if what == "fires" else job_before), "only the other session wrote"


def _or_error(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except StoreUnavailableError as exc:
        return exc


# -- the race -----------------------------------------------------------------------------------------
@KINDS
def test_one_winner_per_fire_time_racing_claim_many_and_acquire(ctx: StoreCtx) -> None:
    """4 racers x 500 rounds: two racers share one node (same holder), two are nodes of their own.

    Every round each racer claims every job of 3 locks at that round's fire time: ``acquire_or_renew``
    with a claim on the locks it does not hold, then one ``claim_many`` on those it holds (with
    tokens that may be stale). Leases are short and nodes stall now and then, so locks change
    hands across nodes while the old holder's claim_many is in flight. Real processes on server
    stores; threads (and the injected clock) on the in-process ones.
    """
    rounds, prefix = 500, secrets.token_hex(3)
    node_ids = ["same-node:1:aaaa", "same-node:1:aaaa", "node-y:2:bbbb", "node-z:3:cccc"]
    if ctx.in_process:
        ttl = 1.0
        clock = ctx.clock
        assert clock is not None
        outcomes = _race_threads(ctx, node_ids, prefix, rounds, ttl, lambda s: clock.advance(s))
    else:
        ttl = 0.05
        outcomes = _race_processes(ctx.url or "", ctx.kind, node_ids, prefix, rounds, ttl)
    winners: dict[tuple[str, str, int], list[int]] = {}
    for i, outcome in enumerate(outcomes):
        for lock, job, r, _nonce in outcome["won"]:
            winners.setdefault((lock, job, r), []).append(i)
    doubled = {key: who for key, who in winners.items() if len(who) > 1}
    assert not doubled, f"fire times claimed twice: {list(doubled.items())[:5]}"
    expected = {(f"{prefix}-{lock}", job, r) for lock in workers.RACE_LOCKS for job in workers.RACE_JOBS for r in range(rounds)}
    missing = expected - winners.keys()
    errors = sum(o["errors"] for o in outcomes)
    claim_errors = sum(o["claim_errors"] for o in outcomes)
    store = ctx.make()
    records = store.read_many([f"{prefix}-{lock}" for lock in workers.RACE_LOCKS])
    changes = sum(rec.token - 1 for rec in records.values())
    lost = sum(o["lost"] for o in outcomes)
    print(f"\n{ctx.kind}: {len(winners)} fire times won once, {len(missing)} unclaimed, {changes} changes of holder, "
          f"{lost} locks claim_many found lost, {errors} uncertain outcomes ({claim_errors} of claim_many)")
    assert changes >= 10 and lost >= 10, f"not a race: {changes} changes of holder, {lost} lost locks seen by claim_many"
    # A fire time goes unclaimed, rightly, in a round where its lock's holder stalled past its lease
    # after the other racers had tried it (refused: the lease was live then): its claim_many found
    # the lock lost, and nobody held it to claim. Any other unclaimed one needs an uncertain outcome.
    lapsed = {(lock, r) for o in outcomes for lock, r in o["lost_rounds"]}
    unexplained = sorted(m for m in missing if (m[0], m[2]) not in lapsed)
    assert len(unexplained) <= 9 * errors, f"unclaimed fire times without a lapse or an uncertain outcome: {unexplained[:5]}"
    # The last fire time of each job is stored with its one winner's nonce: claiming it again with
    # that nonce, as the holder, finds it ours (and only that one).
    nonces = {(lock, job, r): nonce for o in outcomes for lock, job, r, nonce in o["won"]}
    for name, rec in records.items():
        last = {job: max(r for (lock, j, r) in winners if lock == name and j == job) for job in workers.RACE_JOBS}
        assert rec.fire_times == {job: at(workers.RACE_BASE_US + r * 1000) for job, r in last.items()}
        again = [
            HeldClaim(name, rec.token, FireClaim(job, workers.RACE_BASE_US + r * 1000, nonces[name, job, r]))
            for job, r in last.items()
        ]
        assert store.claim_many(Node(rec.holder or "", "-"), again) == BatchClaimResult(
            frozenset({name}), frozenset(c.claim.nonce for c in again)
        )


def _race_processes(url: str, kind: str, node_ids: list[str], prefix: str, rounds: int, ttl: float) -> list[dict[str, Any]]:
    mp = multiprocessing.get_context("spawn")
    barrier, results = mp.Barrier(len(node_ids)), mp.Queue()
    variant = "mysql8" if kind == "mysql8" else ""
    procs = [
        mp.Process(target=workers.claim_race_process, args=(url, variant, node_id, prefix, rounds, ttl, barrier, results, i))
        for i, node_id in enumerate(node_ids)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failed = [o["error"] for o in got.values() if "error" in o]
    assert not failed, failed
    return [got[i] for i in range(len(node_ids))]


def _race_threads(
    ctx: StoreCtx, node_ids: list[str], prefix: str, rounds: int, ttl: float, stall: Callable[[float], None]
) -> list[dict[str, Any]]:
    barrier = threading.Barrier(len(node_ids))
    stores = [ctx.make() for _ in node_ids]
    got: dict[int, dict[str, Any]] = {}

    def run(i: int) -> None:
        try:
            got[i] = workers.claim_race(stores[i], Node(node_ids[i], "127.0.0.1"), prefix, rounds, ttl, barrier, stall, i, 0.0005)
        except BaseException as exc:
            barrier.abort()
            got[i] = {"error": repr(exc)}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(node_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [o["error"] for o in got.values() if "error" in o]
    assert not failed, failed
    return [got[i] for i in range(len(node_ids))]


# -- wrappers -----------------------------------------------------------------------------------------
def test_the_drill_timing_wrapper_times_claim_many(tmp_path: Path) -> None:
    inner = MemoryLockStore()
    timed = TimedLockStore(inner, tmp_path / "ops.jsonl", node_id="n1")
    try:
        token = timed.acquire_or_renew("t", A, 60).token
        claim = FireClaim.new("job", 1)
        assert timed.claim_many(A, [HeldClaim("t", token, claim)]) == BatchClaimResult(frozenset({"t"}), frozenset({claim.nonce}))
    finally:
        timed.close()
    assert '["claim_many",' in (tmp_path / "ops.jsonl").read_text()
