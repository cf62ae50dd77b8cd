"""Two jobs that share one lock name move between nodes together.

    mutexcron run examples/job_group.py

`extract` and `load` both guard the lock "etl": whichever node holds it runs both, and a standby
takes both over when that node dies. The unguarded `report_local_disk` runs on every node.
"""

import logging
import shutil

from mutexcron import MutexScheduler

log = logging.getLogger("etl")
sched = MutexScheduler()


def standby(rec):
    log.info("etl runs on %s (token %d, state %s)", rec.holder, rec.token, rec.state)


@sched.mutex(lock="etl", lock_else=standby, unactive_interval=6)
@sched.interval_schedule(seconds=10)
def extract(**attrs):
    batch = attrs.get("batch", 0) + 1
    log.info("extract batch %d", batch)
    return {**attrs, "batch": batch}


@sched.cron_schedule(second="*/15")
@sched.mutex(lock="etl", unactive_interval=6)  # either order works
def load(**attrs):
    log.info("load up to batch %s", attrs.get("batch"))


@sched.interval_schedule(seconds=30)
def report_local_disk():
    log.info("free disk on this node: %.1f GB", shutil.disk_usage("/").free / 1e9)
