"""Where the locks of a scheduler with a shared job store go (issue #32, A1).

Given no lock store, a scheduler with a shared job store keeps its locks (and tasks) in the job
store's database; a SQLite lock store beside a job store on a server is refused. The cluster test
runs the README's snippet (no ``lock_url``) as two ``mutexcron run`` nodes in two working
directories: each fire time runs once (before, each node used ``./mutexcron.db`` of its own
directory and every fire time ran twice).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from mutexcron import ConfigurationError, MutexScheduler
from mutexcron.jobstores.lockstore import lock_url_of
from tests import shared_jobs
from tests.backends import backend_params, cleanup_redis, drop_store_tables
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec, open_jobstore, read_lines

TICK = "tests.shared_jobs:tick"


@pytest.fixture
def jobstore(kind: str, tmp_path: Path) -> Iterator[JobStoreCtx]:
    with open_jobstore(kind, tmp_path) as ctx:
        yield ctx


def _drop_derived(url: str) -> None:
    if url.startswith("redis"):
        cleanup_redis(url)
    elif not url.startswith("sqlite"):
        drop_store_tables(url)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MUTEXCRON_LOCK_URL", raising=False)


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql", "redis"))
def test_no_lock_url_puts_the_locks_in_the_job_stores_database(kind: str, jobstore: JobStoreCtx, clean_env: None) -> None:
    store = jobstore.make()
    derived = lock_url_of(store)
    assert derived is not None
    sched = MutexScheduler(jobstores={"default": store}, triggers=False)
    try:
        sched.start(paused=True)
        assert sched.lock_url == derived
        assert sched.lock_store.url.split(":", 1)[0].startswith(kind.replace("postgresql", "postgres")[:5])
        assert sched.tasks.store.url == sched.lock_store.url
    finally:
        sched.shutdown(wait=False)
        _drop_derived(derived)


@pytest.mark.parametrize("kind", backend_params("mysql", "postgresql", "redis"))
def test_a_sqlite_lock_store_beside_a_server_job_store_is_refused(kind: str, jobstore: JobStoreCtx, tmp_path: Path) -> None:
    sched = MutexScheduler(jobstores={"default": jobstore.make()}, lock_url=f"sqlite:///{tmp_path}/locks.db", triggers=False)
    with pytest.raises(ConfigurationError, match=r"only this host reaches.*Leave lock_url unset"):
        sched.start(paused=True)
    assert not sched.running


@pytest.mark.parametrize("kind", backend_params("mongomock"))
def test_a_job_store_whose_url_cannot_be_told_needs_a_lock_url(kind: str, jobstore: JobStoreCtx, clean_env: None) -> None:
    sched = MutexScheduler(jobstores={"default": jobstore.make()}, triggers=False)
    with pytest.raises(ConfigurationError, match="set lock_url="):
        sched.start(paused=True)


@pytest.mark.parametrize("kind", backend_params("sqlite"))
def test_a_sqlite_lock_store_beside_a_sqlite_job_store_is_kept(kind: str, jobstore: JobStoreCtx, tmp_path: Path) -> None:
    sched = MutexScheduler(jobstores={"default": jobstore.make()}, lock_url=f"sqlite:///{tmp_path}/locks.db", triggers=False)
    try:
        sched.start(paused=True)
        assert sched.lock_url.endswith("locks.db")
    finally:
        sched.shutdown(wait=False)


def _start_node(name: str, cwd: Path, spec: dict[str, object], out: Path) -> subprocess.Popen[bytes]:
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
    env.update(
        MUTEXCRON_TEST_JOBSTORE=json.dumps(spec), MUTEXCRON_TEST_RUNS=str(out), MUTEXCRON_NODE_ID=name,
        PYTHONPATH=os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]),
    )  # fmt: skip
    with open(cwd / "node.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "mutexcron", "run", "tests.nodes.shared_store_jobs:sched", "--unactive-interval", "2"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
        )  # fmt: skip


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_the_readme_snippet_runs_each_fire_time_once(kind: str, jobstore: JobStoreCtx, tmp_path: Path, clean_env: None) -> None:
    out = tmp_path / "runs.jsonl"
    derived = lock_url_of(jobstore.make())
    assert derived is not None
    procs = [_start_node(f"readme-{i}", tmp_path / f"dir{i}", jobstore.spec, out) for i in range(2)]
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, triggers=False)
    try:
        admin.start(paused=True)
        admin.add_job(TICK, "interval", seconds=1, id="every-second", kwargs={"job": "every-second"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len([r for r in read_lines(out) if "fire" in r]) < 8:
            time.sleep(0.1)
        runs = [r for r in read_lines(out) if "fire" in r]
        logs = "\n".join((tmp_path / f"dir{i}" / "node.log").read_text(errors="replace")[-3000:] for i in range(2))
        assert len(runs) >= 8, logs
        twice = {fire: n for fire, n in Counter(r["fire"] for r in runs).items() if n > 1}
        assert not twice, f"fire times run twice: {twice}\n{logs}"
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        admin.shutdown(wait=False)
        _drop_derived(derived)
        shared_jobs.clear_runs()


def test_a_store_family_that_knows_its_database_names_the_lock_url() -> None:
    """Django's shared store answers from ``DATABASES`` (a store with no engine or client URL to read)."""
    from mutexcron.jobstores.lockstore import lock_url_of

    class KnowsItsDatabase:
        def lock_url(self) -> str:
            return "postgresql://app@db/app"

    assert lock_url_of(KnowsItsDatabase()) == "postgresql://app@db/app"
    assert lock_url_of(object()) is None
