"""What the nodes guarding one lock must agree on, and the one line when they do not: another
jobs file (:class:`Agreement`), or another process with this node's id (:class:`SharedNodeId`).

Every node must run the same jobs file (docs/api.md): a node with another lease or another
trigger for a job of the lock takes the lock over on its own terms, or claims fire times the
holder never names. Nothing breaks "once" at once, which is why it goes unnoticed. The records
the nodes already write say it: each lock record carries its holder's lease (``ttl``), and the
holder writes the lock's jobs with their triggers beside its time zone when it takes the lock
(:meth:`mutexcron.locks.LockStore.set_zone`). A node that reads a record held by another node
compares both with its own and says each new difference once, naming the two nodes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping

from ..locks.base import FireClaim
from ..locks.record import LockRecord
from ..names import printable

__all__ = ["Agreement", "SharedNodeId", "differences", "zone_difference"]

log = logging.getLogger(__name__)

#: Leases differing by less than this (seconds) are the same lease (stored in milliseconds).
_SAME_LEASE = 0.001


def differences(
    record: LockRecord,
    lease: float | None,
    jobs: Mapping[str, str] | None,
    holder_jobs: Mapping[str, str] | None,
    *,
    here: str = "here",
) -> list[str]:
    """How this node's ``lease`` and ``jobs`` (job id -> trigger) for ``record``'s lock differ from
    its holder's (``holder_jobs``: what the holder wrote; None: it wrote nothing to compare).
    ``here`` names this side in the text (the dashboard: ``in jobs.py``, ``on node-a``)."""
    theirs = printable(record.holder or "?")
    out: list[str] = []
    if lease is not None and record.ttl and abs(record.ttl - lease) >= _SAME_LEASE:
        out.append(f"lease {record.ttl:g}s on {theirs}, {lease:g}s {here}")
    if jobs is None or holder_jobs is None:
        return out
    for job in sorted(set(jobs) | set(holder_jobs)):
        mine, other = jobs.get(job), holder_jobs.get(job)
        if mine == other:
            continue
        name = printable(job)
        if other is None:
            out.append(f"job {name!r} only {here} ({printable(mine)})")
        elif mine is None:
            out.append(f"job {name!r} only on {theirs} ({printable(other)})")
        else:
            out.append(f"job {name!r}: {printable(other)} on {theirs}, {printable(mine)} {here}")
    return out


def zone_difference(record: LockRecord, zone: str | None, *, here: str = "here") -> str | None:
    """How this node's ``zone`` for ``record``'s lock differs from the zone its holder wrote, or None
    (the same, or either side names none: a lock of interval jobs only). A node in another zone
    than the holder's runs none of the lock's jobs and does not take it over."""
    if zone is None or record.zone is None or record.zone == zone:
        return None
    return f"time zone {printable(record.zone)} on {printable(record.holder or '?')}, {printable(zone)} {here}"


class Agreement:
    """Compares the records this node reads with its own jobs file: one WARNING per lock when a
    difference appears or changes, one INFO line when the lock's nodes agree again."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._said: dict[str, str] = {}  # lock -> the differences last said
        self._mutex = threading.Lock()

    def check(
        self, record: LockRecord, lease: float | None, jobs: Mapping[str, str] | None, holder_jobs: Mapping[str, str] | None
    ) -> list[str]:
        """Compare ``record`` (held by another node) with this node's settings; returns the differences."""
        if record.holder is None or record.holder == self.node_id:
            return []
        found = differences(record, lease, jobs, holder_jobs)
        text = "; ".join(found)
        with self._mutex:
            before = self._said.get(record.name)
            if found:
                self._said[record.name] = text
            else:
                self._said.pop(record.name, None)
        if found and text != before:
            log.warning(
                "lock %r: this node (%s) and its holder %s run different jobs files: %s. Every node must run the "
                "same jobs file (same job ids, triggers and lease): the lock's fire times and failover follow "
                "whichever node holds it",
                printable(record.name), printable(self.node_id), printable(record.holder), text,
            )  # fmt: skip
        elif not found and before is not None:
            log.info("lock %r: this node and its holder %s agree again", printable(record.name), printable(record.holder))
        return found

    def forget(self, lock: str) -> None:
        with self._mutex:
            self._said.pop(lock, None)


class SharedNodeId:
    """Notices a second process that runs with this node's id.

    Two processes with one node id both "hold" every lock either takes: the store sees one holder,
    renews it for both and gives both the same token. What still tells them apart is the fire
    claim: each claim carries a nonce of its own, and the store says which nonce beat a claim not
    won. A claim beaten by one of this scheduler's own claims (a later fire time its scheduled run
    claimed before a trigger's or a catch-up's older one, a retry) proves nothing. Nor does one
    foreign nonce: the previous holder may have claimed that fire time before this node took the
    lock. Proof is a second, different foreign nonce for the same job while this node holds the
    lock with the same token: the first was stored while this node held it, so the claim that
    replaced it was written after, by a holder with this node's id and token, that is not this
    scheduler. Then one ERROR line.
    """

    #: Nonces remembered per (lock, job): more than a scheduler sends for one job between two of
    #: its claims' outcomes (a batch, its retry, a trigger, a catch-up).
    REMEMBERED = 32
    #: (lock, job) pairs remembered, the oldest forgotten first.
    PAIRS = 4096

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._sent: OrderedDict[tuple[str, str], deque[str]] = OrderedDict()  # this scheduler's nonces
        self._foreign: dict[tuple[str, str], tuple[int, str]] = {}  # the last foreign nonce seen, with the token then
        self._proofs = 0
        self._said = False
        self._mutex = threading.Lock()

    def sent(self, lock: str, claim: FireClaim) -> None:
        """This scheduler is about to send ``claim``."""
        key = (lock, claim.job_id)
        with self._mutex:
            nonces = self._sent.pop(key, None) or deque(maxlen=self.REMEMBERED)
            nonces.append(claim.nonce)
            self._sent[key] = nonces
            while len(self._sent) > self.PAIRS:
                self._sent.popitem(last=False)

    def lost(self, lock: str, claim: FireClaim, beaten_by: str | None, token: int) -> None:
        """``claim`` on ``lock``, which this scheduler holds with ``token``, was not won (the lock is
        not paused): ``beaten_by`` is the nonce the store holds for the job instead (None: unknown)."""
        key = (lock, claim.job_id)
        with self._mutex:
            if beaten_by is None or beaten_by in self._sent.get(key, ()):
                return  # nothing to compare, or this scheduler's own claim
            before = self._foreign.get(key)
            self._foreign[key] = (token, beaten_by)
            if before is None or before[0] != token or before[1] == beaten_by:
                return
            self._proofs += 1
            say = not self._said
            self._said = True
            count = self._proofs
        if say:
            node = printable(self.node_id)
            log.error(
                "lock %r: fire times of a lock this node holds were claimed by another writer with this node's id "
                "(%d so far): another process runs with node id %s. Both believe they hold the locks they share, "
                "with one token, and fencing no longer tells them apart. Give every process its own --node-id "
                "(MUTEXCRON_NODE_ID), or leave it unset: the default is unique per process",
                printable(lock), count, node,
            )  # fmt: skip
