"""A lone ``mutexcron run`` node frozen past its lease runs its shared jobs again (issue #32, A2).

The node holds the lock of an every-second shared job; SIGSTOP for longer than the lease, then
SIGCONT. Nobody took the lock meanwhile, so the store hands it back (with the same token): before,
no event woke the loop, which had found no job held, and the job never ran again.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from mutexcron import MutexScheduler
from tests import shared_jobs
from tests.backends import backend_params
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec
from tests.test_shared_cluster import UNACTIVE_INTERVAL, Cluster, assert_once, jobstore, lock_url, wait_for

__all__ = ["jobstore", "lock_url"]  # fixtures

pytestmark = pytest.mark.cluster

FREEZE = UNACTIVE_INTERVAL * 2.5


@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql", "redis"))
def test_a_lone_holder_frozen_past_its_lease_runs_again(kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path) -> None:
    cluster = Cluster(lock_url, jobstore, tmp_path)
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False)
    admin.start(paused=True)
    try:
        cluster.start(1)
        admin.add_job(shared_jobs.tick, "interval", seconds=1, id="lone", kwargs={"job": "lone"}, replace_existing=True)
        wait_for(lambda: len(cluster.runs()) >= 2, 30, "the job ran", cluster)
        (proc,) = cluster.procs.values()
        for _ in range(2):
            proc.send_signal(signal.SIGSTOP)
            time.sleep(FREEZE)
            proc.send_signal(signal.SIGCONT)
            resumed = time.time()
            wait_for(lambda: any(r["wall"] > resumed for r in cluster.runs()), UNACTIVE_INTERVAL + 8,
                     "a run after the resume", cluster)  # fmt: skip
        assert_once(cluster.runs(), cluster)
    finally:
        cluster.stop_all(signal.SIGKILL, timeout=10)
        admin.shutdown(wait=False)
