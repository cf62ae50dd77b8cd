"""Task handlers: what ``@pool.handler(code)`` registers, what a handler is given, and how its
return value or exception becomes the outcome the worker records.

A handler is ``func(task) -> None | datetime | timedelta | Reschedule`` (a coroutine function
works too: it runs to completion on the worker's thread):

* ``None``: done, the task is dropped;
* an aware ``datetime`` or a ``timedelta`` (from the store's clock): run this task again then
  (seed 000's "next time"), attempts reset;
* ``Reschedule(due, payload=...)``: the same, with a new payload, written in the same fenced
  completion (a handler carrying a cursor from run to run);
* an exception: retried after an exponential backoff with jitter, up to ``max_attempts``, then
  kept as ``failed`` with its error;
* anything else (a naive datetime included): the task is failed with an error that says what to
  return instead.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import random
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ..errors import AttrsError, ConfigurationError, Defer, FailTask
from ..names import check_name
from .base import Done, Due, Fail, Outcome, Reschedule, Retry, TaskRecord
from .checks import check_due, reschedule_payload

__all__ = ["DEFAULT_TASK_LEASE", "INTERNAL_PREFIX", "Defer", "FailTask", "Handler", "Task", "public_codes"]

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the worker's own frames say nothing

#: Task codes that start with this are mutexcron's own (``mutexcron.trigger``, the requests of
#: ``mutexcron trigger``): served like any other, but left out of ``codes()``, the worker's
#: start-up line and the per-code metrics, which describe the user's handlers.
INTERNAL_PREFIX = "mutexcron."


def public_codes(codes: Iterable[str]) -> list[str]:
    """``codes`` without mutexcron's own (:data:`INTERNAL_PREFIX`), sorted."""
    return sorted(code for code in codes if not code.startswith(INTERNAL_PREFIX))


#: Seconds a claimed task's lease lasts unless the handler says otherwise (renewed every lease/3).
DEFAULT_TASK_LEASE = 30.0
#: Attempts a task gets unless the handler says otherwise.
DEFAULT_MAX_ATTEMPTS = 5


class Task:
    """A claimed task, as its handler sees it.

    Attributes:
        code, key, due, payload, attempt, token: the task as claimed (see :class:`TaskRecord`);
            ``attempt`` counts from 1, ``token`` is the fencing token of this attempt.
        record: the whole :class:`TaskRecord`.
    """

    def __init__(
        self, record: TaskRecord, lost: Callable[[], bool], complete: Callable[[Any, Outcome], None] | None = None
    ) -> None:
        self.record = record
        self._lost = lost
        self._complete = complete

    code = property(lambda self: self.record.code, doc="The task's code.")
    key = property(lambda self: self.record.key, doc="The task's key.")
    due = property(lambda self: self.record.due, doc="The due time of this attempt (aware UTC, store clock).")
    payload = property(lambda self: self.record.payload, doc="The task's JSON payload.")
    attempt = property(lambda self: self.record.attempt, doc="This attempt's number, from 1.")
    token = property(lambda self: self.record.token, doc="This attempt's fencing token.")

    @property
    def idempotency_key(self) -> str:
        """``code:key:due``: the same for every attempt of this occurrence (key your own writes on it)."""
        return self.record.idempotency_key

    @property
    def lost(self) -> bool:
        """True once this node no longer holds the task's lease (a renewal was refused, or none
        succeeded within the lease): another node may be running it. Stop, and write nothing."""
        return self._lost()

    def complete(self, transaction: Any, *, reschedule: Due | Reschedule | None = None) -> None:
        """End this attempt inside your own transaction (SQL stores), with the fenced statement the
        worker would run after the handler: the task is dropped (or, with ``reschedule``, queued
        again then, as if the handler returned it; ``Reschedule(due, payload=...)`` also with a new
        payload) if and only if your transaction commits.

        Call it last in the transaction, after your writes, then commit and return normally: the
        worker records nothing more. ``transaction`` is a SQLAlchemy ``Connection`` or
        ``Session``, a DB-API connection, or Django's ``connection`` inside
        ``transaction.atomic()``, on the task store's database.

        Raises:
            StaleTaskError: the fence failed (this node's lease ran out and a newer attempt took
                the task over, or it is gone). Let it propagate: your transaction rolls back with
                this attempt's writes, and the worker records nothing more for this attempt.
            ConfigurationError: not a SQL store, another database, a connection without a
                transaction, or the task completed already.
        """
        if self._complete is None:
            raise ConfigurationError(f"{self!r} was not handed out by a task worker: it has no attempt to complete")
        again = reschedule if isinstance(reschedule, Reschedule) or reschedule is None else Reschedule(reschedule)
        self._complete(transaction, Done() if again is None else again)

    def __repr__(self) -> str:
        return f"<Task {self.code}/{self.key} attempt {self.attempt} token {self.token}>"


