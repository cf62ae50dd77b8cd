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
from datetime import timedelta
from typing import Any

import click
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from click.core import ParameterSource

from ..console import URLS_HINT
from ..dashboard.cli import dashboard
from ..errors import MutexcronError
from ..locks import DEFAULT_LOCK_URL, URL_ENV, defaulted_urls, lock_store_from_url
from ..placement import PLACEMENTS
from ..urls import mask_url
from ..version import __version__
from . import ops as cli_ops
from . import tasks as cli_tasks
from . import trigger as cli_trigger
from . import urls as cli_urls
from .common import (
    EXIT_FAILURE,
    LOG_LEVELS,
    _fail,
    _fail_on,
    _lock_url_option,
    _setup_logging,
)
from .progress import Progress
from .stop import GracefulStop

log = logging.getLogger(__name__)

#: ``run --startup-timeout``: long enough for a database started with the node (a boot, a
#: compose file) to come up; short enough that a wrong password or host shows as a failed unit.
DEFAULT_STARTUP_TIMEOUT = 300.0


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mutexcron")
@click.option(
    "--lock-url", metavar="URL", help="Lock store URL for the command that follows (as its own --lock-url). " + URLS_HINT
)
def main(lock_url: str | None) -> None:
    """Run one APScheduler jobs file on several servers; each guarded job runs once per fire time.

    Shell completion: eval "$(_MUTEXCRON_COMPLETE=bash_source mutexcron)" in ~/.bashrc (zsh_source
    in ~/.zshrc; fish: _MUTEXCRON_COMPLETE=fish_source mutexcron | source).
    """


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
    "--task-retention",
    metavar="AGE",
    envvar="MUTEXCRON_TASK_RETENTION",
    callback=cli_tasks.age_option,
    help="Keep finished tasks this long (7d, 12h, 90s), then prune them (one node at a time); 0 keeps everything "
    "[env MUTEXCRON_TASK_RETENTION; default 7d].",
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
    help="The address the metrics port binds [env MUTEXCRON_METRICS_HOST; default 127.0.0.1, this host only; "
    "0.0.0.0 exposes it on every interface].",
)
@click.option(
    "--startup-timeout",
    type=click.FloatRange(min=0),
    envvar="MUTEXCRON_STARTUP_TIMEOUT",
    default=DEFAULT_STARTUP_TIMEOUT,
    show_default=True,
    help="Exit with status 1 if the store has not answered once within this many seconds of start (a wrong "
    "password, host or database name: the node fails visibly instead of staying up guarding nothing); 0: wait "
    "forever. Once the store has answered, an outage never stops the node [env MUTEXCRON_STARTUP_TIMEOUT].",
)
@click.option(
    "--placement",
    type=click.Choice(PLACEMENTS),
    envvar="MUTEXCRON_PLACEMENT",
    help="Which locks this node asks for: balanced (the default), every live node its fair share of the guarded "
    "locks, each move handed over at a fire-time boundary; first, every node asks for every lock and the first "
    "holds it (the behaviour of earlier releases) [env MUTEXCRON_PLACEMENT; default balanced].",
)
@click.option(
    "--hand-over-wait",
    type=click.FloatRange(min=0),
    envvar="MUTEXCRON_HAND_OVER_WAIT",
    metavar="SECONDS",
    help="Balanced placement: on SIGTERM/SIGINT, how long this node keeps the locks whose jobs fire meanwhile, "
    "waiting for a live node to hand each to (a gunicorn reload's new workers); at most --shutdown-timeout. Keep it "
    "below your orchestrator's stop grace (docker: 10 s) [env MUTEXCRON_HAND_OVER_WAIT; default 20].",
)
@click.option(
    "--weight",
    metavar="NUMBER",
    envvar="MUTEXCRON_WEIGHT",
    help="This node's weight under balanced placement: a node of weight 2 is placed for about twice the locks of a "
    "node of weight 1 (0.01 to 1000) [env MUTEXCRON_WEIGHT; default 1].",
)
@click.option(
    "--tag",
    "tags",
    multiple=True,
    metavar="TAG",
    help="A tag of this node, matched by mutex(nodes='tag:TAG') (plain patterns match tags as well as node ids); "
    "repeat it for several [env MUTEXCRON_TAGS, comma-separated].",
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
    task_retention: timedelta | None,
    metrics_port: int | None,
    metrics_host: str | None,
    startup_timeout: float,
    placement: str | None,
    hand_over_wait: float | None,
    weight: str | None,
    tags: tuple[str, ...],
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
        if lock_url is not None and from_flag:
            _use_store_for_defaults(ctx, lock_url)
        sched = load_scheduler(jobs)
        # Options given on the command line win over the jobs file; environment variables were
        # already read by MutexScheduler() as defaults, below its explicit arguments.
        explicit: dict[str, Any] = {
            name: value
            for name, value in (
                ("node_id", node_id),
                ("unactive_interval", unactive_interval),
                ("task_concurrency", task_concurrency),
                ("task_retention", task_retention),
                ("metrics_port", metrics_port),
                ("metrics_host", metrics_host),
                ("placement", placement),
                ("hand_over_wait", hand_over_wait),
                ("weight", weight),
            )
            if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
        }
        if tags:
            explicit["tags"] = tags
        if store is not None:
            explicit["lock_store"] = store
        sched.configure_mutex(shutdown_timeout=shutdown_timeout, **explicit)
        _warn_of_other_stores(sched.lock_url)
        stopper = GracefulStop(sched, shutdown_timeout)
        stopper.install()
        if startup_timeout > 0:
            _watch_first_contact(sched, stopper, startup_timeout)
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
    if stopper.exit_code:
        sys.exit(stopper.exit_code)


def _use_store_for_defaults(ctx: click.Context, lock_url: str) -> None:
    """``run --lock-url``: every object the jobs file builds without a URL (``Mutex()``,
    ``TaskPool()``, the scheduler) uses the run's store, through ``MUTEXCRON_LOCK_URL``; restored
    when the command ends (for callers that run the command in-process)."""
    before = os.environ.get(URL_ENV)
    os.environ[URL_ENV] = lock_url

    def restore() -> None:
        if before is None:
            os.environ.pop(URL_ENV, None)
        else:
            os.environ[URL_ENV] = before

    ctx.call_on_close(restore)


def _warn_of_other_stores(run_url: str) -> None:
    """Warn once per object kind that took the default store URL while the scheduler uses another:
    a ``Mutex()`` there excludes nothing across the scheduler's nodes."""
    from ..backends.sql import absolute_sqlite_url

    for what, url in sorted(defaulted_urls()):
        if absolute_sqlite_url(url) != absolute_sqlite_url(run_url):
            log.warning(
                "%s in the jobs file uses the store %s, not the scheduler's %s: pass the URL, or set %s "
                "(or run --lock-url) so that every object uses one store",
                what,
                mask_url(absolute_sqlite_url(url)),
                mask_url(absolute_sqlite_url(run_url)),
                URL_ENV,
            )


def _store_reached(sched: Any) -> bool:
    """The node's lock store or task store has answered at least once since start."""
    leases = getattr(sched, "_leases", None)
    worker = getattr(getattr(sched, "_tasks", None), "worker", None)
    healths = [getattr(leases, "health", None), getattr(worker, "health", None)]
    return any(getattr(health, "reached", False) for health in healths)


def _watch_first_contact(sched: Any, stopper: GracefulStop, timeout: float) -> None:
    """``--startup-timeout``: stop the node with exit status 1 if its store never answers in time.

    Until then the node fails closed as always (nothing guarded runs, ``/healthz`` is 503); a
    store reached once is an outage from then on, ridden out however long it lasts.
    """
    deadline = time.monotonic() + timeout

    def watch() -> None:
        while not stopper.signalled.wait(0.25):
            if _store_reached(sched):
                return
            if time.monotonic() >= deadline:
                log.error(
                    "the store %s has not answered once in %gs since start (see the errors above: a wrong URL, "
                    "password, database or privilege?): exiting with status %d (--startup-timeout)",
                    mask_url(sched.lock_url),
                    timeout,
                    EXIT_FAILURE,
                )
                stopper.give_up(EXIT_FAILURE)
                return

    threading.Thread(target=watch, name="mutexcron-startup-watch", daemon=True).start()


async def _serve_on_loop(sched: Any, stopper: GracefulStop) -> None:
    """Run an asyncio-flavoured scheduler until a signal's graceful stop has finished.

    The stop runs on the stopper's thread (it waits for guarded runs while the loop keeps them
    going), so this coroutine only waits for it.
    """
    sched.start()
    await stopper.wait_on_loop()


@main.command()
@_lock_url_option()
def ddl(lock_url: str | None) -> None:
    """Print the CREATE TABLE statements for a SQL lock store (for teams that manage their schema)."""
    try:
        store = lock_store_from_url(lock_url or DEFAULT_LOCK_URL)
    except MutexcronError as exc:
        _fail_on(exc, what="ddl")
    from .tasks import schemaless_note, task_ddl

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
@click.option("--duration", type=click.FloatRange(min=10), default=60.0, show_default=True, help="Seconds the whole drill lasts.")
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
@click.option(
    "--shared-jobs",
    "shared_mode",
    is_flag=True,
    help="Drill shared job stores instead: the nodes share one APScheduler job store, to which the drill adds "
    "every-second jobs of its own and makes changes (reschedule, pause, resume, remove); removed at the end.",
)
@click.option(
    "--jobstore",
    metavar="URL",
    help="With --shared-jobs: the job store, any SQLAlchemy URL (a table of the drill's own) or redis://host:port/db "
    "(keys of its own) [default: a SQLite file of the drill's own].",
)
@click.option(
    "--placement",
    "placement_mode",
    is_flag=True,
    help="Drill balanced placement instead: the nodes share every-second jobs of the drill's own, each on its own lock; "
    "they join one by one, one leaves (SIGTERM), one is killed (SIGKILL), one comes back, and after each change "
    "the locks must follow (--unactive-interval is the lease).",
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
    shared_mode: bool,
    jobstore: str | None,
    placement_mode: bool,
) -> None:
    """A failover drill against your store: N local nodes, SIGKILL, SIGSTOP and SIGTERM of the holder.

    The nodes guard one every-second job under a lock of the drill's own
    (mutexcron-drill-<random>). Exit 0 on PASS, 1 on FAIL, 2 if the drill could not run,
    130 if interrupted. Everything is cleaned up, also after Ctrl-C; the drill's lock is
    forgotten (its fencing tokens stay spent: the store's token floor).

    With --tasks, the same faults hit nodes running task handlers while the drill adds tasks: no
    task may be lost, a stale attempt's completion must be refused, and a killed, frozen or
    stopped node's tasks must start again on another node in time.

    With --shared-jobs, the nodes share one APScheduler job store (--jobstore): each (job, fire
    time) must run once, a struck node's jobs must run elsewhere within the lease, and the drill's
    changes must reach every node within 2 s and hold.

    With --placement, the nodes run balanced placement: after each join and after the return,
    every live node must hold its fair share of the locks (ceil(locks / live nodes), within 10 %)
    within 2 leases; a node's locks must be held elsewhere within 1 s of its SIGTERM and within
    the lease + 1 s of its SIGKILL; no fire time may run twice (the missed ones are reported).
    """
    from ..drill import run_drill, run_placement_drill, run_shared_drill, run_task_drill

    _setup_logging("warning")
    if not lock_url:
        _fail("drill needs the store to test: --lock-url URL (or MUTEXCRON_LOCK_URL)")
    if tasks_mode and skew:
        _fail("--skew is for the lock drill: the task drill judges leases and due times by the store's clock only")
    if shared_mode and (tasks_mode or skew):
        _fail("--shared-jobs is a drill of its own: without --tasks or --skew")
    if jobstore and not shared_mode:
        _fail("--jobstore is for the shared-jobs drill: add --shared-jobs")
    if placement_mode and (tasks_mode or shared_mode or skew):
        _fail("--placement is a drill of its own: without --tasks, --shared-jobs or --skew")

    shown = Progress("drill", int(duration), bar_from=0, unit="s", summary=False)

    def progress(message: str) -> None:
        shown.advance_to(min(int(shown.seconds), int(duration)))
        shown.note(f"[{time.strftime('%H:%M:%S')}] {message}")

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # the drill cleans up on its way out, as for Ctrl-C

    previous = signal.signal(signal.SIGTERM, interrupt)
    report: Any
    try:
        with shown:
            if placement_mode:
                report = run_placement_drill(lock_url, nodes=nodes, lease=unactive_interval, duration=duration, progress=progress)
            elif shared_mode:
                report = run_shared_drill(
                    lock_url, jobstore=jobstore, nodes=nodes, lease=unactive_interval, duration=duration, progress=progress
                )
            elif tasks_mode:
                report = run_task_drill(
                    lock_url, nodes=nodes, lease=unactive_interval, duration=duration, rate=task_rate, progress=progress
                )
            else:
                report = run_drill(
                    lock_url, nodes=nodes, unactive_interval=unactive_interval, duration=duration, skew=skew, progress=progress
                )
            shown.advance_to(int(duration))
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
        click.echo(_drill_format(placement_mode, shared_mode, tasks_mode)(report))
    sys.exit(0 if report.passed else 1)


def _drill_format(placement_mode: bool, shared_mode: bool, tasks_mode: bool) -> Callable[[Any], str]:
    """The text form of the chosen drill's report."""
    from ..drill import format_placement_report, format_report, format_shared_report, format_task_report

    if placement_mode:
        return format_placement_report
    return format_shared_report if shared_mode else format_task_report if tasks_mode else format_report


main.add_command(cli_tasks.tasks)

main.add_command(cli_trigger.trigger)

main.add_command(cli_ops.history)
main.add_command(cli_ops.pause)
main.add_command(cli_ops.resume)
main.add_command(cli_ops.forget)
main.add_command(cli_ops.status)
main.add_command(dashboard)
main.add_command(cli_urls.urls)

from . import jobs as jobs_cli  # noqa: E402

main.add_command(jobs_cli.jobs)  # `mutexcron jobs ...`: the shared job stores' jobs

if __name__ == "__main__":  # pragma: no cover
    main()
