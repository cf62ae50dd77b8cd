"""The zone rule covers shared jobs (issue #32, A7).

Nodes configured in two zones add the same daily cron job at start-up. Before, each restart
rewrote the stored trigger's zone (its next run flipped between 09:00 and 03:15 UTC): a daily job
could run twice in one day, or be skipped. A node in another zone than the stored cron job's now
neither rewrites nor runs it, and says so once.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from mutexcron import MutexScheduler
from mutexcron.guard.firetimes import zone_of
from mutexcron.locks import lock_store_from_url
from tests.backends import backend_params
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec, start_node
from tests.test_shared_cluster import jobstore, lock_url

__all__ = ["jobstore", "lock_url"]  # fixtures

pytestmark = pytest.mark.cluster


def _node(name: str, zone: str, lock_url: str, spec: dict[str, object], workdir: Path) -> Any:
    return start_node("tests.nodes.shared_zone_jobs:sched", name, workdir, spec, "--lock-url", lock_url,
                      "--unactive-interval", "2", MUTEXCRON_TEST_ZONE=zone)


def _wait(predicate: object, timeout: float, what: str, workdir: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in workdir.glob("*.log"))
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s\n{logs}"
        time.sleep(0.1)


@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_a_node_in_another_zone_neither_rewrites_nor_runs_a_shared_cron_job(
    kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path
) -> None:
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False,
                           timezone="UTC")  # fmt: skip
    admin.start(paused=True)
    procs = [_node("utc", "UTC", lock_url, jobstore.spec, tmp_path)]
    locks = lock_store_from_url(lock_url)
    try:
        _wait(lambda: admin.get_job("daily9") is not None, 30, "the UTC node added the job", tmp_path)
        _wait(lambda: (r := locks.read("daily9")) is not None and r.holder == "utc", 30, "the UTC node holds it", tmp_path)
        before = admin.get_job("daily9")
        procs.append(_node("ktm", "Asia/Kathmandu", lock_url, jobstore.spec, tmp_path))
        ktm_log = tmp_path / "ktm.log"
        _wait(lambda: "it neither rewrites nor runs it" in ktm_log.read_text(errors="replace"), 30,
              "the Kathmandu node said why", tmp_path)  # fmt: skip
        after = admin.get_job("daily9")
        assert zone_of(after.trigger) == "UTC", after.trigger
        assert after.next_run_time == before.next_run_time, (before.next_run_time, after.next_run_time)
        procs[0].send_signal(signal.SIGKILL)  # the UTC node dies: the Kathmandu node does not take the job over
        procs[0].wait()
        time.sleep(5)
        record = locks.read("daily9")
        assert record is None or record.holder != "ktm", record
        assert ktm_log.read_text(errors="replace").count("it neither rewrites nor runs it") == 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        locks.close()
        admin.shutdown(wait=False)
