"""mutexcron: run one APScheduler jobs file on many servers; each guarded job runs once per fire time."""

from __future__ import annotations

from .asyncio_scheduler import AsyncIOMutexScheduler
from .errors import (
    AttrsError,
    ConfigurationError,
    Defer,
    FailTask,
    JobsFileError,
    LeaseError,
    MutexcronError,
    StaleTaskError,
    StoreError,
    StoreUnavailableError,
)
from .events import (
    EVENT_CAUGHT_UP,
    EVENT_LOCK_ACQUIRED,
    EVENT_LOCK_LOST,
    EVENT_LOCK_PAUSED,
    EVENT_LOCK_RELEASED,
    EVENT_LOCK_RESUMED,
    EVENT_LOCK_TAKEN_OVER,
    EVENT_MUTEX_ALL,
    EVENT_RUN_FINISHED,
    EVENT_RUN_MISSED,
    EVENT_RUN_SKIPPED,
    EVENT_RUN_STARTED,
    EVENT_STORE_DOWN,
    EVENT_STORE_UP,
    MutexEvent,
)
from .guard.job import MutexConfig, MutexThreadPoolExecutor
from .guard.lease import Lease, current_lease
from .locks import LockStore, lock_store_from_url
from .locks.record import LockRecord
from .mutex.lock import HeldLease, Mutex
from .scheduler import BlockingMutexScheduler, MutexScheduler, MutexSchedulerMixin
from .tasks.base import NewTask, Reschedule, TaskRecord
from .tasks.pool import TaskPool
from .version import __version__

__all__ = [
    "EVENT_CAUGHT_UP",
    "EVENT_LOCK_ACQUIRED",
    "EVENT_LOCK_LOST",
    "EVENT_LOCK_PAUSED",
    "EVENT_LOCK_RELEASED",
    "EVENT_LOCK_RESUMED",
    "EVENT_LOCK_TAKEN_OVER",
    "EVENT_MUTEX_ALL",
    "EVENT_RUN_FINISHED",
    "EVENT_RUN_MISSED",
    "EVENT_RUN_SKIPPED",
    "EVENT_RUN_STARTED",
    "EVENT_STORE_DOWN",
    "EVENT_STORE_UP",
    "AsyncIOMutexScheduler",
    "AttrsError",
    "BlockingMutexScheduler",
    "ConfigurationError",
    "Defer",
    "FailTask",
    "HeldLease",
    "JobsFileError",
    "Lease",
    "LeaseError",
    "LockRecord",
    "LockStore",
    "Mutex",
    "MutexConfig",
    "MutexEvent",
    "MutexScheduler",
    "MutexSchedulerMixin",
    "MutexThreadPoolExecutor",
    "MutexcronError",
    "NewTask",
    "Reschedule",
    "StaleTaskError",
    "StoreError",
    "StoreUnavailableError",
    "TaskPool",
    "TaskRecord",
    "__version__",
    "current_lease",
    "lock_store_from_url",
]
