"""``mutexcron trigger JOB``: ask the cluster to run one guarded job now, through its lock."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import NoReturn

import click

from ..errors import MutexcronError
from ..guard.run_requests import describe_run, run_for, withdraw_stale_request
from ..guard.triggers import NOT_DEFINED, NOT_GUARDED, PAUSED, UNKNOWN, trigger_code
from ..locks import DEFAULT_LOCK_URL, LockStore, lock_store_from_url
from ..locks.record import LockRecord
from ..names import INTERNAL_LOCK_PREFIX, printable
from ..tasks import TaskStore, task_store_from_url
from .common import EXIT_BAD_INPUT, EXIT_FAILURE, _did_you_mean, _fail_on, _lock_url_option
from .ops import node_liveness

#: Exit code when no node ran the job within ``--timeout``.
EXIT_TIMEOUT = 3
#: Exit code when the run started but its outcome is not known (the node running it stopped).
EXIT_UNKNOWN = 4
#: Exit code when the job's lock is paused (nothing ran).
EXIT_PAUSED = 5
#: Seconds a job no lock record names is looked for again before it is refused (a job added a
#: moment ago: a node takes its lock and names it in the record within a second or two).
NEW_JOB_GRACE = 3.0
#: Seconds past ``--timeout`` after which the nodes fail a request no command withdrew.
ORPHAN_GRACE = 30.0


@click.argument("job")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds to wait for the run to be recorded.")  # fmt: skip
@click.option("--force", is_flag=True, help="Request a job no lock record names yet (a guarded job that never ran).")
def _trigger(job: str, timeout: float, force: bool, lock_url: str | None) -> None:
    """Run the guarded job JOB (its job id) once now, on the node that holds its lock.

    The request is a durable task; the node holding the job's lock runs it (if no node holds the
    lock, the next node to take it does), with the request time by the store's clock as its fire
    time, and records it like any run. Exits 0 when the run succeeded, 1 if the job raised (its
    error is printed), 2 if no lock record names the job (a typo, an unguarded job, or a job that
    never ran: --force requests it anyway) or its lock's holder does not define it, 3 if no node
    ran it within --timeout (the request is withdrawn) or no node is running, 4 if the run started
    but its outcome is unknown (the node running it stopped), 5 if its lock is paused.
    """
    url = lock_url or DEFAULT_LOCK_URL
    try:
        locks = lock_store_from_url(url)
    except MutexcronError as exc:
        _fail_on(exc, what="trigger")
    try:
        lock = _lock_of(locks, job, force)
    except MutexcronError as exc:
        _fail_on(exc, what="trigger")
    finally:
        locks.close()
    try:
        store = task_store_from_url(url)
    except MutexcronError as exc:
        _fail_on(exc, what="trigger")
    try:
        _request_and_wait(store, job, timeout, lock, url)
    except MutexcronError as exc:
        _fail_on(exc, what="trigger")
    finally:
        store.close()


def _lock_of(store: LockStore, job: str, force: bool) -> str | None:
    """The lock whose record names ``job``, from what the store already has: its holder's jobs
    (``triggers``, written when it took the lock: a job that never ran included), else the jobs
    that ran under it (their newest fire time). Exits at once when the records say the request
    cannot run: the lock is paused, no record names the job (unless ``force``), or no node is
    running."""
    deadline = time.monotonic() + (0.0 if force else NEW_JOB_GRACE)
    while True:
        records = store.list()
        named, unsure = _naming(records, job)
        if named or unsure or time.monotonic() >= deadline:
            break
        time.sleep(0.5)  # a job added a moment ago: its lock is taken and its record written within a second
    if not named:
        _refuse_a_lock_name(records, job)
    if named and named[-1].paused:
        name = printable(named[-1].name)
        click.echo(f"{printable(job)}: not run: lock {name!r} is paused: run `mutexcron resume {name}` first", err=True)
        raise SystemExit(EXIT_PAUSED)
    if not named and not force and not unsure:
        click.echo(f"{printable(job)}: not requested: {_unknown_job(records, job, store.masked_url)}", err=True)
        raise SystemExit(EXIT_BAD_INPUT)
    try:
        _, live = node_liveness(store.nodes(), records)
    except NotImplementedError:  # a store without presence: no way to tell
        live = None
    if live is not None and not any(live.values()) and not force:
        seen = f" ({len(live)} seen in the last 10 minutes, all stale)" if live else ""
        click.echo(
            f"{printable(job)}: not requested: no node is running: none has written its presence to {store.masked_url} "
            f"lately{seen}. Start `mutexcron run` with the jobs file that defines it",
            err=True,
        )
        raise SystemExit(EXIT_TIMEOUT)
    return named[-1].name if named else None


def _refuse_a_lock_name(records: list[LockRecord], job: str) -> None:
    """Exit at once when ``job`` is the name of a lock whose record names its jobs (``pause`` and
    ``history`` take lock names; ``trigger`` takes a job id)."""
    record = next((r for r in records if r.name == job), None)
    jobs = sorted({*(record.triggers or {}), *record.fire_times} - {job}) if record is not None else []
    if not jobs:
        return
    named = ", ".join(repr(printable(j)) for j in jobs)
    click.echo(f"{printable(job)}: not requested: {printable(job)!r} is a lock, not a job id; its job(s): {named}. "
               f"Run `mutexcron trigger {printable(jobs[0])}`", err=True)  # fmt: skip
    raise SystemExit(EXIT_BAD_INPUT)


def _naming(records: list[LockRecord], job: str) -> tuple[list[LockRecord], bool]:
    """The records naming ``job`` (the best last), and whether one that does not may yet run it: a
    live lock whose holder wrote no jobs (a node of an earlier version, a shared job store's lock),
    where only the request can tell, as before."""
    records = [r for r in records if not r.name.startswith(INTERNAL_LOCK_PREFIX)]  # they guard no job
    named = sorted((r for r in records if job in r.fire_times), key=lambda r: r.fire_times[job])
    named = [r for r in records if r.holder is not None and job in (r.triggers or {})] or named
    return named, any(r.holder is not None and r.triggers is None for r in records)


def _unknown_job(records: list[LockRecord], job: str, shown: str) -> str:
    jobs = sorted({name for r in records for name in (*r.fire_times, *(r.triggers or {}))})
    hint = _did_you_mean(job, jobs, sentence=True)
    return (
        f"no lock record in {shown} names a job {printable(job)!r} (it names {len(jobs)} job{'s' if len(jobs) != 1 else ''})."
        f"{hint} `mutexcron trigger` runs guarded jobs (with a lock: mutex= or @sched.mutex); an unguarded job cannot "
        "be triggered, and --force requests a job no record names yet (its lock was never taken, or by a node of an "
        "earlier version)"
    )


def _request_and_wait(store: TaskStore, job: str, timeout: float, lock: str | None = None, url: str | None = None) -> None:
    # The lock lets its holder fail a request for a job it no longer defines at once; the deadline
    # ends a request this command can no longer withdraw (it was killed) instead of leaving it
    # pending (later than --timeout: while this command waits, it withdraws the request itself).
    deadline = timeout + ORPHAN_GRACE
    payload = {"requested_by": "mutexcron trigger", "deadline": deadline, **({"lock": lock} if lock is not None else {})}
    code = trigger_code(job)  # the nodes that define the job serve it
    withdraw_stale_request(store, code, job)  # a failed or expired earlier request never answers this one
    result = store.add(code, job, timedelta(0), payload, on_conflict="keep")
    request = store.get(code, job)
    fire_time = request.due.isoformat() if request is not None else "?"
    shown = "a trigger was already pending; waiting for it" if result == "kept" else "requested"
    click.echo(f"{job}: {shown} (fire time {fire_time}, store {store.masked_url})", err=True)
    deadline, owner = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        task = store.get(code, job)
        if task is None:
            said = _what_ran(url, lock, job, request.due) if request is not None else None
            click.echo(f"{job}: {said or f'ran at fire time {fire_time}' + (f' on {owner}' if owner else '') + ': success'}")
            return
        if task.state == "failed":
            store.cancel(code, job)
            _report_failed(job, fire_time, task.owner, task.last_error or "")
        owner = task.owner if task.state == "running" else owner
        time.sleep(0.1)
    store.cancel(code, job)
    click.echo(
        f"{job}: no node ran it within {timeout:g}s; the request is withdrawn. Is a node running the jobs file "
        "that defines this job (`mutexcron status` shows the lock and its holder)?",
        err=True,
    )
    raise SystemExit(EXIT_TIMEOUT)


def _what_ran(url: str | None, lock: str | None, job: str, fire_time: datetime) -> str | None:
    """The run that answered the request, in words ("ran at ...", or "merged into the run at ..."
    when a scheduled run claimed a later fire time first); None if the history cannot say."""
    if url is None or lock is None:
        return None
    try:
        locks = lock_store_from_url(url)
    except MutexcronError:
        return None
    try:
        run = run_for(locks.history(lock, job), fire_time)
    except MutexcronError:
        return None
    finally:
        locks.close()
    return describe_run(run, fire_time) if run is not None else None


def _report_failed(job: str, fire_time: str, owner: str | None, error: str) -> NoReturn:
    """A failed request: the job's error (exit 1), a job no lock runs (2), an unknown outcome (4) or a paused lock (5)."""
    for prefix in (NOT_GUARDED, NOT_DEFINED):
        if error.startswith(prefix):
            click.echo(f"{job}: not run: {printable(error.removeprefix(prefix))} (said by {printable(owner)})", err=True)
            raise SystemExit(EXIT_BAD_INPUT)
    if error.startswith(PAUSED):
        click.echo(f"{job}: not run: {printable(error.removeprefix(PAUSED))}", err=True)
        raise SystemExit(EXIT_PAUSED)
    if error.startswith(UNKNOWN):
        click.echo(f"{job}: fire time {fire_time}: unknown: {printable(error.removeprefix(UNKNOWN))}")
        raise SystemExit(EXIT_UNKNOWN)
    click.echo(f"{job}: ran at fire time {fire_time} on {printable(owner)}: error: {printable(error)}")
    raise SystemExit(EXIT_FAILURE)



trigger: click.Command = click.command("trigger", context_settings={"help_option_names": ["-h", "--help"]})(
    _lock_url_option()(_trigger)
)
