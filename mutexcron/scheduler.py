"""MutexScheduler: APScheduler 3 with jobs guarded by leased, fenced named locks."""

from __future__ import annotations

import atexit
import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.util import ref_to_obj, undefined

from .errors import ConfigurationError
from .events import EVENT_MUTEX_ALL, MutexEvent, log_event
from .guard import apscheduler_internals as aps
from .guard.batch import ClaimBatch, run_batch
from .guard.catchup import CatchUp
from .guard.decorators import ScheduleDecorators
from .guard.firetimes import guard_trigger, zone_of
from .guard.job import GuardContext, GuardedJob, MutexConfig, MutexThreadPoolExecutor, _as_config, _seconds
from .guard.triggers import TriggerRoutes, register_triggers
from .heartbeat import LeaseManager
from .jobstores.hooks import SharedJobsMixin
from .jobstores.lockstore import refuse_local_lock_store, shared_lock_url
from .locks import DEFAULT_LOCK_URL, URL_ENV, LockStore, Node, default_lock_url, lock_store_from_url, store_scope_note
from .locks.record import DEFAULT_MAX_ATTRS_BYTES
from .mutex.lock import Mutex
from .node import NodeTraits, default_node_id, outbound_ip
from .observability.feed.writer import start_feed
from .observability.pings import register as register_pings
from .placement import HAND_OVER_WAIT_ENV, Placement, hand_over_wait_seconds, new_placement, placement_mode
from .placement.standby import Standby
from .readonly import only_reading
from .tasks.pool import TaskPool
from .tasks.retention import DEFAULT_RETENTION, PRUNE_LEASE, PRUNE_LOCK, Pruner, check_retention, retention_from_env
from .tasks.runner import TaskRunner
from .tasks.worker import DEFAULT_CONCURRENCY
from .urls import mask_url

if TYPE_CHECKING:
    from .observability.metrics import Observability

log = logging.getLogger(__name__)

DEFAULT_UNACTIVE_INTERVAL = 10.0


