"""``mutexcron.contrib.flask.APScheduler``: Flask-APScheduler, cluster-safe.

* In one process: the config's and ``@scheduler.task``'s jobs are guarded, the lock store comes
  from the app's config (never a default SQLite file), the REST API's run goes through the lock's
  holder, and a change to a process's own memory job is refused.
* ``examples/flask_apscheduler_app.py`` under ``gunicorn -w 4`` (marked ``cluster``) on SQLite and
  PostgreSQL: one run per fire time across the workers; a job added, paused and removed through the
  REST API reaches every worker; SIGKILL of the holder moves the job within the lease; ``HUP``
  loses no fire time. Figures are printed (``-s``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.backends import backend_params_full_matrix, cleanup_redis, cleanup_sql, require_server, sql_url
from tests.test_embedding import (
    REPO,
    Gunicorn,
    Run,
    _die_with_pytest,
    _report,
    analyse,
    child_env,
    pid_alive,
    require_modules,
)

LEASE = 3.0
APP = "examples.flask_apscheduler_app:app"

pytestmark = pytest.mark.timeout(300)


# -- in one process -----------------------------------------------------------------------------------
def _job() -> None:
    """A job function for the in-process tests."""


def _app(config: dict[str, Any]) -> Any:
    require_modules("flask", "flask_apscheduler")
    from flask import Flask

    app = Flask("contrib_flask_test")
    app.config.update(SCHEDULER_API_ENABLED=True, **config)
    return app


@pytest.fixture
def no_lock_url_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MUTEXCRON_LOCK_URL", raising=False)


@pytest.mark.sqlite
def test_lock_store_comes_from_the_apps_config(tmp_path: Path, no_lock_url_env: None) -> None:
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from sqlalchemy.engine import make_url

    from mutexcron.contrib.flask import APScheduler, lock_url_from_config, sqlalchemy_lock_url
    from mutexcron.errors import ConfigurationError

    assert sqlalchemy_lock_url(make_url("postgresql+psycopg2://u:pw@db/app?sslmode=require")) == "postgresql://u:pw@db/app?sslmode=require"
    assert sqlalchemy_lock_url(make_url("mysql+mysqldb://u@db/app?charset=utf8mb4")) == "mysql://u@db/app?charset=utf8mb4"
    assert lock_url_from_config({"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/a.db"}, {}) == f"sqlite:///{tmp_path}/a.db"
    assert lock_url_from_config({"SCHEDULER_LOCK_URL": "redis://h/1", "SQLALCHEMY_DATABASE_URI": "sqlite://"}, {}) == "redis://h/1"

    store = SQLAlchemyJobStore(url=f"sqlite:///{tmp_path}/jobs.db")
    scheduler = APScheduler(app=_app({"SCHEDULER_JOBSTORES": {"default": store}}))
    assert scheduler.scheduler.lock_url == f"sqlite:///{tmp_path}/jobs.db"
    store.engine.dispose()

    from mutexcron import MutexScheduler

    with pytest.raises(ConfigurationError, match="FlaskMutexScheduler"):
        APScheduler(MutexScheduler())  # its memory jobs would run unguarded in every process

    bare = APScheduler(app=_app({"JOBS": [{"id": "j", "func": f"{__name__}:_job", "trigger": "interval", "seconds": 5}]}))
    with pytest.raises(ConfigurationError, match="SCHEDULER_LOCK_URL"):
        bare.start()
    assert not bare.running


@pytest.mark.memory
def test_the_placement_is_balanced_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gunicorn reload hands each lock over at a fire-time boundary under balanced placement only."""
    from mutexcron.contrib.flask import FlaskMutexScheduler

    monkeypatch.delenv("MUTEXCRON_PLACEMENT", raising=False)
    assert FlaskMutexScheduler(lock_url="memory://flask-placement").placement == "balanced"
    assert FlaskMutexScheduler(lock_url="memory://flask-placement", placement="first").placement == "first"
    monkeypatch.setenv("MUTEXCRON_PLACEMENT", "first")
    assert FlaskMutexScheduler(lock_url="memory://flask-placement").placement == "first"


