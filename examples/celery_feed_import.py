"""Celery's "one task at a time" feed importer (the cookbook recipe), with a Mutex as the lock.

    python examples/celery_feed_import.py     # no Celery needed: calls the task function directly

As a Celery task (``pip install "celery[redis]" "mutexcron[redis]"``), from ``examples/``: the
broker (Celery's queue) and the lock store are two settings, here two Redis databases::

    export CELERY_BROKER_URL=redis://cache:6379/1       # where Celery queues the tasks
    export MUTEXCRON_LOCK_URL=redis://cache:6379/0      # where the workers' Mutex keeps its locks
    celery -A celery_feed_import worker --loglevel=INFO --concurrency=4    # on every worker host
    python -c 'from celery_feed_import import import_feed; import_feed.delay("https://example.com/feed.rss")'

The recipe's lock is ``cache.add(lock_id, oid, LOCK_EXPIRE)`` ... ``cache.delete(lock_id)``. With a
Mutex instead:

* the lease is renewed while the import runs: a slow import no longer outlives its lock and lets
  a second worker in, and a crashed worker's lock is free one lease later, not after 10 minutes;
* the release only frees the lock if this worker still holds it with its token: it can never
  delete a lock another worker took after this one's expired;
* ``lease.token`` fences the writes: the feed table refuses a write from an older holder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

from mutexcron import Mutex

log = logging.getLogger("feeds")
mutex = Mutex()  # $MUTEXCRON_LOCK_URL, else sqlite:///mutexcron.db; one per process is enough
LOCK_LEASE = 60  # s: renewed every 20 s while an import runs; a dead worker's lock is free 60 s later
FEEDS_DB = "feeds.db"  # stands in for the Django Feed model


def save_feed(feed_url: str, fence: int) -> str:
    """Fetch and store a feed (simulated); the write is refused if a newer holder already wrote."""
    time.sleep(1.0)  # download and parse
    with sqlite3.connect(FEEDS_DB) as db:
        db.execute("CREATE TABLE IF NOT EXISTS feed (url TEXT PRIMARY KEY, imported REAL, token INT)")
        db.execute("INSERT OR IGNORE INTO feed VALUES (?, 0, 0)", (feed_url,))
        changed = db.execute(
            "UPDATE feed SET imported = ?, token = ? WHERE url = ? AND token <= ?", (time.time(), fence, feed_url, fence)
        ).rowcount
    if not changed:
        raise RuntimeError(f"fenced out: a holder with a token above {fence} already imported {feed_url}")
    return feed_url


def import_feed(feed_url: str) -> str | None:
    """The task: import one feed, unless another worker is importing it right now."""
    digest = hashlib.md5(feed_url.encode(), usedforsecurity=False).hexdigest()
    log.debug("Importing feed: %s", feed_url)
    with mutex.hold(f"import-feed:{digest}", lease=LOCK_LEASE) as lease:
        if not lease:
            log.info("Feed %s is already being imported by %s", feed_url, lease.record.holder)
            return None
        return save_feed(feed_url, fence=lease.token)


try:
    from celery import Celery
except ImportError:  # Celery is optional: the function runs as is
    pass
else:
    # The broker is Celery's, not mutexcron's: MUTEXCRON_LOCK_URL only names the lock store.
    app = Celery("feeds", broker=os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/1"))
    import_feed = app.task(name="feeds.import_feed")(import_feed)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(threadName)s %(message)s")
    url = "https://example.com/feed.rss"
    with ThreadPoolExecutor(2) as workers:  # two deliveries of the same task at once: one imports
        print(list(workers.map(import_feed, [url, url])))
    print(import_feed(url))  # the lock was released: the next one imports again
