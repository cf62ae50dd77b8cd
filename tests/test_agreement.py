"""A cluster that disagrees with itself (issue 25 item 3): nodes of one lock with different jobs
files, said once from the records the nodes already write (mutexcron/guard/agreement.py)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from mutexcron import MutexScheduler
from mutexcron.guard.agreement import Agreement, SharedNodeId, differences
from mutexcron.locks import FireClaim
from mutexcron.locks.record import LockRecord
from tests.schedulers import shut_down_after, wait_for

pytestmark = pytest.mark.memory


def held(ttl: float = 4.0, holder: str | None = "n0") -> LockRecord:
    return LockRecord(name="reports", holder=holder, token=1, ttl=ttl)


def test_differences_name_the_holder_and_each_difference() -> None:
    mine = {"report": "cron[minute='*/3']", "local": "interval[0:00:05]"}
    theirs = {"report": "cron[minute='*/2']", "remote": "interval[0:01:00]"}
    assert differences(held(4.0), 8.0, mine, theirs) == [
        "lease 4s on n0, 8s here",
        "job 'local' only here (interval[0:00:05])",
        "job 'remote' only on n0 (interval[0:01:00])",
        "job 'report': cron[minute='*/2'] on n0, cron[minute='*/3'] here",
    ]
    assert differences(held(4.0), 4.0, mine, dict(mine)) == []
    assert differences(held(4.0), 4.0, mine, None) == [], "a holder that wrote no jobs: only the lease is compared"


def test_said_once_per_change_and_again_when_they_agree(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="mutexcron")
    check = Agreement("n1")
    for _ in range(3):
        check.check(held(4.0), 8.0, None, None)
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "this node (n1) and its holder n0 run different jobs files: lease 4s on n0, 8s here" in (
        warned[0].getMessage()
    )
    check.check(held(6.0), 8.0, None, None)  # a new difference: said again
    check.check(held(8.0), 8.0, None, None)
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "INFO"]
    assert check.check(held(4.0, holder="n1"), 8.0, None, None) == [], "this node's own record"
    assert check.check(held(4.0, holder=None), 8.0, None, None) == [], "a released record"


# -- two schedulers with different jobs files on one lock -----------------------------------------------
@pytest.fixture
def made() -> Iterator[list[MutexScheduler]]:
    yield from shut_down_after()


def node(made: list[MutexScheduler], url: str, node_id: str, lease: float, every: str) -> MutexScheduler:
    # placement="first": the node started first keeps the lock and the other ticks as its standby, which
    # is what this test watches (balanced placement could hand the lock over, and keeps a standby's
    # jobs without lock_else out of its loop).
    sched = MutexScheduler(lock_url=url, node_id=node_id, timezone="UTC", unactive_interval=lease, placement="first")
    sched.add_job(print, "cron", id="report", mutex="reports", second=every, minute="*", hour="*", args=[""])
    made.append(sched)
    return sched


def test_a_node_with_another_jobs_file_warns_once_naming_both_nodes_and_each_difference(
    made: list[MutexScheduler], caplog: pytest.LogCaptureFixture
) -> None:
    """Lease 4 s vs 8 s, cron */2 vs */3: said once by the standby, from the holder's record."""
    url = f"memory://agreement-{secrets.token_hex(4)}"
    holder = node(made, url, "n0", 4, "*/2")
    holder.start()
    assert wait_for(lambda: (holder.lock_store.read("reports") or held(holder=None)).triggers is not None)
    record = holder.lock_store.read("reports")
    assert record is not None and record.holder == "n0" and record.ttl == 4
    assert dict(record.triggers or {}) == {"report": "cron[hour='*', minute='*', second='*/2']"}
    caplog.set_level(logging.INFO, logger="mutexcron")
    node(made, url, "n1", 8, "*/3").start()
    assert wait_for(lambda: any("different jobs files" in r.getMessage() for r in caplog.records))
    time.sleep(2.5)  # the standby reads the record every second: still said once
    said = [r.getMessage() for r in caplog.records if "different jobs files" in r.getMessage()]
    assert len(said) == 1, said
    assert "this node (n1) and its holder n0 run different jobs files: lease 4s on n0, 8s here; job 'report': " in said[0]
    assert "cron[hour='*', minute='*', second='*/2'] on n0, cron[hour='*', minute='*', second='*/3'] here" in said[0]


def test_nodes_with_the_same_jobs_file_say_nothing(made: list[MutexScheduler], caplog: pytest.LogCaptureFixture) -> None:
    url = f"memory://agreement-{secrets.token_hex(4)}"
    caplog.set_level(logging.INFO, logger="mutexcron")
    holder = node(made, url, "n0", 4, "*/2")
    holder.start()
    assert wait_for(lambda: (holder.lock_store.read("reports") or held(holder=None)).triggers is not None)
    standby = node(made, url, "n1", 4, "*/2")
    standby.start()
    time.sleep(2.5)
    assert not [r for r in caplog.records if "different jobs files" in r.getMessage()]


