"""MutexScheduler: APScheduler 3 with jobs guarded by leased, fenced named locks."""

from __future__ import annotations

import atexit
import contextvars
import inspect
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor as WorkerPool
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
from .firetimes import guard_trigger, latest_fire_time, slot_of
from .heartbeat import LeaseManager
from .lease import Lease, _enter, _exit
from .locks import DEFAULT_LOCK_URL, FireClaim, LockStore, Node, RunInfo, lock_store_from_url
from .names import check_name
from .node import default_node_id, outbound_ip
from .record import DEFAULT_MAX_ATTRS_BYTES, LockRecord, us_from_datetime

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
    def callable_lock(self) -> bool:
        """The original design's mode: the user's own ``lock()``/``heartbeat()`` functions (not atomic)."""
        return callable(self.lock)

    def __post_init__(self) -> None:
        if self.callable_lock:
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
        elif self.lock is not None:
            if not isinstance(self.lock, str) or not self.lock.strip():
                raise ConfigurationError(f"mutex(lock=...) must be a non-empty lock name or a callable, not {self.lock!r}")
            check_name(self.lock, "lock name")
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
        self.key = check_name(key, "job id")
        default_lock = getattr(func, "__qualname__", key)
        self.lock = config.lock if isinstance(config.lock, str) else default_lock
        if not config.callable_lock:
            check_name(self.lock, f"lock name of job {key!r}")
        self.__name__ = getattr(func, "__name__", key)
        self.__qualname__ = getattr(func, "__qualname__", key)
        self.__module__ = getattr(func, "__module__", __name__)
        self.__wrapped__ = func
        self._accepts_kwargs = _accepts_var_kwargs(func)
        self._params = _param_names(func)
        self._warned_return = False

    @property
    def ttl(self) -> float:
        return self.config.unactive_interval or self.scheduler.unactive_interval

    def __repr__(self) -> str:
        return f"<GuardedJob {self.key!r} lock={self.lock!r}>"

    def _attr_kwargs(self, attrs: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The attrs to pass as keyword arguments: those the job takes and that are not bound yet."""
        try:
            bound = set(inspect.signature(self.func).bind_partial(*args, **kwargs).arguments)
        except (TypeError, ValueError):
            bound = set(kwargs)
        return {
            k: v for k, v in attrs.items() if k not in bound and (self._accepts_kwargs or k in self._params)
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.callable_lock:
            return self._run_with_user_lock(*args, **kwargs)
        try:
            fire_time = _FIRE_TIME.get()
        except LookupError:
            raise LeaseError(
                f"guarded job {self.key!r} was called outside mutexcron's executor; it only runs when scheduled"
            ) from None
        manager = self.scheduler._leases
        # The run counts from before its store call: a stop that begins now waits for it.
        if manager is None or not manager.begin_run(self.lock):
            log.info("job %r not started: the scheduler is stopping", self.key)
            return None
        try:
            result = manager.tick(self.lock, FireClaim.new(self.key, us_from_datetime(fire_time)))
            if result is None or result.uncertain:  # store down or contended: fail closed (logged)
                return None
            if not result.acquired:
                if self.config.lock_else is not None:
                    self.config.lock_else(result.record)
                return None
            if not result.claimed:
                log.info("job %r: fire time %s already ran under lock %r; not running it again", self.key, fire_time, self.lock)
                return None
            return self._run(manager, result.token, fire_time, args, kwargs)
        finally:
            manager.end_run(self.lock)

    def _run(
        self, manager: LeaseManager, token: int, fire_time: datetime, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        attrs = self._attr_kwargs(manager.attrs(self.lock, token), args, kwargs)
        seen = set(attrs)  # the keys this run may replace or delete; a group mate's stay

        def save(new: Mapping[str, Any]) -> bool:
            return manager.checkpoint(self.lock, token, seen, new, self.key)

        lease = Lease(self.lock, token, manager.node.node_id, fire_time, self.key, manager.holds, save)
        ctx = _enter(lease)
        # The last check before the job's first line: a slow reply or a pause since the store
        # said "yours" may have outlasted the lease (monotonic deadline).
        if not manager.holds(self.lock, token):
            _exit(ctx)
            log.warning("job %r: lease of lock %r (token %d) ran out before the run could start; not run",
                        self.key, self.lock, token)
            return None
        started = manager.clock()
        try:
            result = self.func(*args, **{**attrs, **kwargs})
        except BaseException as exc:
            manager.finish(self.lock, token, seen, None, RunInfo(manager.clock() - started, _describe(exc)), self.key)
            raise
        finally:
            _exit(ctx)
        run = RunInfo(manager.clock() - started, None)
        returned = self._returned_attrs(result)
        try:
            manager.finish(self.lock, token, seen, returned, run, self.key)
        except AttrsError as exc:
            manager.finish(self.lock, token, seen, None, RunInfo(run.duration, _describe(exc)), self.key)
            raise
        return result

    def _returned_attrs(self, result: Any) -> Mapping[str, Any] | None:
        """A returned dict is the new attrs; anything else keeps them (logged once per job)."""
        if result is None or isinstance(result, Mapping):
            return result
        if not self._warned_return:
            self._warned_return = True
            log.warning("job %r returned %s, not a dict: its attrs are kept (return a dict to change them)",
                        self.key, type(result).__name__)
        return None

    def _run_with_user_lock(self, *args: Any, **kwargs: Any) -> Any:
        """The original design's algorithm with the user's own functions. Not atomic: see the README."""
        lock = self.config.lock
        assert callable(lock) and self.config.heartbeat is not None
        ttl = timedelta(seconds=self.ttl)
        lock_rec = lock()
        now = datetime.now().replace(microsecond=0)  # the original design's clock: this node's, local time
        ip = self.scheduler.local_ip
        if (
            not lock_rec
            or lock_rec.get("active_ip") == ip
            or (lock_rec.get("update_time") and now - lock_rec["update_time"] >= ttl)
        ):
            attrs = {k: v for k, v in (lock_rec or {}).items() if k not in ("active_ip", "update_time")}
            result = self.func(*args, **{**self._attr_kwargs(attrs, args, kwargs), **kwargs})
            self.config.heartbeat(ip, now, **(result or {}))
            return result
        if self.config.lock_else is not None:
            self.config.lock_else(lock_rec)
        return None


def _describe(exc: BaseException) -> str:
    """An error as stored with the run: bounded, and valid UTF-8 (a lone surrogate from a
    surrogate-escaped file name would make the store refuse the whole hand-off)."""
    text = f"{type(exc).__name__}: {exc}"[:2000]
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    """APScheduler's ``run_job``, one run time at a time, with the scheduled slot visible to the job.

    The slot is the un-jittered fire time: the same on every node (see :mod:`mutexcron.firetimes`).
    """
    events: list[JobExecutionEvent] = []
    for run_time in run_times:
        ctx = _FIRE_TIME.set(slot_of(job.trigger, run_time))
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
        max_attrs_bytes: the largest attrs a run may store, as JSON (default 1 MB); a larger
            return raises AttrsError and keeps the previous attrs.
        timezone: as in APScheduler, but **UTC by default** (APScheduler's default is the host's
            zone, which would make ``cron_schedule(hour=3)`` a different instant on each node).
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
        max_attrs_bytes: int = DEFAULT_MAX_ATTRS_BYTES,
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
        self.max_attrs_bytes = max_attrs_bytes
        self._own_store = lock_store is None  # built from the URL here: closed by shutdown()
        self._leases: LeaseManager | None = None
        self._catch_ups: ThreadPoolExecutor | None = None
        self._guarded: dict[str, GuardedJob] = {}  # job id -> guard
        self._user_misfire: set[str] = set()
        self._used_ids: set[str] = set()
        self._started_at: datetime | None = None
        self._setup_lock = threading.Lock()
        gconfig = args[0] if args and isinstance(args[0], Mapping) else kwargs.get("gconfig", {})
        if not any(str(k).endswith("timezone") for k in gconfig):
            kwargs.setdefault("timezone", "UTC")
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
            self.lock_url, self._lock_store, self._own_store = lock_url, None, True
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
            trigger, trigger_args = self._guarded_trigger(trigger, trigger_args, guard), {}
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

    def _guarded_trigger(self, trigger: Any, trigger_args: dict[str, Any], guard: GuardedJob) -> Any:
        """The trigger built as APScheduler would, then made to name the same slots on every node."""
        try:
            built = self._create_trigger(trigger, dict(trigger_args))  # type: ignore[attr-defined]
        except (ValueError, TypeError, LookupError) as exc:
            raise ConfigurationError(f"cannot add job {guard.key!r}: {exc}") from None
        if isinstance(built, CronTrigger) and str(built.timezone) != str(self.timezone):  # type: ignore[attr-defined]
            log.warning(
                "guarded job %r fires in time zone %s, not the scheduler's %s: every node must use the same "
                "zone (pass timezone= explicitly to the trigger)",
                guard.key, built.timezone, self.timezone,  # type: ignore[attr-defined]
            )
        return guard_trigger(built, guard.key)

    def _stable_id(self, func: Callable[..., Any]) -> str:
        base = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        candidate, n = base, 1
        while candidate in self._used_ids:
            n += 1
            candidate = f"{base}#{n}"
        return candidate

    def _register_guard(self, job_id: str, guard: GuardedJob) -> None:
        if not guard.config.callable_lock:
            for other in self._guarded.values():
                if other.lock == guard.lock and other.config.unactive_interval != guard.config.unactive_interval:
                    raise ConfigurationError(
                        f"jobs {other.key!r} and {guard.key!r} share lock {guard.lock!r} but have different "
                        "unactive_interval values; a lock has one lease length: give them the same one"
                    )
        self._guarded[job_id] = guard
        if self._leases is not None and not guard.config.callable_lock:
            self._leases.add_lock(guard.lock, guard.ttl)

    def _guard_existing(self, job: Any, func: Callable[..., Any], config: MutexConfig) -> None:
        guard = GuardedJob(self, func, config, key=job.id)
        changes: dict[str, Any] = {"func": guard}
        if job.id not in self._user_misfire and self._leases is not None:
            changes["misfire_grace_time"] = self._guard_misfire(guard)
        job.modify(**changes)
        trigger = self._guarded_trigger(job.trigger, {}, guard)
        if trigger is not job.trigger or self._leases is not None:
            # Recompute the next fire time from the cluster-wide anchor, not from this node's start.
            if self._leases is None:
                job._modify(trigger=trigger)
            else:
                job.reschedule(trigger)
        self._register_guard(job.id, guard)

    def _guard_misfire(self, guard: GuardedJob) -> int:
        """At least 2 x the lease, so a fire time missed during a failover is caught up."""
        default = getattr(self, "_job_defaults", {}).get("misfire_grace_time", 1) or 1
        return max(int(default), math.ceil(2 * guard.ttl))

    # -- running ---------------------------------------------------------------------------------
    def start(self, paused: bool = False) -> None:
        """Open the lock store, start the heartbeat thread and the scheduler.

        Also registers an interpreter-exit hook: a process that ends without calling
        ``shutdown()`` (a web worker's normal exit, a reload) still stops gracefully and releases
        its leases, so a standby takes over at once instead of after a lease.
        """
        with self._setup_lock:
            for alias, executor in list(getattr(self, "_executors", {}).items()):
                if type(executor) is ThreadPoolExecutor:
                    self._executors[alias] = MutexThreadPoolExecutor(executor._pool._max_workers)
            self._check_guarded_executors()
            locks = {g.lock: g.ttl for g in self._guarded.values() if not g.config.callable_lock}
            store = self.lock_store  # a bad URL fails here, before anything starts
            self._started_at = datetime.now(timezone.utc)
            self._catch_ups = WorkerPool(1, thread_name_prefix="mutexcron-catch-up")
            self._leases = LeaseManager(
                store, self.node, locks, on_acquired=self._queue_catch_up, max_attrs_bytes=self.max_attrs_bytes
            )
            for job, _alias, _replace in getattr(self, "_pending_jobs", []):
                guard = self._guarded.get(job.id)
                if guard is not None and job.id not in self._user_misfire and not guard.config.callable_lock:
                    job._modify(misfire_grace_time=self._guard_misfire(guard))
            log.info(
                "node %s (%s) using lock store %s; %d guarded job(s) on %d lock(s)",
                self.node_id,
                self.local_ip,
                store.masked_url,
                len(self._guarded),
                len(locks),
            )
        _at_exit(self._stop_at_exit)
        # The heartbeat thread starts first: BlockingScheduler.start() does not return.
        self._leases.start()
        super().start(paused)  # type: ignore[misc]

    def _check_guarded_executors(self) -> None:
        for job, _alias, _replace in getattr(self, "_pending_jobs", []):
            guard = self._guarded.get(job.id)
            if guard is None or guard.config.callable_lock:
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
        """Stop scheduling, wait for running jobs, release the leases, close the store.

        As in APScheduler, ``wait=True`` waits for running jobs; for guarded jobs at most
        ``shutdown_timeout`` seconds, after which their leases are left to expire. A guarded job
        still running then also stops the wait for unguarded ones, so the process can exit.
        """
        leases = self._leases
        if leases is not None and self.running:  # type: ignore[attr-defined]
            self.pause()  # type: ignore[attr-defined]  # no new fire times while guarded runs end
            leases.stop(self.shutdown_timeout if wait else 0.0)
        busy = bool(leases is not None and leases.running())
        try:
            super().shutdown(wait=wait and not busy)  # type: ignore[misc]
        finally:
            if self._catch_ups is not None:
                self._catch_ups.shutdown(wait=False, cancel_futures=True)
            if self._own_store and self._lock_store is not None and not busy:
                self._lock_store.close()
                self._lock_store = None

    def running_guarded_jobs(self) -> dict[str, int]:
        """Guarded runs in progress on this node, per lock (after ``shutdown()``: those that
        outlived ``shutdown_timeout``)."""
        return self._leases.running() if self._leases is not None else {}

    def _stop_at_exit(self) -> None:
        if self.running:  # type: ignore[attr-defined]
            log.info("interpreter exiting: stopping the scheduler and releasing its leases")
            self.shutdown(wait=True)

    def _queue_catch_up(self, lock: str, before: LockRecord | None) -> None:
        """Called on a change of holder (heartbeat thread or a tick): catch up on another thread."""
        pool = self._catch_ups
        if pool is not None:
            try:
                pool.submit(self._catch_up, lock, before)
            except RuntimeError:  # shut down meanwhile
                pass

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
            missed = latest_fire_time(job.trigger, floor, now, after=last)
            if missed is None:
                continue
            log.warning("job %r: catching up fire time %s missed during the failover of lock %r", job_id, missed, lock)
            try:
                self._lookup_executor(job.executor).submit_job(job, [missed])  # type: ignore[attr-defined]
            except MaxInstancesReachedError:
                log.info("job %r still running; no catch-up", job_id)


def _at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the interpreter exits normally, before non-daemon threads are joined.

    ``threading._register_atexit`` runs before the thread pools' own exit hooks join their
    workers, so scheduling stops before the wait; plain ``atexit`` is the fallback.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(hook)
            return
    except RuntimeError:  # the interpreter is already shutting down
        return
    atexit.register(hook)


class MutexScheduler(MutexSchedulerMixin, BackgroundScheduler):  # type: ignore[misc]
    """A background-thread scheduler with guarded jobs (embeddable in a web app)."""


class BlockingMutexScheduler(MutexSchedulerMixin, BlockingScheduler):  # type: ignore[misc]
    """A scheduler that runs in the foreground: ``start()`` blocks until ``shutdown()``."""
