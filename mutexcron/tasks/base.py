"""The task store interface every backend implements: durable one-off tasks the cluster shares.

A task is ``(code, key)``, unique: ``code`` names what to do (a handler), ``key`` the business
object ("end_promotion", "sku-123"). Rules every implementation follows (the contract suite in
``tests/test_task_store.py`` checks them):

* Each method is **one atomic operation** in the store: a conditional statement, or one short
  transaction that locks the rows it decides on. No decision is taken on a row another writer can
  change before the write lands. A read that only builds the returned records may follow a write.
* Due times, claims and leases are judged by **the store's clock**, never the node's: a
  ``timedelta`` due is added to the store's clock when the task is written; a task is due when
  ``due <= store now``; a lease ends at ``store now + lease``.
* States: ``queued`` (waiting for its due time, or for a retry's time), ``running`` (claimed by
  ``owner`` until ``lease_until``), ``failed`` (out of attempts: kept with its last error until
  retried or cancelled). A finished task is deleted; nothing else deletes a task but
  :meth:`TaskStore.cancel`.
* Occurrences and claim times: ``due`` is when the occurrence is due, and it names it
  (:attr:`TaskRecord.idempotency_key` is ``code:key:due``). Only a new occurrence sets a new
  ``due``: an add that queues the task, a :class:`Reschedule`, a pending re-add applied. Every
  attempt of one occurrence keeps it: a :class:`Retry` sets only ``run_at`` (when a claim may
  take the task) to the retry's time, :meth:`TaskStore.retry` (a failed task queued again) and
  :meth:`TaskStore.release` (a hand-back) make it claimable now. ``run_at`` is the due of a
  freshly queued task, a retry's time, the lease's end of a running task, and None for a failed
  one.
* Claims: a task is claimable when ``run_at <= store now``: queued and due (or its retry's time
  has come), or running with an expired lease (its worker died: no separate rescuer, the same
  claim takes it). A claim sets ``running``, the owner, ``token + 1``, ``attempt + 1``,
  ``lease_until`` and ``run_at`` (the lease's end).
* Attempts count handlers that started: a worker marks each claim whose handler starts
  (:meth:`TaskStore.start`, batched). A claim that rescues a running task whose claim never
  started keeps its attempt number (decided in the claim's own operation), so claims lost with a
  node that never ran them cost no attempt; a started one counts (kept across a rescue, so a task
  that kills its worker still reaches its handler's ``max_attempts``).
* Tokens only go up, across every occurrence of a ``(code, key)``: a task added again after it
  finished or was cancelled starts from the highest token its earlier occurrences reached (the SQL
  and MongoDB stores keep a *tombstone*, the row in state ``done`` holding only its token; Redis
  and memory keep one store-wide floor, raised by every delete), so a stale attempt of an earlier
  occurrence can never pass the fence of a later one. ``occurrence`` records the token at which
  an occurrence began.
* Tombstones are purged (:meth:`TaskStore.purge_batch`) under a **store-wide token floor**: a new
  row (no tombstone) starts from the floor, read in the same statement that inserts it. The purge
  first raises the floor to the highest token of the tombstones it will delete, and deletes only
  tombstones whose token is at most a floor that has held for :attr:`TaskStore.floor_settle`
  seconds of the store's clock (longer than any add's statement may live), so no add can still be
  holding an older floor: a task purged and added again gets a token above every token it ever had.
  Only tombstones go; a queued, running or failed task is never purged.
* Due times are within :data:`~mutexcron.tasks.checks.MIN_DUE` and
  :data:`~mutexcron.tasks.checks.MAX_DUE` (every store holds them); others are refused.
* Fencing: :meth:`TaskStore.renew`, :meth:`TaskStore.complete` and :meth:`TaskStore.release`
  change a task only while it is running, owned by the caller, with the caller's token. A worker
  whose lease expired and whose task another worker claimed (token + 1) gets False: its write never
  overwrites the new attempt.
* Re-adding a running task never starts a second run: the new due and payload are kept as
  *pending* and applied when the running attempt ends, whatever its outcome (the task is queued
  with them, attempts reset). Cancelling a running task lets the run finish, then drops it. The
  later word wins: an add after a cancel clears the cancel, a cancel after an add drops the
  pending values.
* A rescued task that was cancelled while its worker died is dropped by the claim, never run.
* Bad input (a naive datetime, an unknown ``on_conflict``, a payload that is not plain JSON, an
  empty or too long code or key) raises before anything reaches the store.
* Contention that outlasts the store's lock wait, or a write whose outcome is unknown, raises
  :class:`~mutexcron.errors.StoreUnavailableError`, as does a store that cannot be reached.
"""

