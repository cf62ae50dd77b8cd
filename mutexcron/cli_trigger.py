"""``mutexcron trigger JOB``: ask the cluster to run one guarded job now, through its lock."""

from __future__ import annotations

import time
from datetime import timedelta

import click

from .errors import MutexcronError
from .locks import DEFAULT_LOCK_URL
from .tasks import TaskStore, task_store_from_url
from .triggers import TRIGGER_CODE

#: Exit code when no node ran the job within ``--timeout``.
EXIT_TIMEOUT = 3


@click.argument("job")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds to wait for the run to be recorded.")  # fmt: skip
def _trigger(job: str, timeout: float, lock_url: str | None) -> None:
    """Run the guarded job JOB (its job id) once now, on the node that holds its lock.

    The request is a durable task; the node holding the job's lock runs it (if no node holds the
    lock, the next node to take it does), with the request time by the store's clock as its fire
    time, and records it like any run. Exits 0 when the run succeeded, 1 if the job raised (its
    error is printed), 3 if no node ran it within --timeout (the request is withdrawn).
    """
    try:
        store = task_store_from_url(lock_url or DEFAULT_LOCK_URL)
    except MutexcronError as exc:
        _fail_on(exc, what="trigger")
    try:
        _request_and_wait(store, job, timeout)
    except MutexcronError as exc:
        _fail_on(exc, what="trigger")
    finally:
        store.close()


def _request_and_wait(store: TaskStore, job: str, timeout: float) -> None:
    result = store.add(TRIGGER_CODE, job, timedelta(0), {"requested_by": "mutexcron trigger"}, on_conflict="keep")
    request = store.get(TRIGGER_CODE, job)
    fire_time = request.due.isoformat() if request is not None else "?"
    shown = "a trigger was already pending; waiting for it" if result == "kept" else "requested"
    click.echo(f"{job}: {shown} (fire time {fire_time}, store {store.masked_url})", err=True)
    deadline, owner = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        task = store.get(TRIGGER_CODE, job)
        if task is None:
            click.echo(f"{job}: ran at fire time {fire_time}{f' on {owner}' if owner else ''}: success")
            return
        if task.state == "failed":
            store.cancel(TRIGGER_CODE, job)
            click.echo(f"{job}: ran at fire time {fire_time} on {task.owner}: error: {task.last_error}")
            raise SystemExit(EXIT_FAILURE)
        owner = task.owner if task.state == "running" else owner
        time.sleep(0.1)
    store.cancel(TRIGGER_CODE, job)
    click.echo(
        f"{job}: no node ran it within {timeout:g}s; the request is withdrawn. Is a node running the jobs file "
        "that defines this job (`mutexcron status` shows the lock and its holder)?",
        err=True,
    )
    raise SystemExit(EXIT_TIMEOUT)


from .cli import EXIT_FAILURE, _fail_on, _lock_url_option  # noqa: E402 - cli.py imports this module at its end

trigger: click.Command = click.command("trigger", context_settings={"help_option_names": ["-h", "--help"]})(
    _lock_url_option()(_trigger)
)
