"""``mutexcron jobs list|show|pause|resume|remove`` and ``mutexcron trigger`` on shared job stores."""

from __future__ import annotations

import json
import pickle
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron import MutexScheduler
from mutexcron.cli.main import main
from tests import shared_jobs
from tests.shared_jobs import open_jobstore, runs_of

pytestmark = pytest.mark.sqlite


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    with open_jobstore("sqlite", tmp_path) as ctx:
        lock_url = f"sqlite:///{tmp_path}/locks.db"
        jobs_file = tmp_path / "jobs.py"
        options = ctx.spec["options"]
        jobs_file.write_text(textwrap.dedent(f"""
            from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
            from mutexcron import MutexScheduler
            sched = MutexScheduler(jobstores={{"default": SQLAlchemyJobStore(url={options['url']!r},
                                   tablename={options['tablename']!r})}}, lock_url={lock_url!r})
        """))
        shared_jobs.clear_runs()
        started: list[MutexScheduler] = []

        def node(paused: bool = False, **kw: Any) -> MutexScheduler:
            sched = MutexScheduler(jobstores={"default": ctx.make()}, lock_url=lock_url, unactive_interval=1.5, **kw)
            sched.start(paused=paused)
            started.append(sched)
            return sched

        yield str(jobs_file), lock_url, node
        for sched in started:
            sched.shutdown(wait=False)


def test_jobs_list_show_pause_resume_remove(setup: Any) -> None:
    jobs_file, _lock_url, node = setup
    worker = node(triggers=False)
    web = node(paused=True, triggers=False)
    web.add_job(shared_jobs.tick, "interval", seconds=1, id="c1", kwargs={"job": "c1"})
    wait_for(lambda: runs_of("c1"))

    def ran() -> bool:  # the run is recorded (its hand-off) a moment after its first line
        listed = cli("jobs", "list", jobs_file, "--json")
        assert listed.exit_code == 0, listed.output
        return bool(json.loads(listed.stdout)[0]["last_run"])

    wait_for(ran)
    (row,) = json.loads(cli("jobs", "list", jobs_file, "--json").stdout)
    assert row["job"] == "c1" and row["lock"] == "c1" and row["holder"] == worker.node_id and row["state"] == "scheduled"
    assert row["func"] == "tests.shared_jobs:tick" and row["last_run"]
    assert "c1" in cli("jobs", "list", jobs_file).output
    assert json.loads(cli("jobs", "show", jobs_file, "c1").output)["kwargs"] == "{'job': 'c1'}"
    assert cli("jobs", "pause", jobs_file, "c1").exit_code == 0
    store = worker._jobstores["default"]
    assert pickle.loads(store._read_states(["c1"])["c1"])["next_run_time"] is None
    time.sleep(0.5)
    paused = len(runs_of("c1"))
    time.sleep(1.5)
    assert len(runs_of("c1")) == paused
    assert cli("jobs", "resume", jobs_file, "c1").exit_code == 0
    wait_for(lambda: len(runs_of("c1")) > paused)
    assert cli("jobs", "remove", jobs_file, "c1").exit_code == 0
    wait_for(lambda: worker._leases is not None and "c1" not in worker._leases.held(), timeout=3)
    assert store._read_states() == {}
    missing = cli("jobs", "show", jobs_file, "c1")
    assert missing.exit_code == 2 and "no job 'c1'" in missing.output


def test_trigger_runs_a_shared_job_now_on_its_holder(setup: Any) -> None:
    _jobs_file, lock_url, node = setup
    node()
    web = node(paused=True, triggers=False)
    web.add_job(shared_jobs.tick, "interval", hours=1, id="t1", kwargs={"job": "t1"})
    result = cli("trigger", "t1", "--lock-url", lock_url, "--timeout", "20")
    assert result.exit_code == 0, result.output
    assert len(runs_of("t1")) == 1


