"""tasks.py's jobs file, run by its worker nodes: task handlers only, no cron jobs.

    mutexcron run benchmarks/task_nodes.py   # started by tasks.py, one process per node

One handler per node, ``MUTEXCRON_BENCH_HANDLER`` (``noop`` or ``slow``), its code from the
environment tasks.py gives the nodes:

* ``MUTEXCRON_BENCH_CODE``: a no-op. Its first line appends ``code key due_us start_us node``
  to this node's starts file (``$MUTEXCRON_BENCH_DIR/<node>.starts``; ``start_us`` is this host's
  wall clock, ``time.time()``), then it returns: done.
* ``MUTEXCRON_BENCH_SLOW_CODE`` (lease ``MUTEXCRON_BENCH_SLOW_LEASE`` s): records its start the
  same way, then sleeps until ``MUTEXCRON_BENCH_SLOW_SECONDS`` have passed or ``task.lost``
  turns True (so a node stopped mid-handler does not wait for it). tasks.py SIGKILLs the node
  running it and measures when another node starts it.

Before the scheduler starts, each node writes ``<node>.ready`` and waits for the file
``$MUTEXCRON_BENCH_GATE``: tasks.py opens the gate for all nodes at once, so the nodes' start-up
(imports, the store connection) is not part of the throughput window, and reads each node's CPU
time at that moment.

Each node counts its task store's calls (a proxy around ``sched.tasks.store``: calls, items
claimed, completed or renewed, seconds, the slowest, calls of 50 ms or more) and its round trips
(SQL statements on the store's engine, Redis commands sent), and rewrites ``<node>.calls.json``
with the totals every 0.5 s; tasks.py reads them at the start and the end of each phase. tasks.py's ``--profile`` samples one node
with py-spy (every thread, from outside the process).

``MUTEXCRON_BENCH_NO_START_MARKS=1`` (the peer comparison's baseline row) writes no started marks,
so tasks.py can say what they cost on the drain rate.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mutexcron import MutexScheduler
from mutexcron.drill import die_with_parent
from mutexcron.tasks.handlers import Task

die_with_parent()

NODE = os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid()))
OUT = Path(os.environ["MUTEXCRON_BENCH_DIR"])
HANDLER = os.environ.get("MUTEXCRON_BENCH_HANDLER", "noop")  # which one this node registers: noop or slow
CODE = os.environ.get("MUTEXCRON_BENCH_CODE", "bench_noop")
SLOW_CODE = os.environ.get("MUTEXCRON_BENCH_SLOW_CODE", "bench_slow")
SLOW_LEASE = float(os.environ.get("MUTEXCRON_BENCH_SLOW_LEASE", "3"))
SLOW_SECONDS = float(os.environ.get("MUTEXCRON_BENCH_SLOW_SECONDS", "30"))
_fd = os.open(OUT / f"{NODE}.starts", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _started(task: Task) -> None:
    """One line per handler start; a single O_APPEND write, so the handler threads never interleave."""
    now_us = round(time.time() * 1_000_000)
    due_us = round(task.due.timestamp() * 1_000_000)
    os.write(_fd, f"{task.code} {task.key} {due_us} {now_us} {NODE}\n".encode())


if os.environ.get("MUTEXCRON_BENCH_NO_START_MARKS") == "1":  # tasks.py's baseline row: what the started marks cost
    from mutexcron.tasks.completions import CompletionQueue

    CompletionQueue.mark_started = lambda self, code, key, token: None  # type: ignore[method-assign]

sched = MutexScheduler()


def noop(task: Task) -> None:
    _started(task)


def slow(task: Task) -> None:
    _started(task)
    end = time.monotonic() + SLOW_SECONDS
    while time.monotonic() < end and not task.lost:
        time.sleep(0.05)


if HANDLER == "slow":
    sched.tasks.handler(SLOW_CODE, lease=SLOW_LEASE, max_attempts=100)(slow)
else:
    sched.tasks.handler(CODE)(noop)


#: A store call at least this long (seconds) is counted as slow.
SLOW_CALL = 0.05


class CountingStore:
    """The task store, with every public call counted: ``name -> [calls, items, seconds, slowest, slow calls]``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._mutex = threading.Lock()
        self.counts: dict[str, list[float]] = {}
        self.trips = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr) or name == "waker":
            return attr
        return self._counted(name, attr)

    def _counted(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = call(*args, **kwargs)
            seconds = time.perf_counter() - t0
            items = len(result) if name == "claim" else len(args[1]) if name in ("complete_many", "renew") else 1
            with self._mutex:
                c = self.counts.setdefault(name, [0, 0, 0.0, 0.0, 0])
                c[0] += 1
                c[1] += items
                c[2] += seconds
                c[3] = max(c[3], seconds)
                c[4] += seconds >= SLOW_CALL
            return result

        return counted

    def count_trips(self) -> None:
        """Count SQL statements on the store's engine, or every Redis command this process sends."""

        def one(*_args: Any) -> None:
            self.trips += 1

        engine = getattr(getattr(self._inner, "backend", None), "engine", None)
        if engine is not None:
            from sqlalchemy import event

            event.listen(engine, "before_cursor_execute", one)
            return
        from redis.connection import AbstractConnection

        send = AbstractConnection.send_packed_command

        def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> None:
            one()
            send(conn, command, check_health)

        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]

    def dump(self, path: Path) -> None:
        with self._mutex:
            text = json.dumps({"calls": self.counts, "trips": self.trips})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _count_calls() -> None:
    """Put the counting proxy in place of the pool's store (a private slot: skipped if it moved)."""
    pool: Any = sched.tasks
    if not hasattr(pool, "_store"):
        return
    counting = CountingStore(pool.store)
    counting.count_trips()
    pool._store = counting
    path = OUT / f"{NODE}.calls.json"

    def loop() -> None:
        while True:
            counting.dump(path)
            time.sleep(0.5)

    threading.Thread(target=loop, name="bench-calls", daemon=True).start()


_count_calls()
(OUT / f"{NODE}.ready").write_text(str(os.getpid()))
_gate = os.environ.get("MUTEXCRON_BENCH_GATE")
while _gate and not os.path.exists(_gate):
    time.sleep(0.005)
