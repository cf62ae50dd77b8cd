"""The task worker: claims due tasks for this node's handlers and runs them on its handler threads.

One claim thread per node sleeps until the earliest task of its codes is due (by the store's
clock: :meth:`~mutexcron.tasks.TaskStore.next_due`), woken early by the store's notices
(:mod:`mutexcron.tasks.wakeups.base`), and claims ahead: up to its free handler threads plus
``claim_ahead`` more (as many as the node finished in the last second, at least one per thread,
at most ``claim_ahead``), in one round trip per lease length. Claimed tasks wait in one queue the
handler threads take from in turn (a thread that ends a task takes the next one without being
woken); the claim thread claims again when the queue is down to half of what it claims ahead, or
when a thread frees and nothing waits for it.
Every claimed task

1. runs only if its lease is still ours by this node's monotonic clock, checked right before the
   handler's first line (a claim whose reply came later than its lease, or that waited in the
   queue until its lease ran out, is never run);
2. if it is still waiting for a thread when its lease is a third gone, is handed back (fenced:
   token + 1, claimable at once by any node) instead of being renewed, and the node claims
   nothing ahead until one of its threads frees (the task goes to an idle node, not back here);
3. once started, is renewed by the scheduler's heartbeat thread, every lease/3, one round trip
   for all of the node's running tasks (:meth:`TaskWorker.renew_round`); ``task.lost`` turns
   True when a renewal is refused or none succeeded within the lease;
4. ends with one fenced write, recorded by the completion thread in batches
   (:mod:`mutexcron.tasks.completions`) while the handler thread goes on to its next task: a
   worker that stalled past its lease gets its write refused, logged once and counted, and the
   newer attempt is kept. The task is renewed until its completion is recorded.

Stopping (:meth:`TaskWorker.stop`): claims stop, claimed tasks that have not started are handed
back at once (token + 1), and running handlers get up to the timeout to finish.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from ..backends.health import StoreHealth
from ..errors import ConfigurationError, Defer, FailTask, StaleTaskError, StoreError, StoreUnavailableError
from ..events import EVENT_TASK_FAILED, Emit, MutexEvent, log_event
from .base import Fail, Outcome, Retry, TaskRecord, TaskStore
from .completions import Completion, CompletionQueue
from .handlers import Handler, Task, public_codes
from .wakeups.base import BACKSTOP_POLL, Waker

__all__ = ["DEFAULT_CLAIM_AHEAD", "DEFAULT_CONCURRENCY", "LAG_BUCKETS", "LagStats", "TaskWorker", "WorkerStats"]

log = logging.getLogger(__name__)

_W = TypeVar("_W")

#: Handler threads per node unless configured.
DEFAULT_CONCURRENCY = 8
#: The most tasks a node claims beyond its free handler threads unless configured
#: (``$MUTEXCRON_TASK_CLAIM_AHEAD``; 0: claim only for free threads).
DEFAULT_CLAIM_AHEAD = 96
#: Runs of one task on one node that outlive their lease (handed back, not counted) before the next
#: one counts as a failed attempt: a handler that always overruns ends instead of looping.
OVERRUN_LIMIT = 3
_OVERRUNS_KEPT = 10_000  # tasks whose overruns a node remembers (the oldest forgotten first)


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
    #: claimed tasks handed back unstarted: by a stop, or waiting for a thread until their lease was a third gone
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
    #: the handler returned: its outcome is being recorded (a renewal refused now is no loss)
    ending: bool = False
    #: counted as outliving its lease (:meth:`TaskWorker._count_overrun`)
    overrun_counted: bool = False
    #: the handler ended the attempt in its own transaction (Task.complete): the outcome's name,
    #: or "refused" if the fence failed there. The worker records nothing more for this attempt.
    self_completed: str | None = None
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
        claim_ahead: the most tasks claimed beyond the free handler threads, waiting (under their
            lease) for a thread; None: ``$MUTEXCRON_TASK_CLAIM_AHEAD`` or :data:`DEFAULT_CLAIM_AHEAD`.
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
        claim_ahead: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        backstop: float = BACKSTOP_POLL,
        emit: Emit = log_event,
    ) -> None:
        self.store = store
        self.handlers = dict(handlers)
        self.node_id = node_id
        self.concurrency = max(1, int(concurrency))
        self.claim_ahead = max(0, _claim_ahead_setting() if claim_ahead is None else int(claim_ahead))
        self.clock = clock
        self.backstop = backstop
        self.stats = WorkerStats()
        self.health = StoreHealth(store.masked_url, node_id, what="task", emit=emit)
        self._emit = emit
        self._mutex = threading.Lock()
        self._idle = threading.Condition(self._mutex)  # stop() waits here for running tasks to end
        self._work = threading.Condition(self._mutex)  # idle handler threads wait here for a claimed task
        self._runs: dict[tuple[str, str], _Run] = {}  # claimed and not finished: waiting, running, ending
        self._waiting: deque[_Run] = deque()  # claimed, not started: the handler threads take them in turn
        self._busy = 0  # handler threads running a task
        self._idle_threads = 0
        self._refill_asked = False  # a handler thread woke the claim thread for more since its last look
        self._handed_back_busy = False  # claims waited too long for a thread: none ahead until one frees
        self._ended: deque[float] = deque()  # clock() of the handlers ended in the last second
        self._unstarted: list[_Run] = []  # claims a stop caught before their handler started
        self._stopping = False
        self._waker: Waker | None = None
        self._codes_version = self._waker_version = 0  # handler maps so far, and the one the waker listens for
        self._thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        self.on_renew_needed: Callable[[], None] | None = None  # wakes the heartbeat thread early
        self.completions = CompletionQueue(store, node_id, self._settled, linger=lambda: self._busy > 0)
        self.lags: dict[str, LagStats] = {}  # code -> due-to-start lags (metrics read them)
        self.clock_offset: Callable[[], float | None] = lambda: None  # node wall clock minus the store's
        self._overruns: dict[tuple[str, str], int] = {}  # (code, key) -> runs here that outlived their lease

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

    def _ahead(self) -> int:
        """Tasks to claim beyond the free threads: as many as ended in the last second (at least one
        per thread), at most ``claim_ahead``; none after a hand-back until a thread frees. Under the mutex."""
        if not self.claim_ahead or self._handed_back_busy:
            return 0
        now = self.clock()
        while self._ended and self._ended[0] <= now - 1.0:
            self._ended.popleft()
        return min(self.claim_ahead, max(self.concurrency, len(self._ended)))

    def _room(self) -> tuple[int, bool]:
        """How many tasks to claim now (0: none), and whether the queue is low enough to claim."""
        with self._mutex:
            self._refill_asked = False
            ahead = self._ahead()
            room = self.concurrency + ahead - self._busy - len(self._waiting)
            return max(0, room), len(self._waiting) <= ahead // 2

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the claim thread, the handler threads and the completion thread (no-op without handlers or if started)."""
        if not self.handlers or self._thread is not None:
            return
        self._waker = self.store.waker(self.codes, poll=self.poll)
        self.completions.start()
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._serve, name=f"mutexcron-task-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()
        self._thread = threading.Thread(target=self._loop, name="mutexcron-tasks", daemon=True)
        self._thread.start()
        if shown := public_codes(self.codes):  # a node serving only trigger requests has nothing to announce
            log.info("node %s runs task handlers for %s (%d threads)", self.node_id, ", ".join(shown), self.concurrency)

    def add_handlers(self, handlers: Mapping[str, Handler]) -> None:
        """Serve more codes from now on (a scheduler's trigger codes for a job added after start).

        The handler map is replaced, never changed in place (the claim and handler threads read
        it without the mutex); the claim thread listens for the new codes from its next round.
        """
        added = {code: h for code, h in handlers.items() if self.handlers.get(code) is not h}
        if not added:
            return
        with self._mutex:
            self.handlers = {**self.handlers, **added}
            self._codes_version += 1
        self.notify()

    def _listen_to_new_codes(self) -> None:
        """In the claim thread: a waker for the codes added since the last one (store notices name codes)."""
        version = self._codes_version
        if version == self._waker_version or self._waker is None or self._stopping:
            return
        old, self._waker = self._waker, self.store.waker(self.codes, poll=self.poll)
        self._waker_version = version
        old.close()

    def notify(self) -> None:
        """Look at the store now (a task was added in this process)."""
        if self._waker is not None:
            self._waker.notify()

    def stop(self, timeout: float) -> None:
        """Stop claiming, hand back claimed tasks that have not started, wait up to ``timeout``
        seconds for running handlers (and their completions). Handlers still running then keep
        their tasks: the leases run out (renewals stop with the heartbeat) and another node runs
        them again."""
        deadline = self.clock() + max(0.0, timeout)
        with self._mutex:
            if self._stopping:
                return
            self._stopping = True
            self._work.notify_all()
        if self._waker is not None:
            self._waker.notify()
        if self._thread is not None:
            self._thread.join(timeout=15)  # longer than one store operation's timeout
        with self._mutex:  # no claim comes after this: hand back every claim that has not started
            self._take_waiting(list(self._waiting))
            unstarted, self._unstarted = self._unstarted, []
            self._idle.notify_all()
        self._hand_back(unstarted)
        with self._idle:
            while self._runs and self.clock() < deadline:
                self._idle.wait(min(0.5, max(0.01, deadline - self.clock())))
            left = sorted(self._runs)
            late, self._unstarted = self._unstarted, []  # taken by a handler thread as the stop began
        self._hand_back(late)
        for code, key in left:
            log.warning(
                "task %s/%s still running after the shutdown timeout: its lease will run out and another node will run it again",
                code,
                key,
            )
        self.completions.close(timeout=0 if left else 15)
        if self._waker is not None:
            self._waker.close()

    def _take_waiting(self, runs: list[_Run]) -> None:
        """Take ``runs`` out of the queue, to be handed back (``_unstarted``). Under the mutex."""
        for run in runs:
            run.handed_back = True
            self._unstarted.append(run)
            if self._runs.get(run.task_key) is run:
                del self._runs[run.task_key]
        taken = set(map(id, runs))
        self._waiting = deque(r for r in self._waiting if id(r) not in taken)

    def _hand_back(self, runs: list[_Run]) -> None:
        self._release([r.record for r in runs])

    def _hand_back_waiting_too_long(self) -> float:
        """Hand back the claimed tasks that waited for a thread until their lease was a third gone;
        returns seconds until the next waiting one gets there (the backstop if none waits)."""
        now = self.clock()
        with self._mutex:
            self._take_waiting([r for r in self._waiting if now >= r.renew_at])
            stale, self._unstarted = self._unstarted, []
            soonest = min((r.renew_at for r in self._waiting), default=None)
        if stale:
            with self._mutex:  # they go to an idle node: claim nothing ahead until a thread of ours frees
                self._handed_back_busy = True
            log.info("handing back %d claimed task(s) that waited a third of their lease for a thread", len(stale))
            self._hand_back(stale)
        return self.backstop if soonest is None else max(0.0, soonest - now)

    def _release(self, records: list[TaskRecord]) -> None:
        """Hand back claimed tasks that were not started (fenced: token + 1, the claim not counted)."""
        if not records:
            return
        try:
            count = self.store.release(self.node_id, [(r.code, r.key, r.token) for r in records])
        except (StoreUnavailableError, StoreError) as exc:
            log.warning("could not hand back %d unstarted task(s) (%s): they run again after their lease", len(records), exc)
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
        self._listen_to_new_codes()
        nap = self._hand_back_waiting_too_long()
        room, low = self._room()
        if room <= 0 or not low:
            self._sleep(min(nap, self.backstop))  # a handler thread that takes the queue down to half wakes the waker
            return more
        if not more:
            delay = self.store.next_due(self.codes)
            self.health.report(True)
            if delay is None or delay > 0:
                self._sleep(min(nap, self.backstop if delay is None else min(delay, self.backstop)))
                return False
        claimed = self._claim(room)
        self.health.report(True)
        return claimed >= room

    def _claim(self, room: int) -> int:
        """Claim up to ``room`` tasks, one round trip per lease length, and queue them for the handler threads."""
        claimed = 0
        for lease, codes in _by_lease(self.handlers).items():
            if claimed >= room or self._stopping:
                break
            sent_at = self.clock()
            records = self.store.claim(self.node_id, codes, room - claimed, lease)
            claimed += len(records)
            self._queue_all(records, sent_at)
        return claimed

    def _queue_all(self, records: list[TaskRecord], sent_at: float) -> None:
        """Queue every claimed task for the handler threads; whatever fails on the way, the ones not queued are handed back.

        The claim is committed in the store: a task left out here would stay ``running`` under this
        node, never run, until its lease ran out, and again at every claim (its healthy neighbours
        in the batch too) until ``max_attempts`` failed them without a run.
        """
        runs: list[_Run] = []
        for i, record in enumerate(records):
            try:
                handler = self.handlers.get(record.code)
                if handler is None:  # the store matched another code (a MySQL table that pads trailing spaces)
                    self._fail_alone(record, self._no_handler(record))
                    continue
                runs.append(_Run(record, handler, sent_at + handler.lease, sent_at + handler.lease / 3))
            except Exception:
                log.exception("task %s/%s: could not queue the claimed task; handing it back", record.code, record.key)
                self._release([r.record for r in runs] + records[i:])
                return
        if not runs:
            return
        with self._mutex:
            for run in runs:
                self._supersede_locked(run)
                self._runs[run.task_key] = run
            self._waiting.extend(runs)
            self.stats.claimed += len(runs)
            self._work.notify(min(len(runs), self._idle_threads))
        if self.on_renew_needed is not None:
            self.on_renew_needed()

    def _supersede_locked(self, run: _Run) -> None:
        """This node claimed again a task it still runs (its run outlived the lease, and the store gave
        the task to the next claim, ours): the older run is lost for good and counted as an overrun."""
        older = self._runs.get(run.task_key)
        if older is None or older is run or not older.started:
            return
        older.lost = True
        count = self._overrun_locked(older)
        log.warning(
            "task %s/%s: this node's run (token %d) outlived its %g s lease (%d time(s)); this node claimed it again (token %d)",
            run.record.code,
            run.record.key,
            older.record.token,
            older.handler.lease,
            count,
            run.record.token,
        )

    def _no_handler(self, record: TaskRecord) -> str:
        return (
            f"claimed for the handlers of {', '.join(map(repr, self.codes))}, but its code is {record.code!r}: "
            "no handler runs it (a MySQL/MariaDB table whose collation ignores trailing spaces matches such "
            "codes; see the tasks docs)"
        )

    def _fail_alone(self, record: TaskRecord, error: str) -> None:
        """Keep one claimed task as failed with ``error``, without running it (fenced)."""
        log.error("task %s/%s (token %d): failed without running: %s", record.code, record.key, record.token, error)
        try:
            recorded = self.store.complete(self.node_id, record.code, record.key, record.token, Fail(error))
        except (StoreUnavailableError, StoreError) as exc:
            log.warning("task %s/%s: could not record its failure (%s); handing it back", record.code, record.key, exc)
            self._release([record])
            return
        if recorded:
            self._bump("failed")

    def _sleep(self, seconds: float) -> None:
        if self._waker is not None and not self._stopping:
            self._waker.wait(max(0.0, seconds))

    # -- the handler threads -----------------------------------------------------------------
    def _serve(self) -> None:
        """A handler thread: take the next claimed task, run it, again; until the worker stops."""
        while True:
            with self._mutex:
                while not self._waiting and not self._stopping:
                    self._idle_threads += 1
                    self._work.wait()
                    self._idle_threads -= 1
                if not self._waiting:
                    return
                run = self._waiting.popleft()
                refill = not self._refill_asked and len(self._waiting) <= self._ahead() // 2
                self._refill_asked |= refill
                self._busy += 1
            if refill and self._waker is not None:
                self._waker.notify()  # down to half of what is claimed ahead: claim again
            try:
                self._run(run)
            finally:
                self._thread_freed()

    def _thread_freed(self) -> None:
        """A handler thread ended its task: wake the claim thread if nothing waits for it (whatever
        claim-ahead is: with none, the claim thread has nothing to claim for until a thread frees)."""
        with self._mutex:
            self._busy -= 1
            self._ended.append(self.clock())
            self._handed_back_busy = False
            wake = not self._waiting and not self._refill_asked
            self._refill_asked |= wake
        if wake and self._waker is not None:
            self._waker.notify()

    # -- running -----------------------------------------------------------------------------
    def _run(self, run: _Run) -> None:
        """Run one claimed task; its completion goes to the completion thread, which ends the run."""
        ended = True
        try:
            if not self._begin(run):
                return
            self.completions.mark_started(*run.task_key, run.record.token)  # batched: a rescue now counts the attempt
            self._record_lag(run.record)
            outcome = self._overrun_outcome(run) or self._exhausted(run) or self._call(run)
            if outcome is None:
                ended = self._settled_by_handler(run)
                return
            with self._mutex:
                run.ending = True
            if self._is_lost(run):
                ended = self._give_back_lost(run, type(outcome).__name__)
            else:
                self._complete(run, outcome)
                ended = False
        except Exception:  # a bug here must not leave the slot taken
            log.exception("task %s/%s: the worker failed", *run.task_key)
        finally:
            if ended:
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

    def _call(self, run: _Run) -> Outcome | None:
        """The handler's outcome; None if it ended the attempt in its own transaction (:meth:`Task.complete`)
        and returned, or if the fence failed there (whatever it did next)."""
        task = Task(run.record, lambda: self._is_lost(run), lambda tx, outcome: self._complete_in(run, tx, outcome))
        started = time.monotonic()
        try:
            result = run.handler.call(task)
        except BaseException as exc:  # CancelledError, SystemExit...: a failed attempt too
            if run.self_completed == "refused":
                return None
            outcome = run.handler.failure(run.record, exc)
            if not isinstance(exc, Defer):
                self._emit(MutexEvent(EVENT_TASK_FAILED, node=self.node_id, token=task.token, task_code=task.code, key=task.key,
                                      attempt=task.attempt, final=isinstance(outcome, Fail), exception=exc,
                                      duration=time.monotonic() - started))  # fmt: skip
            if isinstance(exc, (Defer, FailTask)):  # the handler's own decision: no traceback
                log.debug("task %s/%s attempt %d: %s", task.code, task.key, task.attempt, exc)
                return outcome
            level = logging.ERROR if isinstance(outcome, Fail) else logging.WARNING
            note = "" if isinstance(exc, Exception) else " (a handler cannot stop the node: recorded as a failed attempt)"
            log.log(level, "task %s/%s attempt %d failed: %r%s", task.code, task.key, task.attempt, exc, note, exc_info=True)
            return outcome
        if run.self_completed is not None:
            if result is not None:
                log.warning(
                    "task %s/%s: the handler completed the task itself; its return value %r is ignored", *run.task_key, result
                )
            return None
        outcome = run.handler.outcome(run.record, result)
        if isinstance(outcome, Fail):  # a return value that says nothing a task can do: as loud as a raise
            log.error("task %s/%s attempt %d failed: %s", task.code, task.key, task.attempt, outcome.error)
        return outcome

    def _complete_in(self, run: _Run, transaction: Any, outcome: Outcome) -> None:
        """``task.complete(transaction)``: the fenced completion, run in the handler's transaction.

        From then on the run is ending (a renewal refused is its own completion, once committed)
        and not renewed (the renewal would wait on the row the handler's transaction holds).
        Whether the transaction then commits is the handler's: if it raises, the worker records its
        failure as usual (fenced: refused if the completion did commit)."""
        record = run.record
        if run.self_completed is not None:
            raise ConfigurationError(f"task {record.code}/{record.key}: task.complete() was called already in this attempt")
        if self._is_lost(run):  # the store may still take it (nobody took the task over), but this run is over
            with self._mutex:
                run.self_completed, run.ending = "refused", True
            raise StaleTaskError(
                f"task {record.code}/{record.key} (token {record.token}): this node's lease ran out before the "
                "completion; let this error roll your transaction back: the task is handed back and runs again"
            )
        try:
            self.store.complete_in(transaction, self.node_id, record.code, record.key, record.token, outcome)
        except StaleTaskError:
            with self._mutex:
                run.self_completed, run.ending = "refused", True
            raise
        with self._mutex:
            run.self_completed, run.ending = type(outcome).__name__, True

    def _settled_by_handler(self, run: _Run) -> bool:
        """Count (and for a refusal, log) an attempt the handler ended in its own transaction; False
        if its end went to the completion thread."""
        record = run.record
        if run.self_completed == "refused" and run.lost:  # refused by this node: the lease had run out
            log.warning(
                "task %s/%s (token %d): completion refused in the handler's transaction: this node's lease ran out; "
                "the handler's transaction was rolled back",
                record.code,
                record.key,
                record.token,
            )
            return self._give_back_lost(run, "task.complete()")
        if run.self_completed == "refused":
            self._bump("refused")
            log.warning(
                "task %s/%s (token %d): completion refused in the handler's transaction: this node's lease ran out and "
                "a newer attempt took the task over; the handler's transaction was rolled back",
                record.code,
                record.key,
                record.token,
            )
            return True
        self._bump("rescheduled" if run.self_completed == "Reschedule" else "done")
        return True

    def _is_lost(self, run: _Run) -> bool:
        """True once the run's lease ran out by this node's monotonic clock or a renewal was refused:
        for good (a renewal that lands later never brings the run back). Sticky, so what the
        handler saw when it stopped is what the worker acts on when it returns."""
        with self._mutex:
            return self._lost_now(run)

    def _lost_now(self, run: _Run) -> bool:
        """:meth:`_is_lost`, under the mutex."""
        if not run.lost and self.clock() >= run.deadline:
            run.lost = True
            if run.started and not run.ending:
                self.stats.lost += 1
                log.warning(
                    "task %s/%s (token %d): the lease ran out by this node's clock before a renewal got through; "
                    "task.lost is now True for good",
                    run.record.code,
                    run.record.key,
                    run.record.token,
                )
        return run.lost

    def _end(self, run: _Run) -> None:
        with self._mutex:
            if self._runs.get(run.task_key) is run:
                del self._runs[run.task_key]
            self._idle.notify_all()

    def _patiently(self, run: _Run, write: Callable[[], _W], what: str) -> _W | None:
        """``write`` (one fenced store call), retried for up to one lease while the store is briefly
        unreachable; None (logged, counted) if it never got through."""
        record, delay, give_up = run.record, 0.2, self.clock() + run.handler.lease
        while True:
            try:
                return write()
            except StoreUnavailableError as exc:
                if self.clock() + delay >= give_up or (self._stopping and self._is_lost(run)):
                    self._bump("unrecorded")
                    log.error(
                        "task %s/%s (token %d): could not record %s (%s); it runs again after its lease",
                        record.code,
                        record.key,
                        record.token,
                        what,
                        exc,
                    )
                    return None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _give_back_lost(self, run: _Run, outcome: str) -> bool:
        """The handler ended (with ``outcome``, an outcome's name) after this node lost the lease (it
        ran out by the node's clock, or a renewal was refused): it may have stopped half-way because
        ``task.lost`` said so. Never record that as the task's end: hand it back, fenced (claimable
        at once, the attempt not counted). If nobody took it over, it runs again; if somebody did,
        the hand-back is refused and the newer attempt is kept.

        The :data:`OVERRUN_LIMIT`-th such end of the same task on this node counts as a failed
        attempt instead (:meth:`_overran`), so a handler that always outlives its lease ends.
        Returns False if the run's end went to the completion thread (which ends the run).
        """
        record = run.record
        if self._count_overrun(run) >= OVERRUN_LIMIT:
            self._complete(run, self._overran(run))
            return False
        count = self._patiently(
            run, lambda: self.store.release(self.node_id, [(record.code, record.key, record.token)]), "its hand-back"
        )
        if count is None:
            return True
        if count:
            self._bump("released", count)
            log.warning(
                "task %s/%s (token %d): the handler ended (%s) after this node lost the lease: handed back, not "
                "recorded (it runs again)",
                record.code,
                record.key,
                record.token,
                outcome,
            )
        else:
            self._bump("refused")
            log.warning(
                "task %s/%s (token %d): completion refused: this node lost the lease and %s; the store keeps the newer state",
                record.code,
                record.key,
                record.token,
                self._superseded(run),
            )
        return True

    def _count_overrun(self, run: _Run) -> int:
        """One more run of this task on this node that outlived its lease (once per run); how many so far."""
        with self._mutex:
            return self._overrun_locked(run)

    def _overrun_locked(self, run: _Run) -> int:
        """:meth:`_count_overrun`, under the mutex."""
        if run.overrun_counted:
            return self._overruns.get(run.task_key, 1)
        run.overrun_counted = True
        count = self._overruns.pop(run.task_key, 0) + 1
        self._overruns[run.task_key] = count
        while len(self._overruns) > _OVERRUNS_KEPT:
            del self._overruns[next(iter(self._overruns))]
        return count

    def _exhausted(self, run: _Run) -> Outcome | None:
        """:meth:`Handler.exhausted`, saying so when this node saw the task's runs outlive their lease."""
        outcome = run.handler.exhausted(run.record)
        if outcome is None:
            return None
        with self._mutex:
            count = self._overruns.get(run.task_key, 0)
        if not count:
            return outcome
        return Fail(
            f"attempt {run.record.attempt} is beyond max_attempts={run.handler.max_attempts}: {self._overrun_error(run, count)}"
        )

    def _overrun_error(self, run: _Run, count: int) -> str:
        times = "once" if count == 1 else f"{count} times"
        return (
            f"the handler outlived its {run.handler.lease:g} s lease {times} on node {self.node_id}: raise the "
            "handler's lease, or let its renewals run (a handler that holds the GIL blocks them)"
        )

    def _overrun_outcome(self, run: _Run) -> Outcome | None:
        """A claim of a task this node saw outlive its lease :data:`OVERRUN_LIMIT` times (its last
        hand-back refused: this node had claimed it again): the failed attempt, without running it."""
        with self._mutex:
            if self._overruns.get(run.task_key, 0) < OVERRUN_LIMIT:
                return None
        return self._overran(run)

    def _overran(self, run: _Run) -> Outcome:
        """The failed attempt of a task whose handler outlived its lease :data:`OVERRUN_LIMIT` times on
        this node: a retry after the handler's back-off, or failed when no attempt is left."""
        record, handler = run.record, run.handler
        with self._mutex:  # forgotten once an outcome is recorded (_count_completion)
            count = self._overruns.get(run.task_key, OVERRUN_LIMIT)
        error = self._overrun_error(run, count)
        log.error("task %s/%s (token %d): %s", record.code, record.key, record.token, error)
        if record.attempt >= handler.max_attempts:
            return Fail(f"attempt {record.attempt} of {handler.max_attempts}: {error}")
        return Retry(timedelta(seconds=handler.retry_delay(record.attempt)), error)

    def _superseded(self, run: _Run) -> str:
        """Who holds the task now, as far as this node knows: itself (a newer claim), or another node."""
        with self._mutex:
            newer = self._runs.get(run.task_key)
        if newer is not None and newer is not run and newer.record.token > run.record.token:
            return f"this node claimed it again (token {newer.record.token}) after its lease ran out"
        # Not known here: a newer attempt of this node's may have ended already (no "taken over" then).
        return "a newer attempt (on this node or another) holds the task, or it was cancelled"

    def _complete(self, run: _Run, outcome: Outcome) -> None:
        """One fenced write, queued for the completion thread (which ends the run): tried even if this
        node thinks the lease is gone (the store decides: a task nobody took over is still ours),
        and retried for up to one lease if the store is briefly unreachable."""
        record = run.record
        self.completions.submit(Completion(record.code, record.key, record.token, outcome, run.handler.lease, run))

    def _settled(self, item: Completion, result: bool | BaseException) -> None:
        """The completion thread's answer for one completion: count it, or fail the task if the store
        refused its outcome as bad input (it should have been caught before) instead of leaving it
        to run again every lease."""
        run: _Run = item.context
        record, outcome = run.record, item.outcome
        if isinstance(result, (StoreError, ConfigurationError)) and not isinstance(result, StoreUnavailableError):
            if not isinstance(outcome, Fail):
                log.error("task %s/%s: the store refused its outcome %r (%s): failing it", *run.task_key, outcome, result)
                failed = Fail(f"{outcome!r} refused: {result}")
                self.completions.submit(Completion(record.code, record.key, record.token, failed, item.give_up, run))
                return
        try:
            self._count_completion(run, outcome, result)
        finally:
            self._end(run)

    def _count_completion(self, run: _Run, outcome: Outcome, result: bool | BaseException) -> None:
        record = run.record
        if isinstance(result, BaseException):
            self._bump("unrecorded")
            log.error(
                "task %s/%s (token %d): could not record its outcome (%s); it runs again after its lease",
                record.code,
                record.key,
                record.token,
                result,
            )
            return
        if not result:
            self._bump("refused")
            log.warning(
                "task %s/%s (token %d): completion refused: %s; the store keeps the newer state",
                record.code,
                record.key,
                record.token,
                self._superseded(run),
            )
            return
        with self._mutex:
            self._overruns.pop(run.task_key, None)
        self._bump({"Done": "done", "Reschedule": "rescheduled", "Retry": "retried", "Fail": "failed"}[type(outcome).__name__])

    def _bump(self, name: str, count: int = 1) -> None:
        with self._mutex:
            setattr(self.stats, name, getattr(self.stats, name) + count)

    # -- renewal (called by the heartbeat thread) --------------------------------------------
    def renew_round(self) -> float | None:
        """Renew the leases of running tasks that are due for it: one round trip per lease length.

        Returns seconds until the next renewal is due, or None if nothing runs.
        """
        self._hand_back_waiting_too_long()
        now = self.clock()
        with self._mutex:
            due = [r for r in self._runs.values() if r.started and now >= r.renew_at and not r.lost and r.self_completed is None]
        groups: dict[float, list[_Run]] = {}
        for run in due:
            groups.setdefault(run.handler.lease, []).append(run)
        for lease, runs in groups.items():
            self._renew(lease, runs)
        with self._mutex:
            # waiting runs too: at their renew_at they are handed back (or renewed, if started meanwhile)
            waits = [r.renew_at for r in self._runs.values() if not r.lost and r.self_completed is None]
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
                if run.task_key in renewed and not self._lost_now(run):  # a late renewal never revives a run
                    run.deadline, run.renew_at = sent_at + lease, sent_at + lease / 3
                elif run.task_key in renewed:
                    continue
                elif not run.lost and not run.ending:  # an ending run's completion may have landed first
                    run.lost = True
                    self.stats.lost += 1
                    log.warning(
                        "task %s/%s (token %d): lease lost (taken over or cancelled); task.lost is now True",
                        run.record.code,
                        run.record.key,
                        run.record.token,
                    )


def _claim_ahead_setting() -> int:
    """``$MUTEXCRON_TASK_CLAIM_AHEAD``, or :data:`DEFAULT_CLAIM_AHEAD`."""
    text = os.environ.get("MUTEXCRON_TASK_CLAIM_AHEAD", "").strip()
    if not text:
        return DEFAULT_CLAIM_AHEAD
    try:
        return max(0, int(text))
    except ValueError as exc:
        raise ConfigurationError(f"MUTEXCRON_TASK_CLAIM_AHEAD must be a whole number, not {text!r}") from exc


def _by_lease(handlers: Mapping[str, Handler]) -> dict[float, list[str]]:
    groups: dict[float, list[str]] = {}
    for code, handler in sorted(handlers.items()):
        groups.setdefault(handler.lease, []).append(code)
    return groups