def _jobs_file(tmp_path: Path, shared: dict[str, Any] | None = None) -> Path:
    """A jobs file with a guarded cron job, a guarded interval job, an unguarded one and a failing one
    (memory jobs), and a shared job store when ``shared`` (its SQLAlchemyJobStore options) is given."""
    path = tmp_path / "jobs.py"
    stores = f"jobstores={{'default': SQLAlchemyJobStore(**{shared!r})}}, " if shared else ""
    path.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from apscheduler.jobstores.memory import MemoryJobStore
        from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
        from mutexcron import MutexScheduler

        OUT = Path({str(tmp_path / "ran.txt")!r})
        sched = MutexScheduler({stores}lock_url={f"sqlite:///{tmp_path}/locks.db"!r}, unactive_interval=4)
        if {bool(shared)!r}:
            sched.add_jobstore(MemoryJobStore(), "local")
        where = {{"jobstore": "local"}} if {bool(shared)!r} else {{}}

        @sched.mutex(lock="billing", unactive_interval=7)
        @sched.cron_schedule(minute="*/5", **where)
        def bill(**attrs):
            OUT.write_text(f"bill {{attrs}}")
            return {{"n": 1}}

        @sched.mutex()
        @sched.interval_schedule(hours=1, **where)
        def hourly():
            pass

        @sched.interval_schedule(seconds=30, **where)
        def free():
            pass

        def broken():
            raise RuntimeError("boom in the job")

        sched.add_job(broken, "interval", minutes=10, id="broken", mutex=True, **where)
    """))
    return path


def test_jobs_list_shows_every_job_of_a_jobs_file_without_a_shared_store(tmp_path: Path) -> None:
    jobs_file = _jobs_file(tmp_path)
    listed = cli("jobs", "list", str(jobs_file), "--json")
    assert listed.exit_code == 0, listed.output
    rows = {r["job"]: r for r in json.loads(listed.stdout)}
    assert set(rows) == {"bill", "hourly", "free", "broken"}
    assert rows["bill"]["lock"] == "billing" and rows["bill"]["lease"] == 7 and rows["bill"]["trigger"] == "cron[minute='*/5']"
    assert rows["hourly"]["lock"] == "hourly" and rows["hourly"]["lease"] == 4
    assert rows["free"]["lock"] is None and rows["free"]["guarded"] is False and rows["free"]["lease"] is None
    next_bill = datetime.fromisoformat(rows["bill"]["next_run"])
    assert next_bill.minute % 5 == 0 and next_bill > datetime.now(timezone.utc)
    # A guarded interval job runs on the hour (anchored cluster-wide), not an hour after this command.
    assert datetime.fromisoformat(rows["hourly"]["next_run"]).minute == 0
    text = cli("jobs", "list", str(jobs_file))
    assert text.exit_code == 0
    header, *lines = [line for line in text.stdout.splitlines() if line]
    assert header.split()[:5] == ["JOB", "STORE", "STATE", "NEXT", "RUN"] and "LEASE" in header
    assert any(line.startswith("bill ") and "billing" in line and "7s" in line for line in lines), text.output
    assert any(line.startswith("free ") and "unguarded" in line for line in lines), text.output
    assert not (tmp_path / "locks.db").exists()  # a read creates nothing


def test_jobs_list_shows_the_files_jobs_and_the_shared_stores_jobs(tmp_path: Path) -> None:
    with open_jobstore("sqlite", tmp_path) as ctx:
        jobs_file = _jobs_file(tmp_path, shared=ctx.spec["options"])
        web = MutexScheduler(jobstores={"default": ctx.make()}, lock_url=f"sqlite:///{tmp_path}/locks.db", triggers=False)
        web.start(paused=True)
        try:
            web.add_job(shared_jobs.tick, "interval", seconds=90, id="stored", kwargs={"job": "stored"})
        finally:
            web.shutdown(wait=False)
        listed = cli("jobs", "list", str(jobs_file), "--json")
        assert listed.exit_code == 0, listed.output
        rows = {r["job"]: r for r in json.loads(listed.stdout)}
        assert set(rows) == {"bill", "hourly", "free", "broken", "stored"}
        assert rows["stored"]["store"] == "default" and rows["stored"]["lock"] == "stored" and rows["stored"]["lease"] == 4
        assert rows["bill"]["store"] == "local" and rows["bill"]["declared"] is True


def test_jobs_run_runs_one_job_once_unguarded_and_says_so(tmp_path: Path) -> None:
    jobs_file = _jobs_file(tmp_path)
    result = cli("jobs", "run", str(jobs_file), "bill")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ran.txt").read_text() == "bill {}"  # the user's function, no attrs handed in
    assert "ONCE, HERE, UNGUARDED, FOR DEBUGGING" in result.stderr and "mutexcron trigger bill" in result.stderr
    assert "returned {'n': 1}" in result.stderr
    assert not (tmp_path / "locks.db").exists()  # no lock, no claim, nothing stored
    failed = cli("jobs", "run", str(jobs_file), "broken")
    assert failed.exit_code == 1 and "RuntimeError: boom in the job" in failed.stderr and "UNGUARDED" in failed.stderr
    missing = cli("jobs", "run", str(jobs_file), "nope")
    assert missing.exit_code == 2 and "no job 'nope'" in missing.stderr


def test_jobs_run_runs_a_shared_job_with_its_stored_arguments(setup: Any) -> None:
    jobs_file, _lock_url, node = setup
    web = node(paused=True, triggers=False)
    web.add_job(shared_jobs.tick, "interval", hours=1, id="s1", kwargs={"job": "s1", "tag": "debug"})
    result = cli("jobs", "run", jobs_file, "s1")
    # tests.shared_jobs.tick asks for its lease: outside one, it raises, and the run says so
    assert result.exit_code == 1 and "UNGUARDED" in result.stderr, result.output
    assert "current_lease" in result.stderr or "lease" in result.stderr


def test_jobs_list_of_a_job_store_no_node_has_made_yet_lists_nothing_and_creates_nothing(tmp_path: Path) -> None:
    jobs_file = tmp_path / "jobs.py"
    jobs_file.write_text(textwrap.dedent(f"""
        from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
        from mutexcron import MutexScheduler
        sched = MutexScheduler(jobstores={{"default": SQLAlchemyJobStore(url="sqlite:///{tmp_path}/jobs.db")}},
                               lock_url="sqlite:///{tmp_path}/locks.db")
    """))
    listed = cli("jobs", "list", str(jobs_file))
    assert listed.exit_code == 0, listed.output
    assert "(no jobs)" in listed.stdout and "Traceback" not in listed.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.py"]  # no job store file, no lock store file
