"""The feed of a ``memory://`` store: a bounded queue in its space, stamped with its clock."""

from __future__ import annotations

import dataclasses
from collections import deque
from datetime import datetime, timedelta, timezone
from typing import Any

from ...backends.memory import MemoryBackend
from . import RETENTION, FeedEvent, FeedStore

__all__ = ["MemoryFeedStore"]


class MemoryFeedStore(FeedStore):
    """The feed in the memory space of ``backend`` (shared by every store on the same ``memory://NAME``)."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        self._table = backend.table("feed")

    def _events(self) -> deque[tuple[float, FeedEvent]]:
        kept: Any = self._table.setdefault("events", deque())
        return kept  # type: ignore[no-any-return]

    def append(self, events: list[FeedEvent]) -> None:
        with self.backend.mutex:
            kept, now = self._events(), self.backend.clock()
            kept.extend((now, e) for e in events)
            while kept and (len(kept) > self.max_events or kept[0][0] < now - RETENTION):
                kept.popleft()

    def recent(self, limit: int, *, kinds: tuple[str, ...] = (), node: str | None = None,
               subject: str | None = None) -> list[FeedEvent]:  # fmt: skip
        with self.backend.mutex:
            kept, now = list(self._events()), self.backend.clock()
        wall = datetime.now(timezone.utc)
        found = []
        for at, event in reversed(kept):
            if (not kinds or event.kind in kinds) and node in (None, "", event.node) and subject in (None, "", event.subject):
                found.append(dataclasses.replace(event, at=wall - timedelta(seconds=now - at)))
                if len(found) >= limit:
                    break
        return found
