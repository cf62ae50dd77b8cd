"""Counters, histograms and gauges kept in plain Python, exported to Prometheus at scrape time.

The scheduler's hot path (a holder's run, each store call) updates them; prometheus_client only
reads them when ``/metrics`` is scraped (:class:`Instruments` is a collector). An update only
appends to a queue (``deque.append``: atomic, no lock taken); the queue is folded into the counts
when scraped, or by the update that finds it :data:`FOLD_AT` long (so it stays bounded when
nobody scrapes). That is about a fiftieth of what a prometheus_client ``labels(...).inc()`` or
``observe()`` costs, which measurably added to every run (docs/benchmarks.md#operations).

Families are exported in the text format prometheus_client would give the same metrics: a
counter ``name`` as ``name_total``, a histogram as ``name_bucket{le=...}``, ``name_count`` and
``name_sum`` with cumulative buckets. A family without labels is exported from the start (at 0);
a labelled one from its first update.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["Counter", "Gauge", "Histogram", "Instruments"]

Labels = tuple[str, ...]

#: Updates queued before the update that finds this many folds them in (scraping folds them too).
FOLD_AT = 1024


class _Family:
    """One metric's name, help text and label names; its values by label values."""

    def __init__(self, instruments: Instruments, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.name, self.documentation, self.label_names = name, documentation, list(labels)
        self._lock = instruments.lock
        instruments.families.append(self)

    def export(self) -> Metric:  # pragma: no cover - every family overrides it
        raise NotImplementedError

    def forget(self, label: str, value: str) -> None:
        """Drop every series whose ``label`` is ``value`` (a removed job or lock)."""
        if label not in self.label_names:
            return
        index = self.label_names.index(label)
        self._fold_all()
        with self._lock:
            series: dict[Labels, Any] = self._series()
            for labels in [labels for labels in series if labels[index] == value]:
                del series[labels]

    def _fold_all(self) -> None:
        """Count in every queued update (before a forget, so none lands after it)."""

    def _series(self) -> dict[Labels, Any]:  # pragma: no cover - every family overrides it
        raise NotImplementedError


class Counter(_Family):
    """A count that only goes up, by label values; ``counted_elsewhere`` adds counts kept by the
    code that counts them (read at export)."""

    def __init__(self, instruments: Instruments, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        super().__init__(instruments, name, documentation, labels)
        self._values: dict[Labels, float] = {} if labels else {(): 0.0}
        self._queued: deque[tuple[Labels, float]] = deque()
        self.counted_elsewhere: Callable[[], Mapping[Labels, float]] | None = None

    def _series(self) -> dict[Labels, Any]:
        return self._values

    def _fold_all(self) -> None:
        self._fold()

    def inc(self, labels: Labels = (), amount: float = 1.0) -> None:
        queued = self._queued
        queued.append((labels, amount))
        if len(queued) >= FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        """Add the queued increments to the counts (popleft: an append made meanwhile is never lost)."""
        queued, values = self._queued, self._values
        with self._lock:
            for _ in range(len(queued)):
                labels, amount = queued.popleft()
                values[labels] = values.get(labels, 0.0) + amount

    def export(self) -> Metric:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(self.name, self.documentation, labels=self.label_names)
        self._fold()
        with self._lock:
            values = dict(self._values)
        if self.counted_elsewhere is not None:
            for labels, count in self.counted_elsewhere().items():
                values[labels] = values.get(labels, 0.0) + count
        for labels, value in sorted(values.items()):
            family.add_metric(list(labels), value)
        return family


class Gauge(_Family):
    """A value that is set, by label values."""

    def __init__(self, instruments: Instruments, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        super().__init__(instruments, name, documentation, labels)
        self._values: dict[Labels, float] = {}

    def _series(self) -> dict[Labels, Any]:
        return self._values

    def set(self, labels: Labels, value: float) -> None:
        self._values[labels] = value  # one dict store: atomic, no lock needed

    def export(self) -> Metric:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(self.name, self.documentation, labels=self.label_names)
        with self._lock:
            values = list(self._values.items())
        for labels, value in sorted(values):
            family.add_metric(list(labels), value)
        return family


class _Cells:
    """One label set's histogram: a count per bucket (the last one: above every bound) and the sum."""

    __slots__ = ("bounds", "counts", "lock", "queued", "total")

    def __init__(self, bounds: tuple[float, ...], lock: threading.Lock) -> None:
        self.bounds, self.lock = bounds, lock
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.queued: deque[float] = deque()

    def observe(self, value: float) -> None:
        queued = self.queued
        queued.append(value)
        if len(queued) >= FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Count the queued observations into their buckets (popleft: an append made meanwhile is never lost)."""
        queued, bounds, counts = self.queued, self.bounds, self.counts
        with self.lock:
            for _ in range(len(queued)):
                value = queued.popleft()
                counts[bisect_left(bounds, value)] += 1
                self.total += value


class Histogram(_Family):
    """Observations counted into buckets (upper bounds, inclusive, as Prometheus's ``le``)."""

    def __init__(
        self, instruments: Instruments, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        super().__init__(instruments, name, documentation, labels)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self._cells: dict[Labels, _Cells] = {}
        if not labels:
            self.child(())

    def child(self, labels: Labels) -> _Cells:
        """The histogram of one label set (its ``observe`` skips the lookup by labels: for hot paths)."""
        cells = self._cells.get(labels)
        if cells is None:
            with self._lock:
                cells = self._cells.setdefault(labels, _Cells(self.bounds, self._lock))
        return cells

    def observe(self, labels: Labels, value: float) -> None:
        self.child(labels).observe(value)

    def _series(self) -> dict[Labels, Any]:
        return self._cells

    def export(self) -> Metric:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        family = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        for cells in list(self._cells.values()):
            cells.fold()
        with self._lock:
            values = [(labels, list(cells.counts), cells.total) for labels, cells in self._cells.items()]
        bounds = [*map(floatToGoString, self.bounds), "+Inf"]
        for labels, counts, total in sorted(values):
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            family.add_metric(list(labels), buckets, sum_value=total)
        return family


class Instruments:
    """The families of one scheduler, one lock for all their updates, and a prometheus_client
    collector (``registry.register(instruments)``) that exports them when scraped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.families: list[_Family] = []
        #: Called before each export: code that queues updates of its own folds them in here.
        self.before_export: list[Callable[[], None]] = []

    def describe(self) -> list[Metric]:
        return []  # no names checked at registration; collect() is not called then

    def collect(self) -> Iterator[Metric]:
        for fold in self.before_export:
            fold()
        for family in self.families:
            yield family.export()
