"""The cluster's event feed: what happened (locks acquired, released, taken over; runs and tasks
that failed, with their tracebacks; fire times missed; nodes that joined or stopped), kept in the
store the nodes share, within a retention and a bounded size.

Each node writes its own events (:mod:`.writer`, a listener of :mod:`mutexcron.events`); the
dashboard reads the newest. One module per store family: :mod:`.sql`, :mod:`.memory`,
:mod:`.redis`, :mod:`.mongodb`. The feed is an account of what happened, not a decision: losing an event (the
store down, the buffer full) changes nothing a node does, and is said once in the log.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["FEED_KINDS", "MAX_DETAIL", "MAX_EVENTS", "RETENTION", "FeedEvent", "FeedStore", "feed_store_for"]

#: Events kept at most (the oldest go first).
MAX_EVENTS = 10_000
#: Seconds an event is kept (store clock): a week.
RETENTION = 7 * 24 * 3600.0
#: Characters of a traceback kept: its head and, mostly, its innermost frames.
MAX_DETAIL = 8_000

#: Every kind an event may have, and what the dashboard calls it.
FEED_KINDS = {
    "lock_acquired": "acquired",
    "lock_released": "released",
    "lock_lost": "lost or handed over",
    "lock_taken_over": "taken over after expiry",
    "lock_paused": "paused",
    "lock_resumed": "resumed",
    "run_failed": "run failed",
    "run_missed": "missed fire time",
    "task_attempt_failed": "task attempt failed",
    "task_failed": "task failed for good",
    "node_joined": "node joined",
    "node_stopped": "node stopped",
    "node_lost": "node lost",
}


@dataclass(frozen=True)
class FeedEvent:
    """One event of the feed.

    Attributes:
        kind: one of :data:`FEED_KINDS`.
        node: the node it happened on (or, for ``node_lost``, the node lost).
        subject: the lock, or the task code, it is about (None for node events).
        text: one line saying what happened.
        detail: a traceback, masked and bounded (:data:`MAX_DETAIL`), or None.
        fields: what else it says, for links and filters (``job``, ``key``, ``token``, ``fire_time``,
            ``attempt``, ``previous_holder``...), JSON values only.
        at: when, by the store's clock (None until the store stamped it).
    """

    kind: str
    node: str | None
    subject: str | None
    text: str
    detail: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    at: datetime | None = None

    def body(self) -> str:
        """What a store keeps beside kind, node and subject: JSON."""
        return json.dumps({"text": self.text, "detail": self.detail, "fields": self.fields}, default=str)

    @classmethod
    def from_stored(cls, kind: str, node: str | None, subject: str | None, body: str, at: datetime | None) -> FeedEvent:
        data = json.loads(body)
        return cls(kind, node, subject, str(data.get("text", "")), data.get("detail"), dict(data.get("fields") or {}), at)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class FeedStore(ABC):
    """Where the feed is kept: appended by the nodes, read newest first by the dashboard."""

    #: Events kept at most (:data:`MAX_EVENTS`).
    max_events = MAX_EVENTS
    #: :meth:`recent` dates events by their age on the store's clock from this host's clock
    #: (a reader that knows the store's time re-bases them); False: by the store's own clock.
    ages_on_host = True

    @abstractmethod
    def append(self, events: list[FeedEvent]) -> None:
        """Keep ``events`` (stamped with the store's clock), then drop what is past the bounds."""

    @abstractmethod
    def recent(self, limit: int, *, kinds: tuple[str, ...] = (), node: str | None = None,
               subject: str | None = None) -> list[FeedEvent]:  # fmt: skip
        """The newest ``limit`` events, newest first, of the given kinds, node and subject (a read only)."""


def feed_store_for(lock_store: Any) -> FeedStore | None:
    """The feed store beside ``lock_store`` (on its backend: its connection pool, its clock), or
    None for a store that keeps no feed (a test double)."""
    from ...backends.memory import MemoryBackend
    from ...backends.sql import SQLBackend

    backend = getattr(lock_store, "backend", None)
    if isinstance(backend, SQLBackend):
        from .sql import SQLFeedStore

        return SQLFeedStore(backend)
    if isinstance(backend, MemoryBackend):
        from .memory import MemoryFeedStore

        return MemoryFeedStore(backend)
    if type(backend).__name__ == "RedisBackend":  # not imported here: the drivers are the extras'
        from .redis import RedisFeedStore

        return RedisFeedStore(backend)
    if type(backend).__name__ == "MongoDBBackend":
        from .mongodb import MongoDBFeedStore

        return MongoDBFeedStore(backend)
    return None
