"""``mutexcron.contrib.django``: django-apscheduler, cluster-safe.

The example site (examples/django_apscheduler_site: django-apscheduler and ``mutexcron.contrib.django``
installed, an every-second job in the shared ``DjangoJobStore``) runs as 3 nodes, ``python manage.py mutexcron
run``, on SQLite, PostgreSQL and MariaDB (a database of the test's own, dropped afterwards; the locks
and tasks in it by default). Each fire time runs once across the nodes; a job added, paused, resumed
and removed by another process (a paused scheduler, as a web process has) reaches every node; the
admin's "run selected jobs" runs the job on its lock holder; SIGKILL of the holder moves the job
within the lease; ``DjangoJobExecution`` holds one row per fire time run, no other.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.backends import backend_params_full_matrix, require_server
from tests.test_contrib_flask import job_runs
from tests.test_embedding import REPO, Run, _die_with_pytest, _report, analyse, child_env, require_modules

PROJECT = REPO / "examples" / "django_apscheduler_site"
DRIVE = REPO / "tests" / "django_site_drive.py"
LEASE = 3.0
NODES = 3

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]


def _server_database(kind: str) -> Iterator[dict[str, Any]]:
    """A fresh database on the ``kind`` server, as a Django ``DATABASES`` entry; dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    base = make_url(require_server(kind))
    name = f"h35_dj_{secrets.token_hex(3)}" if base.database is None else f"{base.database}_dj_{secrets.token_hex(3)}"
    admin_url = base.set(drivername="postgresql+psycopg" if kind == "postgresql" else "mysql+pymysql")
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine_name = "django.db.backends.postgresql" if kind == "postgresql" else "django.db.backends.mysql"
    try:
        yield {"ENGINE": engine_name, "NAME": name, "USER": base.username or "", "PASSWORD": base.password or "",
               "HOST": base.host or "", "PORT": str(base.port or "")}  # fmt: skip
    finally:
        with engine.connect() as conn:
            conn.execute(text(f"DROP DATABASE {name}" + (" WITH (FORCE)" if kind == "postgresql" else "")))
        engine.dispose()


@pytest.fixture
def database(kind: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    require_modules("django", "django_apscheduler")
    if kind == "sqlite":
        yield {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}
        return
    yield from _server_database(kind)


class Project:
    """The test project on ``database``: its manage.py and drive.py, its nodes, their runs."""

    def __init__(self, database: dict[str, Any], workdir: Path) -> None:
        self.runs_path = workdir / "runs.jsonl"
        self.workdir = workdir
        self.env = child_env(SITE_DATABASE=json.dumps(database), SITE_RUNS_LOG=str(self.runs_path),
                             MUTEXCRON_UNACTIVE_INTERVAL=str(LEASE), PYTHONPATH=str(PROJECT))  # fmt: skip
        self.nodes: list[subprocess.Popen[bytes]] = []

    def manage(self, *args: str, timeout: float = 120) -> str:
        return self._run([sys.executable, "manage.py", *args], timeout)

    def drive(self, action: str, job: str) -> str:
        return self._run([sys.executable, str(DRIVE), action, job], 60)

    def _run(self, command: list[str], timeout: float) -> str:
        done = subprocess.run(command, cwd=PROJECT, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{command} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def start_node(self) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"node{len(self.nodes)}.log", "wb")
        node = subprocess.Popen([sys.executable, "manage.py", "mutexcron", "run"], cwd=PROJECT, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_pytest)  # fmt: skip
        log.close()
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        for node in self.nodes:
            if node.poll() is None:
                node.terminate()
        for node in self.nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.workdir.glob("node*.log")))

    def runs(self, job: str) -> list[Run]:
        return job_runs(self.runs_path, job)

    def wait(self, what: str, ready: Callable[[], Any], timeout: float = 45) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            if any(node.poll() is not None for node in self.nodes if node.returncode != -signal.SIGKILL):
                dead = [n for n in self.nodes if n.poll() is not None and n.returncode != -signal.SIGKILL]
                if dead:
                    pytest.fail(f"a node exited ({dead[0].returncode}) waiting for {what}:\n{self.logs()}")
            time.sleep(0.05)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.logs()}")


def _changes_reach_every_node(project: Project) -> dict[str, Any]:
    project.drive("add", "added")
    project.wait("runs of the added job", lambda: len(project.runs("added")) >= 3)
    project.drive("pause", "added")
    paused_at = time.time()
    time.sleep(2.5)
    while_paused = [r for r in project.runs("added") if r.wall > paused_at + 0.5]
    project.drive("resume", "added")
    resumed_at = time.time()
    project.wait("runs after the resume", lambda: any(r.wall > resumed_at for r in project.runs("added")))
    project.drive("remove", "added")
    removed_at = time.time()
    time.sleep(2.5)
    after_remove = [r for r in project.runs("added") if r.wall > removed_at + 0.5]
    return {"added": analyse(project.runs("added")), "runs_while_paused": len(while_paused),
            "runs_after_remove": len(after_remove)}  # fmt: skip