@pytest.mark.sqlite
def test_jobs_are_guarded_and_the_api_acts_through_the_cluster(tmp_path: Path, no_lock_url_env: None) -> None:
    from mutexcron.contrib.flask import APScheduler

    app = _app({
        "SCHEDULER_LOCK_URL": f"sqlite:///{tmp_path}/locks.db",
        "JOBS": [{"id": "from_config", "func": f"{__name__}:_job", "trigger": "interval", "seconds": 30}],
    })  # fmt: skip
    scheduler = APScheduler(app=app)

    @scheduler.task("interval", id="decorated", seconds=30)
    def decorated() -> None:
        pass

    scheduler.start()
    try:
        sched = scheduler.scheduler
        assert sched.guard_of("from_config") is not None and sched.guard_of("decorated") is not None
        client = app.test_client()
        assert sorted(job["id"] for job in client.get("/scheduler/jobs").json) == ["decorated", "from_config"]
        refused = client.post("/scheduler/jobs/from_config/pause")
        assert refused.status_code == 500 and "reach this process only" in refused.json["error_message"], refused.json
        assert sched.get_job("from_config").next_run_time is not None  # not paused here either
        added = client.post("/scheduler/jobs", json={"id": "x", "func": f"{__name__}:_job", "trigger": "interval", "seconds": 9})
        assert added.status_code == 500 and sched.get_job("x") is None, added.json
        assert client.post("/scheduler/jobs/from_config/run").status_code == 200
        from mutexcron.guard.triggers import trigger_code

        request = sched.tasks.get(trigger_code("from_config"), "from_config")  # the code its nodes serve
        assert request is None or request.payload["requested_by"] == "Flask-APScheduler API"
        assert client.post("/scheduler/jobs/nope/run").status_code == 404
        _a_failed_request_never_answers_a_new_run(sched, client)
    finally:
        scheduler.shutdown()


def _a_failed_request_never_answers_a_new_run(sched: Any, client: Any) -> None:
    """An earlier request that failed (its holder lacked the job) is withdrawn by the next run
    request: with ``on_conflict="keep"`` the new one would join it, and never run."""
    from mutexcron.guard.triggers import trigger_code
    from mutexcron.tasks import Fail

    sched._tasks.stop(5.0)  # no task worker here from now on: requests stay as written
    store, code = sched.tasks.store, trigger_code("from_config")
    store.cancel(code, "from_config")
    store.add(code, "from_config", timedelta(0), {"requested_by": "an earlier click"})
    claimed = store.claim("another-node", [code], 1, 30.0)
    assert store.start("another-node", [(code, "from_config", claimed[0].token)]) == 1
    assert store.complete("another-node", code, "from_config", claimed[0].token, Fail("job not on its holder"))
    assert client.post("/scheduler/jobs/from_config/run").status_code == 200
    fresh = store.get(code, "from_config")
    assert fresh is not None and fresh.state == "queued", fresh
    assert fresh.payload["requested_by"] == "Flask-APScheduler API"


# -- under gunicorn -----------------------------------------------------------------------------------
class FlaskAPSchedulerGunicorn(Gunicorn):
    """``gunicorn -w 4`` serving the Flask-APScheduler example on its database."""

    def __init__(self, workdir: Path, database_url: str, lock_url: str | None, job_table: str, **env: str) -> None:
        super().__init__(workdir, lock_url or "")
        self.database_url, self.explicit_lock_url, self.job_table = database_url, lock_url, job_table
        self.env = env

    def start(self) -> None:
        conf = self.workdir / "gunicorn.conf.py"
        conf.write_text(self.config())
        extra = {"MUTEXCRON_LOCK_URL": self.explicit_lock_url} if self.explicit_lock_url else {}
        env = child_env(
            DATABASE_URL=self.database_url, FLASK_APP_JOB_TABLE=self.job_table, FLASK_APP_RUNS_LOG=str(self.runs_path),
            MUTEXCRON_UNACTIVE_INTERVAL=str(LEASE), **extra, **self.env,
        )  # fmt: skip
        cmd = [sys.executable, "-m", "gunicorn", "-c", str(conf), APP]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                start_new_session=True, preexec_fn=_die_with_pytest,
            )  # fmt: skip

    def job_runs(self, job: str) -> list[Run]:
        return job_runs(self.runs_path, job)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                text = response.read()
                return response.status, json.loads(text) if text else None
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")


