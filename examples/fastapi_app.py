"""A FastAPI app whose replicas run one guarded coroutine job once per second between them.

    pip install fastapi uvicorn
    MUTEXCRON_LOCK_URL=redis://cache:6379/0 uvicorn examples.fastapi_app:app --port 8000
    MUTEXCRON_LOCK_URL=redis://cache:6379/0 uvicorn examples.fastapi_app:app --port 8001   # a replica
    curl 127.0.0.1:8000/scheduler

The app starts an ``AsyncIOMutexScheduler`` in its lifespan, on uvicorn's event loop, and stops it
there with ``await sched.shutdown_async()``: running guarded jobs finish (up to
``shutdown_timeout``) and the lease is released, so a replica takes the next tick at once. Each
replica is a node; the lease picks one holder, the others stand by.

The job is an ``async def``. Store calls run on worker threads and the lease is renewed by
mutexcron's heartbeat thread, so a job that blocks the loop delays neither (but it still blocks
your requests: keep blocking work in ``asyncio.to_thread``).

uvicorn configures its own loggers only: without a handler on the root logger, mutexcron's
INFO lines (lock acquired, taken over, store unreachable and back) would go nowhere. The lifespan
configures logging first (:func:`configure_logging`); an app with its own logging set-up keeps it.

``FASTAPI_APP_RUNS_LOG`` (tests only): append one JSON line per run to that file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from mutexcron import AsyncIOMutexScheduler, current_lease

sched = AsyncIOMutexScheduler(unactive_interval=float(os.environ.get("MUTEXCRON_UNACTIVE_INTERVAL", "10")))


@sched.mutex(lock="fastapi-app-rates")
@sched.cron_schedule(second="*")
async def refresh_rates(refreshed: int = 0) -> dict[str, Any]:
    """Runs on one replica at a time; ``refreshed`` is handed from run to run (fenced)."""
    lease = current_lease()
    runs_log = os.environ.get("FASTAPI_APP_RUNS_LOG")
    if runs_log:
        line = {"pid": os.getpid(), "fire": lease.fire_time.isoformat(), "token": lease.token}
        with open(runs_log, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
    return {"refreshed": refreshed + 1}


def configure_logging() -> None:
    """Log mutexcron's lines (INFO and up) to stderr, unless the app already configured logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    logging.getLogger("mutexcron").setLevel(logging.INFO)


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    configure_logging()
    sched.start()  # on uvicorn's running loop
    try:
        yield
    finally:
        await sched.shutdown_async()


app = FastAPI(lifespan=lifespan)


@app.get("/scheduler")
async def scheduler_status() -> dict[str, Any]:
    """This replica's view: the lock record and whether this replica holds it."""
    record = await asyncio.to_thread(sched.lock_store.read, "fastapi-app-rates")  # never block the loop
    return {
        "node": sched.node_id,
        "holder": record.holder if record else None,
        "token": record.token if record else None,
        "attrs": dict(record.attrs) if record else {},
    }
