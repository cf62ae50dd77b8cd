"""Rendezvous (highest random weight) hashing with a bounded load: every node computes the same
owner for each lock from the same live node ids, weights and tags, with no coordinator.

Each lock ranks the nodes by a weighted hash of (lock, node), ``-weight / ln(h)`` with ``h`` in
(0, 1): a node of weight 2 comes first for about twice the locks of a node of weight 1, and with
equal weights the ranking is the plain hash's. A lock goes to the best-ranked node that still has
room under its fair share ``ceil(locks * weight / total weight)``. A node joining or leaving moves
only the locks whose place it changes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping

#: lock -> node id -> whether the node may hold the lock (``mutex(nodes=...)``).
Allowed = Callable[[str, str], bool]
#: The prefix of a ``mutex(nodes=...)`` pattern that matches a node's tags only.
TAG_PREFIX = "tag:"


def node_allowed(node_id: str, patterns: Iterable[str] | None, tags: Iterable[str] = ()) -> bool:
    """True if the node matches one of the glob ``patterns`` (every node when there are none).

    A pattern ``tag:GLOB`` matches the node's tags only; any other pattern matches its id or one of
    its tags (``nodes="reports-*"`` takes ``reports-1`` and a node tagged ``reports-eu``).
    """
    if patterns is None:
        return True
    tags = tuple(tags)
    for pattern in patterns:
        if pattern.startswith(TAG_PREFIX):
            if any(fnmatch.fnmatchcase(tag, pattern[len(TAG_PREFIX) :]) for tag in tags):
                return True
        elif fnmatch.fnmatchcase(node_id, pattern) or any(fnmatch.fnmatchcase(tag, pattern) for tag in tags):
            return True
    return False


def _hash(lock: str, node_id: str) -> int:
    digest = hashlib.blake2b(f"{lock}\x00{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _score(lock: str, node_id: str, weight: float = 1.0) -> float:
    """The node's rank for ``lock``: ``-weight / ln(h)``, ``h`` the hash's top 52 bits mapped into
    (0, 1), exactly as a float (never 0 or 1)."""
    unit = ((_hash(lock, node_id) >> 12) + 0.5) / 2.0**52
    return -weight / math.log(unit)


def capacities(nodes: Collection[str], count: int, weights: Mapping[str, float] | None = None) -> dict[str, int]:
    """Each node's fair share of ``count`` locks: ``ceil(count * weight / total weight)``."""
    weight = {n: (weights or {}).get(n, 1.0) for n in nodes}
    total = sum(weight.values())
    return {n: math.ceil(count * w / total - 1e-9) if total else 0 for n, w in weight.items()}


def assign(
    locks: Collection[str],
    nodes: Collection[str],
    allowed: Allowed | None = None,
    weights: Mapping[str, float] | None = None,
) -> dict[str, str | None]:
    """The owner of each lock among ``nodes`` (None: no node may hold it).

    Every node gets at most its fair share (:func:`capacities`: ``ceil(len(locks) / len(nodes))``
    with equal weights), unless the ``allowed`` rule leaves a lock no other choice; the locks with
    the fewest allowed nodes are placed first. A node missing from ``weights`` weighs 1.
    """
    ranked_nodes = sorted(nodes)
    room = capacities(ranked_nodes, len(locks), weights)
    weight = {n: (weights or {}).get(n, 1.0) for n in ranked_nodes}
    load = dict.fromkeys(ranked_nodes, 0)
    allowed_nodes = {lock: [n for n in ranked_nodes if allowed is None or allowed(lock, n)] for lock in locks}
    owners: dict[str, str | None] = {}
    # The most restricted locks first (then by name), so that the nodes a lock is kept on have room for it.
    for lock in sorted(locks, key=lambda name: (len(allowed_nodes[name]), name)):
        candidates = sorted(allowed_nodes[lock], key=lambda n: _score(lock, n, weight[n]), reverse=True)
        owner = next((n for n in candidates if load[n] < room[n]), candidates[0] if candidates else None)
        if owner is not None:
            load[owner] += 1
        owners[lock] = owner
    return dict(sorted(owners.items()))


def shares(owners: Mapping[str, str | None]) -> dict[str, int]:
    """Node id -> how many locks it is placed for."""
    counts: dict[str, int] = {}
    for owner in owners.values():
        if owner is not None:
            counts[owner] = counts.get(owner, 0) + 1
    return counts
