"""MutexScheduler in-process: decorators, guarded runs, attrs hand-off, errors, stop, fail-closed."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from apscheduler.events import EVENT_JOB_ERROR, EVENT_SCHEDULER_PAUSED, EVENT_SCHEDULER_SHUTDOWN

from mutexcron import (
    EVENT_RUN_FINISHED,
    EVENT_RUN_STARTED,
    ConfigurationError,
    LeaseError,
    LockRecord,
    MutexScheduler,
    StoreUnavailableError,
    current_lease,
)
from mutexcron.guard.job import GuardedJob
from mutexcron.heartbeat import LeaseManager
from mutexcron.locks import BatchClaimResult, FireClaim, HeldClaim, LockStore, Node, Presence, RunInfo
from mutexcron.locks.memory import MemoryLockStore
from tests.backends import FakeClock

pytestmark = pytest.mark.memory


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError("condition not met in time")


@pytest.fixture
def shared_url() -> str:
    return f"memory://sched-{secrets.token_hex(4)}"


@pytest.fixture
def schedulers() -> Iterator[list[MutexScheduler]]:
    made: list[MutexScheduler] = []
    yield made
    for sched in made:
        if sched.running:
            sched.shutdown(wait=False)


def make(schedulers: list[MutexScheduler], url: str, node: str, **kwargs: Any) -> MutexScheduler:
    sched = MutexScheduler(lock_url=url, node_id=node, local_ip=f"10.0.0.{len(schedulers) + 1}", **kwargs)
    schedulers.append(sched)
    return sched


# -- decorators ---------------------------------------------------------------------------------
def test_decorators_work_in_either_order_and_only_on_their_own_function() -> None:
    sched = MutexScheduler(lock_url="memory://", node_id="n")

    @sched.mutex(lock="a")
    @sched.cron_schedule(second="*/5")
    def mutex_outside() -> None: ...

    @sched.cron_schedule(second="*/5")
    @sched.mutex(lock="b")
    def mutex_inside() -> None: ...

    @sched.cron_schedule(second="*/5")  # the seed applied mutex() to the *next* job: we must not
    def plain() -> None: ...

    @sched.mutex()
    @sched.scheduled_job("interval", seconds=30)
    def via_apscheduler() -> None: ...

    @sched.scheduled_job("interval", seconds=30)
    @sched.mutex(lock="d")
    def via_apscheduler_inside() -> None: ...

    def added() -> None: ...

    sched.add_job(added, "interval", seconds=10, mutex={"lock": "e", "unactive_interval": 5})
    # ids and default lock names are the functions' __qualname__ (here inside a test function)
    jobs = {job.id.rpartition(".")[2]: job for job in sched.get_jobs()}
    assert set(jobs) == {"mutex_outside", "mutex_inside", "plain", "via_apscheduler", "via_apscheduler_inside", "added"}
    locks = {jid: job.func.lock.rpartition(".")[2] for jid, job in jobs.items() if isinstance(job.func, GuardedJob)}
    assert locks == {
        "mutex_outside": "a",
        "mutex_inside": "b",
        "via_apscheduler": "via_apscheduler",
        "via_apscheduler_inside": "d",
        "added": "e",
    }
    assert jobs["plain"].func is plain, "an unguarded job is plain APScheduler"
    assert jobs["added"].func.ttl == 5
    assert mutex_outside.__name__ == "mutex_outside" and not isinstance(mutex_outside, GuardedJob)


def test_same_function_scheduled_twice_gets_two_stable_ids() -> None:
    sched = MutexScheduler(lock_url="memory://", node_id="n")

    @sched.mutex(lock="x")
    @sched.cron_schedule(minute="0")
    @sched.cron_schedule(minute="30")
    def twice() -> None: ...

    assert sorted(j.id.rpartition(".")[2] for j in sched.get_jobs()) == ["twice", "twice#2"]
    assert all(isinstance(j.func, GuardedJob) for j in sched.get_jobs())


@pytest.mark.parametrize(
    ("fields", "match"),
    [({"minute": "*/75"}, "minute"), ({"hour": "25"}, "hour"), ({"secnd": "1"}, "secnd")],
)
def test_bad_cron_field_is_a_clear_configuration_error(fields: dict[str, str], match: str) -> None:
    sched = MutexScheduler(lock_url="memory://", node_id="n")
    with pytest.raises(ConfigurationError, match=rf"bad cron schedule for job '.*job'.*{match}"):

        @sched.cron_schedule(**fields)
        def job() -> None: ...


def test_bad_mutex_arguments_are_configuration_errors() -> None:
    sched = MutexScheduler(lock_url="memory://", node_id="n")
    with pytest.raises(ConfigurationError, match="heartbeat"):
        sched.mutex(lock=lambda: None)
    with pytest.raises(ConfigurationError, match="unactive_interval"):
        sched.mutex(unactive_interval=0)
    with pytest.raises(ConfigurationError, match="lock_else"):
        sched.mutex(lock_else="nope")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"unsupported lock URL .*scheme 'ftp'"):
        MutexScheduler(lock_url="ftp://x", node_id="n").start()


def test_guarded_jobs_get_a_misfire_grace_of_two_leases_unless_set() -> None:
    sched = MutexScheduler(lock_url="memory://", node_id="n", unactive_interval=4)

    @sched.mutex()
    @sched.interval_schedule(seconds=60, id="default_grace")
    def default_grace() -> None: ...

    @sched.mutex()
    @sched.interval_schedule(seconds=60, misfire_grace_time=3, id="own_grace")
    def own_grace() -> None: ...

    sched.start(paused=True)
    try:
        assert sched.get_job("default_grace").misfire_grace_time == 8
        assert sched.get_job("own_grace").misfire_grace_time == 3
        assert sched.get_job("own_grace").coalesce is True
    finally:
        sched.shutdown()


# -- running ------------------------------------------------------------------------------------
def test_one_node_runs_attrs_are_handed_over_and_standby_sees_lock_else(
    schedulers: list[MutexScheduler], shared_url: str
) -> None:
    runs: list[tuple[str, int, int, datetime]] = []
    standby: list[LockRecord] = []
    for node in ("a", "b"):
        sched = make(schedulers, shared_url, node)

        @sched.mutex(lock="counter", lock_else=standby.append, unactive_interval=1)
        @sched.interval_schedule(seconds=0.2)
        def count(**attrs: Any) -> dict[str, Any]:
            lease = current_lease()
            runs.append((lease.node_id, attrs.get("n", 0), lease.token, lease.fire_time))
            return {"n": attrs.get("n", 0) + 1, "unicode": "é"}

        sched.start()
    wait_for(lambda: len(runs) >= 8 and standby)
    for sched in schedulers:
        sched.shutdown()
    counters = [n for _, n, _, _ in runs]
    assert counters == list(range(len(runs))), "every run saw the previous run's attrs"
    assert len({node for node, _, _, _ in runs}) == 1, "one node ran the guarded job"
    rec = standby[-1]
    assert rec["active_ip"] in ("10.0.0.1", "10.0.0.2") and rec["holder"] in ("a", "b")
    assert isinstance(rec["update_time"], datetime) and rec["n"] >= 1 and rec.attrs["unicode"] == "é"


def test_job_error_is_recorded_attrs_kept_and_event_fires(schedulers: list[MutexScheduler], shared_url: str) -> None:
    sched = make(schedulers, shared_url, "a")
    events: list[Any] = []
    sched.add_listener(events.append, EVENT_JOB_ERROR)
    calls = []

    @sched.mutex(lock="err")
    @sched.interval_schedule(seconds=0.2)
    def flaky(**attrs: Any) -> dict[str, Any]:
        calls.append(attrs.get("n"))
        if len(calls) == 2:
            raise ValueError("boom")
        return {"n": len(calls)}

    sched.start()
    wait_for(lambda: len(calls) >= 3)
    sched.shutdown()
    assert calls[:3] == [None, 1, 1], "the failed run kept the attrs"
    assert events and isinstance(events[0].exception, ValueError)
    rec = sched.lock_store.read("err")
    assert rec is not None and rec.last_error is None and rec["n"] >= 2


def test_non_json_attrs_name_the_job_and_key_and_keep_previous(
    schedulers: list[MutexScheduler], shared_url: str
) -> None:
    sched = make(schedulers, shared_url, "a")
    events: list[Any] = []
    sched.add_listener(events.append, EVENT_JOB_ERROR)
    calls = []

    @sched.mutex(lock="json")
    @sched.interval_schedule(seconds=0.2, id="bad")
    def bad(**attrs: Any) -> dict[str, Any]:
        calls.append(dict(attrs))
        if len(calls) == 1:
            return {"cursor": 1}
        return {"cursor": 2, "when": datetime.now(timezone.utc)}

    sched.start()
    wait_for(lambda: len(events) >= 1)
    sched.shutdown()
    assert "job 'bad'" in str(events[0].exception) and "'when'" in str(events[0].exception)
    rec = sched.lock_store.read("json")
    assert rec is not None and dict(rec.attrs) == {"cursor": 1}
    assert rec.last_error is not None and "when" in rec.last_error


def test_current_lease_outside_a_job_raises() -> None:
    with pytest.raises(LeaseError, match="outside a guarded job"):
        current_lease()


def test_graceful_shutdown_waits_for_the_job_then_releases(schedulers: list[MutexScheduler], shared_url: str) -> None:
    sched = make(schedulers, shared_url, "a")
    started, finished = threading.Event(), threading.Event()

    @sched.mutex(lock="slow")
    @sched.interval_schedule(seconds=0.2)
    def slow() -> None:
        started.set()
        time.sleep(0.5)
        finished.set()

    sched.start()
    assert started.wait(5)
    sched.shutdown()
    assert finished.is_set(), "shutdown waited for the running guarded job"
    rec = sched.lock_store.read("slow")
    assert rec is not None and rec.holder is None and rec.token == 1, "released, token kept"
    other = MutexScheduler(lock_url=shared_url, node_id="b")
    result = other.lock_store.acquire_or_renew("slow", other.node, 10)
    assert result.acquired and result.token == 2, "a standby takes it at once"


def test_shutdown_tells_listeners_of_the_shutdown_and_of_no_pause(schedulers: list[MutexScheduler], shared_url: str) -> None:
    """As in APScheduler: a shutdown is EVENT_SCHEDULER_SHUTDOWN alone, never a pause first."""
    sched = make(schedulers, shared_url, "a")
    sched.add_job(lambda: None, "interval", seconds=60, id="j", mutex="paused-or-not")
    codes: list[int] = []
    sched.add_listener(lambda event: codes.append(event.code), EVENT_SCHEDULER_PAUSED | EVENT_SCHEDULER_SHUTDOWN)
    sched.start()
    sched.shutdown()
    assert codes == [EVENT_SCHEDULER_SHUTDOWN]


def test_the_schedulers_time_zone_is_apschedulers_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """No zone of our own: the host's, as APScheduler picks it, unless timezone= is given."""
    monkeypatch.setattr("apscheduler.schedulers.base.get_localzone", lambda: ZoneInfo("America/New_York"))
    assert str(MutexScheduler(lock_url="memory://").timezone) == "America/New_York"
    assert str(MutexScheduler(lock_url="memory://", timezone="Asia/Tokyo").timezone) == "Asia/Tokyo"
    assert str(MutexScheduler({"apscheduler.timezone": "Europe/Paris"}, lock_url="memory://").timezone) == "Europe/Paris"


