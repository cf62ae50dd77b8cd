"""The shared job stores of a scheduler that is not started: read their jobs, pause, resume or
remove one. What ``mutexcron jobs`` and the dashboard's Shared jobs page do.

Nothing here runs a scheduler or imports a job's function to list it (APScheduler's pickled
state is read as data). A change is a node's compare-and-set write
(:meth:`SharedJobStore.compare_and_set`) with the store's change notice, so every node sees it as
another writer's change.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Any

import sqlalchemy
from apscheduler.util import ref_to_obj

from ..errors import ConfigurationError
from ..guard import apscheduler_internals as aps
from ..names import printable
from ..urls import mask_url, mask_values, pop_query
from . import is_shared, share
from .base import SharedJobStore
from .node import config_of_function
from .states import load

__all__ = [
    "CHANGES", "change_shared_job", "is_jobstore_url", "jobstore_from_url", "parse_schedule", "reschedule_shared_job",
    "shared_stores", "stored_rows",
]  # fmt: skip

#: The changes of a shared job that ``mutexcron jobs`` and the dashboard make.
CHANGES = ("pause", "resume", "remove")


def is_jobstore_url(text: str) -> bool:
    """True if ``text`` (where a jobs file is expected) is a job store URL: ``scheme://...``."""
    return "://" in text


