"""The site's jobs, run on every node by ``python manage.py mutexcron run``: each job in the
DjangoJobStore runs once per fire time across the nodes, and its runs show in the admin
(Django APScheduler > Django job executions), one row per fire time.

``SITE_RUNS_LOG`` (tests only): append one JSON line per run to that file.
"""

from __future__ import annotations

import json
import logging
import os
import time

from django_apscheduler.jobstores import DjangoJobStore

from mutexcron import MutexScheduler, current_lease

log = logging.getLogger("reports.jobs")
sched = MutexScheduler(jobstores={"default": DjangoJobStore()})  # was: BlockingScheduler() + add_jobstore(DjangoJobStore())


def record(job: str) -> None:
    """A report run: says which node ran which fire time."""
    lease = current_lease()
    log.info("%s: fire time %s on %s (token %d)", job, lease.fire_time, lease.node_id, lease.token)
    runs_log = os.environ.get("SITE_RUNS_LOG")
    if not runs_log:
        return
    line = json.dumps({"job": job, "pid": os.getpid(), "node": lease.node_id, "fire": lease.fire_time.timestamp(),
                       "token": lease.token, "wall": time.time()})  # fmt: skip
    fd = os.open(runs_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


sched.add_job(record, "interval", seconds=1, args=["tick"], id="tick", replace_existing=True)
sched.add_job(record, "interval", hours=1, args=["hourly"], id="hourly", replace_existing=True)