def job_runs(path: Path, job: str) -> list[Run]:
    """The runs of ``job`` in a runs file (one JSON line per run, with its job's name)."""
    out: list[Run] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            fields = json.loads(line)
        except ValueError:
            continue  # a line being written
        if fields.pop("job", None) == job:
            out.append(Run(**fields))
    return out


@pytest.fixture
def flask_database(kind: str, tmp_path: Path) -> Iterator[tuple[str, str | None, str]]:
    """(job store URL, lock URL or None: the job store's database, job table) on ``kind``; dropped afterwards."""
    table = f"mc_flask_jobs_{secrets.token_hex(3)}"
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/app.db", None, table  # the locks go in the job store's file
        return
    if kind == "redis":  # the jobs in a SQLite file, the locks on Redis
        lock_url = f"{require_server(kind)}?namespace=mc-flask-{secrets.token_hex(3)}"
        yield f"sqlite:///{tmp_path}/app.db", lock_url, table
        cleanup_redis(lock_url)
        return
    base = require_server(kind)
    lock_url = sql_url(base, "mc_flask")
    drivers = {"postgresql://": "postgresql+psycopg://", "mysql://": "mysql+pymysql://"}
    database_url = next((base.replace(k, v, 1) for k, v in drivers.items() if base.startswith(k)), base)
    yield database_url, lock_url, table
    cleanup_sql(lock_url)
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        conn.execute(text(f"DROP TABLE IF EXISTS {table}_changes"))
    engine.dispose()


def _wait(server: Gunicorn, what: str, ready: Any, timeout: float = 30) -> Any:
    return server.wait(what, ready, timeout)


def _added_job(server: FlaskAPSchedulerGunicorn) -> dict[str, Any]:
    """Add ``added`` through the REST API; its runs reach the log from whichever worker holds it."""
    body = {"id": "added", "func": "examples.flask_apscheduler_app:record", "args": ["added"],
            "trigger": "interval", "seconds": 1}  # fmt: skip
    status, reply = server.call("POST", "/scheduler/jobs", body)
    assert status == 200, reply
    _wait(server, "runs of the added job", lambda: len(server.job_runs("added")) >= 3)
    return {"added": analyse(server.job_runs("added"))}


def _every_worker_sees(server: FlaskAPSchedulerGunicorn, job: str, check: Any, asks: int = 16) -> None:
    """``asks`` GETs of the job (gunicorn spreads them over its workers) all pass ``check``."""
    for _ in range(asks):
        status, reply = server.call("GET", f"/scheduler/jobs/{job}")
        assert check(status, reply), (status, reply)


def _pause_resume_remove(server: FlaskAPSchedulerGunicorn) -> dict[str, Any]:
    status, reply = server.call("POST", "/scheduler/jobs/added/pause")
    assert status == 200 and reply["next_run_time"] is None, reply
    paused_at = time.time()
    _every_worker_sees(server, "added", lambda s, r: s == 200 and r["next_run_time"] is None)
    time.sleep(2.5)
    late = [r for r in server.job_runs("added") if r.wall > paused_at + 0.5]
    run_at = time.time()  # run it now, paused: once, on the holder of its lock
    status, reply = server.call("POST", "/scheduler/jobs/added/run")
    assert status == 200, reply
    _wait(server, "the requested run", lambda: any(r.wall > run_at for r in server.job_runs("added")))
    time.sleep(1.5)
    requested = [r for r in server.job_runs("added") if r.wall > run_at]
    status, reply = server.call("POST", "/scheduler/jobs/added/resume")
    assert status == 200 and reply["next_run_time"], reply
    resumed_at = time.time()
    _wait(server, "runs after the resume", lambda: any(r.wall > resumed_at for r in server.job_runs("added")))
    status, _ = server.call("DELETE", "/scheduler/jobs/added")
    assert status == 204
    removed_at = time.time()
    _every_worker_sees(server, "added", lambda s, r: s == 404)
    time.sleep(2.5)
    after = [r for r in server.job_runs("added") if r.wall > removed_at + 0.5]
    return {"runs_while_paused": len(late), "requested_runs": len(requested), "runs_after_remove": len(after)}