def test_catch_up_runs_a_fire_time_missed_during_failover(schedulers: list[MutexScheduler], shared_url: str) -> None:
    """The holder dies just before a fire time; the standby takes over and runs that fire time once."""
    store = MemoryLockStore(shared_url)
    dead = Node("dead", "10.9.9.9")
    assert store.acquire_or_renew("hourly", dead, ttl=1.0).acquired
    keep_alive = threading.Event()

    def renew_dead() -> None:
        while not keep_alive.wait(0.2):
            store.hand_off("hourly", dead, 1)

    renewer = threading.Thread(target=renew_dead, daemon=True)
    renewer.start()
    runs: list[tuple[datetime, float]] = []
    refused: list[float] = []
    sched = make(schedulers, shared_url, "standby", unactive_interval=1.0)

    @sched.mutex(lock="hourly", lock_else=lambda rec: refused.append(time.monotonic()))
    @sched.interval_schedule(seconds=4, id="hourly")
    def hourly() -> None:
        runs.append((current_lease().fire_time, time.monotonic()))

    sched.start()
    fire = sched.get_job("hourly").next_run_time
    wait_for(lambda: refused, timeout=8)  # the standby's tick at `fire` was refused...
    keep_alive.set()  # ...then the holder dies
    died = time.monotonic()
    wait_for(lambda: runs, timeout=5)
    assert runs[0][0] == fire, "the missed fire time itself ran"
    assert runs[0][1] - died < 1.0 + 1.0, "within a lease (+ one heartbeat period) of the death"
    time.sleep(0.5)
    assert len(runs) == 1, "it ran once"