def jobstore_from_url(url: str) -> Any:
    """APScheduler's job store at ``url``, read without any jobs file: a SQLAlchemy URL (its table
    ``?tablename=``, default ``apscheduler_jobs``), ``redis://`` (APScheduler's default keys) or
    ``mongodb://`` (database ``apscheduler``, collection ``jobs``).

    Raises:
        ConfigurationError: a URL no APScheduler job store reads (the forms named).
    """
    scheme = url.partition("://")[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        import redis
        from apscheduler.jobstores.redis import RedisJobStore

        store = RedisJobStore()
        store.redis = redis.Redis.from_url(url)
        return store
    if scheme.startswith("mongodb"):
        from apscheduler.jobstores.mongodb import MongoDBJobStore
        from pymongo import MongoClient

        return MongoDBJobStore(client=MongoClient(url))
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    rest, options = pop_query(url, "tablename")
    try:
        return SQLAlchemyJobStore(url=rest, tablename=options.get("tablename", "apscheduler_jobs"))
    except (ArgumentError, NoSuchModuleError) as exc:
        raise ConfigurationError(
            f"{mask_url(url)} is not a job store URL: give a SQLAlchemy URL (postgresql+psycopg://..., "
            f"mysql+pymysql://..., sqlite:///...; ?tablename= for another table), redis://... or mongodb://... ({exc})"
        ) from None


def shared_stores(sched: Any) -> dict[str, SharedJobStore]:
    """The shared job stores of a scheduler that is not started, ready to read and change jobs."""
    found = {alias: share(store, alias) for alias, store in aps.jobstores(sched).items() if is_shared(store)}
    for store in found.values():
        store.prepare_changes(create=False)  # a change bumps the nodes' counter (if they made one)
    return found


def stored_rows(sched: Any, stores: dict[str, SharedJobStore]) -> list[dict[str, Any]]:
    """One dict per job of the shared ``stores`` (a read: the functions are not imported to list
    them, and a job table no node has made yet is not created)."""
    rows: list[dict[str, Any]] = []
    for alias, store in stores.items():
        if not _made(store):
            continue
        for job_id, state in sorted(store._read_states().items()):
            try:
                fields = load(state)
            except Exception as exc:  # noqa: BLE001 - shown, never deleted
                rows.append({"job": job_id, "store": alias, "declared": False, "state": "error",
                             "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
                continue
            lock, lease = _guard_of_stored(sched, fields, job_id)
            next_run = fields.get("next_run_time")
            rows.append({"job": job_id, "store": alias, "declared": False, "func": fields.get("func"),
                         "trigger": str(fields.get("trigger")), "next_run": next_run, "lock": lock, "lease": lease,
                         "guarded": True, "args": repr(mask_values(fields.get("args"))),
                         "kwargs": repr(mask_values(fields.get("kwargs"))),
                         "state": "paused" if next_run is None else "scheduled"})  # fmt: skip
    return rows


def change_shared_job(stores: dict[str, SharedJobStore], job_id: str, how: str) -> str | None:
    """Pause, resume or remove a shared job with a node's compare-and-set writes and notices; the
    outcome for people, or None if no shared store has the job. A resumed job whose schedule is
    over is removed, as APScheduler's ``resume_job`` does.

    Raises:
        ConfigurationError: ``how`` is not one of :data:`CHANGES`.
        StoreUnavailableError: the job kept changing under the write (try again); a store error.
    """
    if how not in CHANGES:
        raise ConfigurationError(f"change {how!r}: use one of {', '.join(CHANGES)}")
    for store in stores.values():
        written = store.compare_and_set(job_id, lambda current: _changed(current, how))
        if written is None:
            continue
        _state, fields = written
        if fields is None:
            return f"{job_id}: removed from {store.where}"
        return f"{job_id}: {how}d; next run {_when(fields['next_run_time'])}"
    return None


def _changed(current: bytes, how: str) -> dict[str, Any] | None:
    """The fields of a job's stored state after ``how``; None: remove it.

    Raises:
        ConfigurationError: the job cannot be read here (one line: its class is not importable...).
    """
    if how == "remove":
        return None
    try:
        fields: dict[str, Any] = load(current)
    except Exception as exc:  # noqa: BLE001 - unpickling fails in many ways: one line, never a traceback
        first = (str(exc).splitlines() or [""])[0]
        raise ConfigurationError(
            f"the job cannot be read here to {how} it ({type(exc).__name__}: {printable(first)[:200]}): run the command "
            "where the job's classes import (its code's environment), or `mutexcron jobs remove` it"
        ) from None
    if how == "pause":
        fields["next_run_time"] = None
        return fields
    fields["next_run_time"] = fields["trigger"].get_next_fire_time(None, datetime.now(timezone.utc))
    return fields if fields["next_run_time"] is not None else None  # its schedule is over: removed


def parse_schedule(text: Any, zone: Any) -> Any:
    """A new schedule for a shared job: a crontab line (``0 6 * * mon``) in ``zone``, or
    ``every N`` seconds (anchored at the Unix epoch, as every node anchors an interval).

    Raises:
        ConfigurationError: neither (the message shows both forms).
    """
    from apscheduler.triggers.cron import CronTrigger
    from apscheduler.triggers.interval import IntervalTrigger

    from ..guard.firetimes import anchor_interval

    fix = "give a crontab line ('0 6 * * mon') or 'every N' seconds ('every 300')"
    words = str(text or "").split()
    try:
        if len(words) == 2 and words[0] == "every":
            seconds = float(words[1])
            if not seconds > 0 or seconds != seconds:
                raise ValueError("a positive number of seconds")
            trigger = IntervalTrigger(seconds=seconds, timezone=zone)
            anchor_interval(trigger)
            return trigger
        return CronTrigger.from_crontab(" ".join(words), timezone=zone)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"schedule {str(text or '')!r}: {fix} ({exc})") from None


def reschedule_shared_job(stores: dict[str, SharedJobStore], job_id: str, schedule: Any) -> str | None:
    """A shared job on a new schedule (:func:`parse_schedule`, in its trigger's zone), with the same
    compare-and-set write and notice as :func:`change_shared_job`; the outcome, or None if no store
    has the job. A paused job stays paused.

    Raises:
        ConfigurationError: a schedule that is neither form (nothing is written).
        StoreUnavailableError: the job kept changing under the write (try again); a store error.
    """
    parse_schedule(schedule, "UTC")  # refused before any write

    def rescheduled(current: bytes) -> dict[str, Any]:
        fields: dict[str, Any] = load(current)
        trigger = parse_schedule(schedule, getattr(fields["trigger"], "timezone", timezone.utc))
        fields["trigger"] = trigger
        if fields.get("next_run_time") is not None:
            fields["next_run_time"] = trigger.get_next_fire_time(None, datetime.now(timezone.utc))
        return fields

    for store in stores.values():
        written = store.compare_and_set(job_id, rescheduled)
        if written is not None:
            fields = written[1] or {}
            return f"{job_id}: rescheduled to {fields.get('trigger')}; next run {_when(fields.get('next_run_time'))}"
    return None


def _when(value: Any) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if isinstance(value, datetime) else "-"


def _made(store: SharedJobStore) -> bool:
    """False for a SQL job store whose SQLite file or table no node has made yet: it has no jobs
    (and reading it would create the file, or fail)."""
    engine = getattr(store, "engine", None)
    if engine is None:
        return True
    database = engine.url.database
    if engine.dialect.name == "sqlite" and database and database != ":memory:" and not os.path.exists(database):
        return False
    table = store.jobs_t  # type: ignore[attr-defined]
    return bool(sqlalchemy.inspect(engine).has_table(table.name, schema=table.schema))


def _guard_of_stored(sched: Any, fields: dict[str, Any], job_id: str) -> tuple[str, float]:
    """A shared job's lock and lease: its function's ``@sched.mutex(...)`` if it imports here, else
    the rule's defaults (a lock per job id, the scheduler's ``unactive_interval``)."""
    try:
        config = config_of_function(ref_to_obj(fields["func"]), job_id)
    except Exception:  # noqa: BLE001 - the function is not importable here: the rule's defaults
        return job_id, float(sched.unactive_interval)
    lock = config.lock if isinstance(config.lock, str) else job_id
    return lock, float(config.unactive_interval or sched.unactive_interval)