class MutexSchedulerMixin(SharedJobsMixin, ScheduleDecorators):
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
        task_concurrency: threads running task handlers (``sched.tasks``) on this node;
            ``$MUTEXCRON_TASK_CONCURRENCY`` sets it too (default 8).
        task_retention: how long finished tasks (the SQL and MongoDB stores' tombstones) are kept
            before a node running a task worker prunes them, one node at a time under the lock
            ``mutexcron:prune-tasks``: a timedelta or seconds, ``0`` keeps everything;
            ``$MUTEXCRON_TASK_RETENTION`` sets it too (``7d``, ``90s``; default 7 days).
        triggers: serve ``mutexcron trigger JOB`` requests (a task worker runs on every node with
            guarded jobs; default True).
        metrics_port: serve Prometheus metrics and health checks on this port from ``start()`` to
            ``shutdown()`` (``/metrics``, ``/healthz``, ``/readyz``; needs ``mutexcron[metrics]``);
            ``$MUTEXCRON_METRICS_PORT`` sets it too. Default: none, nothing is served.
        metrics_host: the address it binds (``$MUTEXCRON_METRICS_HOST``; default 127.0.0.1, this host
            only: ``"0.0.0.0"`` exposes the endpoints on every interface).
        placement: which locks this node asks for: ``"balanced"`` (the default: every live node its
            fair share; a lock that moves is handed over at a fire-time boundary) or ``"first"`` (every
            node asks for every lock, the first holds it: earlier releases' behaviour);
            ``$MUTEXCRON_PLACEMENT`` sets it too.
        weight: this node's weight under balanced placement (default 1: a node of weight 2 is placed
            for about twice the locks); ``$MUTEXCRON_WEIGHT`` sets it too.
        tags: this node's tags, matched by ``mutex(nodes="tag:eu")`` (and by plain patterns, as
            node ids are); ``$MUTEXCRON_TAGS`` (comma-separated) sets them too.
        **kwargs: passed to the APScheduler scheduler. ``timezone`` is APScheduler's default (the
            host's zone); every node must compute a lock's cron and date fire times in the same zone,
            and a node in another zone than the lock's record refuses its jobs (the zone rule).
    """

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
        task_concurrency: int | None = None,
        task_retention: timedelta | float | None = DEFAULT_RETENTION,
        triggers: bool = True,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        placement: str | None = None,
        weight: float | None = None,
        tags: Sequence[str] | None = None,
        hand_over_wait: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.lock_url = lock_url or default_lock_url()
        self._lock_store = lock_store
        # Given none, a scheduler with a shared job store keeps its locks in that store's database.
        self._lock_url_given = bool(lock_url or lock_store is not None or os.environ.get(URL_ENV))
        self.node_id = node_id or os.environ.get("MUTEXCRON_NODE_ID") or default_node_id()
        # A default id names this process; a scheduler built before a fork (gunicorn --preload)
        # and started in each worker needs one per worker: start() makes a new one there.
        self._node_id_for_pid: int | None = None if node_id or os.environ.get("MUTEXCRON_NODE_ID") else os.getpid()
        self._started_pid: int | None = None
        self.local_ip = local_ip or outbound_ip()
        env_interval = os.environ.get("MUTEXCRON_UNACTIVE_INTERVAL")
        try:
            default = _seconds(unactive_interval, "unactive_interval") or _seconds(
                float(env_interval) if env_interval else None, "MUTEXCRON_UNACTIVE_INTERVAL"
            )
        except ValueError as exc:
            raise ConfigurationError(f"MUTEXCRON_UNACTIVE_INTERVAL={env_interval!r}: {exc}") from None
        self.unactive_interval: float = default or DEFAULT_UNACTIVE_INTERVAL
        self._guard_context = GuardContext(self.unactive_interval, self.local_ip)
        self.shutdown_timeout = shutdown_timeout
        self.placement = placement_mode(placement or os.environ.get("MUTEXCRON_PLACEMENT"))
        #: Balanced placement: the longest a stopping node waits for a successor (at most shutdown_timeout).
        self.hand_over_wait = hand_over_wait_seconds(
            hand_over_wait if hand_over_wait is not None else os.environ.get(HAND_OVER_WAIT_ENV)
        )
        #: This node's weight and tags (placement reads every node's from its presence).
        self.traits = NodeTraits.checked(
            weight if weight is not None else os.environ.get("MUTEXCRON_WEIGHT"),
            tags if tags is not None else os.environ.get("MUTEXCRON_TAGS"),
        )
        self.max_attrs_bytes = max_attrs_bytes
        self.triggers = triggers
        self._own_store = lock_store is None  # built from the URL here: closed by shutdown()
        self._tasks = TaskRunner(
            lock_store.url if lock_store is not None else self.lock_url,
            task_concurrency or _env_int("MUTEXCRON_TASK_CONCURRENCY") or DEFAULT_CONCURRENCY,
        )
        given = check_retention(task_retention)
        self.task_retention = retention_from_env(given) if task_retention is DEFAULT_RETENTION else given
        self._pruner: Pruner | None = None
        self._trigger_routes: TriggerRoutes | None = None  # the trigger codes served, once started
        self._claim_batch = ClaimBatch()
        self._leases: LeaseManager | None = None
        self._standby: Standby | None = None  # balanced placement: the loop sees only held locks' jobs
        self._catch_up: CatchUp | None = None
        self._guarded: dict[str, GuardedJob] = {}  # job id -> guard
        self._user_misfire: set[str] = set()
        self._used_ids: set[str] = set()
        self._forget_after_run: set[str] = set()  # removed jobs with a run still going: forget_job
        self._setup_lock = threading.RLock()  # add_job from several threads, and start()
        super().__init__(*args, **kwargs)
        self.add_listener(log_event, EVENT_MUTEX_ALL)  # type: ignore[attr-defined]  # the log lines are a listener
        self._observability = _observability(metrics_port, metrics_host)  # /metrics, /healthz, /readyz
        self._pings = register_pings(self)  # monitors' ping hooks (mutex(ping=...)): a listener too

    # -- configuration -----------------------------------------------------------------------
    def configure_mutex(
        self,
        *,
        lock_url: str | None = None,
        lock_store: LockStore | None = None,
        node_id: str | None = None,
        unactive_interval: timedelta | float | None = None,
        shutdown_timeout: float | None = None,
        task_concurrency: int | None = None,
        task_retention: timedelta | float | object | None = ...,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        placement: str | None = None,
        weight: float | str | None = None,
        tags: Sequence[str] | None = None,
        hand_over_wait: float | None = None,
    ) -> None:
        """Override the lock settings before ``start()`` (the CLI's options use this).

        A ``lock_store`` given here is owned by the scheduler from then on: ``shutdown()`` closes it.
        """
        if self._leases is not None:
            raise ConfigurationError("configure_mutex() must be called before start()")
        if lock_store is not None:
            self.lock_url, self._lock_store, self._own_store = lock_store.url, lock_store, True
        elif lock_url:
            self.lock_url, self._lock_store, self._own_store = lock_url, None, True
        self._lock_url_given = self._lock_url_given or bool(lock_store is not None or lock_url)
        if node_id:
            self.node_id, self._node_id_for_pid = node_id, None
        interval = _seconds(unactive_interval, "unactive_interval")
        if interval:
            self.unactive_interval = self._guard_context.ttl = interval
        if shutdown_timeout is not None:
            self.shutdown_timeout = shutdown_timeout
        if placement is not None:
            self.placement = placement_mode(placement)
        if hand_over_wait is not None:
            self.hand_over_wait = hand_over_wait_seconds(hand_over_wait)
        if weight is not None or tags is not None:
            self.traits = NodeTraits.checked(
                self.traits.weight if weight is None else weight, self.traits.tags if tags is None else tags
            )
        if task_concurrency is not None:
            self._tasks.concurrency = task_concurrency
        if task_retention is not ...:
            self.task_retention = check_retention(task_retention)
        if metrics_port is not None or metrics_host is not None:
            self._observability = _observability(metrics_port, metrics_host, self._observability)
        self._tasks.rebind(self.lock_url)

    @property
    def lock_store(self) -> LockStore:
        """The lock store (built from ``lock_url`` on first use)."""
        if self._lock_store is None:
            self._lock_store = lock_store_from_url(self.lock_url)
        return self._lock_store

    @property
    def tasks(self) -> TaskPool:
        """The durable task pool on the scheduler's store: register handlers with
        ``@sched.tasks.handler(code)``; they run on every node that starts this scheduler."""
        return self._tasks.pool

    @property
    def node(self) -> Node:
        return Node(self.node_id, self.local_ip)

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
        with self._setup_lock:
            return self._add_job(
                func, trigger, args, kwargs, id, name, misfire_grace_time, coalesce, max_instances,
                next_run_time, jobstore, executor, replace_existing, mutex, trigger_args,
            )

    def _add_job(  # APScheduler's add_job arguments, positionally
        self, func: Any, trigger: Any, args: Any, kwargs: Any, id: str | None, name: str | None,
        misfire_grace_time: Any, coalesce: Any, max_instances: Any, next_run_time: Any, jobstore: str,
        executor: str, replace_existing: bool, mutex: Any, trigger_args: dict[str, Any],
    ) -> Any:
        raw = func
        if id is None and callable(func):
            id = self._stable_id(func)
        # A job in a shared job store keeps the user's function (every node restores it from the
        # store and applies the guard there): jobstores/node.py's rule gives its guard.
        shared = self._is_shared_store(jobstore)
        if shared:
            raw = ref_to_obj(func) if isinstance(func, str) else func
            config: MutexConfig | None = self._shared_jobs.config_for_add(raw, mutex, str(id), jobstore)
            if (problem := self._shared_jobs.executor_problem(executor, missing_ok=True)) is not None:
                raise ConfigurationError(f"cannot add shared job {id!r}: {problem}")
            if next_run_time is not undefined:
                self._shared_jobs.mark_explicit(str(id))
        else:
            config = _as_config(mutex) or getattr(func, "__mutexcron_mutex__", None)
        if id is not None:
            self._used_ids.add(id)
            if misfire_grace_time is not undefined:  # the user's choice wins, even if mutex() comes later
                self._user_misfire.add(id)
        if config is not None:
            guard = self._guard(raw, config, str(id))
            func = func if shared else guard
            trigger, trigger_args = self._guarded_trigger(trigger, trigger_args, guard), {}
            self._check_group(guard)  # before anything is added
            if coalesce is undefined:  # True, as APScheduler's default, unless job_defaults say otherwise
                coalesce = aps.job_default(self, "coalesce") is not False
            if misfire_grace_time is undefined and self._leases is not None:
                misfire_grace_time = self._guard_misfire(guard)
        try:
            job = super().add_job(
                func, trigger, args, kwargs, id, name, misfire_grace_time, coalesce, max_instances,
                next_run_time, jobstore, executor, replace_existing, **trigger_args,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"cannot add job {id!r}: {exc}") from None
        if shared:
            self._shared_jobs.register(job.id, raw, guard, job.trigger)
        elif config is not None:
            self._register_guard(job.id, func)
        self._route_triggers(job.id)
        try:
            raw.__dict__.setdefault("__mutexcron_jobs__", []).append(job)
        except AttributeError:  # builtins, partials...: mutex= must then be given to add_job
            pass
        return job

    def remove_job(self, job_id: str, jobstore: str | None = None) -> None:
        """APScheduler's ``remove_job`` (also what it calls for a finished date job); a guarded
        job's registration is undone too (:meth:`forget_job`)."""
        super().remove_job(job_id, jobstore)
        if not self._shared_jobs.was_kept(job_id):  # a date job changed during its last pass stays
            self.forget_job(job_id)

    def remove_all_jobs(self, jobstore: str | None = None) -> None:
        """APScheduler's ``remove_all_jobs``; the removed guarded jobs are forgotten (:meth:`forget_job`)."""
        super().remove_all_jobs(jobstore)  # type: ignore[misc]
        for job_id in list(self._guarded):
            if self.get_job(job_id) is None:  # type: ignore[attr-defined]
                self.forget_job(job_id)

    def forget_job(self, job_id: str) -> None:
        """Undo what adding job ``job_id`` registered, once APScheduler no longer has it.

        Its guard, its stable id and its metrics series go. If it was the last job of its lock,
        the lock is released (fenced; when a run in progress ends) and forgotten: no longer
        renewed, taken over or shown, and its lock's series go too. Unknown ids are ignored.
        """
        with self._setup_lock:
            self._used_ids.discard(job_id)
            self._user_misfire.discard(job_id)
            if job_id in self._guarded and self._instances(job_id):
                # Submitted and not ended yet (APScheduler removes a date job in the pass that
                # submits its run): forgotten when its last instance ends (_job_instance_ended).
                self._forget_after_run.add(job_id)
                return
            self._forget_guard(job_id)

    def _instances(self, job_id: str) -> int:
        """Runs of ``job_id`` submitted to an executor and not ended yet."""
        return sum(aps.instances(executor, job_id) for executor in list(aps.executors(self).values()))

    def _job_instance_ended(self, job_id: str) -> None:
        """An executor ended a run of ``job_id`` (mutexcron's executors call this)."""
        if job_id not in self._forget_after_run:
            return
        with self._setup_lock:
            if job_id in self._forget_after_run and not self._instances(job_id):
                self._forget_guard(job_id)

    def _forget_guard(self, job_id: str) -> None:
        self._forget_after_run.discard(job_id)
        guard = self._guarded.pop(job_id, None)
        if guard is None:
            return
        jobs = getattr(guard.func, "__dict__", {}).get("__mutexcron_jobs__")
        if jobs:
            jobs[:] = [job for job in jobs if job.id != job_id]
        per_lock = self._guard_context.jobs_per_lock
        per_lock[guard.lock] -= 1
        last = per_lock[guard.lock] <= 0
        if last:
            del per_lock[guard.lock]
            if self._leases is not None and not guard.config.callable_lock:
                let_go = self._shared_jobs is not None and self._shared_jobs.lets_go(guard.lock)
                self._leases.remove_lock(guard.lock, let_go=let_go)
        if self._catch_up is not None:
            self._catch_up.forget(job_id, guard.lock if last else None)
        metrics = self._observability.metrics if self._observability is not None else None
        if metrics is not None:
            metrics.forget(job_id, guard.lock if last else None)

    def _guarded_trigger(self, trigger: Any, trigger_args: dict[str, Any], guard: GuardedJob) -> Any:
        """The trigger built as APScheduler would, then made to name the same slots on every node."""
        try:
            built = aps.create_trigger(self, trigger, dict(trigger_args))
        except (ValueError, TypeError, LookupError) as exc:
            raise ConfigurationError(f"cannot add job {guard.job_id!r}: {exc}") from None
        trigger = guard_trigger(built, guard.job_id)
        guard.zone = zone_of(trigger)
        guard.trigger_text = str(trigger)
        return trigger

    def _stable_id(self, func: Callable[..., Any]) -> str:
        base = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        candidate, n = base, 1
        while candidate in self._used_ids:
            n += 1
            candidate = f"{base}#{n}"
        return candidate

    def _guard(self, func: Callable[..., Any], config: MutexConfig, job_id: str) -> GuardedJob:
        """The guard for ``func``: a coroutine function needs the asyncio flavour."""
        if not inspect.iscoroutinefunction(func) or config.callable_lock:
            return GuardedJob(self._guard_context, func, config, job_id)
        if not self._runs_coroutines:
            raise ConfigurationError(
                f"job {job_id!r} is a coroutine function (async def): use mutexcron.AsyncIOMutexScheduler, "
                f"not {type(self).__name__}"
            )
        from .guard.job_async import AsyncGuardedJob

        return AsyncGuardedJob(self._guard_context, func, config, job_id)

    _runs_coroutines = False  # True on the asyncio flavour

    def _check_group(self, guard: GuardedJob) -> None:
        """Jobs sharing a lock share one lease length and one time zone."""
        if guard.config.callable_lock:
            return
        for other in self._guarded.values():
            if other.lock != guard.lock or other.job_id == guard.job_id:
                continue
            if other.config.unactive_interval != guard.config.unactive_interval:
                raise ConfigurationError(
                    f"jobs {other.job_id!r} and {guard.job_id!r} share lock {guard.lock!r} but have different "
                    "unactive_interval values; a lock has one lease length: give them the same one"
                )
            if None not in (other.zone, guard.zone) and other.zone != guard.zone:
                raise ConfigurationError(
                    f"jobs {other.job_id!r} and {guard.job_id!r} share lock {guard.lock!r} but fire in time zones "
                    f"{other.zone} and {guard.zone}; a lock's record carries one zone: give both triggers the same timezone="
                )

    def _lock_triggers(self, lock: str) -> dict[str, str]:
        """``lock``'s jobs on this node and their triggers, as the holder writes them for the others to compare."""
        return {
            job_id: g.trigger_text
            for job_id, g in self._guarded.items()
            if g.lock == lock and g.trigger_text is not None and not g.config.callable_lock
        }

    def _lock_zone(self, lock: str) -> str | None:
        """The zone this node computes ``lock``'s fire times in: its jobs' (None: no job depends on one)."""
        return next((g.zone for g in self._guarded.values() if g.lock == lock and g.zone is not None), None)

    def _register_guard(self, job_id: str, guard: GuardedJob) -> None:
        self._forget_after_run.discard(job_id)  # re-added before its removed run ended
        replaced = self._guarded.get(job_id)
        if replaced is not None:
            self._guard_context.jobs_per_lock[replaced.lock] -= 1
        self._guarded[job_id] = guard
        self._guard_context.jobs_per_lock[guard.lock] += 1
        if self._leases is not None and not guard.config.callable_lock:
            self._leases.placement.restrict(guard.lock, guard.config.node_patterns)
            self._leases.set_zone(guard.lock, self._lock_zone(guard.lock), self._lock_triggers(guard.lock))
            self._leases.add_lock(guard.lock, guard.ttl)

    def _guard_existing(self, job: Any, func: Callable[..., Any], config: MutexConfig) -> None:
        if self._shared_jobs.owns(job.id):  # the options go on the function, where every node reads them
            func.__mutexcron_mutex__ = config  # type: ignore[attr-defined]
            self._shared_jobs.register(job.id, func, self._guard(func, self._shared_jobs.config_of(func, job.id), job.id))
            return
        guard = self._guard(func, config, job.id)
        trigger = self._guarded_trigger(job.trigger, {}, guard)
        self._check_group(guard)
        changes: dict[str, Any] = {"func": guard}
        if job.id not in self._user_misfire and self._leases is not None:
            changes["misfire_grace_time"] = self._guard_misfire(guard)
        job.modify(**changes)
        if trigger is not job.trigger or self._leases is not None:
            # Recompute the next fire time from the cluster-wide anchor, not from this node's start.
            if self._leases is None:
                aps.modify_pending(job, trigger=trigger)
            else:
                job.reschedule(trigger)
        self._register_guard(job.id, guard)

    def _guard_misfire(self, guard: GuardedJob) -> int:
        """At least 2 x the lease, so a fire time missed during a failover is caught up."""
        default = aps.job_default(self, "misfire_grace_time") or 1
        return max(int(default), math.ceil(2 * guard.ttl))

    # -- running ---------------------------------------------------------------------------------
    def start(self, paused: bool = False) -> None:
        """Open the lock store, start the heartbeat thread and the scheduler.

        Also registers an interpreter-exit hook: a process that ends without calling
        ``shutdown()`` (a web worker's normal exit, a reload) still stops gracefully and releases
        its leases, so a standby takes over at once instead of after a lease.
        """
        if only_reading():  # a jobs file imported only to read its jobs (mutexcron jobs): never a node
            log.info("start() not run: the jobs file is only read here")
            return
        with self._setup_lock:
            if self._node_id_for_pid is not None and self._node_id_for_pid != os.getpid():
                self.node_id, self._node_id_for_pid = default_node_id(), os.getpid()
            for alias, executor in list(aps.executors(self).items()):
                mutex_executor = self._mutex_executor(executor)
                if mutex_executor is not None:
                    aps.replace_executor(self, alias, mutex_executor)
            self._check_guarded_executors()
            self._share_jobstores()
            self._place_locks()
            # Shared jobs' locks are taken only while the scheduler runs (jobstores/node.py).
            shared = self._shared_jobs
            locks = {g.lock: g.ttl for g in self._guarded.values() if not g.config.callable_lock and not shared.owns(g.job_id)}
            store = self.lock_store  # a bad URL fails here, before anything starts
            self._size_store_pool(store)
            if self._observability is not None:  # serves from here; the heartbeat and ticks use a timed store
                store = self._observability.start(self, store)
                self._guard_context.run_stats = self._observability.metrics
            # A shared job's missed fire times are its loop's: the stored next run time stays due until
            # the holder runs it (by misfire_grace_time and coalesce), so no takeover catch-up for it.
            # Balanced placement: a job left out of a standby's loop is caught up by the loop itself
            # when its lock is taken (placement/standby.py), not by a second run of the catch-up.
            skip = lambda job_id: shared.owns(job_id) or self._put_back(job_id)  # noqa: E731
            skip_handed = lambda job_id: self._put_back(job_id) and not shared.owns(job_id)  # noqa: E731
            self._catch_up = CatchUp(
                self, lambda: self._guarded, self._emit, self.node_id, skip=skip, skip_handed=skip_handed, stored=shared.owns
            )
            self._leases = LeaseManager(
                store,
                self.node,
                locks,
                on_acquired=self._lock_taken,
                on_read=self._catch_up.check_missed,
                max_attrs_bytes=self.max_attrs_bytes,
                emit=self._emit,
                zones={lock: zone for lock in locks if (zone := self._lock_zone(lock)) is not None},
                triggers={lock: self._lock_triggers(lock) for lock in locks},
                placement=self._new_placement(),
            )
            self._guard_context.leases = self._leases
            if self.placement == "balanced":
                self._standby = Standby(self, lambda: self._guarded, self._leases)
                for alias, jobstore in list(aps.jobstores(self).items()):
                    aps.jobstores(self)[alias] = self._standby.adopt(jobstore)
            for job in aps.pending_jobs(self):
                guard = self._guarded.get(job.id)
                if guard is not None and job.id not in self._user_misfire and not guard.config.callable_lock:
                    aps.modify_pending(job, misfire_grace_time=self._guard_misfire(guard))
            log.info(
                "node %s (%s) using lock store %s; %d guarded job(s) on %d lock(s); %d task handler(s)",
                self.node_id,
                self.local_ip,
                store.masked_url,
                len(self._guarded),
                len(locks),
                len(self._tasks.pool.handlers),
            )
            note = store_scope_note(store.url, defaulted=self._own_store and self.lock_url == DEFAULT_LOCK_URL)
            if note is not None:
                log.log(*note)
        self._started_pid = os.getpid()
        _at_exit(self._stop_at_exit)
        start_feed(self, self.lock_store, self.node_id)  # the event feed the dashboard shows (observability/feed)
        guarded = any(not g.config.callable_lock for g in self._guarded.values()) or (self._has_shared_stores() and not paused)
        if self.triggers and self._tasks.available() and guarded:  # before a lock is taken: see _lock_taken
            # `mutexcron trigger JOB`: a guarded job through its lock, requested with the job's own code
            defined = {*self._guarded, *(job.id for job in aps.pending_jobs(self))}
            self._trigger_routes = register_triggers(self, sorted(defined))  # type: ignore[arg-type]
        # The heartbeat thread starts first: BlockingScheduler.start() does not return.
        self._leases.start()
        self._tasks.start(self.node_id, self._leases, self._emit)
        self._start_pruner()
        super().start(paused)  # type: ignore[misc]


    def _start_pruner(self) -> None:
        """On a node running a task worker, prune finished tasks older than ``task_retention``
        (one node at a time, under a lease of its own on the lock store)."""
        if self.task_retention is None or self._tasks.worker is None or self._pruner is not None:
            return
        if not self._tasks.pool.store.keeps_tombstones:
            return  # Redis, memory: a finished task is deleted when it finishes
        mutex = Mutex(store=self.lock_store, local_ip=self.local_ip)
        self._pruner = Pruner(
            self._tasks.pool.store,
            self.task_retention,
            lambda: mutex.hold(PRUNE_LOCK, lease=PRUNE_LEASE, wait=False),
            on_stop=mutex.close,
        )
        self._pruner.start()

    def _place_locks(self) -> None:
        """Given no lock store, keep the locks (and tasks) in the shared job store's database; refuse
        a lock store only this host reaches beside a job store other hosts share."""
        stores = aps.jobstores(self)
        if not self._lock_url_given and (url := shared_lock_url(stores)) is not None:
            self.lock_url, self._lock_store = url, None
            self._tasks.rebind(url)
            log.info("no lock store configured: the locks and tasks go to the shared job store's database, %s", mask_url(url))
        refuse_local_lock_store(self._lock_store.url if self._lock_store is not None else self.lock_url, stores)

    def _put_back(self, job_id: str) -> bool:
        """True for a job the standby puts back in the loop when its lock is taken (balanced placement)."""
        guard = self._guarded.get(job_id)
        return self._standby is not None and guard is not None and not guard.ticks_on_standby

    def _lock_taken(self, name: str, before: Any) -> None:
        """This node just took ``name``: catch up a fire time missed meanwhile, and put its jobs back
        in the loop (balanced placement)."""
        if self._catch_up is not None:
            handed = before is not None and before.holder == self.node_id and before.active_ip is None  # an offer taken
            self._catch_up.queue(name, before, handed=handed)
        if self._standby is not None:
            self._standby.taken(name, before)
        if self._trigger_routes is not None and before is not None:
            # The lock's jobs by its record, this node's or not (one removed from the jobs file): a
            # request naming the lock reaches its holder, which fails it at once if it lacks the job.
            for job_id in {*before.fire_times, *(before.triggers or {})}:
                self._trigger_routes.serve(job_id)

    def _create_default_jobstore(self) -> Any:
        store = super()._create_default_jobstore()  # type: ignore[misc]
        return self._standby.adopt(store) if self._standby is not None else store

    def _new_placement(self) -> Placement:
        """This node's placement, with the ``mutex(nodes=...)`` patterns of its guarded locks."""
        placement = new_placement(self.placement, self.node_id, self.traits)
        for guard in self._guarded.values():
            if not guard.config.callable_lock:
                placement.restrict(guard.lock, guard.config.node_patterns)
        return placement

    def _size_store_pool(self, store: LockStore) -> None:
        """Tell a SQL store how many threads can call it at once (the executors' threads, the
        heartbeat and the catch-up thread), so its pool keeps that many connections."""
        size_pool = getattr(getattr(store, "backend", None), "size_pool", None)
        if size_pool is None:
            return  # not a SQL store
        threads = sum(aps.pool_size(e) for e in aps.executors(self).values() if isinstance(e, ThreadPoolExecutor))
        size_pool(max(threads, 10) + 2)  # 10: APScheduler's default executor, created later in start()

    def _check_guarded_executors(self) -> None:
        for job in aps.pending_jobs(self):
            guard = self._guarded.get(job.id)
            if guard is None or guard.config.callable_lock:
                continue
            executor = aps.executors(self).get(job.executor)
            if executor is not None and type(executor) is not type(self._create_default_executor()):
                raise ConfigurationError(
                    f"guarded job {job.id!r} uses executor {job.executor!r} ({type(executor).__name__}); guarded "
                    "jobs need mutexcron's executor (the default) to know their fire time"
                )

    def _create_default_executor(self) -> Any:
        return MutexThreadPoolExecutor()

    def _process_jobs(self) -> Any:
        """One pass of APScheduler's loop; the guarded jobs it submits claim together after it."""
        self._claim_batch.open()
        try:
            return aps.process_jobs(self, super()._process_jobs)  # type: ignore[misc]
        except Exception as exc:  # APScheduler's loop dies with this, in every flavour
            self._loop_died(exc)
            raise
        finally:
            self._submit_batch(self._claim_batch.close(), self._pass_pins())

    def _pass_pins(self) -> Callable[[], None]:
        """Unpins the locks of the shared jobs this pass found due (once their runs are counted)."""
        shared = self.__dict__.get("_shared_jobs_state")
        pins, leases = (shared.take_pins() if shared is not None else []), self._leases
        if not pins or leases is None:
            return lambda: None
        return lambda: leases.unpin(pins)

    def _submit_batch(self, entries: list[Any], counted: Callable[[], None] = lambda: None) -> None:
        """Hand the pass's guarded runs to the pool; ``counted`` is called once they are counted as
        running. Never raises: an error here would end APScheduler's loop (this runs on its
        thread), and the node would keep its leases and run nothing."""
        if not entries:
            counted()
            return
        try:
            aps.submit_work(entries[0].executor, lambda: run_batch(entries, _start_one, counted))
        except Exception as exc:  # noqa: BLE001 - no thread could be started, the pool was shut down...
            counted()
            log.error(
                "%d guarded run(s) due now could not be handed to the thread pool (%s); they do not run on this node",
                len(entries),
                exc,
            )
            for entry in entries:
                aps.release_instance(entry.executor, entry.job)

    def _loop_died(self, exc: BaseException) -> None:
        """APScheduler's loop ends: this node can run no guarded job any more, so it gives up its
        leases (a standby takes over) and /healthz says why."""
        reason = f"the scheduler loop died ({type(exc).__name__}: {exc})"
        log.error("%s: releasing this node's leases; restart the process", reason)
        if self._leases is not None:
            self._leases.give_up(reason)

    def _mutex_executor(self, executor: Any) -> Any:
        """mutexcron's executor in place of a plain APScheduler one you configured, or None."""
        if type(executor) is ThreadPoolExecutor:
            return MutexThreadPoolExecutor(aps.pool_size(executor))
        return None

    def shutdown(self, wait: bool = True) -> None:
        """Stop scheduling, wait for running jobs, release the leases, close the store.

        As in APScheduler, ``wait=True`` waits for running jobs; for guarded jobs at most
        ``shutdown_timeout`` seconds, after which their leases are left to expire. A guarded job
        still running then also stops the wait for unguarded ones, so the process can exit.
        """
        self._stop_leases(self.shutdown_timeout if wait else 0.0)
        leases = self._leases
        busy = bool(leases is not None and leases.running())
        try:
            super().shutdown(wait=wait and not busy)  # type: ignore[misc]
        finally:
            if self._catch_up is not None:
                self._catch_up.shutdown()
            if self._own_store and self._lock_store is not None and not busy:
                self._lock_store.close()
                self._lock_store = None
            self._tasks.close()
            if self._observability is not None:
                self._observability.stop()

    def _stop_leases(self, timeout: float) -> None:
        """Stop scheduling, wait up to ``timeout`` for guarded runs, release the leases."""
        leases = self._leases
        if leases is not None and self.running and not leases.stopping:  # type: ignore[attr-defined]
            # Balanced: each lock to its successor, jobs still running, while a fire time needs it.
            leases.hand_over_all(min(self.hand_over_wait, timeout), self._next_fires)
            aps.stop_processing(self)  # no new fire times while guarded runs end (pause() would tell listeners)
            started = time.monotonic()
            leases.begin_stop()  # no takeover or new run while the task worker stops
            if self._pruner is not None:
                self._pruner.stop()  # after its batch in flight: the prune lock given back
            self._tasks.stop(timeout)  # tasks first: their leases renew in the heartbeat thread
            leases.stop(max(0.0, timeout - (time.monotonic() - started)))

    def _next_fires(self) -> dict[str, float | None]:
        """Seconds until each guarded lock's next fire time on this node (:data:`~mutexcron.heartbeat.NextFires`):
        the soonest of its jobs', 0 while a run of one is submitted and has not ended, None when none
        has one (paused, or no fire time left). Shared jobs' locks are left out: their fire times are
        the shared store's, and a stopping node waits for a successor for them as before."""
        now = datetime.now(timezone.utc)
        fires: dict[str, float | None] = {}
        shared: set[str] = set()
        with aps.jobstores_lock(self):
            for job_id, guard in list(self._guarded.items()):
                if guard.config.callable_lock:
                    continue
                if self._shared_jobs.owns(job_id):
                    shared.add(guard.lock)
                    continue
                seconds = self._seconds_to_fire(job_id, now)
                soonest = fires.get(guard.lock)
                fires[guard.lock] = seconds if soonest is None or (seconds is not None and seconds < soonest) else soonest
        return {lock: seconds for lock, seconds in fires.items() if lock not in shared}

    def _seconds_to_fire(self, job_id: str, now: datetime) -> float | None:
        """Seconds from ``now`` to the job's next fire time (0: due, or a run submitted and not ended;
        None: paused, or gone from its store). The caller holds the job stores' lock."""
        if self._instances(job_id):
            return 0.0
        found = aps.lookup_stored_job(self, job_id)
        next_run = found[0].next_run_time if found is not None else None
        return None if next_run is None else max(0.0, (next_run - now).total_seconds())

    def skipped_runs(self) -> dict[tuple[str, str, str], int]:
        """Fire times of guarded jobs this node skipped since it started: ``{(job id, lock, reason): count}``
        (reasons as in :data:`~mutexcron.events.EVENT_RUN_SKIPPED`)."""
        return {(g.job_id, g.lock, reason): n for g in list(self._guarded.values()) for reason, n in dict(g.skips).items()}

    def running_guarded_jobs(self) -> dict[str, int]:
        """Guarded runs in progress on this node, per lock (after ``shutdown()``: those that
        outlived ``shutdown_timeout``)."""
        return self._leases.running() if self._leases is not None else {}

    def _emit(self, event: MutexEvent) -> None:
        """Deliver a lease or run event to the listeners (:mod:`mutexcron.events`), the log lines included."""
        aps.dispatch_event(self, event)

    def _route_triggers(self, job_id: str) -> None:
        """A job defined here after start (an ``add_job``, a shared job restored): this node now
        serves the trigger requests' code of ``job_id``."""
        if self._trigger_routes is not None:
            self._trigger_routes.serve(job_id)

    def guard_of(self, job_id: str) -> GuardedJob | None:
        """The guard of a guarded job (not of a callable-lock one), or None."""
        guard = self._guarded.get(job_id)
        return None if guard is None or guard.config.callable_lock else guard

    def misfire_grace_of(self, job_id: str) -> int | None:
        """The misfire grace time a running node gives a guarded job (2 x the lease), read without
        starting; None if the job is not guarded or the user set its own."""
        guard = self.guard_of(job_id)
        return None if guard is None or job_id in self._user_misfire else self._guard_misfire(guard)

    def running_tasks(self) -> dict[tuple[str, str], int]:
        """Task handlers in progress on this node, (code, key) -> token (after ``shutdown()``: those
        that outlived ``shutdown_timeout``)."""
        worker = self._tasks.worker
        return worker.running() if worker is not None else {}

    def _stop_at_exit(self) -> None:
        # Exit hooks survive fork(): a child must not stop (or release the leases of) its parent's
        # scheduler, whose threads it does not even have.
        if self.running and os.getpid() == self._started_pid:  # type: ignore[attr-defined]
            log.info("interpreter exiting: stopping the scheduler and releasing its leases")
            self.shutdown(wait=True)


def _observability(port: int | None, host: str | None, current: Observability | None = None) -> Observability | None:
    """The metrics and health endpoints if a port is set (:mod:`mutexcron.observability.metrics`); else nothing is imported."""
    if port is None and current is None and not os.environ.get("MUTEXCRON_METRICS_PORT"):
        return None
    from .observability.metrics import Observability

    return Observability.configure(port, host, current)


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(f"{name}={text!r}: give a whole number >= 1")
    return value


def _start_one(entry: Any, token: int | None) -> None:
    entry.executor.start_run(entry.job, [entry.run_time], token)


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
