"""The lock store interface every backend implements.

Rules every implementation follows (the contract suite in ``tests/test_contract.py`` checks them):

* Each method is **one atomic operation** in the store (a conditional UPDATE or upsert, a Lua
  script, a ``find_one_and_update``); writes compare the holder and, after acquisition, the
  fencing token. A read that only builds the returned record may follow a write.
* Staleness is judged by **the store's clock**, against the ``ttl`` the current holder stored
  with its lease. Never the node's wall clock.
* The fencing token goes up by one on every change of holder (including from "released") and
  survives a release; it never goes down.
* Fire claims: ``acquire_or_renew(..., claim=FireClaim(job_id, fire_us, nonce))`` records
  ``fires[job] = [fire_us, nonce]`` in the same atomic operation, only if the lease is acquired
  and ``fire_us`` is greater than the stored one. ``AcquireResult.claimed`` is True only if this
  call wrote that claim (the stored nonce is ours).
* Batched claims: ``claim_many(node, [HeldClaim(lock, token, claim), ...])`` is the same claim for
  locks ``node`` already holds, many at once: per lock, the lease check (holder **and** token),
  the renewal and every claim of that lock happen together or not at all. Like ``renew_many``, it
  does not judge staleness: a holder whose lease ran out by the store clock, but whose record
  still names it with that token, renews and claims. That never lets two nodes run one fire time:
  a takeover changes the token first, and the fire times already claimed stay in the record.
* Contention (a lost race for the row, a deadlock, a busy database) or a write whose outcome is
  unknown makes ``acquire_or_renew`` return ``uncertain=True`` (not acquired, not claimed), and
  makes the other writes raise :class:`~mutexcron.errors.StoreUnavailableError`: it is never
  reported as a renewal, and never as a loss of the lease.
* A store that cannot be reached raises :class:`~mutexcron.errors.StoreUnavailableError`.
* Batched hand-offs: ``hand_off_many(node, [HandOff(lock, token, attrs, run), ...])`` is one
  store operation for many hand-offs: each item is the same write as ``hand_off``, conditional on
  holder **and** token on its own (a refused item changes nothing and the others still count), and
  the items of one lock are applied in the order given. It returns one bool per item.
* Run history: ``hand_off(..., run=RunInfo(...))`` appends the run to its job's history in the
  same atomic operation (and only if the hand-off is accepted), keeping the last
  ``history_length`` runs per job (``?history=N``, default 20).
* Pause: ``set_paused`` is an operator's write: it sets or clears the flag (creating the record if
  missing) and changes neither holder, token nor lease; every other write keeps the flag. While a
  lock is paused its leases are taken and renewed as usual, but **no fire claim is written**:
  ``acquire_or_renew`` answers ``claimed=False`` and ``claim_many`` lists the lock in ``paused``.
* Presence: ``renew_many(..., presence=Presence(...))`` also upserts the node's presence, in the
  same round trip where the store allows it; ``nodes()`` lists those seen within
  :data:`PRESENCE_TTL` seconds (older ones are pruned).
* Hand-over: ``hand_over(name, node, token, successor, within)`` is a release offered to one node,
  one conditional write on holder **and** token: the record names ``successor`` as its holder with
  the next token and a lease of ``within`` seconds from the store's clock (no IP until it takes it),
  and keeps attrs and fire claims (the last claimed fire times). The successor takes it with its
  ordinary ``acquire_or_renew`` (a holder's renewal: the token stays); every other node sees a live
  lease until ``within`` runs out, then a stale one that anyone may take (a dead successor strands
  nothing). Stores with notices tell the successor at once (PostgreSQL ``NOTIFY``, a Redis publish).
* Forget: ``forget`` is one conditional write (an operator's, or a node's for the lock of a
  finished one-off shared job): unless forced, it changes nothing while a holder's lease is live
  by the store's clock. A record no node ever held (token 0) is deleted. Any other record is let go
  while its tokens stay spent: the store keeps one **token floor** (per table, key namespace or
  collection), raised to at least the record's token before or in the same atomic operation that
  clears it. Stores whose forget is one atomic operation over the record and the floor (Redis,
  memory) delete the record at once. The others (SQL, MongoDB) *retire* it: cleared to a released
  record, marked with the store's time, left out of ``list()``, and deleted by a later ``forget``
  once it has been retired :data:`RETIRED_KEEP` seconds, far longer than any write can take
  (statement and socket timeouts), so a write that read the floor before it was raised cannot
  land after the deletion. A record created, or first taken from token 0 (made by a pause), gets
  ``max(token, floor) + 1``; a record held before is above every earlier token of its name
  already (SQL stores use ``max(token, floor) + 1`` for every takeover). An acquire or
  ``set_paused`` of a retired record un-retires it. So tokens only go up across release, forget,
  deletion and re-add. ``forget_node`` deletes a
  node's presence.
"""

