"""The pages: each is a few sections of server-rendered HTML, refreshed in place by the page's
script from ``/api/sections/<page>`` (the same functions render them both times).

:data:`PAGES` is the one list of pages: a new page (the shared job stores' page, for one) is a
:class:`PageDef` added to it, with a function from a :class:`Context` to its sections; the
navigation, the routes and the refresh endpoint follow from the list.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import escape
from typing import Any
from urllib.parse import urlencode

from ..formatting import age as _age
from ..formatting import clip as _clip
from ..formatting import offset as _offset
from ..formatting import record_json
from ..formatting import share as _share
from ..formatting import tags as _tags
from ..formatting import weight as _weight
from ..formatting import when as _when
from ..guard.triggers import TRIGGER_CODE, is_trigger_code
from ..locks.record import LockRecord, NodePresence, RunRecord
from ..names import printable
from ..observability.feed import FEED_KINDS, FeedEvent
from ..placement.rendezvous import capacities
from ..tasks import STATES, CodeSummary, TaskRecord
from ..tasks.handlers import INTERNAL_PREFIX
from ..version import __version__
from .actions import AuditEntry
from .alarms import Alarm, alarms
from .charts import Bar, Series, bar_chart, count, line_chart, seconds
from .jobsfile import JobsFile
from .reads import THROUGHPUT_MINUTES, Snapshot, StoreReader, Throughput

__all__ = ["PAGES", "Context", "PageDef", "render_page"]

log = logging.getLogger(__name__)

#: Tasks listed on the Tasks page at most (a bulk action takes every task the filter selects).
TASK_ROWS = 100


@dataclass
class Context:
    """What a page is rendered from: one snapshot, the jobs file, the request's query."""

    base: str
    reader: StoreReader
    snap: Snapshot
    jobs: JobsFile | None
    actions: bool
    audit: list[AuditEntry]
    query: Mapping[str, str]

    def link(self, path: str, **query: str | None) -> str:
        params = {k: v for k, v in query.items() if v}
        return escape(f"{self.base}/{path}" + (f"?{urlencode(params)}" if params else ""))


@dataclass(frozen=True)
class PageDef:
    """A page: its path (``""`` is the Overview), title, whether the navigation shows it, its
    sections, and whether they show every lock's kept runs (:meth:`StoreReader.snapshot`)."""

    path: str
    title: str
    nav: bool
    sections: Callable[[Context], dict[str, str]]
    histories: bool = False


# -- small pieces ---------------------------------------------------------------------------------
def _badge(text: str, kind: str) -> str:
    return f'<span class="badge {escape(kind)}">{escape(text)}</span>'


def _button(ctx: Context, label: str, action: str, args: Mapping[str, Any], confirm: str = "", kind: str = "",
            prompt: str = "") -> str:  # fmt: skip
    """An action's button; ``prompt`` asks for its ``value`` first (the page's script)."""
    if not ctx.actions:
        return ""
    data = escape(json.dumps(dict(args)), quote=True)
    ask = f' data-confirm="{escape(confirm, quote=True)}"' if confirm else ""
    ask += f' data-prompt="{escape(prompt, quote=True)}"' if prompt else ""
    return f'<button class="act {escape(kind)}" data-action="{escape(action)}" data-args="{data}"{ask}>{escape(label)}</button>'


