"""Flask-APScheduler, cluster-safe: ``from mutexcron.contrib.flask import APScheduler`` in place of
``from flask_apscheduler import APScheduler``; the app's config, ``init_app``, ``@scheduler.task``
and ``scheduler.start()`` stay as they are.

* The scheduler is a :class:`~mutexcron.MutexScheduler`: every job, from ``JOBS`` /
  ``SCHEDULER_JOBS``, ``@scheduler.task`` or the REST API, is guarded (a lock per job id unless the
  function's ``@sched.mutex`` says otherwise; ``mutex=False`` opts one out), so it runs once per fire
  time across every worker and host. Placement is ``balanced`` unless set: the workers share the
  locks, and a reload hands each one over at a fire-time boundary (no fire time lost).
* A ``SCHEDULER_JOBSTORES`` store of APScheduler's (``SQLAlchemyJobStore``...) is shared, as for any
  ``MutexScheduler``: a job added, changed, paused or removed in one process reaches every process.
* The lock store: ``SCHEDULER_LOCK_URL``, else ``$MUTEXCRON_LOCK_URL``, else the database of the first
  ``SQLAlchemyJobStore`` in ``SCHEDULER_JOBSTORES``, else ``SQLALCHEMY_DATABASE_URI``. Without any of
  them ``start()`` refuses: a default SQLite file in each process's working directory would not be
  shared by another host.
* The REST API acts on the cluster: ``POST /scheduler/jobs/<id>/run`` asks the job's lock holder to run
  it once now (``mutexcron trigger``'s request). A change through the API to a job kept in a
  ``MemoryJobStore`` (each process's own copy) would reach one process only: it is refused (HTTP 500
  with the reason, as Flask-APScheduler reports errors), naming the fix.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from apscheduler.util import ref_to_obj, undefined

from ..errors import ConfigurationError

try:
    from flask_apscheduler import APScheduler as _FlaskAPScheduler
except ImportError as exc:  # pragma: no cover - the extra not installed
    raise ConfigurationError(f"mutexcron.contrib.flask needs Flask-APScheduler: pip install 'mutexcron[flask]' ({exc})") from exc
from ..guard import apscheduler_internals as aps
from ..guard.run_requests import withdraw_stale_request
from ..guard.triggers import trigger_code
from ..jobstores import is_shared
from ..jobstores.lockstore import sql_lock_url
from ..locks import URL_ENV
from ..scheduler import MutexScheduler
from ..urls import mask_url

__all__ = ["APScheduler", "FlaskMutexScheduler", "lock_url_from_config", "sqlalchemy_lock_url"]

log = logging.getLogger(__name__)

#: The Flask config key of the lock store URL.
LOCK_URL_KEY = "SCHEDULER_LOCK_URL"
#: Who the REST API's run requests say asked for them.
REQUESTED_BY = "Flask-APScheduler API"

class FlaskMutexScheduler(MutexScheduler):
    """The ``MutexScheduler`` behind :class:`APScheduler`: a job added without ``mutex=`` is guarded
    (a lock per job id), as Flask-APScheduler's apps expect every job to run once.

    Its placement is ``balanced``, the default (unless ``placement=`` or ``$MUTEXCRON_PLACEMENT``
    says otherwise): every worker holds its share of the locks, and a worker that stops (a gunicorn
    reload, a deploy) hands each lock to a live worker at a fire-time boundary, so a reload loses no fire time."""

    def add_job(
        self, func: Any, trigger: Any = None, args: Any = None, kwargs: Any = None, id: str | None = None,
        name: str | None = None, misfire_grace_time: Any = undefined, coalesce: Any = undefined,
        max_instances: Any = undefined, next_run_time: Any = undefined, jobstore: str = "default",
        executor: str = "default", replace_existing: bool = False, mutex: Any = None, **trigger_args: Any,
    ) -> Any:  # fmt: skip
        if not self._is_shared_store(jobstore):
            if isinstance(func, str):
                func = ref_to_obj(func)  # the guard wraps the function itself
            if mutex is None and getattr(func, "__mutexcron_mutex__", None) is None:
                mutex = True
        return super().add_job(
            func, trigger, args, kwargs, id, name, misfire_grace_time, coalesce, max_instances, next_run_time,
            jobstore, executor, replace_existing, mutex=mutex, **trigger_args,
        )  # fmt: skip


class APScheduler(_FlaskAPScheduler):  # type: ignore[misc]
    """Flask-APScheduler's ``APScheduler`` on a :class:`FlaskMutexScheduler` (see the module docstring).

    Args:
        scheduler: a :class:`FlaskMutexScheduler` of your own (its own ``lock_url`` is kept unless
            ``SCHEDULER_LOCK_URL`` is set); default one made here.
        app: the Flask app, as ``init_app(app)``.
    """

    def __init__(self, scheduler: FlaskMutexScheduler | None = None, app: Any = None) -> None:
        if scheduler is not None and not isinstance(scheduler, FlaskMutexScheduler):
            raise ConfigurationError(
                f"mutexcron.contrib.flask.APScheduler needs a FlaskMutexScheduler, not a {type(scheduler).__name__} "
                "(whose jobs in a memory store would run in every process): pass none (it makes one) or "
                "mutexcron.contrib.flask.FlaskMutexScheduler(...) with your options"
            )
        self._own_scheduler = scheduler is None
        self._lock_url_missing: str | None = None
        super().__init__(scheduler or FlaskMutexScheduler(), app)

    @property
    def scheduler(self) -> MutexScheduler:
        found: MutexScheduler = self._scheduler
        return found

    def _load_config(self) -> None:
        super()._load_config()
        url = lock_url_from_config(self.app.config, aps.jobstores(self._scheduler))
        if url is not None and (self._own_scheduler or self.app.config.get(LOCK_URL_KEY)):
            self._scheduler.configure_mutex(lock_url=url)
            log.info("Flask-APScheduler: locks in %s", mask_url(url))
        elif url is None and self._own_scheduler:
            self._lock_url_missing = (
                f"no lock store for the cluster: set {LOCK_URL_KEY} in the app's config (or ${URL_ENV}), "
                "or give SCHEDULER_JOBSTORES a SQLAlchemyJobStore or SQLALCHEMY_DATABASE_URI a database "
                "whose locks every worker and host can share"
            )

    def _load_jobs(self) -> None:
        """The config's jobs, each added with ``replace_existing=True`` unless it says otherwise: every
        process adds them at start-up, and a shared store keeps the first's next run time."""
        jobs = self.app.config.get("SCHEDULER_JOBS") or self.app.config.get("JOBS") or []
        for job in jobs:
            self.add_job(**{"replace_existing": True, **job})

    def start(self, paused: bool = False) -> None:
        """Flask-APScheduler's ``start``; refused without a lock store every process can share."""
        if self._lock_url_missing is not None:
            raise ConfigurationError(self._lock_url_missing)
        super().start(paused=paused)

    # -- the REST API's changes: through the shared store, refused for a process's own copy ---------
    def add_job(self, id: str, func: Any, **kwargs: Any) -> Any:
        if self._scheduler.running:
            self._refuse_local(kwargs.get("jobstore") or "default", f"add job {id!r}")
        return super().add_job(id, func, **kwargs)

    def remove_job(self, id: str, jobstore: str | None = None) -> None:
        self._refuse_local_job(id, jobstore, "remove")
        super().remove_job(id, jobstore)

    def modify_job(self, id: str, jobstore: str | None = None, **changes: Any) -> Any:
        self._refuse_local_job(id, jobstore, "change")
        return super().modify_job(id, jobstore, **changes)

    def pause_job(self, id: str, jobstore: str | None = None) -> None:
        self._refuse_local_job(id, jobstore, "pause")
        super().pause_job(id, jobstore)

    def resume_job(self, id: str, jobstore: str | None = None) -> None:
        self._refuse_local_job(id, jobstore, "resume")
        super().resume_job(id, jobstore)

    def run_job(self, id: str, jobstore: str | None = None) -> None:
        """Ask the holder of the job's lock to run it once now (``mutexcron trigger``'s request: a
        task every started node handles); the run is claimed like any fire time."""
        from apscheduler.jobstores.base import JobLookupError

        if self._scheduler.get_job(id, jobstore) is None:
            raise JobLookupError(id)
        tasks = self._scheduler.tasks
        withdraw_stale_request(tasks.store, trigger_code(id), id)  # an earlier failed request never answers this one
        tasks.add(trigger_code(id), id, timedelta(0), {"requested_by": REQUESTED_BY}, on_conflict="keep")

    def _refuse_local_job(self, job_id: str, jobstore: str | None, what: str) -> None:
        if not self._scheduler.running:
            return  # before start(): the app's own set-up, the same in every process
        job = self._scheduler.get_job(job_id, jobstore)
        if job is not None:
            self._refuse_local(aps.jobstore_alias(job), f"{what} job {job_id!r}")

    def _refuse_local(self, alias: str, what: str) -> None:
        store = aps.jobstores(self._scheduler).get(alias)
        if store is None or not is_shared(store):
            raise ConfigurationError(
                f"cannot {what}: job store {alias!r} is each process's own memory, so the change would "
                "reach this process only. Keep such jobs in SCHEDULER_JOBSTORES = {'default': "
                "SQLAlchemyJobStore(url=...)} (shared by every process), or pause their lock with "
                "`mutexcron pause LOCK`"
            )


