"""The lease a guarded job runs under, and :func:`current_lease` to read it from inside the job."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..errors import LeaseError

_CURRENT: contextvars.ContextVar[Lease] = contextvars.ContextVar("mutexcron_current_lease")


@dataclass(frozen=True)
class Lease:
    """What a running guarded job knows about its lease.

    Attributes:
        lock: the lock name (also readable as ``name``).
        token: the fencing token; pass it to systems that can reject stale writers.
        node_id: this node's id (the holder).
        fire_time: the scheduled fire time this run claimed (UTC).
        job_id: the job id the fire time was claimed for (also readable as ``job``).
    """

    lock: str
    token: int
    node_id: str
    fire_time: datetime
    job_id: str
    _held: Callable[[str, int], bool] = field(repr=False, compare=False)
    _save: Callable[[Mapping[str, Any]], bool] = field(repr=False, compare=False)

    @property
    def lost(self) -> bool:
        """True once this node no longer holds the lease with this token.

        That is: another node took the lock, or renewals failed for longer than the lease by
        this node's monotonic clock. Check it before side effects in long jobs.
        """
        return not self._held(self.lock, self.token)

    @property
    def name(self) -> str:
        """The lock name: the same as ``lock``."""
        return self.lock

    @property
    def job(self) -> str:
        """The job id: the same as ``job_id``."""
        return self.job_id

    def save(self, attrs: Mapping[str, Any]) -> bool:
        """Checkpoint ``attrs`` in the lock record now, fenced by holder and token.

        Returns False (and stores nothing) if this node no longer holds the lease. Save progress
        *before* an external side effect and a failover can never replay it: if this node dies
        after the side effect, the next holder starts from the saved attrs. The dict the job
        returns at the end is still stored as usual (returning None keeps the checkpoint).

        Raises:
            AttrsError: ``attrs`` are not JSON.
        """
        return self._save(attrs)


def current_lease() -> Lease:
    """The lease of the guarded job running in this thread.

    Raises:
        LeaseError: when called outside a guarded job.
    """
    try:
        return _CURRENT.get()
    except LookupError:
        raise LeaseError(
            "current_lease() was called outside a guarded job: only jobs decorated with @sched.mutex "
            "(or added with mutex=...) run under a lease"
        ) from None


def _enter(lease: Lease) -> contextvars.Token[Lease]:
    return _CURRENT.set(lease)


def _exit(token: contextvars.Token[Lease]) -> None:
    _CURRENT.reset(token)
