"""Every private member of APScheduler 3 that mutexcron touches, in one place.

APScheduler 3 has no public hook for what a guarded job needs: the scheduled fire time inside
the job, the pending-job list before ``start()``, the trigger factory. Each function below names
the private member it uses; when upgrading APScheduler, check this module against its source
(``apscheduler/schedulers/base.py``, ``apscheduler/executors/pool.py``, ``apscheduler/job.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from apscheduler.executors.base import run_job as _run_job
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING


def pending_jobs(scheduler: Any) -> list[Any]:
    """Jobs added before ``start()``: ``BaseScheduler._pending_jobs`` holds (job, jobstore, replace)."""
    return [job for job, _alias, _replace in getattr(scheduler, "_pending_jobs", [])]


def executors(scheduler: Any) -> dict[str, Any]:
    """The scheduler's executors by alias: ``BaseScheduler._executors``."""
    found: dict[str, Any] = getattr(scheduler, "_executors", {})
    return found


def replace_executor(scheduler: Any, alias: str, executor: Any) -> None:
    """Swap an executor before ``start()`` (``_executors`` is a plain dict there)."""
    scheduler._executors[alias] = executor


def lookup_executor(scheduler: Any, alias: str) -> Any:
    """``BaseScheduler._lookup_executor``: the executor of a job, to submit a catch-up run."""
    return scheduler._lookup_executor(alias)


def create_trigger(scheduler: Any, trigger: Any, trigger_args: dict[str, Any]) -> Any:
    """``BaseScheduler._create_trigger``: a trigger from an alias and its arguments, with the
    scheduler's time zone, exactly as ``add_job`` would build it."""
    return scheduler._create_trigger(trigger, trigger_args)


def job_default(scheduler: Any, key: str) -> Any:
    """A value of ``job_defaults`` (``BaseScheduler._job_defaults``), or None."""
    return getattr(scheduler, "_job_defaults", {}).get(key)


def modify_pending(job: Any, **changes: Any) -> None:
    """``Job._modify``: change a job that is not in a job store yet (before ``start()``)."""
    job._modify(**changes)


def pool_size(executor: ThreadPoolExecutor) -> int:
    """Threads of an APScheduler ``ThreadPoolExecutor`` (``_pool._max_workers``)."""
    return int(executor._pool._max_workers)


def jobstore_alias(job: Any) -> str:
    """``Job._jobstore_alias``: passed on to ``run_job`` for its events."""
    return str(job._jobstore_alias)


def submit_to_pool(executor: Any, job: Any, work: Callable[[], list[Any]]) -> None:
    """Run ``work`` (which returns APScheduler events) on the executor's thread pool, and report
    its outcome the way ``BasePoolExecutor._do_submit_job`` does (``_pool``, ``_run_job_error``,
    ``_run_job_success``)."""

    def callback(future: Any) -> None:
        exc = future.exception()
        if exc:
            executor._run_job_error(job.id, exc, getattr(exc, "__traceback__", None))
        else:
            executor._run_job_success(job.id, future.result())

    executor._pool.submit(work).add_done_callback(callback)


def run_inline(executor: Any, job: Any, work: Callable[[], list[Any]]) -> None:
    """Run ``work`` (which returns APScheduler events) on the calling thread, and report its
    outcome as :func:`submit_to_pool`'s callback does (``_run_job_error``, ``_run_job_success``)."""
    try:
        events = work()
    except Exception as exc:  # noqa: BLE001 - reported as the pool reports a run's error
        executor._run_job_error(job.id, exc, exc.__traceback__)
    else:
        executor._run_job_success(job.id, events)


def submit_work(executor: Any, work: Callable[[], Any]) -> None:
    """Run ``work`` on the executor's thread pool (``_pool``), outside any job's accounting."""
    executor._pool.submit(work)


def release_instance(executor: Any, job: Any) -> None:
    """Give back the running-instance slot ``submit_job`` counted for a run that will not start
    (``_run_job_success`` with no events)."""
    executor._run_job_success(job.id, [])


def instances(executor: Any, job_id: str) -> int:
    """Runs of ``job_id`` the executor counted and that have not ended (``BaseExecutor._instances``)."""
    counts = getattr(executor, "_instances", None)
    return int(counts.get(job_id, 0)) if counts is not None else 0


def process_jobs(scheduler: Any, super_process: Callable[[], Any]) -> Any:
    """``BaseScheduler._process_jobs``: one pass of APScheduler's loop (submits every due job)."""
    return super_process()


def run_job(job: Any, run_time: datetime, logger_name: str) -> list[Any]:
    """APScheduler's ``run_job`` (public in the module, undocumented) for one run time."""
    events: list[Any] = _run_job(job, jobstore_alias(job), [run_time], logger_name)
    return events


def stop_processing(scheduler: Any) -> None:
    """Stop submitting jobs, as ``BaseScheduler.pause()`` does (``state = STATE_PAUSED``), but
    without its ``EVENT_SCHEDULER_PAUSED``: a shutdown is not a pause to the listeners."""
    if scheduler.state == STATE_RUNNING:
        scheduler.state = STATE_PAUSED


def dispatch_event(scheduler: Any, event: Any) -> None:
    """Deliver ``event`` to the scheduler's listeners whose mask matches its code."""
    scheduler._dispatch_event(event)


def jobstores_lock(scheduler: Any) -> Any:
    """``BaseScheduler._jobstores_lock``: held by the loop pass while it reads and updates the stores."""
    return scheduler._jobstores_lock


def lookup_stored_job(scheduler: Any, job_id: str) -> tuple[Any, Any] | None:
    """The job and the job store that holds it, or None: ``BaseScheduler._lookup_job`` (the caller
    holds :func:`jobstores_lock`)."""
    try:
        job, alias = scheduler._lookup_job(job_id, None)
    except JobLookupError:
        return None
    return (job, scheduler._jobstores[alias]) if alias is not None else None


def jobstores(scheduler: Any) -> dict[str, Any]:
    """The scheduler's job stores by alias: ``BaseScheduler._jobstores`` (a plain dict)."""
    found: dict[str, Any] = getattr(scheduler, "_jobstores", {})
    return found


def create_jobstore(scheduler: Any, plugin: str, options: dict[str, Any]) -> Any:
    """``BaseScheduler._create_plugin_instance``: a job store from its plugin alias (``"sqlalchemy"``...)."""
    return scheduler._create_plugin_instance("jobstore", plugin, options)
