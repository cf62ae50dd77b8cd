"""The dashboard's reads of the store: what ``mutexcron status`` reads, and never a write.

One :class:`StoreReader` per dashboard keeps its lock and task stores open (a pooled connection,
not a new one per refresh) and makes them read-only: a SQL table is looked for, never created or
altered (:attr:`mutexcron.backends.sql.SQLBackend.read_only`), node presences are read without
pruning the old ones (``nodes(prune=False)``), and a SQLite file that does not exist is not
created by connecting to it. A refresh is four reads (locks, nodes, task summary, the newest
events of the event feed, :mod:`mutexcron.observability.feed`), shared by every open page for
:attr:`StoreReader.min_interval` seconds, so ten open tabs cost the store what one does. The kept
run histories of every lock (one read, but its cost grows with locks x jobs x kept runs) are read
only for the pages that show them (History, Shared jobs), and then shared the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TypeVar

from ..backends import family_of
from ..backends.base import reading_only
from ..errors import MutexcronError, SchemaMissingError
from ..heartbeat import PRESENCE_EVERY
from ..locks import LockStore, lock_store_from_url
from ..locks.record import LockRecord, NodePresence, RunRecord
from ..observability.feed import FeedEvent, FeedStore, feed_store_for
from ..tasks import CodeSummary, TaskRecord, TaskStore, task_store_from_url
from ..urls import mask_url

__all__ = ["LIVE_WITHIN", "Snapshot", "StoreReader", "TaskSample", "Throughput"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: A node whose last presence is older than this (store clock) is shown stale: a node publishes
#: its presence with every renewal, and at least every PRESENCE_EVERY seconds when it holds nothing.
LIVE_WITHIN = 3 * PRESENCE_EVERY
#: Samples of the task summary kept per code for the backlog chart (one per refresh at most).
TASK_SAMPLES = 240
#: The throughput chart: tasks finished per minute over this many minutes (the store's clock).
THROUGHPUT_MINUTES = 60
#: Seconds one read of the finish times serves every Tasks page (the read scans the finished tasks).
THROUGHPUT_EVERY = 30.0
#: Finish times read at most (the newest first): beyond, the chart starts at the oldest one read.
THROUGHPUT_ROWS = 50_000
#: Events of the feed read per refresh (the newest).
FEED_ROWS = 200


@dataclass(frozen=True)
class TaskSample:
    """One code's backlog as a refresh read it (the store keeps no finished tasks to count)."""

    at: datetime
    queued: int
    running: int
    failed: int
    lag: float  # seconds the oldest due task has waited (0: none waits)


@dataclass(frozen=True)
class Throughput:
    """Tasks finished and cancelled per minute and code, from the ends the store keeps (:mod:`.finished`)."""

    #: The start of the first minute (the store's clock); each list has :data:`THROUGHPUT_MINUTES` counts.
    start: datetime
    #: Occurrences that finished (not cancelled), per code.
    per_minute: dict[str, list[int]]
    #: Occurrences a cancel ended, per code (a code in either dict is in both).
    cancelled: dict[str, list[int]] = field(default_factory=dict)
    #: The store counts every end (Redis, memory), rather than keeping each (code, key)'s latest.
    every_end: bool = False
    #: The read stopped at :data:`THROUGHPUT_ROWS`: the minutes before this one are not complete.
    complete_from: datetime | None = None
    #: Why there is no throughput to show (a store that keeps no finished task, a store error).
    note: str | None = None


