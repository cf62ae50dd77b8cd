"""Importing a jobs file only to read its jobs (``mutexcron jobs``): its scheduler is never started.

An embedded app may call ``sched.start()`` as it is imported. Read under :func:`reading_jobs`,
that call does nothing (one INFO line), so reading an app's jobs never adds a node to the cluster,
takes no lock and runs no job.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_READING: contextvars.ContextVar[bool] = contextvars.ContextVar("mutexcron_reading_jobs", default=False)


@contextmanager
def reading_jobs() -> Iterator[None]:
    """While this is open, ``MutexScheduler.start()`` does nothing: the jobs file is only read."""
    token = _READING.set(True)
    try:
        yield
    finally:
        _READING.reset(token)


def only_reading() -> bool:
    """True inside :func:`reading_jobs`."""
    return _READING.get()
