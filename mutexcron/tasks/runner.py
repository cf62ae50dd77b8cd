"""What a scheduler does with its task pool (``sched.tasks``): start a worker for the pool's
handlers beside the cron jobs, renew its tasks in the heartbeat thread, stop it first on shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..backends import family_of
from ..errors import ConfigurationError
from ..events import Emit, log_event
from .pool import TaskPool
from .worker import DEFAULT_CONCURRENCY, TaskWorker

__all__ = ["TaskRunner"]

log = logging.getLogger(__name__)


class Heartbeat(Protocol):
    """The part of :class:`~mutexcron.heartbeat.LeaseManager` the task worker uses."""

    def attach(self, round_: Callable[[], float | None]) -> None: ...

    def wake(self) -> None: ...


class TaskRunner:
    """A scheduler's task pool and, once started with handlers, its worker.

    Args:
        url: the scheduler's store URL (the pool's store is built on first use).
        concurrency: handler threads on this node.
    """

    def __init__(self, url: str, concurrency: int = DEFAULT_CONCURRENCY) -> None:
        self.pool = TaskPool._bound(url)
        self.concurrency = concurrency
        self.worker: TaskWorker | None = None

    def available(self) -> bool:
        """True if the pool's store URL names a store family with a task store (no connection made)."""
        if self.pool._store is not None:
            return True
        try:
            return family_of(self.pool._url, "task store").task_store is not None
        except ConfigurationError:
            return False

    def rebind(self, url: str) -> None:
        """The scheduler's store URL changed before start (``configure_mutex``)."""
        self.pool._rebind(url)

    def start(self, node_id: str, heartbeat: Heartbeat, emit: Emit = log_event) -> None:
        """Start a worker for the pool's handlers (nothing without handlers)."""
        if not self.pool.handlers or self.worker is not None:
            return
        store = self.pool.store  # a bad URL fails here, before anything starts
        size_pool = getattr(getattr(store, "backend", None), "size_pool", None)
        if size_pool is not None:  # handler threads, the claim thread, the heartbeat
            size_pool(self.concurrency + 3)
        worker = TaskWorker(store, self.pool.handlers, node_id, concurrency=self.concurrency, emit=emit)
        worker.on_renew_needed = heartbeat.wake
        worker.clock_offset = lambda: getattr(heartbeat, "clock_offset", None)
        heartbeat.attach(worker.renew_round)
        self.pool._on_add = lambda _code: worker.notify()
        self.pool._on_handler = lambda handler: worker.add_handlers({handler.code: handler})
        self.worker = worker
        worker.start()

    def stop(self, timeout: float) -> None:
        """Stop claiming, hand back unstarted tasks, wait up to ``timeout`` for running handlers."""
        if self.worker is not None:
            self.worker.stop(timeout)

    def close(self) -> None:
        """Close the pool's store (after :meth:`stop`), unless a handler still runs on it."""
        if self.worker is not None and self.worker.running():
            return
        self.pool.close()
