"""What runs inside the task drill's node processes: the recording task store and the events file.

Imported by :mod:`mutexcron.drill.task_node_jobs` only. :class:`RecordingTaskStore` wraps the task
store the node's worker uses and writes, for every claim, completion and hand-back, what the store
answered (``complete`` returning False is the fenced refusal of a stale attempt), so the drill
judges the store's answers, not the worker's logs alone. Store calls are timed as the lock drill's
:class:`~mutexcron.drill.TimedLockStore` times them (``{"ops": ...}`` lines in the node's timing file).

The events file (``<node>.tasks.jsonl``, one JSON object a line, appended with single ``write``
calls so lines from several threads never interleave):

* ``{"event": "clock", "offset"}``: the store's clock minus this node's wall clock, in seconds;
* ``{"event": "claim", "tasks": [[key, token, attempt]...], "sent", "mono"}``;
* ``{"event": "held", "tasks": [[key, token]...], "mono"}`` / ``{"event": "unheld", "stopping", "mono"}``:
  a claim reply the drill asked this node to hold (see :meth:`RecordingTaskStore.claim`);
* ``{"event": "start" | "end", "key", "token", "attempt", "due", "at", "sleep", "mono"}``: written
  by the handler (``due`` and ``at`` are epoch seconds by the store's clock);
* ``{"event": "complete", "key", "token", "ok", "outcome", "sent", "mono"}`` (and ``"batch"``: how
  many completions shared the store call, for the worker's group commit through ``complete_many``);
* ``{"event": "release", "tasks": [[key, token]...], "count", "sent", "mono"}``.

``mono`` is ``time.monotonic()`` (system-wide on Linux: the drill compares it with its own).
"""

from __future__ import annotations

import builtins
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from ..tasks.base import AddResult, CodeSummary, Due, NewTask, Outcome, TaskRecord, TaskStore
from ..tasks.wakeups.base import Waker
from .records import OpTimings

__all__ = ["EventLog", "RecordingTaskStore", "measure_offset"]


