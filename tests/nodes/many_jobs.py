"""A jobs file for tests/test_scale_cluster.py: N every-second guarded jobs, each with its own lock.

Each node appends ``<job> <fire time> <node>`` per run to ``$MANY_JOBS_DIR/runs-<pid>.txt``,
buffered and flushed twice a second so that recording costs the job almost nothing.
"""

from __future__ import annotations

import collections
import os
import threading
import time

from mutexcron import MutexScheduler, current_lease

OUT = os.path.join(os.environ["MANY_JOBS_DIR"], f"runs-{os.getpid()}.txt")
NODE = os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid()))
lines: collections.deque[str] = collections.deque()


def flush_forever() -> None:
    while True:
        time.sleep(0.5)
        batch = [lines.popleft() for _ in range(len(lines))]
        if batch:
            with open(OUT, "a", encoding="utf-8") as out:
                out.write("".join(batch))


threading.Thread(target=flush_forever, daemon=True).start()
sched = MutexScheduler()


def make(j: int):  # type: ignore[no-untyped-def]
    def job() -> None:
        lines.append(f"{j} {current_lease().fire_time.timestamp():.0f} {NODE}\n")

    return job


for j in range(int(os.environ["MANY_JOBS"])):
    sched.add_job(make(j), "cron", second="*", id=f"job{j}", mutex=f"many-{j}")
