"""Shared job ids shown safely, an unreadable job refused in one line (issue #32, B6), and reading an
app's jobs never starts its scheduler (B3)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from mutexcron.dashboard.views import _t
from tests import shared_jobs
from tests.test_shared_jobs_cli import cli, setup

__all__ = ["setup"]  # the fixture

pytestmark = pytest.mark.sqlite

SNEAKY = "report\u202etxt.exe"  # a right-to-left override: shown as "report\u202etxt.exe"


def test_a_job_id_with_a_direction_override_is_printed_escaped(setup: Any) -> None:
    jobs_file, _lock_url, node = setup
    node(paused=True).add_job(shared_jobs.tick, "interval", seconds=30, id=SNEAKY, kwargs={"job": "x"})
    listed = cli("jobs", "list", jobs_file)
    assert listed.exit_code == 0, listed.output
    assert "\u202e" not in listed.output and "report\\u202etxt.exe" in listed.output
    paused = cli("jobs", "pause", jobs_file, SNEAKY)
    assert paused.exit_code == 0 and "\u202e" not in paused.output, paused.output
    assert _t(SNEAKY) == "report\\u202etxt.exe"  # the dashboard's pages, the Shared jobs page included


def test_pausing_a_job_that_cannot_be_read_here_is_a_one_line_error(setup: Any) -> None:
    jobs_file, _lock_url, node = setup
    sched = node(paused=True)
    sched.add_job(shared_jobs.tick, "interval", seconds=30, id="fine", kwargs={"job": "fine"})
    store = sched._jobstores["default"]
    with store.engine.begin() as conn:
        conn.execute(sqlalchemy.insert(store.jobs_t).values(id="broken", next_run_time=1.0, job_state=b"not a pickle"))
    result = cli("jobs", "pause", jobs_file, "broken")
    assert result.exit_code != 0
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "cannot be read here to pause it" in result.output and "mutexcron jobs remove" in result.output


def test_reading_an_apps_jobs_never_starts_its_scheduler(setup: Any, tmp_path: Path) -> None:
    """B3: `mutexcron jobs list app.py` imported an app that starts its scheduler as it is imported: a
    node more in the cluster, whose add_job(replace_existing=True) undid a reschedule."""
    jobs_file, _lock_url, node = setup
    admin = node(paused=True)
    admin.add_job(shared_jobs.tick, "interval", seconds=30, id="app-job", kwargs={"job": "app"})
    admin.reschedule_job("app-job", trigger="interval", seconds=60)
    app = tmp_path / "app.py"
    app.write_text(Path(jobs_file).read_text() + textwrap.dedent("""
        from tests import shared_jobs
        sched.add_job(shared_jobs.tick, "interval", seconds=30, id="app-job", kwargs={"job": "app"}, replace_existing=True)
        sched.start()  # an embedded app starts its scheduler as it is imported
    """))
    listed = cli("jobs", "list", str(app))
    assert listed.exit_code == 0, listed.output
    assert "interval[0:01:00]" in listed.output, listed.output
    assert str(admin.get_job("app-job").trigger) == "interval[0:01:00]", "the reschedule is kept"


@pytest.mark.parametrize("kind", [pytest.param("sqlite"), pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_jobs_reads_and_changes_a_shared_store_by_url_without_a_jobs_file(kind: str, tmp_path: Path) -> None:
    """B3: `mutexcron jobs list|pause <job store URL> [JOB]`: no jobs file imported, no app started."""
    from mutexcron import MutexScheduler
    from mutexcron.jobstores.lockstore import lock_url_of
    from tests.backends import drop_store_tables
    from tests.shared_jobs import open_jobstore

    with open_jobstore(kind, tmp_path) as ctx:
        store = ctx.make()
        locks = lock_url_of(store)
        assert locks is not None
        sched = MutexScheduler(jobstores={"default": store}, triggers=False)  # its locks in the job store's database
        sched.start(paused=True)
        try:
            sched.add_job(shared_jobs.tick, "interval", seconds=30, id="by-url", kwargs={"job": "u"})
            url = f"{ctx.spec['options']['url']}?tablename={ctx.spec['options']['tablename']}"
            listed = cli("jobs", "list", url)
            assert listed.exit_code == 0 and "by-url" in listed.output, listed.output
            paused = cli("jobs", "pause", url, "by-url")
            assert paused.exit_code == 0 and "by-url: paused" in paused.output, paused.output
            assert sched.get_job("by-url").next_run_time is None
        finally:
            sched.shutdown(wait=False)
            if kind != "sqlite":
                drop_store_tables(locks)
