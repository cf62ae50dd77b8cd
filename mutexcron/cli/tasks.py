"""``mutexcron tasks``: list, add, cancel and retry durable tasks; the task parts of ``status`` and ``ddl``.

Every command works on the store of ``--lock-url`` (env ``MUTEXCRON_LOCK_URL``): the task pool
lives on the same store as the locks (SQL stores in their own table, ``?tasks_table=``). Times
are shown in UTC; a relative due (``+3d``) is sent to the store as a duration, so it is measured
from the store's clock, never this host's.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, TextIO, TypeVar

import click

from ..backends.base import reading_only
from ..errors import AttrsError, ConfigurationError, MutexcronError
from ..formatting import record_json
from ..locks import DEFAULT_LOCK_URL
from ..tasks import ON_CONFLICT, STATES, AddResult, CodeSummary, NewTask, TaskRecord, TaskStore, task_store_from_url
from ..tasks.checks import check_batch
from ..tasks.handlers import INTERNAL_PREFIX
from ..tasks.retention import format_age, parse_age
from .common import EXIT_BAD_INPUT, EXIT_FAILURE, _age, _clip, _did_you_mean, _fail, _fail_on, _lock_url_option
from .progress import Progress


def _tasks() -> None:
    """The durable task pool: list, add, cancel, retry and purge tasks (on the --lock-url store)."""


tasks: click.Group = click.group("tasks", context_settings={"help_option_names": ["-h", "--help"]})(_tasks)

__all__ = [
    "TaskStatus",
    "age_option",
    "parse_due",
    "schemaless_note",
    "task_ddl",
    "task_status",
    "tasks",
]


_V = TypeVar("_V")


# -- input ----------------------------------------------------------------------------------------
DUE_FORMS = "now, +90s, +2h30m, +3d, or a time with its zone: 2026-12-01T08:00Z, 2026-12-01T08:00:00+01:00"


def parse_due(text: str) -> datetime | timedelta:
    """``--due``: ``now`` and ``+3d``/``+2h30m``/``+90s`` (a timedelta: from the store's clock), or an
    ISO 8601 time with ``Z`` or an offset (an aware datetime). A time without a zone is refused.

    Raises:
        ValueError: anything else; the message says what to write.
    """
    value = text.strip()
    if value.lower() == "now":
        return timedelta(0)
    if value.startswith("+"):
        try:
            return parse_age(value[1:])
        except ValueError as exc:
            if isinstance(exc.__cause__, OverflowError):
                raise ValueError(f"{text!r} is too far ahead") from None
            forms = "+90s, +15m, +2h30m, +3d or +1w (units w, d, h, m, s)"
            raise ValueError(f"{text!r} is not a relative due: write {forms}") from None
    iso = value[:-1] + "+00:00" if value[-1:] in ("Z", "z") else value  # Python 3.10 reads no Z
    try:
        when = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"{text!r} is not a due time: use {DUE_FORMS}") from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(
            f"{text!r} has no time zone: add Z for UTC ({value}Z) or an offset ({value}+01:00); local time is never assumed"
        )
    return when.astimezone(timezone.utc)


def _parsed(parse: Callable[[str], _V]) -> Callable[[click.Context, click.Parameter, str | None], _V | None]:
    """A click callback: the option's text through ``parse``; its ValueError is the option's error."""

    def callback(_ctx: click.Context, param: click.Parameter, value: str | None) -> _V | None:
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param=param) from None

    return callback


_due_option = _parsed(parse_due)
age_option = _parsed(parse_age)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _payload(text: str | None) -> Any:
    """The ``--payload`` JSON, or exit 2 naming the problem (nothing is stored)."""
    if text is None:
        return None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        _fail("--payload is nested too deeply to store as JSON")
    except ValueError as exc:
        _fail(f"--payload is not valid JSON ({exc}): pass e.g. --payload '{{\"pct\": 20}}'")


# -- output ---------------------------------------------------------------------------------------
def _iso(value: datetime | None) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if value else "-"


def _span(seconds: float) -> str:
    """``in 3d 0h`` / ``2m ago``: how far a time is from the store's now."""
    rest = float(round(abs(seconds)))  # a due set to +3d a moment ago is "in 3d 0h", not "in 2d 23h"
    if rest < 1:
        return "now"
    if rest < 120:
        text = f"{rest:.0f}s"
    elif rest < 7200:
        text = f"{rest // 60:.0f}m"
    elif rest < 2 * 86400:
        text = f"{rest // 3600:.0f}h {rest % 3600 // 60:.0f}m"
    else:
        text = f"{rest // 86400:.0f}d {rest % 86400 // 3600:.0f}h"
    return f"in {text}" if seconds > 0 else f"{text} ago"


def _state(task: TaskRecord) -> str:
    if task.cancel_requested:
        return f"{task.state} (cancelling)"
    if task.pending:
        return f"{task.state} (re-added)"
    return task.state


def _lease_left(task: TaskRecord, now: datetime) -> str:
    if task.state != "running" or task.lease_until is None:
        return "-"
    left = (task.lease_until - now).total_seconds()
    return _age(left) if left >= 0 else "expired"


def format_tasks(records: list[TaskRecord], now: datetime) -> str:
    """The ``tasks list`` table."""
    header = ("CODE", "KEY", "STATE", "DUE (UTC)", "ATTEMPT", "TOKEN", "OWNER", "LEASE LEFT", "LAST ERROR")
    rows = [
        (
            _clip(t.code, 32),
            _clip(t.key, 40),
            _state(t),
            _iso(t.due),
            str(t.attempt),
            str(t.token),
            _clip(t.owner, 36),
            _lease_left(t, now),
            _clip(t.last_error, 40),
        )
        for t in records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows))


