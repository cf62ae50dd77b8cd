"""The missed-run alarm (mutexcron/guard/catchup.py): a fire time older than its misfire grace time
that no node claimed is reported once, as EVENT_RUN_MISSED and one ERROR line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from apscheduler.schedulers.background import BackgroundScheduler

from mutexcron import EVENT_RUN_MISSED, LockRecord, MutexEvent, MutexScheduler
from mutexcron.guard.catchup import CatchUp
from mutexcron.locks import FireClaim, Node
from mutexcron.locks.memory import MemoryLockStore
from mutexcron.locks.sql import SQLLockStore
from mutexcron.scheduler import MutexSchedulerMixin
from tests.backends import backend_params, cleanup_redis, cleanup_sql, require_server

JOBS = textwrap.dedent(
    """
    from mutexcron import MutexScheduler
    sched = MutexScheduler()

    @sched.mutex(lock="nightly", unactive_interval=1)
    @sched.interval_schedule(seconds=2)
    def nightly():
        pass
    """
)


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


class NodeProcess:
    """A real ``mutexcron run`` process, its output read as it comes (so a test waits for a line, not a time)."""

    def __init__(self, tmp_path: Path, name: str, url: str) -> None:
        env = {**os.environ, "MUTEXCRON_LOCK_URL": url, "MUTEXCRON_NODE_ID": name}
        self.proc = subprocess.Popen([sys.executable, "-m", "mutexcron", "run", "jobs.py"], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> str:
        """SIGTERM, wait for the exit; the whole output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return self.output()


def _claimed(store: SQLLockStore) -> datetime | None:
    record = store.read("nightly")
    return record.fire_times.get("nightly") if record is not None else None


@pytest.mark.cluster
def test_all_nodes_down_across_fire_times_then_one_starts_reports_the_missed_run(tmp_path: Path) -> None:
    """Every step waits for what it needs (a claim in the store, a time past the grace, the alarm
    line), never for a guessed duration: a loaded machine only makes it slower."""
    url = f"sqlite:///{tmp_path}/m.db"
    (tmp_path / "jobs.py").write_text(JOBS)
    store = SQLLockStore(url)
    try:
        first = NodeProcess(tmp_path, "first", url)
        try:
            assert wait_for(lambda: _claimed(store) is not None, 60), first.output()  # the job ran on a node
        finally:
            out_first = first.stop()
        assert "missed" not in out_first
        last = _claimed(store)
        assert last is not None
        # Every node down until a fire time after the last claim (every 2 s) is older than the 2 s grace.
        down_until = last + timedelta(seconds=2 + 2 + 1)
        time.sleep(max(0.0, (down_until - datetime.now(timezone.utc)).total_seconds()))
        second = NodeProcess(tmp_path, "second", url)
        try:
            assert wait_for(lambda: "ran on no node" in second.output(), 60), second.output()
        finally:
            out = second.stop()
    finally:
        store.close()
    alarms = [line for line in out.splitlines() if "ran on no node" in line]
    assert alarms, out  # the latest missed fire time at each look (the takeover and the refresh may both see one)
    fire_times = [line.split("fire time ")[1].split(" of lock")[0] for line in alarms]
    assert len(set(fire_times)) == len(fire_times) <= 2, out  # each fire time reported once
    assert all("'nightly'" in line and "ERROR" in line for line in alarms)
    assert datetime.fromisoformat(fire_times[0]) > last, "a fire time after the last one claimed"


@pytest.mark.parametrize("kind", backend_params("sqlite", "redis"))
def test_a_standby_reports_fire_times_the_holder_skips(kind: str, tmp_path: Path) -> None:
    """The holder keeps its lease but stops running the job: the standby, reading the holder's
    record as it does every second, raises the alarm once per newly missed fire time."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/m.db"
    else:
        base = require_server(kind)
        option = "namespace" if kind == "redis" else "table"
        url = f"{base}{'&' if '?' in base else '?'}{option}=missed_{os.getpid()}_{int(time.time())}"
    missed: list[MutexEvent] = []
    lock = threading.Lock()

    def node(name: str) -> MutexScheduler:
        # placement="first": the first node keeps the lock, so that the second one is the standby
        # whose alarm this test is about (balanced placement could place the lock on it).
        sched = MutexScheduler(lock_url=url, node_id=name, placement="first")
        # A 3 s lease: a renewal that meets a busy SQLite file on a loaded machine must not hand the
        # lock to the standby, which would then run the job itself and miss nothing.
        sched.mutex(lock="l", unactive_interval=3)(sched.interval_schedule(seconds=1, id="every")(lambda: None))
        return sched

    holder, standby = node("holder"), node("standby")
    holder.start()
    time.sleep(1.5)
    standby.add_listener(lambda e: (lock.acquire(), missed.append(e), lock.release()), EVENT_RUN_MISSED)
    standby.start()
    try:
        time.sleep(1.5)
        assert missed == []  # the holder runs every fire time: nothing to report
        holder.pause_job("every")  # the holder still renews its lease but claims nothing
        assert wait_for(lambda: bool(missed), 15)
    finally:
        standby.shutdown()
        holder.shutdown()
        if kind == "redis":
            cleanup_redis(url)
        elif kind == "postgresql":
            cleanup_sql(url)
    event = missed[0]
    assert (event.lock, event.job_id, event.node) == ("l", "every", "standby")
    assert event.fire_time is not None and event.fire_time > event.last_claimed
    assert len({e.fire_time for e in missed}) == len(missed)  # each fire time once


class _StartsAfterTheTakeover(BackgroundScheduler):  # type: ignore[misc]
    """APScheduler's start() comes only once the heartbeat's takeover has queued its catch-up, as
    on a loaded machine: the catch-up sees a scheduler that is not running yet."""

    catch_up_began = threading.Event()

    def start(self, paused: bool = False) -> None:
        assert self.catch_up_began.wait(10)
        time.sleep(0.2)
        super().start(paused)


class _LateScheduler(MutexSchedulerMixin, _StartsAfterTheTakeover):
    pass


@pytest.mark.memory
def test_a_takeover_before_the_scheduler_runs_still_reports_the_missed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://missed-{os.getpid()}-{time.monotonic_ns()}"
    store = MemoryLockStore(url)
    fire = (int(time.time()) // 2 * 2 - 20) * 1_000_000  # a fire time 20 s ago, older than the 2 s grace
    gone = Node("gone:1:abcdef", "10.0.0.1")
    result = store.acquire_or_renew("nightly", gone, 1, claim=FireClaim.new("nightly", fire))
    assert result.acquired and store.release("nightly", gone, result.token)  # every node down since
    began = _StartsAfterTheTakeover.catch_up_began = threading.Event()
    run = CatchUp.run

    def run_noted(self: CatchUp, lock: str, before: LockRecord | None, *, handed: bool = False) -> None:
        began.set()
        run(self, lock, before, handed=handed)

    monkeypatch.setattr(CatchUp, "run", run_noted)
    missed: list[MutexEvent] = []
    sched = _LateScheduler(lock_url=url, node_id="late")
    sched.mutex(lock="nightly", unactive_interval=1)(sched.interval_schedule(seconds=2, id="nightly")(lambda: None))
    sched.add_listener(missed.append, EVENT_RUN_MISSED)
    sched.start()
    try:
        assert wait_for(lambda: bool(missed), 10), "the takeover's alarm was dropped while the scheduler started"
    finally:
        sched.shutdown()
    assert missed[0].job_id == "nightly" and missed[0].fire_time is not None
    assert missed[0].fire_time.timestamp() > fire / 1e6
