"""Rendezvous (highest random weight) hashing with a bounded load: every node computes the same
owner for each lock from the same live node ids, with no coordinator.

Each lock ranks the nodes by a hash of (lock, node); it goes to the best-ranked node that still
has room under the fair share ``ceil(locks / nodes)``. A node joining or leaving moves only the
locks whose place it changes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping

#: lock -> node id -> whether the node may hold the lock (``mutex(nodes=...)``).
Allowed = Callable[[str, str], bool]


def node_allowed(node_id: str, patterns: Iterable[str] | None) -> bool:
    """True if ``node_id`` matches one of the glob ``patterns`` (every node when there are none)."""
    if patterns is None:
        return True
    return any(fnmatch.fnmatchcase(node_id, pattern) for pattern in patterns)


def _score(lock: str, node_id: str) -> int:
    digest = hashlib.blake2b(f"{lock}\x00{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign(locks: Collection[str], nodes: Collection[str], allowed: Allowed | None = None) -> dict[str, str | None]:
    """The owner of each lock among ``nodes`` (None: no node may hold it).

    Every node gets at most ``ceil(len(locks) / len(nodes))`` locks, unless the ``allowed`` rule
    leaves a lock no other choice.
    """
    ranked_nodes = sorted(nodes)
    share = math.ceil(len(locks) / len(ranked_nodes)) if ranked_nodes else 0
    load = dict.fromkeys(ranked_nodes, 0)
    owners: dict[str, str | None] = {}
    for lock in sorted(locks):
        candidates = [n for n in ranked_nodes if allowed is None or allowed(lock, n)]
        candidates.sort(key=lambda n: _score(lock, n), reverse=True)
        owner = next((n for n in candidates if load[n] < share), candidates[0] if candidates else None)
        if owner is not None:
            load[owner] += 1
        owners[lock] = owner
    return owners


def shares(owners: Mapping[str, str | None]) -> dict[str, int]:
    """Node id -> how many locks it is placed for."""
    counts: dict[str, int] = {}
    for owner in owners.values():
        if owner is not None:
            counts[owner] = counts.get(owner, 0) + 1
    return counts