# -- the store ------------------------------------------------------------------------------------
@contextmanager
def _store(lock_url: str | None, what: str, *, read_only: bool = False) -> Iterator[TaskStore]:
    """The task store of ``lock_url``; a store error is one message and its exit code (``_fail_on``).

    ``read_only``: a command that only reads creates nothing (no SQLite file, table or index).
    """
    try:
        store = task_store_from_url(lock_url or DEFAULT_LOCK_URL)
        if read_only:
            reading_only(store)
    except MutexcronError as exc:
        _fail_on(exc, what=what)
    try:
        yield store
    except AttrsError as exc:  # a payload the store refuses: bad input, nothing was stored
        _fail(str(exc), EXIT_BAD_INPUT)
    except MutexcronError as exc:
        _fail_on(exc, what=what)
    finally:
        store.close()


def _check(code: str, key: str) -> tuple[str, str]:
    """``(code, key)`` checked before anything reaches the store."""
    from ..tasks.checks import check_task

    try:
        return check_task(code, key)
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)


def _check_code(code: str) -> str:
    from ..tasks.checks import check_codes

    try:
        return check_codes([code])[0]
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)


def _name(code: str, key: str) -> str:
    return f"{code}/{key}"


#: The most keys of one code read to suggest a key ("did you mean"): a hint, bounded.
HINT_KEYS = 1000


def _no_task(store: TaskStore, code: str, key: str | None = None) -> str:
    """Why ``code`` (and ``key``) matched no task, with the closest codes or keys: "" if nothing is close."""
    codes = [summary.code for summary in store.summary() if not summary.code.startswith(INTERNAL_PREFIX)]
    if code not in codes:
        return _did_you_mean(code, codes) or f" (no task has the code {code!r})"
    if key is None:
        return ""
    return _did_you_mean(key, [task.key for task in store.list(code=code, limit=HINT_KEYS)])


