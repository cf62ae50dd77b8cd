"""``mutexcron jobs list|show|pause|resume|remove|run``: the jobs of a jobs file.

``list`` shows every job of the file: the jobs it declares (memory jobs, guarded or not) and the
jobs of its shared job stores, like APScheduler's ``print_jobs``, with each job's lock, lease,
holder and last run. ``run`` runs one job once, here, **unguarded**, for debugging.

The jobs file names the job stores (its ``MutexScheduler(jobstores=...)``) and, with ``--lock-url``
as for ``status``, the lock store. The command starts no scheduler: it reads the stored jobs
(APScheduler's pickled states; a job's function is not imported to list it) and the lock records
(creating nothing), and changes a shared job with the same compare-and-set writes and notices as a
node (:mod:`mutexcron.jobstores.base`), so every node sees the change as from any other writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import os
import traceback
from datetime import datetime, timezone
from typing import Any, NoReturn

import click
from apscheduler.util import obj_to_ref, ref_to_obj

from ..backends.base import reading_only
from ..errors import ConfigurationError, MutexcronError
from ..guard import apscheduler_internals as aps
from ..guard.firetimes import guard_trigger
from ..jobstores import is_shared
from ..jobstores.admin import CHANGES, change_shared_job, is_jobstore_url, jobstore_from_url, shared_stores, stored_rows
from ..jobstores.base import SharedJobStore, timestamp
from ..jobstores.lockstore import shared_lock_url
from ..jobstores.states import load
from ..locks import DEFAULT_LOCK_URL, lock_store_from_url
from ..locks.record import LockRecord
from ..names import printable
from ..readonly import reading_jobs
from ..urls import mask_values, redact
from .common import EXIT_FAILURE, _did_you_mean, _fail, _fail_on, _lock_url_option

__all__ = ["CHANGES", "change_shared_job", "jobs", "shared_stores", "stored_rows"]


def _stores(jobs_file: str) -> tuple[Any, dict[str, SharedJobStore]]:
    """The jobs file's scheduler (imported, never started: an app's own ``start()`` does nothing) and
    its shared job stores."""
    from ..jobsfile import load_scheduler

    if is_jobstore_url(jobs_file):  # a shared job store's URL: no jobs file imported at all
        from .. import MutexScheduler

        with reading_jobs():
            sched: Any = MutexScheduler(jobstores={"default": jobstore_from_url(jobs_file)}, triggers=False)
    else:
        with reading_jobs():
            sched = load_scheduler(jobs_file)
    stores = shared_stores(sched)
    if stores and not sched._lock_url_given:  # as its nodes do: the locks in the shared job store's database
        with contextlib.suppress(ConfigurationError):  # a URL that cannot be told: holders unknown, jobs still listed
            sched.lock_url = shared_lock_url(stores) or sched.lock_url
    return sched, stores


def _need_shared(jobs_file: str, stores: dict[str, SharedJobStore]) -> None:
    if not stores:
        raise ConfigurationError(
            f"{jobs_file} has no shared job store: give MutexScheduler(jobstores={{...}}) a SQLAlchemyJobStore, "
            "RedisJobStore or MongoDBJobStore (mutexcron jobs list shows the jobs the file declares)"
        )


def _when(value: Any) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if isinstance(value, datetime) else "-"


_UNSET = object()


def _declared_rows(sched: Any, stored: set[str]) -> list[dict[str, Any]]:
    """The jobs the file declares (added before ``start()``), but those already in a shared store."""
    now = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    for job, alias, _replace in getattr(sched, "_pending_jobs", []):
        if job.id in stored:
            continue  # listed from its store, where the nodes keep it
        guard = sched.guard_of(job.id)
        func = guard.func if guard is not None else job.func
        given = getattr(job, "next_run_time", _UNSET)
        # A guarded job runs on its guarded trigger (an interval anchored cluster-wide): that one's time.
        trigger = guard_trigger(copy.deepcopy(job.trigger), job.id) if guard is not None else job.trigger
        next_run = trigger.get_next_fire_time(None, now) if given is _UNSET else given
        alias = alias or "default"
        shared = is_shared(aps.jobstores(sched).get(alias))
        rows.append({"job": job.id, "store": alias, "declared": True, "func": _ref(func), "trigger": str(job.trigger),
                     "next_run": next_run, "lock": guard.lock if guard is not None else None,
                     "lease": guard.ttl if guard is not None else None, "guarded": guard is not None,
                     "args": repr(mask_values(tuple(job.args))), "kwargs": repr(mask_values(dict(job.kwargs))),
                     "state": "not stored yet" if shared else ("paused" if next_run is None else "scheduled")})  # fmt: skip
    return rows


def _rows(sched: Any, stores: dict[str, SharedJobStore], lock_url: str, *, declared: bool = True) -> list[dict[str, Any]]:
    """Every job: the shared stores' and (``declared``) the file's own, with holder and last run."""
    try:
        rows = stored_rows(sched, stores)
    except Exception as exc:  # noqa: BLE001 - a driver's error: one line, redacted, exit 1
        where = ", ".join(store.where for store in stores.values())
        first = (str(exc).strip().splitlines() or [""])[0]
        _fail(f"cannot read the jobs of {where}: {type(exc).__name__}: {redact(first)}", EXIT_FAILURE)
    if declared:
        rows += _declared_rows(sched, {r["job"] for r in rows})
    records = _records({r["lock"] for r in rows if r.get("lock")}, lock_url)
    for row in rows:
        record = records.get(row.get("lock") or "")
        row["holder"] = record.holder if record is not None and record.state == "active" else None
        row["last_run"] = record.last_run_finished if record is not None else None
        row["last_error"] = record.last_error if record is not None else None
    rows.sort(key=lambda r: (r.get("next_run") is None, timestamp(r.get("next_run")) or 0.0, r["job"]))
    return rows


def _records(locks: set[str], lock_url: str) -> dict[str, LockRecord]:
    """The lock records of ``locks``, read without creating anything; none (and one note) if unreadable."""
    from .ops import _missing_schema

    if not locks:
        return {}
    try:
        store = reading_only(lock_store_from_url(lock_url))
    except MutexcronError as exc:
        _fail_on(exc, what="jobs")
    try:
        missing = _missing_schema(store)
        if missing:
            click.echo(f"mutexcron: note: {missing} in {store.masked_url}: no node has run yet (no holders)", err=True)
            return {}
        found: dict[str, LockRecord] = store.read_many(locks)
        return found
    except MutexcronError as exc:
        click.echo(f"mutexcron: warning: holders and last runs unknown: {exc}", err=True)
        return {}
    finally:
        store.close()


def _ref(func: Any) -> str:
    try:
        ref: str = obj_to_ref(func)
    except ValueError:  # a lambda, a nested function: no reference, its name
        ref = getattr(func, "__qualname__", repr(func))
    return ref


def _json(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()}


def _open(jobs_file: str, lock_url: str | None) -> tuple[Any, dict[str, SharedJobStore], str]:
    try:
        sched, stores = _stores(jobs_file)
    except MutexcronError as exc:
        _fail_on(exc, what="jobs")
    return sched, stores, lock_url or sched.lock_url or DEFAULT_LOCK_URL


def _open_shared(jobs_file: str, lock_url: str | None) -> tuple[Any, dict[str, SharedJobStore], str]:
    sched, stores, url = _open(jobs_file, lock_url)
    try:
        _need_shared(jobs_file, stores)
    except MutexcronError as exc:
        _fail_on(exc, what="jobs")
    return sched, stores, url


class _JobsGroup(click.Group):
    """``mutexcron jobs``: a jobs file where a verb belongs (``jobs jobs.py``) gets the command it meant."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if name and self.get_command(ctx, name) is None and (name.endswith(".py") or ":" in name or os.path.exists(name)):
            raise click.UsageError(
                f"{name!r} is not a command of mutexcron jobs: to list its jobs, mutexcron jobs list {name}", ctx
            )
        return super().resolve_command(ctx, args)


