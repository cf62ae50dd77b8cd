"""A jobs file whose shared job function's lock comes from ``$MUTEXCRON_TEST_LOCK`` (default ``reports``):
``mutexcron run tests.nodes.shared_lock_jobs:sched``, as old and new code in a rolling deploy that renames the lock.

The job store comes from ``$MUTEXCRON_TEST_JOBSTORE`` (:func:`tests.shared_jobs.jobstore_from_spec`).
"""

from __future__ import annotations

import json
import os

from mutexcron import MutexScheduler
from tests.shared_jobs import jobstore_from_spec, tick

LOCK = os.environ.get("MUTEXCRON_TEST_LOCK", "reports")

sched = MutexScheduler(jobstores={"default": jobstore_from_spec(json.loads(os.environ["MUTEXCRON_TEST_JOBSTORE"]))})


@sched.mutex(lock=LOCK)
def send_reports() -> None:
    tick("send-reports", tag=LOCK)
