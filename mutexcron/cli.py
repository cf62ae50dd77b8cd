"""The ``mutexcron`` command: ``run`` a jobs file, show ``status``, print the SQL ``ddl``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn, TypeVar

import click
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from click.core import ParameterSource

from . import __version__
from .errors import ConfigurationError, MutexcronError
from .locks import DEFAULT_LOCK_URL, SCHEMES, lock_store_from_url
from .record import LockRecord

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

LOG_LEVELS = ["debug", "info", "warning", "error"]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    if level != "debug":  # APScheduler logs every run at INFO; keep ours readable
        logging.getLogger("apscheduler").setLevel(logging.WARNING)


#: Exit codes: 0 ok, 1 a failure at run time (store, drill verdict), 2 bad input (usage, URL, jobs file).
EXIT_FAILURE, EXIT_BAD_INPUT = 1, 2


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    click.echo(f"mutexcron: error: {message}", err=True)
    sys.exit(code)


def _fail_on(exc: BaseException, *, debug: bool = False, what: str = "") -> NoReturn:
    """The one mapping from an error to a message and an exit code."""
    if debug:
        log.exception("%s failed", what or "command")
    if isinstance(exc, ConfigurationError):
        _fail(str(exc), EXIT_BAD_INPUT)
    if isinstance(exc, MutexcronError):
        _fail(f"{what}: {exc}" if what else str(exc), EXIT_FAILURE)
    hint = "" if debug else " (--log-level debug shows the traceback)"
    _fail(f"{what or 'command'} failed: {type(exc).__name__}: {exc}{hint}", EXIT_FAILURE)


def _lock_url_option(help_text: str | None = None) -> Callable[[F], F]:
    """The ``--lock-url`` option every command shares (env ``MUTEXCRON_LOCK_URL``)."""
    text = help_text or (
        f"Lock store URL [env MUTEXCRON_LOCK_URL; default {DEFAULT_LOCK_URL}]. Schemes: {', '.join(SCHEMES)}."
    )
    return click.option("--lock-url", envvar="MUTEXCRON_LOCK_URL", metavar="URL", help=text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mutexcron")
def main() -> None:
    """Run one APScheduler jobs file on several servers; each guarded job runs once per fire time."""


@main.command()
@click.argument("jobs")
@_lock_url_option()
@click.option(
    "--node-id", envvar="MUTEXCRON_NODE_ID", help="This node's id [env MUTEXCRON_NODE_ID; default hostname:pid:random]."
)
@click.option(
    "--unactive-interval",
    type=click.FloatRange(min=0.1),
    envvar="MUTEXCRON_UNACTIVE_INTERVAL",
    help="Default lease length in seconds for guarded jobs that set none [default 10].",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, how long to wait for running guarded jobs and task handlers before releasing their "
    "locks (claimed tasks that have not started are handed back at once).",
)
@click.option(
    "--task-concurrency",
    type=click.IntRange(min=1),
    envvar="MUTEXCRON_TASK_CONCURRENCY",
    help="Threads running task handlers (sched.tasks) on this node [env MUTEXCRON_TASK_CONCURRENCY; default 8].",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    envvar="MUTEXCRON_METRICS_PORT",
    help="Serve Prometheus /metrics and the /healthz and /readyz checks on this port (0: any free port; needs "
    'pip install "mutexcron[metrics]") [env MUTEXCRON_METRICS_PORT; default: not served].',
)
@click.option(
    "--metrics-host",
    envvar="MUTEXCRON_METRICS_HOST",
    metavar="ADDRESS",
    help="The address the metrics port binds [env MUTEXCRON_METRICS_HOST; default 0.0.0.0, every interface].",
)
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.pass_context
def run(
    ctx: click.Context,
    jobs: str,
    lock_url: str | None,
    node_id: str | None,
    unactive_interval: float | None,
    shutdown_timeout: float,
    task_concurrency: int | None,
    metrics_port: int | None,
    metrics_host: str | None,
    log_level: str,
) -> None:
    """Run the scheduler in JOBS (a path to a .py file, or module:attr) until SIGTERM/SIGINT."""
    _setup_logging(log_level)
    debug = log_level == "debug"
    from .loader import load_scheduler

    try:
        # A bad URL is a startup error before the jobs file runs; the store built here is the one
        # the scheduler uses (and closes on shutdown).
        from_flag = lock_url is not None and ctx.get_parameter_source("lock_url") is ParameterSource.COMMANDLINE
        store = lock_store_from_url(lock_url) if lock_url is not None and from_flag else None
        sched = load_scheduler(jobs)
        # Options given on the command line win over the jobs file; environment variables were
        # already read by MutexScheduler() as defaults, below its explicit arguments.
        explicit: dict[str, Any] = {
            name: value
            for name, value in (
                ("node_id", node_id),
                ("unactive_interval", unactive_interval),
                ("task_concurrency", task_concurrency),
                ("metrics_port", metrics_port),
                ("metrics_host", metrics_host),
            )
            if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
        }
        if store is not None:
            explicit["lock_store"] = store
        sched.configure_mutex(shutdown_timeout=shutdown_timeout, **explicit)
        stopper = _GracefulStop(sched, shutdown_timeout)
        signal.signal(signal.SIGTERM, stopper.on_signal)
        signal.signal(signal.SIGINT, stopper.on_signal)
        if isinstance(sched, AsyncIOScheduler):
            asyncio.run(_serve_on_loop(sched, stopper))
        else:
            sched.start()  # a BlockingMutexScheduler returns from here only once it is shut down
    except Exception as exc:  # noqa: BLE001 - any startup failure is one message and an exit code
        _fail_on(exc, debug=debug, what="startup")
    stopper.wait()
    running = sched.running_guarded_jobs()
    tasks = sched.running_tasks()
    if running or tasks:
        # Their threads would keep the process alive; their leases run out and other nodes take over.
        busy = [*running, *(f"task {code}/{key}" for code, key in tasks)]
        log.warning("exiting with guarded jobs or task handlers still running: %s", ", ".join(busy))
        logging.shutdown()
        os._exit(1)
    log.info("stopped")


async def _serve_on_loop(sched: Any, stopper: _GracefulStop) -> None:
    """Run an asyncio-flavoured scheduler until a signal's graceful stop has finished.

    The stop runs on the stopper's thread (it waits for guarded runs while the loop keeps them
    going), so this coroutine only waits for it.
    """
    sched.start()
    await asyncio.to_thread(stopper.wait)


class _GracefulStop:
    """SIGTERM/SIGINT: stop the scheduler gracefully, once; a second signal exits at once.

    The stop runs on a thread of its own, so it works while a BlockingMutexScheduler's
    ``start()`` holds the main thread.
    """

    def __init__(self, sched: Any, shutdown_timeout: float) -> None:
        self.sched = sched
        self.shutdown_timeout = shutdown_timeout
        self.signals: list[tuple[int, float]] = []
        self.signalled = threading.Event()
        self.thread = threading.Thread(target=self._stop, name="mutexcron-stop")

    def on_signal(self, signum: int, _frame: Any) -> None:
        # One that arrives within a second of the first is the same stop delivered twice (e.g.
        # to the process and to its process group).
        now = time.monotonic()
        if self.signals and now - self.signals[0][1] > 1.0:
            log.error("second signal: exiting now without waiting for jobs or releasing locks")
            os._exit(128 + signum)
        if not self.signals:
            self.signals.append((signum, now))
            self.thread.start()
            self.signalled.set()

    def _stop(self) -> None:
        name = signal.Signals(self.signals[0][0]).name
        log.info(
            "%s received: stopping (waiting up to %ss for running guarded jobs and task handlers)",
            name,
            self.shutdown_timeout,
        )
        self.sched.shutdown(wait=True)

    def wait(self) -> None:
        """Block until a signal's graceful stop has finished."""
        while not self.signalled.wait(3600):  # the handler runs in this thread and sets it
            pass
        self.thread.join()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _clip(text: str | None, width: int) -> str:
    text = "-" if text in (None, "") else " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def format_status(records: list[LockRecord]) -> str:
    """The ``status`` table."""
    header = ("NAME", "HOLDER", "ACTIVE_IP", "HEARTBEAT", "STATE", "TOKEN", "LAST FIRE (UTC)", "LAST ERROR", "ATTRS")
    rows = [
        (
            _clip(r.name, 32),
            _clip(r.holder, 36),
            r.active_ip or "-",
            _age(r.heartbeat_age),
            r.state,
            str(r.token),
            _when(r.last_fire_time),
            _clip(r.last_error, 30),
            _clip(json.dumps(dict(r.attrs), ensure_ascii=False, sort_keys=True) if r.attrs else "", 40),
        )
        for r in records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)]
    return "\n".join(lines)


