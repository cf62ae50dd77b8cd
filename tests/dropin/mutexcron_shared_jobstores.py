"""A pytest plugin for APScheduler's ``tests/test_jobstores.py``: its SQLAlchemy, Redis and MongoDB
job stores are mutexcron's shared flavours, started by a node that holds the lock of every job it
can run (``-p mutexcron_shared_jobstores``; see ``tests/test_apscheduler_jobstores.py``).

* APScheduler's fixtures build ``SQLAlchemyJobStore(url=...)``, ``RedisJobStore()`` and
  ``MongoDBJobStore(database=...)`` and call ``store.start(None, alias)``: each class, as the test
  module sees it, builds APScheduler's store, makes it shared (:func:`mutexcron.jobstores.share`,
  what ``MutexScheduler.start()`` does) and starts it with a ``MutexScheduler`` of its own (a
  memory lock store; never started, so no lock is taken and no job runs).
* "Holds every lock": ``get_due_jobs``/``get_next_run_time`` see the jobs this node knows and can
  restore (a job it cannot import is not held), as a node holding every lock would.
* The Redis store gets keys of its own (the fixture's defaults are shared by every process on the
  server) on ``$MUTEXCRON_TEST_REDIS_URL``; MongoDB, with no server here, is mongomock.

Each store built is named in ``$MUTEXCRON_APS_STORES`` (one class name per line): the caller checks
that the shared flavours were under test.
"""

from __future__ import annotations

import importlib
import os
import secrets
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import apscheduler.jobstores.mongodb as aps_mongodb
import apscheduler.jobstores.redis as aps_redis
import apscheduler.jobstores.sqlalchemy as aps_sqlalchemy

import mutexcron.jobstores.mongodb
import mutexcron.jobstores.redis
import mutexcron.jobstores.sqlalchemy  # noqa: F401 - the shared classes, made before the names below change
from mutexcron import MutexScheduler
from mutexcron.jobstores import SharedJobStore, share
from mutexcron.jobstores.node import SharedJobs
from mutexcron.locks.memory import MemoryLockStore


def _node() -> Any:
    return MutexScheduler(lock_store=MemoryLockStore(f"memory://aps-{secrets.token_hex(3)}"), triggers=False)


def _holds_every_lock(self: SharedJobs, store: SharedJobStore) -> set[str]:
    """The jobs of ``store`` this node knows and can run now (a node holding every lock): each is
    restored here (its guard registered), so a job whose function went since is not held."""
    known = sorted(store._known)
    states = store._read_states(known) if known else {}
    return {job_id for job_id, state in states.items() if store.restore(job_id, state) is not None}


SharedJobs.held_jobs = _holds_every_lock  # type: ignore[method-assign]


def _started_by_a_node(store: Any, alias: str) -> Any:
    shared = share(store, alias)
    start = shared.start

    def start_with_a_node(scheduler: Any, alias: str) -> None:
        start(scheduler if scheduler is not None else _node(), alias)

    shared.start = start_with_a_node
    path = os.environ.get("MUTEXCRON_APS_STORES")
    if path:
        with open(path, "a") as out:
            out.write(type(shared).__name__ + "\n")
    return shared


def _factory(original: type, alias: str, defaults: Any = None) -> Any:
    def build(*args: Any, **kwargs: Any) -> Any:
        if defaults is not None:
            defaults(kwargs)
        return _started_by_a_node(original(*args, **kwargs), alias)

    build.__name__ = build.__qualname__ = original.__name__
    return build


def _redis_defaults(kwargs: dict[str, Any]) -> None:
    if "jobs_key" in kwargs:
        return
    tag = secrets.token_hex(4)
    parts = urlsplit(os.environ.get("MUTEXCRON_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    kwargs.update(jobs_key=f"mc-aps-{tag}.jobs", run_times_key=f"mc-aps-{tag}.run_times",
                  host=parts.hostname or "127.0.0.1", port=parts.port or 6379,
                  db=int((parts.path or "/0").strip("/") or 0))  # fmt: skip


def _mongomock_defaults(kwargs: dict[str, Any]) -> None:
    if "client" not in kwargs:
        import mongomock

        support = _ours("mongomock_support")
        kwargs["client"] = support.SerializedClient(mongomock.MongoClient(tz_aware=True))


def _ours(name: str) -> Any:
    """mutexcron's ``tests.<name>`` (here ``tests`` is APScheduler's package): imported with ours in its place."""
    root = str(Path(__file__).resolve().parent.parent.parent)
    theirs = {key: sys.modules.pop(key) for key in list(sys.modules) if key == "tests" or key.startswith("tests.")}
    sys.path.insert(0, root)
    try:
        return importlib.import_module(f"tests.{name}")
    finally:
        sys.path.remove(root)
        for key in [key for key in sys.modules if key == "tests" or key.startswith("tests.")]:
            del sys.modules[key]
        sys.modules.update(theirs)


aps_sqlalchemy.SQLAlchemyJobStore = _factory(aps_sqlalchemy.SQLAlchemyJobStore, "sqlalchemy")  # type: ignore[misc]
aps_redis.RedisJobStore = _factory(aps_redis.RedisJobStore, "redis", _redis_defaults)  # type: ignore[misc]
aps_mongodb.MongoDBJobStore = _factory(aps_mongodb.MongoDBJobStore, "mongodb", _mongomock_defaults)  # type: ignore[misc]
