"""Operations commands: ``history``, ``pause``, ``resume``, and ``status`` with nodes, pauses and last runs.

Every command works on the lock store of ``--lock-url`` (env ``MUTEXCRON_LOCK_URL``). Times are
shown in UTC, ages by the store's clock. ``status`` here replaces the first ``status`` of
:mod:`mutexcron.cli` (registered after it, under the same name): the same lock table with a
PAUSED column, then the nodes that announced themselves with their renewals, the paused locks, the
last run of each job, and the task pool; ``--watch`` redraws it in place on a terminal.
"""

from __future__ import annotations

import getpass
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import click

from .errors import MutexcronError
from .locks import DEFAULT_LOCK_URL, SCHEMES, LockStore, lock_store_from_url
from .record import LockRecord, NodePresence, RunRecord

__all__ = ["StatusReport", "format_history", "format_nodes", "format_status", "history", "pause", "resume", "status"]


# -- tables -----------------------------------------------------------------------------------------
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)]
    return "\n".join(lines)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.1f}s" if seconds < 120 else _age(seconds)


def _offset(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:+.3f}s"


def format_status(records: Sequence[LockRecord]) -> str:
    """The lock table of ``status``: :func:`mutexcron.cli.format_status`'s columns, PAUSED after STATE."""
    header = ("NAME", "HOLDER", "ACTIVE_IP", "HEARTBEAT", "STATE", "PAUSED", "TOKEN", "LAST FIRE (UTC)", "LAST ERROR", "ATTRS")
    rows = [
        (
            _clip(r.name, 32),
            _clip(r.holder, 36),
            r.active_ip or "-",
            _age(r.heartbeat_age),
            r.state,
            "paused" if r.paused else "-",
            str(r.token),
            _when(r.last_fire_time),
            _clip(r.last_error, 30),
            _clip(json.dumps(dict(r.attrs), ensure_ascii=False, sort_keys=True) if r.attrs else "", 40),
        )
        for r in records
    ]
    return _table(header, rows)


def format_nodes(nodes: Sequence[NodePresence]) -> str:
    """One line per node: id, IP, version, last seen, clock offset, locks held."""
    header = ("NODE", "IP", "VERSION", "LAST SEEN (UTC)", "AGO", "CLOCK OFFSET", "LOCKS")
    rows = [
        (_clip(n.node_id, 40), n.ip or "-", n.version or "-", _when(n.last_seen), _age(n.age), _offset(n.clock_offset),
         _clip(", ".join(n.locks) or "-", 60))
        for n in nodes
    ]  # fmt: skip
    return _table(header, rows)


def format_history(runs: Sequence[RunRecord]) -> str:
    """Runs, one line each, as given (newest first)."""
    header = ("ENDED (UTC)", "JOB", "LOCK", "OUTCOME", "DURATION", "NODE", "TOKEN", "FIRE TIME (UTC)", "ERROR")
    rows = [
        (_when(r.ended), _clip(r.job, 32), _clip(r.lock, 32), r.outcome, _duration(r.duration), _clip(r.node, 36),
         str(r.token), _when(r.fire_time), _clip(r.error, 50))
        for r in runs
    ]  # fmt: skip
    return _table(header, rows)


def _paused_line(record: LockRecord) -> str:
    since = f" since {_when(record.paused_at)} UTC" if record.paused_at else ""
    return f"  {record.name} (by {record.paused_by or '?'}{since}; `mutexcron resume {record.name}`)"


# -- the store --------------------------------------------------------------------------------------
@contextmanager
def _store(lock_url: str | None, what: str) -> Iterator[LockStore]:
    """The lock store of ``lock_url``, closed afterwards; a store error is one message and its exit code."""
    try:
        store = lock_store_from_url(lock_url or DEFAULT_LOCK_URL)
    except MutexcronError as exc:
        _fail_on(exc, what=what)
    try:
        yield store
    except MutexcronError as exc:
        _fail_on(exc, what=what)
    finally:
        store.close()


def _optional(call: Callable[[], Any], default: Any) -> Any:
    """A store call that stores without the feature (a wrapper, a custom store) do not answer."""
    try:
        return call()
    except NotImplementedError:
        return default


def _on_terminal() -> bool:
    """True if stdout is a terminal (``status --watch`` redraws only there)."""
    return sys.stdout.isatty()


