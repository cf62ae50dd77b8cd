"""tasks.py's peer worker: the same no-op load on procrastinate (``--peer procrastinate``).

    python benchmarks/task_peer.py   # started by tasks.py, one process per worker

procrastinate is a benchmark-only dependency (``pip install procrastinate==3.10.0``), never one
of mutexcron's. Configured by the environment tasks.py gives the workers:
``MUTEXCRON_BENCH_PG`` (the conninfo of a database of its own, with procrastinate's schema),
``MUTEXCRON_BENCH_CONCURRENCY`` (the worker's ``concurrency``), ``MUTEXCRON_BENCH_DIR``,
``MUTEXCRON_BENCH_GATE`` and ``MUTEXCRON_NODE_ID`` as for ``task_nodes.py``. Everything else is
procrastinate's default: LISTEN/NOTIFY plus a 5 s fetch poll, finished jobs kept
(``delete_jobs="never"``).

The task is an async no-op (what procrastinate recommends with ``concurrency`` > 1): its first
line appends ``code key due_us start_us node`` to this worker's starts file, like
``task_nodes.py``'s handler (``due_us``: the job's ``scheduled_at``, 0 when it has none).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from procrastinate import App, JobContext, PsycopgConnector

CODE = "bench_noop"


def make_app(conninfo: str, out: Path | None = None, node: str = "") -> tuple[App, Any]:
    """The app on ``conninfo`` and its no-op task (which records its starts in ``out``)."""
    app = App(connector=PsycopgConnector(conninfo=conninfo))
    fd = os.open(out / f"{node}.starts", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if out else -1

    @app.task(name=CODE, pass_context=True)
    async def noop(context: JobContext, key: str) -> None:
        now_us = round(time.time() * 1_000_000)
        if fd >= 0:
            at = context.job.scheduled_at
            due_us = round(at.timestamp() * 1_000_000) if at is not None else 0
            os.write(fd, f"{CODE} {key} {due_us} {now_us} {node}\n".encode())

    return app, noop


def main() -> None:
    from mutexcron.drill import die_with_parent

    die_with_parent()
    node = os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid()))
    out = Path(os.environ["MUTEXCRON_BENCH_DIR"])
    app, _ = make_app(os.environ["MUTEXCRON_BENCH_PG"], out, node)
    (out / f"{node}.ready").write_text(str(os.getpid()))
    gate = os.environ.get("MUTEXCRON_BENCH_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.005)
    app.run_worker(concurrency=int(os.environ.get("MUTEXCRON_BENCH_CONCURRENCY", "1")), name=node)


if __name__ == "__main__":
    main()
