"""The decorator API of a MutexScheduler: ``@sched.mutex``, ``@sched.cron_schedule``, ``@sched.interval_schedule``.

Each decorator applies only to the function it decorates, and ``mutex`` works above or below the
schedule decorators (and APScheduler's ``scheduled_job``): below, it marks the function for
``add_job``; above, it guards the jobs already added.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from ..errors import ConfigurationError
from ..observability.pings import check_ping
from .job import MutexConfig, _seconds

_JOB_OPTIONS = (
    "args",
    "kwargs",
    "id",
    "name",
    "misfire_grace_time",
    "coalesce",
    "max_instances",
    "next_run_time",
    "jobstore",
    "executor",
    "replace_existing",
)


class ScheduleDecorators:
    """Mixed into MutexSchedulerMixin, which provides ``add_job`` and ``_guard_existing``."""

    _setup_lock: threading.RLock
    add_job: Callable[..., Any]
    _guard_existing: Callable[[Any, Callable[..., Any], MutexConfig], None]

    def mutex(
        self,
        lock: str | Callable[[], Any] | None = None,
        lock_else: Callable[[Any], Any] | None = None,
        unactive_interval: timedelta | float | None = None,
        heartbeat: Callable[..., Any] | None = None,
        ping: str | None = None,
        nodes: str | Sequence[str] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Guard a job with a named lock. Works above or below ``cron_schedule``/``scheduled_job``.

        Args:
            lock: the lock name (default: the function's ``__qualname__``). Jobs sharing a name
                form a group that moves between nodes together. A callable selects the
                non-atomic callable-lock mode with your own ``lock()`` and ``heartbeat()``.
            lock_else: called with the LockRecord on a node that is not the holder, at each tick.
            unactive_interval: lease length: a holder whose heartbeat is older than this, by the
                store's clock, is dead (seconds or timedelta; default the scheduler's, 10 s).
            heartbeat: callable-lock mode only: ``heartbeat(ip, now, **attrs)``.
            ping: a monitor's ping URL, pinged when each run starts and ends on the node that runs
                it: healthchecks.io's ``https://hc-ping.com/<uuid>``, or a template with ``{state}``
                (Cronitor's ``https://cronitor.link/p/<api-key>/{job}?state={state}``); ``{job}``
                and ``{lock}`` are filled in. See :mod:`mutexcron.observability.pings`.
            nodes: only nodes whose id matches this glob pattern (or one of a list) ever ask for
                the lock, for example ``"reports-*"``; the others never run its jobs.
        """
        config = MutexConfig(lock, lock_else, _seconds(unactive_interval, "unactive_interval"), heartbeat, ping, nodes)

        def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
            jobs = getattr(func, "__mutexcron_jobs__", None)
            if jobs:  # mutex above the schedule decorator: guard the jobs already added
                with self._setup_lock:
                    for job in jobs:
                        self._guard_existing(job, func, config)
            else:
                if ping is not None:  # not added yet: name the job by its default id
                    check_ping(ping, getattr(func, "__qualname__", repr(func)))
                func.__mutexcron_mutex__ = config  # type: ignore[attr-defined]
            return func

        return decorate

    def cron_schedule(self, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Schedule the function with cron fields (``second``, ``minute``, ``hour``, ``day_of_week``...)."""
        return self._schedule_decorator("cron", options)

    def interval_schedule(self, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Schedule the function every ``weeks``/``days``/``hours``/``minutes``/``seconds``."""
        return self._schedule_decorator("interval", options)

    def _schedule_decorator(self, kind: str, options: dict[str, Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        job_options = {k: options.pop(k) for k in list(options) if k in _JOB_OPTIONS}

        def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
            fields = dict(options)
            fields["timezone"] = fields.get("timezone") or self.timezone  # type: ignore[attr-defined]
            try:
                trigger = (CronTrigger if kind == "cron" else IntervalTrigger)(**fields)
            except (ValueError, TypeError) as exc:
                name = getattr(func, "__qualname__", repr(func))
                raise ConfigurationError(f"bad {kind} schedule for job {name!r} {options}: {exc}") from None
            self.add_job(func, trigger, **job_options)
            return func

        return decorate

