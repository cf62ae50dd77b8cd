"""A guarded job's run: lease check, fire-time claim, the run under its lease, the fenced hand-off.

:class:`GuardedJob` is the callable APScheduler runs in place of the user's function. It talks to
the node's lease manager through :class:`LeaseKeeper` (implemented by
:class:`mutexcron.heartbeat.LeaseManager`), never to the scheduler. :class:`MutexThreadPoolExecutor`
tells each run the fire time it was scheduled for.
"""

from __future__ import annotations

import collections
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, JobExecutionEvent
from apscheduler.executors.pool import ThreadPoolExecutor

from ..errors import AttrsError, ConfigurationError, LeaseError
from ..events import EVENT_RUN_FINISHED, EVENT_RUN_SKIPPED, EVENT_RUN_STARTED, Emit, MutexEvent, log_event
from ..locks import AcquireResult, FireClaim, Node, RunInfo
from ..locks.record import us_from_datetime
from ..names import check_name
from ..observability.pings import check_ping
from . import apscheduler_internals as aps
from .batch import PRECLAIMED, ClaimBatch, Preclaim
from .firetimes import slot_of
from .lease import Lease, _enter, _exit

log = logging.getLogger(__name__)
#: The error of a run whose lease ran out while its EVENT_RUN_STARTED listeners ran (with the
#: store unreachable, so no renewal got through): it ends without running the job's first line.
LATE_START = "not run: the lease ran out while the run-started listeners ran (renewals failing meanwhile)"

_FIRE_TIME: contextvars.ContextVar[datetime] = contextvars.ContextVar("mutexcron_fire_time")
#: Set by mutexcron's executors around a run: where a run's attrs error goes instead of being
#: raised through APScheduler's ``run_job`` (which logs a traceback of library frames for it).
_QUIET_ERRORS: contextvars.ContextVar[list[BaseException] | None] = contextvars.ContextVar(
    "mutexcron_quiet_errors", default=None
)


class LeaseKeeper(Protocol):
    """What a guarded run needs from the node's lease manager."""

    node: Node
    emit: Emit

    def clock(self) -> float: ...
    def begin_run(self, lock: str) -> bool: ...
    def end_run(self, lock: str) -> None: ...
    def tick(self, lock: str, claim: FireClaim | None) -> AcquireResult | None: ...
    def holds(self, lock: str, token: int, since: float | None = None) -> bool: ...
    def zone_refusal(self, lock: str) -> str | None: ...
    def attrs(self, lock: str, token: int) -> dict[str, Any]: ...
    def checkpoint(
        self, lock: str, token: int, seen: set[str], attrs: Mapping[str, Any], job: str, started: float | None = None
    ) -> bool: ...
    def finish(
        self, lock: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, run: RunInfo, job: str,
        started: float | None = None,
    ) -> bool: ...


class RunStats(Protocol):
    """What a guard tells the metrics of a run, as it happens (no listener call)."""

    def run_started(self, job_id: str, lock: str, lag: float) -> None: ...

    def run_finished(self, job_id: str, lock: str, outcome: str, duration: float) -> None: ...


