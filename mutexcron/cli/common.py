"""What every command shares: ``--lock-url`` and "did you mean"; the logging set-up, exit codes and
the error-to-exit mapping (:mod:`mutexcron.console`) and the formatting (:mod:`mutexcron.formatting`)
under the names the commands use."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

from ..console import EXIT_BAD_INPUT, EXIT_FAILURE, LOG_LEVELS, URLS_HINT, group_lock_url
from ..console import fail as _fail
from ..console import fail_on as _fail_on
from ..console import setup_logging as _setup_logging
from ..formatting import age as _age
from ..formatting import clip as _clip
from ..formatting import when as _when
from ..locks import DEFAULT_LOCK_URL
from ..names import printable

__all__ = [
    "EXIT_BAD_INPUT", "EXIT_FAILURE", "LOG_LEVELS", "_age", "_clip", "_did_you_mean", "_fail", "_fail_on",
    "_lock_url_option", "_setup_logging", "_when",
]  # fmt: skip

F = TypeVar("F", bound=Callable[..., Any])


#: The one help text of ``--lock-url`` (a command with its own meaning adds to it).
LOCK_URL_HELP = f"Lock store URL [env MUTEXCRON_LOCK_URL; default {DEFAULT_LOCK_URL}]. {URLS_HINT}"


def _lock_url_option(help_text: str | None = None) -> Callable[[F], F]:
    """The ``--lock-url`` option every command shares (env ``MUTEXCRON_LOCK_URL``; also given on
    the group: ``mutexcron --lock-url URL CMD``)."""
    text = f"{help_text} {URLS_HINT}" if help_text else LOCK_URL_HELP
    return click.option("--lock-url", envvar="MUTEXCRON_LOCK_URL", metavar="URL", help=text, callback=group_lock_url)


def _did_you_mean(name: str, names: Iterable[str], sentence: bool = False) -> str:
    """`` (did you mean 'a', 'b'?)`` for the names closest to ``name`` (escaped), or ""."""
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    if not close:
        return ""
    shown = ", ".join(repr(printable(n)) for n in close)
    return f" Did you mean {shown}?" if sentence else f" (did you mean {shown}?)"
