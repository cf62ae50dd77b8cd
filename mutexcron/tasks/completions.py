"""Group commit of task completions: handler threads that finish together share one store call.

A handler thread hands its fenced completion to :meth:`CompletionBatcher.complete` and blocks for
the result. If no store call is in flight, its thread makes one at once with everything queued
(no added latency when idle); while one is in flight, the completions that arrive meanwhile wait
and go together in the next call (:meth:`~mutexcron.tasks.TaskStore.complete_many`: one round
trip where the store allows it). Each completion is still fenced on its own by the store.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .base import Outcome, TaskStore

__all__ = ["CompletionBatcher"]

#: The most completions one store call carries.
MAX_BATCH = 200


@dataclass(eq=False)
class _Pending:
    code: str
    key: str
    token: int
    outcome: Outcome
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # this completion's thread makes the next store call
    result: bool = False
    error: BaseException | None = None


class CompletionBatcher:
    """Fenced completions of one node's task handlers, batched while a store call is in flight."""

    def __init__(self, store: TaskStore, node_id: str) -> None:
        self.store = store
        self.node_id = node_id
        self._mutex = threading.Lock()
        self._queue: list[_Pending] = []
        self._busy = False  # a thread is making a store call
        self.calls = 0  # store calls made (completions / calls = the batching achieved)

    def complete(self, code: str, key: str, token: int, outcome: Outcome) -> bool:
        """Record one completion (see :meth:`TaskStore.complete`); raises what the store raises."""
        item = _Pending(code, key, token, outcome)
        with self._mutex:
            self._queue.append(item)
            if self._busy:
                leader = False
            else:
                self._busy = leader = True
        if not leader:
            item.done.wait()
            if item.lead:  # the previous caller handed the next store call to this thread
                self._drain(item)
        if leader:
            self._drain(item)
        if item.error is not None:
            raise item.error
        return item.result

    def _drain(self, own: _Pending) -> None:
        """Make store calls until ``own`` is recorded, then hand on to a waiting thread, if any."""
        while not own.done.is_set() or own.lead:
            own.lead = False
            with self._mutex:
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            self._call(batch)
        with self._mutex:
            if not self._queue:
                self._busy = False
                return
            heir = self._queue[0]
        heir.lead = True
        heir.done.set()

    def _call(self, batch: list[_Pending]) -> None:
        self.calls += 1
        try:
            results = self.store.complete_many(self.node_id, [(p.code, p.key, p.token, p.outcome) for p in batch])
        except BaseException as exc:  # noqa: BLE001 - every waiter gets the error (and re-raises it): none hangs
            for pending in batch:
                pending.error = exc
        else:
            for pending, result in zip(batch, results, strict=True):
                pending.result = result
        for pending in batch:
            if pending.lead:
                continue
            pending.done.set()