@dataclass
class Snapshot:
    """One refresh: every part the pages show, each None when it could not be read (see ``errors``)."""

    store: str
    #: The store's clock at the read, as its records tell it (record time + age), else this host's.
    now: datetime
    now_from_store: bool
    locks: list[LockRecord] | None
    nodes: list[NodePresence] | None
    tasks: list[CodeSummary] | None
    #: The newest events of the feed (None: not kept by this store, or not readable).
    feed: list[FeedEvent] | None = None
    #: part -> the store's error (masked), for the parts that failed.
    errors: dict[str, str] = field(default_factory=dict)
    #: part -> why there is nothing to show (no table yet, a store without the feature).
    notes: dict[str, str] = field(default_factory=dict)
    #: Store calls made for this snapshot and their wall time.
    calls: int = 0
    seconds: float = 0.0
    #: Every lock's kept runs, newest first (read only for the pages that show them: see ``histories_read``).
    histories: dict[str, list[RunRecord]] = field(default_factory=dict)
    histories_read: bool = False

    def lock(self, name: str) -> LockRecord | None:
        return next((r for r in self.locks or () if r.name == name), None)

    def live(self, node: NodePresence) -> bool:
        return self.node_state(node)[0] == "live"

    def node_state(self, node: NodePresence) -> tuple[str, datetime | None]:
        """``live``, ``stopped`` (it said so as it stopped) or ``lost`` (it stopped renewing: its
        presence is older than :data:`LIVE_WITHIN`, a lease it held ran out, or a node took a
        lock over from it), with the time of that: its last presence, its stop."""
        last = node.last_seen
        for event in self.feed or ():
            if event.node == node.node_id and event.kind == "node_stopped" and _not_before(event.at, last):
                return "stopped", event.at
            taken = event.kind == "lock_taken_over" and event.fields.get("previous_holder") == node.node_id
            if taken and _not_before(event.at, last):
                return "lost", last
        if node.age is None or node.age > LIVE_WITHIN:
            return "lost", last
        if any(r.holder == node.node_id and r.state == "stale" for r in self.locks or ()):
            return "lost", last
        return "live", last

    def runs(self, lock: str, job: str | None = None) -> list[RunRecord]:
        return [r for r in self.histories.get(lock, []) if job is None or r.job == job]


