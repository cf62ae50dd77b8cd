"""Prometheus metrics and health endpoints for one scheduler.

``MutexScheduler(metrics_port=9464)`` or ``mutexcron run --metrics-port 9464`` (env
``MUTEXCRON_METRICS_PORT``) serves, on one small HTTP server thread started by ``start()`` and
stopped by ``shutdown()``:

* ``/metrics``: the scheduler's metrics in the Prometheus text format (OpenMetrics if asked);
* ``/healthz``: 200 ``{"status": "ok"}`` while the node can be trusted to run guarded jobs
  (:meth:`~mutexcron.heartbeat.LeaseManager.unhealthy` is None and the task store answers), else
  503 ``{"status": "unhealthy", "reason": ...}``;
* ``/readyz``: 200 once the scheduler has started and until it begins to stop, else 503.

Without a port nothing of this module is imported and nothing is started. It needs
``prometheus_client`` (``pip install "mutexcron[metrics]"``). Each scheduler has a registry of
its own (not prometheus_client's global one). Labels are lock names, job ids and task codes only:
never fire times, task keys or node ids. Every metric is listed in ``docs/operations.md``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import operator
import os
import platform
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from apscheduler.schedulers.base import STATE_STOPPED

from ..errors import ConfigurationError
from ..events import (
    EVENT_LOCK_LOST,
    EVENT_LOCK_TAKEN_OVER,
    EVENT_RUN_MISSED,
    MutexEvent,
)
from ..locks import AcquireResult, BatchClaimResult, LockStore
from ..locks.record import LockRecord
from .capped_server import CappedServer
from .instruments import FOLD_AT, Counter, Gauge, Histogram, Instruments
from .socket_deadlines import SOCKET_DEADLINES

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from ..tasks.base import CodeSummary

__all__ = ["INSTALL_HINT", "MeteredLockStore", "Metrics", "Observability"]

log = logging.getLogger(__name__)

#: How to get prometheus_client.
INSTALL_HINT = 'pip install "mutexcron[metrics]"'
#: This host only: exposing the endpoints to other hosts (Prometheus, Kubernetes probes) is an
#: explicit choice, ``metrics_host="0.0.0.0"`` / ``--metrics-host`` (see docs/operations.md).
DEFAULT_HOST = "127.0.0.1"
PORT_ENV, HOST_ENV = "MUTEXCRON_METRICS_PORT", "MUTEXCRON_METRICS_HOST"
#: Connections served at once; more are closed at once (each holds a thread while it is open).
MAX_CONNECTIONS = 16
#: Seconds a connection may take for its whole request and answer (a per-read timeout lets a
#: client sending a byte every few seconds stay forever).
REQUEST_DEADLINE = 10.0
#: Task counts (a store call) are refreshed at most this often, on the scrape that finds them older.
TASK_COUNTS_MAX_AGE = 15.0

# Buckets in seconds. Runs: a cron job takes from milliseconds to an hour.
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: The lock store's operations, as the ``operation`` label of ``mutexcron_store_operation_seconds``.
STORE_OPERATIONS = (
    "acquire_or_renew", "hand_off", "renew_many", "claim_many", "release", "read", "read_many", "list", "ping",
)  # fmt: skip


def require_prometheus() -> None:
    """Raise :class:`ConfigurationError` naming the extra to install if prometheus_client is missing."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigurationError(f"metrics_port needs prometheus_client: {INSTALL_HINT}") from None