@main.command()
@click.argument("jobs", required=False)
@_lock_url_option()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(jobs: str | None, lock_url: str | None, as_json: bool) -> None:
    """Show every lock in the store: holder, heartbeat age, state, token, last run.

    With JOBS (a jobs file), use that scheduler's lock store unless --lock-url is given.
    """
    from .cli_tasks import task_status

    _setup_logging("warning")
    sched = None
    try:
        if jobs:
            from .loader import load_scheduler

            sched = load_scheduler(jobs)
            lock_url = lock_url or sched.lock_url
        store = lock_store_from_url(lock_url or DEFAULT_LOCK_URL)
    except MutexcronError as exc:
        _fail_on(exc, what="status")
    try:
        records = store.list()
    except MutexcronError as exc:
        _fail_on(exc, what="status")
    finally:
        store.close()
    task_report = task_status(lock_url or DEFAULT_LOCK_URL, sched)
    if as_json:
        locks = [r.to_json() for r in records]
        click.echo(json.dumps({"store": store.masked_url, "locks": locks, "tasks": task_report.to_json()}, indent=2))
        return
    click.echo(f"lock store: {store.masked_url}  ({len(records)} lock{'s' if len(records) != 1 else ''})")
    if records:
        click.echo(format_status(records))
    for line in task_report.lines():
        click.echo(line)


