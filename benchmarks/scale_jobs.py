"""scale.py's jobs file, run by its nodes: J every-second jobs, each guarded by its own lock.

    mutexcron run benchmarks/scale_jobs.py   # started by scale.py through mutexcron.drill.Cluster

Configured by the environment scale.py gives the nodes: ``MUTEXCRON_SCALE_JOBS`` (J),
``MUTEXCRON_SCALE_PREFIX`` (lock names ``<prefix>-<j>``), ``MUTEXCRON_SCALE_DIR`` (where each node
appends its runs), ``MUTEXCRON_SCALE_WORKERS`` (executor threads, empty for APScheduler's default),
``MUTEXCRON_SCALE_STORE_OPTIONS`` (JSON options of the store), plus the drill's ``MUTEXCRON_DRILL_*``.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mutexcron import MutexScheduler, MutexThreadPoolExecutor, current_lease
from mutexcron.drill import die_with_parent, timed_store_from_env

die_with_parent()
WORKERS = int(os.environ["MUTEXCRON_SCALE_WORKERS"] or 0)
options: dict[str, Any] = {"executors": {"default": MutexThreadPoolExecutor(WORKERS)}} if WORKERS else {}
sched = MutexScheduler(
    lock_store=timed_store_from_env(**json.loads(os.environ["MUTEXCRON_SCALE_STORE_OPTIONS"])), **options
)
OUT = os.path.join(os.environ["MUTEXCRON_SCALE_DIR"], f"runs-{os.getpid()}.txt")
PREFIX = os.environ["MUTEXCRON_SCALE_PREFIX"]
_lines: collections.deque[str] = collections.deque()


def _flush() -> None:
    while True:
        time.sleep(1.0)
        batch = [_lines.popleft() for _ in range(len(_lines))]
        if batch:
            with open(OUT, "a") as fh:
                fh.write("".join(batch))


threading.Thread(target=_flush, daemon=True).start()


def make(j: int) -> Callable[[], Any]:
    def job() -> None:
        started = time.time()
        lease = current_lease()
        _lines.append(f"{j} {lease.fire_time.timestamp():.3f} {started:.6f} {lease.node_id}\n")

    return job


for j in range(int(os.environ["MUTEXCRON_SCALE_JOBS"])):
    sched.add_job(make(j), "cron", second="*", id=f"job{j}", mutex={"lock": f"{PREFIX}-{j}"})