def _port(value: int | str | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigurationError(f"{what}={value!r}: give a TCP port, 0-65535 (0: any free port)")
    return port


# -- the metrics --------------------------------------------------------------------------------
class Metrics:
    """The instruments of one scheduler, in a registry of their own.

    Fed by the rare lease events (:meth:`on_event`, a listener), by the guards (each run's start
    and end as they happen: :meth:`run_started`, :meth:`run_finished`; skipped fire times are
    counted by the guards and read at export) and by the timed store. The counts are kept by
    :mod:`mutexcron.observability.instruments` (an update is queued, folded in at export) and exported by
    prometheus_client only when scraped. A job is labelled ``job_id``, not ``job``: Prometheus
    gives every scraped series the label ``job`` (the scrape job), and would rename a ``job`` of
    ours to ``exported_job``.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector

        self.registry: CollectorRegistry = CollectorRegistry()
        i = self.instruments = Instruments()
        self.runs = Counter(
            i, "mutexcron_runs", "Fire times of guarded jobs on this node, by outcome: success, error, or skipped_<reason>.",
            ["job_id", "lock", "outcome"],
        )  # fmt: skip
        self.run_duration = Histogram(
            i, "mutexcron_run_duration_seconds", "How long guarded runs took on this node.", RUN_BUCKETS, ["job_id", "lock"]
        )
        self.start_lag = Histogram(
            i, "mutexcron_run_start_lag_seconds", "Seconds from a guarded run's fire time to its first line.", LAG_BUCKETS,
            ["job_id", "lock"],
        )  # fmt: skip
        self.last_success = Gauge(
            i, "mutexcron_last_success_timestamp_seconds", "When a run of the job last succeeded on this node (Unix time).",
            ["job_id", "lock"],
        )  # fmt: skip
        self.missed = Counter(
            i, "mutexcron_missed_runs", "Fire times that ran on no node (older than their misfire grace time).",
            ["job_id", "lock"],
        )  # fmt: skip
        self.takeovers = Counter(
            i, "mutexcron_takeovers", "Locks this node took over from a node whose lease ran out.", ["lock"]
        )
        self.leases_lost = Counter(
            i, "mutexcron_leases_lost", "Leases this node lost (taken over, or not renewed within the lease).", ["lock"]
        )
        self.store_seconds = Histogram(
            i, "mutexcron_store_operation_seconds", "Store calls of this node, by store and operation (failed ones included).",
            STORE_BUCKETS, ["store", "operation"],
        )  # fmt: skip
        self.renew_seconds = Histogram(
            i, "mutexcron_lease_renew_seconds", "Heartbeat renewals of this node's leases (one renew_many call each).",
            STORE_BUCKETS,
        )  # fmt: skip
        self.renew_failures = Counter(
            i, "mutexcron_lease_renew_failures", "Heartbeat renewals that failed (the store did not answer)."
        )
        self._run_news: deque[tuple[str, str, str, float, float]] = deque()  # (job, lock, outcome, seconds, Unix time)
        self._folding = threading.Lock()
        i.before_export.append(self._fold_runs)
        self.registry.register(i)
        self.registry.register(_BuildInfo())
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, _resident_memory_bytes, _open_fds...
        self._skip_outcomes: dict[str, str] = {}
        self._on: dict[int, Callable[[MutexEvent], None]] = {
            EVENT_RUN_MISSED: self._missed,
            EVENT_LOCK_TAKEN_OVER: self._taken_over,
            EVENT_LOCK_LOST: self._lost,
        }

    def on_event(self, event: MutexEvent) -> None:
        """The scheduler listener of the lease events counted here (:attr:`event_mask`)."""
        handler = self._on.get(event.code)
        if handler is not None:
            handler(event)

    @property
    def event_mask(self) -> int:
        """The codes :meth:`on_event` counts, as an APScheduler listener mask."""
        return functools.reduce(operator.or_, self._on, 0)

    # Runs: told by the guards as they happen (GuardContext.run_stats), not through listeners, and
    # only queued there (one tuple appended): counted into the families when scraped (_fold_runs).
    def run_finished(self, job_id: str, lock: str, outcome: str, duration: float) -> None:
        news = self._run_news
        news.append((job_id, lock, outcome, duration, time.time()))
        if len(news) >= FOLD_AT:
            self._fold_runs()

    def run_started(self, job_id: str, lock: str, lag: float) -> None:
        news = self._run_news
        news.append((job_id, lock, "", lag, 0.0))  # no outcome yet: a start
        if len(news) >= FOLD_AT:
            self._fold_runs()

    def _fold_runs(self) -> None:
        """Count the queued starts and ends (popleft, one fold at a time: an append made meanwhile is never lost)."""
        news = self._run_news
        with self._folding:
            for _ in range(len(news)):
                job_id, lock, outcome, seconds, when = news.popleft()
                labels = (job_id, lock)
                if not outcome:
                    self.start_lag.observe(labels, max(0.0, seconds))  # a wall clock stepped back: counted as 0
                    continue
                self.runs.inc((job_id, lock, outcome))
                self.run_duration.observe(labels, max(0.0, seconds))
                if outcome == "success":
                    self.last_success.set(labels, when)

    def forget(self, job_id: str, lock: str | None) -> None:
        """Drop the series of a removed job, and of its lock if it was the lock's last job."""
        self._fold_runs()
        for family in self.instruments.families:
            family.forget("job_id", job_id)
            if lock is not None:
                family.forget("lock", lock)

    def count_skips_of(self, scheduler: Any) -> None:
        """Take the skipped fire times from ``scheduler.skipped_runs()`` at export: a standby skips
        every tick, and its guard counts that where it happens (no listener call per tick)."""

        def skips() -> dict[tuple[str, ...], float]:
            counts = scheduler.skipped_runs().items()
            return {(job, lock, self._skip_outcome(reason)): float(n) for (job, lock, reason), n in counts}

        self.runs.counted_elsewhere = skips

    def _skip_outcome(self, reason: str) -> str:
        outcome = self._skip_outcomes.get(reason)
        if outcome is None:  # "not-holder" -> "skipped_not_holder"
            outcome = self._skip_outcomes[reason] = "skipped_" + (reason or "unknown").replace("-", "_")
        return outcome

    def _missed(self, e: MutexEvent) -> None:
        self.missed.inc((e.job_id or "", e.lock or ""))

    def _taken_over(self, e: MutexEvent) -> None:
        self.takeovers.inc((e.lock or "",))

    def _lost(self, e: MutexEvent) -> None:
        self.leases_lost.inc((e.lock or "",))

    def observer(self, operation: str) -> Callable[[float], None]:
        """The ``observe`` of one operation's store timing."""
        return self.store_seconds.child(("lock", operation)).observe


# -- the timed lock store -------------------------------------------------------------------------
class MeteredLockStore(LockStore):
    """The scheduler's lock store, timed into ``mutexcron_store_operation_seconds``.

    Used by the scheduler in place of its store only when metrics are enabled. ``renew_many`` (the
    heartbeat's renewal) also feeds ``mutexcron_lease_renew_seconds`` and, when it raises,
    ``mutexcron_lease_renew_failures_total``. Arguments pass through as given, and everything else
    (the interface's other methods and attributes, a store's own such as ``backend``) is the
    wrapped store's: see the loop after this class.
    """

    def __init__(self, inner: LockStore, metrics: Metrics) -> None:
        super().__init__(inner.url)
        self.inner = inner
        self._observe = {op: metrics.observer(op) for op in STORE_OPERATIONS}
        self._acquire_timing, self._hand_off_timing = self._observe["acquire_or_renew"], self._observe["hand_off"]
        self._renew = metrics.renew_seconds.child(()).observe
        self._renew_failed = functools.partial(metrics.renew_failures.inc, ())

    def __getattr__(self, name: str) -> Any:  # backend, engine, table...: the wrapped store's
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"MeteredLockStore({self.inner!r})"

    @property
    def masked_url(self) -> str:
        return self.inner.masked_url

    def acquire_or_renew(self, *args: Any, **kwargs: Any) -> AcquireResult:
        start = time.perf_counter()
        try:
            return self.inner.acquire_or_renew(*args, **kwargs)
        finally:
            self._acquire_timing(time.perf_counter() - start)

    def hand_off(self, *args: Any, **kwargs: Any) -> bool:
        start = time.perf_counter()
        try:
            return self.inner.hand_off(*args, **kwargs)
        finally:
            self._hand_off_timing(time.perf_counter() - start)

    def hand_off_many(self, *args: Any, **kwargs: Any) -> list[bool]:
        """Timed as ``hand_off``: one observation per store call, however many hand-offs it carries."""
        start = time.perf_counter()
        try:
            return self.inner.hand_off_many(*args, **kwargs)
        finally:
            self._hand_off_timing(time.perf_counter() - start)

    def renew_many(self, *args: Any, **kwargs: Any) -> set[str]:
        start = time.perf_counter()
        try:
            return self.inner.renew_many(*args, **kwargs)
        except BaseException:
            self._renew_failed()
            raise
        finally:
            elapsed = time.perf_counter() - start
            self._observe["renew_many"](elapsed)
            self._renew(elapsed)

    def claim_many(self, *args: Any, **kwargs: Any) -> BatchClaimResult:
        start = time.perf_counter()
        try:
            return self.inner.claim_many(*args, **kwargs)
        finally:
            self._observe["claim_many"](time.perf_counter() - start)

    def release(self, *args: Any, **kwargs: Any) -> bool:
        start = time.perf_counter()
        try:
            return self.inner.release(*args, **kwargs)
        finally:
            self._observe["release"](time.perf_counter() - start)

    def read(self, *args: Any, **kwargs: Any) -> LockRecord | None:
        start = time.perf_counter()
        try:
            return self.inner.read(*args, **kwargs)
        finally:
            self._observe["read"](time.perf_counter() - start)

    def read_many(self, *args: Any, **kwargs: Any) -> dict[str, LockRecord]:
        start = time.perf_counter()
        try:
            return self.inner.read_many(*args, **kwargs)
        finally:
            self._observe["read_many"](time.perf_counter() - start)

    def list(self, *args: Any, **kwargs: Any) -> list[LockRecord]:
        start = time.perf_counter()
        try:
            return self.inner.list(*args, **kwargs)
        finally:
            self._observe["list"](time.perf_counter() - start)

    def ping(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            self.inner.ping(*args, **kwargs)
        finally:
            self._observe["ping"](time.perf_counter() - start)

    def close(self) -> None:
        self.inner.close()


def _forward_method(name: str) -> Callable[..., Any]:
    def forward(self: MeteredLockStore, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


def _forward_attribute(name: str) -> property:
    def get(self: MeteredLockStore) -> Any:
        return getattr(self.inner, name)

    def set_(self: MeteredLockStore, value: Any) -> None:  # LockStore.__init__ may set a default
        setattr(self.inner, name, value)

    return property(get, set_, doc=f"The wrapped store's ``{name}``.")


# The LockStore interface's methods and attributes that the class above does not time (set_paused,
# history, a default such as history_length...), those added to it later included, are the wrapped
# store's: inherited as they are, they would answer for a store with nothing behind it.
for _name, _value in list(vars(LockStore).items()):
    if _name.startswith(("__", "_abc")) or _name in vars(MeteredLockStore):
        continue
    setattr(MeteredLockStore, _name, _forward_method(_name) if callable(_value) else _forward_attribute(_name))


# -- what is read at scrape time ------------------------------------------------------------------
_C = TypeVar("_C")


class _TaskCounts(Generic[_C]):
    """``summary()`` of the node's task codes (or another count), at most every ``max_age`` seconds, one
    store call at a time: a scrape that finds the counts older refreshes them; a concurrent scrape keeps the old ones."""

    def __init__(self, max_age: float = TASK_COUNTS_MAX_AGE) -> None:
        self.max_age = max_age
        self._at = -math.inf
        self._rows: _C | None = None
        self._lock = threading.Lock()

    def get(self, count: Callable[[], _C]) -> _C | None:
        if time.monotonic() - self._at >= self.max_age and self._lock.acquire(blocking=False):
            try:
                self._at = time.monotonic()  # a store that does not answer is asked again only then
                try:
                    self._rows = count()
                except Exception as exc:  # noqa: BLE001 - a failed count must not fail the scrape
                    log.warning("metrics: could not count tasks (%s); mutexcron_tasks left out", exc)
                    self._rows = None
            finally:
                self._lock.release()
        return self._rows


class _BuildInfo:
    """``mutexcron_build_info{version, apscheduler, python} 1``: what a node runs, to spot a mixed cluster."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from importlib.metadata import PackageNotFoundError, version

        from prometheus_client.core import GaugeMetricFamily

        from ..version import __version__

        try:
            apscheduler = version("APScheduler")
        except PackageNotFoundError:  # imported from a source tree
            apscheduler = "unknown"
        family = GaugeMetricFamily(
            "mutexcron_build_info", "Always 1: the versions this node runs, as labels.",
            labels=["version", "apscheduler", "python"],
        )  # fmt: skip
        family.add_metric([__version__, apscheduler, platform.python_version()], 1.0)
        yield family


class _StateCollector:
    """Gauges read when Prometheus scrapes: leases held, store up, clock offset, tasks."""

    def __init__(self, observability: Observability) -> None:
        self.obs = observability
        self.task_counts: _TaskCounts[list[CodeSummary]] = _TaskCounts()
        self.stored: _TaskCounts[dict[str, int]] = _TaskCounts()

    def describe(self) -> list[Metric]:
        return []  # names are checked against nothing; collect() is never called at registration

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from ..tasks.handlers import public_codes

        sched = self.obs.scheduler
        leases = getattr(sched, "_leases", None)
        held = GaugeMetricFamily("mutexcron_lease_held", "1 while this node holds the lock's lease, else 0.", labels=["lock"])
        up = GaugeMetricFamily(
            "mutexcron_store_up", "1 while the store answers this node, 0 while it does not.", labels=["store"]
        )
        share = GaugeMetricFamily(
            "mutexcron_locks_held", "How many of its guarded locks this node holds now (its share).", labels=["node"]
        )
        placed = GaugeMetricFamily(
            "mutexcron_locks_placed", "How many guarded locks placement gives each live node, as this node computes it.",
            labels=["node"],
        )  # fmt: skip
        weight = GaugeMetricFamily(
            "mutexcron_node_weight",
            "Each live node's placement weight (--weight), with its tags (--tag), as this node read them.",
            labels=["node", "tags"],
        )  # fmt: skip
        if leases is not None:
            now_held = leases.held()
            for lock in sorted(leases.locks()):
                held.add_metric([lock], 1.0 if lock in now_held else 0.0)
            share.add_metric([leases.node.node_id], float(len(now_held)))
            for node_id, count in sorted(leases.placement.shares().items()):
                placed.add_metric([node_id], float(count))
            for node_id, traits in sorted(leases.placement.nodes_traits().items()):
                weight.add_metric([node_id, ",".join(traits.tags)], traits.weight)
            if leases.health.up is not None:
                up.add_metric(["lock"], 1.0 if leases.health.up else 0.0)
        runner = getattr(sched, "_tasks", None)
        worker = getattr(runner, "worker", None)
        if worker is not None and worker.health.up is not None:
            up.add_metric(["task"], 1.0 if worker.health.up else 0.0)
        yield held
        yield share
        yield placed
        yield weight
        yield up
        offset = getattr(leases, "clock_offset", None)
        if isinstance(offset, (int, float)):
            yield GaugeMetricFamily(
                "mutexcron_clock_offset_seconds", "This node's wall clock minus the store's, as the node estimates it.",
                value=float(offset),
            )  # fmt: skip
        if worker is None or runner is None:
            return
        tasks = GaugeMetricFamily(
            "mutexcron_tasks", "Tasks of this node's codes in the store, by state.", labels=["code", "state"]
        )
        overdue = GaugeMetricFamily(
            "mutexcron_task_oldest_overdue_seconds", "Seconds since the oldest due task of the code was due.", labels=["code"]
        )
        store, codes = runner.pool.store, public_codes(worker.codes)  # the trigger requests are mutexcron's own
        for row in (self.task_counts.get(lambda: store.summary(codes)) if codes else None) or []:
            for state in ("queued", "running", "failed"):
                tasks.add_metric([row.code, state], float(getattr(row, state)))
            overdue.add_metric([row.code], float(row.oldest_overdue or 0.0))
        yield tasks
        yield overdue
        yield _stored_rows(self.stored.get(store.count_stored))
        yield _lag_histogram(worker)
        handled = CounterMetricFamily(
            "mutexcron_worker_tasks", "What this node's task worker did since it started, by event.", labels=["event"]
        )
        stats = worker.stats
        for field in fields(stats):
            count = getattr(stats, field.name)
            if isinstance(count, (int, float)):
                handled.add_metric([field.name], float(count))
        yield handled


def _stored_rows(counts: dict[str, int] | None) -> Metric:
    """``mutexcron_task_store_rows{kind}``: the task table's rows (documents), and its tombstones."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(
        "mutexcron_task_store_rows", "Rows (documents) of the task table, and the tombstones among them.", labels=["kind"]
    )
    for kind, count in sorted((counts or {}).items()):
        family.add_metric([kind], float(count))
    return family


def _lag_histogram(worker: Any) -> Metric:
    """``mutexcron_task_lag_seconds{code}`` from the worker's own counts (no store call)."""
    from prometheus_client.core import HistogramMetricFamily

    from ..tasks.handlers import INTERNAL_PREFIX
    from ..tasks.worker import LAG_BUCKETS

    family = HistogramMetricFamily(
        "mutexcron_task_lag_seconds", "Seconds from a task's due time to its handler's first line, on this node.",
        labels=["code"],
    )  # fmt: skip
    for code, stats in sorted(worker.lag_snapshot().items()):
        if code.startswith(INTERNAL_PREFIX):
            continue
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, LAG_BUCKETS), "+Inf"], stats.buckets, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        family.add_metric([code], buckets, sum_value=stats.total)
    return family