@dataclass
class GuardContext:
    """What the guarded jobs of one scheduler share.

    Attributes:
        ttl: the default lease length in seconds (the scheduler's ``unactive_interval``).
        local_ip: this node's IP, for the callable-lock mode.
        leases: the node's lease manager, set by ``start()``; None before.
    """

    ttl: float
    local_ip: str
    leases: LeaseKeeper | None = None
    #: Told of each run's start and end when metrics are served (:class:`mutexcron.observability.metrics.Metrics`).
    run_stats: RunStats | None = None
    #: How many guarded jobs share each lock (a lock's only job keeps its runs apart: ``RunInfo.sole_job``).
    jobs_per_lock: collections.Counter[str] = field(default_factory=collections.Counter)


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
    ping: str | None = None  # a monitor's ping URL or template: mutexcron.observability.pings
    nodes: str | Sequence[str] | None = None  # glob patterns of the node ids that may hold the lock

    @property
    def node_patterns(self) -> tuple[str, ...] | None:
        """``nodes`` as a tuple of glob patterns (None: every node may hold the lock)."""
        if self.nodes is None:
            return None
        return (self.nodes,) if isinstance(self.nodes, str) else tuple(self.nodes)

    @property
    def callable_lock(self) -> bool:
        """The original design's mode: the user's own ``lock()``/``heartbeat()`` functions (not atomic)."""
        return callable(self.lock)

    def __post_init__(self) -> None:
        if self.callable_lock:
            if not callable(self.heartbeat):
                raise ConfigurationError(
                    "mutex(lock=<callable>) is the callable-lock mode and needs heartbeat=<callable> too "
                    "(heartbeat(ip, now, **attrs)); or pass lock='name' to use the built-in atomic store"
                )
        elif self.heartbeat is not None:
            raise ConfigurationError(
                "mutex(heartbeat=...) is only for the callable-lock mode with lock=<callable>; "
                "built-in stores renew leases themselves"
            )
        elif self.lock is not None:
            if not isinstance(self.lock, str) or not self.lock.strip():
                raise ConfigurationError(f"mutex(lock=...) must be a non-empty lock name or a callable, not {self.lock!r}")
            check_name(self.lock, "lock name")
        if self.lock_else is not None and not callable(self.lock_else):
            raise ConfigurationError(f"mutex(lock_else=...) must be callable, not {self.lock_else!r}")
        patterns = self.node_patterns
        if patterns is not None and (
            self.callable_lock or not patterns or not all(isinstance(p, str) and p.strip() not in ("", "tag:") for p in patterns)
        ):
            raise ConfigurationError(
                "mutex(nodes=...) takes a node id or tag pattern or a list of them, such as nodes='reports-*' or "
                f"nodes='tag:eu', not {self.nodes!r} (and needs a lock name, not the callable-lock mode)"
            )
        if self.ping is not None and self.callable_lock:
            raise ConfigurationError("mutex(ping=...) needs a lock name: the callable-lock mode has no run events to ping")


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


@dataclass
class _Run:
    """A guarded run in progress: its token, the attrs it was given, and its lease context."""

    token: int
    attrs: dict[str, Any]
    seen: set[str]
    context: contextvars.Token[Lease]
    started: float
    fire_time: datetime
    #: Monotonic, before the run's lease checks: the lease must not lapse after it for the run to record anything.
    begun: float
    #: The job's exception, for RUN_FINISHED's ``exception`` (the event feed keeps its traceback).
    exception: BaseException | None = None


