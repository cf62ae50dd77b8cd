"""The parts of :class:`~mutexcron.mutex.lock.Mutex` that are not the Mutex itself.

* (:class:`HeldLease` and its :class:`Renewer` live in :mod:`mutexcron.mutex.held_lease`);
* the acquire loop's steps and the two drivers that run them (in the calling thread, or with
  store calls in a worker thread for asyncio);
* argument checks, lock name templates, and what ``exclusive`` accepts and checks around a call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
import re
import string
import threading
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, Union

from ..errors import ConfigurationError, LeaseError, StoreError
from ..locks import AcquireResult
from ..locks.record import LockRecord
from ..names import check_name
from .held_lease import HeldLease

log = logging.getLogger(__name__)

T = TypeVar("T")


FIRST_BACKOFF = 0.01  # s: the first retry; then doubling, with jitter, up to MAX_BACKOFF
MAX_BACKOFF = 1.0
MIN_STEP = 0.005  # s: no retry sooner than this, even when the holder's lease ends sooner


@dataclass(frozen=True)
class Attempt:
    """One acquire attempt: the store's answer (None: another hold of this Mutex has the name),
    and the lease, already handed to the renewer, if acquired."""

    result: AcquireResult | None
    sent_at: float = 0.0
    held: HeldLease | None = None


@dataclass(frozen=True)
class Call:
    """Run ``fn`` (store work); if an async caller is cancelled meanwhile, ``undo(result)`` later."""

    fn: Callable[[], Any]
    undo: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class Sleep:
    seconds: float


Step = Union[Call, Sleep]
Steps = Generator[Step, Any, HeldLease]


def drive(steps: Steps, run: Callable[[Step], Any]) -> HeldLease:
    """Run the acquire steps; store errors go back into the loop, which decides."""
    reply: Any = None
    error: StoreError | None = None
    try:
        while True:
            try:
                step = steps.throw(error) if error is not None else steps.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply, error = None, None
            try:
                reply = run(step)
            except StoreError as exc:
                error = exc
    finally:
        steps.close()


async def drive_async(steps: Steps, run: Callable[[Step], Awaitable[Any]]) -> HeldLease:
    """:func:`drive` with awaited steps."""
    reply: Any = None
    error: StoreError | None = None
    try:
        while True:
            try:
                step = steps.throw(error) if error is not None else steps.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply, error = None, None
            try:
                reply = await run(step)
            except StoreError as exc:
                error = exc
    finally:
        steps.close()


async def in_thread(fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
    """Run ``fn`` in the loop's executor. If the caller is cancelled, ``fn`` still finishes
    (shielded), and ``undo`` gets its result: a lock acquired for nobody is released at once.

    The undo runs in the executor thread that ran ``fn``, before that thread is done, so
    ``asyncio.run`` (which waits for the default executor) returns after the release, not before.
    """
    call = _Abandonable(fn, undo)
    future = asyncio.get_running_loop().run_in_executor(None, call.run)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        delivered = call.abandon()
        if delivered is not _NOTHING and undo is not None:  # done, but its caller was cancelled
            asyncio.get_running_loop().run_in_executor(None, undo, delivered)
        raise


_NOTHING: Any = object()


class _Abandonable:
    """``fn`` for an executor thread, undone there if its caller gave up before it returned."""

    def __init__(self, fn: Callable[[], Any], undo: Callable[[Any], None] | None) -> None:
        self._fn, self._undo = fn, undo
        self._lock = threading.Lock()
        self._abandoned = False
        self._result: Any = _NOTHING

    def run(self) -> Any:
        result = self._fn()
        with self._lock:
            abandoned = self._abandoned
            if not abandoned:
                self._result = result
        if abandoned and self._undo is not None:
            self._undo(result)
        return result

    def abandon(self) -> Any:
        """Mark the caller gone; return ``fn``'s result if it had already returned (else nothing)."""
        with self._lock:
            self._abandoned = True
            return self._result


def backoff(step: int, attempt: Attempt | None) -> float:
    """Exponential backoff with equal jitter, capped by when the holder's lease would end.

    The holder's lease ends ``ttl - heartbeat_age`` seconds after the store answered, by the
    store's clock, unless it renews: a dead holder's lock is free then, so never sleep past it.
    """
    ceiling = min(MAX_BACKOFF, FIRST_BACKOFF * 2.0 ** min(step - 1, 30))
    delay = ceiling / 2 + random.random() * ceiling / 2  # spreads waiters that started together
    result = attempt.result if attempt is not None else None
    if result is not None and not result.uncertain and result.record.holder and result.record.heartbeat_age is not None:
        delay = min(delay, max(0.0, result.record.ttl - result.record.heartbeat_age) + MIN_STEP)
    return max(MIN_STEP, delay)