# -- the endpoints ---------------------------------------------------------------------------------
class _Server(CappedServer, HTTPServer):
    """One thread per connection, at most :data:`MAX_CONNECTIONS` of them, each for at most
    :data:`REQUEST_DEADLINE` seconds: idle or trickling clients can neither pile up threads (the
    scheduler needs them) nor keep theirs."""

    label = "metrics endpoint"
    observability: Observability

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit(MAX_CONNECTIONS, REQUEST_DEADLINE)

    def process_request_thread(self, request: Any, client_address: Any) -> None:  # socketserver's name
        key = SOCKET_DEADLINES.watch(request, time.monotonic() + self.deadline)
        try:
            super().process_request_thread(request, client_address)
        finally:
            SOCKET_DEADLINES.unwatch(key)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10.0  # a client that does not send its request in time is dropped
    server_version = "mutexcron"
    sys_version = ""

    def do_GET(self) -> None:  # http.server's name
        obs = self.server.observability
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path == "/metrics":
            from prometheus_client.exposition import choose_encoder

            encoder, content_type = choose_encoder(self.headers.get("Accept") or "")
            self._reply(200, encoder(obs.metrics.registry), content_type)
        elif path == "/healthz":
            self._json(*obs.health())
        elif path == "/readyz":
            self._json(*obs.ready())
        else:
            self._json(404, {"status": "not found", "paths": ["/metrics", "/healthz", "/readyz"]})

    def _json(self, status: int, body: Mapping[str, Any]) -> None:
        self._reply(status, json.dumps(body).encode() + b"\n", "application/json")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # http.server's signature
        log.debug("metrics endpoint: %s - %s", self.address_string(), format % args)


