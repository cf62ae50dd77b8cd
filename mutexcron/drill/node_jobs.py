"""The jobs module of the drill's nodes: ``mutexcron run mutexcron.drill.node_jobs:sched``.

One every-second job guarded by the drill's lock appends ``{node, fire, n, token, mono, wall}``
to a file shared by all nodes. ``mono`` is ``time.monotonic()``: system-wide on Linux and, with
``FAKETIME_DONT_FAKE_MONOTONIC=1``, not shifted by libfaketime, so gaps stay true under ``--skew``.

Configured by the environment that :class:`mutexcron.drill.Cluster` gives each node:

* ``MUTEXCRON_DRILL_URL``: the store (timed by :class:`~mutexcron.drill.TimedLockStore`);
* ``MUTEXCRON_DRILL_OPS``: this node's timing file;
* ``MUTEXCRON_DRILL_OUT``: the shared ticks file;
* ``MUTEXCRON_DRILL_LOCK``: the lock name;
* ``MUTEXCRON_DRILL_PARENT``: the drill's pid (the node dies with it);
* ``MUTEXCRON_NODE_ID``: the node id.

Importing it starts nothing, but it opens the store: it is meant for the node processes only.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from mutexcron import MutexScheduler, current_lease  # the public API, as in any user's jobs file

from .node_side import die_with_parent, drill_env, timed_store_from_env

die_with_parent()
sched = MutexScheduler(lock_store=timed_store_from_env())
OUT = drill_env("MUTEXCRON_DRILL_OUT")


@sched.mutex(lock=drill_env("MUTEXCRON_DRILL_LOCK"))
@sched.cron_schedule(second="*")
def drill_tick(**attrs: Any) -> dict[str, int] | None:
    """Count the runs in the lock's attrs, then append this run's tick line to ``OUT``."""
    lease = current_lease()
    n = int(attrs.get("n", 0)) + 1
    # Commit the counter (fenced by holder and token) before the side effect: a node killed or
    # frozen after writing its line can then never hand the previous counter to the next holder.
    if not lease.save({"n": n}):
        return None
    line = json.dumps(
        {
            "node": lease.node_id,
            "fire": lease.fire_time.timestamp(),
            "n": n,
            "token": lease.token,
            "mono": time.monotonic(),
            "wall": time.time(),
        }
    )
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    return {"n": n}
