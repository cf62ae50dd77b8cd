"""A long guarded job that checks its lease and fences its writes with the token.

    mutexcron run examples/fenced_export.py --lock-url postgresql://app@db/ops

The export runs every minute on one node. It processes rows in batches, stops as soon as the
lease is lost (another node took over, or this node could not renew), and writes its progress
with the fencing token so a paused ex-holder can never overwrite newer work.
"""

import logging
import sqlite3
import time

from mutexcron import MutexScheduler, current_lease

log = logging.getLogger("export")
sched = MutexScheduler()
OUTPUT = "export-progress.db"  # stands in for your warehouse


def save_progress(cursor: int, token: int) -> None:
    """Accept the write only if no newer holder (higher token) has written already."""
    with sqlite3.connect(OUTPUT) as db:
        db.execute("CREATE TABLE IF NOT EXISTS progress (id INTEGER PRIMARY KEY CHECK (id = 1), cursor INT, token INT)")
        db.execute("INSERT OR IGNORE INTO progress VALUES (1, 0, 0)")
        changed = db.execute(
            "UPDATE progress SET cursor = ?, token = ? WHERE id = 1 AND token <= ?", (cursor, token, token)
        ).rowcount
        if not changed:
            raise RuntimeError(f"fenced out: a holder with a token above {token} already wrote")


@sched.mutex(lock="export", unactive_interval=15)
@sched.cron_schedule(minute="*")
def export(**attrs):
    lease = current_lease()
    cursor = attrs.get("cursor", 0)
    for _ in range(10):
        if lease.lost:
            log.warning("lease lost at cursor %d; stopping, the new holder resumes from the saved cursor", cursor)
            return None  # keep the attrs as they were
        time.sleep(0.5)  # one batch of work
        cursor += 1000
        save_progress(cursor, lease.token)
    log.info("exported up to %d (token %d)", cursor, lease.token)
    return {"cursor": cursor}
