"""The jobs module of the placement drill's nodes: ``mutexcron run mutexcron.drill.placement_node_jobs:sched``.

``$MUTEXCRON_DRILL_LOCKS`` every-second jobs under balanced placement, job ``j`` guarded by its own
lock ``<$MUTEXCRON_DRILL_LOCK>-<j>``. Each run appends ``{job, fire, node, mono}`` to the shared
runs file ``$MUTEXCRON_DRILL_OUT``; once its scheduler has started, the node appends
``{ready, mono}`` to ``$MUTEXCRON_DRILL_OUT.ready``. The lock store is the drill's timed one
(:func:`~mutexcron.drill.node_side.timed_store_from_env`); ``$MUTEXCRON_WEIGHT`` and
``$MUTEXCRON_TAGS``, when the drill sets them, are this node's weight and tags.

Importing it starts nothing, but it opens the store: it is meant for the node processes only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from apscheduler.events import EVENT_SCHEDULER_STARTED

from mutexcron import MutexScheduler, current_lease  # the public API, as in any user's jobs file

from .node_side import die_with_parent, drill_env, timed_store_from_env

die_with_parent()
sched = MutexScheduler(lock_store=timed_store_from_env(), placement="balanced")
OUT = drill_env("MUTEXCRON_DRILL_OUT")
NODE = drill_env("MUTEXCRON_NODE_ID")


def append(path: str, record: Mapping[str, Any]) -> None:
    """One JSON line, appended in one write (lines of several nodes never interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


def ready(_event: Any) -> None:
    append(OUT + ".ready", {"ready": NODE, "mono": time.monotonic()})


def run_of(job: int) -> Callable[[], None]:
    def placement_tick() -> None:
        append(OUT, {"job": job, "fire": current_lease().fire_time.timestamp(), "node": NODE, "mono": time.monotonic()})

    return placement_tick


sched.add_listener(ready, EVENT_SCHEDULER_STARTED)
for _job in range(int(drill_env("MUTEXCRON_DRILL_LOCKS"))):
    sched.add_job(run_of(_job), "cron", second="*", id=f"placement-{_job}", mutex=f"{drill_env('MUTEXCRON_DRILL_LOCK')}-{_job}")
