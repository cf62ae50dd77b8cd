"""What every command-line entry point shares (``mutexcron`` and its subcommands, ``mutexcron
dashboard``): logging set-up, exit codes, and the one mapping from an error to a message and an
exit code."""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from .errors import ConfigurationError, MutexcronError

__all__ = [
    "EXIT_BAD_INPUT", "EXIT_FAILURE", "LOG_LEVELS", "URLS_HINT", "fail", "fail_on", "group_lock_url", "setup_logging",
]  # fmt: skip

log = logging.getLogger("mutexcron.cli.common")  # the logger the commands have always logged under

LOG_LEVELS = ["debug", "info", "warning", "error"]

#: Exit codes: 0 ok, 1 a failure at run time (store, drill verdict), 2 bad input (usage, URL, jobs file).
EXIT_FAILURE, EXIT_BAD_INPUT = 1, 2


#: The end of every ``--lock-url`` help: the schemes are listed once, by ``mutexcron urls``.
URLS_HINT = "`mutexcron urls` lists the schemes."


def group_lock_url(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A command's ``--lock-url`` callback: ``mutexcron --lock-url URL CMD`` gives URL to CMD, as
    if given to CMD itself (which wins if it has its own, and over the environment variable)."""
    root = ctx.find_root()
    given = root.params.get("lock_url") if root is not ctx else None
    if given is None or param.name is None or ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
        return value
    ctx.set_parameter_source(param.name, ParameterSource.COMMANDLINE)
    return given


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    if level != "debug":  # APScheduler logs every run at INFO; keep ours readable
        logging.getLogger("apscheduler").setLevel(logging.WARNING)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    click.echo(f"mutexcron: error: {message}", err=True)
    sys.exit(code)


def fail_on(exc: BaseException, *, debug: bool = False, what: str = "") -> NoReturn:
    """The one mapping from an error to a message and an exit code."""
    if debug:
        log.exception("%s failed", what or "command")
    if isinstance(exc, ConfigurationError):
        fail(str(exc), EXIT_BAD_INPUT)
    if isinstance(exc, MutexcronError):
        fail(f"{what}: {exc}" if what else str(exc), EXIT_FAILURE)
    hint = "" if debug else " (--log-level debug shows the traceback)"
    fail(f"{what or 'command'} failed: {type(exc).__name__}: {exc}{hint}", EXIT_FAILURE)
