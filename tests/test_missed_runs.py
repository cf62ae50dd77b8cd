"""The missed-run alarm (mutexcron/catchup.py): a fire time older than its misfire grace time
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
from pathlib import Path

import pytest

from mutexcron import EVENT_RUN_MISSED, MutexEvent, MutexScheduler
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


def _run(tmp_path: Path, name: str, url: str) -> subprocess.Popen[str]:
    env = {**os.environ, "MUTEXCRON_LOCK_URL": url, "MUTEXCRON_NODE_ID": name}
    return subprocess.Popen([sys.executable, "-m", "mutexcron", "run", "jobs.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.mark.cluster
def test_all_nodes_down_across_fire_times_then_one_starts_reports_the_missed_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/m.db"
    (tmp_path / "jobs.py").write_text(JOBS)
    first = _run(tmp_path, "first", url)
    time.sleep(4)  # a couple of fire times claimed
    first.send_signal(signal.SIGTERM)
    out_first = first.communicate(timeout=30)[0]
    assert "missed" not in out_first
    time.sleep(7)  # every node down across fire times older than the 2 s grace
    second = _run(tmp_path, "second", url)
    time.sleep(4)
    second.send_signal(signal.SIGTERM)
    out = second.communicate(timeout=30)[0]
    alarms = [line for line in out.splitlines() if "ran on no node" in line]
    assert alarms, out  # the latest missed fire time at each look (the takeover and the refresh may both see one)
    fire_times = [line.split("fire time ")[1].split(" of lock")[0] for line in alarms]
    assert len(set(fire_times)) == len(fire_times) <= 2, out  # each fire time reported once
    assert all("'nightly'" in line and "ERROR" in line for line in alarms)


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
        sched = MutexScheduler(lock_url=url, node_id=name)
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
            cleanup_sql(url)  # the lock table (its _nodes table stays: it is tiny and pruned)
    event = missed[0]
    assert (event.lock, event.job_id, event.node) == ("l", "every", "standby")
    assert event.fire_time is not None and event.fire_time > event.last_claimed
    assert len({e.fire_time for e in missed}) == len(missed)  # each fire time once