# -- commands -------------------------------------------------------------------------------------
@tasks.command("list")
@click.option("--code", help="Only tasks of this code.")
@click.option("--state", type=click.Choice(STATES), help="Only tasks in this state.")
@click.option("--key-contains", metavar="TEXT", help="Only tasks whose key contains TEXT (case-sensitive).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True, help="At most this many tasks.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of tasks, every field (times ISO 8601 UTC).")
@_lock_url_option()
def list_tasks(
    code: str | None, state: str | None, key_contains: str | None, limit: int, as_json: bool, lock_url: str | None
) -> None:
    """Tasks by due time: code, key, state, due, attempt, token, owner, lease left, last error."""
    where: dict[str, Any] = {"code": code, "key_contains": key_contains, "state": state}
    with _store(lock_url, "tasks list", read_only=True) as store:
        missing = _missing_table(store)
        if missing is not None and missing.startswith("no such file"):
            _fail(f"tasks list: {missing} in {store.masked_url}: no node or producer has used this store yet, "
                  "or the URL names another file. tasks list creates nothing", EXIT_FAILURE)  # fmt: skip
        records = [] if missing else store.list(**where, limit=limit)
        total = _total(store, where, len(records), limit)
        now = store.now() if records and not as_json else None
    if as_json:
        click.echo(json.dumps([record_json(r) for r in records], indent=2, ensure_ascii=False))
        return
    counted = f"more than {BULK_LIMIT:,}" if total > BULK_LIMIT else f"{total:,}"
    shown = f"; the first {len(records):,} shown: --limit shows more" if total > len(records) else ""
    note = f"; {missing}" if missing else ""
    click.echo(f"task store: {store.masked_url}  ({counted} task{'s' if total != 1 else ''}{shown}{note})")
    if records and now is not None:
        click.echo(format_tasks(records, now))


def _total(store: TaskStore, where: dict[str, Any], listed: int, limit: int) -> int:
    """How many tasks ``where`` selects: ``listed`` if under ``limit``, else counted by the store
    (per-code counts; with ``key_contains``, a list: more than :data:`BULK_LIMIT` is not counted)."""
    if listed < limit:
        return listed
    if where["key_contains"] is not None:
        return len(store.list(**where, limit=BULK_LIMIT + 1))
    codes = [where["code"]] if where["code"] is not None else None
    fields = [where["state"]] if where["state"] is not None else ["queued", "running", "failed"]
    return int(sum(getattr(summary, name) for summary in store.summary(codes) for name in fields))


@tasks.command("get")
@click.argument("code")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="The task as JSON, every field (times ISO 8601 UTC).")
@_lock_url_option()
def get(code: str, key: str, as_json: bool, lock_url: str | None) -> None:
    """Every field of the task CODE KEY. Exit 1 if there is no such task."""
    code, key = _check(code, key)
    with _store(lock_url, "tasks get", read_only=True) as store:
        task = store.get(code, key)
        if task is None:
            _fail(f"no task {_name(code, key)} in {store.masked_url}{_no_task(store, code, key)}", EXIT_FAILURE)
    fields = record_json(task)
    if as_json:
        click.echo(json.dumps(fields, indent=2, ensure_ascii=False))
        return
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        shown = json.dumps(value, ensure_ascii=False) if name in ("payload", "pending_payload") else value
        click.echo(f"{name.ljust(width)}  {'-' if value is None else shown}")


@tasks.command("add")
@click.argument("code")
@click.argument("key")
@click.option("--due", required=True, metavar="DUE", callback=_due_option, help=f"When the task is due: {DUE_FORMS}.")
@click.option("--payload", metavar="JSON", help="The task's data, as JSON.")
@click.option(
    "--on-conflict",
    type=click.Choice(ON_CONFLICT),
    default="replace",
    show_default=True,
    help="If the task exists: replace its due and payload, keep it, or keep the earliest or latest due.",
)
@_lock_url_option()
def add(code: str, key: str, due: datetime | timedelta, payload: str | None, on_conflict: str, lock_url: str | None) -> None:
    """Add the task CODE KEY, or update it: prints inserted, replaced, kept or pending, and its due.

    A relative due (+3d) is measured from the store's clock. A running task is not run twice: the
    new due and payload apply when its attempt ends (pending).
    """
    code, key = _check(code, key)
    data = _payload(payload)
    with _store(lock_url, "tasks add") as store:
        result = store.add(code, key, due, data, on_conflict=on_conflict)
        task, now = store.get(code, key), store.now()
    name = _name(code, key)
    if task is None:  # finished or cancelled in the meantime
        click.echo(f"{result}: {name} (gone again already: run or cancelled)")
        return
    if result == "pending":
        when = task.pending_due or task.due
        click.echo(f"pending: {name} is running; it is queued again, due {_iso(when)} ({_span((when - now).total_seconds())}),")
        click.echo("  when its running attempt ends")
    elif result == "kept":
        click.echo(f"kept: {name} stays {task.state}, due {_iso(task.due)} ({_span((task.due - now).total_seconds())})")
    else:
        click.echo(f"{result}: {name} due {_iso(task.due)} ({_span((task.due - now).total_seconds())})")