def _table(header: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    # In a box of its own that scrolls sideways: a wide table never widens the page (a phone's 390 px).
    table = f'<table class="{escape(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    return f'<div class="scroll" tabindex="0">{table}</div>'


def _t(value: Any) -> str:
    """Text for a page: HTML-escaped, and a control or direction-override character shown as its escape."""
    return escape("-" if value is None or value == "" else printable(value))


def _ago(snap: Snapshot, when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = (snap.now - when).total_seconds()
    return escape(f"{_age(abs(seconds))} {'ago' if seconds >= 0 else 'ahead'}")


def _outcome(run: RunRecord | None) -> str:
    if run is None:
        return _badge("no run kept", "muted")
    return _badge(run.outcome, "ok" if run.outcome == "success" else "err")


def _dur(value: float | None) -> str:
    """A duration in the unit that suits it (µs, ms, s, min), as the charts' axes show it."""
    return "-" if value is None else seconds(value)


def _lag(run: RunRecord) -> float | None:
    if run.started is None or run.fire_time is None:
        return None
    return max(0.0, (run.started - run.fire_time).total_seconds())


def _notes(snap: Snapshot, *parts: str) -> str:
    shown = [f'<p class="note">{_t(snap.notes[p])}</p>' for p in parts if p in snap.notes]
    shown += [f'<p class="alarm error">{_t(p)}: {_t(snap.errors[p])}</p>' for p in parts if p in snap.errors]
    return "".join(shown)


def _jobs_of(ctx: Context, record: LockRecord, runs: Iterable[RunRecord] = ()) -> list[str]:
    """The jobs of a lock: claimed in it, in its kept ``runs``, or in the jobs file under it."""
    names = set(record.fire_times) | {r.job for r in runs}
    if ctx.jobs is not None:
        names |= {j.job_id for j in ctx.jobs.of_lock(record.name)}
    return sorted(names)


def known_jobs(snap: Snapshot, jobs: JobsFile | None) -> set[str]:
    """Every job id the store, the jobs file or its shared job stores know (a trigger must name one)."""
    names = {job for r in snap.locks or () for job in r.fire_times}
    names |= {run.job for runs in snap.histories.values() for run in runs}
    if jobs is not None:
        names |= set(jobs.jobs)
        try:
            names |= {row["job"] for row in jobs.shared_jobs()}
        except Exception:
            log.debug("cannot read the shared job stores", exc_info=True)
    return names


# -- Overview -------------------------------------------------------------------------------------
def overview(ctx: Context) -> dict[str, str]:
    return {"counts": _counts(ctx), "alarms": _alarms(ctx), "nodes": _nodes(ctx), "events": _events(ctx), "audit": _audit(ctx)}


def _counts(ctx: Context) -> str:
    snap = ctx.snap
    locks = snap.locks or []
    nodes = snap.nodes or []
    live = sum(1 for n in nodes if snap.live(n))
    by_state = {s: sum(1 for r in locks if r.state == s) for s in ("active", "stale", "released")}
    tasks = {s: sum(getattr(c, s) for c in snap.tasks or ()) for s in ("queued", "running", "failed")}
    cells = [
        ("locks", len(locks), f"{by_state['active']} held, {by_state['stale']} stale, {sum(r.paused for r in locks)} paused"),
        ("jobs", len(known_jobs(snap, ctx.jobs)), "in the store" + (" and the jobs file" if ctx.jobs else "")),
        ("nodes", live, f"live; {len(nodes) - live} stopped or lost" if snap.nodes is not None else "no presence kept"),
        ("tasks queued", tasks["queued"], f"{sum(c.due_now for c in snap.tasks or ())} due now"),
        ("tasks running", tasks["running"], ""),
        ("tasks failed", tasks["failed"], ""),
    ]
    kind = {"tasks failed": "err" if tasks["failed"] else "", "locks": "warn" if by_state["stale"] else ""}
    tiles = "".join(f'<div class="tile {kind.get(name, "")}"><div class="num">{value}</div><div class="lbl">{escape(name)}</div>'
                    f'<div class="sub">{escape(sub)}</div></div>' for name, value, sub in cells)  # fmt: skip
    clock = "the store's clock" if snap.now_from_store else "this host's clock (no record gave the store's)"
    return (f'<div class="tiles">{tiles}</div><p class="muted">store {_t(snap.store)} · read at '
            f"{_when(snap.now)} UTC by {clock} · {snap.calls} store calls, {snap.seconds * 1000:.1f} ms</p>"
            + _notes(snap, "locks"))  # fmt: skip


def _alarms(ctx: Context) -> str:
    found: list[Alarm] = alarms(ctx.snap, ctx.jobs)
    note = (
        ""
        if ctx.jobs
        else '<p class="muted">Missed-run alarms, and a holder running another jobs file (zone, lease, triggers), '
        "need the jobs file: start the dashboard with --jobs jobs.py.</p>"
    )
    if not found:
        return f'<p class="ok-line">No alarms.</p>{note}'
    items = "".join(f'<li class="alarm {escape(a.level)}">{_badge(a.kind, a.level)} {_alarm_text(ctx, a)}</li>' for a in found)
    return f'<ul class="alarms">{items}</ul>{note}'


def _alarm_text(ctx: Context, alarm: Alarm) -> str:
    if alarm.link is None:
        return _t(alarm.text)
    path, query = alarm.link
    return f'<a href="{ctx.link(path, **query)}">{_t(alarm.text)}</a>'


def _nodes(ctx: Context) -> str:
    snap = ctx.snap
    if snap.nodes is None:
        return _notes(snap, "nodes") or '<p class="muted">This store keeps no node presence.</p>'
    if not snap.nodes:
        return '<p class="muted">No node seen in the last 10 minutes.</p>'
    # Locks held by the lock records (the holder, its lease running), not by the node's last presence:
    # a node killed a moment ago still names its locks there until its presence goes stale.
    held: dict[str, list[str]] = {}
    for record in snap.locks or ():
        if record.holder is not None and record.state == "active":
            held.setdefault(record.holder, []).append(record.name)
    chosen = ctx.query.get("node")
    total = len(snap.locks or ())
    live_weights = {n.node_id: n.traits.weight for n in snap.nodes if snap.live(n)}
    fair = capacities(live_weights, total, live_weights) if total else {}
    rows = [
        (f'<a href="{ctx.link("", node=n.node_id)}">{_t(n.node_id)}</a>', _node_state(snap, n), _t(n.ip), _t(n.version),
         _ago(snap, n.last_seen), escape(_offset(n.clock_offset)),
         escape(_share(len(held.get(n.node_id, [])), total)), _t(str(fair.get(n.node_id, "-"))),
         _t(_weight(n.traits.weight)), _t(_tags(n.traits.tags)),
         f'<span class="held">{_t(", ".join(held.get(n.node_id, [])) or None)}</span>')
        for n in snap.nodes
        if chosen in (None, "", n.node_id)
    ]  # fmt: skip
    header = ("node", "state", "IP", "version", "last seen", "clock offset", "share", "fair share", "weight", "tags",
              "locks held")  # fmt: skip
    return _table(header, rows, "nodes")


def _node_state(snap: Snapshot, node: NodePresence) -> str:
    state, since = snap.node_state(node)
    when = f" {_ago(snap, since)}" if state != "live" and since is not None else ""
    return _badge(state, {"live": "ok", "stopped": "muted"}.get(state, "err")) + f'<span class="muted">{when}</span>'


#: Events shown on the Overview at most.
EVENT_ROWS = 50
#: Events of the same kind and subject from several nodes within this many seconds are one (every
#: node sees a pause, a missed fire time).
_SAME_EVENT = 30.0


def feed_events(snap: Snapshot) -> list[FeedEvent]:
    """The feed, newest first, with each node lost since it last renewed (no event of its own:
    it could not say so), and an event every node saw shown once."""
    found = list(snap.feed or ())
    for node in snap.nodes or ():
        state, since = snap.node_state(node)
        if state == "lost":
            age = f"{_age((snap.now - since).total_seconds())} ago" if since is not None else "long ago"
            found.append(FeedEvent("node_lost", node.node_id, None, f"node {node.node_id} lost: last renewed {age}",
                                   at=since))  # fmt: skip
    found.sort(key=lambda e: e.at or snap.now, reverse=True)
    shown: list[FeedEvent] = []
    for event in found:
        if event.kind in ("lock_paused", "lock_resumed", "run_missed") and any(_same(event, s) for s in shown):
            continue
        shown.append(event)
    return shown


def _same(a: FeedEvent, b: FeedEvent) -> bool:
    close = a.at is not None and b.at is not None and abs((a.at - b.at).total_seconds()) < _SAME_EVENT
    return close and a.kind == b.kind and a.subject == b.subject and a.fields.get("job") == b.fields.get("job")


def _events(ctx: Context) -> str:
    snap = ctx.snap
    if snap.feed is None:
        return _notes(snap, "feed") or '<p class="muted">This store keeps no event feed.</p>'
    kind, node = ctx.query.get("kind") or None, ctx.query.get("node") or None
    chosen = [e for e in feed_events(snap) if kind in (None, e.kind) and node in (None, e.node)][:EVENT_ROWS]
    rows = [(escape(_when(e.at)[11:19] if e.at else "-"), _badge(FEED_KINDS.get(e.kind, e.kind), _EVENT_BADGE.get(e.kind, "")),
             _event_text(ctx, e)) for e in chosen]  # fmt: skip
    table = _table(("time (UTC)", "what", "event"), rows, "events") if rows else '<p class="muted">No event.</p>'
    return table


_EVENT_BADGE = {"lock_taken_over": "warn", "run_failed": "err", "run_missed": "err", "task_failed": "err",
                "task_attempt_failed": "warn", "node_lost": "err", "lock_paused": "warn", "lock_acquired": "ok"}  # fmt: skip


def _event_text(ctx: Context, event: FeedEvent) -> str:
    """The event's line, linked to what it is about: a lock, a job's runs, a task, a node."""
    text = _t(event.text)
    if event.kind in ("task_failed", "task_attempt_failed"):
        href = ctx.link("task", code=event.subject, key=event.fields.get("key"))
    elif event.kind in ("run_failed", "run_missed"):
        href = ctx.link("history", lock=event.subject, job=event.fields.get("job"))
    elif event.subject is not None:
        href = ctx.link("lock", name=event.subject)
    else:
        href = ctx.link("", node=event.node)
    return f'<a href="{href}">{text}</a>'


def _event_filters(ctx: Context) -> str:
    kind, node = ctx.query.get("kind", ""), ctx.query.get("node", "")
    kinds = '<option value="">every kind</option>' + "".join(
        f'<option value="{escape(k)}"{" selected" if k == kind else ""}>{escape(text)}</option>' for k, text in FEED_KINDS.items()
    )
    nodes = sorted({n.node_id for n in ctx.snap.nodes or ()} | {e.node for e in ctx.snap.feed or () if e.node})
    node_options = '<option value="">every node</option>' + "".join(
        f'<option{" selected" if n == node else ""}>{_t(n)}</option>' for n in nodes
    )
    return (f'<form class="filters" method="get" action="{ctx.link("")}">'
            f'<label>event <select name="kind">{kinds}</select></label>'
            f'<label>node <select name="node">{node_options}</select></label>'
            '<button type="submit">Filter</button></form>')  # fmt: skip


def _audit(ctx: Context) -> str:
    if not ctx.audit:
        return '<p class="muted">No action taken from this dashboard since it started.</p>'
    rows = [(escape(f"{_when(e.at)} UTC"), _t(e.by), _t(e.action), _t(e.target), _t(e.result)) for e in ctx.audit[:15]]
    return _table(("when", "by", "action", "target", "result"), rows)


# -- Locks and jobs -------------------------------------------------------------------------------
#: The Locks page's columns a click sorts by, and each row's key for it.
_LOCK_SORTS: dict[str, Callable[[LockRecord], Any]] = {
    "name": lambda r: r.name,
    "state": lambda r: (r.state, r.name),
    "holder": lambda r: (r.holder or "", r.name),
    "token": lambda r: r.token,
    "last run": lambda r: r.last_run_finished.timestamp() if r.last_run_finished is not None else 0.0,
}


def locks(ctx: Context) -> dict[str, str]:
    """Every lock as one row: filtered by name, state and node (holder or last run's), sorted by a column."""
    snap = ctx.snap
    if not snap.locks:
        return {"locks": _notes(snap, "locks", "history") or '<p class="muted">No lock in the store yet.</p>'}
    q, state, node = (ctx.query.get(k) or None for k in ("q", "state", "node"))
    chosen = [r for r in snap.locks if (q is None or q in r.name) and state in (None, r.state, "paused" if r.paused else None)
              and node in (None, r.holder, r.active_ip)]  # fmt: skip
    sort = ctx.query.get("sort") or "name"
    sort = sort if sort in _LOCK_SORTS else "name"
    chosen.sort(key=_LOCK_SORTS[sort], reverse=ctx.query.get("dir") == "desc")
    rows = [_lock_row(ctx, r) for r in chosen]
    what = f'<p class="muted">{len(chosen)} of {len(snap.locks)} locks</p>'
    return {"locks": _notes(snap, "history") + what + _sortable_table(ctx, rows, "locks")}


def _sortable_table(ctx: Context, rows: list[tuple[str, ...]], cls: str) -> str:
    """The Locks table; a sortable column's header links to the page sorted by it (again: the other way)."""
    header = ("name", "state", "holder", "lease left", "token", "jobs", "last run", "")
    heads = []
    for name in header:
        if name not in _LOCK_SORTS:
            heads.append(f"<th>{escape(name)}</th>")
            continue
        now, way = ctx.query.get("sort") == name, ctx.query.get("dir")
        query = {**ctx.query, "sort": name, "dir": "desc" if now and way != "desc" else "asc"}
        sorted_as = ' aria-sort="descending"' if now and way == "desc" else ' aria-sort="ascending"' if now else ""
        heads.append(f'<th{sorted_as}><a href="{ctx.link("locks", **query)}">{escape(name)}</a></th>')
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    table = f'<table class="{cls}"><thead><tr>{"".join(heads)}</tr></thead><tbody>{body}</tbody></table>'
    return f'<div class="scroll" tabindex="0">{table}</div>'


def _lock_row(ctx: Context, record: LockRecord) -> tuple[str, ...]:
    """One lock, from its record alone (its last run is in it: no read of the run histories)."""
    jobs = _jobs_of(ctx, record)
    ended = record.last_run_finished
    outcome = _badge("error", "err") if record.last_error else _badge("success", "ok")
    return (
        f'<a href="{ctx.link("lock", name=record.name)}">{_t(record.name)}</a>',
        _lock_state(record),
        _t(record.holder),
        escape(_lease_left(record)),
        str(record.token),
        ", ".join(f'<a href="{ctx.link("history", lock=record.name, job=j)}">{_t(j)}</a>' for j in jobs[:4])
        + (f" +{len(jobs) - 4}" if len(jobs) > 4 else ""),
        f"{outcome} {_ago(ctx.snap, ended)}" if ended is not None else "-",
        f'<span class="actions">{_pause_buttons(ctx, record)}</span>',
    )


def _lock_state(record: LockRecord) -> str:
    state = _badge(record.state, {"active": "ok", "stale": "warn"}.get(record.state, "muted"))
    return state + (_badge(f"paused by {record.paused_by or '?'}", "warn") if record.paused else "")


def _lease_left(record: LockRecord) -> str:
    if record.state != "active" or record.heartbeat_age is None:
        return "-"
    return f"{max(0.0, record.ttl - record.heartbeat_age):.1f}s of {record.ttl:g}s"


def _pause_buttons(ctx: Context, record: LockRecord) -> str:
    if record.paused:
        return _button(ctx, "Resume", "resume", {"lock": record.name}, f"Resume lock {record.name}?") + _button(
            ctx, "Resume + catch up", "resume", {"lock": record.name, "catch_up": True},
            f"Resume lock {record.name} and run each of its jobs once now?")  # fmt: skip
    return _button(ctx, "Pause", "pause", {"lock": record.name}, f"Pause lock {record.name} on every node?", "warn")


def _locks_filters(ctx: Context) -> str:
    q, state, node = (ctx.query.get(k, "") for k in ("q", "state", "node"))
    states = '<option value="">every state</option>' + "".join(
        f'<option{" selected" if s == state else ""}>{s}</option>' for s in ("active", "stale", "released", "paused")
    )
    nodes = sorted({r.holder for r in ctx.snap.locks or () if r.holder} | {n.node_id for n in ctx.snap.nodes or ()})
    node_options = '<option value="">every node</option>' + "".join(
        f'<option{" selected" if n == node else ""}>{_t(n)}</option>' for n in nodes
    )
    return (f'<form class="filters" method="get" action="{ctx.link("locks")}">'
            f'<label>name contains <input name="q" value="{escape(q, quote=True)}"></label>'
            f'<label>state <select name="state">{states}</select></label>'
            f'<label>holder or node <select name="node">{node_options}</select></label>'
            '<button type="submit">Filter</button></form>')  # fmt: skip


def lock(ctx: Context) -> dict[str, str]:
    """One lock's page: its state, holder, lease, jobs and their runs' charts."""
    name = ctx.query.get("name", "")
    record = ctx.snap.lock(name)
    if record is None:
        return {"lock": _notes(ctx.snap, "locks") or f'<p class="muted">No lock {_t(name)} in the store.</p>'}
    return {"lock": _lock_card(ctx, record, ctx.reader.history(record.name))}


def _lock_card(ctx: Context, record: LockRecord, kept: list[RunRecord]) -> str:
    """The lock's state and actions, its jobs (with ``kept``, its runs, newest first) and their charts."""
    title = f'<h3><a href="{ctx.link("lock", name=record.name)}">{_t(record.name)}</a></h3>'
    head = (f'<div class="card-head">{title}{_lock_state(record)}<span class="kv">holder <b>{_t(record.holder)}</b>'
            f'</span><span class="kv">lease left <b>{escape(_lease_left(record))}</b></span>'
            f'<span class="kv">token <b>{record.token}</b></span>'
            f'<span class="actions">{_pause_buttons(ctx, record)}</span></div>')  # fmt: skip
    runs = list(reversed(kept))  # oldest first
    charts = ""
    if runs:
        durations = [Bar(f"{r.job} {_when(r.ended)} {r.outcome} {seconds(r.duration or 0.0)} on {r.node}", r.duration or 0.0,
                         "ok" if r.outcome == "success" else "err", r.ended) for r in runs]  # fmt: skip
        lags = [Bar(f"{r.job} fire {_when(r.fire_time)}: started {seconds(lag)} late", lag, "lag", r.ended)
                for r in runs if (lag := _lag(r)) is not None]  # fmt: skip
        charts = (f'<div class="charts">{bar_chart("run duration", durations, f"{len(runs)} kept runs")}'
                  f'{bar_chart("start lag (fire time to first line)", lags)}</div>')  # fmt: skip
    jobs = _jobs_table(ctx, record, kept)
    return f'<div class="card lock" data-lock="{escape(record.name, quote=True)}">{head}{jobs}{charts}</div>'


def _jobs_table(ctx: Context, record: LockRecord, kept: list[RunRecord]) -> str:
    rows = []
    for job in _jobs_of(ctx, record, kept):
        last = next((r for r in kept if r.job == job), None)
        scheduled = ctx.jobs.jobs.get(job) if ctx.jobs is not None else None
        following = scheduled.next_fire_time(ctx.snap.now) if scheduled is not None else None
        trigger = _button(
            ctx, "Trigger now", "trigger", {"job": job, "lock": record.name}, f"Run job {job} once now on its holder?"
        )
        rows.append((
            f'<a href="{ctx.link("history", lock=record.name, job=job)}">{_t(job)}</a>',
            _t(scheduled.schedule if scheduled else None),
            escape(_when(following)),
            escape(_when(record.fire_times.get(job))),
            _outcome(last),
            escape(_dur(last.duration)) if last else "-",
            _t(last.node if last else None),
            _ago(ctx.snap, last.ended) if last else "-",
            _t(_clip(last.error, 60) if last and last.error else None),
            f'{trigger}<span class="outcome" data-job="{escape(job, quote=True)}"></span>',
        ))  # fmt: skip
    header = (
        "job",
        "schedule",
        "next fire (UTC)",
        "last fire claimed (UTC)",
        "last run",
        "duration",
        "node",
        "ended",
        "error",
        "",
    )
    return _table(header, rows, "jobs")


# -- History --------------------------------------------------------------------------------------
#: Runs listed in the cluster-wide recent-runs table at most.
RUN_ROWS = 200


def history(ctx: Context) -> dict[str, str]:
    lock, job = ctx.query.get("lock") or None, ctx.query.get("job") or None
    if lock is None:
        return {"runs": _recent_runs(ctx)}
    runs = ctx.reader.history(lock, job)
    if not runs:
        return {
            "runs": f'<p class="muted">No run of {_t(job or lock)} is kept '
            "(?history=N on the lock URL keeps the last N runs per job).</p>"
        }
    oldest_first = list(reversed(runs))
    durations = [Bar(f"{_when(r.ended)} {r.outcome} {seconds(r.duration or 0.0)}", r.duration or 0.0,
                     "ok" if r.outcome == "success" else "err", r.ended) for r in oldest_first]  # fmt: skip
    lags = [Bar(f"{_when(r.fire_time)}: {seconds(lag)} late", lag, "lag", r.ended)
            for r in oldest_first if (lag := _lag(r)) is not None]  # fmt: skip
    charts = f'<div class="charts">{bar_chart("run duration", durations)}{bar_chart("start lag", lags)}</div>'
    return {"runs": charts + _runs_table(ctx, runs, _tracebacks(ctx, lock))}


def _tracebacks(ctx: Context, lock: str) -> dict[tuple[str, int, str], str]:
    """The kept tracebacks of ``lock``'s failed runs (the event feed), by job, token and fire time."""
    found = {}
    for event in ctx.reader.events(("run_failed",), lock):
        if event.detail:
            fields = event.fields
            found[(str(fields.get("job")), int(fields.get("token") or 0), str(fields.get("fire_time")))] = event.detail
    return found


def _runs_table(ctx: Context, runs: list[RunRecord], tracebacks: Mapping[tuple[str, int, str], str]) -> str:
    rows = [
        (escape(f"{_when(r.ended)}"), f'<a href="{ctx.link("history", lock=r.lock, job=r.job)}">{_t(r.job)}</a>',
         f'<a href="{ctx.link("lock", name=r.lock)}">{_t(r.lock)}</a>', _outcome(r), escape(_dur(r.duration)),
         escape(_dur(_lag(r))), _t(r.node), str(r.token), escape(_when(r.fire_time)),
         _error_cell(r.error, tracebacks.get((r.job, r.token, str(r.fire_time)))))
        for r in runs
    ]  # fmt: skip
    header = ("ended (UTC)", "job", "lock", "outcome", "duration", "start lag", "node", "token", "fire time (UTC)", "error")
    return _table(header, rows, "runs")


def _error_cell(error: str | None, traceback: str | None) -> str:
    """An error, folded: its first line, and the whole text (the traceback, if kept) on a click."""
    if not error and not traceback:
        return "-"
    whole = traceback or error or ""
    head = _clip((error or whole).splitlines()[0] if (error or whole) else "", 80)
    if whole == head:
        return _t(head)
    return f'<details class="error"><summary>{_t(head)}</summary><pre>{escape(whole)}</pre></details>'


def _recent_runs(ctx: Context) -> str:
    """Every kept run of the cluster, newest first, filtered by lock, job, node and outcome."""
    chosen = {key: ctx.query.get(key) or None for key in ("node", "outcome", "q")}
    runs = [r for runs in ctx.snap.histories.values() for r in runs]
    runs = [r for r in runs if (chosen["node"] in (None, r.node)) and (chosen["outcome"] in (None, r.outcome))
            and (chosen["q"] is None or chosen["q"] in f"{r.lock} {r.job}")]  # fmt: skip
    runs.sort(key=lambda r: r.ended or ctx.snap.now, reverse=True)
    if not runs:
        return '<p class="muted">No kept run matches (?history=N on the lock URL keeps the last N runs per job).</p>'
    tracebacks = {}
    for lock in {r.lock for r in runs[:RUN_ROWS] if r.outcome != "success"}:
        tracebacks.update(_tracebacks(ctx, lock))
    more = f'<p class="muted">The newest {RUN_ROWS} of {len(runs)} are listed.</p>' if len(runs) > RUN_ROWS else ""
    return _runs_table(ctx, runs[:RUN_ROWS], tracebacks) + more


def _runs_filters(ctx: Context) -> str:
    query = {key: ctx.query.get(key, "") for key in ("q", "node", "outcome")}
    nodes = sorted({r.node for runs in ctx.snap.histories.values() for r in runs if r.node})
    node_options = '<option value="">every node</option>' + "".join(
        f'<option{" selected" if n == query["node"] else ""}>{_t(n)}</option>' for n in nodes
    )
    outcomes = '<option value="">every outcome</option>' + "".join(
        f'<option{" selected" if o == query["outcome"] else ""}>{o}</option>' for o in ("success", "error")
    )
    return (f'<form class="filters" method="get" action="{ctx.link("history")}">'
            f'<label>lock or job <input name="q" value="{escape(query["q"], quote=True)}"></label>'
            f'<label>node <select name="node">{node_options}</select></label>'
            f'<label>outcome <select name="outcome">{outcomes}</select></label>'
            '<button type="submit">Filter</button></form>')  # fmt: skip


# -- Tasks ----------------------------------------------------------------------------------------
def tasks(ctx: Context) -> dict[str, str]:
    return {"codes": _codes(ctx), "selection": _selection(ctx)}


def _codes(ctx: Context) -> str:
    snap = ctx.snap
    if snap.tasks is None:
        return _notes(snap, "tasks") or '<p class="muted">No task pool.</p>'
    flow = ctx.reader.throughput(snap.now)
    summaries = {c.code: c for c in snap.tasks}
    for code in flow.per_minute if flow is not None else ():  # finished lately, none left: still charted
        summaries.setdefault(code, CodeSummary(code))
    summaries, grouped = _group_triggers(summaries)
    hidden = [code for code in summaries if code.startswith(INTERNAL_PREFIX)]
    if not ctx.query.get("internal"):  # mutexcron's own codes (trigger requests): not the user's
        summaries = {code: c for code, c in summaries.items() if code not in hidden}
    if not summaries:
        return _notes(snap, "tasks") or '<p class="muted">No tasks.</p>'
    rows, charts = [], []
    for code, c in sorted(summaries.items()):
        handled = (
            ""
            if ctx.jobs is None or c.code in ctx.jobs.task_codes or not c.due_now
            else _badge("no handler in the jobs file", "warn")
        )
        link = ctx.link("tasks", code=grouped.get(code, [code])[0], state="failed" if c.failed else None)
        name = (f'<a href="{link}">{_t(c.code)}</a>' if len(grouped.get(code, ())) < 2 else
                f'{_t(c.code)} <span class="muted">({len(grouped[code])} codes, one per bucket of job ids)</span>')  # fmt: skip
        rows.append((f"{name} {handled}",
                     str(c.queued), str(c.due_now), str(c.running),
                     _badge(str(c.failed), "err") if c.failed else "0",
                     escape(_age(c.oldest_overdue))))  # fmt: skip
        samples = list(ctx.reader.samples.get(c.code, ()))
        backlog = line_chart(f"{c.code}: backlog", [Series("queued", "queued", [s.queued for s in samples]),
                                                    Series("running", "running", [s.running for s in samples]),
                                                    Series("failed", "failed", [s.failed for s in samples])],
                             fmt=count, times=[s.at for s in samples])  # fmt: skip
        lag = line_chart(f"{c.code}: lag of the oldest due task", [Series("lag", "lag", [s.lag for s in samples])],
                         times=[s.at for s in samples])  # fmt: skip
        charts.append(f'<div class="charts three">{_throughput_chart(code, flow)}{backlog}{lag}</div>')
    table = _table(("code", "queued", "due now", "running", "failed", "oldest due waiting"), rows)
    span = ""
    if any(ctx.reader.samples.values()):
        first = min(s[0].at for s in ctx.reader.samples.values() if s)
        span = f"backlog and lag sampled by this dashboard at each refresh since {_when(first)} UTC"
    shown = ctx.query.get("internal")
    internal = (f' · <a href="{ctx.link("tasks", internal=None if shown else "1")}">{"hide" if shown else "show"} '
                f'mutexcron\'s own codes ({len(hidden)})</a>' if hidden else "")  # fmt: skip
    return f'{table}<p class="muted">{escape(span)}{_throughput_note(flow)}{internal}</p>{"".join(charts)}'


def _throughput_chart(code: str, flow: Throughput | None) -> str:
    """Tasks of ``code`` finished and cancelled per minute, two series on one grid, the current minute last."""
    if flow is None or flow.note is not None:
        return ""
    finished = flow.per_minute.get(code, [0] * THROUGHPUT_MINUTES)
    cancelled = flow.cancelled.get(code, [0] * THROUGHPUT_MINUTES)
    minutes = [flow.start + timedelta(minutes=i) for i in range(len(finished))]
    series = [Series("finished/min", "finished", finished), Series("cancelled/min", "cancelled", cancelled)]
    note = f"last {THROUGHPUT_MINUTES} min: {sum(finished)} finished, {sum(cancelled)} cancelled"
    return line_chart(f"{code}: finished and cancelled per minute", series, note, count, minutes)


def _throughput_note(flow: Throughput | None) -> str:
    if flow is None:
        return ""
    if flow.note is not None:
        return escape(f" · no throughput chart: {flow.note}")
    if flow.every_end:
        text = " · finished and cancelled per minute: every end, as the store counts them (kept 2 h)"
    else:
        text = (" · finished and cancelled per minute: each (code, key) once, at its latest end, as the store keeps it"
                " (a key run again since is not counted)")  # fmt: skip
    if flow.complete_from is not None:
        text += f"; more ended than were read: counted from {_when(flow.complete_from)} UTC"
    return escape(text)


def selection_filter(query: Mapping[str, str]) -> dict[str, str | None]:
    state = query.get("state", "failed")
    return {
        "code": query.get("code") or None,
        "state": state if state in STATES else None,
        "key_contains": query.get("key") or None,
    }


def _group_triggers(summaries: dict[str, CodeSummary]) -> tuple[dict[str, CodeSummary], dict[str, list[str]]]:
    """The trigger requests' codes (one per bucket of job ids) counted as one ``mutexcron.trigger``
    row, and the codes in it."""
    codes = sorted(code for code in summaries if is_trigger_code(code))
    if not codes:
        return summaries, {}
    parts = [summaries[code] for code in codes]
    overdue = [c.oldest_overdue for c in parts if c.oldest_overdue is not None]
    group = CodeSummary(TRIGGER_CODE, queued=sum(c.queued for c in parts), due_now=sum(c.due_now for c in parts),
                        running=sum(c.running for c in parts), failed=sum(c.failed for c in parts),
                        oldest_overdue=max(overdue, default=None))  # fmt: skip
    rest = {code: c for code, c in summaries.items() if code not in codes}
    return {**rest, TRIGGER_CODE: group}, {TRIGGER_CODE: codes}


def _selection(ctx: Context) -> str:
    chosen = selection_filter(ctx.query)
    try:
        found = ctx.reader.tasks(chosen["code"], chosen["state"], chosen["key_contains"], TASK_ROWS + 1)
    except Exception as exc:  # noqa: BLE001 - a store error is shown where the list would be
        return f'<p class="alarm error">tasks: {_t(exc)}</p>'
    total = len(found) if len(found) <= TASK_ROWS else _summary_count(ctx, chosen)
    shown = found[:TASK_ROWS]
    what = f"{total if total is not None else f'more than {TASK_ROWS}'} task{'s' if total != 1 else ''} match"
    bulk = ""
    if total and ctx.actions:
        args = {"selection": chosen, "expected": total}
        bulk = (_button(ctx, f"Retry {total}", "bulk", {**args, "action": "retry"}, f"Retry {total} tasks ({what})?")
                + _button(ctx, f"Cancel {total}", "bulk", {**args, "action": "cancel"},
                          f"Cancel {total} tasks ({what})? They are dropped.", "warn"))  # fmt: skip
    rows = [
        (f'<a href="{ctx.link("task", code=t.code, key=t.key)}">{_t(t.code)}/{_t(t.key)}</a>', _t(t.state), escape(_when(t.due)),
         str(t.attempt), _t(t.owner), _t(_clip(t.last_error, 80) if t.last_error else None), _task_buttons(ctx, t))
        for t in shown
    ]  # fmt: skip
    table = _table(("task", "state", "due (UTC)", "attempts", "owner", "last error", ""), rows, "tasks") if rows else ""
    more = (
        f'<p class="muted">The first {TASK_ROWS} are listed; the bulk action takes them all.</p>'
        if len(found) > TASK_ROWS
        else ""
    )
    return f'<div class="selection-head"><b>{escape(what)}</b> {bulk}</div>{table}{more}'


def _summary_count(ctx: Context, chosen: Mapping[str, str | None]) -> int | None:
    """The count of a long selection from the summary (no key filter), else None (not counted)."""
    if chosen["key_contains"] or ctx.snap.tasks is None:
        return None
    codes = [c for c in ctx.snap.tasks if chosen["code"] in (None, c.code)]
    states = [chosen["state"]] if chosen["state"] else ["queued", "running", "failed"]
    return sum(int(getattr(c, s)) for c in codes for s in states if s is not None)


def _task_buttons(ctx: Context, task: TaskRecord) -> str:
    name = f"{task.code}/{task.key}"
    retry = (
        _button(ctx, "Retry", "retry", {"code": task.code, "key": task.key}, f"Retry {name} now?")
        if task.state == "failed"
        else ""
    )
    return retry + _button(
        ctx, "Cancel", "cancel", {"code": task.code, "key": task.key}, f"Cancel {name}? It is dropped.", "warn"
    )


def task(ctx: Context) -> dict[str, str]:
    code, key = ctx.query.get("code", ""), ctx.query.get("key", "")
    found = ctx.reader.task(code, key) if code and key else None
    if found is None:
        return {"task": f'<p class="muted">No task {_t(code)}/{_t(key)} (finished tasks leave the store).</p>'}
    fields = record_json(found)
    payload = json.dumps(fields.pop("payload"), indent=2, ensure_ascii=False, sort_keys=True)
    items = "".join(f"<dt>{escape(k)}</dt><dd>{_t(v)}</dd>" for k, v in fields.items() if k != "last_error")
    error = f"<h3>last error</h3>{_error_cell(found.last_error, None)}" if found.last_error else ""
    return {"task": f'<div class="actions">{_task_buttons(ctx, found)}</div><h3>attempts</h3>{_attempts(ctx, found)}'
                    f'{error}<h3>payload</h3><pre class="payload">{escape(payload)}</pre>'
                    f'<h3>fields</h3><dl class="fields">{items}</dl>'}  # fmt: skip


def _attempts(ctx: Context, found: TaskRecord) -> str:
    """The task's attempts: the failed ones the event feed kept (with their tracebacks), then the current one."""
    kinds = ("task_attempt_failed", "task_failed")
    failed = [e for e in ctx.reader.events(kinds, found.code) if e.fields.get("key") == found.key]
    rows = []
    for event in reversed(failed):  # oldest first
        took = event.fields.get("duration")
        start = event.at - timedelta(seconds=float(took)) if event.at is not None and took is not None else None
        rows.append((str(event.fields.get("attempt", "?")), _t(event.node), escape(_when(start)), escape(_when(event.at)),
                     _badge("failed" if event.kind == "task_failed" else "failed, retried", "err"),
                     _error_cell(str(event.fields.get("error") or ""), event.detail)))  # fmt: skip
    if found.state in ("queued", "running") or not rows:
        state = {"running": "running", "queued": "waiting" if found.attempt else "not run yet"}.get(found.state, found.state)
        rows.append((str(found.attempt + (found.state == "queued")), _t(found.owner), "-", "-", _badge(state, "muted"), "-"))
    table = _table(("attempt", "node", "started (UTC)", "ended (UTC)", "outcome", "error"), rows, "attempts")
    note = "" if ctx.snap.feed is not None else '<p class="muted">No event feed here: only the last error is kept.</p>'
    return table + note


# -- Shared jobs ----------------------------------------------------------------------------------
def shared(ctx: Context) -> dict[str, str]:
    return {"shared": _shared_jobs(ctx)}


def _shared_jobs(ctx: Context) -> str:
    jobs = ctx.jobs
    if jobs is None:
        return ('<p class="muted">The shared job stores are named by the jobs file: start the dashboard with '
                "--jobs jobs.py.</p>")  # fmt: skip
    if not jobs.shared:
        return (f'<p class="muted">{_t(jobs.spec)} has no shared job store (a SQLAlchemyJobStore, RedisJobStore or '
                "MongoDBJobStore in its MutexScheduler(jobstores=...)).</p>")  # fmt: skip
    try:
        rows = jobs.shared_jobs()
    except Exception as exc:  # noqa: BLE001 - shown (its type only: a driver's text may hold the job store's URL)
        log.warning("cannot read the shared job stores of %s: %s", jobs.spec, type(exc).__name__)
        where = ", ".join(store.where for store in jobs.shared.values())
        return f'<p class="alarm error">cannot read {_t(where)}: {_t(type(exc).__name__)} (see the dashboard\'s log)</p>'
    if not rows:
        return '<p class="muted">No job in the shared job stores.</p>'
    return _table(("job", "store", "state", "schedule", "next run (UTC)", "lock", "holder", "last run", ""),
                  [_shared_row(ctx, row) for row in rows], "shared")  # fmt: skip


def _shared_row(ctx: Context, row: Mapping[str, Any]) -> tuple[str, ...]:
    job, lock = str(row["job"]), row.get("lock")
    if "error" in row:
        return (_t(job), _t(row["store"]), _badge("unreadable", "err"), _t(row["error"]), "-", "-", "-", "-", "")
    record = ctx.snap.lock(lock) if lock else None
    holder = record.holder if record is not None and record.state == "active" else None
    last = next(iter(ctx.snap.runs(lock, job)), None) if lock else None
    paused = row.get("next_run") is None
    what = f"job {job}"
    buttons = (
        (_button(ctx, "Resume", "job_resume", {"job": job}, f"Resume {what} on every node (next fire time from now)?")
         if paused else
         _button(ctx, "Pause", "job_pause", {"job": job}, f"Pause {what} on every node?", "warn"))
        + _button(ctx, "Run now", "trigger", {"job": job, "lock": lock}, f"Run {what} once now on its holder?")
        + _button(ctx, "Reschedule", "job_reschedule", {"job": job},
                  prompt=f"New schedule of {what} on every node: a crontab line (0 6 * * mon) or every N seconds (every 300)")
        + _button(ctx, "Remove", "job_remove", {"job": job}, f"Remove {what} from its store? Every node lets go of it.",
                  "warn")
    )  # fmt: skip
    next_run = row.get("next_run")
    details = (f'<details class="job-details"><summary>{_t(row.get("trigger"))}</summary><dl class="fields">'
               f'<dt>function</dt><dd>{_t(row.get("func"))}</dd><dt>args</dt><dd>{_t(row.get("args"))}</dd>'
               f'<dt>kwargs</dt><dd>{_t(row.get("kwargs"))}</dd><dt>lease</dt><dd>{_t(row.get("lease"))}</dd>'
               "</dl></details>")  # fmt: skip
    return (
        f'<a href="{ctx.link("history", lock=lock, job=job)}">{_t(job)}</a>',
        _t(row["store"]),
        _badge("paused", "warn") if paused else _badge("scheduled", "ok"),
        details,
        escape(_when(next_run)) + (f' <span class="muted">{_ago(ctx.snap, next_run)}</span>' if next_run else ""),
        _t(lock),
        _t(holder),
        (f"{_outcome(last)} {_ago(ctx.snap, last.ended)}" if last else _t(_when(record.last_run_finished) if record else None)),
        f'<span class="actions">{buttons}</span><span class="outcome" data-job="{escape(job, quote=True)}"></span>',
    )


PAGES: dict[str, PageDef] = {
    page.path: page
    for page in (
        PageDef("", "Overview", True, overview),
        PageDef("locks", "Locks and jobs", True, locks),
        PageDef("shared", "Shared jobs", True, shared, histories=True),
        PageDef("tasks", "Tasks", True, tasks),
        PageDef("history", "History", True, history, histories=True),
        PageDef("task", "Task", False, task),
        PageDef("lock", "Lock", False, lock),
    )
}

_SECTION_TITLES = {"counts": "", "alarms": "Alarms", "nodes": "Nodes", "events": "Events",
                   "audit": "Recent actions (this dashboard)", "locks": "",
                   "codes": "Tasks by code", "selection": "Selection", "runs": "", "task": "", "shared": "",
                   "lock": ""}  # fmt: skip


_DOCUMENT = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · mutexcron</title>
<meta name="mc-base" content="{base}"><meta name="mc-page" content="{page}">
<meta name="mc-refresh" content="{refresh}"><meta name="mc-csrf" content="{csrf}"><meta name="mc-actions" content="{actions}">
<link rel="stylesheet" href="{base}/static/dashboard.css"><script src="{base}/static/dashboard.js" defer></script>
</head><body>
<header><span class="brand">mutexcron</span><nav>{nav}</nav><span class="store">{store}</span>{token_box}</header>
<main><div class="title-row"><h1>{heading}</h1><span id="stamp" class="muted">updated {now} UTC · every {refresh}s</span></div>
<div id="flash" role="status"></div>
{filters}{body}</main>
<footer>mutexcron {version} dashboard</footer>
</body></html>"""

_ACTIONS_FORM = (
    '<form id="token" class="token" autocomplete="off">'
    '<input id="token-name" placeholder="your name" aria-label="your name" maxlength="64">'
    '<input id="token-value" type="password" placeholder="action token" aria-label="action token">'
    '<button type="submit">Use for actions</button>'
    '<span id="token-state"></span></form>'
)


def _section(name: str, html: str, above: str = "") -> str:
    title = _SECTION_TITLES.get(name, "")
    heading = f"<h2>{escape(title)}</h2>" if title else ""
    return f'<section>{heading}{above}<div id="s-{escape(name)}" class="live">{html}</div></section>'


def render_page(ctx: Context, page: PageDef, csrf: str, refresh: float) -> str:
    """The whole page: navigation, the sections, and the refresh script's settings in meta tags."""
    nav = "".join(
        f'<a class="{"active" if p.path == page.path else ""}" href="{ctx.link(p.path)}">{escape(p.title)}</a>'
        for p in PAGES.values()
        if p.nav
    )
    return _DOCUMENT.format(
        title=escape(page.title),
        base=escape(ctx.base, quote=True),
        page=escape(page.path or "overview", quote=True),
        refresh=f"{refresh:g}",
        csrf=escape(csrf, quote=True),
        actions="1" if ctx.actions else "0",
        nav=nav,
        store=_t(ctx.snap.store),
        token_box=_ACTIONS_FORM if ctx.actions else '<span class="readonly">read-only</span>',
        heading=_heading(ctx, page),
        now=escape(_when(ctx.snap.now)),
        filters=_filters(ctx) if page.path == "tasks" else "",
        body="".join(_section(name, html, _above(ctx, page, name)) for name, html in page.sections(ctx).items()),
        version=escape(__version__),
    )


def _above(ctx: Context, page: PageDef, section: str) -> str:
    """A section's filters, outside the part that refreshes (a choice being made stays put)."""
    if section == "events":
        return _event_filters(ctx)
    if section == "locks" and page.path == "locks":
        return _locks_filters(ctx)
    if section == "runs" and not ctx.query.get("lock"):
        return _runs_filters(ctx)
    return ""


def _heading(ctx: Context, page: PageDef) -> str:
    if page.path == "history" and not ctx.query.get("lock"):
        return "Recent runs"
    if page.path == "history" and ctx.query.get("lock"):
        job = ctx.query.get("job")
        return escape(f"History of {job} (lock {ctx.query['lock']})" if job else f"History of lock {ctx.query['lock']}")
    if page.path == "lock":
        return escape(f"Lock {ctx.query.get('name', '')}")
    if page.path == "task":
        return escape(f"Task {ctx.query.get('code', '')}/{ctx.query.get('key', '')}")
    return escape(page.title)


def _filters(ctx: Context) -> str:
    chosen = selection_filter(ctx.query)
    key = escape(chosen["key_contains"] or "", quote=True)
    listed = {c.code for c in ctx.snap.tasks or ()}
    listed = {c for c in listed if c == TRIGGER_CODE or not is_trigger_code(c)}  # up to 256: the key filter finds a request
    codes = sorted(listed | ({chosen["code"]} if chosen["code"] else set()))
    code_options = '<option value="">every code</option>' + "".join(
        f"<option{' selected' if c == chosen['code'] else ''}>{_t(c)}</option>" for c in codes
    )
    state_options = f'<option value="any"{" selected" if chosen["state"] is None else ""}>every state</option>' + "".join(
        f"<option{' selected' if s == chosen['state'] else ''}>{escape(s)}</option>" for s in STATES
    )
    return (f'<form class="filters" method="get" action="{ctx.link("tasks")}"><label>code <select name="code">{code_options}'
            f'</select></label><label>state <select name="state">{state_options}</select></label><label>key contains '
            f'<input name="key" value="{key}"></label><button type="submit">Filter</button></form>')  # fmt: skip
