"""A `mutexcron run` jobs file for the dashboard tests: two locks, a job that fails at times, a
six-hourly job to trigger by hand, and a task handler that fails until ``$DASH_DIR/smtp-up`` exists.
A shared job store (``$DASH_JOBSTORE_URL``, table ``$DASH_JOBSTORE_TABLE``) holds two shared jobs
that every node adds at start-up: ``weekly_digest`` and ``purge_sessions``.

Each run of ``nightly_report`` appends its node to ``$DASH_DIR/reports.log``; each task run of
``email.send`` appends its key to ``$DASH_DIR/emails.log``; each run of a shared job its id to
``$DASH_DIR/shared.log``.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

from mutexcron import MutexScheduler, current_lease
from mutexcron.tasks.handlers import Task

DIR = Path(os.environ["DASH_DIR"])
sched = MutexScheduler(
    jobstores={
        "default": MemoryJobStore(),
        "shared": SQLAlchemyJobStore(
            url=os.environ.get("DASH_JOBSTORE_URL", f"sqlite:///{DIR}/jobs.db"),
            tablename=os.environ.get("DASH_JOBSTORE_TABLE", "apscheduler_jobs"),
        ),
    }
)


def shared_job(job: str) -> None:
    """A shared job (the store keeps ``dashboard_jobs:shared_job``, importable on every node)."""
    with open(DIR / "shared.log", "a") as out:
        out.write(job + "\n")


sched.add_job(shared_job, "cron", day_of_week="mon", hour=6, id="weekly_digest", kwargs={"job": "weekly_digest"},
              jobstore="shared", replace_existing=True)  # fmt: skip
sched.add_job(shared_job, "interval", minutes=30, id="purge_sessions", kwargs={"job": "purge_sessions"},
              jobstore="shared", replace_existing=True)  # fmt: skip


@sched.mutex(lock="billing", unactive_interval=5)  # a takeover misses fire times, inside their grace (2 x 5 s)
@sched.interval_schedule(seconds=2, id="close_invoices")
def close_invoices() -> None:
    time.sleep(random.uniform(0.01, 0.25))


@sched.mutex(lock="billing", unactive_interval=5)
@sched.interval_schedule(seconds=3, id="send_reminders")
def send_reminders() -> None:
    time.sleep(random.uniform(0.01, 0.1))
    if random.random() < 0.3:
        raise ConnectionError("SMTP 451: mail server busy, try later")


@sched.mutex(lock="reports", unactive_interval=3)
@sched.interval_schedule(hours=6, id="nightly_report")
def nightly_report() -> None:
    with open(DIR / "reports.log", "a") as out:
        out.write(current_lease().node_id + "\n")


@sched.tasks.handler("email.send", max_attempts=2, backoff=0.2, backoff_max=0.2)
def send_email(task: Task) -> None:
    if not (DIR / "smtp-up").exists():
        raise ConnectionRefusedError("SMTP connection refused by mail.example.com:25")
    with open(DIR / "emails.log", "a") as out:
        out.write(task.key + "\n")
