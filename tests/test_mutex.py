"""``Mutex``: a leased, fenced lock for any code, on every backend against real servers.

In-process stores (memory, mongomock) judge staleness by an injected clock: here it follows real
time (:func:`real_time`), so the same timing tests run everywhere. Tests that need other
processes run on the URL backends only. Waits are checked with an injected clock and sleep where
the assertion is about store calls and requested waits, not wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron import ConfigurationError, HeldLease, LeaseError, LockRecord, Mutex, MutexScheduler, StoreUnavailableError
from mutexcron.cli.main import main as cli_main
from mutexcron.locks import AcquireResult, BatchClaimResult, FireClaim, HeldClaim, LockStore, Node, Presence, RunInfo
from mutexcron.mutex.acquire import FIRST_BACKOFF, MAX_BACKOFF
from tests.backends import ALL_BACKENDS, FakeClock, StoreCtx, backend_params, open_backend
from tests.redis_servers import PrivateRedis

URL_BACKENDS = ("sqlite", "mysql", "postgresql", "redis")
every_backend = pytest.mark.parametrize("kind", backend_params(*ALL_BACKENDS))
url_backends = pytest.mark.parametrize("kind", backend_params(*URL_BACKENDS))
ROOT = Path(__file__).resolve().parents[1]


# -- helpers and fixtures ------------------------------------------------------------------------
@contextlib.contextmanager
def real_time(clock: FakeClock | None) -> Iterator[None]:
    """Make an in-process store's injected clock follow real time (no-op for real servers)."""
    if clock is None:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.wait(0.002):
            now = time.monotonic()
            clock.advance(now - last)
            last = now

    thread = threading.Thread(target=tick, name="real-time", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture
def ctx(kind: str, tmp_path: Path) -> Iterator[StoreCtx]:
    with open_backend(kind, tmp_path) as ctx, real_time(ctx.clock):
        yield ctx


@pytest.fixture
def new_mutex(ctx: StoreCtx) -> Iterator[Callable[..., Mutex]]:
    """Mutex objects on their own client of the test's store (as on separate machines)."""
    made: list[Mutex] = []

    def make(**kwargs: Any) -> Mutex:
        store = kwargs.pop("store", None) or ctx.make()
        mutex = Mutex(store=store, local_ip=f"10.0.0.{len(made) + 1}", **kwargs)
        made.append(mutex)
        return mutex

    yield make
    for mutex in made:
        mutex.close()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


class CountingStore(LockStore):
    """A real store behind a call counter.

    ``unknown_outcomes = n`` makes the next n acquires happen for real and then report
    ``uncertain`` (the write went through, the reply was lost): what a contended or timed-out
    write looks like to the caller.
    """

    def __init__(self, inner: LockStore) -> None:
        super().__init__(inner.url)
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.unknown_outcomes = 0

    def acquire_or_renew(self, name: str, node: Node, ttl: float, claim: FireClaim | None = None) -> AcquireResult:
        self.calls["acquire_or_renew"] += 1
        result = self.inner.acquire_or_renew(name, node, ttl, claim)
        if self.unknown_outcomes:
            self.unknown_outcomes -= 1
            return AcquireResult(False, result.record, uncertain=True)
        return result

    def hand_off(self, name: str, node: Node, token: int, attrs: Any = None, run: RunInfo | None = None) -> bool:
        self.calls["hand_off"] += 1
        return self.inner.hand_off(name, node, token, attrs, run)

    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        self.calls["renew_many"] += 1
        return self.inner.renew_many(node, leases, presence=presence)

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        self.calls["claim_many"] += 1
        return self.inner.claim_many(node, claims)

    def release(self, name: str, node: Node, token: int) -> bool:
        self.calls["release"] += 1
        return self.inner.release(name, node, token)

    def read(self, name: str) -> LockRecord | None:
        self.calls["read"] += 1
        return self.inner.read(name)

    def list(self) -> list[LockRecord]:
        return self.inner.list()

    def ping(self) -> None:
        self.inner.ping()


class FakeSleep:
    """An injected sleep: records each wait and moves the injected clock instead of sleeping."""

    def __init__(self, clock: FakeClock, after: Callable[[int], None] | None = None) -> None:
        self.clock, self.after, self.waits = clock, after, list[float]()

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.clock.advance(seconds)
        if self.after is not None:
            self.after(len(self.waits))


def assert_backoff(waits: list[float]) -> None:
    """Each wait is within the jittered envelope of its step: [ceiling/2, ceiling], ceiling doubling to the cap."""
    for step, wait in enumerate(waits[:-1]):
        ceiling = min(MAX_BACKOFF, FIRST_BACKOFF * 2**step)
        assert ceiling / 2 - 1e-9 <= wait <= ceiling + 1e-9, (step, wait, waits)
    assert waits and 0 < waits[-1] <= min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (len(waits) - 1)) + 1e-9


