"""The shared-jobs drill's job store and job function, importable with no side effect (the drill
process adds the jobs by their reference, the nodes run them).

* :func:`jobstore_spec`: from ``--jobstore URL`` (any SQLAlchemy URL, ``redis://``) to the spec
  that the drill and each node build the same APScheduler job store from, on a table (or keys) of
  the drill's own; :func:`jobstore_from_spec`, :func:`drop_jobstore`.
* :func:`shared_tick`: the drill's every-second shared job; each run appends
  ``{"job", "node", "fire", "token", "mono", "wall"}`` to ``$MUTEXCRON_DRILL_SHARED_OUT``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import ConfigurationError
from ..urls import mask_url

#: The job function's reference, as the drill adds the jobs (textual: the drill never imports the node side).
TICK_REF = "mutexcron.drill.shared_jobs:shared_tick"


def jobstore_spec(url: str, tag: str) -> dict[str, Any]:
    """The spec of the drill's job store at ``url``: ``{"kind", "options", "where"}``.

    Raises:
        ConfigurationError: a scheme that is not a SQLAlchemy dialect nor Redis (the fix named).
    """
    scheme = url.partition("://")[0].lower()
    if scheme in ("redis", "rediss"):
        parts = urlsplit(url)
        options: dict[str, Any] = {
            "jobs_key": f"mutexcron-drill-{tag}.jobs",
            "run_times_key": f"mutexcron-drill-{tag}.run_times",
            "host": parts.hostname or "localhost",
            "port": parts.port or 6379,
            "db": int((parts.path or "/0").strip("/") or 0),
        }
        if parts.password:
            options["password"] = unquote(parts.password)
        if parts.username:
            options["username"] = unquote(parts.username)
        if scheme == "rediss":
            options["ssl"] = True
        return {"kind": "redis", "options": options, "where": f"{mask_url(url)} (keys mutexcron-drill-{tag}.*)"}
    if scheme.startswith(("mongodb", "memory")) or not scheme:
        raise ConfigurationError(
            f"--jobstore {mask_url(url)!r}: the shared-jobs drill runs a SQLAlchemyJobStore (sqlite:///path, "
            "postgresql+psycopg://..., mysql+pymysql://...) or a RedisJobStore (redis://host:port/db); "
            "without --jobstore it uses a SQLite file of its own"
        )
    table = f"mutexcron_drill_{tag}"
    return {"kind": "sqlalchemy", "options": {"url": url, "tablename": table}, "where": f"{mask_url(url)} (table {table})"}


def jobstore_from_spec(spec: dict[str, Any]) -> Any:
    """An APScheduler job store from :func:`jobstore_spec`'s spec (its driver imported only now)."""
    if spec["kind"] == "redis":
        from apscheduler.jobstores.redis import RedisJobStore

        return RedisJobStore(**spec["options"])
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

    return SQLAlchemyJobStore(**spec["options"])


def drop_jobstore(spec: dict[str, Any]) -> str:
    """Remove the drill's job table (and its change counter) or keys; what was done, for the report."""
    store = jobstore_from_spec(spec)
    try:
        if spec["kind"] == "redis":
            options = spec["options"]
            store.redis.delete(options["jobs_key"], options["run_times_key"])
            return "the drill's job store keys deleted"
        from ..jobstores.sqlalchemy import changes_table

        store.jobs_t.drop(store.engine, checkfirst=True)
        changes_table(store.jobs_t).drop(store.engine, checkfirst=True)
        return f"the drill's job table {store.jobs_t.name} dropped"
    finally:
        store.shutdown()


def shared_tick(job: str, version: str = "v1") -> None:
    """One run of a drill job: a line in the shared runs file (the fire time the lease names, and the
    version of the jobs file that last added the job)."""
    from mutexcron import current_lease

    lease = current_lease()
    line = json.dumps({"job": job, "node": lease.node_id, "fire": lease.fire_time.timestamp(), "token": lease.token,
                       "mono": time.monotonic(), "wall": time.time(), "version": version})  # fmt: skip
    _append(line)


def record_event(event: Any) -> None:
    """A node's APScheduler job event (added, modified, removed), as a line of the shared runs file."""
    line = json.dumps({"event": event.code, "job": event.job_id, "node": os.environ.get("MUTEXCRON_NODE_ID", ""),
                       "mono": time.monotonic()})  # fmt: skip
    _append(line)


def record_ready(_event: Any) -> None:
    """The node's scheduler started (its shared job stores read and watched): a ``ready`` line."""
    _append(json.dumps({"ready": os.environ.get("MUTEXCRON_NODE_ID", ""), "mono": time.monotonic()}))


def ready_nodes(path: Any) -> set[str]:
    """The nodes whose ``ready`` line is in the shared runs file."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return set()
    return {json.loads(line)["ready"] for line in lines if line.startswith('{"ready"')}


def _append(line: str) -> None:
    fd = os.open(os.environ["MUTEXCRON_DRILL_SHARED_OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