from __future__ import annotations

import builtins
import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Union

from ..errors import ConfigurationError
from ..urls import mask_url
from .wakeups.base import DEFAULT_POLL, PollWaker, Waker

__all__ = [
    "KEEP",
    "ON_CONFLICT",
    "PURGE_BATCH",
    "STATES",
    "AddResult",
    "CodeSummary",
    "Done",
    "Due",
    "Fail",
    "Outcome",
    "PurgeBatch",
    "Reschedule",
    "Retry",
    "TaskRecord",
    "TaskStore",
]

#: Task states.
STATES = ("queued", "running", "failed")
#: What :meth:`TaskStore.add` does when the task exists (see :meth:`TaskStore.add`).
ON_CONFLICT = ("replace", "keep", "earliest", "latest")
#: The most tombstones one purge statement deletes: a short statement that holds no long lock.
PURGE_BATCH = 1000
#: An absolute due time (aware datetime) or one relative to the store's clock.
Due = Union[datetime, timedelta]


class NewTask(NamedTuple):
    """One task of :meth:`TaskStore.add_many`: the arguments of :meth:`TaskStore.add`. A plain
    tuple ``(code, key, due)`` or ``(code, key, due, payload)`` works as well."""

    code: str
    key: str
    due: Due
    payload: Any = None


class AddResult(str, enum.Enum):
    """What :meth:`TaskStore.add` did. A ``str``: ``result == "inserted"`` works."""

    #: The task did not exist: it is queued.
    INSERTED = "inserted"
    #: The task existed (queued or failed): it is queued with the new due and payload, attempts reset.
    REPLACED = "replaced"
    #: The task existed and ``on_conflict`` kept it as it was.
    KEPT = "kept"
    #: The task is running: the new due and payload apply when the running attempt ends.
    PENDING = "pending"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TaskRecord:
    """One task, as the store saw it. Times are aware UTC datetimes, by the store's clock.

    Attributes:
        code: what to do (the handler's code).
        key: the business object (unique per code).
        due: when this occurrence of the task is due. Every attempt of the occurrence keeps it (a
            :class:`Retry` waits in ``run_at``); an add, a :class:`Reschedule` or an applied
            pending re-add starts a new occurrence with a new due.
        payload: the task's JSON data.
        state: ``queued``, ``running`` or ``failed``.
        attempt: how many times it was claimed since it was last added, rescheduled or retried by hand.
        token: fencing token; goes up by one on every claim and every hand-back, never down.
        owner: the node running it, or the last node that did.
        lease_until: when a running task's lease ends (None unless running).
        run_at: when a claim may take the task: its due, a retry's time, or a running task's
            lease end; None when failed (never claimed). A retried or handed-back task is
            claimable at once (``run_at`` is the store's time of the retry or hand-back).
        last_error: the last failed attempt's error.
        pending_due / pending_payload: a re-add while running, applied when the attempt ends.
        cancel_requested: cancelled while running: dropped when the attempt ends.
        created / updated: when the task was first added and last changed.
        occurrence: the token when this occurrence began (see :attr:`idempotency_key`); None for a
            task last queued by an earlier mutexcron.
    """

    code: str
    key: str
    due: datetime
    payload: Any = None
    state: str = "queued"
    attempt: int = 0
    token: int = 0
    owner: str | None = None
    lease_until: datetime | None = None
    run_at: datetime | None = None
    last_error: str | None = None
    pending_due: datetime | None = None
    pending_payload: Any = None
    cancel_requested: bool = False
    created: datetime | None = None
    updated: datetime | None = None
    occurrence: int | None = None

    @property
    def idempotency_key(self) -> str:
        """``code:key:due#occurrence``: the same for every attempt of one occurrence (a
        :class:`Retry`, a rescue after a dead worker, a hand-back, a retry by hand), and different
        for every occurrence that ran: a rescheduled one, or one added again, even with the same due.

        ``occurrence`` is the task's token when the occurrence began; tokens only go up across
        occurrences, so no two occurrences that reached a handler share it. A handler's own writes
        keyed on it (a unique constraint, an upsert) happen once even if the task runs twice
        (at-least-once delivery: a worker stalled past its lease). A task last queued by an
        earlier mutexcron has no occurrence yet: its key is ``code:key:due`` until it is queued again.
        """
        base = f"{self.code}:{self.key}:{self.due.isoformat()}"
        return base if self.occurrence is None else f"{base}#{self.occurrence}"

    @property
    def pending(self) -> bool:
        """True if a re-add while running waits for the running attempt to end."""
        return self.pending_due is not None


