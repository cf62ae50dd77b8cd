"""Fire-time identity: every node must name the same scheduled run with the same instant.

A fire claim is ``(lock, job id, fire time)``. Each node computes fire times from its own copy of
the trigger, so the trigger must produce the same instants on every node:

* **Interval triggers** are anchored at a cluster-wide point: the user's ``start_date``, or else
  the Unix epoch (so ``hours=1`` fires on the hour, ``days=1`` at 00:00 UTC), never at the
  moment a node happened to start.
* **Jitter** is deterministic per (job, fire time), and the claim names the un-jittered slot.
* **DST fall-back**: a cron trigger in a zone with daylight saving time fires once per local
  wall-clock time. The repeated hour's second pass (``fold=1``) is skipped.

:func:`latest_fire_time` is the catch-up walk after a failover: the latest slot in a window,
walked in UTC and bounded by time, not by a count of iterations. :func:`passed_fire_time` is a
shared job's after a hand-over: a fire time its stored next run time was moved past, found on the
job's own sequence of fire times (which an off-slot ``next_run_time`` moves), not on the slots.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from datetime import datetime, timedelta, timezone
from typing import Any

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from ..locks.record import us_from_datetime

log = logging.getLogger(__name__)

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)
_REMEMBERED = 256  # jittered run time -> slot, per job: APScheduler asks about the last few only


def is_repeated_wall_time(when: datetime) -> bool:
    """True for the second pass (``fold=1``) through a wall-clock time repeated at DST fall-back."""
    return when.fold == 1 and when.replace(fold=0).utcoffset() != when.utcoffset()


def _has_dst(trigger: Any) -> bool:
    tz = getattr(trigger, "timezone", None)
    if tz is None:
        return False
    year = datetime.now(timezone.utc).year
    offsets = {datetime(year, month, 1, 12, tzinfo=tz).utcoffset() for month in (1, 4, 7, 10)}
    return len(offsets) > 1


def anchor_interval(trigger: Any, now: datetime | None = None) -> None:
    """Anchor an IntervalTrigger whose ``start_date`` APScheduler defaulted to "now + interval".

    APScheduler sets ``start_date = now + interval`` when none is given, so two nodes started at
    different moments fire at different instants. Such a start date (within a minute of that
    default) is replaced by the Unix epoch, which every node shares.
    """
    if not isinstance(trigger, IntervalTrigger):
        return
    now = now or datetime.now(timezone.utc)
    defaulted_at = trigger.start_date - trigger.interval
    if abs((defaulted_at - now).total_seconds()) < 60:
        trigger.start_date = EPOCH.astimezone(trigger.timezone)


def _jitter_offset(job: str, slot: datetime, jitter: float) -> timedelta:
    """A delay in ``[0, jitter)`` seconds that every node computes alike for (job, slot)."""
    slot_us = us_from_datetime(slot)
    digest = hashlib.blake2b(f"{job}\x00{slot_us}".encode(), digest_size=8).digest()
    fraction = int.from_bytes(digest, "big") / 2.0**64
    return timedelta(microseconds=int(fraction * jitter * 1_000_000))


class SlotTrigger(BaseTrigger):  # type: ignore[misc]
    """A guarded job's trigger: the user's trigger, made to name the same slots on every node.

    ``get_next_fire_time`` returns the slot plus a deterministic jitter; :meth:`slot_of` maps a
    run time back to its slot, which is what the fire claim records.
    """

    def __init__(self, inner: Any, job: str, jitter: float | None) -> None:
        self.inner = inner
        self.job = job
        self.jitter = jitter or 0
        self.skip_repeated = isinstance(inner, CronTrigger) and _has_dst(inner)
        self._slots: OrderedDict[datetime, datetime] = OrderedDict()

    @property
    def timezone(self) -> Any:
        return getattr(self.inner, "timezone", timezone.utc)

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "job": self.job, "jitter": self.jitter}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"], state["job"], state["jitter"])  # type: ignore[misc]

    def __str__(self) -> str:
        return str(self.inner) + (f", jitter={self.jitter}s per slot" if self.jitter else "")

    def __repr__(self) -> str:
        return f"<SlotTrigger {self.inner!r} job={self.job!r} jitter={self.jitter}>"

    def next_slot(self, previous: datetime | None, now: datetime) -> datetime | None:
        """The next un-jittered slot after ``previous`` (a slot) and not before ``now``."""
        slot: datetime | None = self.inner.get_next_fire_time(previous, now)
        while slot is not None and self.skip_repeated and is_repeated_wall_time(slot):
            after = slot.astimezone(timezone.utc) + _US  # UTC: adding to a fold=1 time would drop the fold
            slot = self.inner.get_next_fire_time(None, after)
        return slot

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
        previous = self.slot_of(previous_fire_time) if previous_fire_time is not None else None
        slot = self.next_slot(previous, now)
        if slot is None or not self.jitter:
            return slot
        run_time = slot + _jitter_offset(self.job, slot, self.jitter)
        self._slots[run_time] = slot
        while len(self._slots) > _REMEMBERED:
            self._slots.popitem(last=False)
        return run_time

    def slot_of(self, run_time: datetime) -> datetime:
        """The slot a run time was produced for (itself when there is no jitter)."""
        if not self.jitter:
            return run_time
        known = self._slots.get(run_time)
        if known is not None:
            return known
        slot = self.next_slot(None, run_time - timedelta(seconds=self.jitter))
        for _ in range(1000):
            if slot is None or slot > run_time:
                break
            if slot + _jitter_offset(self.job, slot, self.jitter) == run_time:
                return slot
            slot = self.next_slot(slot, slot.astimezone(timezone.utc) + _US)
        return run_time


#: Names of UTC itself: a host set to any of them computes the same fire times.
_UTC_NAMES = frozenset({"UTC", "Etc/UTC", "Etc/Universal", "Universal", "Etc/Zulu", "Zulu", "UCT", "Etc/UCT"})


def zone_of(trigger: Any) -> str | None:
    """The time zone a trigger's fire times depend on: a cron trigger's zone, the zone a date
    trigger's run date was read in; None for triggers whose instants are the same in every zone
    (intervals, anchored in UTC) or that do not say."""
    inner = trigger.inner if isinstance(trigger, SlotTrigger) else trigger
    if isinstance(inner, CronTrigger):
        zone = inner.timezone
    elif isinstance(inner, DateTrigger):
        zone = inner.run_date.tzinfo
    else:
        return None
    name = str(zone)
    return "UTC" if name in _UTC_NAMES else name


def guard_trigger(trigger: Any, job: str, *, anchor: bool = True) -> Any:
    """The trigger a guarded job runs on: anchored, and wrapped when jitter or DST need it.

    ``anchor=False``: a trigger read from a shared job store, anchored (or not) where it was added.
    """
    if isinstance(trigger, SlotTrigger):
        return trigger
    if anchor:
        anchor_interval(trigger)
    jitter = getattr(trigger, "jitter", None)
    if not jitter and not (isinstance(trigger, CronTrigger) and _has_dst(trigger)):
        return trigger
    if jitter:
        trigger.jitter = None  # the wrapper adds its own, deterministic, jitter
    return SlotTrigger(trigger, job, jitter)


def slot_of(trigger: Any, run_time: datetime) -> datetime:
    """The slot to claim for ``run_time``: the un-jittered fire time."""
    return trigger.slot_of(run_time) if isinstance(trigger, SlotTrigger) else run_time


def _slot_source(trigger: Any) -> Any:
    return trigger if isinstance(trigger, SlotTrigger) else _Plain(trigger)


class _Plain:
    def __init__(self, trigger: Any) -> None:
        self.trigger = trigger

    def next_slot(self, previous: datetime | None, now: datetime) -> datetime | None:
        return self.trigger.get_next_fire_time(previous, now)  # type: ignore[no-any-return]


def latest_fire_time(
    trigger: Any, floor: datetime, now: datetime, after: datetime | None, budget: float = 0.2
) -> datetime | None:
    """The latest slot of ``trigger`` in ``[max(floor, after + 1 µs), now]``, or None.

    The walk goes backwards in doubling windows from ``now``, so its cost depends on how many
    slots lie near ``now``, not on how wide the window is. All arithmetic is in UTC (a ``fold=1``
    local time plus one microsecond would land an hour early). It gives up (None: no catch-up)
    after ``budget`` seconds of CPU rather than return a wrong answer.
    """
    source = _slot_source(trigger)
    now = now.astimezone(timezone.utc)
    start = floor.astimezone(timezone.utc)
    if after is not None:
        start = max(start, after.astimezone(timezone.utc) + _US)
    if start > now:
        return None
    give_up = time.thread_time() + budget
    width = timedelta(seconds=1)
    while True:
        window_start = max(start, now - width)
        latest = _last_in(source, window_start, now, give_up)
        if latest is not None or window_start == start:
            return latest
        if time.thread_time() > give_up:
            log.warning("catch-up walk of %r gave up after %.1fs of CPU", trigger, budget)
            return None
        width *= 2


def _last_in(source: Any, start: datetime, end: datetime, give_up: float) -> datetime | None:
    latest = None
    when = source.next_slot(None, start)
    while when is not None and when.astimezone(timezone.utc) <= end:
        latest = when
        if time.thread_time() > give_up:
            return None
        when = source.next_slot(when, when.astimezone(timezone.utc) + _US)
    return latest


def passed_fire_time(
    trigger: Any, last: datetime | None, stored: datetime, floor: datetime, now: datetime, budget: float = 0.2
) -> datetime | None:
    """The latest fire time in ``[floor, now]`` that a job's stored next run time (``stored``) was
    moved past without a run, or None.

    A scheduler's loop moves a job's next run time from one fire time to the next, each computed from
    the one before (an interval trigger adds its interval to the previous fire time, wherever that
    was: after ``next_run_time=`` at add or ``modify_job(next_run_time=...)``, the job's fire times
    are that instant plus whole intervals, not the trigger's anchored slots). So such a fire time
    lies on the sequence that starts after ``last`` (the last claimed fire time) and goes on to
    ``stored`` exactly. A sequence that passes ``stored`` without meeting it shows ``stored`` was set
    off it (by ``next_run_time=``, ``modify_job``, a resume), and nothing before ``stored`` is a fire
    time the job still has: None. Without ``last`` (no claim yet) the sequence starts at the latest
    slot in ``[floor, now]``. ``stored`` is a slot (un-jittered), as the fire times walked are. The
    walk gives up (None: nothing run) after ``budget`` seconds of CPU.
    """
    source = _slot_source(trigger)
    zone = getattr(trigger, "timezone", None) or timezone.utc
    give_up = time.thread_time() + budget
    if last is None:
        when = latest_fire_time(trigger, floor, now, None, budget)
    else:
        previous = last.astimezone(zone)  # computed as the loop computes it: in the trigger's zone
        when = source.next_slot(previous, previous.astimezone(timezone.utc) + _US)
    latest = None
    while when is not None and when < stored:
        if floor <= when <= now:
            latest = when
        if time.thread_time() > give_up:
            log.warning("catch-up walk of %r from %s to %s gave up after %.1fs of CPU", trigger, last, stored, budget)
            return None
        when = source.next_slot(when, when.astimezone(timezone.utc) + _US)  # in UTC, as _last_in steps
    return latest if when == stored else None
