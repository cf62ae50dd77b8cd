"""mutexcron: run one APScheduler jobs file on many servers; each guarded job runs once per fire time."""

from __future__ import annotations

from .asyncio_scheduler import AsyncIOMutexScheduler
from .errors import (
    AttrsError,
    ConfigurationError,
    JobsFileError,
    LeaseError,
    MutexcronError,
    StoreError,
    StoreUnavailableError,
)
from .guard import MutexConfig, MutexThreadPoolExecutor
from .lease import Lease, current_lease
from .locks import LockStore, lock_store_from_url
from .mutex import HeldLease, Mutex
from .record import LockRecord
from .scheduler import BlockingMutexScheduler, MutexScheduler, MutexSchedulerMixin
from .tasks.base import TaskRecord
from .tasks.pool import TaskPool

__version__ = "0.1.0"

__all__ = [
    "AsyncIOMutexScheduler",
    "AttrsError",
    "BlockingMutexScheduler",
    "ConfigurationError",
    "HeldLease",
    "JobsFileError",
    "Lease",
    "LeaseError",
    "LockRecord",
    "LockStore",
    "Mutex",
    "MutexConfig",
    "MutexScheduler",
    "MutexSchedulerMixin",
    "MutexThreadPoolExecutor",
    "MutexcronError",
    "StoreError",
    "StoreUnavailableError",
    "TaskPool",
    "TaskRecord",
    "__version__",
    "current_lease",
    "lock_store_from_url",
]
