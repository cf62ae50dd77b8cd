"""Checks on what callers give the task stores, and the one rule of ``add`` every store applies.

Everything here runs before a store is contacted, so bad input stores nothing, and every store
(memory and SQL alike) takes the same decision for the same row (:func:`decide_add`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple, TypeVar

from ..errors import AttrsError, ConfigurationError, StoreError
from ..names import check_name
from .base import KEEP, ON_CONFLICT, STATES, AddResult, Done, Fail, NewTask, Outcome, Reschedule, Retry, TaskRecord, TaskStore

log = logging.getLogger(__name__)
_Row = TypeVar("_Row")

#: ``last_error`` keeps at most this many characters (a traceback's head is what a reader needs).
MAX_ERROR_LENGTH = 4000

#: The due times every store holds (Redis keeps epoch microseconds exact in a Lua double up to
#: 2**53, about 285 years either side of 1970; MySQL's DATETIME starts at 1000, SQLite's text
#: form has four-digit years): from 1900 up to, not including, 2200, in UTC. An ``add``, a
#: :class:`~mutexcron.tasks.base.Reschedule`, a :class:`~mutexcron.tasks.base.Retry` (a ``Defer``)
#: outside it is refused before anything reaches the store.
MIN_DUE = datetime(1900, 1, 1, tzinfo=timezone.utc)
MAX_DUE = datetime(2200, 1, 1, tzinfo=timezone.utc)

_JSON_RULE = "dicts with string keys, lists, strings, finite numbers, booleans and None"


def check_task(code: object, key: object) -> tuple[str, str]:
    """``(code, key)`` if both are valid names (:func:`mutexcron.names.check_name`), else ConfigurationError."""
    return check_name(code, "task code"), check_name(key, "task key")


class CheckedTask(NamedTuple):
    """One task of an ``add_many`` once checked: its names, its due (``at`` or ``delay``, as
    :func:`check_due` gives them) and its payload as the JSON text a store writes."""

    code: str
    key: str
    due: Any
    payload: Any
    at: datetime | None
    delay: float | None
    text: str


def check_batch(tasks: Iterable[NewTask | tuple[Any, ...]], *, labels: Sequence[str] | None = None) -> list[NewTask]:
    """The tasks of an ``add_many``, each checked as ``add`` checks it (names, due, payload), the
    same ``(code, key)`` twice refused; nothing is written unless all pass.

    Args:
        labels: how errors name each task ("line 7"); default "task N of add_many", counted from 1.
    """
    return [NewTask(t.code, t.key, t.due, t.payload) for t in checked_batch(tasks, labels=labels)]


def add_one_by_one(store: TaskStore, tasks: Iterable[NewTask | tuple[Any, ...]], on_conflict: str) -> list[AddResult]:
    """:meth:`TaskStore.add_many` one :meth:`~TaskStore.add` at a time, every task checked first."""
    batch, mode = check_batch(tasks), check_on_conflict(on_conflict)
    return [store.add(task.code, task.key, task.due, task.payload, on_conflict=mode) for task in batch]


def checked_batch(tasks: Iterable[NewTask | tuple[Any, ...]], *, labels: Sequence[str] | None = None) -> list[CheckedTask]:
    """:func:`check_batch`, keeping what the checks computed, so a store writes the batch without checking it again."""
    if isinstance(tasks, (str, bytes, Mapping)):
        raise ConfigurationError(f"add_many takes a list of tasks, not a {type(tasks).__name__}")

    def label(position: int, within: str = " of add_many") -> str:
        return labels[position] if labels is not None else f"task {position + 1}{within}"

    batch: list[CheckedTask] = []
    seen: dict[tuple[str, str], int] = {}
    for position, item in enumerate(tasks):
        task = _new_task(item, label(position))
        try:
            code, key = check_task(task.code, task.key)
            at, delay = check_due(task.due)
            text = dump_payload(task.payload, code, key)
        except (ConfigurationError, AttrsError) as exc:
            raise type(exc)(f"{label(position)}: {exc}") from None
        if (code, key) in seen:
            raise ConfigurationError(
                f"{label(position)}: ({code!r}, {key!r}) is {label(seen[code, key], '')} too; give each task once"
            )
        seen[code, key] = position
        batch.append(CheckedTask(code, key, task.due, task.payload, at, delay, text))
    return batch


def _new_task(item: object, label: str) -> NewTask:
    if isinstance(item, NewTask):
        return item
    if isinstance(item, tuple) and 3 <= len(item) <= 4:
        return NewTask(*item)
    raise ConfigurationError(
        f"{label}: {type(item).__name__} {item!r:.80}: give NewTask(code, key, due, payload) "
        "or a tuple (code, key, due) / (code, key, due, payload)"
    )


def check_codes(codes: Iterable[str]) -> list[str]:
    """The distinct codes of ``codes``, sorted, each checked as a task code."""
    if isinstance(codes, str):  # a lone code would be read as its characters
        codes = [codes]
    return sorted({check_name(code, "task code") for code in codes})


def check_due(due: object, what: str = "due") -> tuple[datetime | None, float | None]:
    """``(absolute UTC due, None)`` for an aware datetime, ``(None, seconds)`` for a timedelta.

    Raises:
        ConfigurationError: a naive datetime or another type; the message says what to pass.
    """
    if isinstance(due, datetime):
        if due.tzinfo is None or due.utcoffset() is None:
            raise ConfigurationError(
                f"{what}={due!r} is a naive datetime: the store cannot tell which time zone it is in. Pass an aware "
                "datetime (datetime(..., tzinfo=timezone.utc), or .astimezone() for local time) or a timedelta from now"
            )
        try:
            inside = MIN_DUE <= due < MAX_DUE
        except OverflowError:
            inside = False
        if not inside:
            raise ConfigurationError(_out_of_range(what, due.isoformat()))
        return due.astimezone(timezone.utc), None
    if isinstance(due, timedelta):
        # By this node's clock: the store's is seconds away at most, the range centuries wide.
        try:
            inside = MIN_DUE <= datetime.now(timezone.utc) + due < MAX_DUE
        except OverflowError:
            inside = False
        if not inside:
            raise ConfigurationError(_out_of_range(what, f"now + {due}"))
        return None, due.total_seconds()
    raise ConfigurationError(
        f"{what}={due!r} is a {type(due).__name__}: pass an aware datetime (absolute) or a timedelta (from the store's clock)"
    )


def _out_of_range(what: str, shown: str) -> str:
    return (
        f"{what}={shown} is outside the due times every store holds ({MIN_DUE:%Y-%m-%d} to {MAX_DUE:%Y-%m-%d} UTC): "
        "give a time in that range (for a task that should never run, cancel it instead)"
    )


def check_time(value: object, what: str) -> datetime:
    """An aware datetime as UTC (a filter such as ``due_before``), else ConfigurationError."""
    if not isinstance(value, datetime):
        raise ConfigurationError(f"{what}={value!r} is a {type(value).__name__}: pass an aware datetime")
    if value.tzinfo is None or value.utcoffset() is None:
        check_due(value, what)  # raises: the message says what to pass
    try:  # a bound beyond the times a store holds reads as the range's own end
        return min(max(value, MIN_DUE), MAX_DUE).astimezone(timezone.utc)
    except OverflowError:
        return MAX_DUE if value.year > MAX_DUE.year else MIN_DUE


def resolve_due(due: datetime | None, delay: float | None, now: datetime) -> datetime:
    """The absolute due: ``due``, or ``now`` (the store's clock) plus ``delay`` seconds."""
    if due is not None:
        return due
    return now + timedelta(seconds=delay or 0.0)


def check_on_conflict(mode: object) -> str:
    if mode not in ON_CONFLICT:
        raise ConfigurationError(f"on_conflict={mode!r} is not one of {', '.join(map(repr, ON_CONFLICT))}")
    return str(mode)


def check_state(state: object) -> str:
    if state not in STATES:
        raise ConfigurationError(f"state={state!r} is not one of {', '.join(map(repr, STATES))}")
    return str(state)


def check_claim(limit: object, lease: object) -> tuple[int, float]:
    """``(limit, lease)`` if ``limit`` is a whole number >= 1 and ``lease`` a positive number of seconds."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ConfigurationError(f"limit={limit!r}: claim at least 1 task (a whole number)")
    return limit, check_lease(lease)


def check_lease(lease: object) -> float:
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not math.isfinite(lease) or lease <= 0:
        raise ConfigurationError(f"lease={lease!r}: give the lease in seconds, a positive number")
    return float(lease)


def check_outcome(outcome: object) -> Outcome:
    """``outcome`` if it is one of Done, Reschedule, Retry, Fail with a valid due; else ConfigurationError."""
    if isinstance(outcome, (Reschedule, Retry)):
        check_due(outcome.due, f"{type(outcome).__name__}.due")
    elif not isinstance(outcome, (Done, Fail)):
        raise ConfigurationError(f"outcome {outcome!r} is not Done(), Reschedule(due), Retry(due, error) or Fail(error)")
    return outcome


def reschedule_payload(outcome: Outcome, code: str, key: str) -> str | None:
    """The new payload of a :class:`Reschedule` as stored JSON text, or None (the task keeps its own).

    Raises:
        AttrsError: a payload that is not plain JSON (before anything is written).
    """
    if not isinstance(outcome, Reschedule) or outcome.payload is KEEP:
        return None
    return dump_payload(outcome.payload, code, key)


def error_text(error: object) -> str:
    """An error as stored: text, at most :data:`MAX_ERROR_LENGTH` characters."""
    text = str(error)
    return text if len(text) <= MAX_ERROR_LENGTH else text[: MAX_ERROR_LENGTH - 3] + "..."


def dump_payload(payload: Any, code: str, key: str) -> str:
    """A payload as stored: JSON text. Only plain JSON is accepted (never pickle, never a silent conversion).

    Raises:
        AttrsError: a value that is not plain JSON, naming where it is and what to pass instead.
    """
    where = f"payload of task {code!r}/{key!r}"
    try:
        _check_json(payload, where, "")
    except RecursionError:
        raise AttrsError(f"{where} is nested too deeply to store as JSON") from None
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a surrogate-escaped file name
        raise AttrsError(f"{where} holds text that is not valid Unicode ({exc.reason}): decode bytes properly first") from None
    return text


def _check_json(value: Any, where: str, path: str) -> None:
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise AttrsError(f"{where}: {value!r} at {path or 'the top'} is not a JSON number; store a finite number or None")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise AttrsError(f"{where}: key {k!r} at {path or 'the top'} is a {type(k).__name__}; JSON keys are strings")
            _check_json(v, where, f"{path}[{k!r}]")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, where, f"{path}[{i}]")
        return
    raise AttrsError(
        f"{where}: {type(value).__name__} at {path or 'the top'} is not JSON; use {_JSON_RULE} "
        "(e.g. an ISO string for a datetime, a list for a tuple)"
    )


def load_payload(text: Any) -> Any:
    """A stored payload (JSON text) back as Python values."""
    if text is None:
        return None
    return json.loads(text)


def decide_add(state: str, due: datetime, pending_due: datetime | None, new_due: datetime, mode: str) -> AddResult:
    """What :meth:`~mutexcron.tasks.base.TaskStore.add` does to an existing task: the one rule every store applies.

    Args:
        state: the task's state.
        due: its due time (a running task's: the running attempt's).
        pending_due: the due of a re-add waiting for the running attempt, or None.
        new_due: the due being added (absolute, by the store's clock).
        mode: ``on_conflict``.

    Returns:
        KEPT (change nothing), REPLACED (queue with the new due and payload) or PENDING (record them
        as pending: the task is running).
    """
    if mode == "keep":
        return AddResult.KEPT
    if state == "running":
        # The running attempt's own due is in the past: compare with what would run next, if anything.
        if pending_due is None or mode == "replace" or _wins(mode, new_due, pending_due):
            return AddResult.PENDING
        return AddResult.KEPT
    if state == "failed" or mode == "replace" or _wins(mode, new_due, due):
        return AddResult.REPLACED  # a failed task has no due to compare with: the add revives it
    return AddResult.KEPT


def _wins(mode: str, new_due: datetime, old_due: datetime) -> bool:
    return new_due < old_due if mode == "earliest" else new_due > old_due


def decode_claimed(
    store: TaskStore,
    node: str,
    rows: Sequence[_Row],
    decode: Callable[[_Row], TaskRecord],
    ident: Callable[[_Row], tuple[str, str, int]],
) -> list[TaskRecord]:
    """The claimed rows as records; a row that cannot be read is failed alone, with its error.

    The claim is already committed: a row that raised here would take its whole batch down with it
    (claimed, never run, never handed back). It is kept as ``failed`` instead (fenced: the claim's
    token), and the healthy ones are returned.
    """
    records: list[TaskRecord] = []
    poison: list[tuple[str, str, int, Outcome]] = []
    for row in rows:
        try:
            records.append(decode(row))
        except Exception as exc:  # noqa: BLE001 - any value a record cannot hold: fail this task, not the batch
            code, key, token = ident(row)
            error = f"the stored task cannot be read ({type(exc).__name__}: {exc}); not run. Add it again or cancel it"
            log.error("task %s/%s on %s: %s", code, key, store.masked_url, error)
            poison.append((code, key, token, Fail(error_text(error))))
    if poison:
        try:
            store.complete_many(node, poison)
        except StoreError as exc:  # it stays claimed until its lease ends, then the next claim fails it
            log.warning("could not record %d unreadable task(s) as failed on %s: %s", len(poison), store.masked_url, exc)
    return records