class EventLog:
    """Appends JSON lines to one file with one ``write`` each (safe from any thread)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, obj: Mapping[str, Any]) -> None:
        try:
            os.write(self._fd, (json.dumps(obj, separators=(",", ":")) + "\n").encode())
        except OSError:  # the drill removed its directory: nothing left to report to
            pass


def measure_offset(store: TaskStore) -> float:
    """The store's clock minus this node's wall clock (seconds), read at the middle of one round trip."""
    before = time.time()
    now = store.now().timestamp()
    after = time.time()
    return now - (before + after) / 2


class RecordingTaskStore(TaskStore):
    """A TaskStore that records what the store answered to this node's worker, and times each call.

    Args:
        inner: the store to record.
        events: the node's events file.
        timing: the node's timing file (the lock drill's ``{"ops": [[op, start, seconds]...]}`` lines).
        hold_file: while this file exists, the next claim that returns tasks is held (see :meth:`claim`).
        max_hold: the longest a claim reply is held (kept well inside the lease, so a held claim
            can still start).
    """

    def __init__(
        self,
        inner: TaskStore,
        events: EventLog,
        timing: EventLog,
        *,
        hold_file: Path | None = None,
        max_hold: float = 1.0,
    ) -> None:
        super().__init__(inner.url)
        self.inner = inner
        self.events = events
        self.timing = timing
        self.hold_file = hold_file
        self.max_hold = max_hold
        #: Set by the jobs module: True once the worker is stopping (ends a held claim at once).
        self.stopping: Callable[[], bool] = lambda: False
        # TaskRunner sizes a SQL store's connection pool through ``store.backend``.
        self.backend = getattr(inner, "backend", None)
        self._timings = OpTimings(timing.write)
        self._timed = self._timings.timed

    def flush(self) -> None:
        """Append the buffered timings to the timing file."""
        self._timings.flush()

    # -- what the worker calls: recorded ---------------------------------------------------------
    def claim(self, node: str, codes: Iterable[str], limit: int, lease: float) -> builtins.list[TaskRecord]:
        """Claim as the store does, and record the reply.

        If the drill created :attr:`hold_file`, a reply with tasks is held (the file is consumed)
        until the worker stops or :attr:`max_hold` passes: the drill SIGTERMs this node meanwhile,
        so the node has claimed tasks that have not started, which a stop must hand back at once.
        Without the hold, a claimed task starts within microseconds and a SIGTERM almost never
        finds one to hand back.
        """
        sent = time.monotonic()
        with self._timed("claim"):
            records = self.inner.claim(node, codes, limit, lease)
        if records:
            self.events.write(
                {
                    "event": "claim",
                    "tasks": [[r.key, r.token, r.attempt] for r in records],
                    "sent": sent,
                    "mono": time.monotonic(),
                }
            )
            self._hold(records)
        return records

    def _hold(self, records: builtins.list[TaskRecord]) -> None:
        if self.hold_file is None:
            return
        try:
            self.hold_file.unlink()
        except FileNotFoundError:
            return
        self.events.write({"event": "held", "tasks": [[r.key, r.token] for r in records], "mono": time.monotonic()})
        end = time.monotonic() + self.max_hold
        while not self.stopping() and time.monotonic() < end:
            time.sleep(0.005)
        self.events.write({"event": "unheld", "stopping": self.stopping(), "mono": time.monotonic()})

    def complete(self, node: str, code: str, key: str, token: int, outcome: Outcome) -> bool:
        sent = time.monotonic()
        with self._timed("complete"):
            ok = self.inner.complete(node, code, key, token, outcome)
        self.events.write(
            {
                "event": "complete",
                "key": key,
                "token": token,
                "ok": ok,
                "outcome": type(outcome).__name__,
                "sent": sent,
                "mono": time.monotonic(),
            }
        )
        return ok

    def complete_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> builtins.list[bool]:
        """The worker's group commit: one store call, one ``complete`` event per completion."""
        completions = builtins.list(completions)
        sent = time.monotonic()
        with self._timed("complete_many"):
            results = self.inner.complete_many(node, completions)
        at = time.monotonic()
        for (_code, key, token, outcome), ok in zip(completions, results, strict=True):
            self.events.write(
                {
                    "event": "complete",
                    "key": key,
                    "token": token,
                    "ok": ok,
                    "outcome": type(outcome).__name__,
                    "sent": sent,
                    "mono": at,
                    "batch": len(completions),
                }
            )
        return results

    def release(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        tasks = builtins.list(tasks)
        sent = time.monotonic()
        with self._timed("release"):
            count = self.inner.release(node, tasks)
        self.events.write(
            {"event": "release", "tasks": [[k, t] for _c, k, t in tasks], "count": count, "sent": sent, "mono": time.monotonic()}
        )
        if len(tasks) == 1 and count == 0:
            # A run that ended after this node lost its lease is handed back, never recorded (one
            # task at a time): refused, it is a stale attempt's end the store refused, as a completion.
            _code, key, token = tasks[0]
            self.events.write(
                {"event": "complete", "key": key, "token": token, "ok": False, "outcome": "HandBack", "sent": sent,
                 "mono": time.monotonic()}
            )  # fmt: skip
        return count

    def add_many(self, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace") -> builtins.list[AddResult]:
        return self.inner.add_many(tasks, on_conflict=on_conflict)

    def start(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        with self._timed("start"):
            return self.inner.start(node, tasks)

    def renew(self, node: str, tokens: Mapping[tuple[str, str], int], lease: float) -> set[tuple[str, str]]:
        with self._timed("renew"):
            return self.inner.renew(node, tokens, lease)

    def next_due(self, codes: Iterable[str]) -> float | None:
        with self._timed("next_due"):
            return self.inner.next_due(codes)

    # -- the rest: passed through -----------------------------------------------------------------
    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        return self.inner.add(code, key, due, payload, on_conflict=on_conflict)

    def cancel(self, code: str, key: str) -> bool:
        return self.inner.cancel(code, key)

    def get(self, code: str, key: str) -> TaskRecord | None:
        return self.inner.get(code, key)

    def list(
        self,
        *,
        code: str | None = None,
        key_contains: str | None = None,
        due_before: datetime | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> builtins.list[TaskRecord]:
        return self.inner.list(code=code, key_contains=key_contains, due_before=due_before, state=state, limit=limit)

    def retry(self, code: str, key: str) -> bool:
        return self.inner.retry(code, key)

    def summary(self, codes: Iterable[str] | None = None) -> builtins.list[CodeSummary]:
        return self.inner.summary(codes)

    def waker(self, codes: Iterable[str], poll: float | None = None) -> Waker:
        return self.inner.waker(codes, poll)

    def now(self) -> datetime:
        return self.inner.now()

    def ping(self) -> None:
        self.inner.ping()

    def close(self) -> None:
        self._timings.close()
        self.inner.close()
