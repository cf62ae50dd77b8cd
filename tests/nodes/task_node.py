"""A `mutexcron run` jobs file for the task cluster tests: one handler that records its runs.

Each start and end is one JSON line in ``$TASK_NODE_LOG`` (node, key, token, attempt, wall
time). The payload steers the handler: ``sleep`` seconds, and ``reschedule_hours_per_token``
returns ``timedelta(hours=token * n)`` (so the store's final due shows which attempt counted);
``steps`` runs that many steps of ``step`` seconds, checking ``task.lost`` before each, and on
lost logs ``lost`` and returns after ``cleanup`` seconds (the documented pattern);
``hold_gil`` keeps the GIL that many seconds (no other thread of the node runs: no renewal).
The ``overrun`` handler (``max_attempts=1``) does the same with the payload it gets.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

from mutexcron import MutexScheduler
from mutexcron.tasks.handlers import Task

sched = MutexScheduler()
LOG = open(os.environ["TASK_NODE_LOG"], "a", buffering=1)
NODE = os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid()))


def record(event: str, task: Task) -> None:
    line = {"event": event, "node": NODE, "key": task.key, "token": task.token, "attempt": task.attempt}
    LOG.write(json.dumps({**line, "t": time.time(), "due": task.due.timestamp()}) + "\n")


@sched.tasks.handler("work", lease=float(os.environ.get("TASK_LEASE", "3")), max_attempts=10, backoff=0.5)
def work(task: Task) -> Any:
    record("start", task)
    payload = task.payload or {}
    for _ in range(int(payload.get("steps", 0))):
        if task.lost:
            record("lost", task)
            time.sleep(float(payload.get("cleanup", 0)))
            return None
        time.sleep(float(payload.get("step", 0.1)))
    time.sleep(float(payload.get("sleep", 0)))
    if "hold_gil" in payload:
        hold_gil(float(payload["hold_gil"]))
    record("end", task)
    hours = payload.get("reschedule_hours_per_token")
    return timedelta(hours=task.token * hours) if hours else None


if os.environ.get("PRUNE_LOG"):  # tests/test_task_retention.py: each purge batch's span on this node, one JSON line
    from mutexcron.tasks.stores.sql import SQLTaskStore

    PRUNE_LOG = open(os.environ["PRUNE_LOG"], "a", buffering=1)
    plain_purge_batch = SQLTaskStore.purge_batch

    def logged_purge_batch(self: SQLTaskStore, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        PRUNE_LOG.write(json.dumps({"node": NODE, "event": "begin", "t": started}) + "\n")
        batch = plain_purge_batch(self, *args, **kwargs)
        line = {"node": NODE, "event": "end", "t": time.time(), "begun": started, "removed": batch.removed}
        PRUNE_LOG.write(json.dumps(line) + "\n")
        return batch

    SQLTaskStore.purge_batch = logged_purge_batch  # type: ignore[method-assign]


@sched.tasks.handler("overrun", lease=float(os.environ.get("TASK_LEASE", "3")), max_attempts=1)
def overrun(task: Task) -> Any:
    return work(task)


def hold_gil(seconds: float) -> None:
    """Spin with a switch interval longer than ``seconds``: no other thread of this process runs."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 5)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(before)
