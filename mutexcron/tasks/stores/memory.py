"""``memory://``: an in-process task store for tests and single-process use.

The rows live in the ``tasks`` table of a :class:`~mutexcron.backends.memory.MemoryBackend`, under
its mutex, so every method is trivially atomic. The store's clock is the backend's ``clock``
(monotonic seconds, injectable for tests) anchored once per ``memory://NAME`` space to the wall
time of its first use: every store on the space reads the same clock, and a test that moves the
fake clock moves the store's time and nothing else (the node's clock stays where it is).
"""

from __future__ import annotations

import builtins
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from ...backends.memory import MemoryBackend
from ..base import AddResult, CodeSummary, Done, Due, Fail, NewTask, Outcome, Reschedule, Retry, TaskRecord, TaskStore
from ..checks import (
    add_one_by_one,
    check_claim,
    check_codes,
    check_due,
    check_lease,
    check_on_conflict,
    check_outcome,
    check_state,
    check_task,
    check_time,
    decide_add,
    dump_payload,
    error_text,
    load_payload,
    reschedule_payload,
    resolve_due,
)
from ..wakeups.base import DEFAULT_POLL, PollWaker, Waker
from . import FINISHED_TTL

__all__ = ["MemoryTaskStore"]


@dataclass
class _Row:
    due: datetime
    #: When a claim may take the task: its due or a retry's time (queued), its lease's end (running), never (failed).
    run_at: datetime | None
    payload: str  # JSON text: records never share mutable state with the store
    created: datetime
    updated: datetime
    state: str = "queued"
    attempt: int = 0
    token: int = 0
    owner: str | None = None
    lease_until: datetime | None = None
    last_error: str | None = None
    pending_due: datetime | None = None
    pending_payload: str | None = None
    cancel_requested: bool = False
    occurrence: int = 0
    #: the running claim's handler started (:meth:`MemoryTaskStore.start`): a rescue counts a new attempt
    started: bool = False

    def fenced(self, node: str, token: int) -> bool:
        return self.state == "running" and self.owner == node and self.token == token

    def queue(self, due: datetime, now: datetime) -> None:
        """A new occurrence, due at ``due``: named by the token it begins at."""
        self.due, self.occurrence = due, self.token
        self.wait(due, now)

    def wait(self, run_at: datetime, now: datetime) -> None:
        """Queued, claimable from ``run_at``: the same occurrence (its due is kept)."""
        self.state, self.run_at, self.lease_until, self.updated = "queued", run_at, None, now

    def apply_pending(self, now: datetime) -> None:
        """The re-add made while the attempt ran becomes the task: a new definition, attempts reset."""
        assert self.pending_due is not None and self.pending_payload is not None
        self.queue(self.pending_due, now)
        self.payload, self.attempt, self.last_error = self.pending_payload, 0, None
        self.pending_due = self.pending_payload = None


