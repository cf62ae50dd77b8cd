"""The jobs module of the shared-jobs drill's nodes: ``mutexcron run mutexcron.drill.shared_node_jobs:sched``.

No job is declared here: the drill adds them to the shared job store (``$MUTEXCRON_DRILL_JOBSTORE``,
the spec of :func:`mutexcron.drill.shared_jobs.jobstore_spec`). The lock store is the drill's
timed one (``$MUTEXCRON_DRILL_URL``, :func:`~mutexcron.drill.node_side.timed_store_from_env`); each
node writes its APScheduler job events to ``$MUTEXCRON_DRILL_SHARED_OUT``, and a ``ready`` line once
its scheduler started (the drill changes the jobs only when every node is ready).

Importing it starts nothing, but it opens the stores: it is meant for the node processes only.
"""

from __future__ import annotations

import json
import os

from apscheduler.events import EVENT_JOB_ADDED, EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED, EVENT_SCHEDULER_STARTED

from mutexcron import MutexScheduler  # the public API, as in any user's jobs file

from .node_side import die_with_parent, drill_env, timed_store_from_env
from .shared_jobs import TICK_REF, jobstore_from_spec, record_event, record_ready

die_with_parent()
sched = MutexScheduler(
    lock_store=timed_store_from_env(),
    jobstores={"default": jobstore_from_spec(json.loads(drill_env("MUTEXCRON_DRILL_JOBSTORE")))},
)
sched.add_listener(record_event, EVENT_JOB_ADDED | EVENT_JOB_MODIFIED | EVENT_JOB_REMOVED)
sched.add_listener(record_ready, EVENT_SCHEDULER_STARTED)  # after its job stores were read and are watched

# The rolling restart's new jobs file: it adds one of the drill's jobs again, with a change.
_CHANGED = os.environ.get("MUTEXCRON_DRILL_JOBS_V2")
if _CHANGED:
    sched.add_job(TICK_REF, "interval", seconds=1, id=_CHANGED, kwargs={"job": _CHANGED, "version": "v2"}, replace_existing=True)
