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
