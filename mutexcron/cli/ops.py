"""Operations commands: ``history``, ``pause``, ``resume``, and ``status`` with nodes, pauses and last runs.

Every command works on the lock store of ``--lock-url`` (env ``MUTEXCRON_LOCK_URL``). Times are
shown in UTC, ages by the store's clock. ``status`` here replaces the first ``status`` of
:mod:`mutexcron.cli.main` (registered after it, under the same name): the same lock table with a
PAUSED column, then the nodes that announced themselves with their renewals, the paused locks, the
last run of each job, and the task pool; ``--watch`` redraws it in place on a terminal.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import click

from ..backends.base import reading_only
from ..errors import ConfigurationError, MutexcronError
from ..formatting import duration as _duration
from ..formatting import offset as _offset
from ..formatting import share as _share
from ..formatting import tags as _tags
from ..formatting import weight as _weight
from ..locks import DEFAULT_LOCK_URL, LockStore, lock_store_from_url
from ..locks.base import FORGET_DELETED, FORGET_HELD, FORGET_MISSING
from ..locks.record import LockRecord, NodePresence, RunRecord
from ..names import check_name, printable
from ..placement.rendezvous import capacities
from .common import EXIT_FAILURE, _age, _clip, _did_you_mean, _fail, _fail_on, _lock_url_option, _setup_logging, _when

__all__ = [
    "StatusReport", "forget", "format_history", "format_nodes", "format_status", "history", "pause", "resume", "status",
]  # fmt: skip


# -- tables -----------------------------------------------------------------------------------------
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)]
    return "\n".join(lines)


def format_status(records: Sequence[LockRecord]) -> str:
    """The lock table of ``status``: one line per lock (ZONE: the zone its holder computes fire times in)."""
    header = ("NAME", "HOLDER", "ACTIVE_IP", "HEARTBEAT", "STATE", "PAUSED", "TOKEN", "ZONE", "LAST FIRE (UTC)", "LAST ERROR",
              "ATTRS")  # fmt: skip
    rows = [
        (
            _clip(r.name, 32),
            _clip(r.holder, 36),
            r.active_ip or "-",
            _age(r.heartbeat_age),
            r.state,
            "paused" if r.paused else "-",
            str(r.token),
            _clip(r.zone, 24),
            _when(r.last_fire_time),
            _clip(r.last_error, 30),
            _clip(json.dumps(dict(r.attrs), ensure_ascii=False, sort_keys=True) if r.attrs else "", 40),
        )
        for r in records
    ]
    return _table(header, rows)


def format_nodes(nodes: Sequence[NodePresence], live: Mapping[str, bool] | None = None, total: int = 0) -> str:
    """One line per node: id, state (``live``/``stale``, see :func:`node_liveness`), IP, version,
    last seen, clock offset, its share of the ``total`` locks and its fair share (:func:`fair_shares`),
    its weight and tags, the locks it holds."""
    header = ("NODE", "STATE", "IP", "VERSION", "LAST SEEN (UTC)", "AGO", "CLOCK OFFSET", "SHARE", "FAIR", "WEIGHT", "TAGS",
              "LOCKS")  # fmt: skip
    fair = fair_shares(nodes, live, total)
    rows = [
        (_clip(n.node_id, 40), _node_state(live, n.node_id), n.ip or "-", n.version or "-", _when(n.last_seen),
         _age(n.age), _offset(n.clock_offset), _share(len(n.locks), total), str(fair.get(n.node_id, "-")),
         _weight(n.traits.weight), _clip(_tags(n.traits.tags), 30), _clip(", ".join(n.locks) or "-", 60))
        for n in nodes
    ]  # fmt: skip
    return _table(header, rows)


def fair_shares(nodes: Sequence[NodePresence], live: Mapping[str, bool] | None, total: int) -> dict[str, int]:
    """Live node id -> its fair share of ``total`` locks under balanced placement:
    ``ceil(total * weight / the live nodes' total weight)`` (``mutex(nodes=...)`` patterns aside)."""
    weights = {n.node_id: n.traits.weight for n in nodes if live is None or live.get(n.node_id, False)}
    return capacities(weights, total, weights) if total > 0 else {}


def _node_state(live: Mapping[str, bool] | None, node_id: str) -> str:
    if live is None or node_id not in live:
        return "-"
    return "live" if live[node_id] else "stale"


#: A node that publishes no lease renewal still publishes its presence every 10 s
#: (:data:`mutexcron.heartbeat.PRESENCE_EVERY`): three missed ones make it stale.
STALE_PRESENCE = 30.0


def node_liveness(nodes: Sequence[NodePresence], records: Sequence[LockRecord]) -> tuple[list[NodePresence], dict[str, bool]]:
    """Judge each node by the store's clock, and keep only the locks the lock records say it holds.

    A node publishes its presence with every lease renewal (every lease/3) and every 10 s without
    one. It is *stale* once its presence is older than :data:`STALE_PRESENCE` and older than the
    longest lease of the locks it listed: by then it has missed three renewals, and its leases have
    run out. The locks a presence listed are kept only while the lock's record names that node as
    its holder: a lock released or taken over since is not shown as held by a node gone since.

    Returns:
        (the nodes with their held locks, node id -> live).
    """
    by_name = {r.name: r for r in records}
    judged: list[NodePresence] = []
    live: dict[str, bool] = {}
    for node in nodes:
        live[node.node_id] = node.age is not None and node.age <= stale_after(node, by_name)
        held = tuple(name for name in node.locks if name not in by_name or by_name[name].holder == node.node_id)
        judged.append(dataclasses.replace(node, locks=held))
    return judged, live


def stale_after(node: NodePresence, records: Mapping[str, LockRecord]) -> float:
    """Seconds after its last presence when ``node`` is stale: :data:`STALE_PRESENCE`, or the
    longest lease of the locks it listed (``records`` by name) if longer."""
    return max([STALE_PRESENCE, *(records[name].ttl for name in node.locks if name in records)])


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
    name = printable(record.name)
    return f"  {name} (by {printable(record.paused_by or '?')}{since}; `mutexcron resume {name}`)"


# -- the store --------------------------------------------------------------------------------------
@contextmanager
def _store(lock_url: str | None, what: str, *, read_only: bool = False) -> Iterator[LockStore]:
    """The lock store of ``lock_url``, closed afterwards; a store error is one message and its exit code.

    ``read_only``: a command that only reads (``status``, ``history``) creates nothing: a SQL store
    whose file or table does not exist is an error naming it, not an empty table left behind.
    """
    try:
        store = lock_store_from_url(lock_url or DEFAULT_LOCK_URL)
    except MutexcronError as exc:
        _fail_on(exc, what=what)
    if read_only:
        reading_only(store)
    try:
        missing = _missing_schema(store) if read_only else None
        if missing:
            _fail_missing(store, what, missing)
        yield store
    except MutexcronError as exc:
        _fail_on(exc, what=what)
    finally:
        store.close()


def _fail_missing(store: LockStore, what: str, missing: str) -> NoReturn:
    store.close()
    _fail(
        f"{what}: {missing} in {store.masked_url}: no node has used this store yet, or the URL names another "
        f"file, database or table than the nodes use. {what} creates nothing",
        EXIT_FAILURE,
    )


def _missing_schema(store: LockStore) -> str | None:
    """What reading a SQL lock store would have to create first (its SQLite file, its table), or None."""
    from ..backends.sql import DEFAULT_TABLE
    from ..locks.sql import SQLLockStore

    if not isinstance(store, SQLLockStore):
        return None  # Redis and MongoDB create nothing on a read
    backend = store.backend
    if backend.missing_file() or backend.missing_schema(store.table) is None:
        return backend.missing_file()
    return f"no such table {store.table!r} (?table=; default {DEFAULT_TABLE})"


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
    with _store(lock_url, "history", read_only=True) as store:
        runs = _runs(store, name, job)
        unknown = _unknown_name(store, name) if name is not None and not runs else None
        shown = store.masked_url
    if unknown:
        _fail(f"history: {unknown}", EXIT_FAILURE)
    runs = runs[:limit]
    if as_json:
        click.echo(json.dumps({"store": shown, "runs": [r.to_json() for r in runs]}, indent=2))
        return
    if not runs:
        click.echo(f"no runs recorded{f' for {name}' if name else ''} in {shown}", err=True)
        return
    click.echo(format_history(runs))


def _unknown_name(store: LockStore, name: str) -> str | None:
    """'no lock or job NAME in STORE (did you mean ...)' if no record names ``name`` as a lock or a job, else None."""
    records = store.list()
    names = {r.name for r in records}
    for record in records:
        names.update(record.fire_times or {})
        names.update(record.triggers or {})
    names.update(run.job for runs in store.history_many(sorted(r.name for r in records), None).values() for run in runs)
    if name in names:
        return None
    return f"no lock or job {printable(name)!r} in {store.masked_url}{_did_you_mean(name, sorted(names))}"


def _runs(store: LockStore, name: str | None, job: str | None) -> list[RunRecord]:
    """Newest first: the lock ``name``'s runs, else job ``name``'s wherever they are, else every lock's."""
    if name is not None and store.read(name) is not None:
        return store.history(name, job)
    names = [r.name for r in store.list()]
    wanted = name if name is not None else job
    found = [run for runs in store.history_many(names, wanted).values() for run in runs]
    return sorted(found, key=lambda r: r.ended.timestamp() if r.ended else 0.0, reverse=True)


# -- pause / resume ---------------------------------------------------------------------------------
def _pause(lock: str, by: str | None, force: bool, lock_url: str | None) -> None:
    """Pause LOCK on every node: none starts its jobs' fire times until `mutexcron resume LOCK`.

    The flag lives in the lock record; runs in progress finish, leases are still taken and renewed,
    and fire times that pass while paused are not claimed. A name the store has no record of (a
    typo, or a lock no node has taken yet) is refused; with --force it is paused anyway, and the
    lock starts paused when a node first takes it.
    """
    who = _checked(lock, by, "pause")
    with _store(lock_url, "pause") as store:
        _known(store, lock, force, "pause")
        record = store.set_paused(lock, True, who)
        shown = store.masked_url
    fresh = " (no node has taken it yet: it starts paused)" if record.token == 0 and record.holder is None else ""
    click.echo(f"{lock}: paused by {printable(record.paused_by)} at {_when(record.paused_at)} UTC in {shown}{fresh}")
    if record.holder:
        click.echo(f"{lock}: held by {printable(record.holder)} (token {record.token}); a run in progress there finishes")


def _checked(lock: str, by: str | None, what: str) -> str:
    """Who pauses or resumes ``lock``, once both pass the one name rule (:func:`check_name`: no
    control characters, at most 191 characters); a bad one exits with the problem and the fix."""
    try:
        check_name(lock, "lock name")
        return check_name(by, "--by") if by is not None else _operator()
    except ConfigurationError as exc:
        _fail_on(exc, what=what)


def _known(store: LockStore, lock: str, force: bool, what: str) -> None:
    """Exit with the problem and the fix if the store has no record of ``lock`` (unless ``force``)."""
    if force or store.read(lock) is not None:
        return
    fix = "To pause a lock before any node takes it" if what == "pause" else "To write the flag anyway"
    _fail(f"{what}: {_unknown_lock(store, lock)}. {fix}, add --force")


def _unknown_lock(store: LockStore, lock: str) -> str:
    """'no lock NAME in STORE', with the closest names the store has."""
    names = [r.name for r in store.list()]
    hint = _did_you_mean(lock, names)
    known = f"; it has {len(names)} lock{'s' if len(names) != 1 else ''}" if names else "; it has no locks yet"
    return f"no lock {printable(lock)!r} in {store.masked_url}{hint}{known}"


def _resume(lock: str, catch_up: bool, timeout: float, by: str | None, force: bool, lock_url: str | None) -> None:
    """Resume LOCK: its jobs run again from their next fire time.

    With --catch-up, each job that has run under LOCK also runs once now, through the lock, on the
    node that holds it (a `mutexcron trigger` request per job), making up for the fire times
    skipped while the lock was paused. It waits up to --timeout seconds and says what became of
    each request: "ran at ... on NODE", "merged into the run at ... on NODE" (a scheduled run that
    claimed a later fire time first), or why it did not run. Exits 1 if a catch-up did not run
    (within --timeout) or raised; the lock is resumed all the same.
    """
    who = _checked(lock, by, "resume")
    with _store(lock_url, "resume") as store:
        _known(store, lock, force, "resume")
        before = store.read(lock)
        record = store.set_paused(lock, False, who, catch_up=catch_up)
        shown = store.masked_url
    note = "" if before is not None and before.paused else " (it was not paused)"
    jobs = sorted(before.fire_times) if before is not None and catch_up else []
    after = f"; catch-up requested: {printable(', '.join(jobs))}" if jobs else ""
    if catch_up and not jobs:
        after = "; no job has run under it: nothing to catch up"
    click.echo(f"{lock}: resumed by {printable(record.paused_by)} at {_when(record.paused_at)} UTC in {shown}{note}{after}")
    if jobs:
        _catch_up(lock_url or DEFAULT_LOCK_URL, lock, jobs, timeout)


def _catch_up(lock_url: str, lock: str, jobs: Sequence[str], timeout: float) -> None:
    """One trigger request per job (:func:`mutexcron.guard.run_requests.request_runs`), then what
    became of each, within ``timeout`` seconds (0: not waited for)."""
    from ..guard.run_requests import request_runs, wait_for_runs

    requests = request_runs(lock_url, lock, jobs)
    if not timeout:
        for job, fire_time in requests.items():
            click.echo(f"{printable(job)}: requested (fire time {fire_time.isoformat()}); not waited for")
        return
    outcomes = wait_for_runs(lock_url, lock, requests, timeout)
    for job, outcome in outcomes.items():
        click.echo(f"{printable(job)}: {outcome}")
    if any(o.startswith("not run") or ": error: " in o for o in outcomes.values()):
        raise SystemExit(EXIT_FAILURE)  # the lock is resumed; a catch-up did not run, or raised


# -- forget -----------------------------------------------------------------------------------------
def _forget(lock: str | None, node_id: str | None, force: bool, lock_url: str | None) -> None:
    """Delete the record of LOCK (its holder, attrs, fire times, run history and pause), or with
    --node ID the presence record of a node.

    A lock whose holder's lease is live (by the store's clock) is refused unless --force, which
    takes it from its holder: that node's next renewal fails and it stops running the lock's jobs,
    as after a takeover. Its tokens stay spent (the store's token floor keeps them), so the next
    holder's token is greater: Redis and memory:// delete the record at once, the SQL stores and
    MongoDB retire it (out of the lock list; a later forget deletes it once it has been retired
    ``retired_keep``, 10 min). A node
    that is live (as ``status`` judges it: seen in the last 30 s, or within its longest lease) is
    refused unless --force: a running node writes its presence again.
    """
    if (lock is None) == (node_id is None):
        _fail("forget: give a LOCK, or --node ID (not both)")
    if node_id is not None:
        _forget_node(node_id, force, lock_url)
        return
    assert lock is not None
    _checked(lock, None, "forget")
    with _store(lock_url, "forget") as store:
        before = store.read(lock)
        outcome = FORGET_MISSING if before is None else store.forget(lock, force=force)
        if outcome == FORGET_MISSING:
            _fail(f"forget: {_unknown_lock(store, lock)}")
        shown, keep = store.masked_url, store.retired_keep
    assert before is not None
    name = printable(lock)
    if outcome == FORGET_HELD:
        age = _age(before.heartbeat_age)
        _fail(f"forget: {name!r} is held by {printable(before.holder)} (token {before.token}, heartbeat {age} ago, "
              f"lease {before.ttl:g}s): not forgotten. Stop that node first, or wait for its lease to run out; --force "
              "takes the lock from it", EXIT_FAILURE)  # fmt: skip
    if before.holder is not None and force:
        click.echo(f"{name}: taken from {printable(before.holder)} (token {before.token}): its next renewal fails")
    spent = f"its token {before.token} stays spent: the next holder's token is greater"
    if outcome == FORGET_DELETED:
        click.echo(f"{name}: forgotten (record deleted from {shown})" + (f"; {spent}" if before.token else ""))
    else:
        click.echo(f"{name}: forgotten: retired in {shown} (out of the lock list; its pause, attrs, fire times and run "
                   f"history cleared), deleted by a later forget once retired {_age(keep)}; {spent}")  # fmt: skip


def _forget_node(node_id: str, force: bool, lock_url: str | None) -> None:
    with _store(lock_url, "forget") as store:
        seen = {n.node_id: n for n in _optional(store.nodes, [])}.get(node_id)
        if seen is None:
            hint = _did_you_mean(node_id, [n.node_id for n in _optional(store.nodes, [])])
            _fail(f"forget: no node {printable(node_id)!r} seen in the last 10 minutes in {store.masked_url}{hint}")
        limit = stale_after(seen, {r.name: r for r in store.list()})
        if not store.forget_node(node_id, min_age=0.0 if force else limit):
            _fail(f"forget: node {printable(node_id)!r} was seen {_age(seen.age)} ago: it is running and writes its "
                  "presence again with its next renewal. Stop it first; --force deletes the record anyway",
                  EXIT_FAILURE)  # fmt: skip
        shown = store.masked_url
    count = len(seen.locks)
    held = f" (it named {count} lock{'s' if count != 1 else ''}; their records are unchanged)" if count else ""
    click.echo(f"node {printable(node_id)}: forgotten (presence deleted from {shown}){held}")


# -- status -----------------------------------------------------------------------------------------
@dataclass
class StatusReport:
    """What ``status`` shows: the locks, the nodes, the paused locks and each job's last run."""

    store: str
    records: list[LockRecord]
    #: None: the store keeps no presence.
    nodes: list[NodePresence] | None
    last_runs: list[RunRecord] = field(default_factory=list)
    #: Node id -> live (True) or stale (False), by the store's clock (:func:`node_liveness`).
    live: dict[str, bool] = field(default_factory=dict)
    #: Why there are no locks to show (no lock table yet), or None.
    note: str | None = None

    @property
    def paused(self) -> list[LockRecord]:
        return [r for r in self.records if r.paused]

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "locks": [r.to_json() for r in self.records],
            "nodes": None if self.nodes is None else [self._node_json(n) for n in self.nodes],
            "paused": [r.name for r in self.paused],
            "last_runs": [r.to_json() for r in self.last_runs],
        }

    def _node_json(self, node: NodePresence) -> dict[str, Any]:
        fair = fair_shares(self.nodes or [], self.live, len(self.records)).get(node.node_id)
        return {**node.to_json(), "state": _node_state(self.live, node.node_id), "share": len(node.locks), "fair_share": fair}

    def lines(self) -> Iterator[str]:
        count = len(self.records)
        if self.note:
            yield f"lock store: {self.store}  (no locks: {self.note}; no node has run on this store yet)"
            return
        yield f"lock store: {self.store}  ({count} lock{'s' if count != 1 else ''})"
        if self.records:
            yield format_status(self.records)
        if self.nodes is not None:
            if self.nodes:
                yield f"nodes ({len(self.nodes)} seen in the last 10 minutes):"
                yield format_nodes(self.nodes, self.live, len(self.records))
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
    live: dict[str, bool] = {}
    if nodes is not None:
        nodes, live = node_liveness(nodes, records)
    return StatusReport(store.masked_url, records, nodes, last_runs, live)