# -- arguments and lock name templates -------------------------------------------------------------
def positive_seconds(value: object, what: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{what} must be a positive number of seconds or a timedelta, not {value!r}")
    return float(seconds)


def wait_seconds(value: object) -> float | None:
    if value is None:
        return None
    if value is True:
        raise ConfigurationError("wait=True is ambiguous: use wait=None to wait forever, or a number of seconds")
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if seconds is False or (isinstance(seconds, (int, float)) and seconds == 0):
        return 0.0  # try once
    return positive_seconds(value, "wait")


def busy(func: Callable[..., Any], held: HeldLease, lock_else: Callable[[LockRecord], Any] | None) -> Any:
    if lock_else is not None:
        return lock_else(held.record)
    log.info("%s not run: lock %r is held by %s", getattr(func, "__qualname__", func), held.name, held.record.holder)
    return None


def _call_method(func: Callable[..., Any]) -> Any:
    return getattr(func, "__call__", None)  # noqa: B004 - the method itself, not whether func is callable


def is_async_callable(func: Callable[..., Any]) -> bool:
    """``async def`` functions, and objects (or partials) whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(_call_method(func))


def refuse_generators(func: Callable[..., Any]) -> None:
    """``exclusive`` cannot guard a generator: its body runs while the caller iterates, after the call returned."""
    if any(inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f) for f in (func, _call_method(func))):
        raise ConfigurationError(
            f"exclusive() cannot guard {getattr(func, '__qualname__', func)!r}: it is a generator, whose body runs "
            "while the caller iterates, after the call has returned and the lock is released; hold the lock "
            "inside it instead (with mutex.hold(...) / async with mutex.hold_async(...))"
        )


def check_not_lost(func: Callable[..., Any], held: HeldLease) -> None:
    """Never start the function with a lease that is already lost (a pause right after the acquire)."""
    reason = held.lost_reason
    if reason is not None:
        raise LeaseError(
            f"{getattr(func, '__qualname__', func)} not run: the lease of lock {held.name!r} "
            f"(token {held.record.token}) was lost before it started ({reason})"
        )


def check_done(func: Callable[..., Any], result: Any) -> Any:
    """A plain function that handed back a coroutine, a generator or another awaitable did not do its work yet."""
    if inspect.isawaitable(result) or inspect.isgenerator(result) or inspect.isasyncgen(result):
        if inspect.iscoroutine(result):
            result.close()  # never run: no "never awaited" warning on top of this error
        raise ConfigurationError(
            f"exclusive(): {getattr(func, '__qualname__', func)}() returned {type(result).__name__}, whose work "
            "would run after the lock is released; make it an async def, or hold the lock where the work is done"
        )
    return result


class LockName:
    """A lock name template such as ``"import-feed:{url}"``, checked against a function's arguments."""

    def __init__(self, template: str, func: Callable[..., Any]) -> None:
        if not isinstance(template, str):
            raise ConfigurationError(f"the lock name must be a string template, not {template!r}")
        self.template, self.func = template, getattr(func, "__qualname__", repr(func))
        self.signature = inspect.signature(func)
        params = self.signature.parameters
        self.var_kwargs = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
        self.fields = template_fields(template)
        for field in self.fields:
            if field not in params and self.var_kwargs is None:
                raise ConfigurationError(
                    f"lock name {template!r} uses {{{field}}}, but {self.func}() has no argument {field!r} "
                    f"(its arguments: {', '.join(params) or 'none'})"
                )
        if not self.fields:
            check_name(template, "lock name")

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        bound = self.signature.bind_partial(*args, **kwargs)  # a TypeError, as the call itself would raise
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.update(values.pop(self.var_kwargs, {}) if self.var_kwargs else {})
        for field in self.fields:
            if field not in values:
                raise ConfigurationError(
                    f"lock name {self.template!r}: this call to {self.func}() gives no value for {{{field}}}"
                )
        try:
            name = self.template.format_map(values)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(f"lock name {self.template!r}: cannot fill it from this call ({exc!r})") from None
        return check_name(name, f"lock name (from {self.template!r})")


def template_fields(template: str) -> list[str]:
    """The argument names a template's ``{fields}`` start with (``{feed.id}`` -> ``feed``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigurationError(f"bad lock name template {template!r}: {exc}") from None
    fields: list[str] = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not root.isidentifier():
            raise ConfigurationError(f"lock name {template!r}: name each field after an argument, e.g. {{url}}, not {{{field}}}")
        if root not in fields:
            fields.append(root)
    return fields