class GuardedJob:
    """The callable APScheduler runs for a guarded job: lease check, claim, run, hand-off."""

    def __init__(self, context: GuardContext, func: Callable[..., Any], config: MutexConfig, job_id: str) -> None:
        self.context = context
        self.func = func
        self.config = config
        self.job_id = check_name(job_id, "job id")
        default_lock = getattr(func, "__qualname__", job_id)
        self.lock = config.lock if isinstance(config.lock, str) else default_lock
        if not config.callable_lock:
            check_name(self.lock, f"lock name of job {job_id!r}")
        if config.ping is not None:
            check_ping(config.ping, job_id)
        #: Ticks on a node that does not hold the lock: ``lock_else`` is called there at each fire
        #: time (and the callable-lock mode decides at each tick); the others wait for the lock.
        self.ticks_on_standby = config.lock_else is not None or config.callable_lock
        self.__name__ = getattr(func, "__name__", job_id)
        self.__qualname__ = getattr(func, "__qualname__", job_id)
        self.__module__ = getattr(func, "__module__", __name__)
        self.__wrapped__ = func
        self._accepts_kwargs = _accepts_var_kwargs(func)
        self._params = _param_names(func)
        self._warned_return = False
        #: The time zone this job's fire times depend on (:func:`mutexcron.firetimes.zone_of`), set when it is added.
        self.zone: str | None = None
        #: Its trigger as text (``cron[minute='*/2']``), set when it is added: what the holder of its
        #: lock writes for the other nodes to compare with their jobs file (:mod:`mutexcron.guard.agreement`).
        self.trigger_text: str | None = None
        #: Runs whose returned attrs could not be stored (AttrsError); logged once per distinct problem.
        self.attrs_errors = 0
        self._attrs_problem: str | None = None
        #: Fire times this node skipped, by reason (a standby's every tick: counted here, where it
        #: happens, and read by the metrics at scrape time rather than through a listener).
        self.skips: dict[str, int] = {}
        self._skips_lock = threading.Lock()

    @property
    def ttl(self) -> float:
        return self.config.unactive_interval or self.context.ttl

    def __repr__(self) -> str:
        return f"<GuardedJob {self.job_id!r} lock={self.lock!r}>"

    def _attr_kwargs(self, attrs: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The attrs to pass as keyword arguments: those the job takes and that are not bound yet."""
        if not attrs:
            return {}
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
        fire_time = self._fire_time()
        manager = self.context.leases
        preclaimed = PRECLAIMED.get(None)  # a batch claimed it, and counted the run already
        if preclaimed is not None:
            preclaimed.taken = True
        # The run counts from before its store call: a stop that begins now waits for it.
        if manager is None or (preclaimed is None and not manager.begin_run(self.lock)):
            self._skipped(manager, fire_time, "stopping")
            return None
        ended_later = False  # the run's hand-off was queued: it ends the run once settled
        try:
            token = preclaimed.token if preclaimed is not None else self._claim(manager, fire_time)
            run = None if token is None else self._start(manager, token, fire_time, args, kwargs)
            if run is None:
                return None
            try:
                result = self.func(*args, **{**run.attrs, **kwargs})
            except BaseException as exc:
                _exit(run.context)
                ended_later = self._end(manager, run, error=exc)
                raise
            _exit(run.context)
            ended_later = self._end(manager, run, result=result)
            return result
        finally:
            if not ended_later:
                manager.end_run(self.lock)

    def _fire_time(self) -> datetime:
        try:
            return _FIRE_TIME.get()
        except LookupError:
            raise LeaseError(
                f"guarded job {self.job_id!r} was called outside mutexcron's executor; it only runs when scheduled"
            ) from None

    def _claim(self, manager: LeaseKeeper, fire_time: datetime) -> int | None:
        """The per-tick store call: the token if this node holds the lease and won the fire claim."""
        if manager.zone_refusal(self.lock) is not None:  # the holder names other instants (logged once)
            self._skipped(manager, fire_time, "zone-mismatch")
            return None
        result = manager.tick(self.lock, FireClaim.new(self.job_id, us_from_datetime(fire_time)))
        if result is None or result.uncertain:  # store down or contended: fail closed (logged)
            return None
        if not result.acquired:
            self._skipped(manager, fire_time, "not-holder")
            if self.config.lock_else is not None:
                self.config.lock_else(result.record)
            return None
        if not result.claimed:
            # The fire time claimed instead: a later one (a scheduled run's, past a trigger's) is no run of this one.
            claimed = result.record.fire_times.get(self.job_id)
            self._skipped(manager, fire_time, "paused" if result.record.paused else "already-run", result.token, claimed)
            return None
        return result.token

    def _skipped(
        self, manager: LeaseKeeper | None, fire_time: datetime, reason: str, token: int | None = None,
        claimed: datetime | None = None,
    ) -> None:  # fmt: skip
        """A fire time this node does not run (:data:`~mutexcron.events.EVENT_RUN_SKIPPED`)."""
        with self._skips_lock:
            self.skips[reason] = self.skips.get(reason, 0) + 1
        emit = manager.emit if manager is not None else log_event
        node = manager.node.node_id if manager is not None else None
        event = MutexEvent(EVENT_RUN_SKIPPED, lock=self.lock, job_id=self.job_id, node=node, token=token,
                           fire_time=fire_time, reason=reason, **({"claimed": claimed} if claimed else {}))  # fmt: skip
        _report(event)
        emit(event)

    def run_now(self, fire_time: datetime, args: tuple[Any, ...], kwargs: dict[str, Any]) -> MutexEvent | None:
        """Run the job for ``fire_time`` on this thread, through its lock as a scheduled run is
        (the fire claim decides: at most once per fire time across the cluster).

        Returns the event that ended it: RUN_FINISHED (ran; ``outcome``), RUN_SKIPPED (``reason``),
        or None if it did not get that far. The job's own exception is in the event, not raised.
        """
        report: list[MutexEvent] = []
        reported, fired = _REPORT.set(report), _FIRE_TIME.set(fire_time)
        try:
            self(*args, **kwargs)
        except Exception:
            # Logged as APScheduler's executor logs a scheduled run's error: with its traceback.
            log.exception('Job "%s" (run now, fire time %s) raised an exception', self.job_id, fire_time.isoformat())
        finally:
            _FIRE_TIME.reset(fired)
            _REPORT.reset(reported)
        return report[-1] if report else None

    def _start(
        self, manager: LeaseKeeper, token: int, fire_time: datetime, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Run | None:
        """Set up the run's lease and arguments; None if the lease ran out meanwhile. No store call."""
        begun = manager.clock()  # a lapse of the lease after this ends what the run may record
        attrs = self._attr_kwargs(manager.attrs(self.lock, token), args, kwargs)
        seen = set(attrs)  # the keys this run may replace or delete; a group mate's stay

        def save(new: Mapping[str, Any]) -> bool:
            return manager.checkpoint(self.lock, token, seen, new, self.job_id, begun)

        lease = Lease(self.lock, token, manager.node.node_id, fire_time, self.job_id, manager.holds, save)
        context = _enter(lease)
        # The last check before the job's first line: a slow reply or a pause since the store
        # said "yours" may have outlasted the lease (monotonic deadline).
        if not manager.holds(self.lock, token):
            _exit(context)
            self._skipped(manager, fire_time, "lease-expired", token)
            return None
        lag = (datetime.now(fire_time.tzinfo) - fire_time).total_seconds()
        manager.emit(MutexEvent(EVENT_RUN_STARTED, lock=self.lock, job_id=self.job_id, node=manager.node.node_id,
                                token=token, fire_time=fire_time, lag=lag))  # fmt: skip
        stats = self.context.run_stats
        if stats is not None:
            stats.run_started(self.job_id, self.lock, lag)
        run = _Run(token, attrs, seen, context, manager.clock(), fire_time, begun)
        if not manager.holds(self.lock, token):  # the RUN_STARTED listeners outlasted the lease
            _exit(context)
            self._finished(manager, run, 0.0, LATE_START)
            return None
        return run

    def _end(
        self, manager: LeaseKeeper, run: _Run, *, result: Any = None, error: BaseException | None = None, wait: bool = False
    ) -> bool:
        """The fenced hand-off of the run's attrs and run info.

        A scheduled run's hand-off (on mutexcron's executor) is queued (``finish_later``: the node's next
        batch of hand-offs carries it) and the pool thread is free at once; the run stays counted
        until it is settled, and its RUN_FINISHED event follows the write, as before. True then (the
        hand-off ends the run). A run started by :meth:`run_now`, or with ``wait`` (a coroutine job's,
        on a worker thread already), waits for its hand-off (False).
        """
        duration = manager.clock() - run.started
        if error is not None:
            run.exception = error
            return self._hand_off(manager, run, None, self._info(run, duration, _describe(error)), _describe(error), wait)
        returned = self._returned_attrs(result)
        try:
            return self._hand_off(manager, run, returned, self._info(run, duration, None), None, wait)
        except AttrsError as exc:
            info = self._info(run, duration, _describe(exc))
            ended_later = self._hand_off(manager, run, None, info, _describe(exc), wait)
            self._attrs_failed(exc)
            return ended_later

    def _hand_off(
        self, manager: LeaseKeeper, run: _Run, attrs: Mapping[str, Any] | None, info: RunInfo, error: str | None, wait: bool
    ) -> bool:
        """Hand the run off, then report it finished; True if that happens later (queued)."""
        later = getattr(manager, "finish_later", None)
        scheduled = _QUIET_ERRORS.get() is not None and _REPORT.get() is None  # on mutexcron's executor, not run_now
        if wait or later is None or not scheduled:
            manager.finish(self.lock, run.token, run.seen, attrs, info, self.job_id, run.begun)
            self._finished(manager, run, info.duration, error)
            return False

        def settled(_saved: bool) -> None:
            try:
                self._finished(manager, run, info.duration, error)
            finally:
                manager.end_run(self.lock)

        later(self.lock, run.token, run.seen, attrs, info, self.job_id, settled, run.begun)
        return True

    def _attrs_failed(self, exc: AttrsError) -> None:
        """A run whose attrs cannot be stored: one ERROR line per distinct problem, then a count.

        Under mutexcron's executors the error reaches APScheduler's listeners as the run's
        EVENT_JOB_ERROR without going through APScheduler's ``run_job``, which would log a
        traceback of library frames at every fire time; called any other way, it is raised.
        """
        self.attrs_errors += 1
        problem = str(exc)
        if problem != self._attrs_problem:
            self._attrs_problem = problem
            log.error("job %r: %s. The run is recorded as failed and the previous attrs are kept; said once, "
                      "later runs are counted (GuardedJob.attrs_errors, mutexcron_runs_total{outcome=\"error\"})",
                      self.job_id, problem)  # fmt: skip
        else:
            log.debug("job %r: attrs not stored again (%d times): %s", self.job_id, self.attrs_errors, problem)
        quiet = _QUIET_ERRORS.get()
        if quiet is None:
            raise exc
        quiet.append(exc)

    def _info(self, run: _Run, duration: float, error: str | None) -> RunInfo:
        """What the hand-off records of the run (also its run-history entry)."""
        sole = self.context.jobs_per_lock[self.lock] == 1
        return RunInfo(duration, error, job=self.job_id, fire_time=run.fire_time, sole_job=sole)

    def _finished(self, manager: LeaseKeeper, run: _Run, duration: float, error: str | None) -> None:
        event = MutexEvent(EVENT_RUN_FINISHED, lock=self.lock, job_id=self.job_id, node=manager.node.node_id,
                           token=run.token, fire_time=run.fire_time, outcome="error" if error else "success",
                           duration=duration, error=error, exception=run.exception if error else None)  # fmt: skip
        _report(event)
        manager.emit(event)
        stats = self.context.run_stats
        if stats is not None:
            stats.run_finished(self.job_id, self.lock, "error" if error else "success", duration)

    def _returned_attrs(self, result: Any) -> Mapping[str, Any] | None:
        """A returned dict is the new attrs; anything else keeps them (logged once per job)."""
        if result is None or isinstance(result, Mapping):
            return result
        if not self._warned_return:
            self._warned_return = True
            log.warning("job %r returned %s, not a dict: its attrs are kept (return a dict to change them)",
                        self.job_id, type(result).__name__)
        return None

    def _run_with_user_lock(self, *args: Any, **kwargs: Any) -> Any:
        """The original design's algorithm with the user's own functions. Not atomic: see docs/migration.md."""
        lock = self.config.lock
        assert callable(lock) and self.config.heartbeat is not None
        ttl = timedelta(seconds=self.ttl)
        lock_rec = lock()
        now = datetime.now().replace(microsecond=0)  # the original design's clock: this node's, local time
        ip = self.context.local_ip
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


#: The events of a run started by :meth:`GuardedJob.run_now` (None for scheduled runs).
_REPORT: contextvars.ContextVar[list[MutexEvent] | None] = contextvars.ContextVar("mutexcron_run_report", default=None)


def _report(event: MutexEvent) -> None:
    report = _REPORT.get()
    if report is not None:
        report.append(event)


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


def _run_with_fire_times(job: Any, run_times: list[datetime], logger_name: str, token: int | None = None) -> list[Any]:
    """APScheduler's ``run_job``, one run time at a time, with the scheduled slot visible to the job.

    The slot is the un-jittered fire time: the same on every node (see :mod:`mutexcron.guard.firetimes`).
    ``token``: the run was claimed by a batch already (one run time only).
    """
    events: list[JobExecutionEvent] = []
    for run_time in run_times:
        preclaim = Preclaim(token) if token is not None else None
        ctx = _FIRE_TIME.set(slot_of(job.trigger, run_time))
        claimed = PRECLAIMED.set(preclaim) if preclaim is not None else None
        quiet: list[BaseException] = []
        errors = _QUIET_ERRORS.set(quiet)
        try:
            events.extend(quiet_errors(aps.run_job(job, run_time, logger_name), quiet))
        finally:
            _QUIET_ERRORS.reset(errors)
            if claimed is not None:
                PRECLAIMED.reset(claimed)
            _FIRE_TIME.reset(ctx)
            if preclaim is not None and not preclaim.taken and job.func.context.leases is not None:
                job.func.context.leases.end_run(job.func.lock)  # APScheduler skipped it (misfire)
    return events


class RunEnds:
    """Tells the scheduler each time a job's run ends or is given back, once APScheduler has
    uncounted it (a removed guarded job is forgotten when its last run ends: ``forget_job``)."""

    def _run_job_success(self, job_id: str, events: list[Any]) -> None:
        super()._run_job_success(job_id, events)  # type: ignore[misc]
        self._run_ended(job_id)

    def _run_job_error(self, job_id: str, exc: BaseException, traceback: Any = None) -> None:
        super()._run_job_error(job_id, exc, traceback)  # type: ignore[misc]
        self._run_ended(job_id)

    def _run_ended(self, job_id: str) -> None:
        ended = getattr(getattr(self, "_scheduler", None), "_job_instance_ended", None)
        if ended is not None:
            ended(job_id)


def quiet_errors(events: list[Any], quiet: list[BaseException]) -> list[Any]:
    """``events`` of one run time, its success turned into the error in ``quiet`` (a run whose
    attrs could not be stored), with no traceback: listeners see EVENT_JOB_ERROR as before."""
    if not quiet:
        return events
    return [
        JobExecutionEvent(EVENT_JOB_ERROR, e.job_id, e.jobstore, e.scheduled_run_time, exception=quiet[-1], traceback=None)
        if e.code == EVENT_JOB_EXECUTED
        else e
        for e in events
    ]


class MutexThreadPoolExecutor(RunEnds, ThreadPoolExecutor):  # type: ignore[misc]
    """A thread pool that tells guarded jobs which scheduled fire time they run for.

    Plain APScheduler ``ThreadPoolExecutor`` instances given to a MutexScheduler are replaced by
    this class automatically.
    """

    batch: ClaimBatch | None = None  # the scheduler's: guarded jobs due together claim together

    def start(self, scheduler: Any, alias: str) -> None:
        super().start(scheduler, alias)
        self.batch = getattr(scheduler, "_claim_batch", None)

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        if not isinstance(job.func, GuardedJob):
            super()._do_submit_job(job, run_times)
            return
        if self.batch is not None and self.batch.collecting() and not job.func.config.callable_lock:
            self.batch.add(self, job, run_times)
            return
        self.start_run(job, run_times, None)

    def run_here(self, job: Any, run_times: list[datetime]) -> list[Any]:
        """A guarded job's fire times on the calling thread (a batch's, for locks another node
        holds: the runs only skip); returns APScheduler's events, which the caller reports."""
        return _run_with_fire_times(job, run_times, self._logger.name)

    def start_run(self, job: Any, run_times: list[datetime], token: int | None) -> None:
        """Submit a guarded run to the pool: with the token a batch won for it, or None for the
        per-job path (the run makes its own claim)."""
        aps.submit_to_pool(self, job, lambda: _run_with_fire_times(job, run_times, self._logger.name, token))
