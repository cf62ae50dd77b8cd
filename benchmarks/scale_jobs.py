"""scale.py's guarded jobs file, run by its nodes: J every-second jobs on L locks (each its own lock by default).

    mutexcron run benchmarks/scale_jobs.py   # started by scale.py through mutexcron.drill.Cluster

Configured by the environment scale.py gives the nodes: ``MUTEXCRON_SCALE_JOBS`` (J),
``MUTEXCRON_SCALE_LOCKS`` (L: job j takes lock ``<prefix>-<j mod L>``, so L < J makes lock groups),
``MUTEXCRON_SCALE_PREFIX`` (the lock names' prefix), ``MUTEXCRON_SCALE_DIR`` (where each node
appends its runs, see ``scale_runs.py``, and the waits of its batched hand-offs),
``MUTEXCRON_SCALE_WORKERS`` (executor threads, empty for APScheduler's default),
``MUTEXCRON_SCALE_STORE_OPTIONS`` (JSON options of the store), plus the drill's ``MUTEXCRON_DRILL_*``.
The store is wrapped in the drill's node-side :class:`~mutexcron.drill.TimedLockStore`, which counts
and times every store call in the node.
``plain_jobs.py`` is the same jobs on plain APScheduler, unguarded.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from scale_runs import RunLog  # a neighbour of this file: mutexcron run puts its directory on sys.path

from mutexcron import MutexScheduler, MutexThreadPoolExecutor, current_lease
from mutexcron.drill import die_with_parent, timed_store_from_env

die_with_parent()
WORKERS = int(os.environ["MUTEXCRON_SCALE_WORKERS"] or 0)
options: dict[str, Any] = {"executors": {"default": MutexThreadPoolExecutor(WORKERS)}} if WORKERS else {}
sched = MutexScheduler(
    lock_store=timed_store_from_env(**json.loads(os.environ["MUTEXCRON_SCALE_STORE_OPTIONS"])), **options
)
PREFIX = os.environ["MUTEXCRON_SCALE_PREFIX"]
LOCKS = int(os.environ["MUTEXCRON_SCALE_LOCKS"])
runs = RunLog(os.environ["MUTEXCRON_SCALE_DIR"], os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid())))


def make(j: int) -> Callable[[], Any]:
    def job() -> None:
        started = time.time()
        runs.add(j, current_lease().fire_time.timestamp(), started)

    return job


def write_hand_off_stats() -> None:
    """Once a second, this node's batched hand-offs (calls, hand-offs, waits for a batch) to ``handoff-<pid>.json``."""
    path = os.path.join(os.environ["MUTEXCRON_SCALE_DIR"], f"handoff-{os.getpid()}.json")
    while True:
        time.sleep(1.0)
        leases = getattr(sched, "_leases", None)
        if leases is not None:
            with open(path + ".tmp", "w") as fh:
                json.dump(leases.handoff.batcher.snapshot(), fh)
            os.replace(path + ".tmp", path)


threading.Thread(target=write_hand_off_stats, name="scale-handoff-stats", daemon=True).start()
if os.environ.get("MUTEXCRON_SCALE_PROFILE"):  # profile_node.py: this node profiles itself (yappi, CPU clock)
    from profile_node import profile_in_node

    profile_in_node(os.environ["MUTEXCRON_SCALE_PROFILE"])

for j in range(int(os.environ["MUTEXCRON_SCALE_JOBS"])):
    sched.add_job(make(j), "cron", second="*", id=f"job{j}", mutex={"lock": f"{PREFIX}-{j % LOCKS}"})