#: Tasks ``tasks add-many`` writes per ``add_many`` call (one transaction on a SQL store).
ADD_MANY_CHUNK = 1000
#: The fields of one ``tasks add-many`` line: those required, and all those allowed.
_TASK_FIELDS = ({"code", "key", "due"}, {"code", "key", "due", "payload"})


@tasks.command("add-many")
@click.argument("source", type=click.File("r", encoding="utf-8"), metavar="FILE")
@click.option(
    "--on-conflict",
    type=click.Choice(ON_CONFLICT),
    default="replace",
    show_default=True,
    help="If a task exists: replace its due and payload, keep it, or keep the earliest or latest due.",
)
@_lock_url_option()
def add_many(source: TextIO, on_conflict: str, lock_url: str | None) -> None:
    """Add or update many tasks from FILE (- for stdin): JSON Lines, one task per line, e.g.
    {"code": "email", "key": "user-42", "due": "+5m", "payload": {"to": "a@example.com"}}.

    "due" takes the forms of tasks add --due. Every line is checked first: a bad one stops the
    command before anything is stored. The tasks are written 1,000 at a time (on a SQL store,
    each thousand in one transaction); prints how many were inserted, replaced, kept or pending.
    """
    batch, lines = _read_task_lines(source)
    try:
        check_batch(batch, labels=[f"line {number}" for number in lines])
    except (ConfigurationError, AttrsError) as exc:
        _fail(f"{source.name}, {exc}")
    counts: Counter[str] = Counter()
    with _store(lock_url, "tasks add-many") as store, Progress("adding", len(batch), unit="tasks") as progress:
        for start in range(0, len(batch), ADD_MANY_CHUNK):
            chunk = batch[start : start + ADD_MANY_CHUNK]
            counts.update(str(r) for r in store.add_many(chunk, on_conflict=on_conflict))
            progress.advance(len(chunk))
    shown = ", ".join(f"{counts[r.value]:,} {r.value}" for r in AddResult if counts[r.value]) or "nothing to add"
    click.echo(f"{len(batch):,} task(s) from {source.name}: {shown}")


