"""A writer frozen inside its transaction holds one shared job, never the node (issue #32, A3).

Another process updates one job's row and keeps its transaction open (its row lock held) while a
real ``mutexcron run`` node runs that job and another every second. Before, the node's advance of
the locked job waited without bound on PostgreSQL (and 50 s on MariaDB, whose error 1205 then
killed the scheduler loop): neither job ran. Now each job store write waits at most a third of the
lease: the other job runs on, and the locked one runs again once the writer commits.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from mutexcron import MutexScheduler
from tests import shared_jobs
from tests.backends import backend_params
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec
from tests.test_shared_cluster import Cluster, assert_once, jobstore, lock_url, wait_for

__all__ = ["jobstore", "lock_url"]  # fixtures

pytestmark = pytest.mark.cluster

FREEZE = 8.0


@pytest.mark.parametrize("kind", backend_params("mysql", "postgresql"))
def test_a_writer_frozen_in_its_transaction_holds_one_job_never_the_node(
    kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path
) -> None:
    cluster = Cluster(lock_url, jobstore, tmp_path)
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False)
    admin.start(paused=True)
    options = jobstore.spec["options"]
    engine = sqlalchemy.create_engine(options["url"])
    try:
        cluster.start(1)
        for job in ("locked", "free"):
            admin.add_job(shared_jobs.tick, "interval", seconds=1, id=job, kwargs={"job": job}, replace_existing=True)
        wait_for(lambda: {r["job"] for r in cluster.runs()} == {"locked", "free"}, 30, "both jobs ran", cluster)
        with engine.connect() as writer:
            writer.begin()
            update = f"UPDATE {options['tablename']} SET job_state = job_state WHERE id = :id"
            writer.execute(sqlalchemy.text(update), {"id": "locked"})
            frozen_at = time.time()
            time.sleep(FREEZE)  # the row stays locked: the writer is frozen between its UPDATE and its COMMIT
            during = [r for r in cluster.runs() if r["job"] == "free" and frozen_at + 2 < r["wall"]]
            writer.commit()
        released = time.time()
        assert len(during) >= (FREEZE - 2) / 2, f"the free job stalled behind the locked row: {during}\n{cluster.logs()}"
        wait_for(lambda: any(r["job"] == "locked" and r["wall"] > released for r in cluster.runs()), 10,
                 "the locked job ran after the writer committed", cluster)  # fmt: skip
        assert cluster.alive(), cluster.logs()
        assert "scheduler loop died" not in cluster.logs()
        assert_once(cluster.runs(), cluster)
    finally:
        engine.dispose()
        cluster.stop_all(signal.SIGKILL, timeout=10)
        admin.shutdown(wait=False)


@pytest.mark.sqlite
def test_the_loop_survives_store_errors_in_every_call_it_makes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """APScheduler's loop dies of an error from ``update_job``, ``remove_job`` or ``get_next_run_time``:
    on a shared store each is said once and the loop carries on."""
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from sqlalchemy.exc import OperationalError

    from mutexcron.jobstores.sqlalchemy import SharedSQLAlchemyJobStore
    from mutexcron.locks.memory import MemoryLockStore

    failing = {"on": False}
    real_replace, real_earliest = SharedSQLAlchemyJobStore._replace, SharedSQLAlchemyJobStore._earliest

    def broken(real: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if failing["on"]:
                raise OperationalError("UPDATE ...", {}, Exception("database is locked"))
            return real(self, *args, **kwargs)

        return call

    monkeypatch.setattr(SharedSQLAlchemyJobStore, "_replace", broken(real_replace))
    monkeypatch.setattr(SharedSQLAlchemyJobStore, "_earliest", broken(real_earliest))
    shared_jobs.clear_runs()
    sched = MutexScheduler(jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{tmp_path}/jobs.db")},
                           lock_store=MemoryLockStore("memory://loop-errors"), unactive_interval=2, triggers=False)  # fmt: skip
    sched.start()
    try:
        sched.add_job(shared_jobs.tick, "interval", seconds=1, id="e", kwargs={"job": "e"})
        _wait(lambda: len(shared_jobs.runs_of("e")) >= 1, 15)
        failing["on"] = True
        time.sleep(2.5)
        failing["on"] = False
        recovered = len(shared_jobs.runs_of("e"))
        _wait(lambda: len(shared_jobs.runs_of("e")) >= recovered + 2, 15)
        fires = [r[1] for r in shared_jobs.runs_of("e")]
        assert len(fires) == len(set(fires)), fires
    finally:
        sched.shutdown(wait=False)
        shared_jobs.clear_runs()


def _wait(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)