from __future__ import annotations

import builtins
import itertools
import json
import os
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from json.encoder import encode_basestring
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..node import NodeTraits
from ..timeutil import MICROSECONDS, as_utc, us_from_datetime
from ..urls import mask_url, pop_query
from .record import LockRecord, NodePresence, RunRecord, newest_first

if TYPE_CHECKING:  # the wakers' package imports drivers lazily, but it is the tasks' package
    from ..tasks.wakeups.base import Waker


@dataclass(frozen=True)
class Node:
    """Who is asking: the node id (unique per process) and the IP shown as ``active_ip``."""

    node_id: str
    ip: str


@dataclass(frozen=True)
class FireClaim:
    """A claim on one scheduled fire time of one job, made atomically with the lease."""

    job_id: str
    fire_us: int
    nonce: str

    @classmethod
    def new(cls, job_id: str, fire_us: int) -> FireClaim:
        """A claim with a nonce no other claim has: this process's random prefix and a counter (no
        system call per claim: a holder makes one per guarded job per fire time)."""
        return cls(job_id=job_id, fire_us=fire_us, nonce=f"{_NONCE_PREFIX}{next(_nonce_counter):x}")


#: The nonces of this process's claims: 8 random bytes per process (a fork draws its own, see
#: below) and a counter. A nonce only needs to be one no other claim uses.
_NONCE_PREFIX = secrets.token_hex(8)
_nonce_counter = itertools.count(1)


def _new_nonce_prefix() -> None:
    global _NONCE_PREFIX, _nonce_counter
    _NONCE_PREFIX, _nonce_counter = secrets.token_hex(8), itertools.count(1)


os.register_at_fork(after_in_child=_new_nonce_prefix)


