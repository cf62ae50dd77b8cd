"""One lock per shared job, whatever the code says (issue #32, A4).

A rolling deploy changes the job function's ``@sched.mutex(lock=...)``: old and new nodes guarded
the same shared job under two locks, and 8 of 10 fire times ran twice. The lock a job was first
added under is now stored with it; a node whose code names another lock refuses the job loudly.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mutexcron import MutexScheduler
from tests.backends import backend_params
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec, read_lines, start_node
from tests.test_shared_cluster import jobstore, lock_url

__all__ = ["jobstore", "lock_url"]  # fixtures

pytestmark = pytest.mark.cluster

JOB = "tests.nodes.shared_lock_jobs:send_reports"


def _node(name: str, lock: str, lock_url: str, spec: dict[str, object], out: Path, workdir: Path) -> Any:
    return start_node("tests.nodes.shared_lock_jobs:sched", name, workdir, spec, "--lock-url", lock_url,
                      "--unactive-interval", "2", MUTEXCRON_TEST_RUNS=str(out), MUTEXCRON_TEST_LOCK=lock)


@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_old_and_new_code_naming_two_locks_never_run_a_fire_time_twice(
    kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MUTEXCRON_TEST_JOBSTORE", json.dumps(jobstore.spec))
    out = tmp_path / "runs.jsonl"
    procs = [_node("old", "reports", lock_url, jobstore.spec, out, tmp_path),
             _node("new", "send-reports", lock_url, jobstore.spec, out, tmp_path)]  # fmt: skip
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False)
    admin.start(paused=True)
    try:
        admin.add_job(JOB, "interval", seconds=1, id="send-reports", replace_existing=True)  # the old code's lock: reports
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and len([r for r in read_lines(out) if "fire" in r]) < 8:
            time.sleep(0.1)
        time.sleep(1.0)
        runs = [r for r in read_lines(out) if "fire" in r]
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log"))
        assert len(runs) >= 8, logs
        twice = {fire: n for fire, n in Counter(r["fire"] for r in runs).items() if n > 1}
        assert not twice, f"fire times run twice: {twice}\n{logs}"
        assert {r["tag"] for r in runs} == {"reports"}, "only code naming the stored lock runs it"
        new_log = (tmp_path / "new.log").read_text(errors="replace")
        assert new_log.count("was added under lock 'reports', but this node's code names lock 'send-reports'") == 1, new_log
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        admin.shutdown(wait=False)