class MemoryTaskStore(TaskStore):
    """Dicts behind the backend's mutex.

    Args:
        url: ``memory://`` or ``memory://NAME``, or a ready :class:`MemoryBackend`.
        clock: the store's clock in seconds (with a URL only); only its differences count.
    """

    def __init__(self, url: str | MemoryBackend = "memory://", *, clock: Callable[[], float] | None = None) -> None:
        if isinstance(url, MemoryBackend):
            if clock is not None:
                raise TypeError("clock= belongs to the backend: MemoryBackend(url, clock=...)")
            backend = url
        else:
            backend = MemoryBackend(url, clock=clock)
        super().__init__(backend.url)
        self.backend = backend
        # The space's tables are untyped dicts: this one is keyed by (code, key).
        self._rows = cast("dict[tuple[str, str], _Row]", backend.table("tasks"))
        self._wakers = cast("dict[str, list[Waker]]", backend.table("tasks_wakers"))
        # The highest token of a deleted task: a task added again starts from it (tokens only go up).
        self._floor = cast("dict[str, int]", backend.table("tasks_token_floor"))
        # Occurrences ended per minute, code and way (cancelled or not): the dashboard's throughput.
        self._ended = cast("dict[tuple[datetime, str, bool], int]", backend.table("tasks_finished"))
        origin = backend.table("tasks_clock")
        with backend.mutex:
            origin.setdefault("origin", (datetime.now(timezone.utc), backend.clock()))
            self._origin: tuple[datetime, float] = origin["origin"]

    def _now(self) -> datetime:
        wall, reading = self._origin
        return wall + timedelta(seconds=self.backend.clock() - reading)

    def _record(self, key: tuple[str, str], row: _Row) -> TaskRecord:
        return TaskRecord(
            code=key[0],
            key=key[1],
            due=row.due,
            payload=load_payload(row.payload),
            state=row.state,
            attempt=row.attempt,
            token=row.token,
            owner=row.owner,
            lease_until=row.lease_until,
            run_at=row.run_at,
            last_error=row.last_error,
            pending_due=row.pending_due,
            pending_payload=load_payload(row.pending_payload),
            cancel_requested=row.cancel_requested,
            created=row.created,
            updated=row.updated,
            occurrence=row.occurrence,
        )

    def _drop(self, key: tuple[str, str]) -> None:
        """Delete a task whose occurrence ended (under the mutex), raising the store's token floor to
        its token, and count the end in its minute: cancelled if a cancel was asked."""
        row = self._rows.pop(key)
        self._floor["token"] = max(self._floor.get("token", 0), row.token)
        minute = self._now().replace(second=0, microsecond=0)
        counted = (minute, key[0], row.cancel_requested)
        if counted not in self._ended:  # a new minute's first count: forget the minutes older than the keep
            oldest = minute - timedelta(seconds=FINISHED_TTL)
            for old in [k for k in self._ended if k[0] < oldest]:
                del self._ended[old]
        self._ended[counted] = self._ended.get(counted, 0) + 1

    def finished_per_minute(self, since: datetime) -> builtins.list[tuple[str, bool, datetime, int]]:
        """``(code, cancelled, minute, count)``: the occurrences that ended in each minute of the
        store's clock from the one holding ``since`` (kept :data:`~mutexcron.tasks.stores.FINISHED_TTL` seconds). A read."""
        first = check_time(since, "since").replace(second=0, microsecond=0)
        with self.backend.mutex:
            return [(code, cancelled, minute, n) for (minute, code, cancelled), n in self._ended.items() if minute >= first]

    # -- producers ---------------------------------------------------------------------------
    def add_many(self, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace") -> builtins.list[AddResult]:
        """One :meth:`add` at a time, every task checked first (see :meth:`TaskStore.add_many`)."""
        return add_one_by_one(self, tasks, on_conflict)

    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        code, key = check_task(code, key)
        at, delay = check_due(due)
        mode = check_on_conflict(on_conflict)
        text = dump_payload(payload, code, key)
        with self.backend.mutex:
            now = self._now()
            new_due = resolve_due(at, delay, now)
            row = self._rows.get((code, key))
            if row is None:
                floor = self._floor.get("token", 0)
                self._rows[code, key] = _Row(
                    due=new_due, run_at=new_due, payload=text, created=now, updated=now, token=floor, occurrence=floor
                )
                self._notify(code)
                return AddResult.INSERTED
            result = decide_add(row.state, row.due, row.pending_due, new_due, mode)
            if result is AddResult.REPLACED:
                row.queue(new_due, now)
                row.payload, row.attempt, row.last_error = text, 0, None
            elif result is AddResult.PENDING:
                row.pending_due, row.pending_payload, row.cancel_requested, row.updated = new_due, text, False, now
            if result is AddResult.REPLACED:
                self._notify(code)
            return result

    def cancel(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        with self.backend.mutex:
            row = self._rows.get((code, key))
            if row is None:
                return False
            if row.state != "running":
                row.cancel_requested = True  # counted as cancelled
                self._drop((code, key))
            else:
                row.cancel_requested, row.pending_due, row.pending_payload, row.updated = True, None, None, self._now()
            return True

    def get(self, code: str, key: str) -> TaskRecord | None:
        code, key = check_task(code, key)
        with self.backend.mutex:
            row = self._rows.get((code, key))
            return None if row is None else self._record((code, key), row)

    def list(
        self,
        *,
        code: str | None = None,
        key_contains: str | None = None,
        due_before: datetime | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> list[TaskRecord]:
        before = check_time(due_before, "due_before") if due_before is not None else None
        if state is not None:
            check_state(state)
        with self.backend.mutex:
            found = [
                (row.due, key, row)
                for key, row in self._rows.items()
                if (code is None or key[0] == code)
                and (key_contains is None or key_contains in key[1])
                and (before is None or row.due < before)
                and (state is None or row.state == state)
            ]
            found.sort(key=lambda item: (item[0], item[1]))
            return [self._record(key, row) for _, key, row in found[: max(0, limit)]]

    def retry(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        with self.backend.mutex:
            row = self._rows.get((code, key))
            if row is None or row.state != "failed":
                return False
            now = self._now()
            row.wait(now, now)
            row.attempt = 0
            self._notify(code)
            return True

    # -- workers -----------------------------------------------------------------------------
    def claim(self, node: str, codes: Iterable[str], limit: int, lease: float) -> builtins.list[TaskRecord]:
        wanted = set(check_codes(codes))
        limit, lease = check_claim(limit, lease)
        claimed: builtins.list[TaskRecord] = []
        with self.backend.mutex:
            now = self._now()
            due = heapq.nsmallest(
                limit,
                (
                    (run_at, key)
                    for key, row in self._rows.items()
                    if key[0] in wanted and (run_at := row.run_at) is not None and run_at <= now
                ),
            )
            for _, key in due:
                row = self._rows[key]
                if row.state == "running" and row.cancel_requested:
                    self._drop(key)  # its worker died after a cancel: nothing is left to finish
                    continue
                counted = row.state != "running" or row.started  # a rescued claim that never started is not counted twice
                row.attempt += int(counted)
                row.state, row.owner, row.token, row.started = "running", node, row.token + 1, False
                row.lease_until, row.updated = now + timedelta(seconds=lease), now
                row.run_at = row.lease_until
                try:
                    claimed.append(self._record(key, row))
                except ValueError as exc:  # an unreadable payload: failed alone, the batch goes on
                    row.state, row.run_at, row.lease_until = "failed", None, None
                    row.last_error = error_text(f"the stored task cannot be read ({type(exc).__name__}: {exc}); not run")
        return claimed

    def renew(self, node: str, tokens: Mapping[tuple[str, str], int], lease: float) -> set[tuple[str, str]]:
        lease = check_lease(lease)
        renewed: set[tuple[str, str]] = set()
        with self.backend.mutex:
            until = self._now() + timedelta(seconds=lease)
            for key, token in tokens.items():
                row = self._rows.get(key)
                if row is not None and row.fenced(node, token):
                    row.lease_until = row.run_at = until
                    renewed.add(key)
        return renewed

    def start(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        started = 0
        with self.backend.mutex:
            for code, key, token in tasks:
                row = self._rows.get((code, key))
                if row is not None and row.fenced(node, token):
                    row.started, started = True, started + 1
        return started

    def complete(self, node: str, code: str, key: str, token: int, outcome: Outcome) -> bool:
        check_outcome(outcome)
        payload = reschedule_payload(outcome, code, key)
        with self.backend.mutex:
            return self._complete(node, code, key, token, outcome, payload)

    def complete_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> builtins.list[bool]:
        """Every completion under the mutex once, in order (each fenced on its own)."""
        payloads = [reschedule_payload(check_outcome(outcome), code, key) for code, key, _, outcome in completions]
        with self.backend.mutex:
            return [
                self._complete(node, code, key, token, outcome, payload)
                for (code, key, token, outcome), payload in zip(completions, payloads, strict=True)
            ]

    def _complete(self, node: str, code: str, key: str, token: int, outcome: Outcome, payload: str | None = None) -> bool:
        """One completion, under the mutex (``payload``: a Reschedule's new one, as JSON text)."""
        row = self._rows.get((code, key))
        if row is None or not row.fenced(node, token):
            return False
        now = self._now()
        if row.cancel_requested or (isinstance(outcome, Done) and row.pending_due is None):
            self._drop((code, key))
            return True
        if row.pending_due is not None:
            row.apply_pending(now)
        elif isinstance(outcome, Fail):
            row.state, row.run_at, row.lease_until = "failed", None, None
            row.last_error, row.updated = error_text(outcome.error), now
            return True
        elif isinstance(outcome, Reschedule):
            row.queue(resolve_due(*check_due(outcome.due), now), now)  # a new occurrence
            row.attempt, row.last_error = 0, None
            if payload is not None:
                row.payload = payload
        elif isinstance(outcome, Retry):
            row.wait(resolve_due(*check_due(outcome.due), now), now)  # the same occurrence: due kept
            row.last_error = error_text(outcome.error)
        self._notify(code)  # queued again: an in-process notice costs nothing
        return True

    def release(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        count = 0
        queued: set[str] = set()
        with self.backend.mutex:
            now = self._now()
            for code, key, token in tasks:
                row = self._rows.get((code, key))
                if row is None or not row.fenced(node, token):
                    continue
                count += 1
                if row.cancel_requested:
                    self._drop((code, key))
                    continue
                row.token += 1  # a claim made with the old token can no longer write
                if row.pending_due is not None:
                    row.apply_pending(now)
                else:
                    row.attempt -= 1  # never started: the claim does not count as an attempt
                    row.wait(now, now)  # claimable at once; the occurrence (due) is kept
                queued.add(code)
            for code in sorted(queued):
                self._notify(code)
        return count

    def next_due(self, codes: Iterable[str]) -> float | None:
        wanted = set(check_codes(codes))
        with self.backend.mutex:
            times = [t for key, row in self._rows.items() if key[0] in wanted and (t := row.run_at) is not None]
            if not times:
                return None
            return max(0.0, (min(times) - self._now()).total_seconds())

    def summary(self, codes: Iterable[str] | None = None) -> builtins.list[CodeSummary]:
        wanted = None if codes is None else set(check_codes(codes))
        counts: dict[str, dict[str, Any]] = {code: {} for code in wanted or ()}
        with self.backend.mutex:
            now = self._now()
            for (code, _), row in self._rows.items():
                if wanted is not None and code not in wanted:
                    continue
                seen = counts.setdefault(code, {})
                seen[row.state] = seen.get(row.state, 0) + 1
                run_at = row.run_at
                if run_at is not None and run_at <= now:
                    seen["due_now"] = seen.get("due_now", 0) + 1
                    seen["oldest"] = min(seen.get("oldest", row.due), row.due)
        return [
            CodeSummary(
                code,
                queued=seen.get("queued", 0),
                due_now=seen.get("due_now", 0),
                running=seen.get("running", 0),
                failed=seen.get("failed", 0),
                oldest_overdue=None if "oldest" not in seen else max(0.0, (now - seen["oldest"]).total_seconds()),
            )
            for code, seen in sorted(counts.items())
        ]

    def waker(self, codes: Iterable[str], poll: float | None = None) -> Waker:
        """Polls (every ``poll`` seconds, None: the default), and is woken at once when a task of
        ``codes`` on the same ``memory://`` space is queued (an add, a retry, a hand-back, an
        attempt's end that queues it again)."""
        waker = PollWaker(poll or DEFAULT_POLL)
        with self.backend.mutex:
            for code in check_codes(codes):
                self._wakers.setdefault(code, []).append(waker)
        return waker

    def _notify(self, code: str) -> None:
        """Wake the workers of ``code`` on this space (called under the mutex)."""
        for waker in self._wakers.get(code, ()):
            waker.notify()

    def count_stored(self) -> dict[str, int]:
        with self.backend.mutex:
            return {"rows": len(self._rows), "tombstones": 0}

    def now(self) -> datetime:
        with self.backend.mutex:
            return self._now()

    def ping(self) -> None:
        self.backend.ping()

    def close(self) -> None:
        self.backend.close()