# -- two processes with one node id -----------------------------------------------------------------
def test_two_schedulers_with_one_node_id_are_said_once(made: list[MutexScheduler], caplog: pytest.LogCaptureFixture) -> None:
    """Both "held" the lock with token 1 and nothing said so: now their lost fire claims do."""
    url = f"memory://agreement-{secrets.token_hex(4)}"
    caplog.set_level(logging.INFO, logger="mutexcron")
    runs: list[int] = []
    for _ in range(2):
        sched = MutexScheduler(lock_url=url, node_id="web-1", timezone="UTC", unactive_interval=1)
        sched.add_job(runs.append, "interval", seconds=0.25, id="tick", mutex="tick", args=[1])
        made.append(sched)
        sched.start()
    assert wait_for(lambda: any("another process runs with node id web-1" in r.getMessage() for r in caplog.records), 15)
    time.sleep(1.0)
    said = [r for r in caplog.records if "another process runs with node id" in r.getMessage()]
    assert 1 <= len(said) <= 2 and all(r.levelname == "ERROR" for r in said), "once per process"
    assert "Give every process its own --node-id" in said[0].getMessage()


def test_one_scheduler_never_says_so(made: list[MutexScheduler], caplog: pytest.LogCaptureFixture) -> None:
    url = f"memory://agreement-{secrets.token_hex(4)}"
    caplog.set_level(logging.INFO, logger="mutexcron")
    runs: list[int] = []
    sched = MutexScheduler(lock_url=url, node_id="web-1", timezone="UTC", unactive_interval=1)
    sched.add_job(runs.append, "interval", seconds=0.25, id="tick", mutex="tick", args=[1])
    made.append(sched)
    sched.start()
    assert wait_for(lambda: len(runs) >= 12, 15)
    assert not [r for r in caplog.records if "another process runs with node id" in r.getMessage()]


def test_one_schedulers_own_later_claims_never_say_so(made: list[MutexScheduler], caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32, C5: trigger and catch-up requests run fire times older than the one the holder's
    scheduled runs claimed since (the request waited for the holder); the store refuses them, and
    two such refusals a lease after taking the lock were read as "another process runs with node
    id web-1" although this one scheduler made every claim. The store now names the claim that
    beat each one: this scheduler's own."""
    url = f"memory://agreement-{secrets.token_hex(4)}"
    caplog.set_level(logging.INFO, logger="mutexcron")
    runs: list[int] = []
    sched = MutexScheduler(lock_url=url, node_id="web-1", timezone="UTC", unactive_interval=1)
    sched.add_job(runs.append, "interval", seconds=0.25, id="tick", mutex="tick", args=[1])
    made.append(sched)
    sched.start()
    assert wait_for(lambda: len(runs) >= 8, 15)  # held for more than a lease
    guard = sched.guard_of("tick")
    assert guard is not None
    ended = [guard.run_now(datetime.now(timezone.utc) - timedelta(seconds=1 + i / 10), (1,), {}) for i in range(4)]
    assert all(e is not None and e.reason == "already-run" for e in ended), ended  # refused, as before
    assert not [r for r in caplog.records if "another process runs with node id" in r.getMessage()]


def test_the_diagnosis_needs_two_foreign_claims_under_one_token(caplog: pytest.LogCaptureFixture) -> None:
    """One foreign nonce may be the previous holder's claim; two different ones while this node
    holds the lock with one token were written during its hold, by a holder that is not this one."""
    caplog.set_level(logging.INFO, logger="mutexcron")
    check = SharedNodeId("web-1")
    mine = FireClaim.new("tick", 1)
    check.sent("tick", mine)
    check.lost("tick", FireClaim.new("tick", 0), mine.nonce, 3)  # beaten by its own claim
    check.lost("tick", FireClaim.new("tick", 2), None, 3)  # the store could not say
    check.lost("tick", FireClaim.new("tick", 3), "theirs-1", 3)  # the previous holder's, maybe
    check.lost("tick", FireClaim.new("tick", 4), "theirs-2", 4)  # another token: another hold
    check.lost("tick", FireClaim.new("tick", 5), "theirs-2", 4)  # the same claim again
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    check.lost("tick", FireClaim.new("tick", 6), "theirs-3", 4)
    check.lost("tick", FireClaim.new("tick", 7), "theirs-4", 4)
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and "another process runs with node id web-1" in said[0], said


@pytest.mark.cluster
@pytest.mark.sqlite
def test_two_mutexcron_run_processes_with_one_node_id_say_so(tmp_path: Path) -> None:
    """The issue's set-up: two `mutexcron run --node-id web` on one store."""
    (tmp_path / "jobs.py").write_text(
        "from mutexcron import MutexScheduler\n"
        "sched = MutexScheduler(unactive_interval=2)\n"
        "@sched.mutex(lock='tick')\n"
        "@sched.interval_schedule(seconds=1, id='tick')\n"
        "def tick():\n"
        "    pass\n"
    )
    env = {**os.environ, "MUTEXCRON_LOCK_URL": f"sqlite:///{tmp_path}/t.db"}
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = []
    for log_path in logs:
        with open(log_path, "w") as sink:
            command = [sys.executable, "-m", "mutexcron", "run", "jobs.py", "--node-id", "web"]
            procs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT))
    try:
        assert wait_for(lambda: any("another process runs with node id web" in p.read_text() for p in logs), 30)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