def _kill_holder(server: FlaskAPSchedulerGunicorn) -> dict[str, Any]:
    """SIGKILL the worker running ``refresh_rates``; the next run elsewhere must come within the lease."""
    holder = server.job_runs("refresh_rates")[-1].pid
    os.kill(holder, signal.SIGKILL)
    killed_at = time.time()
    last = max(r.wall for r in server.job_runs("refresh_rates") if r.pid == holder)
    nxt = _wait(server, "a run on another worker", lambda: next(
        (r for r in server.job_runs("refresh_rates") if r.pid != holder and r.wall > killed_at), None))  # fmt: skip
    return {"killed": holder, "moved_after_kill": round(nxt.wall - killed_at, 3),
            "moved_after_last_run": round(nxt.wall - last, 3), "lease": LEASE}  # fmt: skip


def _scheduler_up(server: Gunicorn, pids: set[int]) -> float | None:
    """When the first of ``pids`` started its scheduler (its "using lock store" line), epoch seconds."""
    pattern = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[(\d+)\] mutexcron.scheduler INFO: node .* using lock store")
    times = [datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
             for line in server.log_path.read_text(errors="replace").splitlines()
             if (m := pattern.match(line)) and int(m[2]) in pids]  # fmt: skip
    return min(times, default=None)


def _reload(server: FlaskAPSchedulerGunicorn) -> dict[str, Any]:
    """HUP: four new workers, the old ones stopped gracefully (their leases released). Every fire
    time from the first new scheduler's start runs once; those that fell while no worker was up
    are one catch-up run (coalesced, as APScheduler does)."""
    assert server.proc is not None
    old = set(server.booted())
    hup_at = time.time()
    server.proc.send_signal(signal.SIGHUP)
    _wait(server, "4 new workers", lambda: len(set(server.booted()) - old) >= 4)
    _wait(server, "the old workers' exit", lambda: not any(pid_alive(pid) for pid in old))
    gone_at = time.time()
    _wait(server, "4 s of runs after the reload", lambda: any(r.wall >= gone_at + 4 for r in server.job_runs("refresh_rates")))
    up_at = _wait(server, "a new scheduler", lambda: _scheduler_up(server, set(server.booted()) - old))
    runs = server.job_runs("refresh_rates")
    first_after = min((r for r in runs if r.wall > up_at), key=lambda r: r.wall)
    return {
        "new_scheduler_up_after_hup": round(up_at - hup_at, 3),
        "first_run_after_up": round(first_after.wall - up_at, 3),
        "around": analyse([r for r in runs if r.fire >= hup_at - 3]),
        "after_up": analyse([r for r in runs if r.fire >= first_after.fire]),
    }


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params_full_matrix(("postgresql",), ("sqlite",)))  # SQLite: the five reloads
def test_flask_apscheduler_under_gunicorn(kind: str, flask_database: tuple[str, str | None, str], tmp_path: Path) -> None:
    require_modules("flask", "flask_apscheduler", "gunicorn")
    database_url, lock_url, table = flask_database
    result: dict[str, Any] = {"kind": kind, "lease": LEASE}
    with FlaskAPSchedulerGunicorn(tmp_path, database_url, lock_url, table) as server:
        first = _wait(server, "the first run", lambda: server.job_runs("refresh_rates"))[0]
        _wait(server, "6 s of runs", lambda: any(r.fire >= first.fire + 6 for r in server.job_runs("refresh_rates")))
        result["steady"] = analyse(server.job_runs("refresh_rates"))
        result.update(_added_job(server))
        result.update(_pause_resume_remove(server))
        result["kill"] = _kill_holder(server)
        result["reload"] = _reload(server)
        result["whole"] = analyse(server.job_runs("refresh_rates"))
        result["added_whole"] = analyse(server.job_runs("added"))
        result["stop_seconds"] = server.stop()
    _report(result)
    assert result["steady"]["pids"] == 1 or not result["steady"]["duplicated"], result
    assert not result["whole"]["duplicated"] and not result["added_whole"]["duplicated"], f"a fire time ran twice\n{result}"
    assert not result["whole"]["shared_node_ids"], result
    assert result["runs_while_paused"] == 0 and result["runs_after_remove"] == 0, result
    assert result["requested_runs"] == 1, f"POST .../run did not run the job once\n{result}"
    # A run every second: the first fire time after the lease ran out is at most a second later.
    assert result["kill"]["moved_after_kill"] < LEASE + 1.5, f"the job took longer than the lease to move\n{result}"
    reload = result["reload"]
    assert reload["first_run_after_up"] < 1.5, f"a lease-length wait after HUP\n{result}"
    assert reload["after_up"]["missed"] == 0 and not reload["around"]["duplicated"], f"HUP lost a fire time\n{result}"
    assert result["stop_seconds"] is not None, f"gunicorn needed SIGKILL\n{result}"


