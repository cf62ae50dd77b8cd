"""Asking the holder of a lock to run some of its jobs once now: one trigger request per job
(:mod:`mutexcron.guard.triggers`), as ``mutexcron resume --catch-up`` and the dashboard's
"Resume + catch up" make them, and what became of each request, said truly.

A request's fire time is its due (the store's clock when it was made). The holder claims that fire
time; a scheduled run of the job that claimed a later fire time first (it started after the
request, while the request waited for the holder) leaves it unclaimable, as claims only go
forward: the request is then merged into that run, and says so ("merged into the run at ...").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timedelta

from ..locks.record import RunRecord
from ..names import printable
from ..tasks.base import TaskRecord, TaskStore

__all__ = ["CATCH_UP_BY", "describe_run", "request_runs", "run_for", "wait_for_runs", "withdraw_stale_request"]

#: Who a catch-up's requests say asked for them.
CATCH_UP_BY = "mutexcron resume --catch-up"


def withdraw_stale_request(tasks: TaskStore, code: str, job: str) -> None:
    """Withdraw an earlier request for ``job`` that must not answer a new one: one that failed, or
    one still queued past its own deadline (store clock: no node that defines the job claimed it
    in time, so the first that does would fail it, and with it the new request)."""
    stale = tasks.get(code, job)
    if stale is None or stale.state == "running":
        return
    if stale.state == "failed" or _past_deadline(stale, tasks.now()):
        tasks.cancel(code, job)


def _past_deadline(request: TaskRecord, now: datetime) -> bool:
    deadline = request.payload.get("deadline") if isinstance(request.payload, dict) else None
    if deadline is None or request.created is None:
        return False
    try:
        return (now - request.created).total_seconds() > float(deadline)
    except (TypeError, ValueError):
        return False


def request_runs(lock_url: str, lock: str, jobs: Sequence[str], requested_by: str = CATCH_UP_BY) -> dict[str, datetime]:
    """One trigger request per job of ``lock``: its holder runs each once now. A job the lock's
    holder no longer has, or that no node runs within
    :data:`~mutexcron.guard.triggers.CATCH_UP_DEADLINE` seconds, fails its request instead of
    waiting forever. A request already pending for a job is kept; an earlier request that failed,
    or that is still queued past its deadline, is withdrawn first (it never answers this one).

    Returns each request's fire time (its due, by the store's clock)."""
    from ..tasks import task_store_from_url
    from .triggers import CATCH_UP_DEADLINE, trigger_code

    payload = {"requested_by": requested_by, "lock": lock, "deadline": CATCH_UP_DEADLINE}
    tasks = task_store_from_url(lock_url)
    fire_times: dict[str, datetime] = {}
    try:
        for job in jobs:
            code = trigger_code(job)  # the nodes that define the job serve it
            withdraw_stale_request(tasks, code, job)
            tasks.add(code, job, timedelta(0), payload, on_conflict="keep")
            request = tasks.get(code, job)
            if request is not None:
                fire_times[job] = request.due
    finally:
        tasks.close()
    return fire_times


def run_for(runs: Sequence[RunRecord], fire_time: datetime) -> RunRecord | None:
    """The run that answered a request of ``fire_time``: the run of that fire time, else the first
    run after it (a scheduled run that claimed a later fire time first)."""
    after = [r for r in runs if r.fire_time is not None and r.fire_time >= fire_time]
    return min(after, key=lambda r: r.fire_time or fire_time) if after else None


def describe_run(run: RunRecord, fire_time: datetime) -> str:
    """What became of the request of ``fire_time`` that ``run`` answered, in words: ``ran at ...`` or
    ``merged into the run at ...``, on which node, and its outcome."""
    node = printable(run.node or "?")
    when = run.fire_time.isoformat() if run.fire_time is not None else "?"
    outcome = "success" if run.outcome == "success" else f"error: {printable(run.error or 'the job failed')}"
    if run.fire_time == fire_time:
        return f"ran at fire time {when} on {node}: {outcome}"
    return (
        f"merged into the run at fire time {when} on {node} (a scheduled run that claimed a later fire time while the "
        f"request of {fire_time.isoformat()} waited for the holder): {outcome}"
    )


def wait_for_runs(lock_url: str, lock: str, requests: dict[str, datetime], timeout: float) -> dict[str, str]:
    """Wait up to ``timeout`` seconds for each request to end; what became of each, by job id.

    A request still pending at the deadline is said to be so (it runs later: ``mutexcron history``
    shows it); a failed one gives its error (a paused lock, a job its holder does not define)."""
    from ..locks import lock_store_from_url
    from ..tasks import task_store_from_url
    from .triggers import trigger_code

    tasks, locks = task_store_from_url(lock_url), lock_store_from_url(lock_url)
    outcomes: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            for job, fire_time in requests.items():
                if job not in outcomes:
                    outcome = _outcome(tasks.get(trigger_code(job), job), locks.history(lock, job), fire_time)
                    if outcome is not None:
                        outcomes[job] = outcome
            if len(outcomes) == len(requests) or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    finally:
        tasks.close()
        locks.close()
    for job, fire_time in requests.items():
        outcomes.setdefault(job, f"not run yet within {timeout:g}s (request of fire time {fire_time.isoformat()} pending): "
                                 f"`mutexcron history {printable(lock)} --job {printable(job)}` shows its run")  # fmt: skip
    return outcomes


def _outcome(request: TaskRecord | None, runs: Sequence[RunRecord], fire_time: datetime) -> str | None:
    """The request's end in words, or None while it is pending."""
    if request is not None and request.due == fire_time:
        if request.state != "failed":
            return None
        return f"not run: {printable(request.last_error or 'the request failed')}"
    run = run_for(runs, fire_time)  # the request completes only once its run is recorded
    if run is None:
        return f"done, but no run at or after fire time {fire_time.isoformat()} is recorded (the lock keeps no history)"
    return describe_run(run, fire_time)
