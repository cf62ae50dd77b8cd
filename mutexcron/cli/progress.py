"""Progress for long commands: a bar on a terminal, one summary line elsewhere (the one way every command shows it)."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

#: Below this many items a command shows no bar: it is over before a reader could look.
BAR_FROM = 2_000


class Progress:
    """Counts done out of ``total`` (None: unknown) for ``label``; a bar on a terminal (stderr), else nothing until the end.

    Use as a context manager and call :meth:`advance` after each batch. On leaving, a command that
    is not on a terminal gets one line on stderr: ``<label>: <done> in <seconds> s``. The counts a
    command reports on stdout stay its own: this only shows that work is moving.
    """

    def __init__(self, label: str, total: int | None = None, *, show: bool | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        on_terminal = sys.stderr.isatty() if show is None else show
        self._bar_wanted = on_terminal and (total is None or total >= BAR_FROM)
        self._bar: ProgressBar[int] | None = None
        self._started = time.monotonic()

    def __enter__(self) -> Progress:
        if self._bar_wanted:
            bar: ProgressBar[int] = click.progressbar(length=self.total, label=self.label, file=sys.stderr, show_pos=True)
            bar.__enter__()
            self._bar = bar
        return self

    def advance(self, count: int) -> None:
        """``count`` more items are done."""
        self.done += count
        if self._bar is not None:
            self._bar.update(count)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)
            return
        if not sys.stderr.isatty() and self.done >= BAR_FROM:
            seconds = time.monotonic() - self._started
            click.echo(f"{self.label}: {self.done} in {seconds:.1f} s", err=True)
