"""retention_soak.py's jobs file: one no-op task handler that records each start.

    mutexcron run benchmarks/retention_nodes.py   # started by retention_soak.py, one process per node

Each start appends ``key node`` to ``$MUTEXCRON_BENCH_DIR/<node>.starts`` (one O_APPEND write, so
handler threads never interleave); the soak counts keys started more than once. The retention
comes from ``MUTEXCRON_TASK_RETENTION``, which the soak sets.
"""

from __future__ import annotations

import os
from pathlib import Path

from mutexcron import MutexScheduler
from mutexcron.drill import die_with_parent
from mutexcron.tasks.handlers import Task

die_with_parent()

NODE = os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid()))
_fd = os.open(Path(os.environ["MUTEXCRON_BENCH_DIR"]) / f"{NODE}.starts", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

sched = MutexScheduler()


@sched.tasks.handler("soak")
def soak(task: Task) -> None:
    os.write(_fd, f"{task.key} {NODE}\n".encode())