@main.command()
@_lock_url_option()
def ddl(lock_url: str | None) -> None:
    """Print the CREATE TABLE statements for a SQL lock store (for teams that manage their schema)."""
    try:
        store = lock_store_from_url(lock_url or DEFAULT_LOCK_URL)
    except MutexcronError as exc:
        _fail_on(exc, what="ddl")
    from .cli_tasks import schemaless_note, task_ddl

    try:
        statements: Callable[[], list[str]] | None = getattr(store, "ddl", None)
        if statements is None:
            _fail(f"{store.masked_url} has no schema to create: only SQL stores have DDL. {schemaless_note(store)}".strip())
        for statement in [*statements(), *task_ddl(lock_url or DEFAULT_LOCK_URL)]:
            click.echo(statement.strip() + ("\n" if statement.startswith("--") else ";\n"))
    finally:
        store.close()


@main.command()
@_lock_url_option(
    "The store to drill [env MUTEXCRON_LOCK_URL; required]. To keep the drill's record out of your "
    "lock table, point it at a table or namespace of its own (?table=mutexcron_drill, ?namespace=drill)."
)
@click.option("--nodes", type=click.IntRange(min=3, max=32), default=3, show_default=True, help="Node processes to start.")
@click.option(
    "--unactive-interval",
    type=click.FloatRange(min=0.5),
    default=3.0,
    show_default=True,
    help="Lease length in seconds; failover must happen within it + 1 s.",
)
@click.option(
    "--duration", type=click.FloatRange(min=10), default=60.0, show_default=True, help="Seconds the whole drill lasts."
)
@click.option(
    "--skew",
    type=float,
    default=0.0,
    metavar="SECONDS",
    help="Shift node i's wall clock by i x SECONDS (needs libfaketime: apt-get install faketime).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout (progress stays on stderr).")
@click.option(
    "--tasks",
    "tasks_mode",
    is_flag=True,
    help="Drill the task pool instead of the cron locks: the nodes run tasks of the drill's own code "
    "(mutexcron-drill-<random>, removed at the end); --unactive-interval is the task lease.",
)
@click.option(
    "--task-rate",
    type=click.FloatRange(min=0.5, max=200),
    default=4.0,
    show_default=True,
    help="With --tasks: tasks added per second, due 0-3 s ahead.",
)
def drill(
    lock_url: str | None,
    nodes: int,
    unactive_interval: float,
    duration: float,
    skew: float,
    as_json: bool,
    tasks_mode: bool,
    task_rate: float,
) -> None:
    """A failover drill against your store: N local nodes, SIGKILL, SIGSTOP and SIGTERM of the holder.

    The nodes guard one every-second job under a lock of the drill's own
    (mutexcron-drill-<random>). Exit 0 on PASS, 1 on FAIL, 2 if the drill could not run,
    130 if interrupted. Everything is cleaned up, also after Ctrl-C; the drill lock stays in the
    store as a released record (records are never deleted, so fencing tokens never go back).

    With --tasks, the same faults hit nodes running task handlers while the drill adds tasks: no
    task may be lost, a stale attempt's completion must be refused, and a killed, frozen or
    stopped node's tasks must start again on another node in time.
    """
    from .drill import format_report, format_task_report, run_drill, run_task_drill

    _setup_logging("warning")
    if not lock_url:
        _fail("drill needs the store to test: --lock-url URL (or MUTEXCRON_LOCK_URL)")
    if tasks_mode and skew:
        _fail("--skew is for the lock drill: the task drill judges leases and due times by the store's clock only")

    def progress(message: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {message}", err=True)

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # the drill cleans up on its way out, as for Ctrl-C

    previous = signal.signal(signal.SIGTERM, interrupt)
    report: Any
    try:
        if tasks_mode:
            report = run_task_drill(
                lock_url, nodes=nodes, lease=unactive_interval, duration=duration, rate=task_rate, progress=progress
            )
        else:
            report = run_drill(
                lock_url, nodes=nodes, unactive_interval=unactive_interval, duration=duration, skew=skew, progress=progress
            )
    except KeyboardInterrupt:
        click.echo("mutexcron: drill interrupted; nodes stopped and temporary files removed", err=True)
        sys.exit(130)
    except MutexcronError as exc:
        _fail_on(exc, what="the drill could not run")
    finally:
        signal.signal(signal.SIGTERM, previous)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(format_task_report(report) if tasks_mode else format_report(report))
    sys.exit(0 if report.passed else 1)


from . import cli_tasks  # noqa: E402 - it uses the helpers above

main.add_command(cli_tasks.tasks)

from . import cli_trigger  # noqa: E402

main.add_command(cli_trigger.trigger)

from . import cli_ops  # noqa: E402

main.add_command(cli_ops.history)
main.add_command(cli_ops.pause)
main.add_command(cli_ops.resume)
main.add_command(cli_ops.status)  # replaces the status above: its lock table (+ PAUSED), nodes, pauses, last runs

if __name__ == "__main__":  # pragma: no cover
    main()
