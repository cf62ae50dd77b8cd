"""Asking the holder of a lock to run some of its jobs once now: one trigger request per job
(:mod:`mutexcron.guard.triggers`), as ``mutexcron resume --catch-up`` and the dashboard's
"Resume + catch up" make them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

__all__ = ["CATCH_UP_BY", "request_runs"]

#: Who a catch-up's requests say asked for them.
CATCH_UP_BY = "mutexcron resume --catch-up"


def request_runs(lock_url: str, lock: str, jobs: Sequence[str], requested_by: str = CATCH_UP_BY) -> None:
    """One trigger request per job of ``lock``: its holder runs each once now. A job the lock's
    holder no longer has, or that no node runs within
    :data:`~mutexcron.guard.triggers.CATCH_UP_DEADLINE` seconds, fails its request instead of
    waiting forever. A request already pending for a job is kept."""
    from ..tasks import task_store_from_url
    from .triggers import CATCH_UP_DEADLINE, TRIGGER_CODE

    payload = {"requested_by": requested_by, "lock": lock, "deadline": CATCH_UP_DEADLINE}
    tasks = task_store_from_url(lock_url)
    try:
        for job in jobs:
            tasks.add(TRIGGER_CODE, job, timedelta(0), payload, on_conflict="keep")
    finally:
        tasks.close()
