"""`mutexcron trigger JOB` against a cluster of real `mutexcron run` nodes (mutexcron/guard/triggers.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.backends import backend_params, cleanup_redis, require_server

pytestmark = pytest.mark.cluster

JOBS = textwrap.dedent(
    """
    import json, os
    from mutexcron import MutexScheduler, current_lease
    sched = MutexScheduler()
    OUT = os.environ["TRIGGER_OUT"]

    @sched.mutex(lock="reports", unactive_interval=2)
    @sched.interval_schedule(hours=6, id="report")
    def report():
        lease = current_lease()
        with open(OUT, "a") as out:
            out.write(json.dumps({"node": lease.node_id, "fire_time": lease.fire_time.isoformat(), "token": lease.token}) + "\\n")

    @sched.mutex(lock="reports", unactive_interval=2)
    @sched.interval_schedule(hours=6, id="broken")
    def broken():
        raise RuntimeError("the report server said no")

    @sched.interval_schedule(hours=6, id="plain")  # unguarded: no lock to run it through
    def plain():
        pass
    """
)


def _url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/t.db"
    base = require_server(kind)
    return f"{base}{'&' if '?' in base else '?'}namespace=trigger-{os.getpid()}"


def _cli(*args: str, env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mutexcron", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize("kind", backend_params("sqlite", "redis"))
def test_trigger_runs_the_job_once_on_the_holder_and_reports_the_outcome(kind: str, tmp_path: Path) -> None:
    url = _url(kind, tmp_path)
    (tmp_path / "jobs.py").write_text(JOBS)
    out = tmp_path / "runs.jsonl"
    env = {**os.environ, "MUTEXCRON_LOCK_URL": url, "TRIGGER_OUT": str(out)}
    command = [sys.executable, "-m", "mutexcron", "run", "jobs.py", "--node-id"]
    nodes = [
        subprocess.Popen([*command, f"n{i}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        for i in range(3)
    ]
    try:
        time.sleep(3)  # started; the 6-hourly jobs are far from due, one node holds "reports"
        # Never run yet: its lock's holder wrote it in the record with its trigger (issue 25 items 3, 7).
        done = _cli("trigger", "report", "--timeout", "30", env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "report: ran at fire time" in done.stdout and "success" in done.stdout
        runs = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(runs) == 1  # once, across three nodes
        assert runs[0]["fire_time"] in done.stdout
        again = _cli("trigger", "report", "--timeout", "30", env=env, cwd=tmp_path)
        assert again.returncode == 0 and len(out.read_text().splitlines()) == 2  # a new request, a new run
        assert len({json.loads(line)["node"] for line in out.read_text().splitlines()}) == 1  # the holder ran both
        failed = _cli("trigger", "broken", "--timeout", "30", env=env, cwd=tmp_path)
        assert failed.returncode == 1 and "RuntimeError: the report server said no" in failed.stdout
        # Issue 25 item 7: answered at once, with the real reason (not after --timeout).
        started = time.monotonic()
        typo = _cli("trigger", "reprot", "--timeout", "30", env=env, cwd=tmp_path)
        assert typo.returncode == 2 and "Did you mean 'report'?" in typo.stderr, typo.stderr
        unguarded = _cli("trigger", "plain", "--force", "--timeout", "30", env=env, cwd=tmp_path)
        assert unguarded.returncode == 2 and "job 'plain' has no lock" in unguarded.stderr, unguarded.stderr
        assert _cli("pause", "reports", env=env, cwd=tmp_path).returncode == 0
        paused = _cli("trigger", "report", "--timeout", "30", env=env, cwd=tmp_path)
        assert paused.returncode == 5 and "lock 'reports' is paused" in paused.stderr, paused.stderr
        assert _cli("resume", "reports", env=env, cwd=tmp_path).returncode == 0
        assert time.monotonic() - started < 25, "each answered at once"
        unknown = _cli("trigger", "no-such-job", "--force", "--timeout", "2", env=env, cwd=tmp_path)
        assert unknown.returncode == 3 and "no node ran it within 2s" in unknown.stderr
        listed = _cli("tasks", "list", "--json", env=env, cwd=tmp_path)
        assert json.loads(listed.stdout) == []  # no request left behind
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            assert node.wait(timeout=30) == 0
        if kind == "redis":
            cleanup_redis(url)