def _status(jobs: str | None, lock_url: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Show every lock (holder, heartbeat, state, paused, last run), the nodes, and each job's last run.

    With JOBS (a jobs file), use that scheduler's lock store unless --lock-url is given. --watch
    redraws the view every --interval seconds while stdout is a terminal (Ctrl-C stops it);
    elsewhere it prints once.
    """
    from .tasks import task_status

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
        missing = _missing_schema(store)
        # No lock table: fine where producers have added tasks (the task table exists), else a typo
        # or a store no node has used; status creates nothing either way.
        if missing and (missing.startswith("no such file") or task_status(store.url, sched).note is not None):
            _fail_missing(store, "status", missing)

        def render() -> str:
            # The store's URL has no ?history=, which the task store (same URL) would hand to its driver.
            report = StatusReport(store.masked_url, [], None, note=missing) if missing else status_report(store)
            tasks = task_status(store.url, sched)
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
pause: click.Command = _command(
    "pause",
    _pause,
    click.argument("lock"),
    _BY,
    click.option("--force", is_flag=True, help="Pause a name the store has no record of (no node has taken it yet)."),
    _lock_url_option(),
)
resume: click.Command = _command(
    "resume",
    _resume,
    click.argument("lock"),
    click.option("--catch-up", is_flag=True, help="Also run each job of the lock once now, on its holder (a trigger)."),
    click.option(
        "--timeout",
        type=click.FloatRange(min=0),
        default=60.0,
        show_default=True,
        help="With --catch-up: seconds to wait for the runs and say what became of each (0: do not wait).",
    ),
    _BY,
    click.option("--force", is_flag=True, help="Write the flag for a name the store has no record of."),
    _lock_url_option(),
)
forget: click.Command = _command(
    "forget",
    _forget,
    click.argument("lock", required=False),
    click.option("--node", "node_id", metavar="ID", help="Forget this node's presence record instead of a lock."),
    click.option("--force", is_flag=True, help="Also a lock with a live lease (taken from its holder), or a node seen just now."),
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