def test_catch_up_after_a_graceful_release_covers_the_slot_before_this_node_started(
    schedulers: list[MutexScheduler], shared_url: str
) -> None:
    """A gunicorn HUP: the old holder stops and releases, a new worker starts after the next slot
    and acquires the released lock. That slot runs (caught up), as after a takeover."""
    store = MemoryLockStore(shared_url)
    old = Node("old-worker", "10.9.9.9")
    now = datetime.now(timezone.utc)
    if now.timestamp() % 2 > 1.2:  # keep clear of the next slot (the job fires every even second)
        time.sleep(2.2 - now.timestamp() % 2)
        now = datetime.now(timezone.utc)
    missed = datetime.fromtimestamp(now.timestamp() // 2 * 2, timezone.utc)  # the slot no one ran
    ran = missed - timedelta(seconds=2)
    result = store.acquire_or_renew("reload", old, 2.0, FireClaim.new("every", int(ran.timestamp() * 1_000_000)))
    assert result.claimed and store.release("reload", old, result.token)
    runs: list[datetime] = []
    sched = make(schedulers, shared_url, "new-worker", unactive_interval=2.0)
    sched.add_job(lambda: runs.append(current_lease().fire_time), "interval", seconds=2, id="every", mutex="reload")
    sched.start()  # after `missed`
    wait_for(lambda: runs, timeout=5)
    assert runs[0] == missed, f"the slot between the release and this start ran first: {runs}"


# -- fail closed --------------------------------------------------------------------------------
class FlakyStore(LockStore):
    """A real memory store behind a switch that makes every call fail like an unreachable server."""

    def __init__(self, inner: LockStore) -> None:
        super().__init__("flaky://user:secret@host/db")
        self.inner = inner
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailableError("connection refused (flaky://user:***@host/db)")

    def acquire_or_renew(self, *a: Any, **k: Any) -> Any:
        self._check()
        return self.inner.acquire_or_renew(*a, **k)

    def hand_off(self, *a: Any, **k: Any) -> bool:
        self._check()
        return self.inner.hand_off(*a, **k)

    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        self._check()
        return self.inner.renew_many(node, leases, presence=presence)

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        self._check()
        return self.inner.claim_many(node, claims)

    def release(self, *a: Any, **k: Any) -> bool:
        self._check()
        return self.inner.release(*a, **k)

    def read(self, name: str) -> LockRecord | None:
        self._check()
        return self.inner.read(name)

    def list(self) -> list[LockRecord]:
        self._check()
        return self.inner.list()

    def ping(self) -> None:
        self._check()


def test_store_down_means_no_guarded_run_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore(MemoryLockStore())
    store.down = True
    sched = MutexScheduler(lock_store=store, node_id="n")
    runs: list[int] = []
    unguarded: list[int] = []

    @sched.mutex(lock="l", unactive_interval=0.6)
    @sched.interval_schedule(seconds=0.1)
    def guarded() -> None:
        runs.append(1)

    @sched.interval_schedule(seconds=0.1)
    def local() -> None:
        unguarded.append(1)

    caplog.set_level(logging.INFO, logger="mutexcron")
    sched.start()
    try:
        time.sleep(1.2)
        assert not runs, "no guarded run while the store is unreachable"
        assert unguarded, "unguarded jobs keep running"
        down_lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down_lines) == 1, [r.getMessage() for r in down_lines]
        assert "secret" not in caplog.text
        store.down = False
        wait_for(lambda: runs, timeout=5)
        assert sum("reachable again" in r.getMessage() for r in caplog.records) == 1
    finally:
        sched.shutdown()


