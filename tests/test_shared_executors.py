"""Executors of shared jobs (issue #32, A5 and A6).

A6: a job whose executor a ``mutexcron run`` node lacks is skipped there with one warning, and
stays in the store (APScheduler's loop deleted it for the whole cluster). A5: a shared job on a
process pool is refused at ``add_job`` with the fix (it ran in the pool's child, unguarded), and a node with a
process pool never runs one that another writer stored.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from apscheduler.executors.pool import ProcessPoolExecutor, ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from mutexcron import ConfigurationError, MutexScheduler
from mutexcron.locks.memory import MemoryLockStore
from tests import shared_jobs
from tests.backends import backend_params
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec, open_jobstore
from tests.test_shared_cluster import UNACTIVE_INTERVAL, Cluster, jobstore, lock_url

__all__ = ["jobstore", "lock_url"]  # fixtures


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_a_job_on_an_executor_a_node_lacks_is_skipped_there_and_kept(
    kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path
) -> None:
    cluster = Cluster(lock_url, jobstore, tmp_path)
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False,
                           executors={"special": ThreadPoolExecutor(2)})  # fmt: skip
    admin.start(paused=True)
    try:
        cluster.start(1)
        admin.add_job(shared_jobs.tick, "interval", seconds=1, id="special-job", kwargs={"job": "special-job"},
                      executor="special")  # fmt: skip
        admin.add_job(shared_jobs.tick, "interval", seconds=1, id="plain", kwargs={"job": "plain"})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len([r for r in cluster.runs() if r["job"] == "plain"]) < 3:
            time.sleep(0.1)
        time.sleep(UNACTIVE_INTERVAL)
        assert [r for r in cluster.runs() if r["job"] == "plain"], cluster.logs()
        assert admin.get_job("special-job") is not None, f"the job was deleted from the store\n{cluster.logs()}"
        assert not [r for r in cluster.runs() if r["job"] == "special-job"]
        logs = cluster.logs()
        assert logs.count("executor 'special' is not configured on this node") == 1, logs
        assert "removing it from the job store" not in logs
    finally:
        cluster.stop_all(signal.SIGKILL, timeout=10)
        admin.shutdown(wait=False)


@pytest.mark.parametrize("kind", backend_params("sqlite"))
def test_a_shared_job_on_a_process_pool_is_refused_with_the_fix(kind: str, tmp_path: Path) -> None:
    with open_jobstore(kind, tmp_path) as ctx:
        sched = MutexScheduler(jobstores={"default": ctx.make()}, lock_store=MemoryLockStore("memory://pp"), triggers=False,
                               executors={"processpool": ProcessPoolExecutor(2)})  # fmt: skip
        sched.start(paused=True)
        try:
            with pytest.raises(ConfigurationError, match=r"executor 'processpool' is a ProcessPoolExecutor.*Drop executor="):
                sched.add_job(shared_jobs.tick, "interval", seconds=1, id="pp", kwargs={"job": "pp"}, executor="processpool")
            assert sched.get_job("pp") is None, "nothing is added"
        finally:
            sched.shutdown(wait=False)


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql"))
def test_a_shared_job_on_a_process_pool_never_runs_unguarded_on_a_real_node(
    kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A5 with a real ``mutexcron run`` node that has a ``ProcessPoolExecutor`` (as APScheduler's
    guide sets one up): a shared job on it, written by a writer that does not refuse it (plain
    APScheduler, an older app), never runs there (before: 4 runs in the pool's child, no claim, no
    run record); the node says why once and keeps the job in the store."""
    monkeypatch.setenv("SHARED_TEST_PROCESS_POOL", "1")  # read by tests/nodes/shared_store_jobs.py
    cluster = Cluster(lock_url, jobstore, tmp_path)
    writer = BackgroundScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)},
                                 executors={"processpool": ProcessPoolExecutor(1)})  # fmt: skip
    writer.start(paused=True)
    try:
        writer.add_job(shared_jobs.mark, "interval", seconds=1, id="pp", kwargs={"job": "pp"}, executor="processpool")
        cluster.start(1)
        admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False)
        admin.start(paused=True)
        try:
            admin.add_job(shared_jobs.tick, "interval", seconds=1, id="plain", kwargs={"job": "plain"})
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len([r for r in cluster.runs() if r["job"] == "plain"]) < 3:
                time.sleep(0.1)
            time.sleep(2)  # the pp job was due every second meanwhile
        finally:
            admin.shutdown(wait=False)
        lines = [r for r in shared_jobs.read_lines(cluster.out) if r.get("job") == "pp"]
        logs = cluster.logs()
        assert len([r for r in cluster.runs() if r["job"] == "plain"]) >= 3, logs
        assert not lines, f"the process-pool job ran: {lines}\n{logs}"
        assert writer.get_job("pp") is not None, "kept in the store"
        assert logs.count("executor 'processpool' is a ProcessPoolExecutor") == 1, logs
    finally:
        cluster.stop_all(signal.SIGKILL, timeout=10)
        writer.shutdown(wait=False)
