"""Retention of finished tasks: the purge of old tombstones, by hand and by the running cluster.

A finished or cancelled task leaves a *tombstone* on the SQL and MongoDB stores (its token, so
tokens only go up). :func:`purge` removes those older than a retention, in batches of at most
:data:`~mutexcron.tasks.base.PURGE_BATCH` (one short statement each), under the store-wide token
floor (:meth:`~mutexcron.tasks.base.TaskStore.purge_batch`). :class:`Pruner` is what a running
node does with it: one prune at a time across the cluster, under a lock of its own.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

from ..errors import ConfigurationError, MutexcronError
from ..names import INTERNAL_LOCK_PREFIX
from .base import TaskStore

__all__ = [
    "DEFAULT_RETENTION",
    "PRUNE_LEASE",
    "PRUNE_LOCK",
    "RETENTION_ENV",
    "PruneLease",
    "Pruner",
    "check_retention",
    "format_age",
    "parse_age",
    "purge",
    "retention_from_env",
]

log = logging.getLogger(__name__)

#: How long finished tasks are kept when nothing else is said.
DEFAULT_RETENTION = timedelta(days=7)
#: The environment variable that sets the retention (``mutexcron run --task-retention``).
RETENTION_ENV = "MUTEXCRON_TASK_RETENTION"
#: The lock under which one node of the cluster prunes at a time.
PRUNE_LOCK = INTERNAL_LOCK_PREFIX + "prune-tasks"
#: Seconds of the prune lock's lease, and the least a lease must have left for one more batch to start
#: (a batch is one statement, bounded by the store's operation timeout).
PRUNE_LEASE = 30.0
PRUNE_MARGIN = 12.0
#: Floor settles one :func:`purge` waits out before it stops: the one its first raise needs, and one more.
_SETTLES = 2


_AGE = re.compile(r"(?:(?P<w>\d+(?:\.\d+)?)w)?(?:(?P<d>\d+(?:\.\d+)?)d)?(?:(?P<h>\d+(?:\.\d+)?)h)?"
                  r"(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s?)?", re.IGNORECASE)  # fmt: skip
_UNITS = {"w": "weeks", "d": "days", "h": "hours", "m": "minutes", "s": "seconds"}


def parse_age(text: str) -> timedelta:
    """An age as people write it: ``7d``, ``12h``, ``2h30m``, ``90s``, ``1w``, or seconds (``90``, ``0``).

    Raises:
        ValueError: anything else; the message says what to write.
    """
    match = _AGE.fullmatch(text.strip())
    if match is None or not any(match.groupdict().values()):
        raise ValueError(f"{text!r} is not an age: write 7d, 12h, 2h30m, 90s or 1w (units w, d, h, m, s), or 0")
    try:
        return timedelta(**{_UNITS[unit]: float(amount) for unit, amount in match.groupdict().items() if amount})
    except OverflowError as exc:
        raise ValueError(f"{text!r} is too long") from exc


def format_age(age: timedelta) -> str:
    """An age the way :func:`parse_age` reads it: ``7d``, ``12h``, ``90s``."""
    seconds = age.total_seconds()
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def check_retention(value: object, what: str = "task_retention") -> timedelta | None:
    """A retention as a timedelta, or None to keep everything (``0``, ``None``, ``timedelta(0)``).

    Raises:
        ConfigurationError: not a timedelta or a number of seconds, or negative; the message says what to pass.
    """
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise ConfigurationError(f"{what}={value!r}: pass a timedelta (timedelta(days=7)), seconds, or 0 to keep everything")
    span = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
    if span < timedelta(0):
        raise ConfigurationError(f"{what}={value!r} is negative: pass a timedelta of 0 or more (0 keeps everything)")
    return span or None


def retention_from_env(default: timedelta | None) -> timedelta | None:
    """``$MUTEXCRON_TASK_RETENTION`` if set (``7d``, ``90s``, ``0``), else ``default``.

    Raises:
        ConfigurationError: a value :func:`parse_age` refuses.
    """
    text = os.environ.get(RETENTION_ENV)
    if not text:
        return default
    try:
        return check_retention(parse_age(text), RETENTION_ENV)
    except ValueError as exc:
        raise ConfigurationError(f"{RETENTION_ENV}: {exc}") from None


def purge(
    store: TaskStore,
    older_than: timedelta,
    *,
    code: str | None = None,
    on_batch: Callable[[int], None] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
) -> int:
    """Remove the tombstones that finished more than ``older_than`` ago by the store's clock (of
    ``code`` only, if given), batch after batch; ``on_batch`` gets each batch's count.

    Where the token floor must settle first (:attr:`TaskStore.floor_settle`), waits for it at most
    twice, so a purge ends even while tasks keep finishing. Returns how many were removed.

    Raises:
        ConfigurationError: a negative ``older_than``.
    """
    if not isinstance(older_than, timedelta) or older_than < timedelta(0):
        raise ConfigurationError(f"older_than={older_than!r}: pass a timedelta of 0 or more (timedelta(days=7))")
    removed, settles = 0, 0
    while True:
        batch = store.purge_batch(older_than.total_seconds(), code=code)
        removed += batch.removed
        if on_batch is not None and batch.removed:
            on_batch(batch.removed)
        if batch.ready_in is None:
            return removed
        if batch.ready_in > 0:
            settles += 1
            if settles > _SETTLES:
                return removed
            sleep(batch.ready_in)


class PruneLease(Protocol):
    """What :class:`Pruner` needs of the prune lock's lease (a :class:`~mutexcron.mutex.HeldLease`)."""

    def __bool__(self) -> bool: ...

    @property
    def lost(self) -> bool: ...

    @property
    def remaining(self) -> float: ...