@dataclass(frozen=True)
class CodeSummary:
    """The tasks of one code, counted by :meth:`TaskStore.summary` (by the store's clock).

    Attributes:
        code: the task code.
        queued: queued tasks (due or not).
        due_now: queued tasks whose due time has come, plus running ones whose lease ran out.
        running: tasks running under a lease (expired or not).
        failed: tasks out of attempts.
        oldest_overdue: seconds since the due time of the oldest task in ``due_now``, or None.
    """

    code: str
    queued: int = 0
    due_now: int = 0
    running: int = 0
    failed: int = 0
    oldest_overdue: float | None = None


@dataclass(frozen=True)
class PurgeBatch:
    """What one :meth:`TaskStore.purge_batch` did.

    Attributes:
        removed: tombstones deleted.
        ready_in: seconds until the next batch may remove more (0: at once; more: the token floor it
            raised must settle first), or None when no tombstone old enough is left.
    """

    removed: int = 0
    ready_in: float | None = None


# -- outcomes of a run: what complete() records -------------------------------------------------
@dataclass(frozen=True)
class Done:
    """The task ran: drop it (or queue its pending re-add)."""


class _Keep:
    """The payload of a :class:`Reschedule` that keeps the task's payload (None is a JSON payload)."""

    def __repr__(self) -> str:
        return "KEEP"


#: ``Reschedule(due)``'s default payload: the task keeps the one it has.
KEEP: Any = _Keep()


@dataclass(frozen=True)
class Reschedule:
    """Run the task again at ``due`` (seed 000's "next time"): a new occurrence, attempts reset.

    A handler may return it: ``return Reschedule(timedelta(hours=1), payload={"cursor": 42})``
    runs the task again in an hour with the new payload, written in the same fenced completion
    (a stale worker changes nothing). Without ``payload`` the task keeps its payload, as when the
    handler returns the ``timedelta`` alone.
    """

    due: Due
    payload: Any = KEEP


@dataclass(frozen=True)
class Retry:
    """The attempt failed with ``error``: run it again at ``due``, attempts counted on.

    The same occurrence: the task's own ``due`` (and its idempotency key) is kept; ``due`` here is
    when it may be claimed again (the record's ``run_at``).
    """

    due: Due
    error: str


@dataclass(frozen=True)
class Fail:
    """The attempt failed with ``error`` and no attempt is left: keep the task as ``failed``."""

    error: str


Outcome = Union[Done, Reschedule, Retry, Fail]


