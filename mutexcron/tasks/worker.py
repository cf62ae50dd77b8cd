"""The task worker: claims due tasks for this node's handlers and runs them on a thread pool.

One claim thread per node sleeps until the earliest task of its codes is due (by the store's
clock: :meth:`~mutexcron.tasks.TaskStore.next_due`), woken early by the store's notices
(:mod:`mutexcron.tasks.wakeup`), and claims as many tasks as it has free handler threads, in
one round trip per lease length. Every claimed task

1. runs only if its lease is still ours by this node's monotonic clock, checked right before the
   handler's first line (a claim whose reply came later than its lease is never run);
2. is renewed by the scheduler's heartbeat thread, every lease/3, one round trip for all of the
   node's running tasks (:meth:`TaskWorker.renew_round`); ``task.lost`` turns True when a renewal
   is refused or none succeeded within the lease;
3. ends with one fenced write (:meth:`~mutexcron.tasks.TaskStore.complete`; handlers that end
   while another completion is in flight share the next round trip:
   :mod:`mutexcron.tasks.completions`): a worker that stalled past its lease gets its write
   refused, logged once and counted, and the newer attempt is kept.

Stopping (:meth:`TaskWorker.stop`): claims stop, claimed tasks that have not started are handed
back at once (token + 1), and running handlers get up to the timeout to finish.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import Defer, FailTask, StoreError, StoreUnavailableError
from ..events import Emit, log_event
from ..health import StoreHealth
from .base import Fail, Outcome, TaskRecord, TaskStore
from .completions import CompletionBatcher
from .handlers import Handler, Task
from .wakeup import BACKSTOP_POLL, Waker

__all__ = ["DEFAULT_CONCURRENCY", "LAG_BUCKETS", "LagStats", "TaskWorker", "WorkerStats"]

log = logging.getLogger(__name__)

#: Handler threads per node unless configured.
DEFAULT_CONCURRENCY = 8


@dataclass
class WorkerStats:
    """What a worker did since it started (read them for tests and metrics)."""

    claimed: int = 0
    done: int = 0
    rescheduled: int = 0
    retried: int = 0
    failed: int = 0
    #: completions the store refused: the attempt had been taken over (stale worker) or cancelled
    refused: int = 0
    #: completions given up because the store stayed unreachable for the whole lease
    unrecorded: int = 0
    #: claimed tasks handed back unstarted by a stop
    released: int = 0
    #: claims whose lease ran out before the handler could start (never run)
    expired_before_start: int = 0
    #: running tasks whose lease this node lost
    lost: int = 0


#: Upper bounds (seconds) of the due-to-start lag buckets a worker counts per code (for metrics).
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class LagStats:
    """Due-to-start lags of one code's tasks on this node: counts per bucket of :data:`LAG_BUCKETS`
    (the last one: above them all), their sum and count. The node's clock, corrected by its
    estimated offset to the store's clock when known."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def add(self, lag: float) -> None:
        index = next((i for i, bound in enumerate(LAG_BUCKETS) if lag <= bound), len(LAG_BUCKETS))
        self.buckets[index] += 1
        self.total += lag
        self.count += 1


