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
    is not on a terminal gets one line on stderr: ``<label>: <done> <unit> in <seconds> s``. The
    counts a command reports on stdout stay its own: this only shows that work is moving.

    Args:
        label: what is being done ("cancelling").
        total: how many items, if known.
        show: force the bar on (True) or off (False); default: when stderr is a terminal.
        bar_from: the fewest items worth a bar and a summary line (:data:`BAR_FROM`).
        unit: what is counted, for the summary line ("tasks").
        summary: False: no summary line (a command that prints its own report).
    """

    def __init__(
        self, label: str, total: int | None = None, *, show: bool | None = None, bar_from: int = BAR_FROM,
        unit: str = "items", summary: bool = True,
    ) -> None:  # fmt: skip
        self.label = label
        self.total = total
        self.unit = unit
        self._summary = summary
        self.done = 0
        self._on_terminal = sys.stderr.isatty() if show is None else show
        self._bar_from = bar_from
        self._bar_wanted = self._on_terminal and (total is None or total >= bar_from)
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

    def advance_to(self, done: int) -> None:
        """``done`` items are done in all (a count read from elsewhere, or seconds elapsed)."""
        if done > self.done:
            self.advance(done - self.done)

    def note(self, message: str) -> None:
        """One line on stderr that does not break the bar (drawn again below it)."""
        if self._bar is None:
            click.echo(message, err=True)
            return
        click.echo("\r\033[K" + message, err=True)
        self._bar.render_progress()

    @property
    def seconds(self) -> float:
        """Seconds since the progress began."""
        return time.monotonic() - self._started

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)
            return
        if self._summary and not self._on_terminal and self.done >= self._bar_from:
            click.echo(f"{self.label}: {self.done:,} {self.unit} in {self.seconds:.1f} s", err=True)