class TaskStore(ABC):
    """A store of durable one-off tasks, claimed with leases and fenced by tokens.

    The stores of :mod:`mutexcron.tasks` stand on a backend (:mod:`mutexcron.backends`: the
    connection, the clock, the error translation) and are built from a URL by
    :func:`mutexcron.tasks.task_store_from_url`.
    """

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def masked_url(self) -> str:
        """The URL with any password replaced by ``***``: safe for logs and ``status``."""
        return mask_url(self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.masked_url!r})"

    # -- producers ---------------------------------------------------------------------------
    @abstractmethod
    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        """Add or update the task ``(code, key)``: one atomic upsert.

        Args:
            code: the handler's code.
            key: the business object.
            due: an aware datetime, or a timedelta from the store's clock.
            payload: plain JSON (dicts with string keys, lists, strings, finite numbers, booleans, None).
            on_conflict: if the task exists: ``"replace"`` its due and payload; ``"keep"`` it as
                it is; keep the ``"earliest"`` or the ``"latest"`` due (with its payload). A failed
                task is revived by every mode but ``keep``. A running task gets the new values as
                pending (``keep``: it is kept as it is; ``earliest``/``latest``: compared with the
                pending due, if there is one).

        Raises:
            ConfigurationError: a bad code, key, due or ``on_conflict``.
            AttrsError: a payload that is not plain JSON.
        """

    @abstractmethod
    def add_many(self, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace") -> builtins.list[AddResult]:
        """:meth:`add` each of ``tasks`` (``NewTask`` or ``(code, key, due[, payload])``), in order;
        one result per task.

        Every task is checked before anything is written: a bad one, or the same ``(code, key)``
        twice, raises and adds nothing. The SQL stores write the batch in one transaction (all or
        nothing) and Redis in one script call per 1,000 tasks; the memory and MongoDB stores add
        them one at a time (:func:`mutexcron.tasks.checks.add_one_by_one`).

        Raises:
            ConfigurationError: a bad task (its position in ``tasks`` named), a duplicate, or a bad ``on_conflict``.
            AttrsError: a payload that is not plain JSON.
        """

    # -- inside the caller's transaction (SQL stores; mutexcron.tasks.transactions) ------------
    def add_many_in(
        self, transaction: Any, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace"
    ) -> builtins.list[AddResult]:
        """:meth:`add_many` on the caller's open ``transaction`` (its executor: see
        :mod:`mutexcron.tasks.transactions`): the tasks commit with the caller's writes, or not at all.

        Raises:
            ConfigurationError: this store shares no transaction with the caller's data (not SQL),
                or the transaction is not on the store's database.
        """
        raise ConfigurationError(_no_transaction("adding a task", self.masked_url))

    def cancel_in(self, transaction: Any, code: str, key: str) -> bool:
        """:meth:`cancel` on the caller's open ``transaction`` (see :meth:`add_many_in`)."""
        raise ConfigurationError(_no_transaction("cancelling a task", self.masked_url))

    def complete_in(self, transaction: Any, node: str, code: str, key: str, token: int, outcome: Outcome) -> None:
        """:meth:`complete` on the caller's open ``transaction`` (see :meth:`add_many_in`).

        Raises:
            StaleTaskError: the fence failed (this attempt no longer runs the task): roll back.
        """
        raise ConfigurationError(_no_transaction("completing a task", self.masked_url))

    @abstractmethod
    def cancel(self, code: str, key: str) -> bool:
        """Drop the task; a running one is dropped when its attempt ends. False if there is no such task."""

    @abstractmethod
    def get(self, code: str, key: str) -> TaskRecord | None:
        """The task, or None."""

    @abstractmethod
    def list(
        self,
        *,
        code: str | None = None,
        key_contains: str | None = None,
        due_before: datetime | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> list[TaskRecord]:
        """Tasks by due time (then code and key), filtered by code, a substring of the key (case
        sensitive), due strictly before an aware datetime, and state; at most ``limit``."""

    @abstractmethod
    def retry(self, code: str, key: str) -> bool:
        """Queue a failed task again, claimable now by the store's clock (``run_at``; its ``due``, the
        occurrence, is kept), attempts reset. False if it is not failed."""

    # -- workers -----------------------------------------------------------------------------
    @abstractmethod
    def claim(self, node: str, codes: Iterable[str], limit: int, lease: float) -> builtins.list[TaskRecord]:
        """Claim up to ``limit`` claimable tasks of ``codes``, earliest first, for ``node``.

        Claimable: ``run_at <= store now`` (queued and due or its retry's time come, or running
        with an expired lease), earliest ``run_at`` first. Each claimed task is returned as left:
        running, owned by ``node``, token and attempt + 1, ``lease_until = run_at = store now +
        lease``. Concurrent claims never return one task twice while its lease runs. A rescued task
        that was cancelled is dropped, not returned. A rescued task whose last claim was never
        marked started (:meth:`start`) keeps its attempt number: that claim did not count.
        """

    @abstractmethod
    def start(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        """Mark that the handlers of ``(code, key, token)`` started, in one round trip: each fenced
        like :meth:`complete` (running, owned by ``node``, with its token). A later claim that
        rescues a task whose lease ran out counts a new attempt only if the claim it takes over
        was marked started. Returns how many were marked."""

    @abstractmethod
    def renew(self, node: str, tokens: Mapping[tuple[str, str], int], lease: float) -> set[tuple[str, str]]:
        """Extend to ``store now + lease`` the leases ``node`` holds on ``{(code, key): token}``, in one round trip.

        Returns the tasks renewed; the others are lost (taken over, or gone).
        """

    @abstractmethod
    def complete(self, node: str, code: str, key: str, token: int, outcome: Outcome) -> bool:
        """Record how the attempt ended, if ``node`` still runs the task with ``token``.

        :class:`Done` deletes the task, :class:`Reschedule` queues a new occurrence at its due,
        :class:`Retry` queues the same occurrence (``due`` kept) claimable at its time
        (``run_at``), :class:`Fail` keeps it as failed. A pending re-add wins over any outcome (the
        task is queued with the pending due and payload, attempts reset); a cancel drops the task.

        Returns:
            False, and nothing is changed, if the task was taken over (its lease expired and
            another claim raised the token), cancelled after a hand-back, or is gone.
        """

    def complete_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> builtins.list[bool]:
        """:meth:`complete` for several ``(code, key, token, outcome)`` at once, in one round trip
        where the store allows it; each one is fenced on its own. Returns one result per completion,
        in order.

        The default calls :meth:`complete` for each; a store that raises StoreUnavailableError
        part-way leaves the earlier ones recorded (a retry of them is refused harmlessly: their
        tokens no longer run).
        """
        return [self.complete(node, code, key, token, outcome) for code, key, token, outcome in completions]

    @abstractmethod
    def release(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        """Hand back tasks ``node`` claimed but did not start: queued again, claimable at once
        (``run_at`` = store now, ``due`` kept), token + 1, the claim's attempt not counted (a pending
        re-add is applied instead). Fenced like :meth:`complete`. Stores with notices send one, as
        :meth:`add` does, so other nodes' workers take them at once. Returns how many were handed
        back (or dropped, if cancelled meanwhile)."""

    @abstractmethod
    def next_due(self, codes: Iterable[str]) -> float | None:
        """Seconds until the earliest task of ``codes`` is claimable (0 if one is now), by the
        store's clock; None if none will be (no task, or only failed ones)."""

    @abstractmethod
    def summary(self, codes: Iterable[str] | None = None) -> builtins.list[CodeSummary]:
        """Counts per code (``codes``, or every code with a task), sorted by code, in one round trip
        where the store allows it; a code of ``codes`` without tasks is counted as all zeros.

        For ``mutexcron status`` and metrics: it may read every task of the codes it counts
        (an index-only count on the SQL stores), so it is not for a hot path.
        """

    # -- retention -----------------------------------------------------------------------------
    #: Seconds a raised token floor must hold (by the store's clock) before a tombstone under it is
    #: deleted: longer than any add's statement may live (0 where one writer at a time reads the
    #: floor and writes, as on SQLite).
    floor_settle: float = 0.0
    #: True for the stores that keep a finished task's tombstone (SQL, MongoDB): the ones a node prunes.
    keeps_tombstones: bool = False

    def purge_batch(self, older_than: float, *, code: str | None = None, limit: int = PURGE_BATCH) -> PurgeBatch:
        """Delete at most ``limit`` tombstones (finished or cancelled tasks) that finished more than
        ``older_than`` seconds ago by the store's clock (of ``code`` only, if given), each statement
        one short atomic operation, under the token floor (see the module's rules).

        A store that keeps no tombstone (Redis, memory: a finished task is deleted at once) has
        nothing to purge: this default.
        """
        return PurgeBatch()

    def count_purgeable(self, older_than: float, *, code: str | None = None) -> int:
        """How many tombstones finished more than ``older_than`` seconds ago (of ``code``): what a purge would remove."""
        return 0

    def count_stored(self) -> dict[str, int]:
        """What the store holds for the task pool, by kind (``rows``: every task's row or document;
        ``tombstones``: the finished tasks among them, kept for their token), for the metrics.
        One count over the table: not for a hot path. {} where counting is not cheap (Redis)."""
        return {}

    @property
    def default_poll(self) -> float:
        """Seconds between two looks for new tasks where no notice comes, when no handler asks otherwise."""
        return DEFAULT_POLL

    def waker(self, codes: Iterable[str], poll: float | None = None) -> Waker:
        """What a worker handling ``codes`` sleeps on between claims (:mod:`mutexcron.tasks.wakeups.base`).

        The default polls every ``poll`` seconds (None: :data:`~mutexcron.tasks.wakeups.base.DEFAULT_POLL`);
        stores with notices override it. The caller closes it.
        """
        return PollWaker(poll or self.default_poll)

    @abstractmethod
    def now(self) -> datetime:
        """The store's clock, as an aware UTC datetime."""

    @abstractmethod
    def ping(self) -> None:
        """One raw round trip to the server."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The store must not be used afterwards."""


def _no_transaction(what: str, where: str) -> str:
    return (
        f"{what} inside your transaction needs a SQL task store (sqlite://, mysql://, mariadb://, postgresql://): "
        f"{where} has no transaction shared with your data. Use it without transaction=, and key the handler's "
        "writes on task.idempotency_key"
    )
