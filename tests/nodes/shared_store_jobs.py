"""The jobs file of the shared-store cluster test's nodes: ``mutexcron run tests.nodes.shared_store_jobs:sched``.

No job is declared here: a separate process adds them to the shared job store. The store comes from
``$MUTEXCRON_TEST_JOBSTORE`` (JSON: ``{"kind": ..., "options": {...}}``, :func:`tests.shared_jobs.jobstore_from_spec`);
each node appends its job events (added, modified, removed) to ``$MUTEXCRON_TEST_RUNS``.
"""

from __future__ import annotations

import json
import os

from apscheduler.events import EVENT_JOB_ADDED, EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED

from mutexcron import MutexScheduler
from tests.shared_jobs import jobstore_from_spec, record_event

sched = MutexScheduler(jobstores={"default": jobstore_from_spec(json.loads(os.environ["MUTEXCRON_TEST_JOBSTORE"]))})
sched.add_listener(record_event, EVENT_JOB_ADDED | EVENT_JOB_MODIFIED | EVENT_JOB_REMOVED)
