"""The nodes' jobs module (``manage.py mutexcron run`` runs ``sched``): one every-second job in the
shared DjangoJobStore; each run appends a JSON line to $DJ_RUNS_LOG."""

from __future__ import annotations

import json
import os
import time

from django_apscheduler.jobstores import DjangoJobStore

from mutexcron import MutexScheduler, current_lease

sched = MutexScheduler(jobstores={"default": DjangoJobStore()})


def record(job: str) -> None:
    lease = current_lease()
    line = json.dumps({"job": job, "pid": os.getpid(), "node": lease.node_id, "fire": lease.fire_time.timestamp(),
                       "token": lease.token, "wall": time.time()})  # fmt: skip
    fd = os.open(os.environ["DJ_RUNS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


sched.add_job(record, "interval", seconds=1, args=["tick"], id="tick", replace_existing=True)
sched.add_job(record, "interval", hours=1, args=["hourly"], id="hourly", replace_existing=True)  # run from the admin
