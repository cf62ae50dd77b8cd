"""The interface between the lease manager and a placement, and ``first`` (every node asks)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from ..errors import ConfigurationError
from ..locks import LockStore
from ..node import NodeTraits
from .rendezvous import node_allowed

#: The placement modes: ``first`` (every node asks for every lock, the first to ask holds it: the
#: behaviour of earlier releases) and ``balanced`` (every live node its fair share; a lock that moves
#: is handed over to its successor at a fire-time boundary, see docs/operations.md).
PLACEMENTS = ("first", "balanced")
#: A cluster shares the work by default; ``--placement first`` keeps the earlier behaviour.
DEFAULT_PLACEMENT = "balanced"


#: The longest a stopping node under balanced placement keeps a lock whose jobs fire within it, waiting
#: for a live node to hand it to (a gunicorn reload: the new workers are still booting), in seconds;
#: at most the scheduler's ``shutdown_timeout``. ``MUTEXCRON_HAND_OVER_WAIT`` / ``--hand-over-wait`` set it.
DEFAULT_HAND_OVER_WAIT = 20.0
HAND_OVER_WAIT_ENV = "MUTEXCRON_HAND_OVER_WAIT"


def hand_over_wait_seconds(value: float | str | None) -> float:
    """``value`` (None: :data:`DEFAULT_HAND_OVER_WAIT`) as seconds >= 0; a ConfigurationError names the fix."""
    if value is None or value == "":
        return DEFAULT_HAND_OVER_WAIT
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigurationError(
            f"hand_over_wait must be a number of seconds >= 0 (0: release at once), not {value!r} "
            f"(--hand-over-wait / {HAND_OVER_WAIT_ENV})"
        )
    return seconds


def placement_mode(mode: str | None) -> str:
    """``mode`` checked (None: :data:`DEFAULT_PLACEMENT`); a ConfigurationError names the choices."""
    value = (mode or DEFAULT_PLACEMENT).strip().lower()
    if value not in PLACEMENTS:
        choices = ", ".join(PLACEMENTS)
        raise ConfigurationError(f"placement must be one of {choices}, not {mode!r} (--placement / MUTEXCRON_PLACEMENT)")
    return value


class Placement(Protocol):
    """Who asks for which lock. The lease manager calls it from its heartbeat thread."""

    mode: str
    #: This node's weight and tags, published with its presence.
    traits: NodeTraits

    def restrict(self, lock: str, patterns: Sequence[str] | None) -> None:
        """Only nodes whose id matches one of ``patterns`` may hold ``lock`` (None: every node)."""

    def refresh(self, store: LockStore, locks: Mapping[str, float], now: float, *, force: bool = False) -> None:
        """Read the live nodes (at most once a second; ``force``: now) and place ``locks`` (name -> lease) among them."""

    def asks(self, lock: str, now: float) -> bool:
        """True if this node asks the store for ``lock`` when it is free (a tick of its job)."""

    def placed_here(self, lock: str, now: float) -> bool:
        """True if ``lock`` is placed on this node (balanced only): while another node holds it, this
        node reads it each round and asks for it at each tick, so that a hand-over is noticed at once."""

    def placed_elsewhere(self, lock: str, now: float) -> bool:
        """True if ``lock`` is placed on another node (balanced only): this node watches only its expiry."""

    def to_take(self, store: LockStore, free: Mapping[str, str | None], now: float) -> list[str]:
        """Which of the ``free`` locks (lock -> the holder whose lease ran out, or None if
        released) this node tries to take over now (the live nodes may be read again first)."""

    def surplus(self, held: Collection[str], now: float) -> dict[str, str]:
        """The held locks placed on another live node: lock -> that node (the successor)."""

    def successors(self, store: LockStore, held: Collection[str], now: float) -> dict[str, str]:
        """This node stops: the live node each of the ``held`` locks is placed on without it (the
        live nodes read again first); a lock with no such node is left out."""

    def others_seen(self) -> bool:
        """True if the last read of the live nodes showed another node than this one."""

    def leave(self, store: LockStore) -> None:
        """This node stops: its presence is deleted, so the others place its locks at once."""

    def shares(self) -> dict[str, int]:
        """Node id -> how many locks it is placed for ({} when not placing)."""

    def nodes_traits(self) -> dict[str, NodeTraits]:
        """Live node id -> its weight and tags, as last read (this node alone when not placing)."""

    def move_reason(self, lock: str) -> str | None:
        """Why ``lock`` was last placed on another node than before (a node joined, left, its lease
        ran out, or the shares were rebalanced), said once: None after the first call."""


class Restrictions:
    """The ``mutex(nodes=...)`` patterns of each lock: which nodes may hold it (by id or tag)."""

    def __init__(self, node_id: str, traits: NodeTraits | None = None) -> None:
        self.node_id = node_id
        self.traits = traits or NodeTraits()
        self._patterns: dict[str, tuple[str, ...]] = {}
        self._tags: dict[str, tuple[str, ...]] = {node_id: self.traits.tags}  # node id -> its tags, as last read

    def restrict(self, lock: str, patterns: Sequence[str] | None) -> None:
        if patterns is None:
            self._patterns.pop(lock, None)
        else:
            self._patterns[lock] = tuple(patterns)

    def allows(self, lock: str, node_id: str) -> bool:
        """True if ``node_id`` may hold ``lock``."""
        return node_allowed(node_id, self._patterns.get(lock), self._tags.get(node_id, ()))

    def nodes_traits(self) -> dict[str, NodeTraits]:
        return {self.node_id: self.traits}

    def move_reason(self, lock: str) -> str | None:
        return None


class FirstPlacement(Restrictions):
    """``--placement first``: every node asks for every lock it may hold; the first to ask holds it."""

    mode = "first"

    def refresh(self, store: LockStore, locks: Mapping[str, float], now: float, *, force: bool = False) -> None:
        return None

    def asks(self, lock: str, now: float) -> bool:
        return self.allows(lock, self.node_id)

    def placed_here(self, lock: str, now: float) -> bool:
        return False

    def placed_elsewhere(self, lock: str, now: float) -> bool:
        return False

    def to_take(self, store: LockStore, free: Mapping[str, str | None], now: float) -> list[str]:
        return [lock for lock in free if self.allows(lock, self.node_id)]

    def surplus(self, held: Collection[str], now: float) -> dict[str, str]:
        return {}

    def successors(self, store: LockStore, held: Collection[str], now: float) -> dict[str, str]:
        return {}

    def others_seen(self) -> bool:
        return False

    def leave(self, store: LockStore) -> None:
        return None

    def shares(self) -> dict[str, int]:
        return {}
