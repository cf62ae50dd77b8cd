"""Batched fire claims: the holder claims every guarded job due at one instant in one round trip.

APScheduler's loop submits the jobs due at one instant one after another. While that loop runs,
mutexcron's executor collects the guarded ones (:class:`ClaimBatch`) instead of starting them.
When the loop is done, one task on the executor's pool makes **one** ``claim_many`` call for all
the collected jobs whose lock this node holds: each claim is atomic with the holder-and-token
check of its lock and renews that lease, as a single ``acquire_or_renew`` would. Then each won
claim starts its run, which only checks the lease against the monotonic deadline before the job's
first line (no second store call). Jobs whose lock this node does not hold take the ordinary
per-job path (a standby with a fresh view of the holder makes no store call at all).

The store call runs on the pool, never on APScheduler's loop thread, so a slow store cannot delay
unguarded jobs.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from ..events import EVENT_RUN_SKIPPED, MutexEvent
from ..locks import FireClaim, HeldClaim
from ..locks.record import us_from_datetime
from . import apscheduler_internals as aps
from .firetimes import slot_of

log = logging.getLogger(__name__)

@dataclass
class Preclaim:
    """A run a batch claimed: its token, and whether the guarded job took over its counted run."""

    token: int
    taken: bool = False


#: Set only while a pre-claimed run starts.
PRECLAIMED: contextvars.ContextVar[Preclaim] = contextvars.ContextVar("mutexcron_preclaimed")


@dataclass
class _Entry:
    executor: Any
    job: Any
    run_time: datetime
    slot: datetime


class ClaimBatch:
    """The guarded submissions of one pass of APScheduler's loop, on the loop's thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def open(self) -> None:
        self._local.entries = []

    def collecting(self) -> bool:
        return getattr(self._local, "entries", None) is not None

    def add(self, executor: Any, job: Any, run_times: list[datetime]) -> None:
        for run_time in run_times:
            self._local.entries.append(_Entry(executor, job, run_time, slot_of(job.trigger, run_time)))

    def close(self) -> list[_Entry]:
        entries: list[_Entry] = self._local.entries
        self._local.entries = None
        return entries


def run_batch(
    entries: list[_Entry], start_one: Callable[[_Entry, int | None], None], counted: Callable[[], None] = lambda: None
) -> None:
    """Claim the held locks' fire times in one round trip, then start every run.

    ``start_one(entry, token)`` submits one run: with the token it won (a pre-claimed run), or with
    None for the ordinary per-job path. ``counted`` is called once the runs of held locks are
    counted as running (before the claim's store call), whatever happens.
    """
    try:
        manager, claims, elsewhere = _count_runs(entries, start_one)
    finally:
        counted()
    if claims:
        _claim_and_start(manager, claims, start_one)
    for entry in elsewhere:
        _run_here(entry)


def _count_runs(
    entries: list[_Entry], start_one: Callable[[_Entry, int | None], None]
) -> tuple[Any, list[tuple[_Entry, HeldClaim]], list[_Entry]]:
    """The lease manager; each run of a held lock counted as running, with its claim; the others
    started on the ordinary path, or set aside to skip here (held elsewhere)."""
    by_lock: dict[str, list[_Entry]] = {}
    for entry in entries:
        by_lock.setdefault(entry.job.func.lock, []).append(entry)
    manager = entries[0].job.func.context.leases if entries else None
    claims: list[tuple[_Entry, HeldClaim]] = []
    elsewhere: list[_Entry] = []
    if manager is None:
        return manager, claims, elsewhere
    held = manager.held()
    for lock, group in by_lock.items():
        token = held.get(lock)
        for entry in group:
            if token is None and _held_elsewhere(manager, entry):
                elsewhere.append(entry)  # skipped here, after this node's own runs have started
                continue
            if token is None or _misfired(entry) or not manager.begin_run(lock):
                _start(entry, None, start_one)  # not held here, or too late, or stopping: the ordinary path decides
                continue
            claim = FireClaim.new(entry.job.func.job_id, us_from_datetime(entry.slot))
            claims.append((entry, HeldClaim(lock, token, claim)))
    return manager, claims, elsewhere


def _held_elsewhere(manager: Any, entry: _Entry) -> bool:
    """A fresh view says another node holds the job's lock: its run only skips, with no store call
    and no code of the user's (no ``lock_else``), so it can run on the batch's thread."""
    config, views = getattr(entry.job.func, "config", None), getattr(manager, "views", None)
    if config is None or config.lock_else is not None or views is None:
        return False
    return bool(views.holds_elsewhere(entry.job.func.lock, manager.clock()))


def _run_here(entry: _Entry) -> None:
    """Run a fire time on this thread, reported to APScheduler as the pool would (its events, its
    instance given back): the guarded job decides, as on the pool, and only skips."""
    aps.run_inline(entry.executor, entry.job, lambda: entry.executor.run_here(entry.job, [entry.run_time]))


def _claim_and_start(
    manager: Any, claims: list[tuple[_Entry, HeldClaim]], start_one: Callable[[_Entry, int | None], None]
) -> None:
    try:
        won = manager.claim_batch([held for _entry, held in claims])
    except Exception:  # never leave runs counted and instances taken: nothing runs, all is given back
        log.exception("batched claim of %d fire time(s) failed; none of them runs", len(claims))
        won = None
    for entry, held in claims:
        if won is not None and held.claim.nonce in won:
            if not _start(entry, held.token, start_one):
                manager.end_run(held.lock)  # _start gave the instance back
            continue  # a started run ends its counted run itself
        manager.end_run(held.lock)
        if won is not None and manager.holds(held.lock, held.token):
            reason = "paused" if manager.paused(held.lock) else "already-run"
            manager.emit(MutexEvent(EVENT_RUN_SKIPPED, lock=held.lock, job_id=entry.job.id, node=manager.node.node_id,
                                    token=held.token, fire_time=entry.slot, reason=reason))  # fmt: skip
        aps.release_instance(entry.executor, entry.job)  # free the instance APScheduler counted


def _start(entry: _Entry, token: int | None, start_one: Callable[[_Entry, int | None], None]) -> bool:
    """Submit one run; if that fails (the pool was shut down by a stop, no thread could be started),
    give back the instance APScheduler counted, so the job is not skipped as "still running" forever.
    Never raises: one failed start must not leave the batch's other runs counted and unstarted."""
    try:
        start_one(entry, token)
        return True
    except Exception as exc:  # noqa: BLE001 - any failure: this run does not start, the others do
        if isinstance(exc, RuntimeError) and "shutdown" in str(exc):
            log.info("job %r: not started, the scheduler is stopping", entry.job.id)
        else:
            log.error("job %r: the run for %s could not be started (%s); this fire time does not run here",
                      entry.job.id, entry.run_time, exc)  # fmt: skip
        aps.release_instance(entry.executor, entry.job)
        return False


def _misfired(entry: _Entry) -> bool:
    """Past the job's misfire grace time: APScheduler will not run it, so do not claim it."""
    grace = entry.job.misfire_grace_time
    return grace is not None and datetime.now(timezone.utc) - entry.run_time > timedelta(seconds=grace)