@dataclass(eq=False)
class _Run:
    record: TaskRecord
    handler: Handler
    deadline: float  # monotonic: the lease is ours until then, unless renewed
    renew_at: float
    started: bool = False
    handed_back: bool = False
    lost: bool = False
    task_key: tuple[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.task_key = (self.record.code, self.record.key)


class TaskWorker:
    """Runs this node's task handlers.

    Args:
        store: the task store.
        handlers: code -> handler.
        node_id: the owner recorded on claimed tasks.
        concurrency: handler threads (and the most tasks this node runs at once).
        clock: this node's monotonic clock (injectable for tests).
        backstop: the longest sleep between two looks at the store, whatever the waker says.
        emit: where the task store's down/up events go (:mod:`mutexcron.events`).
    """

    def __init__(
        self,
        store: TaskStore,
        handlers: Mapping[str, Handler],
        node_id: str,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        clock: Callable[[], float] = time.monotonic,
        backstop: float = BACKSTOP_POLL,
        emit: Emit = log_event,
    ) -> None:
        self.store = store
        self.handlers = dict(handlers)
        self.node_id = node_id
        self.concurrency = max(1, int(concurrency))
        self.clock = clock
        self.backstop = backstop
        self.stats = WorkerStats()
        self.health = StoreHealth(store.masked_url, node_id, what="task", emit=emit)
        self._mutex = threading.Lock()
        self._idle = threading.Condition(self._mutex)
        self._runs: dict[tuple[str, str], _Run] = {}
        self._unstarted: list[_Run] = []  # claims a stop caught before their handler started
        self._stopping = False
        self._waker: Waker | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.on_renew_needed: Callable[[], None] | None = None  # wakes the heartbeat thread early
        self.completions = CompletionBatcher(store, node_id)  # handlers that end together share a round trip
        self.lags: dict[str, LagStats] = {}  # code -> due-to-start lags (metrics read them)
        self.clock_offset: Callable[[], float | None] = lambda: None  # node wall clock minus the store's

    # -- state -------------------------------------------------------------------------------
    @property
    def codes(self) -> list[str]:
        return sorted(self.handlers)

    @property
    def poll(self) -> float | None:
        """Seconds between two looks on stores without notices: the most eager handler's, a handler
        without ``poll`` asking for the store's own cadence (None without handlers)."""
        default = self.store.default_poll
        return min((default if h.poll is None else h.poll for h in self.handlers.values()), default=None)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def running(self) -> dict[tuple[str, str], int]:
        """The tasks this node has claimed and not yet finished: (code, key) -> token."""
        with self._mutex:
            return {k: r.record.token for k, r in self._runs.items()}

    def _free(self) -> int:
        with self._mutex:
            return self.concurrency - len(self._runs)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the claim thread and the handler threads (no-op without handlers or if started)."""
        if not self.handlers or self._thread is not None:
            return
        self._waker = self.store.waker(self.codes, poll=self.poll)
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="mutexcron-task")
        self._thread = threading.Thread(target=self._loop, name="mutexcron-tasks", daemon=True)
        self._thread.start()
        log.info("node %s runs task handlers for %s (%d threads)", self.node_id, ", ".join(self.codes), self.concurrency)

    def notify(self) -> None:
        """Look at the store now (a task was added in this process)."""
        if self._waker is not None:
            self._waker.notify()

    def stop(self, timeout: float) -> None:
        """Stop claiming, hand back claimed tasks that have not started, wait up to ``timeout``
        seconds for running handlers. Handlers still running then keep their tasks: the leases run
        out (renewals stop with the heartbeat) and another node runs them again."""
        deadline = self.clock() + max(0.0, timeout)
        with self._mutex:
            if self._stopping:
                return
            self._stopping = True
        if self._waker is not None:
            self._waker.notify()
        if self._thread is not None:
            self._thread.join(timeout=15)  # longer than one store operation's timeout
        with self._mutex:  # no claim comes after this: hand back every claim that has not started
            for run in [r for r in self._runs.values() if not r.started]:
                run.handed_back = True
                self._unstarted.append(run)
                del self._runs[run.task_key]
            unstarted, self._unstarted = self._unstarted, []
            self._idle.notify_all()
        self._hand_back(unstarted)
        with self._idle:
            while self._runs and self.clock() < deadline:
                self._idle.wait(min(0.5, max(0.01, deadline - self.clock())))
            left = sorted(self._runs)
        for code, key in left:
            log.warning(
                "task %s/%s still running after the shutdown timeout: its lease will run out and another node will run it again",
                code,
                key,
            )
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._waker is not None:
            self._waker.close()

    def _hand_back(self, runs: list[_Run]) -> None:
        if not runs:
            return
        try:
            count = self.store.release(self.node_id, [(r.record.code, r.record.key, r.record.token) for r in runs])
        except (StoreUnavailableError, StoreError) as exc:
            log.warning("could not hand back %d unstarted task(s) (%s): they run again after their lease", len(runs), exc)
            return
        self._bump("released", count)
        log.info("handed back %d claimed task(s) that had not started", count)

    # -- claiming ----------------------------------------------------------------------------
    def _loop(self) -> None:
        more = False  # the last claim was full: there may be more due tasks right now
        while not self._stopping:
            try:
                more = self._claim_round(more)
            except (StoreUnavailableError, StoreError) as exc:
                self.health.report(False, exc)
                more = False
                self._sleep(min(self.backstop, self.health.backoff(0.5, holding=False)))
            except Exception:  # never let the claim thread die
                log.exception("task claim round failed")
                self._sleep(1.0)

    def _claim_round(self, more: bool) -> bool:
        free = self._free()
        if free <= 0:
            self._sleep(self.backstop)  # a finished handler wakes the waker
            return more
        if not more:
            delay = self.store.next_due(self.codes)
            self.health.report(True)
            if delay is None or delay > 0:
                self._sleep(self.backstop if delay is None else min(delay, self.backstop))
                return False
        claimed = self._claim(free)
        self.health.report(True)
        return len(claimed) >= free

    def _claim(self, free: int) -> list[_Run]:
        """Claim up to ``free`` tasks, one round trip per lease length, and start them."""
        runs: list[_Run] = []
        for lease, codes in _by_lease(self.handlers).items():
            if free <= 0 or self._stopping:
                break
            sent_at = self.clock()
            records = self.store.claim(self.node_id, codes, free, lease)
            free -= len(records)
            runs.extend(self._submit(record, sent_at) for record in records)
        return runs

    def _submit(self, record: TaskRecord, sent_at: float) -> _Run:
        handler = self.handlers[record.code]
        run = _Run(record, handler, sent_at + handler.lease, sent_at + handler.lease / 3)
        with self._mutex:
            self._runs[run.task_key] = run
        self._bump("claimed")
        assert self._pool is not None
        self._pool.submit(self._run, run)
        if self.on_renew_needed is not None:
            self.on_renew_needed()
        return run

    def _sleep(self, seconds: float) -> None:
        if self._waker is not None and not self._stopping:
            self._waker.wait(max(0.0, seconds))

    # -- running -----------------------------------------------------------------------------
    def _run(self, run: _Run) -> None:
        try:
            if not self._begin(run):
                return
            self._record_lag(run.record)
            outcome = run.handler.exhausted(run.record) or self._call(run)
            self._complete(run, outcome)
        except Exception:  # a bug here must not leave the slot taken
            log.exception("task %s/%s: the worker failed", *run.task_key)
        finally:
            self._end(run)

    def _begin(self, run: _Run) -> bool:
        """Mark the run started if its lease is still ours; the last check before the handler."""
        with self._mutex:
            if run.handed_back:
                return False
            if self._stopping:  # stop() hands it back
                run.handed_back = True
                self._unstarted.append(run)
                del self._runs[run.task_key]
                return False
            if self.clock() >= run.deadline or run.lost:
                self.stats.expired_before_start += 1
                log.warning(
                    "task %s/%s (token %d): the lease ran out before the handler could start; not run here",
                    run.record.code,
                    run.record.key,
                    run.record.token,
                )
                return False
            run.started = True
            return True

    def lag_snapshot(self) -> dict[str, LagStats]:
        """A copy of the due-to-start lags counted per code so far."""
        with self._mutex:
            return {code: LagStats(list(stats.buckets), stats.total, stats.count) for code, stats in self.lags.items()}

    def _record_lag(self, record: TaskRecord) -> None:
        lag = time.time() - (self.clock_offset() or 0.0) - record.due.timestamp()
        with self._mutex:
            self.lags.setdefault(record.code, LagStats()).add(max(0.0, lag))

    def _call(self, run: _Run) -> Outcome:
        task = Task(run.record, lambda: self._is_lost(run))
        try:
            result = run.handler.call(task)
        except Exception as exc:
            outcome = run.handler.failure(run.record, exc)
            if isinstance(exc, (Defer, FailTask)):  # the handler's own decision: no traceback
                log.debug("task %s/%s attempt %d: %s", task.code, task.key, task.attempt, exc)
                return outcome
            level = logging.ERROR if isinstance(outcome, Fail) else logging.WARNING
            log.log(level, "task %s/%s attempt %d failed: %s", task.code, task.key, task.attempt, exc, exc_info=True)
            return outcome
        return run.handler.outcome(run.record, result)

    def _is_lost(self, run: _Run) -> bool:
        with self._mutex:
            return run.lost or self.clock() >= run.deadline

    def _end(self, run: _Run) -> None:
        with self._mutex:
            if self._runs.get(run.task_key) is run:
                del self._runs[run.task_key]
            self._idle.notify_all()
        if self._waker is not None:
            self._waker.notify()  # a handler thread is free

    def _complete(self, run: _Run, outcome: Outcome) -> None:
        """One fenced write, tried even if this node thinks the lease is gone (the store decides:
        a task nobody took over is still ours), and retried for up to one lease if the store is
        briefly unreachable."""
        record, delay, give_up = run.record, 0.2, self.clock() + run.handler.lease
        while True:
            try:
                recorded = self.completions.complete(record.code, record.key, record.token, outcome)
                break
            except StoreUnavailableError as exc:
                if self.clock() + delay >= give_up or (self._stopping and self._is_lost(run)):
                    self._bump("unrecorded")
                    log.error(
                        "task %s/%s (token %d): could not record its outcome (%s); it runs again after its lease",
                        record.code,
                        record.key,
                        record.token,
                        exc,
                    )
                    return
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if not recorded:
            self._bump("refused")
            log.warning(
                "task %s/%s (token %d): completion refused: the task was taken over by a newer attempt (this node's "
                "lease ran out) or cancelled; the store keeps the newer state",
                record.code,
                record.key,
                record.token,
            )
            return
        self._bump({"Done": "done", "Reschedule": "rescheduled", "Retry": "retried", "Fail": "failed"}[type(outcome).__name__])

    def _bump(self, name: str, count: int = 1) -> None:
        with self._mutex:
            setattr(self.stats, name, getattr(self.stats, name) + count)

    # -- renewal (called by the heartbeat thread) --------------------------------------------
    def renew_round(self) -> float | None:
        """Renew the leases of running tasks that are due for it: one round trip per lease length.

        Returns seconds until the next renewal is due, or None if nothing runs.
        """
        now = self.clock()
        with self._mutex:
            due = [r for r in self._runs.values() if now >= r.renew_at and not r.lost]
        groups: dict[float, list[_Run]] = {}
        for run in due:
            groups.setdefault(run.handler.lease, []).append(run)
        for lease, runs in groups.items():
            self._renew(lease, runs)
        with self._mutex:
            waits = [r.renew_at for r in self._runs.values() if not r.lost]
        return None if not waits else max(0.0, min(waits) - self.clock())

    def _renew(self, lease: float, runs: list[_Run]) -> None:
        sent_at = self.clock()
        tokens = {r.task_key: r.record.token for r in runs}
        try:
            renewed = self.store.renew(self.node_id, tokens, lease)
        except (StoreUnavailableError, StoreError) as exc:
            self.health.report(False, exc)
            with self._mutex:
                for run in runs:  # try again soon; the deadline stays where it was
                    run.renew_at = self.clock() + min(1.0, lease / 6)
            return
        self.health.report(True)
        with self._mutex:
            for run in runs:
                if run.task_key in renewed:
                    run.deadline, run.renew_at = sent_at + lease, sent_at + lease / 3
                elif not run.lost:
                    run.lost = True
                    self.stats.lost += 1
                    log.warning(
                        "task %s/%s (token %d): lease lost (taken over or cancelled); task.lost is now True",
                        run.record.code,
                        run.record.key,
                        run.record.token,
                    )


def _by_lease(handlers: Mapping[str, Handler]) -> dict[float, list[str]]:
    groups: dict[float, list[str]] = {}
    for code, handler in sorted(handlers.items()):
        groups.setdefault(handler.lease, []).append(code)
    return groups
