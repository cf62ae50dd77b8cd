"""A jobs file for tests/test_scale_cluster.py: N every-second guarded jobs, each with its own lock.

Each node appends ``<job> <fire time> <node>`` per run to ``$MANY_JOBS_DIR/runs-<pid>.txt``
(with ``MANY_JOBS_ATTRS=1``, then the run count ``n`` the job's attrs handed it: each run returns n + 1),
buffered and flushed twice a second so that recording costs the job almost nothing, and writes
``$MANY_JOBS_DIR/ready-<pid>`` once its scheduler has started (the test's window starts after all).
``MANY_JOBS_DAILY=n`` adds n daily cron jobs, each on its own lock, firing 12 hours from the start.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import time
from datetime import datetime, timedelta

from apscheduler.events import EVENT_SCHEDULER_STARTED, SchedulerEvent

from mutexcron import MutexScheduler, current_lease

OUT = os.path.join(os.environ["MANY_JOBS_DIR"], f"runs-{os.getpid()}.txt")
NODE = os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid()))
lines: collections.deque[str] = collections.deque()


def flush() -> None:
    batch = [lines.popleft() for _ in range(len(lines))]
    if batch:
        with open(OUT, "a", encoding="utf-8") as out:
            out.write("".join(batch))


def flush_forever() -> None:
    while True:
        time.sleep(0.5)
        flush()


threading.Thread(target=flush_forever, daemon=True).start()
atexit.register(flush)  # a node stopped by SIGTERM keeps its last runs
sched = MutexScheduler()


def started(_event: SchedulerEvent) -> None:
    with open(os.path.join(os.environ["MANY_JOBS_DIR"], f"ready-{os.getpid()}"), "w", encoding="utf-8"):
        pass


sched.add_listener(started, EVENT_SCHEDULER_STARTED)


def make(j: int | str):  # type: ignore[no-untyped-def]
    def job() -> None:
        lines.append(f"{j} {current_lease().fire_time.timestamp():.0f} {NODE}\n")

    def counted(n: int = 0) -> dict[str, int]:
        lines.append(f"{j} {current_lease().fire_time.timestamp():.0f} {NODE} {n}\n")
        return {"n": n + 1}

    return counted if os.environ.get("MANY_JOBS_ATTRS") == "1" else job


for j in range(int(os.environ["MANY_JOBS"])):
    sched.add_job(make(j), "cron", second="*", id=f"job{j}", mutex=f"many-{j}")

# $MANY_JOBS_TAGGED=n: n more jobs, each on its own lock, that only nodes tagged eu may hold.
for j in range(int(os.environ.get("MANY_JOBS_TAGGED", "0"))):
    sched.add_job(make(f"eu{j}"), "cron", second="*", id=f"eu{j}", mutex={"lock": f"many-eu-{j}", "nodes": "tag:eu"})

# $MANY_JOBS_DAILY=n: n more jobs, each on its own lock, that fire once a day, 12 hours from now.
daily = datetime.now() + timedelta(hours=12)
for j in range(int(os.environ.get("MANY_JOBS_DAILY", "0"))):
    sched.add_job(make(f"daily{j}"), "cron", hour=daily.hour, minute=daily.minute, id=f"daily{j}", mutex=f"many-daily-{j}")
