"""Shared job stores in tests: APScheduler job stores on an isolated table, key pair or collection
per test, and the job functions the nodes import (module-level, so their reference restores anywhere).

A run is recorded as ``(job id, fire time, node, kwargs tag)``: in :data:`RUNS` in this process, and
appended to ``$MUTEXCRON_TEST_RUNS`` (a JSON line per run) when that is set (subprocess nodes).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mutexcron import current_lease
from tests.backends import require_server

RUNS: list[tuple[str, float, str, str]] = []
_RUNS_LOCK = threading.Lock()


def tick(job: str, tag: str = "v1", sleep: float = 0.0) -> None:
    """A shared job: records its run (the fire time is the one its lease names)."""
    lease = current_lease()
    row = (job, lease.fire_time.timestamp(), lease.node_id, tag)
    with _RUNS_LOCK:
        RUNS.append(row)
    path = os.environ.get("MUTEXCRON_TEST_RUNS")
    if path:
        _append(path, {"job": job, "fire": row[1], "node": row[2], "tag": tag, "wall": time.time()})
    if sleep:
        time.sleep(sleep)


def mark(job: str) -> None:
    """A job that records any run of it, guarded or not (no lease asked for): ``{"job", "pid"}``."""
    append_line({"job": job, "pid": os.getpid(), "wall": time.time()})


def _append(path: str, row: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def record_event(event: Any) -> None:
    """A node's APScheduler job event, as a line of ``$MUTEXCRON_TEST_RUNS``."""
    path = os.environ.get("MUTEXCRON_TEST_RUNS")
    if path:
        node = os.environ.get("MUTEXCRON_NODE_ID")
        _append(path, {"event": event.code, "job": event.job_id, "node": node, "wall": time.time()})


def append_line(row: dict[str, Any]) -> None:
    """A line of ``$MUTEXCRON_TEST_RUNS`` (when set), from a node's own test hook."""
    path = os.environ.get("MUTEXCRON_TEST_RUNS")
    if path:
        _append(path, row)


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def jobstore_from_spec(spec: dict[str, Any]) -> Any:
    """An APScheduler job store from ``{"kind": ..., "options": {...}}`` (:attr:`JobStoreCtx.spec`)."""
    kind, options = spec["kind"], spec["options"]
    if kind in ("sqlite", "mysql", "postgresql"):
        from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

        return SQLAlchemyJobStore(**options)
    if kind == "redis":
        from apscheduler.jobstores.redis import RedisJobStore

        return RedisJobStore(**options)
    from apscheduler.jobstores.mongodb import MongoDBJobStore

    return MongoDBJobStore(**options)


def runs_of(job: str) -> list[tuple[str, float, str, str]]:
    with _RUNS_LOCK:
        return [r for r in RUNS if r[0] == job]


def clear_runs() -> None:
    with _RUNS_LOCK:
        RUNS.clear()


#: The store families the tests run on (a real server each, but MongoDB: mongomock in one process).
KINDS = ("sqlite", "mysql", "postgresql", "redis", "mongomock")


@dataclass
class JobStoreCtx:
    """APScheduler job stores on one isolated place: ``make()`` opens another client on the same jobs."""

    kind: str
    make: Callable[[], Any]
    #: What a subprocess node builds the same store from (:func:`jobstore_from_spec`).
    spec: dict[str, Any] = field(default_factory=dict)


def _sql_url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/jobs.db"
    base = require_server(kind)
    rest = base.split("://", 1)[1]
    return f"mysql+pymysql://{rest}" if kind == "mysql" else f"postgresql+psycopg://{rest}"


@contextmanager
def open_jobstore(kind: str, tmp_path: Path) -> Iterator[JobStoreCtx]:
    """Yield job store factories for ``kind``; the table, keys or collection are dropped afterwards."""
    tag = secrets.token_hex(4)
    cleanup: Callable[[], None] | None = None
    if kind in ("sqlite", "mysql", "postgresql"):
        from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

        url, table = _sql_url(kind, tmp_path), f"aps_jobs_{tag}"
        options = {"url": url, "tablename": table}
        ctx = JobStoreCtx(kind, lambda: SQLAlchemyJobStore(**options), {"kind": kind, "options": options})

        def cleanup() -> None:
            import sqlalchemy

            engine = sqlalchemy.create_engine(url)
            with engine.begin() as conn:
                conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {table}"))
                conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {table}_changes"))
            engine.dispose()

    elif kind == "redis":
        from urllib.parse import urlsplit

        from apscheduler.jobstores.redis import RedisJobStore

        parts = urlsplit(require_server("redis"))
        options = {
            "host": parts.hostname or "127.0.0.1",
            "port": parts.port or 6379,
            "db": int((parts.path or "/0").strip("/") or 0),
            "jobs_key": f"aps.{tag}.jobs",
            "run_times_key": f"aps.{tag}.run_times",
        }
        ctx = JobStoreCtx(kind, lambda: RedisJobStore(**options), {"kind": kind, "options": options})

        def cleanup() -> None:
            import redis

            client = redis.Redis(host=options["host"], port=options["port"], db=options["db"])
            client.delete(options["jobs_key"], options["run_times_key"])
            client.close()

    elif kind == "mongomock":
        import mongomock
        from apscheduler.jobstores.mongodb import MongoDBJobStore

        from tests.mongomock_support import SerializedClient

        client = SerializedClient(mongomock.MongoClient(tz_aware=True))
        ctx = JobStoreCtx(kind, lambda: MongoDBJobStore(client=client, database="aps", collection=f"jobs_{tag}"))
    elif kind == "mongodb":  # a real server: MUTEXCRON_TEST_MONGODB_URL
        from apscheduler.jobstores.mongodb import MongoDBJobStore

        options = {"host": require_server("mongodb"), "database": "aps", "collection": f"jobs_{tag}"}
        ctx = JobStoreCtx(kind, lambda: MongoDBJobStore(**options), {"kind": kind, "options": options})

        def cleanup() -> None:
            import pymongo

            client: Any = pymongo.MongoClient(options["host"])
            client["aps"][options["collection"]].drop()
            client["aps"][options["collection"] + "_changes"].drop()
            client.close()

    else:  # pragma: no cover - a typo in a test
        raise ValueError(kind)
    try:
        yield ctx
    finally:
        if cleanup is not None:
            cleanup()


def start_node(jobs: str, name: str, workdir: Path, spec: dict[str, Any], *args: str, **env: str) -> Any:
    """A ``mutexcron run <jobs>`` node on the job store of ``spec`` (``$MUTEXCRON_TEST_JOBSTORE``), its
    output in ``<workdir>/<name>.log``; ``args`` are more ``run`` options, ``env`` more variables."""
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
    environ.update(MUTEXCRON_TEST_JOBSTORE=json.dumps(spec), MUTEXCRON_NODE_ID=name,
                   PYTHONPATH=os.pathsep.join([os.getcwd(), environ.get("PYTHONPATH", "")]), **env)  # fmt: skip
    with open(workdir / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "mutexcron", "run", jobs, *args], stdout=log,
                                stderr=subprocess.STDOUT, env=environ, cwd=os.getcwd(), start_new_session=True)  # fmt: skip