def _operator() -> str:
    """Who runs the command: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment (a container without passwd entry)
        user = "?"
    return f"{user}@{socket.gethostname()}"


# -- history ----------------------------------------------------------------------------------------
def _history(name: str | None, job: str | None, limit: int, lock_url: str | None, as_json: bool) -> None:
    """Print the runs kept for NAME (a lock, else a job id; none: every lock), newest first.

    Each lock keeps the last runs of each of its jobs (``?history=N`` on the lock URL, default 20),
    written by the run's hand-off: node, token, fire time, start and end by the store's clock,
    outcome and error.
    """
    with _store(lock_url, "history") as store:
        runs = _runs(store, name, job)
        shown = store.masked_url
    runs = runs[:limit]
    if as_json:
        click.echo(json.dumps({"store": shown, "runs": [r.to_json() for r in runs]}, indent=2))
        return
    if not runs:
        click.echo(f"no runs recorded{f' for {name}' if name else ''} in {shown}", err=True)
        return
    click.echo(format_history(runs))


def _runs(store: LockStore, name: str | None, job: str | None) -> list[RunRecord]:
    """Newest first: the lock ``name``'s runs, else job ``name``'s wherever they are, else every lock's."""
    if name is not None and store.read(name) is not None:
        return store.history(name, job)
    names = [r.name for r in store.list()]
    wanted = name if name is not None else job
    found = [run for runs in store.history_many(names, wanted).values() for run in runs]
    return sorted(found, key=lambda r: r.ended.timestamp() if r.ended else 0.0, reverse=True)


# -- pause / resume ---------------------------------------------------------------------------------
def _pause(lock: str, by: str | None, lock_url: str | None) -> None:
    """Pause LOCK on every node: none starts its jobs' fire times until `mutexcron resume LOCK`.

    The flag lives in the lock record; runs in progress finish, leases are still taken and renewed,
    and fire times that pass while paused are not claimed. A lock no node has taken yet starts
    paused.
    """
    with _store(lock_url, "pause") as store:
        record = store.set_paused(lock, True, by or _operator())
        shown = store.masked_url
    fresh = " (no node has taken it yet: it starts paused)" if record.token == 0 and record.holder is None else ""
    click.echo(f"{lock}: paused by {record.paused_by} at {_when(record.paused_at)} UTC in {shown}{fresh}")
    if record.holder:
        click.echo(f"{lock}: held by {record.holder} (token {record.token}); a run in progress there finishes")


def _resume(lock: str, catch_up: bool, by: str | None, lock_url: str | None) -> None:
    """Resume LOCK: its jobs run again from their next fire time.

    With --catch-up, each job that has run under LOCK also runs once now, through the lock, on the
    node that holds it (a `mutexcron trigger` request per job), making up for the fire times
    skipped while the lock was paused.
    """
    with _store(lock_url, "resume") as store:
        before = store.read(lock)
        record = store.set_paused(lock, False, by or _operator(), catch_up=catch_up)
        shown = store.masked_url
    note = "" if before is not None and before.paused else " (it was not paused)"
    jobs = sorted(before.fire_times) if before is not None and catch_up else []
    after = f"; catching up once now: {', '.join(jobs)}" if jobs else ""
    if catch_up and not jobs:
        after = "; no job has run under it: nothing to catch up"
    click.echo(f"{lock}: resumed by {record.paused_by} at {_when(record.paused_at)} UTC in {shown}{note}{after}")
    if jobs:
        _request_runs(lock_url, jobs)


def _request_runs(lock_url: str | None, jobs: Sequence[str]) -> None:
    """One trigger request per job (:mod:`mutexcron.triggers`): the holder runs each once now."""
    from .tasks import task_store_from_url
    from .triggers import TRIGGER_CODE

    tasks = task_store_from_url(lock_url or DEFAULT_LOCK_URL)
    try:
        for job in jobs:
            tasks.add(TRIGGER_CODE, job, timedelta(0), {"requested_by": "mutexcron resume --catch-up"}, on_conflict="keep")
    finally:
        tasks.close()


# -- status -----------------------------------------------------------------------------------------
@dataclass
class StatusReport:
    """What ``status`` shows: the locks, the nodes, the paused locks and each job's last run."""

    store: str
    records: list[LockRecord]
    #: None: the store keeps no presence.
    nodes: list[NodePresence] | None
    last_runs: list[RunRecord] = field(default_factory=list)

    @property
    def paused(self) -> list[LockRecord]:
        return [r for r in self.records if r.paused]

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "locks": [r.to_json() for r in self.records],
            "nodes": None if self.nodes is None else [n.to_json() for n in self.nodes],
            "paused": [r.name for r in self.paused],
            "last_runs": [r.to_json() for r in self.last_runs],
        }

    def lines(self) -> Iterator[str]:
        count = len(self.records)
        yield f"lock store: {self.store}  ({count} lock{'s' if count != 1 else ''})"
        if self.records:
            yield format_status(self.records)
        if self.nodes is not None:
            if self.nodes:
                yield f"nodes ({len(self.nodes)} seen in the last 10 minutes):"
                yield format_nodes(self.nodes)
            else:
                yield "nodes: none seen in the last 10 minutes"
        if self.paused:
            yield f"paused ({len(self.paused)}):"
            yield from (_paused_line(r) for r in self.paused)
        if self.last_runs:
            yield "last run of each job:"
            yield format_history(self.last_runs)