@dataclass(frozen=True)
class RunInfo:
    """What a finished run reports with its hand-off.

    ``duration`` is measured with the node's monotonic clock; the store stamps
    ``last_run_finished`` with its own clock and ``last_run_started`` as that minus ``duration``.
    The same write appends the run to the job's history (:meth:`LockStore.history`), stamped the
    same way.
    """

    duration: float
    error: str | None = None
    #: The job the run belongs to: its history list in the lock record (None: the lock's name).
    job: str | None = None
    #: The scheduled fire time the run was for (None: not known, e.g. a run by hand).
    fire_time: datetime | None = None
    #: True if the job is the only one of its lock (no lock group): SQL stores then keep its runs
    #: in a plain text column of the lock row, appended without parsing the row's JSON.
    sole_job: bool = False

    def __post_init__(self) -> None:
        if self.error is not None:  # the one place every store's hand-off text goes through
            object.__setattr__(self, "error", store_text(self.error))

    def history_entry(self, node: Node, token: int) -> dict[str, Any]:
        """The run's history entry as every store keeps it, but for ``started``/``ended`` (the store stamps them).

        Only what a run has is written: no ``fire_us`` for a run without a fire time, and
        ``outcome``/``error`` only for a failed run (an entry without them is a success, see
        :meth:`mutexcron.locks.record.RunRecord.from_stored`). Every store rewrites a job's kept runs with
        each run, so each byte left out is saved N times per run.
        """
        entry: dict[str, Any] = {"node": node.node_id, "ip": node.ip, "token": token}
        if self.fire_time is not None:
            entry["fire_us"] = us_from_datetime(self.fire_time)
        if self.error is not None:
            entry.update(outcome="error", error=self.error[:HISTORY_ERROR_LIMIT])
        return entry

    def history_tail(self, node: Node, token: int, job: str | None = None) -> str:
        """The run's history line (:data:`mutexcron.locks.record.HISTORY_LINE`) after its end time, as
        the SQL and Redis stores send it: ``,"node","ip",token,fire_us,duration_us]``, with the
        error if the run failed, and ``job`` (the SQL ``runs`` column's line of a job not named as
        its lock). The store writes ``[`` and the end time (its clock, epoch ms) before it."""
        fire_us = "null" if self.fire_time is None else us_from_datetime(self.fire_time)
        tail = f",{_json_text(node.node_id)},{_json_text(node.ip)},{token},{fire_us},{round(max(0.0, self.duration) * 1e6)}"
        if self.error is not None or job is not None:
            tail += "," + ("null" if self.error is None else _json_text(self.error[:HISTORY_ERROR_LIMIT]))
        if job is not None:
            tail += "," + _json_text(job)
        return tail + "]"  # written by hand: a third of what a JSON encoder takes for so short a list


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def store_text(text: str) -> str:
    """``text`` as every store's text columns take it: NUL (refused by PostgreSQL in text and in
    jsonb) and lone surrogates (which no driver can encode, e.g. from a surrogate-escaped file
    name) become U+FFFD. Text without them is returned as it is."""
    return _UNSTORABLE.sub("\ufffd", text)


#: A str as JSON text, non-ASCII kept as is (the json module's own, C-accelerated).
_json_text: Callable[[str], str] = encode_basestring

#: The default number of runs kept per job (``?history=N`` / ``history=N``), and its bounds (0: no history is written).
DEFAULT_HISTORY, MIN_HISTORY, MAX_HISTORY = 20, 0, 1000
#: The longest error text a history entry keeps (``last_error`` keeps the whole text).
HISTORY_ERROR_LIMIT = 500
#: A node's presence is dropped once it is older than this many seconds (store clock).
PRESENCE_TTL = 600

#: Seconds a retired lock record (``forget`` on SQL and MongoDB) stays before a later ``forget``
#: deletes it: far above any store write's own bound (a 10 s statement timeout, socket timeouts).
RETIRED_KEEP = 600.0

#: What :meth:`LockStore.forget` did: the record is gone ...
FORGET_DELETED = "deleted"
#: ... it is retired: a released record, out of ``list()``, deleted :data:`RETIRED_KEEP` seconds later ...
FORGET_CLEARED = "cleared"
#: ... nothing: a holder's lease is live by the store's clock (and ``force`` was not given) ...
FORGET_HELD = "held"
#: ... nothing: there is no such record.
FORGET_MISSING = "missing"


def history_option(url: str, history: int | str | None = None) -> tuple[str, int]:
    """Split the run-history length off a lock URL: ``(url without ?history=, length)``.

    ``history`` (the store's keyword) wins over ``?history=``; neither: :data:`DEFAULT_HISTORY`.

    Raises:
        ConfigurationError: not a whole number from :data:`MIN_HISTORY` to :data:`MAX_HISTORY`.
    """
    rest, found = pop_query(url, "history")
    value = history if history is not None else found.get("history", DEFAULT_HISTORY)
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdecimal() or not MIN_HISTORY <= int(text) <= MAX_HISTORY:
        raise ConfigurationError(
            f"bad history length {value!r} for {mask_url(url)}: use ?history=N with N from {MIN_HISTORY} to {MAX_HISTORY} "
            f"(runs kept per job, 0 for none; default {DEFAULT_HISTORY})"
        )
    return rest, int(text)


