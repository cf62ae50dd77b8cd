"""Placement: which node asks for which guarded lock (rendezvous hashing over the live nodes).

Placement decides who *asks* for a lock, never who wins it: acquiring still goes only through
the store's conditional, fenced operation, and a node not placed for a lock still takes it over
once its placed owner is gone. ``balanced`` (the default) gives every live node a fair share, and
hands each lock that moves over to its successor at a fire-time boundary; ``first`` keeps the
behaviour of earlier releases (every node asks for every lock) (``heartbeat.LeaseManager``,
``LockStore.hand_over``).
"""

from __future__ import annotations

from ..node import NodeTraits
from .balanced import BalancedPlacement
from .base import (
    DEFAULT_HAND_OVER_WAIT,
    HAND_OVER_WAIT_ENV,
    PLACEMENTS,
    FirstPlacement,
    Placement,
    hand_over_wait_seconds,
    placement_mode,
)
from .rendezvous import TAG_PREFIX, assign, node_allowed

__all__ = [
    "DEFAULT_HAND_OVER_WAIT",
    "HAND_OVER_WAIT_ENV",
    "PLACEMENTS",
    "TAG_PREFIX",
    "BalancedPlacement",
    "FirstPlacement",
    "Placement",
    "assign",
    "hand_over_wait_seconds",
    "new_placement",
    "node_allowed",
    "placement_mode",
]


def new_placement(mode: str, node_id: str, traits: NodeTraits | None = None) -> Placement:
    """The placement of ``mode`` (``balanced`` or ``first``) for the node ``node_id`` with its weight and tags."""
    if placement_mode(mode) == "first":
        return FirstPlacement(node_id, traits)
    return BalancedPlacement(node_id, traits)