def _admin_run(project: Project) -> dict[str, Any]:
    """The admin's action on the hourly job: one run now, on its lock's holder (the only run of it)."""
    reply = json.loads(project.drive("admin-run", "hourly").strip().splitlines()[-1])
    time.sleep(1)
    return {"admin_reply": reply, "admin_runs": analyse(project.runs("hourly"))}


def _kill_holder(project: Project) -> dict[str, Any]:
    holder = project.runs("tick")[-1].pid
    os.kill(holder, signal.SIGKILL)
    killed_at = time.time()
    nxt = project.wait("a run on another node", lambda: next(
        (r for r in project.runs("tick") if r.pid != holder and r.wall > killed_at), None))  # fmt: skip
    return {"moved_after_kill": round(nxt.wall - killed_at, 3), "lease": LEASE}


@pytest.mark.parametrize("kind", backend_params_full_matrix(("postgresql",), ("sqlite", "mysql")))  # CI time
def test_django_apscheduler_on_three_nodes(kind: str, database: dict[str, Any], tmp_path: Path) -> None:
    project = Project(database, tmp_path)
    project.manage("migrate", "--noinput")
    result: dict[str, Any] = {"kind": kind, "lease": LEASE}
    planted = json.loads(project.drive("failed-request", "hourly").strip().splitlines()[-1])
    assert planted == {"state": "failed"}, planted  # the admin's run must withdraw it, not join it
    try:
        for _ in range(NODES):
            project.start_node()
        first = project.wait("the first run", lambda: project.runs("tick"))[0]
        project.wait("6 s of runs", lambda: any(r.fire >= first.fire + 6 for r in project.runs("tick")))
        result["steady"] = analyse(project.runs("tick"))
        listing = project.manage("mutexcron", "jobs", "list")  # the jobs module from settings.MUTEXCRON_JOBS
        assert "tick" in listing and "hourly" in listing, listing
        result.update(_changes_reach_every_node(project))
        result.update(_admin_run(project))
        result["kill"] = _kill_holder(project)
        after_kill = time.time()
        project.wait("3 s of runs after the take-over", lambda: any(r.wall > after_kill + 3 for r in project.runs("tick")))
    finally:
        project.stop()
    runs = project.runs("tick")
    result["whole"] = analyse(runs)
    rows = json.loads(project.drive("executions", "tick").strip().splitlines()[-1])
    row_fires = sorted(round(when, 6) for when, _status in rows)
    run_fires = sorted(round(r.fire, 6) for r in runs)
    result["executions"] = {"rows": len(rows), "runs": len(runs), "statuses": sorted({s for _, s in rows}),
                            "rows_without_run": len(set(row_fires) - set(run_fires)),
                            "runs_without_row": len(set(run_fires) - set(row_fires))}  # fmt: skip
    _report(result)
    assert not result["whole"]["duplicated"] and not result["added"]["duplicated"], f"a fire time ran twice\n{result}"
    assert result["whole"]["pids"] >= 2 and not result["whole"]["shared_node_ids"], result
    assert result["runs_while_paused"] == 0 and result["runs_after_remove"] == 0, result
    assert any("Executed job 'hourly'" in m for m in result["admin_reply"]["messages"]), result
    assert result["admin_runs"]["runs"] == 1, result
    assert result["kill"]["moved_after_kill"] < LEASE + 1.5, f"the job took longer than the lease to move\n{result}"
    executions = result["executions"]
    assert executions["rows_without_run"] == 0 and executions["rows"] == len(set(row_fires)), result
    assert executions["runs_without_row"] <= 1, result  # the run the SIGKILL interrupted may have no row


@pytest.mark.parametrize("kind", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_a_removal_racing_a_runs_history_row_goes_through(kind: str, database: dict[str, Any], tmp_path: Path) -> None:
    """A run's DjangoJobExecution row committed while a removal runs (after Django collected the job's
    rows, before it deleted the job) failed the removal's commit with a foreign key error; the removal
    is tried again and goes through, taking that row too (PostgreSQL checks the key at commit)."""
    project = Project(database, tmp_path)
    project.manage("migrate", "--noinput")
    outcome = json.loads(project.drive("remove-racing-a-run", "raced").strip().splitlines()[-1])
    assert outcome == {"raced": True, "jobs": 0, "rows": 0}, outcome