def test_a_run_whose_lease_runs_out_in_its_started_listeners_never_reaches_its_first_line() -> None:
    """The last lease check comes after the EVENT_RUN_STARTED listeners: one that takes longer than
    the lease while renewals fail (here it takes the store down itself) ends the run unrun."""
    store = FlakyStore(MemoryLockStore())
    sched = MutexScheduler(lock_store=store, node_id="n")
    runs: list[int] = []
    finished: list[Any] = []
    slowed = threading.Event()

    @sched.mutex(lock="late", unactive_interval=0.6)
    @sched.interval_schedule(seconds=0.2)
    def guarded() -> None:
        runs.append(1)

    def slow_listener(event: Any) -> None:
        if event.code == EVENT_RUN_STARTED and not slowed.is_set():
            slowed.set()
            store.down = True  # no renewal gets through while this listener runs past the lease
            time.sleep(1.2)
        elif event.code == EVENT_RUN_FINISHED:
            finished.append(event)

    sched.add_listener(slow_listener, EVENT_RUN_STARTED | EVENT_RUN_FINISHED)
    sched.start()
    try:
        wait_for(lambda: bool(finished), timeout=10)
    finally:
        sched.shutdown()
    first = finished[0]
    assert first.outcome == "error" and "lease ran out while the run-started listeners ran" in (first.error or "")
    assert runs == [], "the job's first line never ran without a lease"