def lock_url_from_config(config: Any, jobstores: dict[str, Any]) -> str | None:
    """The lock store of a Flask app: ``SCHEDULER_LOCK_URL``, ``$MUTEXCRON_LOCK_URL``, the first
    ``SQLAlchemyJobStore``'s database, ``SQLALCHEMY_DATABASE_URI``; None if none is set."""
    explicit = config.get(LOCK_URL_KEY) or os.environ.get(URL_ENV)
    if explicit:
        return str(explicit)
    for store in jobstores.values():
        engine = getattr(store, "engine", None)
        if engine is not None:
            return sqlalchemy_lock_url(engine.url)
    database = config.get("SQLALCHEMY_DATABASE_URI")
    if database:
        from sqlalchemy.engine import make_url

        return sqlalchemy_lock_url(make_url(database))
    return None


def sqlalchemy_lock_url(url: Any) -> str:
    """A lock store URL on the database of a SQLAlchemy URL (its driver swapped for mutexcron's)."""
    lock_url = sql_lock_url(url)
    if lock_url is None:
        raise ConfigurationError(
            f"no lock store on a {url.get_backend_name()} database in {mask_url(str(url))}: set {LOCK_URL_KEY} to "
            "a store URL every process reaches (sqlite file, mysql, postgresql, redis, mongodb)"
        )
    return lock_url
