"""``mutexcron dashboard``: serve the web dashboard of a store (``pip install "mutexcron[dashboard]"``)."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

import click

from ..console import URLS_HINT, group_lock_url
from .security import TOKEN_ENV

__all__ = ["dashboard"]

log = logging.getLogger(__name__)


@click.command("dashboard", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--lock-url",
    envvar="MUTEXCRON_LOCK_URL",
    metavar="URL",
    help=f"The store to show [env MUTEXCRON_LOCK_URL; default: the jobs file's, else sqlite:///mutexcron.db]. {URLS_HINT}",
    callback=group_lock_url,
)
@click.option(
    "--jobs",
    metavar="JOBS",
    help="A jobs file (jobs.py or module:attr), imported and never started: its schedules "
    "give the missed-run alarms and next fire times.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    envvar="MUTEXCRON_DASHBOARD_HOST",
    help="The address to bind [env MUTEXCRON_DASHBOARD_HOST]. Anyone who reaches it can read the dashboard.",
)
@click.option(
    "--port",
    type=click.IntRange(min=0, max=65535),
    default=8465,
    show_default=True,
    envvar="MUTEXCRON_DASHBOARD_PORT",
    help="The port (0: any free port) [env MUTEXCRON_DASHBOARD_PORT].",
)
@click.option(
    "--action-token",
    envvar=TOKEN_ENV,
    metavar="TOKEN",
    help=f"Enable pause, resume, trigger, retry and cancel for whoever gives this token (16+ characters) "
    f"[env {TOKEN_ENV}, which keeps it out of the process list]. Without it the dashboard is read-only.",
)
@click.option(
    "--refresh",
    type=click.FloatRange(min=0.5),
    default=2.0,
    show_default=True,
    help="Seconds between two refreshes of an open page.",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def dashboard(lock_url: str | None, jobs: str | None, host: str, port: int, action_token: str | None, refresh: float,
              log_level: str) -> None:  # fmt: skip
    """Serve the web dashboard: nodes, alarms, locks and jobs, runs, tasks; actions with --action-token."""
    from ..console import fail_on, setup_logging
    from .server import is_loopback, make, serve

    setup_logging(log_level)
    try:
        app = _create(lock_url, jobs, action_token, refresh)
        server = make(app, host, port)
    except Exception as exc:  # noqa: BLE001 - any startup failure is one message and an exit code
        fail_on(exc, debug=log_level == "debug", what="dashboard")
    where = f"http://{f'[{host}]' if ':' in host else host}:{server.server_port}/"
    mode = "actions enabled (token required)" if app.guard.actions_enabled else "read-only"
    log.info("dashboard of %s on %s (%s)", app.reader.masked_url, where, mode)
    if not is_loopback(host):
        log.warning("the dashboard listens on %s: anyone who can reach it can read it; put it behind your own access control",
                    host)  # fmt: skip
    click.echo(f"mutexcron dashboard: {where}", err=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve(server)
    finally:
        app.close()
        log.info("dashboard stopped")
    sys.exit(0)


def _create(lock_url: str | None, jobs: str | None, action_token: str | None, refresh: float) -> Any:
    try:
        from .app import create_app
    except ModuleNotFoundError as exc:  # pragma: no cover - the dashboard needs nothing beyond mutexcron today
        from ..errors import ConfigurationError

        raise ConfigurationError(f'the dashboard needs {exc.name!r}: pip install "mutexcron[dashboard]"') from exc
    return create_app(lock_url, jobs=jobs, action_token=action_token, refresh=refresh)


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt
