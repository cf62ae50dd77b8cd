"""This node's wall-clock offset to the store's clock, estimated from round trips it already makes.

The lock does not need synchronised clocks (staleness is judged by the store's clock), but
APScheduler fires by the node's clock: a node whose clock is 5 s fast fires 5 s early. Every lock
record a store call returns says when the store wrote it (``update_time``) and how long ago that
was by the store's clock (``heartbeat_age``), so ``update_time + heartbeat_age`` is the store's
clock at the read. Against the node's wall clock at the midpoint of the round trip, that is one
sample, uncertain by half the round trip. The estimate is the sample with the shortest round trip
among the recent ones (as NTP does), so a slow reply does not pull it off.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

from ..locks.record import LockRecord

__all__ = ["WARN_ABOVE", "ClockOffset"]

log = logging.getLogger(__name__)

#: Seconds of offset above which the node logs a WARNING (once).
WARN_ABOVE = 1.0


@dataclass(frozen=True)
class _Sample:
    offset: float  # node clock minus store clock, seconds
    rtt: float


class ClockOffset:
    """A running estimate of (this node's wall clock) minus (the store's clock), in seconds.

    Args:
        window: how many recent samples the estimate is chosen from.
        warn_above: the offset (either way) that logs a WARNING, once.
    """

    def __init__(self, window: int = 32, warn_above: float = WARN_ABOVE) -> None:
        self._samples: deque[_Sample] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.warn_above = warn_above
        self._warned = False

    def observe(self, record: LockRecord | None, wall_sent: float, wall_received: float) -> None:
        """Take one sample from a record read between two readings of ``time.time()``."""
        if record is None or record.update_time is None or record.heartbeat_age is None:
            return
        if wall_received < wall_sent:
            return  # the wall clock stepped back during the call: no sample
        store_now = (record.update_time + timedelta(seconds=record.heartbeat_age)).timestamp()
        sample = _Sample((wall_sent + wall_received) / 2 - store_now, wall_received - wall_sent)
        with self._lock:
            self._samples.append(sample)
        # The estimate is one of the samples: it can only pass the threshold with a sample that
        # does (a node whose clock is off gives one with every read), so the usual sample costs no search.
        if not self._warned and abs(sample.offset) > self.warn_above:
            self._check()

    @property
    def value(self) -> float | None:
        """The estimate in seconds (positive: this node's clock is ahead), or None without samples."""
        best = self._best()
        return None if best is None else best.offset

    @property
    def uncertainty(self) -> float | None:
        """Half the round trip of the sample the estimate comes from, in seconds."""
        best = self._best()
        return None if best is None else best.rtt / 2

    def _best(self) -> _Sample | None:
        with self._lock:
            return min(self._samples, key=lambda s: s.rtt, default=None)

    def _check(self) -> None:
        offset = self.value
        if offset is None or self._warned or abs(offset) <= self.warn_above:
            return
        self._warned = True
        log.warning(
            "this node's clock is %+.2fs off the store's clock (±%.3fs): APScheduler fires by the node's clock, so "
            "jobs fire %s on this node; synchronise it with NTP (chrony, systemd-timesyncd). The lock itself judges "
            "leases by the store's clock and stays safe",
            offset,
            self.uncertainty or 0.0,
            "early" if offset > 0 else "late",
        )
