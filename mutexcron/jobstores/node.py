"""What one scheduler knows of its shared job stores: each shared job's guard and lock, the
watcher that brings other writers' changes, and the rule for ``mutex=``.

The rule: **every job in a shared store is guarded**, with a lock per job id. Its guard options are
read from the job's function, where every node (one started later too) finds them in the code:
``@sched.mutex(lock=..., unactive_interval=..., ping=...)`` on the function. ``add_job(mutex=None)``
and ``mutex=True`` get that guard; ``mutex=False`` (run on every node) and option dicts given to
``add_job`` alone (which other nodes could not know) are refused with the fix.

A node takes the locks of shared jobs only while its scheduler runs: a web process that starts its
scheduler paused (to add and change jobs, as APScheduler's docs advise) never holds one. A node
runs only the jobs whose lock it holds; a job is removed anywhere, and every node lets go of its lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from apscheduler.events import (
    EVENT_JOB_ADDED,
    EVENT_JOB_MODIFIED,
    EVENT_JOB_REMOVED,
    EVENT_SCHEDULER_PAUSED,
    EVENT_SCHEDULER_RESUMED,
    EVENT_SCHEDULER_STARTED,
    JobEvent,
)
from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.util import obj_to_ref

from ..errors import ConfigurationError
from ..events import EVENT_LOCK_ACQUIRED, EVENT_LOCK_TAKEN_OVER
from ..guard import apscheduler_internals as aps
from ..guard.firetimes import guard_trigger, zone_of
from ..guard.job import GuardedJob, MutexConfig
from .states import kind_of_change
from .watch import Watcher

if TYPE_CHECKING:
    from .base import SharedJobStore

log = logging.getLogger(__name__)


def zone_of_scheduler(sched: Any) -> str | None:
    """The zone a node computes its shared jobs' cron fire times in: its scheduler's ``timezone``."""
    return zone_of(CronTrigger(timezone=sched.timezone)) if getattr(sched, "timezone", None) is not None else None


def cron_zone(trigger: Any) -> str | None:
    """A cron trigger's zone (its fire times depend on it); None for any other trigger."""
    return zone_of(trigger) if isinstance(getattr(trigger, "inner", trigger), CronTrigger) else None


def config_of_function(func: Any, job_id: str) -> MutexConfig:
    """A shared job's guard: its function's ``@sched.mutex(...)`` options, else a lock named as the job."""
    found = getattr(func, "__mutexcron_mutex__", None)
    config = found if isinstance(found, MutexConfig) else MutexConfig()
    if config.callable_lock:
        raise ConfigurationError(
            f"job {job_id!r} is in a shared job store, where the lock is the store's: mutex(lock=<callable>) "
            "(your own lock functions) is not supported there; give a lock name or none"
        )
    return config if config.lock is not None else dataclasses.replace(config, lock=job_id)


