"""What every command-line entry point shares (``mutexcron`` and its subcommands, ``mutexcron
dashboard``): logging set-up, exit codes, and the one mapping from an error to a message and an
exit code."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

import click

from .errors import ConfigurationError, MutexcronError

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILURE", "LOG_LEVELS", "fail", "fail_on", "setup_logging"]

log = logging.getLogger("mutexcron.cli.common")  # the logger the commands have always logged under

LOG_LEVELS = ["debug", "info", "warning", "error"]

#: Exit codes: 0 ok, 1 a failure at run time (store, drill verdict), 2 bad input (usage, URL, jobs file).
EXIT_FAILURE, EXIT_BAD_INPUT = 1, 2


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
