"""django-apscheduler's ``DjangoJobStore`` as mutexcron's shared store, for django-apscheduler's own
tests (``jobstore`` fixture of ``django_apscheduler_conftest.py``, with ``MUTEXCRON_DJANGO_SHARED=1``):
made shared as ``MutexScheduler.start()`` makes it, and started with a ``MutexScheduler`` of its own
(a memory lock store; never started, so no lock is taken and no job runs) that holds the lock of
every job it can run, as tests/dropin/mutexcron_shared_jobstores.py does for APScheduler's stores."""

from __future__ import annotations

import secrets
from typing import Any

import mutexcron_shared_jobstores  # noqa: F401 - its node holds every lock it can run (SharedJobs.held_jobs)

from mutexcron import MutexScheduler
from mutexcron.jobstores import share
from mutexcron.locks.memory import MemoryLockStore


def start_shared(store: Any, alias: str) -> Any:
    """``store`` made shared and started by a node of its own."""
    shared = share(store, alias)
    node = MutexScheduler(lock_store=MemoryLockStore(f"memory://django-aps-{secrets.token_hex(3)}"), triggers=False)
    shared.start(node, alias)
    return shared
