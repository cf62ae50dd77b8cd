"""``mutexcron trigger`` tells the truth (issue #32, C3 and C4), with a real ``mutexcron run`` node.

C3: a lock name given where a job id is expected (``pause`` and ``history`` take lock names) is
answered at once with the lock's jobs (before: 60 s of waiting, then "no node ran it").
C4: a triggered run that raises is logged on the node with its traceback, as a scheduled run is
(before: the node's log was silent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_trigger import JOBS, _cli

pytestmark = [pytest.mark.cluster, pytest.mark.sqlite]


def test_a_lock_name_is_answered_at_once_and_a_failed_run_is_logged_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "jobs.py").write_text(JOBS)
    env = {**os.environ, "MUTEXCRON_LOCK_URL": f"sqlite:///{tmp_path}/t.db", "TRIGGER_OUT": str(tmp_path / "runs.jsonl")}
    log = tmp_path / "node.log"
    with open(log, "wb") as out:
        node = subprocess.Popen([sys.executable, "-m", "mutexcron", "run", "jobs.py", "--node-id", "n0"], cwd=tmp_path,
                                env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "lock 'reports'" not in log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.1)
        done = _cli("trigger", "report", "--timeout", "30", env=env, cwd=tmp_path)  # the lock record names its jobs now
        assert done.returncode == 0, done.stdout + done.stderr
        started = time.monotonic()
        lock = _cli("trigger", "reports", "--timeout", "30", env=env, cwd=tmp_path)
        assert time.monotonic() - started < 15, "answered at once, not after --timeout"
        assert lock.returncode == 2, lock.stdout + lock.stderr
        assert "'reports' is a lock, not a job id; its job(s): 'broken', 'report'" in lock.stderr, lock.stderr
        failed = _cli("trigger", "broken", "--timeout", "30", env=env, cwd=tmp_path)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        deadline = time.monotonic() + 10
        while "RuntimeError: the report server said no" not in log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text(errors="replace")
        assert 'Job "broken" (run now' in text and "Traceback (most recent call last)" in text, text[-3000:]
        assert "RuntimeError: the report server said no" in text
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=30)