@dataclass(frozen=True)
class Handler:
    """A registered task handler and its settings.

    Args:
        code: the task code it runs.
        func: ``func(task)``; see the module docstring for what it may return.
        lease: seconds of lease per claim, renewed every lease/3 while the handler runs.
        max_attempts: attempts before the task is kept as failed (a rescued attempt counts).
        backoff: seconds before the first retry; doubled for each further attempt.
        backoff_max: the longest wait before a retry.
        jitter: the fraction of each wait that is random (0: none, 1: anywhere from 0 to the wait),
            so tasks that failed together do not retry together.
        poll: on stores without notices of new tasks (MySQL/MariaDB, MongoDB) and on SQLite's
            change check, the seconds between two looks for this code's new tasks; None: the
            store's own cadence (0.2 s; SQLite 25 ms). A node looks as often as its most eager
            handler asks. PostgreSQL and Redis are woken by notices whatever this says.
    """

    code: str
    func: Callable[[Task], Any]
    lease: float = DEFAULT_TASK_LEASE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff: float = 10.0
    backoff_max: float = 3600.0
    jitter: float = 0.5
    poll: float | None = None
    is_coroutine: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        check_name(self.code, "task code")
        if not callable(self.func):
            raise ConfigurationError(f"the handler of task code {self.code!r} is {self.func!r}, not a function")
        _positive(self.lease, "lease", self.code)
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigurationError(f"handler {self.code!r}: max_attempts={self.max_attempts!r}; give a whole number >= 1")
        _positive(self.backoff, "backoff", self.code, zero=True)
        _positive(self.backoff_max, "backoff_max", self.code, zero=True)
        if isinstance(self.jitter, bool) or not isinstance(self.jitter, (int, float)) or not 0 <= self.jitter <= 1:
            raise ConfigurationError(f"handler {self.code!r}: jitter={self.jitter!r}; give a fraction from 0 to 1")
        if self.poll is not None:
            _positive(self.poll, "poll", self.code)
        object.__setattr__(self, "is_coroutine", inspect.iscoroutinefunction(self.func))

    @property
    def name(self) -> str:
        return getattr(self.func, "__qualname__", repr(self.func))

    def call(self, task: Task) -> Any:
        """Run the handler on ``task`` (a coroutine handler on an event loop of its own)."""
        if self.is_coroutine:
            return asyncio.run(self.func(task))
        return self.func(task)

    def retry_delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        """Seconds before retrying after failed attempt number ``attempt`` (from 1)."""
        wait = min(self.backoff_max, self.backoff * 2.0 ** min(max(attempt - 1, 0), 60))
        return wait * (1.0 - self.jitter * rng())

    def outcome(self, record: TaskRecord, result: Any) -> Outcome:
        """What the handler's return value means for the task."""
        if result is None:
            return Done()
        if isinstance(result, (datetime, timedelta)):
            if isinstance(result, datetime) and (result.tzinfo is None or result.utcoffset() is None):
                return Fail(
                    f"handler {self.name} returned the naive datetime {result!r}: return None when the task is done, "
                    "or an aware datetime (tzinfo=timezone.utc) or a timedelta to run it again then"
                )
            try:
                check_due(result, "the returned due")
            except ConfigurationError as exc:
                return Fail(f"handler {self.name} returned {_short(result)}: {exc}")
            return Reschedule(result)
        if isinstance(result, Reschedule):
            return self._rescheduled(record, result)
        return Fail(
            f"handler {self.name} returned {type(result).__name__} {_short(result)}: return None when the task is "
            "done, or an aware datetime, a timedelta or Reschedule(due, payload=...) to run it again then"
        )

    def _rescheduled(self, record: TaskRecord, result: Reschedule) -> Outcome:
        """A returned ``Reschedule(due, payload=...)``: checked here, so that a bad due or payload
        fails the task with what to fix instead of failing its completion."""
        due = result.due
        if isinstance(due, datetime) and (due.tzinfo is None or due.utcoffset() is None):
            return Fail(f"handler {self.name} returned Reschedule with the naive datetime {due!r}: give it tzinfo=timezone.utc")
        try:
            check_due(due, "Reschedule.due")
            reschedule_payload(result, record.code, record.key)
        except (ConfigurationError, AttrsError) as exc:
            return Fail(f"handler {self.name} returned {_short(result)}: {exc}")
        return result

    def failure(self, record: TaskRecord, exc: BaseException) -> Outcome:
        """What an exception in attempt ``record.attempt`` means: a retry, or the failed state."""
        if isinstance(exc, Defer):
            return self._deferred(record, exc)
        if isinstance(exc, FailTask):
            return Fail(str(exc))
        error = _error_text(exc)
        if record.attempt >= self.max_attempts:
            return Fail(f"attempt {record.attempt} of {self.max_attempts}: {error}")
        return Retry(timedelta(seconds=self.retry_delay(record.attempt)), error)

    def _deferred(self, record: TaskRecord, signal: Defer) -> Outcome:
        """A :class:`Defer`: the same occurrence again later, unless no attempt is left or the time is out of range."""
        if record.attempt >= self.max_attempts:
            return Fail(
                f"the handler deferred attempt {record.attempt} of max_attempts={self.max_attempts} ({signal.reason}): no "
                "attempt is left. Defer counts attempts: give the handler a larger max_attempts (or Defer less often), "
                "then `mutexcron tasks retry` it"
            )
        try:
            wait = timedelta(seconds=signal.seconds)
            check_due(wait, f"Defer({signal.seconds:g})")
        except (ConfigurationError, OverflowError) as exc:
            text = str(exc) if isinstance(exc, ConfigurationError) else f"Defer({signal.seconds:g}) is too far away"
            return Fail(f"handler {self.name}: {text}")
        return Retry(wait, signal.reason)

    def exhausted(self, record: TaskRecord) -> Outcome | None:
        """Fail a task claimed beyond ``max_attempts`` (its earlier workers died mid-run) without running it."""
        if record.attempt <= self.max_attempts:
            return None
        return Fail(
            f"attempt {record.attempt} is beyond max_attempts={self.max_attempts}: earlier attempts ended without a "
            "result (their workers died or stalled past the lease); not run again. Fix the cause, then "
            "`mutexcron tasks retry` it"
        )


def _positive(value: object, what: str, code: str, *, zero: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):  # type: ignore[operator]
        raise ConfigurationError(
            f"handler {code!r}: {what}={value!r}; give a {'non-negative' if zero else 'positive'} number of seconds"
        )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_text(exc: BaseException) -> str:
    """The exception and the innermost frames of its traceback: what a reader of ``last_error`` needs."""
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_HERE)][-3:]
    where = "; ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in frames)
    return f"{head} (at {where})" if where else head