@click.group("jobs", cls=_JobsGroup, context_settings={"help_option_names": ["-h", "--help"]})
def jobs() -> None:
    """The jobs of a jobs file: list, show, pause, resume, remove (shared jobs), run (once, unguarded).

    JOBS is a jobs file (imported, its scheduler never started), or a shared job store's URL
    (postgresql+psycopg://..., redis://...: read without any jobs file).
    """


@jobs.command("list")
@click.argument("jobs_file", metavar="JOBS")
@_lock_url_option()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_jobs(jobs_file: str, lock_url: str | None, as_json: bool) -> None:
    """Every job of the file and of its shared job stores: next run, trigger, lock, lease, holder, last run."""
    sched, stores, url = _open(jobs_file, lock_url)
    rows = _rows(sched, stores, url)
    if as_json:
        click.echo(json.dumps([_json(r) for r in rows], indent=2))
        return
    click.echo(f"{'JOB':24} {'STORE':8} {'STATE':9} {'NEXT RUN':23} {'LOCK':20} {'LEASE':6} {'HOLDER':24} "
               f"{'LAST RUN':23} TRIGGER")  # fmt: skip
    for r in rows:  # ids, locks, holders and triggers are outside text: shown printable (no escape sequence, no override)
        holder, trigger = printable(r.get("holder") or "-"), printable(r.get("trigger", r.get("error")))
        lock = printable(r.get("lock") or ("-" if "error" in r else "unguarded"))
        lease = f"{r['lease']:g}s" if r.get("lease") else "-"
        click.echo(f"{printable(r['job'])[:24]:24} {r['store'][:8]:8} {r['state'][:9]:9} {_when(r.get('next_run')):23} "
                   f"{lock[:20]:20} {lease:6} {holder[:24]:24} {_when(r.get('last_run')):23} {trigger}")  # fmt: skip
    if not rows:
        click.echo("(no jobs)")


