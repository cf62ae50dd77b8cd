"""Delayed tasks beside a cron job: run this jobs file on every node.

    mutexcron run examples/delayed_tasks.py            # the default store: sqlite:///mutexcron.db
    python examples/add_tasks.py --now                 # in another terminal: tasks due now

Each node runs the handlers below on its own threads; a task runs on one node at a time, under
a lease the node renews while the handler runs. Producers (a web app, a script) add tasks with
``TaskPool(url).add(code, key, due, payload)`` or ``mutexcron tasks add``; see docs/tasks.md.

The handlers:

* ``end_promotion``: a one-off task with a payload ("end the 20% promotion of sku-123 in 3 days").
* ``send_reminder``: reschedules itself by returning a timedelta, until the payload's ``until``.
* ``charge_invoice``: an effectively-once write. Delivery is at least once (a node that stalls
  past its lease may run the task a second time), so the handler keys its write on
  ``task.idempotency_key`` under a UNIQUE constraint: a second run of the same task writes nothing.

And ``task_report``, a guarded cron job: one node a minute logs the pool's counts per code.
"""

import contextlib
import logging
import os
import sqlite3
from datetime import datetime, timedelta, timezone

from mutexcron import MutexScheduler

log = logging.getLogger("delayed_tasks")
sched = MutexScheduler()  # store from --lock-url / MUTEXCRON_LOCK_URL, default sqlite:///mutexcron.db

#: Stands in for your application's database (the promotions, the ledger).
APP_DB = os.environ.get("EXAMPLE_APP_DB", "delayed-tasks-app.db")


def app_db() -> "contextlib.closing[sqlite3.Connection]":
    db = sqlite3.connect(APP_DB, timeout=10)
    db.executescript(
        """
        CREATE TABLE IF NOT EXISTS promotion_log (sku TEXT NOT NULL, pct INTEGER NOT NULL, ended_at TEXT NOT NULL);
        CREATE TABLE IF NOT EXISTS reminder_log (user_id TEXT NOT NULL, text TEXT NOT NULL, sent_at TEXT NOT NULL);
        CREATE TABLE IF NOT EXISTS ledger (
            idempotency_key TEXT NOT NULL UNIQUE,  -- one row per task occurrence, however often it runs
            invoice         TEXT NOT NULL,
            amount_cents    INTEGER NOT NULL,
            token           INTEGER NOT NULL,      -- the fencing token of the attempt that wrote it
            charged_at      TEXT NOT NULL
        );
        """
    )
    return contextlib.closing(db)


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@sched.tasks.handler("end_promotion", lease=30, max_attempts=5)
def end_promotion(task):
    """Due at the promotion's end; the payload says which discount. Returning None: done, dropped."""
    pct = task.payload["pct"]
    with app_db() as db, db:  # the second `db`: one transaction, committed on success
        db.execute("INSERT INTO promotion_log VALUES (?, ?, ?)", (task.key, pct, utcnow()))
    log.info("ended the %d%% promotion of %s (attempt %d)", pct, task.key, task.attempt)


@sched.tasks.handler("send_reminder", lease=30, max_attempts=3, backoff=5, backoff_max=300)
def send_reminder(task):
    """Reminds ``task.key`` every ``payload["every"]`` seconds until ``payload["until"]`` (ISO 8601 with a zone).

    Returning a timedelta runs the same task again that long after now, by the store's clock (an
    aware datetime: at that time). The payload stays; attempts start again from 1.
    """
    every = timedelta(seconds=task.payload.get("every", 3600))
    with app_db() as db, db:
        db.execute("INSERT INTO reminder_log VALUES (?, ?, ?)", (task.key, task.payload["text"], utcnow()))
    log.info("reminded %s: %s", task.key, task.payload["text"])
    until = task.payload.get("until")
    if until and task.due + every > datetime.fromisoformat(until.replace("Z", "+00:00")):
        return None  # the last one: done, dropped
    return every


@sched.tasks.handler("charge_invoice", lease=60, max_attempts=8, backoff=30, backoff_max=1800)
def charge_invoice(task):
    """Charges an invoice once, even if the task is delivered twice.

    ``task.idempotency_key`` is ``code:key:due``: the same for both runs of a task that a stalled
    node and its successor both run. Key your own write on it (here a UNIQUE column; with a payment
    API, its idempotency key header) so the second write is a no-op.
    """
    if task.lost:  # the lease is gone: another node may run it; write nothing
        return None
    with app_db() as db, db:
        inserted = db.execute(
            "INSERT INTO ledger VALUES (?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING",
            (task.idempotency_key, task.key, task.payload["amount_cents"], task.token, utcnow()),
        ).rowcount
    if inserted:
        log.info("charged invoice %s: %d cents", task.key, task.payload["amount_cents"])
    else:
        log.info("invoice %s was already charged by an earlier run of this task: nothing to do", task.key)
    return None


@sched.mutex(lock="task-report")
@sched.cron_schedule(minute="*")
def task_report():
    """A guarded cron job beside the handlers: one node a minute logs the pool's counts."""
    for s in sched.tasks.store.summary(sched.tasks.codes()):
        log.info(
            "tasks %s: queued %d, due now %d, running %d, failed %d", s.code, s.queued, s.due_now, s.running, s.failed
        )
        if s.failed:
            log.warning("%d failed %s task(s): `mutexcron tasks list --state failed`, then `mutexcron tasks retry`",
                        s.failed, s.code)
