"""The scheduler's side of shared job stores, mixed into :class:`~mutexcron.scheduler.MutexSchedulerMixin`:
which stores are shared, turning them into their shared flavour, and APScheduler methods whose
meaning changes on a shared store (a job already removed by another node is not an error)."""

from __future__ import annotations

import logging
from typing import Any

from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.base import STATE_STOPPED

from ..guard import apscheduler_internals as aps
from . import check, is_shared, share
from .node import SharedJobs, lazily

log = logging.getLogger(__name__)


class SharedJobsMixin:
    """Shared job stores for a MutexScheduler (APScheduler's ``BaseScheduler`` comes after it)."""

    @property
    def _shared_jobs(self) -> SharedJobs:
        return lazily(lambda: SharedJobs(self), self)

    def _is_shared_store(self, alias: str) -> bool:
        """True if ``alias`` names a shared job store (a store mutexcron cannot handle is refused)."""
        store = aps.jobstores(self).get(alias)
        if store is None:
            return False  # APScheduler makes a MemoryJobStore for a missing "default"
        check(store, alias)
        return is_shared(store)

    def _share_jobstores(self) -> None:
        """Before the stores start: each persistent one becomes its shared flavour."""
        stores = aps.jobstores(self)
        for alias, store in list(stores.items()):
            stores[alias] = share(store, alias)

    def _has_shared_stores(self) -> bool:
        return any(is_shared(store) for store in aps.jobstores(self).values())

    def add_jobstore(self, jobstore: Any, alias: str = "default", **jobstore_opts: Any) -> None:
        """APScheduler's ``add_jobstore``; a persistent store is shared from the start."""
        if isinstance(jobstore, str):
            jobstore, jobstore_opts = aps.create_jobstore(self, jobstore, jobstore_opts), {}
        super().add_jobstore(share(jobstore, alias), alias, **jobstore_opts)  # type: ignore[misc]

    def remove_job(self, job_id: str, jobstore: str | None = None) -> None:
        """APScheduler's ``remove_job``; a job already removed from a shared store (by another node,
        or by its last run) is not an error there."""
        try:
            super().remove_job(job_id, jobstore)  # type: ignore[misc]
        except JobLookupError:
            if self._shared_jobs.is_kept(job_id):
                return  # changed by another writer during the loop's pass: not removed (no event)
            stores = aps.jobstores(self)
            shared = [a for a, s in stores.items() if is_shared(s) and jobstore in (None, a)]
            if getattr(self, "state", STATE_STOPPED) == STATE_STOPPED or not shared:
                raise
            log.info("job %r was not in job store %s: already removed", job_id, ", ".join(map(repr, shared)))
