"""`mutexcron pause` / `resume` against a cluster of real `mutexcron run` nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

JOBS = textwrap.dedent(
    """
    import json, os
    from mutexcron import MutexScheduler, current_lease
    sched = MutexScheduler()

    @sched.mutex(lock="billing", unactive_interval=2)
    @sched.interval_schedule(seconds=1, id="tick")
    def tick():
        lease = current_lease()
        with open(os.environ["PAUSE_OUT"], "a") as out:
            out.write(json.dumps({"node": lease.node_id, "fire_time": lease.fire_time.timestamp(), "token": lease.token}) + "\\n")
    """
)


def _wait_for_runs(out: Path, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(_runs(out)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_runs(out)) >= count, "the nodes did not start running the job"


def _runs(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mutexcron", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_pause_stops_the_runs_on_every_node_keeps_the_lease_and_resume_restarts_them(tmp_path: Path) -> None:
    (tmp_path / "jobs.py").write_text(JOBS)
    out = tmp_path / "runs.jsonl"
    env = {**os.environ, "MUTEXCRON_LOCK_URL": f"sqlite:///{tmp_path}/p.db", "PAUSE_OUT": str(out)}
    logs = [tmp_path / f"n{i}.log" for i in range(3)]
    nodes = []
    for i, log in enumerate(logs):
        with open(log, "w") as sink:
            command = [sys.executable, "-m", "mutexcron", "run", "jobs.py", "--node-id", f"n{i}"]
            nodes.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT))
    try:
        _wait_for_runs(out, 2)
        holder_before = json.loads(_cli("status", "--json", env=env, cwd=tmp_path).stdout)["locks"][0]
        assert _cli("pause", "billing", env=env, cwd=tmp_path).returncode == 0
        paused_at = time.time()
        time.sleep(5)
        during = [r for r in _runs(out) if r["fire_time"] > paused_at + 1.5]
        assert during == []  # no node ran a fire time while paused
        status = json.loads(_cli("status", "--json", env=env, cwd=tmp_path).stdout)
        lock = status["locks"][0]
        assert lock["paused"] is True
        assert (lock["holder"], lock["token"]) == (holder_before["holder"], holder_before["token"])  # no failover
        assert lock["heartbeat_age"] < 2.0  # the lease still moves
        present = {n["node_id"]: n for n in status["nodes"]}  # presence, published with the renewals
        assert set(present) == {"n0", "n1", "n2"}, status["nodes"]
        assert present[lock["holder"]]["locks"] == ["billing"] and present[lock["holder"]]["version"]
        assert all(n["clock_offset"] is None or abs(n["clock_offset"]) < 0.5 for n in present.values())
        assert status["paused"] == ["billing"]
        assert _cli("resume", "billing", env=env, cwd=tmp_path).returncode == 0
        resumed_at = time.time()
        time.sleep(4)
        after = [r for r in _runs(out) if r["fire_time"] > paused_at + 1.5]
        assert after and all(r["fire_time"] >= resumed_at - 1.5 for r in after)  # paused fire times not caught up
        assert len({r["fire_time"] for r in after}) == len(after)  # and none twice
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            assert node.wait(timeout=30) == 0
    for log in logs:  # every node logged the pause once, and the resume once
        text = log.read_text()
        assert text.count("is paused (by") == 1, text
        assert text.count("is resumed") == 1, text


def test_resume_with_catch_up_runs_each_job_once_now_on_the_holder(tmp_path: Path) -> None:
    (tmp_path / "jobs.py").write_text(JOBS.replace("seconds=1", "seconds=5"))
    out = tmp_path / "runs.jsonl"
    env = {**os.environ, "MUTEXCRON_LOCK_URL": f"sqlite:///{tmp_path}/p.db", "PAUSE_OUT": str(out)}
    node = subprocess.Popen([sys.executable, "-m", "mutexcron", "run", "jobs.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_for_runs(out, 1)
        assert _cli("pause", "billing", env=env, cwd=tmp_path).returncode == 0
        time.sleep(6)  # a fire time skipped
        resumed = _cli("resume", "billing", "--catch-up", env=env, cwd=tmp_path)
        assert resumed.returncode == 0 and "catch-up requested: tick" in resumed.stdout, resumed.stdout
        assert "tick: ran at fire time " in resumed.stdout, resumed.stdout  # waited for, and said what ran
        resumed_at = time.time()
        _wait_for_runs(out, 2, timeout=4)  # well before the next 5-second fire time
    finally:
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0
    caught = [r for r in _runs(out) if abs(r["fire_time"] - resumed_at) < 1.5]
    assert len(caught) == 1 and caught[0]["fire_time"] % 5 != 0, [datetime.fromtimestamp(r["fire_time"]) for r in _runs(out)]