def status_report(store: LockStore) -> StatusReport:
    """Read ``status``'s view of ``store``: three reads (locks, nodes, histories)."""
    records = store.list()
    nodes = _optional(store.nodes, None)
    histories = _optional(lambda: store.history_many([r.name for r in records]), {})
    latest: dict[tuple[str, str], RunRecord] = {}
    for runs in histories.values():
        for run in runs:  # newest first: the first of each job is its last run
            latest.setdefault((run.lock, run.job), run)
    last_runs = [latest[key] for key in sorted(latest, key=lambda k: (k[1], k[0]))]
    return StatusReport(store.masked_url, records, nodes, last_runs)


def _status(jobs: str | None, lock_url: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Show every lock (holder, heartbeat, state, paused, last run), the nodes, and each job's last run.

    With JOBS (a jobs file), use that scheduler's lock store unless --lock-url is given. --watch
    redraws the view every --interval seconds while stdout is a terminal (Ctrl-C stops it);
    elsewhere it prints once.
    """
    from .cli_tasks import task_status

    _setup_logging("warning")
    sched = None
    if jobs:
        try:
            from .loader import load_scheduler

            sched = load_scheduler(jobs)
        except MutexcronError as exc:
            _fail_on(exc, what="status")
        lock_url = lock_url or sched.lock_url
    url = lock_url or DEFAULT_LOCK_URL
    with _store(url, "status") as store:

        def render() -> str:
            # The store's URL has no ?history=, which the task store (same URL) would hand to its driver.
            report, tasks = status_report(store), task_status(store.url, sched)
            if as_json:
                return json.dumps({**report.to_json(), "tasks": tasks.to_json()}, indent=2)
            return "\n".join([*report.lines(), *tasks.lines()])

        if not (watch and _on_terminal()):
            click.echo(render())
            return
        try:
            while True:
                text = render()
                click.clear()
                click.echo(f"{text}\n\n(every {interval:g}s; Ctrl-C to stop)")
                time.sleep(interval)
        except KeyboardInterrupt:
            return


# -- the commands -----------------------------------------------------------------------------------
# Built before the import of .cli at the end of this module: cli.py imports this module at its own
# end to register them, and so either module can be imported first.
def _lock_url_option() -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The ``--lock-url`` option, as :mod:`mutexcron.cli` gives every command."""
    text = f"Lock store URL [env MUTEXCRON_LOCK_URL; default {DEFAULT_LOCK_URL}]. Schemes: {', '.join(SCHEMES)}."
    return click.option("--lock-url", envvar="MUTEXCRON_LOCK_URL", metavar="URL", help=text)


_JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
_BY = click.option("--by", metavar="WHO", help="Who to record as having done it [default: user@host].")


def _command(name: str, func: Callable[..., None], *decorators: Callable[[Any], Any]) -> click.Command:
    """``func`` as the command ``name``, with ``decorators`` applied as if stacked above it."""
    for decorator in reversed(decorators):
        func = decorator(func)
    return click.command(name, context_settings={"help_option_names": ["-h", "--help"]})(func)


history: click.Command = _command(
    "history",
    _history,
    click.argument("name", metavar="[JOB|LOCK]", required=False),
    click.option("--job", help="With a LOCK: only this job's runs."),
    click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Runs to show."),
    _lock_url_option(),
    _JSON,
)
pause: click.Command = _command("pause", _pause, click.argument("lock"), _BY, _lock_url_option())
resume: click.Command = _command(
    "resume",
    _resume,
    click.argument("lock"),
    click.option("--catch-up", is_flag=True, help="Also run each job of the lock once now, on its holder (a trigger)."),
    _BY,
    _lock_url_option(),
)
status: click.Command = _command(
    "status",
    _status,
    click.argument("jobs", required=False),
    _lock_url_option(),
    _JSON,
    click.option("--watch", is_flag=True, help="Redraw every --interval seconds (on a terminal; Ctrl-C stops)."),
    click.option(
        "--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True, help="Seconds between redraws (--watch)."
    ),
)

from .cli import _age, _clip, _fail_on, _setup_logging, _when  # noqa: E402 - see above