def _read_task_lines(source: TextIO) -> tuple[list[NewTask], list[int]]:
    """The JSON Lines of ``tasks add-many`` and the line number of each (from 1); exit 2 at the
    first bad line, naming it."""
    batch: list[NewTask] = []
    lines: list[int] = []
    for number, line in enumerate(source, start=1):
        if not line.strip():
            continue
        where = f"{source.name}, line {number}"
        try:
            item = json.loads(line, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            _fail(f"{where}: not a JSON object ({exc})")
        if not isinstance(item, dict) or not _TASK_FIELDS[0] <= item.keys() or item.keys() - _TASK_FIELDS[1]:
            _fail(f'{where}: give an object with "code", "key", "due" and, if any, "payload" (nothing else)')
        try:
            due = parse_due(str(item["due"]))
        except ValueError as exc:
            _fail(f"{where}: {exc}")
        batch.append(NewTask(item["code"], item["key"], due, item.get("payload")))
        lines.append(number)
    return batch, lines


_YES = click.option("--yes", "-y", is_flag=True, help="Bulk: do not ask for confirmation.")
_KEY_CONTAINS = click.option("--key-contains", metavar="TEXT", help="Bulk: only tasks whose key contains TEXT.")
#: The most tasks one bulk command lists, confirms and acts on (run it again for more).
BULK_LIMIT = 100_000


def _bulk(store: TaskStore, verb: str, act: Callable[[TaskRecord], bool], yes: bool, **where: Any) -> None:
    """List the tasks ``where`` selects, show their count and a few of them, ask (unless ``yes``),
    then ``act`` on exactly those: tasks added after the question are not touched."""
    records = store.list(**where, limit=BULK_LIMIT + 1)
    shown = ", ".join(f"{k}={v!r}" for k, v in where.items() if v is not None)
    if not records:
        hint = _no_task(store, where["code"]) if where.get("code") is not None else ""
        click.echo(f"no task matches {shown} in {store.masked_url}: nothing to {verb}{hint}")
        return
    rest = len(records) > BULK_LIMIT
    records = records[:BULK_LIMIT]
    more = f" (the first {BULK_LIMIT:,}: run the command again for the rest)" if rest else ""
    click.echo(f"{len(records):,} task{'s' if len(records) != 1 else ''} match {shown} in {store.masked_url}{more}:")
    for task in records[:5]:
        click.echo(f"  {_name(task.code, task.key)}  {_state(task)}, due {_iso(task.due)}")
    if len(records) > 5:
        click.echo(f"  ... and {len(records) - 5:,} more")
    if not yes:
        click.confirm(f"{verb.capitalize()} these {len(records):,} tasks?", abort=True, err=True)
    past = {"cancel": "cancelled", "retry": "retried"}[verb]
    done = 0
    with Progress({"cancel": "cancelling", "retry": "retrying"}[verb], len(records), unit="tasks") as progress:
        for task in records:
            done += bool(act(task))
            progress.advance(1)
    running = sum(t.state == "running" for t in records) if verb == "cancel" else 0
    note = f"; {running:,} running: dropped when their attempt ends" if running else ""
    missed = len(records) - done
    gone = f" ({missed:,} changed meanwhile: finished, cancelled or retried by someone else)" if missed else ""
    again = "; more match: run the command again for the rest" if rest else ""
    click.echo(f"{past} {done:,} of {len(records):,} task{'s' if len(records) != 1 else ''}{gone}{note}{again}")


@tasks.command("cancel")
@click.argument("code", required=False)
@click.argument("key", required=False)
@click.option("--code", "by_code", metavar="CODE", help="Bulk: cancel every task of CODE (narrowed by the options below).")
@_KEY_CONTAINS
@click.option("--state", type=click.Choice(STATES), help="Bulk: only tasks in this state.")
@_YES
@_lock_url_option()
def cancel(
    code: str | None, key: str | None, by_code: str | None, key_contains: str | None, state: str | None, yes: bool,
    lock_url: str | None,
) -> None:  # fmt: skip
    """Drop the task CODE KEY (a running one when its attempt ends). Exit 1 if there is no such task.

    Bulk: --code C [--key-contains K] [--state S] cancels every matching task, after showing how
    many and asking (--yes skips the question).
    """
    if by_code is not None:
        if code is not None or key is not None:
            _fail("tasks cancel: give CODE KEY, or --code with --key-contains/--state (not both)")
        with _store(lock_url, "tasks cancel") as store:
            act = lambda t: store.cancel(t.code, t.key)  # noqa: E731
            _bulk(store, "cancel", act, yes, code=by_code, key_contains=key_contains, state=state)
        return
    if code is None or key is None or key_contains is not None or state is not None:
        _fail("tasks cancel: give CODE KEY (one task), or --code CODE [--key-contains K] [--state S] (many)")
    code, key = _check(code, key)
    with _store(lock_url, "tasks cancel") as store:
        if not store.cancel(code, key):
            _fail(f"no task {_name(code, key)} in {store.masked_url}{_no_task(store, code, key)}", EXIT_FAILURE)
        left = store.get(code, key)
    if left is not None and left.state == "running":
        click.echo(f"cancelled: {_name(code, key)} is running; it is dropped when its attempt ends")
    else:
        click.echo(f"cancelled: {_name(code, key)}")


@tasks.command("retry")
@click.argument("code", required=False)
@click.argument("key", required=False)
@click.option("--all-failed", is_flag=True, help="Bulk: every failed task (narrowed by --code, --key-contains).")
@click.option("--code", "by_code", metavar="CODE", help="Bulk: only failed tasks of CODE.")
@_KEY_CONTAINS
@_YES
@_lock_url_option()
def retry(
    code: str | None, key: str | None, all_failed: bool, by_code: str | None, key_contains: str | None, yes: bool,
    lock_url: str | None,
) -> None:  # fmt: skip
    """Queue the failed task CODE KEY again, due now, attempts reset. Exit 1 if it is not failed.

    Bulk: --all-failed [--code C] [--key-contains K] retries every matching failed task, after
    showing how many and asking (--yes skips the question).
    """
    if all_failed:
        if code is not None or key is not None:
            _fail("tasks retry: give CODE KEY, or --all-failed with --code/--key-contains (not both)")
        with _store(lock_url, "tasks retry") as store:
            act = lambda t: store.retry(t.code, t.key)  # noqa: E731
            _bulk(store, "retry", act, yes, code=by_code, key_contains=key_contains, state="failed")
        return
    if code is None or key is None or by_code is not None or key_contains is not None:
        _fail("tasks retry: give CODE KEY (one task), or --all-failed [--code C] [--key-contains K] (many)")
    code, key = _check(code, key)
    with _store(lock_url, "tasks retry") as store:
        if not store.retry(code, key):
            task = store.get(code, key)
            why = (f"there is no such task in {store.masked_url}{_no_task(store, code, key)}" if task is None
                   else f"it is {task.state}, not failed")  # fmt: skip
            _fail(f"cannot retry {_name(code, key)}: {why}", EXIT_FAILURE)
    click.echo(f"retried: {_name(code, key)} is queued, due now")


@tasks.command("purge")
@click.option(
    "--older-than", required=True, metavar="AGE", callback=age_option,
    help="Remove finished tasks that finished more than AGE ago, by the store's clock: 7d, 12h, 90s, or 0 (all).",
)
@click.option("--code", help="Only finished tasks of this code.")
@click.option("--dry-run", is_flag=True, help="Count what would be removed; remove nothing.")
@_lock_url_option()
def purge(older_than: timedelta, code: str | None, dry_run: bool, lock_url: str | None) -> None:  # fmt: skip
    """Remove finished and cancelled tasks' records (tombstones) older than --older-than.

    In batches of at most 1,000 (one short statement each); queued, running and failed tasks are
    never touched, and a key added again later still gets a higher token. A running cluster does
    this by itself (--task-retention, 7 days by default).
    """
    from ..tasks.retention import purge as purge_store
    from .progress import Progress

    if code is not None:
        code = _check_code(code)
    age = format_age(older_than)
    scope = f" of code {code!r}" if code is not None else ""
    with _store(lock_url, "tasks purge") as store:
        if not store.keeps_tombstones:
            click.echo(f"nothing to purge: {store.masked_url} deletes a task when it finishes")
            return
        missing = _missing_table(store)  # a purge creates no table (nor, on SQLite, a file)
        if missing is not None:
            click.echo(f"nothing to purge in {store.masked_url}: {missing}")
            return
        count = store.count_purgeable(older_than.total_seconds(), code=code)
        if dry_run:
            click.echo(f"would remove {count} finished task(s){scope} older than {age} from {store.masked_url} (dry run)")
            return
        with Progress("removing finished tasks", total=count) as progress:
            removed = purge_store(store, older_than, code=code, on_batch=progress.advance)
        left = store.count_purgeable(older_than.total_seconds(), code=code)
    more = f"; {left} finished meanwhile or wait for the token floor: run it again" if left else ""
    click.echo(f"removed {removed} finished task(s){scope} older than {age} from {store.masked_url}{more}")


# -- status ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class TaskStatus:
    """The task part of ``mutexcron status``.

    Attributes:
        codes: one summary per code with tasks (None: the store has no task pool).
        note: why there is nothing to count (no task pool, no table yet), or None.
        handled: the codes the jobs file's handlers serve, if it says (None: not known).
        keeps_forever: the jobs file turns task retention off (``task_retention=0``): nothing prunes.
    """

    codes: list[CodeSummary] | None
    note: str | None = None
    handled: frozenset[str] | None = None
    keeps_forever: bool = False

    def unserved(self) -> list[CodeSummary]:
        """Codes with due tasks that no loaded handler serves (only when the handlers are known)."""
        if self.handled is None or not self.codes:
            return []
        return [s for s in self.codes if s.due_now and s.code not in self.handled and not s.code.startswith(INTERNAL_PREFIX)]

    def to_json(self) -> list[dict[str, Any]] | None:
        if self.codes is None:
            return None
        return [
            {**dataclasses.asdict(s), "handled": None if self.handled is None else s.code in self.handled} for s in self.codes
        ]

    def lines(self) -> list[str]:
        return [*self._code_lines(), *self._retention_lines()]

    def _retention_lines(self) -> list[str]:
        if not self.keeps_forever or self.codes is None:
            return []
        return ["task retention: off (task_retention=0): finished tasks are kept forever; "
                "`mutexcron tasks purge --older-than 7d` removes them"]  # fmt: skip

    def _code_lines(self) -> list[str]:
        if not self.codes:
            return [f"no tasks{f' ({self.note})' if self.note else ''}"]
        width = max(len(s.code) for s in self.codes)
        out = [f"tasks: {len(self.codes)} code{'s' if len(self.codes) != 1 else ''}"]
        for s in self.codes:
            overdue = "-" if s.oldest_overdue is None else _age(s.oldest_overdue)
            out.append(
                f"  {s.code.ljust(width)}  queued {s.queued}, due now {s.due_now}, running {s.running}, "
                f"failed {s.failed}, oldest overdue {overdue}"
            )
        for s in self.unserved():
            out.append(
                f"warning: {s.due_now} due task{'s' if s.due_now != 1 else ''} of code {s.code!r}: "
                "no handler in this jobs file serves that code"
            )
        return out


def _handled_codes(sched: Any) -> frozenset[str] | None:
    registry = getattr(sched, "tasks", None)
    codes = getattr(registry, "codes", None)
    if not callable(codes):
        return None
    return frozenset(codes())


def _missing_table(store: TaskStore) -> str | None:
    """For a SQL task store whose file or table does not exist: a note saying so (status creates nothing)."""
    from ..tasks.stores.sql import SQLTaskStore

    if not isinstance(store, SQLTaskStore):
        return None
    backend = store.backend
    if backend.missing_file() or backend.missing_schema(store.table) is None:
        return backend.missing_file()  # never connect to a SQLite file that is not there: it would be created
    return f"table {store.table} not created yet"


def task_status(url: str, sched: Any = None) -> TaskStatus:
    """The per-code summary of the task pool on ``url``; ``sched``: a loaded jobs file's scheduler, if any.

    A store error exits like every command (``_fail_on``); a store without a task pool, or a SQL
    store whose task table does not exist yet, is "no tasks".
    """
    from ..backends import family_of

    handled = _handled_codes(sched) if sched is not None else None
    forever = sched is not None and getattr(sched, "task_retention", True) is None
    try:
        row = family_of(url)
    except ConfigurationError as exc:
        _fail_on(exc, what="status")
    if row.task_store is None:
        return TaskStatus(None, f"the {row.name} store has no task pool", handled)
    with _store(url, "status", read_only=True) as store:
        note = _missing_table(store)
        if note is not None:
            return TaskStatus([], note, handled, forever)
        return TaskStatus(store.summary(), None, handled, forever)


# -- ddl ------------------------------------------------------------------------------------------
def task_ddl(url: str) -> list[str]:
    """The task table's CREATE statements for a SQL ``url`` (a ``-- comment`` first); [] for other stores."""
    from ..backends import family_of

    try:
        if family_of(url).task_store is None:
            return []
    except ConfigurationError as exc:
        _fail_on(exc, what="ddl")
    with _store(url, "ddl") as store:
        statements = getattr(store, "ddl", None)
        if statements is None:
            return []
        table = getattr(store, "table", "")
        return [f"-- the durable task pool: table {table} (?tasks_table=)", *statements()]


def schemaless_note(store: Any) -> str:
    """What a store without DDL uses instead (Redis keys, a MongoDB collection), for ``ddl``."""
    backend = getattr(store, "backend", None)
    prefix = getattr(backend, "prefix", None)
    if prefix:
        return (
            f"Redis creates its keys on first use, all under {prefix}* (?namespace=): locks {prefix}lock:<name>, "
            f"{prefix}token:<name>, {prefix}names; tasks {prefix}task:<code>:<key>, {prefix}due:<code>, {prefix}task_codes"
        )
    collection = getattr(backend, "collection_name", None)
    if collection:
        database = getattr(backend, "database_name", "?")
        return (
            f"MongoDB creates the lock collection {database}.{collection} (?collection=) and its documents on first use; "
            + _mongodb_tasks(getattr(store, "url", ""), database)
        )
    if getattr(store, "masked_url", "").startswith("memory:"):
        return "memory:// keeps everything in this process"
    return ""


def _mongodb_tasks(url: str, database: str) -> str:
    """Where a MongoDB URL keeps its tasks, as far as the task store says (nothing is contacted)."""
    from ..backends import family_of

    try:
        if family_of(url).task_store is None:
            return "the task pool has no MongoDB store yet"
        store = task_store_from_url(url)
    except ConfigurationError:
        return "the task pool has no MongoDB store here"
    try:
        names = (getattr(store, name, None) for name in ("collection_name", "tasks_collection", "table"))
        where = next((n for n in names if isinstance(n, str) and n), None)
    finally:
        store.close()
    return f"tasks in the collection {database}.{where}" if where else "tasks in a collection of their own"
