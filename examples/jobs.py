"""A jobs file to run on every node: `mutexcron run examples/jobs.py`.

It works as is on the embedded SQLite default (sqlite:///mutexcron.db in the current directory).
Start it in two terminals to see one node run the guarded job and the other stand by; stop the
active one (Ctrl-C) and the standby takes the next tick.
"""

import logging
from datetime import timedelta

from mutexcron import MutexScheduler, current_lease

log = logging.getLogger("jobs")
sched = MutexScheduler()  # store from --lock-url / MUTEXCRON_LOCK_URL, default sqlite:///mutexcron.db


def on_standby(lock_rec):
    """Called on a node that is not the holder, at each of its ticks."""
    log.info("standby: active node %s (%s), last heartbeat %.1fs ago, cursor=%s",
             lock_rec["holder"], lock_rec["active_ip"], lock_rec["heartbeat_age"] or 0, lock_rec.attrs.get("cursor"))


@sched.mutex(lock="billing", lock_else=on_standby, unactive_interval=timedelta(seconds=10))
@sched.cron_schedule(second="*/5")
def close_invoices(**attrs):
    """Runs on exactly one node every 5 seconds; the returned dict is handed to the next run."""
    cursor = attrs.get("cursor", 0)
    lease = current_lease()
    log.info("closing invoices from cursor %d (token %d, fire time %s)", cursor, lease.token, lease.fire_time)
    return {"cursor": cursor + 100}


@sched.interval_schedule(seconds=30)
def local_housekeeping():
    """Unguarded: runs on every node."""
    log.info("local housekeeping on this node")
