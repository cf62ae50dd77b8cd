"""Guarded coroutine jobs, for :class:`mutexcron.AsyncIOMutexScheduler`.

The per-run protocol is :class:`~mutexcron.guard.job.GuardedJob`'s. Two things differ:

* store calls (the tick's claim and the hand-off) run on a worker thread, so the event loop never
  waits on the network;
* the lease is renewed by the lease manager's heartbeat thread, as for every scheduler: a
  coroutine that blocks the loop cannot starve renewals (APScheduler issue #1116 is what happens
  when renewals live on the loop). If renewals do fail for longer than the lease,
  ``current_lease().lost`` turns True on the monotonic clock, loop or no loop.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import datetime
from typing import Any

from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.executors.base import run_coroutine_job

from . import apscheduler_internals as aps
from .firetimes import slot_of
from .job import _FIRE_TIME, _QUIET_ERRORS, GuardedJob, RunEnds, _run_with_fire_times, quiet_errors
from .lease import _exit


class AsyncGuardedJob(GuardedJob):
    """A guarded ``async def`` job: awaited on the scheduler's event loop."""

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fire_time = self._fire_time()
        manager = self.context.leases
        if manager is None or not manager.begin_run(self.lock):
            self._skipped(manager, fire_time, "stopping")
            return None
        try:
            token = await asyncio.to_thread(self._claim, manager, fire_time)
            run = None if token is None else self._start(manager, token, fire_time, args, kwargs)
            if run is None:
                return None
            try:
                result = await self.func(*args, **{**run.attrs, **kwargs})
            except BaseException as exc:
                _exit(run.context)
                await asyncio.to_thread(self._end, manager, run, error=exc, wait=True)
                raise
            _exit(run.context)
            await asyncio.to_thread(self._end, manager, run, result=result, wait=True)
            return result
        finally:
            manager.end_run(self.lock)


async def _run_coroutine_with_fire_times(job: Any, run_times: list[datetime], logger_name: str) -> list[Any]:
    """APScheduler's ``run_coroutine_job``, one run time at a time, with the slot visible to the job."""
    events: list[Any] = []
    for run_time in run_times:
        ctx = _FIRE_TIME.set(slot_of(job.trigger, run_time))
        quiet: list[BaseException] = []
        errors = _QUIET_ERRORS.set(quiet)
        try:
            events.extend(quiet_errors(await run_coroutine_job(job, aps.jobstore_alias(job), [run_time], logger_name), quiet))
        finally:
            _QUIET_ERRORS.reset(errors)
            _FIRE_TIME.reset(ctx)
    return events


class MutexAsyncIOExecutor(RunEnds, AsyncIOExecutor):  # type: ignore[misc]
    """APScheduler's ``AsyncIOExecutor`` that tells guarded jobs their scheduled fire time.

    Guarded coroutine jobs run on the loop; guarded plain functions run on the loop's default
    thread pool, as APScheduler runs plain functions here.
    """

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        if isinstance(job.func, AsyncGuardedJob):
            future: Any = self._eventloop.create_task(_run_coroutine_with_fire_times(job, run_times, self._logger.name))
        elif isinstance(job.func, GuardedJob):
            future = self._eventloop.run_in_executor(None, _run_with_fire_times, job, run_times, self._logger.name)
        else:
            super()._do_submit_job(job, run_times)
            return

        def callback(done: Any) -> None:
            self._pending_futures.discard(done)
            try:
                events = done.result()
            except BaseException:  # noqa: BLE001 - reported to APScheduler as the job's error
                self._run_job_error(job.id, *sys.exc_info()[1:])
            else:
                self._run_job_success(job.id, events)

        future.add_done_callback(callback)
        self._pending_futures.add(future)
