"""What every command shares: logging set-up, exit codes, the one error-to-exit mapping, ``--lock-url``, formatting."""

from __future__ import annotations

import difflib
import logging
import sys
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, NoReturn, TypeVar

import click

from ..errors import ConfigurationError, MutexcronError
from ..locks import DEFAULT_LOCK_URL, SCHEMES
from ..names import printable

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


def _did_you_mean(name: str, names: Iterable[str], sentence: bool = False) -> str:
    """`` (did you mean 'a', 'b'?)`` for the names closest to ``name`` (escaped), or ""."""
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    if not close:
        return ""
    shown = ", ".join(repr(printable(n)) for n in close)
    return f" Did you mean {shown}?" if sentence else f" (did you mean {shown}?)"
