"""Shared job stores with real processes: three ``mutexcron run`` nodes on one APScheduler job store
per family (SQLAlchemyJobStore on SQLite, MariaDB and PostgreSQL; RedisJobStore; MongoDBJobStore on
a real server when ``MUTEXCRON_TEST_MONGODB_URL`` is set: mongomock lives in one process, and its
in-process runs are in ``tests/test_shared_jobstores.py``).

A separate process (this test, through a MutexScheduler started paused, as a web app would) adds
10 guarded every-second jobs, then checks: each (job, fire time) runs once; after SIGKILL of the
busiest node every job runs on within the lease; a removal and a reschedule reach every node
within 2 s; a change made while the loops advance the jobs is kept; after SIGTERM and a restart of
every node the jobs are still there and run.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from apscheduler.events import EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED

from mutexcron import MutexScheduler
from tests import shared_jobs
from tests.backends import (
    backend_params_full_matrix,
    cleanup_redis,
    cleanup_sql,
    drop_tasks_table,
    require_server,
)
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec, open_jobstore, read_lines

pytestmark = pytest.mark.cluster

UNACTIVE_INTERVAL = 2.0
JOBS = [f"j{i}" for i in range(10)]


@pytest.fixture
def lock_url(kind: str, tmp_path: Path) -> Iterator[str]:
    tag = secrets.token_hex(3)
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/locks.db"
        return
    if kind == "mongodb":
        base = require_server("mongodb")
        yield f"{base}{'&' if '?' in base else '?'}collection=mc_shared_{tag}"
        return
    base = require_server(kind)
    sep = "&" if "?" in base else "?"
    if kind == "redis":
        url = f"{base}{sep}namespace=shared-{tag}"
        yield url
        cleanup_redis(url)
    else:
        url = f"{base}{sep}table=mc_shared_{tag}&tasks_table=mc_shared_tasks_{tag}"
        yield url
        cleanup_sql(url)
        drop_tasks_table(url)


@pytest.fixture
def jobstore(kind: str, tmp_path: Path) -> Iterator[JobStoreCtx]:
    with open_jobstore(kind, tmp_path) as ctx:
        yield ctx


class Cluster:
    def __init__(self, lock_url: str, jobstore: JobStoreCtx, workdir: Path) -> None:
        self.lock_url, self.jobstore, self.workdir = lock_url, jobstore, workdir
        self.out = workdir / "runs.jsonl"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, count: int = 3) -> None:
        for i in range(count):
            node = f"node{len(self.procs)}-{i}"
            env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
            env.update(
                MUTEXCRON_TEST_JOBSTORE=json.dumps(self.jobstore.spec), MUTEXCRON_TEST_RUNS=str(self.out),
                MUTEXCRON_NODE_ID=node, PYTHONPATH=os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]),
            )  # fmt: skip
            log = open(self.workdir / f"{node}.log", "wb")
            self.procs[node] = subprocess.Popen(
                [sys.executable, "-m", "mutexcron", "run", "tests.nodes.shared_store_jobs:sched", "--lock-url", self.lock_url,
                 "--unactive-interval", str(UNACTIVE_INTERVAL), "--shutdown-timeout", "5"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(), start_new_session=True,
            )  # fmt: skip
            log.close()

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def runs(self) -> list[dict[str, Any]]:
        return [r for r in read_lines(self.out) if "fire" in r]

    def events(self) -> list[dict[str, Any]]:
        return [r for r in read_lines(self.out) if "event" in r]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in self.workdir.glob("*.log"))

    def stop_all(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        for node in self.alive():
            self.procs[node].send_signal(sig)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(predicate: Any, timeout: float, what: str, cluster: Cluster) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s\n{cluster.logs()}")


def assert_once(runs: list[dict[str, Any]], cluster: Cluster) -> None:
    counts = Counter((r["job"], r["fire"]) for r in runs)
    twice = {k: v for k, v in counts.items() if v > 1}
    assert not twice, f"fire times run more than once: {twice}\n{cluster.logs()}"


@pytest.mark.parametrize("kind", backend_params_full_matrix(("sqlite", "postgresql", "mongodb"), ("mysql", "redis")))
def test_three_nodes_share_one_job_store(kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path) -> None:
    cluster = Cluster(lock_url, jobstore, tmp_path)
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False)
    admin.start(paused=True)
    try:
        cluster.start()
        for job in JOBS:
            admin.add_job(shared_jobs.tick, "interval", seconds=1, id=job, kwargs={"job": job}, replace_existing=True)
        wait_for(lambda: {r["job"] for r in cluster.runs()} >= set(JOBS), 20, "every job ran", cluster)
        time.sleep(2)
        assert_once(cluster.runs(), cluster)

        # SIGKILL of the busiest node: every job runs on within the lease.
        recent = Counter(r["node"] for r in cluster.runs() if r["wall"] > time.time() - 2)
        busiest = recent.most_common(1)[0][0]
        killed_at = time.time()
        cluster.procs[busiest].send_signal(signal.SIGKILL)
        wait_for(
            lambda: all(any(r["job"] == job and r["wall"] > killed_at for r in cluster.runs()) for job in JOBS),
            UNACTIVE_INTERVAL + 4, "every job ran after the kill", cluster,
        )  # fmt: skip
        after = [r for r in cluster.runs() if r["wall"] > killed_at]
        gaps = {job: min(r["wall"] for r in after if r["job"] == job) - killed_at for job in JOBS}
        assert max(gaps.values()) <= UNACTIVE_INTERVAL + 1.5, gaps

        # A removal and a reschedule reach every node within 2 s (their events), and take effect.
        alive = set(cluster.alive())
        changed_at = time.time()
        admin.remove_job("j0")
        admin.reschedule_job("j1", trigger="interval", seconds=3)
        for code, job in ((EVENT_JOB_REMOVED, "j0"), (EVENT_JOB_MODIFIED, "j1")):
            wait_for(lambda: {e["node"] for e in cluster.events() if e["event"] == code and e["job"] == job} >= alive,
                     2.0, f"event {code} of {job} on every node", cluster)  # fmt: skip
        time.sleep(6.5)
        assert not [r for r in cluster.runs() if r["job"] == "j0" and r["fire"] > changed_at + 1.0]
        later = sorted(r["fire"] for r in cluster.runs() if r["job"] == "j1" and r["fire"] > changed_at + 1.0)
        assert len(later) >= 2 and all(round(b - a, 3) == 3.0 for a, b in itertools.pairwise(later)), later

        # Changes made while the loops advance every job each second are kept.
        for job in JOBS[2:]:
            admin.modify_job(job, kwargs={"job": job, "tag": "v2"})
        modified_at = time.time()
        time.sleep(3)
        for job in JOBS[2:]:
            fires = [r for r in cluster.runs() if r["job"] == job and r["fire"] > modified_at + 1.0]
            assert fires and all(r["tag"] == "v2" for r in fires), (job, fires)
            assert admin.get_job(job).kwargs["tag"] == "v2"

        # SIGTERM and restart of every node: the jobs are still there and run.
        cluster.stop_all()
        assert sorted(j.id for j in admin.get_jobs()) == sorted(JOBS[1:])
        restarted_at = time.time()
        cluster.start()
        wait_for(lambda: {r["job"] for r in cluster.runs() if r["wall"] > restarted_at} >= set(JOBS[1:]), 20,
                 "every job ran after the restart", cluster)  # fmt: skip
        time.sleep(1)
        assert_once(cluster.runs(), cluster)
        assert not [r for r in cluster.runs() if r["job"] == "j0" and r["fire"] > changed_at + 1.0]
    finally:
        cluster.stop_all(signal.SIGKILL, timeout=10)
        admin.shutdown(wait=False)