class Observability:
    """A scheduler's metrics and its ``/metrics``, ``/healthz`` and ``/readyz`` server.

    Args:
        port: the TCP port (0: any free one; :attr:`address` tells which).
        host: the address to bind (default 127.0.0.1: this host only; ``0.0.0.0`` for every
            IPv4 interface, ``::`` for every interface).

    Raises:
        ConfigurationError: prometheus_client is not installed, or the port is not one.
    """

    def __init__(self, port: int, host: str | None = None) -> None:
        require_prometheus()
        checked = _port(port, "metrics_port")
        assert checked is not None
        self.port = checked
        self.host = host or DEFAULT_HOST
        self.metrics = Metrics()
        self.scheduler: Any = None
        self.metrics.registry.register(_StateCollector(self))
        self._listening = False
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    @classmethod
    def configure(cls, port: int | None, host: str | None, current: Observability | None = None) -> Observability | None:
        """Settings given (``port``/``host``, None: not given) over the current ones, then the
        environment (``MUTEXCRON_METRICS_PORT``/``_HOST``); None without a port anywhere."""
        chosen = _port(port, "metrics_port")
        if chosen is None:
            chosen = current.port if current is not None else _port(os.environ.get(PORT_ENV), PORT_ENV)
        if chosen is None:
            return None
        host = host or (current.host if current is not None else None) or os.environ.get(HOST_ENV) or None
        return cls(chosen, host)

    @property
    def address(self) -> tuple[str, int]:
        """Where the endpoints are served (the real port once started with port 0)."""
        server = self._server
        if server is None:
            return self.host, self.port
        return self.host, int(server.server_address[1])

    # -- lifecycle (called by the scheduler) ----------------------------------------------------
    def start(self, scheduler: Any, store: LockStore) -> LockStore:
        """Serve the endpoints for ``scheduler`` (once) and return its store, timed.

        Called by ``start()`` before anything else starts, so a port in use fails the start.

        Raises:
            ConfigurationError: the address cannot be bound.
        """
        with self._mutex:
            self.scheduler = scheduler
            if not self._listening:
                scheduler.add_listener(self.metrics.on_event, self.metrics.event_mask)
                self.metrics.count_skips_of(scheduler)
                self._listening = True
            if self._server is None:
                self._serve()
        return MeteredLockStore(store, self.metrics)

    def _serve(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_class = type("_BoundServer", (_Server,), {"address_family": family})
        try:
            server: _Server = server_class((self.host, self.port), _Handler)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {self.host}:{self.port} ({exc.strerror or exc}): choose another --metrics-port"
            ) from None
        server.observability = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="mutexcron-metrics", daemon=True
        )
        self._thread.start()
        host, port = self.address
        log.info("metrics and health endpoints on http://%s:%d (/metrics, /healthz, /readyz)", host, port)

    def stop(self) -> None:
        """Stop serving (``shutdown()``); a later ``start()`` serves again."""
        with self._mutex:
            server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    # -- the answers ----------------------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, str]]:
        """``/healthz``: (200, ok) while the node can run guarded jobs and tasks, else (503, why)."""
        reason = self._unhealthy()
        if reason is None:
            return 200, {"status": "ok"}
        return 503, {"status": "unhealthy", "reason": reason}

    def _unhealthy(self) -> str | None:
        sched = self.scheduler
        leases = getattr(sched, "_leases", None)
        if leases is None:
            return "the scheduler has not started"
        try:
            reason: str | None = leases.unhealthy()  # store URLs come masked
            worker = getattr(getattr(sched, "_tasks", None), "worker", None)
            if reason is None and worker is not None and worker.health.up is False:
                reason = f"task store {worker.health.masked_url} is unreachable"
        except Exception as exc:  # an answer, not a 500
            log.exception("health check failed")
            reason = f"the health check failed ({type(exc).__name__})"
        return reason

    def ready(self) -> tuple[int, dict[str, str]]:
        """``/readyz``: (200, ok) from ``start()`` until ``shutdown()`` begins, else (503, why)."""
        sched = self.scheduler
        leases = getattr(sched, "_leases", None)
        if leases is None or getattr(sched, "state", STATE_STOPPED) == STATE_STOPPED:
            return 503, {"status": "not ready", "reason": "the scheduler is not running"}
        if leases.stopping:
            return 503, {"status": "not ready", "reason": "the scheduler is stopping"}
        return 200, {"status": "ok"}
