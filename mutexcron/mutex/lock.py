"""``Mutex``: a leased, fenced lock for any code (Celery tasks, scripts, web handlers).

A Mutex lock is an ordinary lock record in the same stores the scheduler uses, so
``mutexcron status`` shows it and a cron job guarded by ``@sched.mutex(lock="x")`` and
``mutex.hold("x")`` exclude each other. Each Mutex is its own holder (``hostname:pid:random``);
one daemon thread per Mutex renews all of its held leases in one ``renew_many`` round trip.

The acquire loop is written once, as a generator of steps ("call the store", "sleep"), and run
by two drivers: :meth:`Mutex.hold` runs the steps in the calling thread, :meth:`Mutex.hold_async`
runs store calls in a worker thread and sleeps with ``asyncio.sleep``, so the event loop never
blocks. Renewals never depend on the caller's thread or event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ParamSpec

from ..errors import ConfigurationError, LeaseError, StoreError, StoreUnavailableError
from ..locks import LockStore, Node, default_lock_url, lock_store_from_url
from ..locks.record import LockRecord
from ..names import check_name
from ..node import default_node_id, outbound_ip
from .acquire import (
    Attempt,
    Call,
    LockName,
    Sleep,
    Step,
    Steps,
    backoff,
    busy,
    check_done,
    check_not_lost,
    drive,
    drive_async,
    in_thread,
    is_async_callable,
    positive_seconds,
    refuse_generators,
    wait_seconds,
)
from .held_lease import HeldLease, OnLost, Releaser, Renewer

__all__ = ["HeldLease", "Mutex"]

log = logging.getLogger(__name__)
P = ParamSpec("P")

RELEASE_TRIES = 3
#: Seconds the end of a block waits for its release at most: a store that stops answering must not
#: keep the caller for whole operation timeouts (the release goes on meanwhile, or the lease expires).
RELEASE_DEADLINE = 1.0


@dataclass
class _Process:
    """What belongs to one process; a forked child builds its own (new holder id, connections)."""

    store: LockStore
    node: Node
    renewer: Renewer
    releaser: Releaser
    names: set[str]  # held, or being acquired, by holds of this Mutex in this process
    mutex: threading.Lock
    finalizer: weakref.finalize[Any, Any]


class Mutex:
    """A leased, fenced lock usable from any code.

    Args:
        url: the lock store URL. Default: ``$MUTEXCRON_LOCK_URL``, else ``sqlite:///mutexcron.db``.
        store: a ready LockStore instead of a URL (not closed by :meth:`close`; not rebuilt in a
            forked child, so pass a URL if you fork).
        local_ip: shown as ``active_ip``. Default: this host's outbound IP.
        clock: monotonic clock for deadlines and waits (a seam for tests).
        sleep: how :meth:`hold` sleeps between attempts (a seam for tests; ``hold_async`` always
            uses ``asyncio.sleep``).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        store: LockStore | None = None,
        local_ip: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if url is not None and store is not None:
            raise ConfigurationError("Mutex() takes a lock URL or store=, not both")
        self.url = store.url if store is not None else url or default_lock_url("Mutex()")
        self._given_store = store
        self._clock, self._sleep = clock, sleep
        self._ip = local_ip or outbound_ip()
        self._closed = False
        self._inherited: list[_Process] = []
        self._proc_lock = threading.Lock()
        self._proc: _Process | None = self._new_process()  # a bad URL fails here, not at first use
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"Mutex({self.store.masked_url!r}, node_id={self.node_id!r})"

    @property
    def store(self) -> LockStore:
        return self._state().store

    @property
    def node_id(self) -> str:
        """This Mutex's holder id, ``hostname:pid:random`` (a new one in a forked child)."""
        return self._state().node.node_id

    def close(self) -> None:
        """Stop the renewer and close the store built from the URL. Call it after the blocks end."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            proc.renewer.stop()
            proc.releaser.stop(RELEASE_DEADLINE)  # the releases in flight first
            if self._given_store is None:
                proc.store.close()

    def __enter__(self) -> Mutex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the two forms ---------------------------------------------------------------------------
    @contextmanager
    def hold(
        self,
        name: str,
        lease: float | timedelta = 60.0,
        wait: float | timedelta | None = False,
        *,
        strict: bool = False,
        on_lost: OnLost | None = None,
    ) -> Iterator[HeldLease]:
        """Hold the lock ``name`` for the ``with`` block, renewed in the background.

        Args:
            name: the lock name (at most 191 characters, no control characters).
            lease: seconds (or timedelta) a holder that stops renewing keeps others out.
            wait: ``False`` tries once; seconds retries until then; ``None`` waits forever.
            strict: raise LeaseError at the end of a block whose lease was lost (default: a WARNING).
            on_lost: called once, on a thread of its own, with the lease when it is lost.

        Yields:
            A truthy :class:`HeldLease` if acquired, else a falsy one whose ``record`` shows the holder.

        Raises:
            ConfigurationError: a bad name, lease or wait.
            StoreUnavailableError: the store could not be reached on the last attempt.
        """
        held = drive(self._acquire(*self._check(name, lease, wait), on_lost), self._step)
        if not held:
            yield held
            return
        completed = False
        try:
            yield held
            completed = True
        finally:
            self._finish(held)
            self._report_exit(held, strict and completed)

    @asynccontextmanager
    async def hold_async(
        self,
        name: str,
        lease: float | timedelta = 60.0,
        wait: float | timedelta | None = False,
        *,
        strict: bool = False,
        on_lost: OnLost | None = None,
    ) -> AsyncIterator[HeldLease]:
        """:meth:`hold` for ``async with``: same arguments and semantics; the event loop never blocks.

        Store calls run in the loop's default executor, waits are ``asyncio.sleep``, and renewals
        stay on the renewer thread, so a coroutine that blocks the loop keeps its lease.
        """
        held = await drive_async(self._acquire(*self._check(name, lease, wait), on_lost), self._step_async)
        if not held:
            yield held
            return
        completed = False
        try:
            yield held
            completed = True
        finally:
            await in_thread(functools.partial(self._finish, held))
            self._report_exit(held, strict and completed)

    def exclusive(
        self,
        name: str,
        lease: float | timedelta = 60.0,
        wait: float | timedelta | None = False,
        *,
        strict: bool = False,
        on_lost: OnLost | None = None,
        lock_else: Callable[[LockRecord], Any] | None = None,
    ) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
        """Decorate a function (or coroutine function) to run under :meth:`hold`.

        Args:
            name: a lock name template filled from the call's arguments, e.g. ``"import:{url}"``
                (``{feed.id}`` and format specs work too).
            lease: lease length in seconds, as in :meth:`hold`.
            wait: how long to wait for the lock, as in :meth:`hold`.
            strict: raise LeaseError at exit if the lease was lost, as in :meth:`hold`.
            on_lost: called once if the lease is lost, as in :meth:`hold`.
            lock_else: called with the holder's LockRecord when the lock is not acquired; its
                return value is returned. Default: log at INFO and return None.

        Returns:
            The decorator.

        Raises:
            ConfigurationError: at decoration, a template field that is not an argument of the
                function, or a bad lease/wait; at call time, a field the call gives no value for.
        """
        lease_s, wait_s = positive_seconds(lease, "lease"), wait_seconds(wait)

        def decorate(func: Callable[P, Any]) -> Callable[P, Any]:
            refuse_generators(func)
            lock_name = LockName(name, func)
            options: dict[str, Any] = {"lease": lease_s, "wait": wait_s, "strict": strict, "on_lost": on_lost}
            if is_async_callable(func):

                @functools.wraps(func)
                async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                    async with self.hold_async(lock_name(args, kwargs), **options) as held:
                        if not held:
                            return busy(func, held, lock_else)
                        check_not_lost(func, held)
                        return await func(*args, **kwargs)

                return run_async

            @functools.wraps(func)
            def run(*args: P.args, **kwargs: P.kwargs) -> Any:
                with self.hold(lock_name(args, kwargs), **options) as held:
                    if not held:
                        return busy(func, held, lock_else)
                    check_not_lost(func, held)
                    return check_done(func, func(*args, **kwargs))

            return run

        return decorate

    # -- acquiring -------------------------------------------------------------------------------
    def _check(self, name: str, lease: float | timedelta, wait: float | timedelta | None) -> tuple[str, float, float | None]:
        if self._closed:
            raise LeaseError("this Mutex is closed")
        return check_name(name, "lock name"), positive_seconds(lease, "lease"), wait_seconds(wait)

    def _acquire(self, name: str, lease: float, wait: float | None, on_lost: OnLost | None) -> Steps:
        """The acquire loop: one store call per step, then a bounded, jittered backoff."""
        deadline = None if wait is None else self._clock() + wait
        outage: StoreUnavailableError | None = None
        step = 0
        while True:
            attempt: Attempt | None = None
            try:
                attempt = yield Call(functools.partial(self._try_once, name, lease, on_lost), self._undo)
                outage = None
            except StoreUnavailableError as exc:
                if outage is None:
                    log.warning("lock %r: the lock store is unreachable; retrying while the wait lasts (%s)", name, exc)
                outage = exc
            if attempt is not None and attempt.held is not None:
                return attempt.held
            step += 1
            left = None if deadline is None else deadline - self._clock()
            if left is not None and left <= 0:
                return (yield from self._give_up(name, lease, attempt, outage))
            delay = backoff(step, attempt)
            yield Sleep(delay if left is None else min(delay, left))

    def _try_once(self, name: str, lease: float, on_lost: OnLost | None) -> Attempt:
        """Reserve ``name`` in this process, then one acquire_or_renew; keep the reservation if acquired.

        Holds of one Mutex share its holder id, and the store would let the same holder in twice
        (it reads as a renewal): the reservation keeps a second hold of this Mutex out. An acquired
        lease goes to the renewer here, in the thread that made the store call: an async caller's
        event loop may not resume for a while, and its lease must be renewed meanwhile.
        """
        proc = self._state()
        with proc.mutex:
            if name in proc.names:
                return Attempt(None)
            proc.names.add(name)
        try:
            sent_at = self._clock()  # before the request: the lease is counted from here
            result = proc.store.acquire_or_renew(name, proc.node, lease)
        except BaseException:
            _forget(proc, name)
            raise
        if not result.acquired:  # refused or uncertain: not ours, try again later
            _forget(proc, name)
            return Attempt(result, sent_at)
        held = HeldLease(
            name, proc.node.node_id, lease, result.record,
            acquired=True, clock=self._clock, sent_at=sent_at, on_lost=on_lost,
        )  # fmt: skip
        try:
            proc.renewer.add(held)
        except LeaseError:  # closed meanwhile
            self._finish(held)
            raise
        return Attempt(result, sent_at, held)

    def _undo(self, attempt: Any) -> None:
        """Release a lock acquired for an async caller that was cancelled before it got it."""
        if isinstance(attempt, Attempt) and attempt.held is not None:
            self._finish(attempt.held)

    def _give_up(self, name: str, lease: float, attempt: Attempt | None, outage: StoreError | None) -> Steps:
        if outage is not None:
            raise StoreUnavailableError(f"could not acquire lock {name!r}: the lock store is unreachable ({outage})")
        assert attempt is not None
        record = attempt.result.record if attempt.result is not None else None
        if record is None:  # another hold of this Mutex has it: show what the store says
            record = (yield Call(functools.partial(self._state().store.read, name))) or LockRecord(name, holder=self.node_id)
        return HeldLease(name, self.node_id, lease, record, acquired=False, clock=self._clock)

    def _step(self, step: Step) -> Any:
        if isinstance(step, Sleep):
            self._sleep(step.seconds)
            return None
        return step.fn()

    async def _step_async(self, step: Step) -> Any:
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            return None
        return await in_thread(step.fn, step.undo)

    # -- releasing -------------------------------------------------------------------------------
    def _finish(self, held: HeldLease) -> None:
        """Stop renewing, release on holder and token (never someone else's lock), forget the name.

        A lease the store showed taken by another holder is not released (the store would refuse).
        The release waits at most :data:`RELEASE_DEADLINE`; the name is forgotten once it is over.
        """
        proc = self._state()
        proc.renewer.remove(held)
        held._close()
        if held.node_id != proc.node.node_id:  # a block begun before this process was forked
            held.released = False
            return
        if held._superseded:  # the store showed another holder: the release could only be refused
            held.released = False
            _forget(proc, held.name)
            return
        work = functools.partial(self._release, held.name, held.record.token, proc)
        released = proc.releaser.release(work, functools.partial(_forget, proc, held.name), RELEASE_DEADLINE)
        if released is None:
            log.warning(
                "lock %r (token %d): the store did not answer the release within %gs; "
                "it is released when the store answers, or expires after its lease",
                held.name, held.record.token, RELEASE_DEADLINE,
            )  # fmt: skip
        held.released = bool(released)

    def _release(self, name: str, token: int, proc: _Process) -> bool:
        error: StoreError | None = None
        for attempt in range(RELEASE_TRIES):
            try:
                return proc.store.release(name, proc.node, token)
            except StoreUnavailableError as exc:  # a blip: a few quick retries, then let it expire
                error = exc
                if attempt + 1 < RELEASE_TRIES:
                    self._sleep(0.05 * 2**attempt)
            except StoreError as exc:
                error = exc
                break
        log.warning("could not release lock %r (token %d): %s; it expires after its lease", name, token, error)
        return False

    def _report_exit(self, held: HeldLease, strict: bool) -> None:
        reason = held.lost_reason
        if reason is None:
            return
        message = (
            f"lock {held.name!r} (token {held.record.token}) was lost during the block ({reason}): "
            "another holder may have run at the same time"
        )
        if strict:
            raise LeaseError(message)
        log.warning(message)

    # -- per process -----------------------------------------------------------------------------
    def _new_process(self) -> _Process:
        store = self._given_store or lock_store_from_url(self.url)
        node = Node(default_node_id(), self._ip)
        renewer, releaser = Renewer(store, node, self._clock), Releaser()
        finalizer = weakref.finalize(self, _stop_threads, renewer, releaser)  # a Mutex dropped without close()
        return _Process(store, node, renewer, releaser, set(), threading.Lock(), finalizer)

    def _state(self) -> _Process:
        proc = self._proc
        if proc is None:
            with self._proc_lock:
                if self._proc is None:
                    self._proc = self._new_process()
                proc = self._proc
        return proc

    def _forked(self) -> None:
        """In a forked child (Celery's prefork workers): a new holder id, renewer and connections.

        A child sharing its parent's holder id would be let in as "the holder renewing". The
        parent's store object is kept but never used or closed: closing it could end the parent's
        connections, which the child shares. The parent's renewer and its holds are left behind:
        their threads are not in the child, and a block the child inherited does not hold the lock.
        """
        if self._proc is not None:
            self._proc.finalizer.detach()  # stopping the parent's renewer here could wait on a lock held at the fork
            self._proc.renewer._forked()
            self._inherited.append(self._proc)
        self._proc, self._proc_lock = None, threading.Lock()


# -- helpers ---------------------------------------------------------------------------------------
def _stop_threads(renewer: Renewer, releaser: Releaser) -> None:
    renewer.stop(0)
    releaser.stop()


def _forget(proc: _Process, name: str) -> None:
    with proc.mutex:
        proc.names.discard(name)


_LIVE: weakref.WeakSet[Mutex] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mutex in list(_LIVE):
        mutex._forked()


if hasattr(os, "register_at_fork"):  # POSIX: Celery's prefork pool, multiprocessing's fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
