"""Task completions, batched on a thread of their own.

A handler thread hands its fenced completion to :meth:`CompletionQueue.submit` and goes on to
its next task at once; the queue's thread records what was submitted in one store call
(:meth:`~mutexcron.tasks.TaskStore.complete_many`: one statement on PostgreSQL and SQLite, one
transaction on MySQL/MariaDB) and hands each result to the worker (``settle``). Each completion is
still fenced on its own (owner and token) by the store: a stale one in a batch is refused while
the others count.

How long a completion waits for its batch is bounded: a call goes at once when no handler is
running (``linger`` says False: nothing else is about to end, so light load adds no delay),
otherwise after at most ``max_delay`` seconds, or as soon as ``max_batch`` are queued; completions
that arrive while a call is in flight go in the next one. The waits are measured
(:attr:`CompletionQueue.delay_max`, :attr:`CompletionQueue.delay_total`).

The same thread writes the *started* marks (:meth:`CompletionQueue.mark_started`: a handler began,
so a rescue of its claim counts an attempt) in one :meth:`~mutexcron.tasks.TaskStore.start` call
per batch, before the batch's completions; a mark whose completion is in the same batch is not
written (the completion says more).

A store that is briefly unreachable: the batch is tried again with a growing pause, each
completion until its ``give_up`` time (its lease); one the store refuses as bad input is tried on
its own, so it does not take the others down with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import PartlyCompletedError, StoreUnavailableError
from .base import Outcome, TaskStore

__all__ = ["MAX_BATCH", "MAX_DELAY", "Completion", "CompletionQueue"]

log = logging.getLogger(__name__)

#: The most completions one store call carries.
MAX_BATCH = 200
#: The longest a completion waits for others to join its batch (seconds), while handlers run.
MAX_DELAY = 0.002


@dataclass(eq=False)
class Completion:
    """One fenced completion, and what its submitter needs back with the result (``context``)."""

    code: str
    key: str
    token: int
    outcome: Outcome
    give_up: float = 0.0  # seconds (from submit) the store may stay unreachable before the result is the error
    context: Any = None
    queued_at: float = 0.0  # time.monotonic() at submit


#: What the queue hands back per completion: the store's answer (recorded or refused) or its error.
Settle = Callable[[Completion, "bool | BaseException"], None]


class CompletionQueue:
    """Fenced completions of one node's task handlers, recorded in batches by a thread of its own."""

    def __init__(
        self,
        store: TaskStore,
        node_id: str,
        settle: Settle,
        *,
        linger: Callable[[], bool] = lambda: False,
        max_delay: float = MAX_DELAY,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.store = store
        self.node_id = node_id
        self.settle = settle
        self.linger = linger
        self.max_delay = max_delay
        self.max_batch = max(1, max_batch)
        self._cond = threading.Condition()
        self._queue: deque[Completion] = deque()
        self._starts: dict[tuple[str, str, int], float] = {}  # (code, key, token) -> time.monotonic() at mark
        self._closed = False
        self._thread: threading.Thread | None = None
        self.calls = 0  # store calls made (completed / calls = the batching achieved)
        self.completed = 0
        self.delay_max = 0.0  # seconds: the longest a completion waited in the queue for its store call
        self.delay_total = 0.0
        self.start_calls = 0  # store calls that wrote started marks
        self.marked = 0  # started marks written
        self.elided = 0  # started marks not written: their completion went in the same batch

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mutexcron-completions", daemon=True)
            self._thread.start()

    def submit(self, item: Completion) -> None:
        """Queue one completion; its result goes to ``settle`` on the queue's thread."""
        item.queued_at = time.monotonic()
        with self._cond:
            self._queue.append(item)
            if len(self._queue) == 1 or len(self._queue) >= self.max_batch:
                self._cond.notify()

    def mark_started(self, code: str, key: str, token: int) -> None:
        """Queue the started mark of one claim, written with the next batch."""
        with self._cond:
            first = not self._starts and not self._queue
            self._starts[(code, key, int(token))] = time.monotonic()
            if first:
                self._cond.notify()

    def close(self, timeout: float = 15.0) -> None:
        """Record what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the queue's thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while (taken := self._next_batch()) is not None:
            starts, batch = taken
            try:
                self._mark(starts)
                self._record(batch)
            except Exception:  # never let the thread die: the submitters wait for their results
                log.exception("task completions: recording a batch failed")

    def _next_batch(self) -> tuple[list[tuple[str, str, int]], list[Completion]] | None:
        """The started marks and the completions of the next store calls (None once closed and empty)."""
        with self._cond:
            while not self._queue and not self._starts:
                if self._closed:
                    return None
                self._cond.wait()
            if len(self._queue) < self.max_batch and not self._closed and self.linger():
                first = self._queue[0].queued_at if self._queue else min(self._starts.values())
                until = first + self.max_delay
                while len(self._queue) < self.max_batch and not self._closed and (left := until - time.monotonic()) > 0:
                    self._cond.wait(left)
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]
            ending = {(c.code, c.key, c.token) for c in batch}
            starts = [mark for mark in self._starts if mark not in ending]
            self.elided += len(self._starts) - len(starts)
            self._starts.clear()
        self._waited(batch)
        return starts, batch

    def _mark(self, starts: list[tuple[str, str, int]]) -> None:
        """Write the started marks (one store call). Not retried: a mark that does not get through
        only means a rescue of that claim would not count its attempt."""
        if not starts:
            return
        self.start_calls += 1
        try:
            self.marked += self.store.start(self.node_id, starts)
        except Exception as exc:  # noqa: BLE001 - the batch's completions must still be recorded
            log.debug("task started marks: %d not written (%s)", len(starts), exc)

    def _waited(self, batch: list[Completion]) -> None:
        now = time.monotonic()
        for item in batch:
            waited = now - item.queued_at
            self.delay_total += waited
            self.delay_max = max(self.delay_max, waited)

    def _record(self, batch: list[Completion]) -> None:
        if not batch:
            return
        pause = 0.2
        while batch:
            self.calls += 1
            try:
                results = self.store.complete_many(self.node_id, [(c.code, c.key, c.token, c.outcome) for c in batch])
            except StoreUnavailableError as exc:
                if isinstance(exc, PartlyCompletedError):  # recorded before the failure: settled, not retried
                    for i in sorted(exc.ended):
                        self._settle(batch[i], True)
                    batch = [item for i, item in enumerate(batch) if i not in exc.ended]
                batch = self._give_up_on(batch, exc, pause)
                time.sleep(pause if batch else 0)
                pause = min(pause * 2, 2.0)
                continue
            except BaseException as exc:  # noqa: BLE001 - bad input in one of them: each on its own
                if len(batch) == 1:
                    self._settle(batch[0], exc)
                else:
                    for item in batch:
                        self._record([item])
                return
            for item, result in zip(batch, results, strict=True):
                self._settle(item, result)
            return

    def _give_up_on(self, batch: list[Completion], exc: BaseException, pause: float) -> list[Completion]:
        """Settle with ``exc`` the completions that would outlast their ``give_up`` by another try; the rest."""
        now = time.monotonic()
        keep = []
        for item in batch:
            if self._closed or now + pause >= item.queued_at + item.give_up:
                self._settle(item, exc)
            else:
                keep.append(item)
        return keep

    def _settle(self, item: Completion, result: bool | BaseException) -> None:
        self.completed += 1
        try:
            self.settle(item, result)
        except Exception:
            log.exception("task %s/%s: handling its completion failed", item.code, item.key)
