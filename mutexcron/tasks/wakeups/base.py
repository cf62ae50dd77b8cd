"""Wake-ups for the task worker: sleep until the earliest due task, woken early by new work.

A worker loop asks its store for the seconds until the next claimable task
(:meth:`~mutexcron.tasks.TaskStore.next_due`) and sleeps that long in :meth:`Waker.wait`, which
returns early when a task may have become due sooner:

* a task added in this process, or a handler slot freed (:meth:`Waker.notify`);
* a notice from the store, where the store has one (PostgreSQL ``LISTEN/NOTIFY``, Redis publish,
  SQLite ``PRAGMA data_version``): each store's :meth:`~mutexcron.tasks.TaskStore.waker` builds it;
* otherwise a short poll (:class:`PollWaker`).

A wake-up only makes the worker look again: it never claims anything by itself, so a lost notice
costs latency and never a task, and the worker keeps a backstop poll whatever the waker.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

__all__ = ["BACKSTOP_POLL", "DEFAULT_POLL", "PollWaker", "Waker"]

#: Seconds between two looks at the store when no notice arrives, whatever the waker.
BACKSTOP_POLL = 5.0
#: Seconds between two looks for stores without notices (MariaDB/MySQL's ``MIN(due)``, MongoDB).
DEFAULT_POLL = 0.2


class Waker(ABC):
    """What a task worker sleeps on. Thread-safe: :meth:`notify` may come from any thread."""

    def __init__(self) -> None:
        self._local = threading.Event()

    def notify(self) -> None:
        """Wake the waiting worker now (a task added in this process, a handler slot freed)."""
        self._local.set()

    @abstractmethod
    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if a task may have become due sooner.

        Returns True if woken by a notice (local or from the store), False on a timeout or a poll.
        A store notice that cannot be read (a broken listening connection) is not an error: the
        waker falls back to polling and reconnects later.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the waker holds (a listening connection, a subscription)."""


class PollWaker(Waker):
    """Wakes on local notices, and every ``interval`` seconds so the worker looks at the store again."""

    def __init__(self, interval: float = DEFAULT_POLL) -> None:
        super().__init__()
        self.interval = interval

    def wait(self, timeout: float) -> bool:
        woken = self._local.wait(max(0.0, min(timeout, self.interval)))
        self._local.clear()
        return woken