class SharedJobs:
    """The shared job stores of one scheduler (``sched._shared_jobs``)."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self._mutex = threading.RLock()
        self._stores: list[SharedJobStore] = []
        self._watchers: dict[int, Watcher[SharedJobStore]] = {}
        self._guards: dict[str, tuple[Any, GuardedJob]] = {}  # job id -> (its function, its guard)
        self._leased: set[str] = set()  # locks handed to the lease manager
        self._explicit: set[str] = set()  # jobs added with next_run_time= given
        self._one_off: set[str] = set()  # date jobs guarded by a lock of their own (named as the job)
        self._letting_go: set[str] = set()  # their locks, once the job is gone: the holder forgets the record
        self._warned: dict[str, str] = {}  # job id -> the restore error last warned about
        self._kept = threading.local()  # the job id whose removal by this thread's loop pass was refused
        self._pass = threading.local()  # the locks this thread's loop pass pinned (begin_pass)
        self._default_executor: type | None = None  # the scheduler's own executor class
        self._my_zone: tuple[str | None] | None = None  # (this node's zone,) once read
        self._listening = False

    # -- add_job ---------------------------------------------------------------------------------
    def config_for_add(self, func: Any, mutex: Any, job_id: str, alias: str) -> MutexConfig:
        """The guard of a job added to shared store ``alias`` (see the module's rule)."""
        where = f"job {job_id!r} is in the shared job store {alias!r}"
        if mutex is False:
            raise ConfigurationError(
                f"{where}, where each job runs once per fire time across the cluster; mutex=False would run it "
                "on every node: add it to a memory job store instead (jobstores={'local': MemoryJobStore()}, "
                "add_job(..., jobstore='local', mutex=False))"
            )
        if mutex is not None and mutex is not True:
            raise ConfigurationError(
                f"{where}: its guard options must be known to every node, so they go on its function, where "
                "every node reads them: decorate the function with @sched.mutex(lock=..., unactive_interval=...) "
                "and add the job with mutex=True (or no mutex=)"
            )
        return config_of_function(func, job_id)

    @staticmethod
    def config_of(func: Any, job_id: str) -> MutexConfig:
        return config_of_function(func, job_id)

    def mark_explicit(self, job_id: str) -> None:
        """``add_job(next_run_time=...)``: a replacement writes that time, not the stored one."""
        self._explicit.add(job_id)

    def explicit_next_run_time(self, job_id: str) -> bool:
        return job_id in self._explicit

    def register(self, job_id: str, func: Any, guard: GuardedJob, trigger: Any = None) -> None:
        """The guard of a shared job, built where the job is added or restored (``trigger``: the job's)."""
        with self._mutex:
            previous = self._guards.get(job_id)
            self._guards[job_id] = (func, guard)
            self._note_one_off(job_id, guard.lock, trigger)
            context = self.sched._guard_context
            if previous is not None:
                context.jobs_per_lock[previous[1].lock] -= 1
            self.sched._guarded[job_id] = guard
            context.jobs_per_lock[guard.lock] += 1
            if previous is not None and previous[1].lock != guard.lock:
                self._release_if_unused(previous[1].lock)
        self._lease_locks()
        self.sched._route_triggers(job_id)

    def owns(self, job_id: str) -> bool:
        return job_id in self._guards

    # -- restoring a stored job ----------------------------------------------------------------------
    def guard(self, store: SharedJobStore, job: Any) -> bool:
        """Put the job's guard in place of its function; False if it has none on this node."""
        func = job.func
        # A process started paused (a web app) runs nothing and takes no lock: it may lack the executor.
        problem = self.executor_problem(job.executor, missing_ok=self.sched.state == STATE_PAUSED)
        if problem is not None:
            self._warn(job.id, f"job {job.id!r} in {store.where} is not run on this node: {problem}; it stays in the store")
            return False
        theirs, mine = cron_zone(job.trigger), self._zone()
        if theirs is not None and mine is not None and theirs != mine and self.sched.state != STATE_PAUSED:
            self._warn_zone(store, job.id, theirs, mine)  # the zone rule: a node that disagrees refuses the job
            self.forget(store, job.id, keep_warning=True)  # and its lock, if its code added it here
            return False
        with self._mutex:
            known = self._guards.get(job.id)
        if known is not None and known[0] is func:
            guard = known[1]
        else:
            try:
                config = config_of_function(func, job.id)
                guard = self.sched._guard(func, config, job.id)
                self.sched._check_group(guard)
            except ConfigurationError as exc:
                self._warn(job.id, f"job {job.id!r} in {store.where} is not run on this node: {exc}")
                return False
        if not self._same_lock(store, job, guard.lock):
            return False  # a new guard is not registered: this node takes no lock for it
        if known is None or known[1] is not guard:
            self.register(job.id, func, guard, job.trigger)
        else:
            with self._mutex:
                self._note_one_off(job.id, guard.lock, job.trigger)
        job.func = guard
        job.trigger = guard_trigger(job.trigger, job.id, anchor=False)
        return True

    def executor_problem(self, alias: str, *, missing_ok: bool = False) -> str | None:
        """Why a shared job on executor ``alias`` cannot run under its lock here (None: it can;
        with ``missing_ok``, also when this node has no such executor: a process adding the job).

        A node without that executor leaves the job to the nodes that have it (APScheduler's loop
        would delete it from the store). A process pool runs the job in a child, beyond the reach
        of its fire claim and lease check: refused.
        """
        executor = aps.executors(self.sched).get(alias)
        if executor is None:
            return None if alias == "default" or missing_ok else f"executor {alias!r} is not configured on this node"
        if self._default_executor is None:  # the type only: made once, not at each restore
            self._default_executor = type(self.sched._create_default_executor())
        if isinstance(executor, self._default_executor) or self.sched._mutex_executor(executor) is not None:
            return None
        return (
            f"executor {alias!r} is a {type(executor).__name__}: a shared job runs under its lock in the scheduler's "
            "own threads (its fire claim and lease are checked there). Drop executor= (or use a ThreadPoolExecutor); a "
            "job that needs processes can start them itself"
        )

    def _same_lock(self, store: SharedJobStore, job: Any, lock: str) -> bool:
        """False (and one warning) if the job was first added under another lock than this node's code names."""
        stored = getattr(job, "_mc_lock", None)
        if stored is None or stored == lock:
            return True
        self._warn(job.id, f"job {job.id!r} in {store.where} was added under lock {stored!r}, but this node's code "
                           f"names lock {lock!r}: it is not run on this node (two locks would run its fire times twice). "
                           "Deploy the same @sched.mutex(lock=...) on every node, or remove the job and add it again "
                           "to change its lock")  # fmt: skip
        return False

    def other_zone(self, store: SharedJobStore, job_id: str, new: Any, stored: Any) -> bool:
        """True (and one warning) if this node would rewrite a stored trigger in another zone (its
        scheduler's ``timezone``): each restart of nodes in two zones would move the job's fire time."""
        theirs, mine = cron_zone(stored), cron_zone(new)
        if theirs is None or mine is None or theirs == mine:
            return False
        self._warn_zone(store, job_id, theirs, mine)
        return True

    def _zone(self) -> str | None:
        """This node's zone for cron jobs (its scheduler's ``timezone``), read once."""
        if self._my_zone is None:
            self._my_zone = (zone_of_scheduler(self.sched),)
        return self._my_zone[0]

    def _warn_zone(self, store: SharedJobStore, job_id: str, theirs: str, mine: str) -> None:
        self._warn(job_id, f"job {job_id!r} in {store.where} is a cron job stored in zone {theirs}, but this node computes "
                           f"cron jobs in {mine}: it neither rewrites nor runs it. Give every node the same timezone= "
                           "(or TZ)")  # fmt: skip

    def lock_of(self, job: Any) -> str | None:
        """The lock a shared job is guarded by on this node (None: it has no guard here)."""
        if isinstance(job.func, GuardedJob):
            return job.func.lock
        try:
            lock = config_of_function(job.func, job.id).lock
        except ConfigurationError:
            return None
        return lock if isinstance(lock, str) else None

    def func_ref(self, job: Any) -> str:
        """The ``module:function`` text of a guarded shared job's own function."""
        try:
            ref: str = obj_to_ref(job.func.func)
        except ValueError:
            ref = job.func_ref
        return ref

    def unrestorable(self, store: SharedJobStore, job_id: str, exc: BaseException) -> None:
        self._warn(
            job_id,
            f"job {job_id!r} in {store.where} cannot be restored on this node ({type(exc).__name__}: {exc}): "
            "it does not run here, and it stays in the store for the nodes that can import it",
        )

    def _warn(self, job_id: str, text: str) -> None:
        """One warning per job and problem (not one per loop pass)."""
        with self._mutex:
            if self._warned.get(job_id) == text:
                return
            self._warned[job_id] = text
        log.warning("%s", text)

    # -- which jobs this node runs ---------------------------------------------------------------------
    def held_jobs(self, store: SharedJobStore) -> set[str]:
        """The jobs of ``store`` whose lock this node holds now."""
        leases = self.sched._leases
        if leases is None or self.sched.state != STATE_RUNNING:
            return set()
        held = leases.held()
        with self._mutex:
            return {job_id for job_id in store._known if (g := self._guards.get(job_id)) is not None and g[1].lock in held}

    def begin_pass(self, store: SharedJobStore) -> set[str]:
        """:meth:`held_jobs` for a loop pass over ``store``, their locks pinned (no hand-over,
        release or stop lets them go: :meth:`~mutexcron.heartbeat.LeaseManager.pin`) until
        :meth:`due_read` says which of them are due."""
        held = self.held_jobs(store)
        leases = self.sched._leases
        self._pass.reading = {}
        if not held or leases is None:
            return held
        with self._mutex:
            lock_of = {job_id: g[1].lock for job_id in held if (g := self._guards.get(job_id)) is not None}
        pinned = leases.pin(set(lock_of.values()))
        self._pass.reading = {job_id: lock for job_id, lock in lock_of.items() if lock in pinned}
        return {job_id for job_id in held if lock_of.get(job_id) in pinned}

    def due_read(self, due: Collection[str]) -> None:
        """The jobs of the read :meth:`begin_pass` began that are due (none: the read failed). Their
        locks stay pinned until their runs are counted (:meth:`take_pins`): the pass writes their
        next run times before their runs claim, and a lock handed over in between would lose the
        fire time. The other locks are let go of now."""
        reading: dict[str, str] = getattr(self._pass, "reading", None) or {}
        self._pass.reading = {}
        keep = {reading[job_id] for job_id in due if job_id in reading}
        leases = self.sched._leases
        if leases is not None:
            leases.unpin(set(reading.values()) - keep)
        self._pass_pins().extend(keep)

    def take_pins(self) -> list[str]:
        """The locks this thread's loop pass keeps pinned (its caller unpins them): emptied."""
        pins = self._pass_pins()
        taken = list(pins)
        pins.clear()
        return taken

    def _pass_pins(self) -> list[str]:
        pins: list[str] | None = getattr(self._pass, "pins", None)
        if pins is None:
            pins = self._pass.pins = []
        return pins

    def _lease_locks(self) -> None:
        """Hand the shared jobs' locks to the lease manager while the scheduler runs."""
        leases = self.sched._leases
        if leases is None or self.sched.state != STATE_RUNNING or leases.stopping:
            return
        with self._mutex:
            wanted = {g.lock: g.ttl for _func, g in self._guards.values()}
            patterns = {g.lock: g.config.node_patterns for _func, g in self._guards.values()}
            new = {lock: ttl for lock, ttl in wanted.items() if lock not in self._leased}
            self._leased.update(new)
        for lock, ttl in new.items():
            leases.placement.restrict(lock, patterns[lock])
            leases.add_lock(lock, ttl)
        if new:
            leases.wake()  # take them now, not after a round planned without them

    def _unlease_locks(self) -> None:
        leases = self.sched._leases
        with self._mutex:
            locks, self._leased = set(self._leased), set()
        if leases is not None and not leases.stopping:
            for lock in locks:
                leases.remove_lock(lock)

    def _note_one_off(self, job_id: str, lock: str, trigger: Any) -> None:
        """Under ``_mutex``: remember whether the job is a date job with a lock of its own."""
        if lock == job_id and isinstance(trigger, DateTrigger):
            self._one_off.add(job_id)
        elif trigger is not None:
            self._one_off.discard(job_id)

    def forget(self, store: SharedJobStore, job_id: str, *, keep_warning: bool = False) -> None:
        """The job is gone from the store (removed anywhere, or its last run submitted), or this node
        refuses it (``keep_warning``): its guard goes by the scheduler's ``forget_job``, as for any
        removed guarded job (when a run of it still going ends), and with the last job of its lock,
        the lock. A gone one-off job's own lock record is let go by its holder (:meth:`lets_go`)."""
        with self._mutex:
            known = self._guards.pop(job_id, None)
            self._explicit.discard(job_id)
            one_off = job_id in self._one_off and not keep_warning
            self._one_off.discard(job_id)
            if not keep_warning:
                self._warned.pop(job_id, None)
            if known is None:
                return
            lock = known[1].lock
            if not any(g.lock == lock for _f, g in self._guards.values()):
                self._leased.discard(lock)  # forget_job lets go of it; a new job of it leases it again
                if one_off and self.sched._guarded.get(job_id) is known[1]:
                    self._letting_go.add(lock)  # taken back by the scheduler's forget_job, below (lets_go)
        if self.sched._guarded.get(job_id) is known[1]:
            self.sched.forget_job(job_id)

    def lets_go(self, lock: str) -> bool:
        """True (once) if ``lock`` was the own lock of a one-off job now gone from its store: its
        record is forgotten once released (memory and lock records stay bounded, issue 32 B5)."""
        with self._mutex:
            if lock in self._letting_go:
                self._letting_go.discard(lock)
                return not any(g.lock == lock for _f, g in self._guards.values())
            return False

    def keep(self, job_id: str) -> None:
        """The loop's removal of a finished date job was refused: another writer changed it meanwhile
        (a reschedule), so it stays, with its guard and its lock."""
        self._kept.job_id = job_id

    def is_kept(self, job_id: str) -> bool:
        """True if this thread's last removal of ``job_id`` was refused (:meth:`keep`)."""
        kept: bool = getattr(self._kept, "job_id", None) == job_id
        return kept

    def was_kept(self, job_id: str) -> bool:
        """:meth:`is_kept`, and forgotten: once per removal."""
        kept = self.is_kept(job_id)
        self._kept.job_id = None
        return kept

    def _release_if_unused(self, lock: str) -> None:
        if any(g.lock == lock for _f, g in self._guards.values()) or lock not in self._leased:
            return
        self._leased.discard(lock)
        leases = self.sched._leases
        if leases is not None:
            leases.remove_lock(lock)

    # -- stores and their watchers ---------------------------------------------------------------------
    def attach(self, store: SharedJobStore) -> None:
        """A shared store starts: read its jobs (no events: nothing changed), then watch it."""
        self._listen()
        with self._mutex:
            self._stores.append(store)
        self.refresh(store, initial=True)
        watcher = Watcher(store, self.refresh, str(store._alias))
        with self._mutex:
            self._watchers[id(store)] = watcher
        watcher.start()

    def detach(self, store: SharedJobStore) -> None:
        with self._mutex:
            watcher = self._watchers.pop(id(store), None)
            if store in self._stores:
                self._stores.remove(store)
        if watcher is not None:
            watcher.stop()

    def watcher(self, store: SharedJobStore) -> Watcher[SharedJobStore] | None:
        return self._watchers.get(id(store))

    def refresh(self, store: SharedJobStore, initial: bool = False) -> None:
        """Read the store and act on what other writers changed: guards, locks, events, a wake-up."""
        before, now = store.snapshot()
        events: list[tuple[int, str]] = []
        for job_id in now.keys() - before.keys():
            store.restore(job_id, now[job_id])
            events.append((EVENT_JOB_ADDED, job_id))
        for job_id in before.keys() - now.keys():
            self.forget(store, job_id)
            events.append((EVENT_JOB_REMOVED, job_id))
        moved = False  # a next run time moved by another writer (``modify_job(next_run_time=...)``): no event, a wake-up
        for job_id in now.keys() & before.keys():
            if now[job_id] != before[job_id] and kind_of_change(before[job_id], now[job_id]) == "modified":
                store.restore(job_id, now[job_id])  # a new function gets its guard
                events.append((EVENT_JOB_MODIFIED, job_id))
            moved = moved or now[job_id] != before[job_id]
        if initial or not (events or moved):
            return
        for code, job_id in events:
            aps.dispatch_event(self.sched, JobEvent(code, job_id, store._alias))
        self.wake()

    def wake(self) -> None:
        if self.sched.state == STATE_RUNNING:
            self.sched.wakeup()

    # -- the scheduler's state ---------------------------------------------------------------------------
    def _listen(self) -> None:
        if self._listening:
            return
        self._listening = True
        self.sched.add_listener(self._on_state, EVENT_SCHEDULER_STARTED | EVENT_SCHEDULER_RESUMED | EVENT_SCHEDULER_PAUSED)
        self.sched.add_listener(self._on_lock, EVENT_LOCK_ACQUIRED | EVENT_LOCK_TAKEN_OVER)

    def _on_state(self, event: Any) -> None:
        if event.code == EVENT_SCHEDULER_PAUSED:
            self._unlease_locks()
        else:
            self._lease_locks()

    def _on_lock(self, event: Any) -> None:
        """A lock of a shared job became this node's: its loop looks at that job's next run time now."""
        with self._mutex:
            ours = event.lock in self._leased
        if ours:
            self.wake()


def lazily(factory: Callable[[], SharedJobs], owner: Any) -> SharedJobs:
    found: SharedJobs | None = owner.__dict__.get("_shared_jobs_state")
    if found is None:
        found = owner.__dict__["_shared_jobs_state"] = factory()
    return found