def test_node_demotes_itself_when_renewals_fail_for_a_lease() -> None:
    clock = FakeClock()
    store = FlakyStore(MemoryLockStore(clock=clock))
    manager = LeaseManager(store, Node("n", "ip"), {"l": 3.0}, clock=clock)
    result = manager.tick("l", FireClaim.new("job", 1))
    assert result is not None and result.acquired
    token = result.token
    assert manager.holds("l", token)
    store.down = True
    clock.advance(2.0)
    manager.run_once()
    assert manager.holds("l", token), "still within the lease"
    clock.advance(1.5)
    manager.run_once()
    assert not manager.holds("l", token), "demoted after a lease without renewal (monotonic clock)"
    assert manager.tick("l", None) is None, "no new run while the store is down"
    store.down = False
    again = manager.tick("l", None)
    assert again is not None and again.acquired and again.token == token, "nobody took it: same holder, same token"


def test_attrs_write_after_losing_the_lease_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store = MemoryLockStore(clock=clock)
    a = LeaseManager(store, Node("a", "ip-a"), {"l": 1.0}, clock=clock)
    b = LeaseManager(store, Node("b", "ip-b"), {"l": 1.0}, clock=clock)
    first = a.tick("l", None)
    assert first is not None
    store.hand_off("l", a.node, first.token, {"n": 1})
    clock.advance(2.0)  # a froze mid-run
    took = b.tick("l", None)
    assert took is not None and took.acquired and took.token == 2
    store.hand_off("l", b.node, 2, {"n": 2})
    caplog.set_level(logging.WARNING)
    assert not a.finish("l", first.token, set(), {"n": 99}, RunInfo(0.1), "job")
    assert "NOT saved" in caplog.text
    rec = store.read("l")
    assert rec is not None and dict(rec.attrs) == {"n": 2}, "the new holder's state is kept"


def test_callable_lock_mode_calls_the_users_functions() -> None:
    table: dict[str, Any] = {}
    calls: list[tuple[str, Any]] = []

    def lock() -> dict[str, Any] | None:
        return dict(table) if table else None

    def heartbeat(ip: str, now: datetime, **attrs: Any) -> None:
        table.update(attrs, active_ip=ip, update_time=now)

    sched = MutexScheduler(lock_url="memory://", node_id="n", local_ip="10.1.1.1")

    @sched.mutex(lock=lock, heartbeat=heartbeat, lock_else=lambda rec: calls.append(("else", rec)))
    @sched.cron_schedule(second="*")
    def job(**attrs: Any) -> dict[str, Any]:
        calls.append(("run", attrs))
        return {"n": attrs.get("n", 0) + 1}

    guard = sched.get_jobs()[0].func
    guard()
    guard()
    assert calls == [("run", {}), ("run", {"n": 1})]
    assert table["active_ip"] == "10.1.1.1" and table["n"] == 2
    table.update(active_ip="10.2.2.2", update_time=datetime.now())
    guard()
    assert calls[-1][0] == "else" and calls[-1][1]["active_ip"] == "10.2.2.2"
    table["update_time"] = datetime.now() - timedelta(seconds=60)
    guard()
    assert calls[-1] == ("run", {"n": 2}), "stale by the seed's rule: runs"


