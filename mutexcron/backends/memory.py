"""``memory://``: the in-process backend, for tests and single-process use.

``memory://`` gives a private space; ``memory://NAME`` shares one space between every
``memory://NAME`` backend in the same process (handy for several schedulers in one test). Each
store keeps its rows in a table of that space, under one mutex. The clock is ``clock``
(monotonic seconds), injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

from .base import Backend


class _Space:
    """Tables of one ``memory://NAME``, and the mutex every operation on them holds."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Any]] = {}
        self.mutex = threading.Lock()


class MemoryBackend(Backend):
    """Dicts behind a mutex, in this process."""

    kind = "memory"
    _named: ClassVar[dict[str, _Space]] = {}
    _named_mutex: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, url: str = "memory://", *, clock: Callable[[], float] | None = None) -> None:
        super().__init__(url)
        #: The store's clock: monotonic seconds.
        self.clock = clock or time.monotonic
        name = url.partition("://")[2].strip("/")
        if name:
            with self._named_mutex:
                self._space = self._named.setdefault(name, _Space())
        else:
            self._space = _Space()

    @property
    def mutex(self) -> threading.Lock:
        """Held by every operation on this space's tables."""
        return self._space.mutex

    def table(self, name: str) -> dict[str, Any]:
        """The table ``name`` of this space (created empty), shared by every backend on the same ``memory://NAME``."""
        with self._space.mutex:
            return self._space.tables.setdefault(name, {})

    def wall(self, at: float | None, now: float) -> datetime | None:
        """The UTC wall time of clock reading ``at``, given the reading ``now`` taken just before."""
        if at is None:
            return None
        return datetime.now(timezone.utc) - timedelta(seconds=now - at)

    def ping(self) -> None:
        with self._space.mutex:
            pass