@dataclass(frozen=True)
class Presence:
    """What a node publishes with its renewals: ``renew_many(node, leases, presence=...)``.

    The store adds the node's id and IP (from the :class:`Node`) and ``last_seen`` (its own clock).
    """

    #: The node's mutexcron version.
    version: str
    #: The node's wall clock minus the store's, in seconds (None: not measured yet).
    clock_offset: float | None = None
    #: The locks the node holds; None: the names in the same call's ``leases``.
    locks: tuple[str, ...] | None = None
    #: The node's placement weight and tags (every node places the locks from them).
    traits: NodeTraits = field(default_factory=NodeTraits)

    def held(self, leases: Mapping[str, int]) -> list[str]:
        """The lock names to publish, sorted."""
        return sorted(self.locks if self.locks is not None else leases)

    def locks_text(self, leases: Mapping[str, int]) -> str:
        return json.dumps(self.held(leases), ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class AcquireResult:
    """The outcome of :meth:`LockStore.acquire_or_renew`."""

    acquired: bool
    record: LockRecord
    claimed: bool = False
    #: The store cannot say whether this call took or renewed the lease (it lost a race for the
    #: row, or the write's outcome is unknown). ``acquired`` and ``claimed`` are then False, and the
    #: caller must neither count the call as a renewal nor drop a lease it holds.
    uncertain: bool = False
    #: The nonce of the claim the record holds for the claim's job after this call (None: no claim
    #: was asked for, or none is stored): a claim not won was beaten by the writer of this nonce.
    claimed_by: str | None = field(default=None, compare=False)

    @property
    def token(self) -> int:
        return self.record.token


@dataclass(frozen=True)
class HandOff:
    """One item of :meth:`LockStore.hand_off_many`: what ``hand_off(lock, node, token, attrs, run)`` writes."""

    #: The lock name.
    lock: str
    #: The token the caller holds the lock with: the item is written only if the record still names it.
    token: int
    #: The attrs to store (None: keep the stored ones).
    attrs: Mapping[str, Any] | None = None
    #: The run to record (None: none).
    run: RunInfo | None = None


def hand_off_rounds(items: Sequence[HandOff]) -> list[list[tuple[int, HandOff]]]:
    """``items`` (with their index) in rounds where each lock appears at most once, in order: the
    n-th hand-off of a lock goes to round n. Applying the rounds one after the other applies each
    lock's hand-offs in the order given (a statement that updates a row once per call needs this)."""
    rounds: list[list[tuple[int, HandOff]]] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        n = seen.get(item.lock, 0)
        seen[item.lock] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append((index, item))
    return rounds


@dataclass(frozen=True)
class HeldClaim:
    """A fire claim on a lock the caller holds: one item of :meth:`LockStore.claim_many`."""

    #: The lock name.
    lock: str
    #: The token the caller holds the lock with.
    token: int
    #: The fire time claimed (job id, fire time in epoch microseconds, nonce).
    claim: FireClaim


@dataclass(frozen=True)
class BatchClaimResult:
    """The outcome of :meth:`LockStore.claim_many`."""

    #: Locks still held by the caller with the given token: their lease was renewed.
    renewed: frozenset[str] = frozenset()
    #: Nonces of the claims this call wrote: each one's fire time is now the caller's to run. As for
    #: :attr:`AcquireResult.claimed`, "wrote" is read as "the stored nonce is ours", so a retry with
    #: the same nonces after an unknown outcome reports the claims an earlier attempt wrote.
    won: frozenset[str] = frozenset()
    #: Renewed locks that are paused (:meth:`LockStore.set_paused`): none of their claims was written.
    paused: frozenset[str] = frozenset()
    #: For each claim not won on a renewed lock that is not paused: its nonce -> the nonce of the
    #: claim the record holds for that job instead (who beat it). A diagnosis, left out of ==.
    lost_to: Mapping[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class LockClaims:
    """The claims of one call of :meth:`LockStore.claim_many` on one lock (see :func:`group_claims`)."""

    token: int
    #: ``{job_id: claim}``: per job id, the claim with the greatest fire time (the first of equals).
    claims: dict[str, FireClaim]


def group_claims(claims: Iterable[HeldClaim]) -> dict[str, LockClaims]:
    """``claims`` by lock, sorted by lock name, one claim per job id: what every store writes.

    Two claims for one job id on one lock: the greater fire time is kept (the first of equal ones),
    as if they were applied one after the other. Every store writes only these, so ``won`` never
    holds the nonce of a claim that a greater one of the same call replaced.

    Raises:
        ValueError: one lock is given with two different tokens.
    """
    out: dict[str, LockClaims] = {}
    for item in claims:
        group = out.setdefault(item.lock, LockClaims(item.token, {}))
        if group.token != item.token:
            raise ValueError(f"claim_many: lock {item.lock!r} given with tokens {group.token} and {item.token}")
        kept = group.claims.get(item.claim.job_id)
        if kept is None or item.claim.fire_us > kept.fire_us:
            group.claims[item.claim.job_id] = item.claim
    return dict(sorted(out.items()))


def won_claims(groups: Mapping[str, LockClaims], fires_by_lock: Mapping[str, Mapping[str, Any] | None]) -> frozenset[str]:
    """Nonces of the claims in ``groups`` that the stored ``fires`` of their (renewed) lock show as ours."""
    return frozenset(
        claim.nonce
        for lock, fires in fires_by_lock.items()
        if lock in groups
        for claim in groups[lock].claims.values()
        if claim_won(fires, claim)
    )


def lost_claims(groups: Mapping[str, LockClaims], fires_by_lock: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str]:
    """``{nonce: stored nonce}`` of the claims in ``groups`` that their (renewed) lock's stored
    ``fires`` show as another claim's (:attr:`BatchClaimResult.lost_to`)."""
    lost: dict[str, str] = {}
    for lock, fires in fires_by_lock.items():
        for claim in groups[lock].claims.values() if lock in groups else ():
            stored = stored_nonce(fires, claim)
            if stored is not None and stored != claim.nonce:
                lost[claim.nonce] = stored
    return lost


def stored_nonce(fires: Mapping[str, Any] | None, claim: FireClaim | None) -> str | None:
    """The nonce of the claim stored in ``fires`` for ``claim.job_id`` (None if none is)."""
    value = (fires or {}).get(claim.job_id) if claim is not None else None
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[1], str):
        return value[1]
    return None


def fire_times_from_json(fires: Mapping[str, Any] | None) -> dict[str, datetime]:
    """``{job: [fire_us, nonce]}`` as stored -> ``{job: datetime}``."""
    out: dict[str, datetime] = {}
    for job, value in (fires or {}).items():
        fire_us = value[0] if isinstance(value, (list, tuple)) else value
        when = as_utc(fire_us, epoch_unit=MICROSECONDS)
        if when is not None:
            out[job] = when
    return out


def claim_won(fires: Mapping[str, Any] | None, claim: FireClaim | None) -> bool:
    """True if the stored claim for ``claim.job_id`` is exactly ours (same time and nonce)."""
    if claim is None or not fires:
        return False
    value = fires.get(claim.job_id)
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and int(value[0]) == claim.fire_us
        and value[1] == claim.nonce
    )