# -- holding and releasing -----------------------------------------------------------------------
@every_backend
def test_hold_takes_the_lock_with_a_token_and_releases_it_on_holder_and_token(
    ctx: StoreCtx, new_mutex: Callable[..., Mutex]
) -> None:
    a, b = new_mutex(), new_mutex()
    assert a.node_id != b.node_id, "two Mutex objects in one process are two holders"
    with a.hold("import-feed:abc", lease=30) as lease:
        assert lease and lease.acquired and lease.token == 1 and not lease.lost and lease.remaining > 29
        rec = b.store.read("import-feed:abc")
        assert rec is not None and rec.holder == a.node_id and rec.active_ip == "10.0.0.1" and rec.ttl == pytest.approx(30)
        with b.hold("import-feed:abc", lease=30) as other:
            assert not other and other.lost and other.record.holder == a.node_id and other.record.token == 1
            with pytest.raises(LeaseError, match="not acquired"):
                _ = other.token
        assert not lease.lost, "a refused rival changes nothing"
    assert lease.released is True and not lease.lost
    rec = b.store.read("import-feed:abc")
    assert rec is not None and rec.holder is None and rec.token == 1, "released; the token survives"
    with b.hold("import-feed:abc") as again:
        assert again.token == 2, "a new holder gets a higher token"


