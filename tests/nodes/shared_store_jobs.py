"""The jobs file of the shared-store cluster test's nodes: ``mutexcron run tests.nodes.shared_store_jobs:sched``.

No job is declared here: a separate process adds them to the shared job store. The store comes from
``$MUTEXCRON_TEST_JOBSTORE`` (JSON: ``{"kind": ..., "options": {...}}``, :func:`tests.shared_jobs.jobstore_from_spec`);
each node appends its job events (added, modified, removed) to ``$MUTEXCRON_TEST_RUNS``.
"""

from __future__ import annotations

import json
import os

from apscheduler.events import EVENT_JOB_ADDED, EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED
from apscheduler.executors.pool import ProcessPoolExecutor

from mutexcron import MutexScheduler
from tests.shared_jobs import jobstore_from_spec, record_event

# A node with a process pool named "processpool", for the A5 test (tests/test_shared_executors.py).
_executors = {"processpool": ProcessPoolExecutor(1)} if os.environ.get("SHARED_TEST_PROCESS_POOL") else {}
sched = MutexScheduler(jobstores={"default": jobstore_from_spec(json.loads(os.environ["MUTEXCRON_TEST_JOBSTORE"]))},
                       executors=_executors)  # fmt: skip
sched.add_listener(record_event, EVENT_JOB_ADDED | EVENT_JOB_MODIFIED | EVENT_JOB_REMOVED)

# A slow removal of a finished date job (a loaded database), for the A8 test
# (tests/test_shared_date_jobs_cluster.py): the loop's removal of a date job it read due says so
# in $MUTEXCRON_TEST_RUNS ({"event": "removing"}), then waits this long, so another process can
# reschedule the job in between, as it may at any time.
_REMOVAL_DELAY = float(os.environ.get("SHARED_TEST_REMOVAL_DELAY", "0"))
if _REMOVAL_DELAY:
    import time

    from mutexcron.jobstores.base import SharedJobStore
    from tests.shared_jobs import append_line

    _remove_job = SharedJobStore.remove_job

    def _slow_loop_removal(self: SharedJobStore, job_id: str) -> None:
        if job_id in getattr(self._loop_reads, "due", {}):  # the loop's removal, not an API call
            append_line({"event": "removing", "job": job_id, "node": os.environ.get("MUTEXCRON_NODE_ID"), "wall": time.time()})
            time.sleep(_REMOVAL_DELAY)
        _remove_job(self, job_id)

    SharedJobStore.remove_job = _slow_loop_removal  # type: ignore[method-assign]
