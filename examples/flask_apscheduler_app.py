"""A Flask-APScheduler app, once per fire time under ``gunicorn -w 4`` and on several hosts.

    pip install "mutexcron[flask,postgresql]" gunicorn
    DATABASE_URL=postgresql+psycopg://app@db/app gunicorn -w 4 -b 127.0.0.1:8000 examples.flask_apscheduler_app:app
    curl 127.0.0.1:8000/scheduler/jobs

The one line that changed from a plain Flask-APScheduler app is the import of ``APScheduler``.
Every gunicorn worker starts the scheduler, as before; ``refresh_rates`` runs once per second
across all of them (and every host running the app), and the jobs live in the app's database
(``SCHEDULER_JOBSTORES``), so a job added, paused, resumed or removed through the REST API
(``/scheduler/jobs``...) reaches every worker. The locks are kept in the same database.

``FLASK_APP_RUNS_LOG`` (tests only): append one JSON line per run to that file;
``FLASK_APP_JOB_TABLE`` (tests only): the job table's name.
"""

from __future__ import annotations

import json
import logging
import os
import time

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from flask import Flask

from mutexcron import current_lease
from mutexcron.contrib.flask import APScheduler  # was: from flask_apscheduler import APScheduler

logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(process)d] %(name)s %(levelname)s: %(message)s")
logging.getLogger("apscheduler").setLevel(logging.WARNING)

DATABASE_URL = os.environ.get("DATABASE_URL", "sqlite:///flask_apscheduler_app.db")
RUNS_LOG = os.environ.get("FLASK_APP_RUNS_LOG")


class Config:
    SCHEDULER_API_ENABLED = True
    SCHEDULER_JOBSTORES = {
        "default": SQLAlchemyJobStore(url=DATABASE_URL, tablename=os.environ.get("FLASK_APP_JOB_TABLE", "apscheduler_jobs"))
    }
    JOBS = [{"id": "refresh_rates", "func": "examples.flask_apscheduler_app:refresh_rates", "trigger": "cron", "second": "*"}]


scheduler = APScheduler()


def refresh_rates() -> None:
    record("refresh_rates")


def record(job: str) -> None:
    """One run: a JSON line in ``FLASK_APP_RUNS_LOG`` (its fire time, token and node)."""
    lease = current_lease()
    if not RUNS_LOG:
        return
    line = json.dumps({"job": job, "pid": os.getpid(), "node": lease.node_id, "fire": lease.fire_time.timestamp(),
                       "token": lease.token, "wall": time.time()})  # fmt: skip
    fd = os.open(RUNS_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # one write per line: no interleaving
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.from_object(Config())
    scheduler.init_app(app)
    scheduler.start()
    return app


app = create_app()