@every_backend
def test_holds_of_one_mutex_exclude_each_other_across_threads(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    mutex = new_mutex()
    got: dict[str, Any] = {}

    def try_once() -> None:
        with mutex.hold("x", lease=30) as second:
            got["second"], got["holder"] = bool(second), second.record.holder

    def wait_for_it() -> None:
        with mutex.hold("x", lease=30, wait=10) as third:
            got["third"] = third.token

    with mutex.hold("x", lease=30) as first:
        thread = threading.Thread(target=try_once)
        thread.start()
        thread.join()
        assert got == {"second": False, "holder": mutex.node_id}, "same holder id, but the store is not asked to renew"
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and "third" not in got
    waiter.join(10)
    assert got["third"] == first.token + 1


@every_backend
def test_a_block_that_raises_releases_and_the_exception_propagates(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    a, b = new_mutex(), new_mutex()
    with pytest.raises(ZeroDivisionError), a.hold("boom", lease=30) as lease:
        _ = 1 / 0
    assert lease.released is True
    rec = b.store.read("boom")
    assert rec is not None and rec.holder is None
    with b.hold("boom") as next_holder:
        assert next_holder, "free at once: no waiting for the lease to run out"


@every_backend
def test_a_block_that_outlives_its_lease_four_times_keeps_it(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    a, b = new_mutex(), new_mutex()
    rivals: list[bool] = []
    with a.hold("long", lease=0.5) as lease:
        token = lease.token
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            with b.hold("long", lease=0.5) as rival:
                rivals.append(bool(rival))
            time.sleep(0.1)
        rec = b.store.read("long")
        assert not lease.lost and lease.remaining > 0 and lease.token == token
        assert rec is not None and rec.holder == a.node_id and rec.token == token and rec.state == "active"
    assert len(rivals) >= 10 and not any(rivals), "no other holder got in while renewals ran"
    assert lease.released is True


@every_backend
def test_takeover_is_seen_by_the_renewer_on_lost_runs_once_and_the_release_spares_the_new_holder(
    ctx: StoreCtx, new_mutex: Callable[..., Mutex], caplog: pytest.LogCaptureFixture
) -> None:
    mutex = new_mutex()
    store = ctx.make()
    intruder = Node("intruder:1:abcdef", "10.9.9.9")
    calls: list[tuple[bool, str]] = []

    def steal(name: str, lease: HeldLease) -> None:
        # Someone with access to the store frees the lock and another node takes it.
        assert store.release(name, Node(mutex.node_id, "10.0.0.1"), lease.token)
        assert store.acquire_or_renew(name, intruder, 30).acquired

    with caplog.at_level(logging.WARNING, "mutexcron.mutex.lock"):
        with mutex.hold("t", lease=0.6, on_lost=lambda lost: calls.append((lost.lost, threading.current_thread().name))) as lease:
            steal("t", lease)
            wait_for(lambda: calls, timeout=3)
            assert lease.lost and "another holder" in (lease.lost_reason or "")
        assert calls == [(True, "mutexcron-on-lost")], "called once, on a thread of its own"
        assert lease.released is False
        rec = store.read("t")
        assert rec is not None and rec.holder == intruder.node_id and rec.token == lease.token + 1
    assert "was lost during the block" in caplog.text

    with pytest.raises(LeaseError, match="lost during the block"), mutex.hold("t2", lease=0.6, strict=True) as strict:
        steal("t2", strict)
        wait_for(lambda: strict.lost, timeout=3)
    rec = store.read("t2")
    assert rec is not None and rec.holder == intruder.node_id


@every_backend
def test_no_renewal_for_a_whole_lease_by_the_monotonic_clock_is_a_loss(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    clock = FakeClock()
    mutex = new_mutex(clock=clock)
    lost: list[str] = []
    with mutex.hold("frozen", lease=5, on_lost=lambda gone: lost.append(gone.lost_reason or "")) as lease:
        clock.advance(4.9)
        assert not lease.lost
        clock.advance(0.1)  # as if every renewal had failed for a whole lease (or this process had paused)
        assert lease.lost and lease.remaining == 0 and "no successful renewal" in (lease.lost_reason or "")
        wait_for(lambda: lost, timeout=3)
        clock.advance(-100)  # a late renewal reply cannot bring it back: lost is sticky
        assert lease.lost
    assert lost and "no successful renewal" in lost[0]
    rec = mutex.store.read("frozen")
    assert lease.released is True and rec is not None and rec.holder is None, "nobody took it, so ours to release"


# -- waiting ---------------------------------------------------------------------------------------
@every_backend
def test_wait_retries_with_bounded_jittered_backoff_one_store_call_per_step(
    ctx: StoreCtx, new_mutex: Callable[..., Mutex]
) -> None:
    clock = FakeClock()
    sleep = FakeSleep(clock)
    store = CountingStore(ctx.make())
    holder, waiter = new_mutex(), new_mutex(store=store, clock=clock, sleep=sleep)
    with holder.hold("w", lease=30), waiter.hold("w", lease=30, wait=5.0) as got:
        assert not got and got.record.holder == holder.node_id
    assert store.calls["acquire_or_renew"] == len(sleep.waits) + 1, "one store call per step, plus the first"
    assert sum(sleep.waits) == pytest.approx(5.0), "the last wait ends at the deadline"
    assert_backoff(sleep.waits)
    # No spinning: 7 doubling steps (at least 0.635 s in all), then at least 0.5 s per step.
    assert len(sleep.waits) <= 7 + math.ceil((5.0 - 0.635) / 0.5)
    assert store.calls["read"] == 0 and store.calls["release"] == 0

    store.calls.clear()
    with holder.hold("w2", lease=30), waiter.hold("w2", lease=30, wait=False) as once:
        assert not once
    assert store.calls == Counter(acquire_or_renew=1), "wait=False: one try, no sleep"


@every_backend
def test_wait_none_waits_until_the_holder_releases(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    clock = FakeClock()
    held = contextlib.ExitStack()
    sleep = FakeSleep(clock, after=lambda n: held.close() if n == 6 else None)
    store = CountingStore(ctx.make())
    holder, waiter = new_mutex(), new_mutex(store=store, clock=clock, sleep=sleep)
    first = held.enter_context(holder.hold("q", lease=30))
    with waiter.hold("q", lease=30, wait=None) as got:
        assert got and got.token == first.token + 1
    assert store.calls["acquire_or_renew"] == 7 and len(sleep.waits) == 6
    assert_backoff(sleep.waits)


@every_backend
def test_an_uncertain_answer_counts_as_not_acquired_and_is_retried(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    clock = FakeClock()
    sleep = FakeSleep(clock)
    store = CountingStore(ctx.make())
    waiter = new_mutex(store=store, clock=clock, sleep=sleep)
    store.unknown_outcomes = 2
    with waiter.hold("u", lease=30, wait=1.0) as got:
        assert got and got.token == 1, "the unknown write had gone through: the retry renews it, same token"
    assert store.calls["acquire_or_renew"] == 3 and len(sleep.waits) == 2
    store.unknown_outcomes = 1
    with waiter.hold("u2", lease=30, wait=False) as once:
        assert not once


@every_backend
def test_the_first_waits_stop_at_the_dead_holders_lease_end(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    dead = Node("dead:1:000000", "10.6.6.6")
    assert ctx.make().acquire_or_renew("d", dead, ttl=1.0).acquired  # and never renews
    lease_end = time.monotonic() + 1.0  # at or after the end by the store's clock: stamped before this reply
    sleeps: list[tuple[float, float]] = []

    def sleep(seconds: float) -> None:
        sleeps.append((time.monotonic(), seconds))
        time.sleep(seconds)

    waiter = new_mutex(sleep=sleep)
    started = time.monotonic()
    with waiter.hold("d", lease=30, wait=10) as got:
        took = time.monotonic() - started
        assert got and got.token == 2
    overshoot = [round(start + seconds - lease_end, 3) for start, seconds in sleeps if start < lease_end]
    # Backoff alone would sleep up to ~0.9 s past it here (0.005 + ... + 0.32, then up to 1 s).
    # (0.1 s of slack for scheduling between the store's reply and the sleep, on a loaded machine.)
    assert max(overshoot) <= 0.1, f"no wait runs past the holder's lease end (store clock): {overshoot}"
    assert took < 1.25 and len(sleeps) <= 10, (took, sleeps)


# -- the store goes away ---------------------------------------------------------------------------
@pytest.mark.redis
def test_store_killed_lease_lost_within_the_lease_and_waiters_raise_after_their_deadline(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    server: PrivateRedis = request.getfixturevalue("private_redis")  # by name: redis-server starts only here
    holder = Mutex(server.url, local_ip="10.0.0.1")
    clock = FakeClock()
    sleep = FakeSleep(clock)
    waiter = Mutex(server.url, local_ip="10.0.0.2", clock=clock, sleep=sleep)
    lost_at: list[float] = []
    try:
        with caplog.at_level(logging.WARNING, "mutexcron.mutex.lock"):
            with holder.hold("x", lease=1.0, on_lost=lambda _: lost_at.append(time.monotonic())) as lease:
                time.sleep(0.5)  # a few renewals
                server.kill()
                killed = time.monotonic()
                wait_for(lambda: lease.lost, timeout=5)
                seen = time.monotonic() - killed
                with pytest.raises(StoreUnavailableError, match="unreachable"), waiter.hold("x", lease=1, wait=0.5):
                    pass
                wait_for(lambda: lost_at, timeout=2)
            assert 0.6 <= seen <= 1.2, f"lost one lease after the last renewal that got through ({seen:.2f}s)"
            assert lost_at[0] - killed <= 1.3, "on_lost comes on time even though no store call succeeds"
            assert lease.released is False
        assert "was lost during the block" in caplog.text and "could not release" in caplog.text
        assert sum(sleep.waits) == pytest.approx(0.5) and len(sleep.waits) >= 3, "kept retrying until the deadline"
    finally:
        holder.close()
        waiter.close()


# -- other processes -------------------------------------------------------------------------------
COUNTER_CHILD = """
import os, sys, time
from mutexcron import Mutex
url, name, counter, marker, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
mutex, overlaps = Mutex(url), 0
for _ in range(rounds):
    with mutex.hold(name, lease=10, wait=None):
        try:  # a second holder inside the block would find the marker there
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            mine = True
        except FileExistsError:
            overlaps, mine = overlaps + 1, False
        with open(counter) as f:
            value = int(f.read() or 0)
        time.sleep(0.002)  # widen the read-modify-write window
        with open(counter, "w") as f:
            f.write(str(value + 1))
        if mine:
            os.unlink(marker)
print(overlaps)
"""


@url_backends
def test_processes_holding_with_wait_none_never_overlap_and_count_exactly(ctx: StoreCtx, tmp_path: Path) -> None:
    procs, rounds = 4, 25
    counter, marker = tmp_path / "counter", tmp_path / "inside"
    counter.write_text("0")
    assert ctx.url is not None
    args = [ctx.url, f"counter-{secrets.token_hex(3)}", str(counter), str(marker), str(rounds)]
    children = [
        subprocess.Popen([sys.executable, "-c", COUNTER_CHILD, *args], stdout=subprocess.PIPE, cwd=ROOT) for _ in range(procs)
    ]
    overlaps = [int(child.communicate(timeout=240)[0]) for child in children]
    assert [child.returncode for child in children] == [0] * procs
    assert overlaps == [0] * procs
    assert int(counter.read_text()) == procs * rounds


FROZEN_CHILD = """
import json, sys
from mutexcron import Mutex
mutex = Mutex(sys.argv[1])
with mutex.hold(sys.argv[2], lease=1.0) as lease:
    print(json.dumps({"token": lease.token, "node": mutex.node_id}), flush=True)
    sys.stdin.readline()  # frozen here by SIGSTOP; the parent writes a line after SIGCONT
    lost, reason = lease.lost, lease.lost_reason
print(json.dumps({"lost": lost, "reason": reason, "released": lease.released}), flush=True)
"""


@url_backends
def test_a_frozen_holder_loses_its_lease_and_its_release_spares_the_new_holder(
    ctx: StoreCtx, new_mutex: Callable[..., Mutex]
) -> None:
    assert ctx.url is not None
    child = subprocess.Popen(
        [sys.executable, "-c", FROZEN_CHILD, ctx.url, "frozen"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        first = json.loads(child.stdout.readline())
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(1.5)  # past the frozen holder's lease, by the store's clock
        taker = new_mutex()
        with taker.hold("frozen", lease=30, wait=5) as taken:
            assert taken and taken.token == first["token"] + 1
            os.kill(child.pid, signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            report = json.loads(child.stdout.readline())
            assert child.wait(timeout=30) == 0
            rec = taker.store.read("frozen")
            assert report["lost"] is True and report["released"] is False, report
            assert rec is not None and rec.holder == taker.node_id and rec.token == taken.token, "untouched"
            assert not taken.lost
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()


def _forked_hold(mutex: Mutex, barrier: Any, out: Any) -> None:
    with mutex.hold("shared", lease=10) as lease:
        out.put((mutex.node_id, bool(lease)))
        barrier.wait(timeout=20)  # both children have tried before either lets go


@url_backends
def test_children_forked_from_one_mutex_are_different_holders(ctx: StoreCtx) -> None:
    assert ctx.url is not None
    mutex = Mutex(ctx.url, local_ip="10.0.0.1")
    try:
        with mutex.hold("warm-up", lease=5):  # connections and a renewer exist before the fork, as in a Celery master
            pass
        mp = multiprocessing.get_context("fork")
        barrier, out = mp.Barrier(2), mp.Queue()
        children = [mp.Process(target=_forked_hold, args=(mutex, barrier, out)) for _ in range(2)]
        for child in children:
            child.start()
        results = [out.get(timeout=30) for _ in children]
        for child in children:
            child.join(30)
        assert [child.exitcode for child in children] == [0, 0]
        ids = {node for node, _ in results}
        assert len(ids) == 2 and mutex.node_id not in ids, "each child has its own holder id"
        assert sorted(got for _, got in results) == [False, True], "exactly one child held the lock"
    finally:
        mutex.close()


# -- shared with the scheduler and the CLI -------------------------------------------------------
@every_backend
def test_a_cron_job_and_a_mutex_on_the_same_name_exclude_each_other(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    mutex = new_mutex()
    sched = MutexScheduler(lock_store=ctx.make(), node_id="sched-node", local_ip="10.0.0.9", unactive_interval=1.0)
    runs: list[int] = []
    refused: list[LockRecord] = []

    @sched.mutex(lock="nightly-report", lock_else=refused.append)
    @sched.interval_schedule(seconds=0.2)
    def report() -> None:
        runs.append(1)

    try:
        with mutex.hold("nightly-report", lease=1.0) as lease:
            sched.start()
            time.sleep(1.5)
            assert lease and not lease.lost
            assert not runs, "the cron job never ran while the Mutex held its lock"
            assert refused and refused[-1].holder == mutex.node_id
        wait_for(lambda: runs, timeout=5)
        with mutex.hold("nightly-report", lease=1.0) as refused_mutex:
            assert not refused_mutex and refused_mutex.record.holder == "sched-node"
    finally:
        sched.shutdown()
    with mutex.hold("nightly-report", lease=1.0) as after:
        assert after and after.token > lease.token, "the scheduler released it on shutdown"


@url_backends
def test_status_lists_mutex_locks_like_any_other(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    mutex = new_mutex()
    with mutex.hold("import-feed:1f2e", lease=45) as lease:
        result = CliRunner().invoke(cli_main, ["status", "--lock-url", str(ctx.url), "--json"])
        text = CliRunner().invoke(cli_main, ["status", "--lock-url", str(ctx.url)]).output
    assert result.exit_code == 0, result.output
    (lock,) = [r for r in json.loads(result.output)["locks"] if r["name"] == "import-feed:1f2e"]
    assert (lock["holder"], lock["state"], lock["token"], lock["ttl"]) == (mutex.node_id, "active", lease.token, 45)
    assert "import-feed:1f2e" in text and mutex.node_id in text


# -- asyncio ---------------------------------------------------------------------------------------
@every_backend
def test_async_hold_keeps_its_lease_while_the_loop_is_blocked(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    a, b = new_mutex(), new_mutex()
    rivals: list[bool] = []

    def rival() -> None:
        end = time.monotonic() + 1.8
        while time.monotonic() < end:
            with b.hold("aio", lease=0.5) as other:
                rivals.append(bool(other))
            time.sleep(0.1)

    async def main() -> tuple[HeldLease, int, LockRecord | None]:
        async with a.hold_async("aio", lease=0.5) as lease:
            token = lease.token
            thread = threading.Thread(target=rival)
            thread.start()
            time.sleep(2.0)  # blocks the event loop for four leases
            thread.join()
            assert not lease.lost and lease.token == token
            return lease, token, await asyncio.to_thread(b.store.read, "aio")

    lease, token, rec = asyncio.run(main())
    assert rec is not None and rec.holder == a.node_id and rec.token == token and rec.state == "active"
    assert len(rivals) >= 8 and not any(rivals)
    assert lease.released is True


@every_backend
def test_async_loss_is_seen_while_the_loop_is_blocked(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    mutex = new_mutex()
    store = ctx.make()
    lost_during_block: list[bool] = []

    async def main() -> HeldLease:
        async with mutex.hold_async("aio-lost", lease=0.6, on_lost=lambda _: lost_during_block.append(True)) as lease:
            assert store.release("aio-lost", Node(mutex.node_id, "10.0.0.1"), lease.token)
            assert store.acquire_or_renew("aio-lost", Node("other:2:222222", "10.0.0.8"), 30).acquired
            time.sleep(1.0)  # the loop is blocked: only the renewer thread can notice
            assert lost_during_block == [True] and lease.lost
            return lease

    lease = asyncio.run(main())
    rec = store.read("aio-lost")
    assert lease.released is False and rec is not None and rec.holder == "other:2:222222"


@every_backend
def test_async_wait_leaves_the_loop_free_and_cancelling_leaks_nothing(
    ctx: StoreCtx, new_mutex: Callable[..., Mutex]
) -> None:
    a, b = new_mutex(), new_mutex()
    inside, leave = threading.Event(), threading.Event()

    def hold_for_a_while() -> None:
        with a.hold("aw", lease=30):
            inside.set()
            leave.wait(10)

    async def main() -> tuple[int, float, bool]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        # A waiter cancelled mid-wait leaves no lock and no reservation behind.
        cancelled = asyncio.create_task(b.hold_async("aw", lease=30, wait=None).__aenter__())
        await asyncio.sleep(0.2)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        asyncio.get_running_loop().call_later(0.5, leave.set)
        started, ticks_before = time.monotonic(), ticks
        async with b.hold_async("aw", lease=30, wait=5) as got:
            waited = time.monotonic() - started
            tick_task.cancel()
            return ticks - ticks_before, waited, bool(got)

    thread = threading.Thread(target=hold_for_a_while)
    thread.start()
    assert inside.wait(10)
    ticks, waited, got = asyncio.run(main())
    thread.join()
    assert got and 0.4 < waited < 2.5
    assert ticks >= 20, f"the loop ran other coroutines while the hold waited ({ticks} ticks of 10 ms in {waited:.2f}s)"
    rec = b.store.read("aw")
    assert rec is not None and rec.holder is None


@every_backend
def test_cancelling_an_async_block_releases_the_lock(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    a, b = new_mutex(), new_mutex()

    async def main() -> None:
        async def work() -> None:
            async with a.hold_async("c", lease=30):
                await asyncio.sleep(30)

        task = asyncio.create_task(work())
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    with b.hold("c") as got:
        assert got, "released when the task was cancelled"


@pytest.mark.memory
def test_an_async_caller_cancelled_while_its_acquire_is_in_flight_leaves_no_lock_behind() -> None:
    url = f"memory://mutex-{secrets.token_hex(3)}"
    a, b = Mutex(url), Mutex(url)
    entered, gate = threading.Event(), threading.Event()
    acquire = a.store.acquire_or_renew

    def slow_acquire(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(10)
        return acquire(*args, **kwargs)

    a.store.acquire_or_renew = slow_acquire  # type: ignore[method-assign]

    async def main() -> None:
        async def work() -> None:
            async with a.hold_async("c", lease=30):
                await asyncio.sleep(30)

        task = asyncio.create_task(work())
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()  # the store call is in flight: it acquires for nobody
        gate.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())  # waits for the executor: the acquire and its undo have ended
    with b.hold("c") as got:
        assert got, f"the lock acquired for the cancelled caller was not released: {got!r}"


# -- the decorator and argument errors ---------------------------------------------------------------
@pytest.mark.memory
def test_exclusive_fills_the_name_from_the_call_and_runs_under_the_lock() -> None:
    url = f"memory://mutex-{secrets.token_hex(3)}"
    mutex, rival = Mutex(url), Mutex(url)

    @mutex.exclusive("import-feed:{url}:{feed.kind}", lease=30)
    def import_feed(url: str, feed: Any, *, force: bool = False) -> str | None:
        rec = mutex.store.read(f"import-feed:{url}:{feed.kind}")
        return rec.holder if rec is not None else None

    @mutex.exclusive("a-import:{url}", lease=30, lock_else=lambda rec: f"busy: {rec.holder}")
    async def import_async(url: str) -> str:
        await asyncio.sleep(0)
        return "imported"

    feed = type("Feed", (), {"kind": "rss"})()
    assert import_feed("http://x", feed) == mutex.node_id, "the block runs holding the filled-in name"
    assert import_feed.__name__ == "import_feed"
    with rival.hold("import-feed:http://x:rss"):
        assert import_feed("http://x", feed=feed) is None, "not acquired: not run"
    assert asyncio.run(import_async("u")) == "imported"
    with rival.hold("a-import:u"):
        assert asyncio.run(import_async(url="u")) == f"busy: {rival.node_id}"


@pytest.mark.memory
def test_exclusive_template_errors_are_configuration_errors() -> None:
    mutex = Mutex("memory://")
    with pytest.raises(ConfigurationError, match=r"\{feed_url\}.*no argument 'feed_url'"):

        @mutex.exclusive("import:{feed_url}")
        def by_url(url: str) -> None: ...

    with pytest.raises(ConfigurationError, match="name each field after an argument"):
        mutex.exclusive("import:{0}")(lambda url: None)
    with pytest.raises(ConfigurationError, match="lease"):
        mutex.exclusive("import:{url}", lease=0)

    @mutex.exclusive("import:{feed}")
    def loose(**kwargs: Any) -> str:
        return "ran"

    assert loose(feed="f") == "ran"
    with pytest.raises(ConfigurationError, match=r"gives no value for \{feed\}"):
        loose(url="u")
    with pytest.raises(ConfigurationError, match="191"):
        loose(feed="f" * 200)


@pytest.mark.memory
@pytest.mark.parametrize("name", ["", "x" * 192, "a\nb", "tab\there", None, 42])
def test_bad_lock_names_are_configuration_errors(name: Any) -> None:
    with pytest.raises(ConfigurationError, match="lock name"), Mutex("memory://").hold(name):
        pass


@pytest.mark.memory
@pytest.mark.parametrize(
    ("lease", "wait"), [(0, False), (-1, False), ("10", False), (True, False), (float("nan"), False), (10, -1), (10, True)]
)
def test_bad_lease_or_wait_is_a_configuration_error(lease: Any, wait: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"lease|wait"), Mutex("memory://").hold("x", lease=lease, wait=wait):
        pass


@pytest.mark.memory
def test_defaults_url_from_the_environment_and_closed_mutex_refuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MUTEXCRON_LOCK_URL", f"sqlite:///{tmp_path}/env.db")
    with Mutex() as mutex:
        assert mutex.url == f"sqlite:///{tmp_path}/env.db"
        with mutex.hold("x") as lease:
            assert lease
    with pytest.raises(LeaseError, match="closed"), mutex.hold("x"):
        pass
    with pytest.raises(ConfigurationError, match="unsupported lock URL"):
        Mutex("nosuch://x")


# -- issue 22: fork, a lost lease at entry, on_lost, the release deadline ---------------------------
def _in_forked_child(work: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``work()`` in a child forked from this process (as Celery's prefork pool does): its result, or what it raised."""
    mp = multiprocessing.get_context("fork")
    receiver, sender = mp.Pipe(duplex=False)

    def child() -> None:
        try:
            sender.send(("ok", work()))
        except BaseException as exc:  # reported to the parent
            sender.send(("raised", repr(exc)))

    process = mp.Process(target=child)
    process.start()
    try:
        assert receiver.poll(timeout), "the child did not answer"
        kind, value = receiver.recv()
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert kind == "ok", value
    return value


@pytest.mark.sqlite
def test_a_child_forked_while_a_parent_thread_writes_sqlite_takes_locks_at_once(tmp_path: Path) -> None:
    """A thread of the parent in the middle of a write at the fork: the child's writes do not wait
    for it (it does not exist there), through a new Mutex store or a store the parent built."""
    from mutexcron.backends.sql import write_mutex
    from mutexcron.locks.sql import SQLLockStore

    path = tmp_path / "fork.db"
    mutex = Mutex(f"sqlite:///{path}", local_ip="10.0.0.1")
    inherited = SQLLockStore(f"sqlite:///{path}")  # built and used before the fork, as a web app's master does
    inherited.read("x")
    parent_pool = id(inherited.backend.engine.pool)
    turn = write_mutex(str(path))
    in_write, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with turn.lock:
            in_write.set()
            leave.wait(60)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert in_write.wait(10)

        def child() -> tuple[bool, bool, bool, float]:
            started = time.monotonic()
            with mutex.hold("forked", lease=5) as lease:
                held = bool(lease)
            other = inherited.acquire_or_renew("other", Node("child:1:abcdef", "10.0.0.2"), 5).acquired
            return held, other, id(inherited.backend.engine.pool) != parent_pool, time.monotonic() - started

        held, other, new_pool, took = _in_forked_child(child)
        assert held and other, "the child's writes went through"
        assert new_pool, "the child does not share its parent's pooled connections"
        assert took < 3, f"the child waited {took:.1f}s for a turn held by a thread it does not have"
    finally:
        leave.set()
        thread.join(10)
        inherited.close()
        mutex.close()


@pytest.mark.sqlite
def test_a_child_forked_inside_a_hold_does_not_hold_the_parents_lock(tmp_path: Path) -> None:
    mutex = Mutex(f"sqlite:///{tmp_path}/inside.db", local_ip="10.0.0.1")
    try:
        with mutex.hold("parent", lease=30) as lease:

            def child() -> tuple[bool, bool | None, str | None]:
                with mutex.hold("child", lease=5) as mine:  # the child's own holds work
                    assert mine
                return lease.lost, lease.released, lease.lost_reason

            lost, released, reason = _in_forked_child(child)
            assert lost and released is None and "forked" in (reason or ""), "in the child, the parent's lease is not its own"
            assert not lease.lost, "the parent's lease is untouched"
            rec = mutex.store.read("parent")
            assert rec is not None and rec.holder == mutex.node_id and rec.token == lease.token
        assert lease.released is True
    finally:
        mutex.close()


class _BlockLoopAfterAcquire(CountingStore):
    """After a successful acquire, blocks the event loop for ``seconds`` before it can resume the waiter."""

    loop: asyncio.AbstractEventLoop | None = None
    seconds = 0.0

    def acquire_or_renew(self, name: str, node: Node, ttl: float, claim: FireClaim | None = None) -> AcquireResult:
        result = super().acquire_or_renew(name, node, ttl, claim)
        if result.acquired and self.loop is not None and self.seconds:
            self.loop.call_soon_threadsafe(time.sleep, self.seconds)
        return result


@pytest.mark.parametrize("kind", backend_params("memory", "sqlite"))
def test_async_lease_is_renewed_while_the_loop_is_blocked_right_after_the_acquire(
    ctx: StoreCtx, new_mutex: Callable[..., Mutex]
) -> None:
    store = _BlockLoopAfterAcquire(ctx.make())
    mutex = new_mutex(store=store)

    async def main() -> tuple[bool, str | None]:
        store.loop, store.seconds = asyncio.get_running_loop(), 1.5  # three leases
        async with mutex.hold_async("blocked", lease=0.5) as lease:
            return bool(lease) and not lease.lost, lease.lost_reason

    ok, reason = asyncio.run(main())
    assert ok, f"the body started with a lost lease: {reason}"


class _PausedAcquire(CountingStore):
    """Acquires, then moves the injected clock past the lease: a process paused right after its acquire."""

    def __init__(self, inner: LockStore, clock: FakeClock, pause: float) -> None:
        super().__init__(inner)
        self.clock, self.pause = clock, pause

    def acquire_or_renew(self, name: str, node: Node, ttl: float, claim: FireClaim | None = None) -> AcquireResult:
        result = super().acquire_or_renew(name, node, ttl, claim)
        self.clock.advance(self.pause)
        return result


@pytest.mark.memory
def test_exclusive_never_runs_the_function_with_a_lease_lost_before_it_starts() -> None:
    clock = FakeClock()
    mutex = Mutex(store=_PausedAcquire(Mutex("memory://").store, clock, pause=10), clock=clock)
    ran: list[str] = []

    @mutex.exclusive("paused", lease=5)
    def work() -> None:
        ran.append("sync")

    @mutex.exclusive("paused-async", lease=5)
    async def work_async() -> None:
        ran.append("async")

    with pytest.raises(LeaseError, match="lost before"):
        work()
    with pytest.raises(LeaseError, match="lost before"):
        asyncio.run(work_async())
    assert ran == []
    mutex.close()


@pytest.mark.memory
def test_exclusive_refuses_generators_and_guards_async_callable_objects() -> None:
    url = f"memory://mutex-{secrets.token_hex(3)}"
    mutex = Mutex(url)

    def numbers(n: int) -> Iterator[int]:
        yield from range(n)

    async def numbers_async(n: int) -> Any:
        yield n

    for func in (numbers, numbers_async):
        with pytest.raises(ConfigurationError, match="generator"):
            mutex.exclusive("gen:{n}")(func)

    class Importer:
        async def __call__(self, url: str) -> str | None:
            await asyncio.sleep(0)
            rec = await asyncio.to_thread(mutex.store.read, f"obj:{url}")
            return rec.holder if rec is not None else None

    guarded = mutex.exclusive("obj:{url}")(Importer())
    assert asyncio.run(guarded("u")) == mutex.node_id, "the body ran holding the lock"

    @mutex.exclusive("returns-coroutine")
    def sneaky() -> Any:  # a plain function that hands back work to do later, after the release
        return numbers_async(1).__anext__()

    with pytest.raises(ConfigurationError, match="after the lock is released"):
        sneaky()
    mutex.close()


def _steal(store: LockStore, mutex: Mutex, name: str, lease: HeldLease) -> None:
    """Someone with access to the store frees the lock and another node takes it."""
    assert store.release(name, Node(mutex.node_id, "10.0.0.1"), lease.token)
    assert store.acquire_or_renew(name, Node("intruder:1:abcdef", "10.9.9.9"), 30).acquired


@pytest.mark.parametrize("kind", backend_params("memory", "sqlite"))
def test_a_slow_on_lost_callback_delays_no_other_holds_renewal(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    mutex, store = new_mutex(), ctx.make()
    in_callback, leave = threading.Event(), threading.Event()

    def slow(_: HeldLease) -> None:
        in_callback.set()
        leave.wait(30)

    try:
        with mutex.hold("healthy", lease=1.0) as healthy, mutex.hold("doomed", lease=1.0, on_lost=slow) as doomed:
            _steal(store, mutex, "doomed", doomed)
            assert in_callback.wait(10)
            time.sleep(2.5)  # two and a half leases inside the callback
            assert not healthy.lost, healthy.lost_reason
    finally:
        leave.set()


@pytest.mark.parametrize("kind", backend_params("memory", "sqlite"))
def test_sys_exit_in_on_lost_leaves_the_renewer_running(ctx: StoreCtx, new_mutex: Callable[..., Mutex]) -> None:
    mutex, store = new_mutex(), ctx.make()
    called = threading.Event()

    def leave(_: HeldLease) -> None:
        called.set()
        sys.exit(3)

    with mutex.hold("doomed", lease=1.0, on_lost=leave) as doomed:
        _steal(store, mutex, "doomed", doomed)
        assert called.wait(10)
    time.sleep(0.2)
    with mutex.hold("later", lease=0.6) as later:
        time.sleep(2.0)
        assert not later.lost, later.lost_reason


class _HangingRelease(CountingStore):
    """A store that stops answering releases (for ``hang`` seconds each, or until ``answer`` is set)."""

    def __init__(self, inner: LockStore, hang: float) -> None:
        super().__init__(inner)
        self.hang, self.answer = hang, threading.Event()

    def release(self, name: str, node: Node, token: int) -> bool:
        self.calls["release"] += 1
        if not self.answer.wait(self.hang):
            raise StoreUnavailableError("timed out")
        return self.inner.release(name, node, token)


@pytest.mark.memory
def test_leaving_a_hold_on_a_hanging_store_takes_a_short_deadline_and_none_when_taken_over() -> None:
    inner = Mutex(f"memory://hang-{secrets.token_hex(3)}").store
    store = _HangingRelease(inner, hang=5.0)
    mutex = Mutex(store=store)
    try:
        started = time.monotonic()
        with mutex.hold("hung", lease=30) as lease:
            pass
        took = time.monotonic() - started
        assert took < 3, f"leaving the block took {took:.1f}s"
        assert lease.released is False
        store.answer.set()  # the store answers again: the release in flight still lands
        wait_for(lambda: (rec := inner.read("hung")) is not None and rec.holder is None)

        store.answer.clear()
        store.calls.clear()
        with mutex.hold("lost", lease=1.0) as lost:
            _steal(inner, mutex, "lost", lost)
            wait_for(lambda: lost.lost)
            started = time.monotonic()
        took = time.monotonic() - started
        assert took < 1 and store.calls["release"] == 0, "a lease another holder took is not released: the store would refuse"
        assert lost.released is False
    finally:
        store.answer.set()
        mutex.close()