class LockStore(ABC):
    """A store of named, leased lock records.

    The stores of :mod:`mutexcron.locks` stand on a backend (:mod:`mutexcron.backends`: the
    connection, the clock, the error translation) and are built from a URL by
    :func:`mutexcron.locks.lock_store_from_url`. ``url`` is what the store reports (wrappers
    around another store pass that store's URL).
    """

    #: Runs kept per job in the run history (``?history=N``; stores set it from their URL).
    history_length: int = DEFAULT_HISTORY

    #: Seconds a retired record stays before a later ``forget`` deletes it (see the contract).
    retired_keep: float = RETIRED_KEEP

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def masked_url(self) -> str:
        """The URL with any password replaced by ``***``: safe for logs and ``status``."""
        return mask_url(self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.masked_url!r})"

    @abstractmethod
    def acquire_or_renew(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None = None
    ) -> AcquireResult:
        """Take the lock if it is free, released or stale, or renew it if ``node`` holds it.

        Args:
            name: lock name.
            node: the caller.
            ttl: lease length in seconds; stored with the lease, and used by *other* nodes to
                judge this holder stale.
            claim: optionally claim a fire time in the same atomic operation.

        Returns:
            Whether the lease is held, the record after the operation, and whether the claim
            was won.
        """

    @abstractmethod
    def hand_off(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        """Refresh the lease and optionally store attrs and run info.

        Conditional on holder **and** token: returns False (and changes nothing) if another
        node took the lock since ``token`` was issued. ``attrs=None`` keeps the stored attrs.
        """

    def hand_off_many(self, node: Node, items: Sequence[HandOff]) -> builtins.list[bool]:
        """Many :meth:`hand_off` writes in one store operation; one bool per item, in order.

        Each item is conditional on holder **and** its token on its own: a refused item (the lock
        moved on) changes nothing and is answered False while the others are written. Items of one
        lock are applied in the order given. Every item's attrs are checked before anything is
        sent (AttrsError). The stores of :mod:`mutexcron.locks` make it one atomic operation (one
        statement or transaction, one Lua script; MongoDB: one ordered bulk write, each document's
        update atomic); this fallback, for other stores, is one ``hand_off`` per item.

        Raises:
            StoreUnavailableError: the store cannot be reached or met contention: no item may be
                counted as written (a retry with the same items is safe: each is fenced).
        """
        return [self.hand_off(item.lock, node, item.token, item.attrs, item.run) for item in items]

    @abstractmethod
    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        """Refresh every lease in ``{name: token}`` held by ``node``, in one round trip.

        With ``presence``, also publish the node's presence (see :meth:`nodes`) in the same round
        trip where the store allows it; ``leases`` may then be empty (only the presence is written).

        Returns the names that were renewed; the others were lost.
        """

    @abstractmethod
    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        """Claim fire times on locks ``node`` holds, renewing their leases, in one atomic round trip.

        For every lock in ``claims`` that ``node`` holds with the given token: renew its lease
        (``hb`` = the store's clock; ttl, attrs and ``active_ip`` are kept) and record each of its
        claims whose fire time is greater than the one stored for that job id. Several claims of
        one lock (a lock group) are all applied; two claims for one job id on one lock: the
        greater fire time wins (the first of equal ones). Each lock's part is atomic with its
        lease check: either all of it happens while the record names ``node`` with that token, or
        none of it. Locks not held with that token (taken over, released, missing) are left
        untouched and appear in neither set.

        Staleness is not judged here, as in :meth:`renew_many`: a holder whose lease expired by
        the store's clock, but whose record still names it with that token (nobody took over
        yet), renews and claims. A takeover always changes the token, and claimed fire times stay
        in the record, so a fire time is still claimed once.

        Args:
            node: the caller.
            claims: what to claim, on which lock, with which token. Empty: nothing is sent.

        Returns:
            The locks renewed and the nonces of the claims this call wrote.

        Raises:
            ValueError: one lock is given with two different tokens.
            StoreUnavailableError: the store cannot be reached, or met contention (nothing may be
                counted as renewed or won; the caller retries).
        """

    @abstractmethod
    def release(self, name: str, node: Node, token: int) -> bool:
        """Mark the lock free if ``node`` holds it with ``token``. Keeps token, attrs and fire times."""

    def hand_over(self, name: str, node: Node, token: int, successor: str, within: float) -> bool:
        """Give the lock up to ``successor``: one write, conditional on holder and token, that names
        it the holder with the next token and a lease of ``within`` seconds (the store's clock),
        keeping attrs and fire claims. False (nothing changed) if ``node`` no longer holds it with
        ``token``. The successor takes it with :meth:`acquire_or_renew`; once ``within`` has run
        out, anyone may take it."""
        raise NotImplementedError(f"{type(self).__name__} cannot hand a lock over")

    def hand_over_waker(self, node_id: str) -> Waker | None:
        """A waker woken when a lock is handed over to ``node_id`` (its own connection: PostgreSQL
        ``LISTEN``, a Redis subscription), or None where the store sends no notice."""
        return None

    @abstractmethod
    def read(self, name: str) -> LockRecord | None:
        """The record of one lock (``heartbeat_age`` by the store's clock), or None."""

    @abstractmethod
    def list(self) -> list[LockRecord]:
        """Every lock record in the store, sorted by name."""

    def read_many(self, names: Iterable[str]) -> dict[str, LockRecord]:
        """Records for several locks; stores override this with one round trip."""
        out: dict[str, LockRecord] = {}
        for name in names:
            record = self.read(name)
            if record is not None:
                out[name] = record
        return out

    def set_paused(self, name: str, paused: bool, by: str, *, catch_up: bool = False) -> LockRecord:
        """Pause or resume a lock: one atomic write of the flag, creating the record if missing.

        An operator's write: holder, token, lease, attrs and fire times are left as they are.
        ``paused_at`` is set to the store's clock and ``paused_by`` to ``by``; ``resume_catch_up``
        to ``catch_up`` on a resume (False on a pause).

        Returns:
            The record after the write.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot pause locks")

    def set_zone(
        self, name: str, node: Node, token: int, zone: str | None, triggers: Mapping[str, str] | None = None
    ) -> bool:
        """Record the time zone the holder computes the lock's fire times in, and its jobs of the
        lock with their triggers (``{job: trigger text}``): one write, conditional on holder and
        token (nothing else changes). False if ``node`` does not hold ``name`` with ``token``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no time zone")

    def forget(self, name: str, *, force: bool = False) -> str:
        """Forget the lock ``name``: its holder, attrs, fire times, run history and pause, in one
        conditional write.

        Unless ``force``, nothing changes while a holder's lease is live by the store's clock (its
        heartbeat is younger than its ttl). A forced forget of a live lease takes it from its
        holder: the holder's next renewal fails and it stops running the lock's jobs, as after a
        takeover; its writes are fenced.

        Returns:
            :data:`FORGET_DELETED` (a record never held, or a store whose forget is atomic over
            the record and its token floor), :data:`FORGET_CLEARED` (retired: the floor keeps
            its token, so that the next holder's is greater), :data:`FORGET_HELD` or
            :data:`FORGET_MISSING`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot forget locks")

    def forget_node(self, node_id: str, *, min_age: float = 0.0) -> bool:
        """Delete the presence record of ``node_id`` if it was last seen at least ``min_age`` seconds
        ago by the store's clock: one conditional delete. True if a record was deleted. A node that
        still runs publishes its presence again with its next renewal."""
        raise NotImplementedError(f"{type(self).__name__} keeps no node presence")

    def history(self, lock: str, job: str | None = None, limit: int | None = None) -> builtins.list[RunRecord]:
        """The runs kept for ``lock`` (only ``job``'s if given), newest first, at most ``limit``."""
        return self.history_many([lock], job, limit).get(lock, [])

    def history_many(
        self, locks: Iterable[str], job: str | None = None, limit: int | None = None
    ) -> dict[str, builtins.list[RunRecord]]:
        """:meth:`history` of several locks, in one round trip where the store allows it.

        Returns:
            ``{lock: runs newest first}``, for the locks that have a record.
        """
        wanted = list(dict.fromkeys(locks))
        stored = self._stored_history(wanted) if wanted else {}
        return {lock: newest_first(lock, stored[lock], job, limit) for lock in wanted if lock in stored}

    def _stored_history(self, locks: Sequence[str]) -> dict[str, Mapping[str, Any]]:
        """``{lock: {job: [entry, ...] oldest first}}`` as stored, for the locks that have a record."""
        raise NotImplementedError(f"{type(self).__name__} keeps no run history")

    def nodes(self, *, prune: bool = True) -> builtins.list[NodePresence]:
        """The nodes that published their presence within :data:`PRESENCE_TTL` seconds, by node id.

        ``prune``: also delete the older presences (a write); ``False`` for a reader that must not
        write (the dashboard), which gets the same answer.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no node presence")

    @abstractmethod
    def ping(self) -> None:
        """One raw round trip to the server (``SELECT 1``, ``PING``...): health check and benchmark baseline."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The store must not be used afterwards."""