class Pruner:
    """A node's pruning thread. It tries the prune lock (``hold``: a context manager around a lease
    of its own, :data:`PRUNE_LOCK`, renewed in the background, yielding a falsy lease while another
    node holds it) every ``interval`` seconds; the node that holds it is the cluster's pruner until
    it stops or loses the lease. Every ``interval`` it purges the tombstones older than
    ``retention``, batch by batch, each batch started only while the lease has more than
    :data:`PRUNE_MARGIN` seconds left by this node's monotonic clock. Store errors are logged once
    per change and never end the loop.
    """

    def __init__(
        self,
        store: TaskStore,
        retention: timedelta,
        hold: Callable[[], AbstractContextManager[PruneLease, Any]],
        *,
        interval: float | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.retention = retention
        #: Seconds between two passes: a tenth of the retention, within 1 s and a minute.
        self.interval = interval if interval is not None else min(60.0, max(1.0, retention.total_seconds() / 10))
        self._hold = hold
        self._on_stop = on_stop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        #: Tombstones this node removed since it started.
        self.removed = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mutexcron-task-pruner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the batch in flight (one short statement) and give the prune lock back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._try_lock()
                self._stop.wait(self.interval)
        finally:
            if self._on_stop is not None:
                self._on_stop()

    def _try_lock(self) -> None:
        """Take the prune lock once; holding it, prune every ``interval`` until stopped or the lease is lost."""
        try:
            with self._hold() as lease:
                if not lease:
                    return  # another node prunes
                age, where = format_age(self.retention), self.store.masked_url
                log.info("this node prunes finished tasks older than %s from %s", age, where)
                while not self._stop.is_set() and not lease.lost:
                    self._stop.wait(self._pass(lease))
                if lease.lost:
                    log.warning("this node stopped pruning finished tasks: its prune lock was lost")
        except MutexcronError as exc:  # the lock store: tried again next interval
            self._report(exc)

    def _pass(self, lease: PruneLease) -> float:
        """One pass, its errors logged once per change; the seconds until the next."""
        try:
            wait = self.prune_once(lease)
        except MutexcronError as exc:
            self._report(exc)
            return self.interval
        if self._failing:
            log.info("pruning finished tasks on %s works again", self.store.masked_url)
            self._failing = False
        return wait

    def _report(self, exc: MutexcronError) -> None:
        if not self._failing:
            where, every = self.store.masked_url, self.interval
            log.warning("pruning finished tasks on %s failed (tried again every %.0f s): %s", where, every, exc)
            self._failing = True

    def prune_once(self, lease: PruneLease) -> float:
        """Purge batch by batch while ``lease`` has time left; the seconds until the next pass."""
        older_than = self.retention.total_seconds()
        while not self._stop.is_set() and not lease.lost and lease.remaining > PRUNE_MARGIN:
            batch = self.store.purge_batch(older_than)
            self.removed += batch.removed
            if batch.ready_in is None:
                break
            if batch.ready_in > 0:
                return min(self.interval, batch.ready_in)
        return self.interval
