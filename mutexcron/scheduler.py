"""MutexScheduler: APScheduler 3 with jobs guarded by leased, fenced named locks."""

from __future__ import annotations

import contextvars
import inspect
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from apscheduler.events import JobExecutionEvent
from apscheduler.executors.base import MaxInstancesReachedError, run_job
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from apscheduler.util import undefined

from .errors import AttrsError, ConfigurationError, LeaseError
from .heartbeat import LeaseManager
from .lease import Lease, _enter, _exit
from .locks import DEFAULT_LOCK_URL, FireClaim, LockStore, Node, RunInfo, lock_store_from_url
from .node import default_node_id, outbound_ip
from .record import LockRecord, dump_attrs, us_from_datetime

log = logging.getLogger(__name__)

DEFAULT_UNACTIVE_INTERVAL = 10.0
_FIRE_TIME: contextvars.ContextVar[datetime] = contextvars.ContextVar("mutexcron_fire_time")
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


def _seconds(value: timedelta | float | int | None, what: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise ConfigurationError(f"{what} must be a positive number of seconds or a timedelta, not {value!r}")
    return seconds


@dataclass(frozen=True)
class MutexConfig:
    """How a job is guarded: the arguments of :meth:`MutexSchedulerMixin.mutex`."""

    lock: str | Callable[[], Any] | None = None
    lock_else: Callable[[Any], Any] | None = None
    unactive_interval: float | None = None  # None: the scheduler's default
    heartbeat: Callable[..., Any] | None = None

    @property
    def seed_mode(self) -> bool:
        """The seed's mode: the user's own ``lock()``/``heartbeat()`` functions (not atomic)."""
        return callable(self.lock)

    def __post_init__(self) -> None:
        if self.seed_mode:
            if not callable(self.heartbeat):
                raise ConfigurationError(
                    "mutex(lock=<callable>) is the seed-compatible mode and needs heartbeat=<callable> too "
                    "(heartbeat(ip, now, **attrs)); or pass lock='name' to use the built-in atomic store"
                )
        elif self.heartbeat is not None:
            raise ConfigurationError(
                "mutex(heartbeat=...) is only for the seed-compatible mode with lock=<callable>; "
                "built-in stores renew leases themselves"
            )
        elif self.lock is not None and (not isinstance(self.lock, str) or not self.lock.strip()):
            raise ConfigurationError(f"mutex(lock=...) must be a non-empty lock name or a callable, not {self.lock!r}")
        if self.lock_else is not None and not callable(self.lock_else):
            raise ConfigurationError(f"mutex(lock_else=...) must be callable, not {self.lock_else!r}")


def _as_config(mutex: Any) -> MutexConfig | None:
    if mutex is None or mutex is False:
        return None
    if mutex is True:
        return MutexConfig()
    if isinstance(mutex, MutexConfig):
        return mutex
    if isinstance(mutex, str):
        return MutexConfig(lock=mutex)
    if isinstance(mutex, Mapping):
        kwargs = dict(mutex)
        if "unactive_interval" in kwargs:
            kwargs["unactive_interval"] = _seconds(kwargs["unactive_interval"], "unactive_interval")
        try:
            return MutexConfig(**kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"bad mutex options {sorted(kwargs)}: {exc}") from None
    raise ConfigurationError(f"mutex= takes True, a lock name, a dict of mutex() options or a MutexConfig, not {mutex!r}")


class GuardedJob:
    """The callable APScheduler runs for a guarded job: lease check, claim, run, hand-off."""

    def __init__(self, scheduler: MutexSchedulerMixin, func: Callable[..., Any], config: MutexConfig, key: str) -> None:
        self.scheduler = scheduler
        self.func = func
        self.config = config
        self.key = key
        self.lock = config.lock if isinstance(config.lock, str) else getattr(func, "__qualname__", key)
        self.__name__ = getattr(func, "__name__", key)
        self.__qualname__ = getattr(func, "__qualname__", key)
        self.__module__ = getattr(func, "__module__", __name__)
        self.__wrapped__ = func
        self._accepts_kwargs = _accepts_var_kwargs(func)
        self._params = _param_names(func)

    @property
    def ttl(self) -> float:
        return self.config.unactive_interval or self.scheduler.unactive_interval

    def __repr__(self) -> str:
        return f"<GuardedJob {self.key!r} lock={self.lock!r}>"

    def _attr_kwargs(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        if self._accepts_kwargs:
            return dict(attrs)
        return {k: v for k, v in attrs.items() if k in self._params}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.seed_mode:
            return self._run_seed(*args, **kwargs)
        try:
            fire_time = _FIRE_TIME.get()
        except LookupError:
            raise LeaseError(
                f"guarded job {self.key!r} was called outside mutexcron's executor; it only runs when scheduled"
            ) from None
        manager = self.scheduler._leases
        if manager is None or manager.stopping:
            log.info("job %r not started: the scheduler is stopping", self.key)
            return None
        result = manager.tick(self.lock, FireClaim.new(self.key, us_from_datetime(fire_time)))
        if result is None:  # store unreachable: fail closed (the manager logged it)
            return None
        if not result.acquired:
            if self.config.lock_else is not None:
                self.config.lock_else(result.record)
            return None
        if not result.claimed:
            log.info("job %r: fire time %s already ran under lock %r; not running it again", self.key, fire_time, self.lock)
            return None
        return self._run(result.token, result.record, fire_time, args, kwargs)

    def _run(
        self, token: int, record: LockRecord, fire_time: datetime, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        manager = self.scheduler._leases
        assert manager is not None
        lease = Lease(self.lock, token, manager.node.node_id, fire_time, self.key, manager.holds, manager.checkpoint)
        # The run counts as running until its result is saved, so a graceful stop never releases
        # the lease between the job's return and its attrs hand-off.
        manager.begin_run(self.lock)
        try:
            ctx = _enter(lease)
            started = manager.clock()
            try:
                result = self.func(*args, **{**self._attr_kwargs(record.attrs), **kwargs})
            except BaseException as exc:
                manager.finish(self.lock, token, None, RunInfo(manager.clock() - started, _describe(exc)), self.key)
                raise
            finally:
                _exit(ctx)
            run = RunInfo(manager.clock() - started, None)
            if result is not None:
                try:
                    dump_attrs(result, job=self.key)
                except AttrsError as exc:
                    manager.finish(self.lock, token, None, RunInfo(run.duration, _describe(exc)), self.key)
                    raise
            manager.finish(self.lock, token, result, run, self.key)
            return result
        finally:
            manager.end_run(self.lock)

    def _run_seed(self, *args: Any, **kwargs: Any) -> Any:
        """The seed's algorithm with the user's own functions. Not atomic: see the README."""
        lock = self.config.lock
        assert callable(lock) and self.config.heartbeat is not None
        ttl = timedelta(seconds=self.ttl)
        lock_rec = lock()
        now = datetime.now().replace(microsecond=0)  # the seed's clock: this node's, local time
        ip = self.scheduler.local_ip
        if (
            not lock_rec
            or lock_rec.get("active_ip") == ip
            or (lock_rec.get("update_time") and now - lock_rec["update_time"] >= ttl)
        ):
            attrs = {k: v for k, v in (lock_rec or {}).items() if k not in ("active_ip", "update_time")}
            result = self.func(*args, **{**self._attr_kwargs(attrs), **kwargs})
            self.config.heartbeat(ip, now, **(result or {}))
            return result
        if self.config.lock_else is not None:
            self.config.lock_else(lock_rec)
        return None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _accepts_var_kwargs(func: Callable[..., Any]) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return True


def _param_names(func: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return set()


def _run_with_fire_times(job: Any, jobstore_alias: str, run_times: list[datetime], logger_name: str) -> list[Any]:
    """APScheduler's ``run_job``, one run time at a time, with the scheduled time visible to the job."""
    events: list[JobExecutionEvent] = []
    for run_time in run_times:
        ctx = _FIRE_TIME.set(run_time)
        try:
            events.extend(run_job(job, jobstore_alias, [run_time], logger_name))
        finally:
            _FIRE_TIME.reset(ctx)
    return events


class MutexThreadPoolExecutor(ThreadPoolExecutor):  # type: ignore[misc]
    """A thread pool that tells guarded jobs which scheduled fire time they run for.

    Plain APScheduler ``ThreadPoolExecutor`` instances given to a MutexScheduler are replaced by
    this class automatically.
    """

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        if not isinstance(job.func, GuardedJob):
            super()._do_submit_job(job, run_times)
            return

        def callback(future: Any) -> None:
            exc = future.exception()
            if exc:
                self._run_job_error(job.id, exc, getattr(exc, "__traceback__", None))
            else:
                self._run_job_success(job.id, future.result())

        future = self._pool.submit(_run_with_fire_times, job, job._jobstore_alias, run_times, self._logger.name)
        future.add_done_callback(callback)


class MutexSchedulerMixin:
    """Adds leased, fenced locks to an APScheduler 3 scheduler.

    Args:
        lock_url: the lock store URL. Default: ``$MUTEXCRON_LOCK_URL``, else ``sqlite:///mutexcron.db``.
        lock_store: a ready LockStore instead of a URL.
        node_id: this node's id. Default: ``$MUTEXCRON_NODE_ID``, else ``hostname:pid:random``.
        local_ip: shown as ``active_ip``. Default: this host's outbound IP.
        unactive_interval: default lease length for guarded jobs (seconds or timedelta), 10 s;
            ``$MUTEXCRON_UNACTIVE_INTERVAL`` sets it too.
        shutdown_timeout: how long ``shutdown()`` waits for running guarded jobs before it
            releases the leases (seconds, default 30).
        Other arguments go to the APScheduler scheduler.
    """

    _executors: dict[str, Any]  # APScheduler's, on the scheduler class this mixes into

    def __init__(
        self,
        *args: Any,
        lock_url: str | None = None,
        lock_store: LockStore | None = None,
        node_id: str | None = None,
        local_ip: str | None = None,
        unactive_interval: timedelta | float | None = None,
        shutdown_timeout: float = 30.0,
        **kwargs: Any,
    ) -> None:
        self.lock_url = lock_url or os.environ.get("MUTEXCRON_LOCK_URL") or DEFAULT_LOCK_URL
        self._lock_store = lock_store
        self.node_id = node_id or os.environ.get("MUTEXCRON_NODE_ID") or default_node_id()
        self.local_ip = local_ip or outbound_ip()
        env_interval = os.environ.get("MUTEXCRON_UNACTIVE_INTERVAL")
        try:
            default = _seconds(unactive_interval, "unactive_interval") or _seconds(
                float(env_interval) if env_interval else None, "MUTEXCRON_UNACTIVE_INTERVAL"
            )
        except ValueError as exc:
            raise ConfigurationError(f"MUTEXCRON_UNACTIVE_INTERVAL={env_interval!r}: {exc}") from None
        self.unactive_interval: float = default or DEFAULT_UNACTIVE_INTERVAL
        self.shutdown_timeout = shutdown_timeout
        self._leases: LeaseManager | None = None
        self._guarded: dict[str, GuardedJob] = {}  # job id -> guard
        self._user_misfire: set[str] = set()
        self._used_ids: set[str] = set()
        self._started_at: datetime | None = None
        self._setup_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    # -- configuration -----------------------------------------------------------------------
    def configure_mutex(
        self,
        *,
        lock_url: str | None = None,
        node_id: str | None = None,
        unactive_interval: timedelta | float | None = None,
        shutdown_timeout: float | None = None,
    ) -> None:
        """Override the lock settings before ``start()`` (the CLI's options use this)."""
        if self._leases is not None:
            raise ConfigurationError("configure_mutex() must be called before start()")
        if lock_url:
            self.lock_url, self._lock_store = lock_url, None
        if node_id:
            self.node_id = node_id
        interval = _seconds(unactive_interval, "unactive_interval")
        if interval:
            self.unactive_interval = interval
        if shutdown_timeout is not None:
            self.shutdown_timeout = shutdown_timeout

    @property
    def lock_store(self) -> LockStore:
        """The lock store (built from ``lock_url`` on first use)."""
        if self._lock_store is None:
            self._lock_store = lock_store_from_url(self.lock_url)
        return self._lock_store

    @property
    def node(self) -> Node:
        return Node(self.node_id, self.local_ip)

    # -- decorators ----------------------------------------------------------------------------
    def mutex(
        self,
        lock: str | Callable[[], Any] | None = None,
        lock_else: Callable[[Any], Any] | None = None,
        unactive_interval: timedelta | float | None = None,
        heartbeat: Callable[..., Any] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Guard a job with a named lock. Works above or below ``cron_schedule``/``scheduled_job``.

        Args:
            lock: the lock name (default: the function's ``__qualname__``). Jobs sharing a name
                form a group that moves between nodes together. A callable selects the seed's
                non-atomic mode with your own ``lock()`` and ``heartbeat()``.
            lock_else: called with the LockRecord on a node that is not the holder, at each tick.
            unactive_interval: lease length: a holder whose heartbeat is older than this, by the
                store's clock, is dead (seconds or timedelta; default the scheduler's, 10 s).
            heartbeat: seed mode only: ``heartbeat(ip, now, **attrs)``.
        """
        config = MutexConfig(lock, lock_else, _seconds(unactive_interval, "unactive_interval"), heartbeat)

        def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
            jobs = getattr(func, "__mutexcron_jobs__", None)
            if jobs:  # mutex above the schedule decorator: guard the jobs already added
                for job in jobs:
                    self._guard_existing(job, func, config)
            else:
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

    def add_job(
        self,
        func: Any,
        trigger: Any = None,
        args: Any = None,
        kwargs: Any = None,
        id: str | None = None,
        name: str | None = None,
        misfire_grace_time: Any = undefined,
        coalesce: Any = undefined,
        max_instances: Any = undefined,
        next_run_time: Any = undefined,
        jobstore: str = "default",
        executor: str = "default",
        replace_existing: bool = False,
        mutex: Any = None,
        **trigger_args: Any,
    ) -> Any:
        """APScheduler's ``add_job``, plus ``mutex=`` (True, a lock name, or a dict of ``mutex()`` options).

        Jobs without an ``id`` get a stable one (the function's qualified name), the same on every node.
        """
        config = _as_config(mutex) or getattr(func, "__mutexcron_mutex__", None)
        raw = func
        if id is None and callable(func):
            id = self._stable_id(func)
        if id is not None:
            self._used_ids.add(id)
            if misfire_grace_time is not undefined:  # the user's choice wins, even if mutex() comes later
                self._user_misfire.add(id)
        if config is not None:
            guard = GuardedJob(self, raw, config, key=str(id))
            func = guard
            if coalesce is undefined:
                coalesce = True
            if misfire_grace_time is undefined and self._leases is not None:
                misfire_grace_time = self._guard_misfire(guard)
        try:
            job = super().add_job(  # type: ignore[misc]
                func, trigger, args, kwargs, id, name, misfire_grace_time, coalesce, max_instances,
                next_run_time, jobstore, executor, replace_existing, **trigger_args,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"cannot add job {id!r}: {exc}") from None
        if config is not None:
            self._register_guard(job.id, func)
        try:
            raw.__dict__.setdefault("__mutexcron_jobs__", []).append(job)
        except AttributeError:  # builtins, partials...: mutex= must then be given to add_job
            pass
        return job

    def _stable_id(self, func: Callable[..., Any]) -> str:
        base = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        candidate, n = base, 1
        while candidate in self._used_ids:
            n += 1
            candidate = f"{base}#{n}"
        return candidate

    def _register_guard(self, job_id: str, guard: GuardedJob) -> None:
        if not guard.config.seed_mode:
            for other in self._guarded.values():
                if other.lock == guard.lock and other.config.unactive_interval != guard.config.unactive_interval:
                    raise ConfigurationError(
                        f"jobs {other.key!r} and {guard.key!r} share lock {guard.lock!r} but have different "
                        "unactive_interval values; a lock has one lease length: give them the same one"
                    )
        self._guarded[job_id] = guard
        if self._leases is not None and not guard.config.seed_mode:
            self._leases.locks.setdefault(guard.lock, guard.ttl)
            self._leases.start()

    def _guard_existing(self, job: Any, func: Callable[..., Any], config: MutexConfig) -> None:
        guard = GuardedJob(self, func, config, key=job.id)
        changes: dict[str, Any] = {"func": guard}
        if job.id not in self._user_misfire and self._leases is not None:
            changes["misfire_grace_time"] = self._guard_misfire(guard)
        job.modify(**changes)
        self._register_guard(job.id, guard)

    def _guard_misfire(self, guard: GuardedJob) -> int:
        """At least 2 x the lease, so a fire time missed during a failover is caught up."""
        default = getattr(self, "_job_defaults", {}).get("misfire_grace_time", 1) or 1
        return max(int(default), math.ceil(2 * guard.ttl))

    # -- running ---------------------------------------------------------------------------------
    def start(self, paused: bool = False) -> None:
        """Open the lock store, start the heartbeat thread and the scheduler."""
        with self._setup_lock:
            for alias, executor in list(getattr(self, "_executors", {}).items()):
                if type(executor) is ThreadPoolExecutor:
                    self._executors[alias] = MutexThreadPoolExecutor(executor._pool._max_workers)
            self._check_guarded_executors()
            locks = {g.lock: g.ttl for g in self._guarded.values() if not g.config.seed_mode}
            store = self.lock_store  # a bad URL fails here, before anything starts
            self._started_at = datetime.now(timezone.utc)
            self._leases = LeaseManager(store, self.node, locks, on_acquired=self._catch_up)
            for job, _alias, _replace in getattr(self, "_pending_jobs", []):
                guard = self._guarded.get(job.id)
                if guard is not None and job.id not in self._user_misfire and not guard.config.seed_mode:
                    job._modify(misfire_grace_time=self._guard_misfire(guard))
            log.info(
                "node %s (%s) using lock store %s; %d guarded job(s) on %d lock(s)",
                self.node_id,
                self.local_ip,
                store.masked_url,
                len(self._guarded),
                len(locks),
            )
        # The heartbeat thread starts first: BlockingScheduler.start() does not return.
        self._leases.start()
        super().start(paused)  # type: ignore[misc]

    def _check_guarded_executors(self) -> None:
        for job, _alias, _replace in getattr(self, "_pending_jobs", []):
            guard = self._guarded.get(job.id)
            if guard is None or guard.config.seed_mode:
                continue
            executor = self._executors.get(job.executor) if job.executor in self._executors else None
            if executor is not None and not isinstance(executor, MutexThreadPoolExecutor):
                raise ConfigurationError(
                    f"guarded job {job.id!r} uses executor {job.executor!r} ({type(executor).__name__}); guarded "
                    "jobs need a mutexcron.MutexThreadPoolExecutor (the default) to know their fire time"
                )

    def _create_default_executor(self) -> Any:
        return MutexThreadPoolExecutor()

    def shutdown(self, wait: bool = True) -> None:
        """Stop scheduling, wait (up to ``shutdown_timeout``) for guarded jobs, release the leases."""
        leases = self._leases
        if leases is not None:
            leases.stopping = True
        super().shutdown(wait=False)  # type: ignore[misc]
        if leases is not None:
            leases.stop(self.shutdown_timeout if wait else 0.0)

    def _catch_up(self, lock: str, before: LockRecord | None) -> None:
        """After taking a lock over, run each of its jobs once for the latest fire time missed.

        Only fire times after this scheduler started, after the job's last claimed fire time and
        within the job's ``misfire_grace_time`` count; the claim in the store still decides.
        """
        now = datetime.now(timezone.utc)
        if not self.running:  # type: ignore[attr-defined]
            return
        for job_id, guard in list(self._guarded.items()):
            if guard.lock != lock:
                continue
            job = self.get_job(job_id)  # type: ignore[attr-defined]
            if job is None or job.next_run_time is None:
                continue
            grace = job.misfire_grace_time
            floor = self._started_at or now
            if grace is not None:
                floor = max(floor, now - timedelta(seconds=grace))
            last = before.fire_times.get(guard.key) if before is not None else None
            missed = _latest_fire_time(job.trigger, floor, now, after=last)
            if missed is None:
                continue
            log.warning("job %r: catching up fire time %s missed during the failover of lock %r", job_id, missed, lock)
            try:
                self._lookup_executor(job.executor).submit_job(job, [missed])  # type: ignore[attr-defined]
            except MaxInstancesReachedError:
                log.info("job %r still running; no catch-up", job_id)


def _latest_fire_time(trigger: Any, floor: datetime, now: datetime, after: datetime | None) -> datetime | None:
    """The latest fire time of ``trigger`` in ``[floor, now]`` that is later than ``after``."""
    latest = None
    when = trigger.get_next_fire_time(None, floor)
    for _ in range(100_000):
        if when is None or when > now:
            break
        if after is None or when > after:
            latest = when
        when = trigger.get_next_fire_time(when, when + timedelta(microseconds=1))
    return latest


class MutexScheduler(MutexSchedulerMixin, BackgroundScheduler):  # type: ignore[misc]
    """A background-thread scheduler with guarded jobs (embeddable in a web app)."""


class BlockingMutexScheduler(MutexSchedulerMixin, BlockingScheduler):  # type: ignore[misc]
    """A scheduler that runs in the foreground: ``start()`` blocks until ``shutdown()``."""
