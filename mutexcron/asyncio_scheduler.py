"""AsyncIOMutexScheduler: APScheduler's AsyncIOScheduler with guarded ``async def`` jobs."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from .scheduler import MutexSchedulerMixin

log = logging.getLogger(__name__)


class AsyncIOMutexScheduler(MutexSchedulerMixin, AsyncIOScheduler):  # type: ignore[misc]
    """A scheduler on an asyncio event loop: guarded ``async def`` jobs run on the loop.

    Store calls run on worker threads and leases are renewed by the heartbeat thread, so a job that
    blocks the loop delays neither. Call ``start()`` from inside the running loop (a FastAPI
    lifespan, ``asyncio.run(main())``), and stop with ``await sched.shutdown_async()``.
    """

    _runs_coroutines = True

    def _create_default_executor(self) -> Any:
        from .guard.job_async import MutexAsyncIOExecutor

        return MutexAsyncIOExecutor()

    def _mutex_executor(self, executor: Any) -> Any:
        from apscheduler.executors.asyncio import AsyncIOExecutor

        return self._create_default_executor() if type(executor) is AsyncIOExecutor else None

    async def shutdown_async(self, wait: bool = True) -> None:
        """``shutdown()`` from inside the event loop: waits for guarded runs without blocking it."""
        await asyncio.to_thread(self._stop_leases, self.shutdown_timeout if wait else 0.0)
        self.shutdown(wait=False)

    def shutdown(self, wait: bool = True) -> None:
        """Stop scheduling and release the leases. Called on the loop's own thread it cannot wait
        for coroutine jobs (they need the loop): use ``await shutdown_async()`` there."""
        if wait and self._on_loop_thread():
            log.warning("shutdown() on the event loop cannot wait for guarded coroutine jobs; "
                        "use `await sched.shutdown_async()`")
            wait = False
        super().shutdown(wait)

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._eventloop
        except RuntimeError:
            return False
