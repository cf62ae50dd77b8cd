"""tasks.py's PgQueuer peer worker: the same no-op load on PgQueuer (``--peer pgqueuer``).

    python benchmarks/task_pgqueuer.py   # started by tasks.py, one process per worker

PgQueuer is a benchmark-only dependency (``pip install -e '.[bench]'``: pgqueuer, asyncpg), never
one of mutexcron's. Configured by the environment tasks.py gives the workers:
``MUTEXCRON_BENCH_PG`` (the DSN of a database of its own, with PgQueuer's schema installed),
``MUTEXCRON_BENCH_BATCH`` (``QueueManager.run(batch_size=...)``; PgQueuer's default is 10),
``MUTEXCRON_BENCH_DIR``, ``MUTEXCRON_BENCH_GATE`` and ``MUTEXCRON_NODE_ID`` as for
``task_nodes.py``. Everything else is PgQueuer's default (LISTEN/NOTIFY, buffered status log,
heartbeats); one asyncpg connection per worker, as in PgQueuer's own examples.

The entrypoint is an async no-op whose first line appends ``code key due_us start_us node`` to
this worker's starts file (the key is the job's payload; ``due_us`` its ``execute_after``).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

CODE = "bench_noop"


async def connect(dsn: str) -> tuple[Any, Any]:
    """An asyncpg connection and PgQueuer's Queries on it."""
    import asyncpg
    from pgqueuer import Queries

    conn = await asyncpg.connect(dsn)
    return conn, Queries.from_asyncpg_connection(conn)


async def install(dsn: str) -> None:
    conn, queries = await connect(dsn)
    try:
        await queries.install()
    finally:
        await conn.close()


async def enqueue(dsn: str, keys: list[str], ahead: list[float] | None = None, chunk: int = 1000) -> None:
    """Enqueue one job per key (payload: the key), due now or ``ahead`` seconds from the server's clock."""
    from datetime import timedelta

    conn, queries = await connect(dsn)
    try:
        for i in range(0, len(keys), chunk):
            part = keys[i : i + chunk]
            after = [timedelta(seconds=a) for a in ahead[i : i + chunk]] if ahead else None
            await queries.enqueue([CODE] * len(part), [k.encode() for k in part], [0] * len(part), after)
    finally:
        await conn.close()


async def work(dsn: str, batch: int, out: Path, node: str) -> None:
    from pgqueuer import QueueManager
    from pgqueuer.models import Job

    conn, queries = await connect(dsn)
    qm = QueueManager(queries)
    fd = os.open(out / f"{node}.starts", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @qm.entrypoint(CODE)
    async def noop(job: Job) -> None:
        now_us = round(time.time() * 1_000_000)
        key = (job.payload or b"").decode()
        due_us = round(job.execute_after.timestamp() * 1_000_000)
        os.write(fd, f"{CODE} {key} {due_us} {now_us} {node}\n".encode())

    (out / f"{node}.ready").write_text(str(os.getpid()))
    gate = os.environ.get("MUTEXCRON_BENCH_GATE")
    while gate and not os.path.exists(gate):
        await asyncio.sleep(0.005)
    try:
        await qm.run(batch_size=batch)
    finally:
        await conn.close()


def main() -> None:
    from mutexcron.drill import die_with_parent

    die_with_parent()
    node = os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid()))
    out = Path(os.environ["MUTEXCRON_BENCH_DIR"])
    asyncio.run(work(os.environ["MUTEXCRON_BENCH_PG"], int(os.environ.get("MUTEXCRON_BENCH_BATCH", "10")), out, node))


if __name__ == "__main__":
    main()
