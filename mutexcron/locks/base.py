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
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..record import LockRecord
from ..timeutil import MICROSECONDS, as_utc
from ..urls import mask_url


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
        return cls(job_id=job_id, fire_us=fire_us, nonce=secrets.token_hex(8))


@dataclass(frozen=True)
class RunInfo:
    """What a finished run reports with its heartbeat.

    ``duration`` is measured with the node's monotonic clock; the store stamps
    ``last_run_finished`` with its own clock and ``last_run_started`` as that minus ``duration``.
    """

    duration: float
    error: str | None = None


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

    @property
    def token(self) -> int:
        return self.record.token


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

    @abstractmethod
    def renew_many(self, node: Node, leases: Mapping[str, int]) -> set[str]:
        """Refresh every lease in ``{name: token}`` held by ``node``, in one round trip.

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

    @abstractmethod
    def ping(self) -> None:
        """One raw round trip to the server (``SELECT 1``, ``PING``...): health check and benchmark baseline."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The store must not be used afterwards."""