@jobs.command("show")
@click.argument("jobs_file", metavar="JOBS")
@click.argument("job_id", metavar="JOB")
@_lock_url_option()
def show(jobs_file: str, job_id: str, lock_url: str | None) -> None:
    """One job (the file's or a shared store's), every field."""
    sched, stores, url = _open(jobs_file, lock_url)
    rows = _rows(sched, stores, url)
    for row in rows:
        if row["job"] == job_id:
            click.echo(json.dumps(_json(row), indent=2))
            return
    _missing(job_id, [row["job"] for row in rows])


def _missing(job_id: str, names: list[str]) -> NoReturn:
    hint = _did_you_mean(job_id, names)
    _fail(f"no job {printable(job_id)!r} in the jobs file nor in its shared job stores{hint} (mutexcron jobs list shows them)")


def _job_ids(sched: Any, stores: dict[str, SharedJobStore]) -> list[str]:
    """Every job id the file declares or its shared stores hold (for "did you mean")."""
    declared = [job.id for job, _alias, _replace in getattr(sched, "_pending_jobs", [])]
    try:
        stored = [row["job"] for row in stored_rows(sched, stores)]
    except Exception:  # noqa: BLE001 - a hint only: the error itself is the missing job
        stored = []
    return declared + stored


def _change(jobs_file: str, job_id: str, lock_url: str | None, how: str) -> None:
    sched, stores, _url = _open_shared(jobs_file, lock_url)
    try:
        outcome = change_shared_job(stores, job_id, how)
    except MutexcronError as exc:
        _fail_on(exc, what=f"jobs {how}")
    if outcome is None:
        _missing(job_id, _job_ids(sched, stores))
    click.echo(printable(outcome))


@jobs.command("pause")
@click.argument("jobs_file", metavar="JOBS")
@click.argument("job_id", metavar="JOB")
@_lock_url_option()
def pause(jobs_file: str, job_id: str, lock_url: str | None) -> None:
    """Pause a shared job on every node (APScheduler's pause_job: no next run time)."""
    _change(jobs_file, job_id, lock_url, "pause")


@jobs.command("resume")
@click.argument("jobs_file", metavar="JOBS")
@click.argument("job_id", metavar="JOB")
@_lock_url_option()
def resume(jobs_file: str, job_id: str, lock_url: str | None) -> None:
    """Resume a shared job on every node (its next fire time from now)."""
    _change(jobs_file, job_id, lock_url, "resume")


@jobs.command("remove")
@click.argument("jobs_file", metavar="JOBS")
@click.argument("job_id", metavar="JOB")
@_lock_url_option()
def remove(jobs_file: str, job_id: str, lock_url: str | None) -> None:
    """Remove a shared job from its store; every node lets go of its lock."""
    _change(jobs_file, job_id, lock_url, "remove")


_UNGUARDED = (
    "mutexcron: RUNNING JOB {job!r} ONCE, HERE, UNGUARDED, FOR DEBUGGING: no lock is taken and no fire time "
    "is claimed, nothing is recorded in the store (no attrs handed in, its return value is only printed), "
    "and the nodes keep running it on schedule, possibly at this very moment. To run it once on the "
    "cluster, guarded: mutexcron trigger {job}"
)


@jobs.command("run")
@click.argument("jobs_file", metavar="JOBS")
@click.argument("job_id", metavar="JOB")
@_lock_url_option()
def run_once(jobs_file: str, job_id: str, lock_url: str | None) -> None:
    """Run one job once, here, UNGUARDED (no lock, no claim, nothing stored), for debugging.

    Exit 0 if it returned, 1 if it raised (its traceback is printed).
    """
    sched, stores, _url = _open(jobs_file, lock_url)
    func, args, kwargs = _callable(sched, stores, job_id)
    click.echo(click.style(_UNGUARDED.format(job=job_id), fg="yellow", bold=True), err=True)
    try:
        result = func(*args, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
    except Exception:  # noqa: BLE001 - the job's own error: shown in full, as the point of a debug run
        click.echo(traceback.format_exc(), err=True)
        click.echo(f"mutexcron: job {job_id!r} raised (unguarded debug run)", err=True)
        raise SystemExit(EXIT_FAILURE) from None
    click.echo(f"mutexcron: job {job_id!r} returned {result!r} (unguarded debug run: nothing was stored)", err=True)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _callable(sched: Any, stores: dict[str, SharedJobStore], job_id: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The job's own function (never its guard) and arguments, from the file or a shared store."""
    for job, _alias, _replace in getattr(sched, "_pending_jobs", []):
        if job.id == job_id:
            guard = sched.guard_of(job.id)
            return (guard.func if guard is not None else job.func), tuple(job.args), dict(job.kwargs)
    for store in stores.values():
        state = store._read_states([job_id]).get(job_id)
        if state is None:
            continue
        try:
            fields = load(state)
            func = ref_to_obj(fields["func"])
        except Exception as exc:  # noqa: BLE001 - not importable here: say so
            _fail(f"job {job_id!r} in {store.where} cannot be loaded here: {type(exc).__name__}: {exc}", EXIT_FAILURE)
        return func, tuple(fields.get("args") or ()), dict(fields.get("kwargs") or {})
    _missing(job_id, _job_ids(sched, stores))
