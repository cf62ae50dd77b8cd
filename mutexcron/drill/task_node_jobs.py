"""The jobs module of the task drill's nodes: ``mutexcron run mutexcron.drill.task_node_jobs:sched``.

One task handler for the drill's own task code: it records its start (node, key, token, attempt,
due and start time by the store's clock), sleeps for the task's ``payload["sleep"]`` seconds (so
a kill or a freeze lands mid-handler), records its end and returns None (done). It does not look
at ``task.lost``: a stale attempt runs to its end on purpose, so the drill sees its completion
refused by the store. The worker's store is a :class:`~mutexcron.drill.task_node_side.RecordingTaskStore`.

Configured by the environment that :func:`mutexcron.drill.run_task_drill` gives each node:

* ``MUTEXCRON_DRILL_URL``: the store;
* ``MUTEXCRON_DRILL_TASK_CODE``: the drill's task code (``mutexcron-drill-<random>``);
* ``MUTEXCRON_DRILL_TASK_LEASE``: the handler's lease in seconds;
* ``MUTEXCRON_DRILL_OUT``: a file in the drill's directory (this node writes ``<node>.tasks.jsonl``
  and reads ``<node>.hold`` beside it);
* ``MUTEXCRON_DRILL_OPS``: this node's timing file;
* ``MUTEXCRON_DRILL_PARENT``, ``MUTEXCRON_NODE_ID``: as for :mod:`mutexcron.drill.node_jobs`.

Importing it starts nothing, but it opens the store: it is meant for the node processes only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mutexcron import MutexScheduler
from mutexcron.tasks import task_store_from_url
from mutexcron.tasks.handlers import Task

from .node_side import die_with_parent, drill_env
from .task_node_side import EventLog, RecordingTaskStore, measure_offset

die_with_parent()
NODE = os.environ.get("MUTEXCRON_NODE_ID", "")
URL = drill_env("MUTEXCRON_DRILL_URL")
CODE = drill_env("MUTEXCRON_DRILL_TASK_CODE")
LEASE = float(drill_env("MUTEXCRON_DRILL_TASK_LEASE"))
WORKDIR = Path(drill_env("MUTEXCRON_DRILL_OUT")).parent

EVENTS = EventLog(WORKDIR / f"{NODE}.tasks.jsonl")
_inner = task_store_from_url(URL)
OFFSET = measure_offset(_inner)  # store clock - this node's wall clock (also opens the connection)
EVENTS.write({"event": "clock", "node": NODE, "offset": OFFSET, "pid": os.getpid(), "mono": time.monotonic()})
STORE = RecordingTaskStore(
    _inner, EVENTS, EventLog(drill_env("MUTEXCRON_DRILL_OPS")), hold_file=WORKDIR / f"{NODE}.hold", max_hold=LEASE / 2
)

sched = MutexScheduler(lock_url=URL)
# The drill's one seam into the scheduler: its pool's store is the recording one (same URL, so
# configure_mutex() keeps it), and a held claim ends as soon as the worker stops.
sched.tasks._store = STORE
if sched.tasks.store is not STORE:  # pragma: no cover - the pool's internals changed
    raise RuntimeError("the task drill could not give the scheduler's task pool its recording store")


def _worker_stopping() -> bool:
    worker = getattr(getattr(sched, "_tasks", None), "worker", None)
    return bool(worker is not None and worker.stopping)


STORE.stopping = _worker_stopping


def _record(event: str, task: Task, sleep: float) -> None:
    EVENTS.write(
        {
            "event": event,
            "node": NODE,
            "key": task.key,
            "token": task.token,
            "attempt": task.attempt,
            "due": task.due.timestamp(),
            "at": time.time() + OFFSET,
            "sleep": sleep,
            "mono": time.monotonic(),
        }
    )


@sched.tasks.handler(CODE, lease=LEASE, max_attempts=20, backoff=0.5, backoff_max=2.0)
def drill_task(task: Task) -> None:
    """Record the start, sleep ``payload["sleep"]`` seconds, record the end; done."""
    payload = task.payload if isinstance(task.payload, dict) else {}
    sleep = float(payload.get("sleep", 0.5))
    _record("start", task, sleep)
    time.sleep(sleep)
    _record("end", task, sleep)
