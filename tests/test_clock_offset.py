"""This node's clock offset to the store's clock (mutexcron/observability/clock_offset.py), from records it reads."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from mutexcron.drill import libfaketime
from mutexcron.locks.record import LockRecord
from mutexcron.observability.clock_offset import ClockOffset
from tests.backends import cleanup_redis, require_server


def _record(store_now: float, age: float = 0.5) -> LockRecord:
    written = datetime.fromtimestamp(store_now - age, timezone.utc)
    return LockRecord("l", update_time=written, heartbeat_age=age)


def test_the_estimate_is_the_shortest_round_trip_sample_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    offset = ClockOffset()
    now = time.time()
    assert offset.value is None
    offset.observe(_record(now - 2.0), now - 0.3, now + 0.3)  # slow reply: +2 s +- 0.3 s
    offset.observe(_record(now - 2.5), now - 0.001, now + 0.001)  # fast reply: +2.5 s +- 1 ms
    offset.observe(_record(now - 1.0), now - 0.2, now + 0.2)
    assert offset.value == pytest.approx(2.5, abs=0.01) and offset.uncertainty == pytest.approx(0.001, abs=1e-4)
    with caplog.at_level(logging.WARNING, logger="mutexcron"):
        offset.observe(_record(now - 2.5), now, now + 0.001)
    warnings = [r.getMessage() for r in caplog.records if "off the store's clock" in r.getMessage()]
    assert len(warnings) <= 1  # already warned at the second sample, or now: once in all
    offset.observe(None, now, now)  # a missing record is no sample
    offset.observe(_record(now), now + 1, now)  # nor is a wall clock that stepped back
    assert offset.value == pytest.approx(2.5, abs=0.01)


def test_a_clock_that_jumps_ahead_warns_once_its_older_samples_have_left_the_window(caplog: pytest.LogCaptureFixture) -> None:
    offset, now = ClockOffset(window=8), time.time()
    for _ in range(8):
        offset.observe(_record(now), now - 0.0001, now + 0.0001)  # in sync, fast replies
    with caplog.at_level(logging.WARNING, logger="mutexcron"):
        for i in range(8):  # the node's clock is now 3 s ahead; slower replies, so the old samples stay best
            assert not [r for r in caplog.records if "off the store's clock" in r.getMessage()], i
            offset.observe(_record(now - 3.0), now - 0.01, now + 0.01)
    assert offset.value == pytest.approx(3.0, abs=0.02)
    assert len([r for r in caplog.records if "off the store's clock" in r.getMessage()]) == 1


def test_a_node_in_sync_has_an_offset_near_zero(tmp_path: Path) -> None:
    from mutexcron import MutexScheduler

    sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/o.db")
    sched.mutex(lock="l", unactive_interval=3)(sched.interval_schedule(seconds=1)(lambda: None))
    sched.start()
    try:
        deadline = time.monotonic() + 10
        while sched._leases is not None and sched._leases.clock_offset is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sched._leases is not None and sched._leases.clock_offset is not None
        assert abs(sched._leases.clock_offset) < 0.1
    finally:
        sched.shutdown()


JOBS = textwrap.dedent(
    """
    from mutexcron import MutexScheduler
    sched = MutexScheduler()

    @sched.mutex(lock="skewed", unactive_interval=3)
    @sched.interval_schedule(seconds=1)
    def tick():
        pass
    """
)


@pytest.mark.redis
def test_a_node_whose_clock_is_ahead_warns_with_its_offset(tmp_path: Path) -> None:
    """A node 3 s ahead of the Redis server's clock (libfaketime) logs one WARNING naming +3 s and NTP."""
    try:
        library = libfaketime()
    except Exception as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{exc} (CI=true: .ci/run installs the faketime package)")
        pytest.skip(str(exc))
    base = require_server("redis")
    url = f"{base}{'&' if '?' in base else '?'}namespace=skew-{os.getpid()}"
    (tmp_path / "jobs.py").write_text(JOBS)
    env = {**os.environ, "MUTEXCRON_LOCK_URL": url, "LD_PRELOAD": library, "FAKETIME": "+3s", "DONT_FAKE_MONOTONIC": "1"}
    node = subprocess.Popen([sys.executable, "-m", "mutexcron", "run", "jobs.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        time.sleep(4)
    finally:
        node.send_signal(signal.SIGTERM)
        out = node.communicate(timeout=30)[0]
        cleanup_redis(url)  # the namespace's keys: tests drop what they create
    lines = [line for line in out.splitlines() if "off the store's clock" in line]
    assert len(lines) == 1, out
    assert "+3.0" in lines[0] or "+2.9" in lines[0] or "+3.1" in lines[0], lines[0]
    assert "NTP" in lines[0] and "early" in lines[0]