@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params_full_matrix(("sqlite",), ("postgresql", "mysql", "redis")))
def test_five_reloads_lose_no_fire_time(kind: str, flask_database: tuple[str, str | None, str], tmp_path: Path) -> None:
    """Issue 33/35: ``kill -HUP`` of the master 5 times, under the integration's default (balanced)
    placement. Each old worker
    leaves, keeps the lock (and runs the job) until a new worker is up, and hands it over at a
    fire-time boundary: every fire time from the first run to the last runs once."""
    require_modules("flask", "flask_apscheduler", "gunicorn")
    database_url, lock_url, table = flask_database
    with FlaskAPSchedulerGunicorn(tmp_path, database_url, lock_url, table) as server:
        first = _wait(server, "the first run", lambda: server.job_runs("refresh_rates"))[0]
        _wait(server, "3 s of runs", lambda: any(r.fire >= first.fire + 3 for r in server.job_runs("refresh_rates")))
        assert server.proc is not None
        for hup in range(1, 6):
            old = set(server.booted())
            server.proc.send_signal(signal.SIGHUP)
            _wait(server, f"HUP {hup}: 4 new workers", lambda old=old: len(set(server.booted()) - old) >= 4)
            _wait(server, f"HUP {hup}: the old workers' exit", lambda old=old: not any(pid_alive(p) for p in old))
            since = time.time()
            runs_after = lambda since=since: any(r.wall >= since + 2 for r in server.job_runs("refresh_rates"))  # noqa: E731
            _wait(server, f"HUP {hup}: 2 s of runs", runs_after)
        runs = server.job_runs("refresh_rates")
        stop_seconds = server.stop()
    result = analyse([r for r in runs if r.fire >= first.fire])
    _report({"kind": kind, "hups": 5, **result, "stop_seconds": stop_seconds})
    print(f"\n[{kind}] 5 HUPs: {result['fire_times']} fire times run, {result['missed']} missed, "
          f"{len(result['duplicated'])} run twice, largest gap {result['max_gap']}s")  # fmt: skip
    assert result["pids"] >= 2, f"the job never moved to a new worker\n{result}"
    assert not result["duplicated"], f"a fire time ran twice\n{result}"
    assert result["missed"] == 0, f"a reload lost a fire time\n{result}"


def test_the_example_changes_only_the_import() -> None:
    """The example's module names the import it replaces (the docs' before/after)."""
    text = (REPO / "examples" / "flask_apscheduler_app.py").read_text()
    assert "from mutexcron.contrib.flask import APScheduler  # was: from flask_apscheduler import APScheduler" in text