def test_blocking_scheduler_runs_guarded_jobs_and_stops(shared_url: str) -> None:
    from mutexcron import BlockingMutexScheduler

    sched = BlockingMutexScheduler(lock_url=shared_url, node_id="blocking")
    runs: list[int] = []
    stopper = threading.Thread(target=sched.shutdown)

    @sched.mutex(lock="blocking")
    @sched.interval_schedule(seconds=0.1)
    def job(**attrs: Any) -> dict[str, int]:
        runs.append(attrs.get("n", 0))
        if len(runs) == 3:
            stopper.start()
        return {"n": attrs.get("n", 0) + 1}

    thread = threading.Thread(target=sched.start)
    thread.start()
    thread.join(timeout=10)
    stopper.join(timeout=10)
    assert not thread.is_alive() and runs[:3] == [0, 1, 2]
    rec = sched.lock_store.read("blocking")
    assert rec is not None and rec.holder is None and rec["n"] >= 3


def test_catch_up_also_when_another_job_of_the_group_takes_the_lock_over(
    schedulers: list[MutexScheduler], shared_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lock group {hourly, frequent}: the takeover comes from `frequent`'s tick, and `hourly`'s
    fire time missed during the failover still runs once."""
    monkeypatch.setattr(LeaseManager, "_take_over", lambda self: None)  # only ticks acquire here
    store = MemoryLockStore(shared_url)
    dead = Node("dead", "10.9.9.9")
    assert store.acquire_or_renew("group", dead, ttl=1.0).acquired
    keep_alive = threading.Event()

    def renew_dead() -> None:
        while not keep_alive.wait(0.2):
            store.hand_off("group", dead, 1)

    threading.Thread(target=renew_dead, daemon=True).start()
    hourly_runs: list[datetime] = []
    refused: list[float] = []
    # placement="first": the takeover must come from a tick of `frequent`, and balanced placement
    # leaves a job without lock_else out of the loop of a node that does not hold its lock.
    sched = make(schedulers, shared_url, "standby", unactive_interval=1.0, placement="first")

    @sched.mutex(lock="group", lock_else=lambda rec: refused.append(time.monotonic()))
    @sched.interval_schedule(seconds=3, id="hourly")
    def hourly() -> None:
        hourly_runs.append(current_lease().fire_time)

    @sched.mutex(lock="group")
    @sched.interval_schedule(seconds=0.25, id="frequent")
    def frequent() -> None: ...

    sched.start()
    fire = sched.get_job("hourly").next_run_time
    wait_for(lambda: sched.get_job("hourly").next_run_time != fire and refused, timeout=8)
    keep_alive.set()
    wait_for(lambda: hourly_runs, timeout=4)
    assert hourly_runs[0] == fire, "the hourly fire time missed during the failover ran"
    time.sleep(0.5)
    assert hourly_runs.count(fire) == 1


def test_lease_save_checkpoints_attrs_and_is_fenced() -> None:
    clock = FakeClock()
    store = MemoryLockStore(clock=clock)
    a = LeaseManager(store, Node("a", "ip-a"), {"l": 1.0}, clock=clock)
    b = LeaseManager(store, Node("b", "ip-b"), {"l": 1.0}, clock=clock)
    first = a.tick("l", None)
    assert first is not None and first.acquired
    import functools

    from mutexcron.guard.lease import Lease

    save = functools.partial(a.checkpoint, "l", first.token, set(), job="job")
    lease = Lease("l", first.token, "a", datetime.now(timezone.utc), "job", a.holds, save)
    assert lease.save({"n": 1})
    assert dict(store.read("l").attrs) == {"n": 1}, "checkpointed during the run"  # type: ignore[union-attr]
    with pytest.raises(Exception, match="not JSON"):
        lease.save({"when": datetime.now(timezone.utc)})
    clock.advance(2.0)  # a froze
    took = b.tick("l", None)
    assert took is not None and took.acquired
    assert not lease.save({"n": 99}), "a checkpoint after a takeover is refused"
    assert lease.lost
    assert dict(store.read("l").attrs) == {"n": 1}  # type: ignore[union-attr]