class StoreReader:
    """Read-only views of the lock and task stores of one URL.

    Args:
        url: the store URL (``?history=`` and every other option as the nodes use it).
        min_interval: seconds a snapshot is shared by every page before the store is read again.
    """

    def __init__(self, url: str, *, min_interval: float = 1.0) -> None:
        self.url = url
        self.masked_url = mask_url(url)
        self.min_interval = min_interval
        self.has_tasks = family_of(url).task_store is not None
        self._locks: LockStore | None = None
        self._tasks: TaskStore | None = None
        self._build = threading.Lock()
        self._read = threading.Lock()
        self._last: tuple[float, Snapshot] | None = None
        self.samples: dict[str, deque[TaskSample]] = {}
        self._flow_lock = threading.Lock()
        self._flow: tuple[float, Throughput | None] | None = None
        self._feed: FeedStore | None = None

    # -- the stores -------------------------------------------------------------------------
    def lock_store(self) -> LockStore:
        with self._build:
            if self._locks is None:
                self._locks = reading_only(lock_store_from_url(self.url))
            return self._locks

    def task_store(self) -> TaskStore:
        # The lock store's URL has no ?history=, which the task store would hand to its driver.
        url = self.lock_store().url
        with self._build:
            if self._tasks is None:
                self._tasks = reading_only(task_store_from_url(url))
            return self._tasks

    def feed_store(self) -> FeedStore | None:
        """The event feed beside the lock store (read-only, like it), or None for a store without one."""
        store = self.lock_store()
        with self._build:
            if self._feed is None:
                self._feed = feed_store_for(store)
            return self._feed

    def close(self) -> None:
        with self._build:
            self._feed = None
            for store in (self._locks, self._tasks):
                if store is not None:
                    store.close()
            self._locks = self._tasks = None

    # -- one refresh ------------------------------------------------------------------------
    def snapshot(self, *, histories: bool = False) -> Snapshot:
        """The latest snapshot, read again once it is :attr:`min_interval` seconds old; with
        ``histories``, with every lock's kept runs (read once per snapshot, for the pages that need them)."""
        with self._read:
            if self._last is None or time.monotonic() - self._last[0] >= self.min_interval:
                snap = self._snapshot()
                self._last = (time.monotonic(), snap)
                self._sample(snap)
            snap = self._last[1]
            if histories and not snap.histories_read:
                self._read_histories(snap)
            return snap

    def _read_histories(self, snap: Snapshot) -> None:
        names = [r.name for r in snap.locks or ()]
        snap.histories_read = True
        if not names:
            return
        started = time.perf_counter()
        with _caught("history", snap.errors, snap.notes):
            snap.histories = self.lock_store().history_many(names)
        snap.calls += 1
        snap.seconds += time.perf_counter() - started

    def invalidate(self) -> None:
        """The next snapshot is read from the store (after an action: show its effect at once)."""
        with self._read:
            self._last = None
        with self._flow_lock:
            self._flow = None

    def _snapshot(self) -> Snapshot:
        started = time.perf_counter()
        errors: dict[str, str] = {}
        notes: dict[str, str] = {}
        calls = 0

        def part(name: str, call: Callable[[], _T]) -> _T | None:
            nonlocal calls
            calls += 1
            with _caught(name, errors, notes):
                return call()
            return None

        missing = self._missing_file()
        if missing is not None:
            notes["locks"] = missing
            locks, nodes, tasks, events = None, None, None, None
        else:
            locks = part("locks", lambda: self.lock_store().list())
            nodes = part("nodes", lambda: self.lock_store().nodes(prune=False)) if "locks" not in errors else None
            tasks = part("tasks", lambda: self.task_store().summary()) if self.has_tasks else None
            if not self.has_tasks:
                notes["tasks"] = "this store has no task pool"
            feed = self.feed_store()
            events = part("feed", lambda: feed.recent(FEED_ROWS)) if feed is not None else None
            if feed is None:
                notes["feed"] = "this store keeps no event feed"
        now, from_store = _store_now(locks, nodes)
        if events and from_store and self._feed is not None and self._feed.ages_on_host:
            shift = now - datetime.now(timezone.utc)  # the events' ages, on the store's clock as the records
            events = [dataclasses.replace(e, at=e.at + shift) if e.at is not None else e for e in events]
        return Snapshot(self.masked_url, now, from_store, locks, nodes, tasks, events, errors, notes, calls,
                        time.perf_counter() - started)  # fmt: skip

    def _missing_file(self) -> str | None:
        """For a SQLite URL whose file does not exist: a note (connecting would create it)."""
        from ..backends.sql import SQLBackend

        backend = getattr(self.lock_store(), "backend", None)
        missing = backend.missing_file() if isinstance(backend, SQLBackend) else None
        return None if missing is None else f"{missing}: no node has used this store yet"

    def _sample(self, snap: Snapshot) -> None:
        if snap.tasks is None:
            return
        seen = set()
        for summary in snap.tasks:
            seen.add(summary.code)
            samples = self.samples.setdefault(summary.code, deque(maxlen=TASK_SAMPLES))
            samples.append(TaskSample(snap.now, summary.queued, summary.running, summary.failed, summary.oldest_overdue or 0.0))
        for code, samples in self.samples.items():  # a code with no task left: its backlog is zero, not unknown
            if code not in seen:
                samples.append(TaskSample(snap.now, 0, 0, 0, 0.0))

    # -- reads for one page -----------------------------------------------------------------
    def events(self, kinds: tuple[str, ...], subject: str | None, limit: int = FEED_ROWS) -> list[FeedEvent]:
        """The newest events of ``kinds`` about ``subject`` (a lock, a task code): a job's or a task's page."""
        feed = self.feed_store() if not self._missing_file() else None
        if feed is None:
            return []
        with _caught_quietly():
            return feed.recent(limit, kinds=kinds, subject=subject)
        return []

    def history(self, lock: str, job: str | None = None) -> list[RunRecord]:
        if self._missing_file():
            return []
        with _caught_quietly():
            return self.lock_store().history(lock, job)
        return []

    def throughput(self, now: datetime) -> Throughput | None:
        """Tasks finished and cancelled per minute over the :data:`THROUGHPUT_MINUTES` before ``now`` (the
        snapshot's store clock), read at most every :data:`THROUGHPUT_EVERY` seconds; None if there
        is no task table to read."""
        if not self.has_tasks or self._missing_file():
            return None
        with self._flow_lock:
            if self._flow is not None and time.monotonic() - self._flow[0] < THROUGHPUT_EVERY:
                return self._flow[1]
            flow = self._read_throughput(now)
            self._flow = (time.monotonic(), flow)
            return flow

    def _read_throughput(self, now: datetime) -> Throughput | None:
        from .finished import finished_since

        end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)  # the current minute is the last bar
        start = end - timedelta(minutes=THROUGHPUT_MINUTES)
        try:
            finished = finished_since(self.task_store(), start, THROUGHPUT_ROWS)
        except SchemaMissingError:
            return None
        except NotImplementedError as exc:
            return Throughput(start, {}, note=str(exc))
        except MutexcronError as exc:  # masked by the store
            return Throughput(start, {}, note=f"finished tasks: {exc}")
        per_minute: dict[str, list[int]] = {}
        cancelled: dict[str, list[int]] = {}
        for ended in finished:
            minute = int((ended.at - start).total_seconds() // 60)
            if 0 <= minute < THROUGHPUT_MINUTES:
                per_minute.setdefault(ended.code, [0] * THROUGHPUT_MINUTES)
                cancelled.setdefault(ended.code, [0] * THROUGHPUT_MINUTES)
                (cancelled if ended.cancelled else per_minute)[ended.code][minute] += ended.occurrences
        capped = finished[-1].at if len(finished) >= THROUGHPUT_ROWS else None
        complete_from = capped.replace(second=0, microsecond=0) + timedelta(minutes=1) if capped else None
        if complete_from is not None:  # the oldest minute read may be partial, and those before it unread
            first = min(THROUGHPUT_MINUTES, max(0, int((complete_from - start).total_seconds() // 60)))
            for counts in (*per_minute.values(), *cancelled.values()):
                counts[:first] = [0] * first
        every_end = not self.task_store().keeps_tombstones
        return Throughput(start, per_minute, cancelled, every_end, complete_from)

    def tasks(self, code: str | None, state: str | None, key_contains: str | None, limit: int) -> list[TaskRecord]:
        if not self.has_tasks or self._missing_file():
            return []
        with _caught_quietly():
            return self.task_store().list(code=code or None, key_contains=key_contains or None, state=state or None, limit=limit)
        return []

    def task(self, code: str, key: str) -> TaskRecord | None:
        if not self.has_tasks or self._missing_file():
            return None
        with _caught_quietly():
            return self.task_store().get(code, key)
        return None


@contextmanager
def _caught(name: str, errors: dict[str, str], notes: dict[str, str]) -> Iterator[None]:
    try:
        yield
    except SchemaMissingError as exc:
        notes[name] = str(exc)
    except NotImplementedError as exc:  # a store that keeps no history or presence
        notes[name] = str(exc)
    except MutexcronError as exc:  # already masked and redacted by the store
        errors[name] = str(exc)


@contextmanager
def _caught_quietly() -> Iterator[None]:
    try:
        yield
    except (SchemaMissingError, NotImplementedError):
        pass


def _not_before(at: datetime | None, last: datetime | None) -> bool:
    """``at`` is the last presence's time or later (1 s of slack: two clocks stamp them)."""
    return at is not None and (last is None or at >= last - timedelta(seconds=1))


def _store_now(locks: list[LockRecord] | None, nodes: list[NodePresence] | None) -> tuple[datetime, bool]:
    """The store's clock at the read, from the records it returned (a write's time + its age by the
    store's clock): no extra call. This host's clock if no record tells it."""
    for record in locks or ():
        if record.update_time is not None and record.heartbeat_age is not None:
            return record.update_time + timedelta(seconds=record.heartbeat_age), True
    for node in nodes or ():
        if node.last_seen is not None and node.age is not None:
            return node.last_seen + timedelta(seconds=node.age), True
    return datetime.now(timezone.utc), False
