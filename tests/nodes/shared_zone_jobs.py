"""A jobs file adding a daily cron job to a shared store, in the zone ``$MUTEXCRON_TEST_ZONE`` (default UTC):
``mutexcron run tests.nodes.shared_zone_jobs:sched``, as nodes of one cluster configured in two zones.

The job store comes from ``$MUTEXCRON_TEST_JOBSTORE`` (:func:`tests.shared_jobs.jobstore_from_spec`).
"""

from __future__ import annotations

import json
import os

from mutexcron import MutexScheduler
from tests.shared_jobs import jobstore_from_spec, tick

sched = MutexScheduler(
    jobstores={"default": jobstore_from_spec(json.loads(os.environ["MUTEXCRON_TEST_JOBSTORE"]))},
    timezone=os.environ.get("MUTEXCRON_TEST_ZONE", "UTC"),
)
sched.add_job(tick, "cron", hour=9, id="daily9", kwargs={"job": "daily9"}, replace_existing=True)
