"""Issue 8, part A: every node names the same scheduled run with the same fire time.

Interval anchors, the scheduler's time zone, jitter, the DST fall-back and the catch-up walk.
The multi-node tests run two real schedulers on one SQLite file, each with its own store client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from mutexcron import MutexScheduler, current_lease
from mutexcron.guard.firetimes import SlotTrigger, guard_trigger, latest_fire_time
from mutexcron.locks import lock_store_from_url

pytestmark = pytest.mark.sqlite

NEW_YORK = ZoneInfo("America/New_York")
FALL_BACK = datetime(2026, 11, 1, tzinfo=NEW_YORK)  # 02:00 EDT -> 01:00 EST


def walk(trigger: Any, start: datetime, count: int) -> list[datetime]:
    """The next ``count`` fire times, fed back the way APScheduler does."""
    out: list[datetime] = []
    previous, now = None, start
    for _ in range(count):
        when = trigger.get_next_fire_time(previous, now)
        assert when is not None
        out.append(when)
        previous, now = when, when
    return out


# -- A1: interval anchors ---------------------------------------------------------------------
def test_interval_jobs_started_at_different_moments_fire_at_the_same_instants() -> None:
    a = MutexScheduler(lock_url="memory://a1")
    a.add_job(print, "interval", days=1, id="daily", mutex=True)
    time.sleep(0.3)
    b = MutexScheduler(lock_url="memory://a1")
    b.add_job(print, "interval", days=1, id="daily", mutex=True)
    now = datetime.now(timezone.utc)
    fire_a = a.get_job("daily").trigger.get_next_fire_time(None, now)
    fire_b = b.get_job("daily").trigger.get_next_fire_time(None, now)
    assert fire_a == fire_b
    assert fire_a.astimezone(timezone.utc).time() == datetime.min.time(), "days=1 is anchored at 00:00 UTC"


def test_an_explicit_start_date_is_the_anchor() -> None:
    start = datetime(2026, 1, 1, 8, 0, 7, tzinfo=timezone.utc)
    trigger = guard_trigger(IntervalTrigger(hours=6, start_date=start), "job")
    fire = trigger.get_next_fire_time(None, datetime(2026, 3, 1, 9, tzinfo=timezone.utc))
    assert fire == datetime(2026, 3, 1, 14, 0, 7, tzinfo=timezone.utc)


def test_two_nodes_started_apart_run_each_interval_slot_once(tmp_path: Path) -> None:
    """Before the anchor, node B's slots were offset by its start time: both claims were accepted."""
    url = f"sqlite:///{tmp_path}/interval.db"
    runs: list[tuple[str, datetime]] = []
    lock = threading.Lock()
    nodes = []
    for node in ("a", "b"):
        sched = MutexScheduler(lock_url=url, node_id=node, unactive_interval=1.5)

        def job(node: str = node) -> None:
            with lock:
                runs.append((node, current_lease().fire_time))

        sched.add_job(job, "interval", seconds=2, id="every2", mutex=True)
        sched.start()
        nodes.append(sched)
        time.sleep(0.7)
    time.sleep(5)
    for sched in nodes:
        sched.shutdown(wait=True)
    fires = [fire for _node, fire in runs]
    assert fires, "the job never ran"
    assert all(int(f.timestamp()) % 2 == 0 and f.microsecond == 0 for f in fires), fires
    assert len(fires) == len(set(fires)), f"a slot ran twice: {runs}"
    gaps = [(b - a).total_seconds() for a, b in zip(sorted(fires), sorted(fires)[1:])]
    assert all(g >= 2 for g in gaps), f"two runs less than one interval apart: {runs}"


# -- A2: time zones ---------------------------------------------------------------------------
NEXT_FIRE = """
import json, sys
from datetime import datetime, timezone
from mutexcron import MutexScheduler
s = MutexScheduler(lock_url="memory://tz")
s.add_job(print, "cron", hour=3, id="nightly", mutex=True)
now = datetime(2026, 6, 1, 12, tzinfo=timezone.utc)
print(json.dumps({"tz": str(s.timezone),
                  "next": s.get_job("nightly").trigger.get_next_fire_time(None, now).astimezone(timezone.utc).isoformat()}))
"""


def test_cron_hour_is_local_time_in_the_hosts_zone_as_in_apscheduler() -> None:
    """The scheduler keeps APScheduler's default zone (the host's): hour=3 is 03:00 there. A cluster
    whose nodes are in different zones is refused by the zone rule (tests/test_zones.py)."""
    answers = {}
    for tz in ("Europe/Paris", "UTC", "America/Los_Angeles"):
        out = subprocess.run(
            [sys.executable, "-c", NEXT_FIRE], env={**os.environ, "TZ": tz}, capture_output=True, text=True, check=True
        )
        answers[tz] = json.loads(out.stdout)
    assert {tz: a["tz"] for tz, a in answers.items()} == {tz: tz for tz in answers}
    assert {tz: a["next"] for tz, a in answers.items()} == {
        "Europe/Paris": "2026-06-02T01:00:00+00:00",
        "UTC": "2026-06-02T03:00:00+00:00",
        "America/Los_Angeles": "2026-06-02T10:00:00+00:00",
    }


def test_local_time_schedules_need_an_explicit_zone() -> None:
    sched = MutexScheduler(lock_url="memory://tz2", timezone="America/New_York")
    sched.add_job(print, "cron", hour=3, id="nightly", mutex=True)
    fire = sched.get_job("nightly").trigger.get_next_fire_time(None, datetime(2026, 6, 1, 12, tzinfo=timezone.utc))
    assert fire.astimezone(timezone.utc) == datetime(2026, 6, 2, 7, tzinfo=timezone.utc)


# -- A3: jitter -------------------------------------------------------------------------------
def test_jitter_is_the_same_on_every_node_and_the_claim_is_the_unjittered_slot() -> None:
    first = guard_trigger(CronTrigger(second="*/10", jitter=4, timezone="UTC"), "report")
    second = guard_trigger(CronTrigger(second="*/10", jitter=4, timezone="UTC"), "report")
    start = datetime(2026, 6, 1, 12, tzinfo=timezone.utc)
    runs_a, runs_b = walk(first, start, 30), walk(second, start, 30)
    assert runs_a == runs_b, "two nodes must compute the same jittered run times"
    slots = [first.slot_of(r) for r in runs_a]
    assert all(s.second % 10 == 0 and s.microsecond == 0 for s in slots)
    assert slots == [start + timedelta(seconds=10 * i) for i in range(30)], "jitter must not drift the slots"
    assert len({(r - s).total_seconds() for r, s in zip(runs_a, slots)}) > 5, "the jitter still spreads runs"
    assert all(0 <= (r - s).total_seconds() < 4 for r, s in zip(runs_a, slots))
    other_job = walk(guard_trigger(CronTrigger(second="*/10", jitter=4, timezone="UTC"), "other"), start, 30)
    assert other_job != runs_a, "jitter differs between jobs"


def test_a_jittered_run_claims_its_slot_so_a_takeover_does_not_rerun_it(tmp_path: Path) -> None:
    """Before: the claim was the node's random jittered time; the next holder's catch-up computed
    another one for the same slot and ran it again (87 of 200 simulated failovers)."""
    url = f"sqlite:///{tmp_path}/jitter.db"
    sched = MutexScheduler(lock_url=url, node_id="a", unactive_interval=2)
    fires: list[datetime] = []
    sched.add_job(lambda: fires.append(current_lease().fire_time), "interval", seconds=2, jitter=1, id="j", mutex="jl")
    sched.start()
    try:
        deadline = time.monotonic() + 10
        while len(fires) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sched.shutdown(wait=True)
    assert len(fires) >= 2
    store = lock_store_from_url(url)
    try:
        record = store.read("jl")
        assert record is not None
        claimed = record.fire_times["j"]
    finally:
        store.close()
    assert claimed == max(fires) and claimed.microsecond == 0 and int(claimed.timestamp()) % 2 == 0
    trigger = SlotTrigger(IntervalTrigger(seconds=2, start_date=datetime(1970, 1, 1, tzinfo=timezone.utc)), "j", 1)
    now = claimed + timedelta(seconds=1.5)  # the next holder looks, before the next slot
    assert latest_fire_time(trigger, claimed - timedelta(seconds=10), now, after=claimed) is None


# -- A4: DST ----------------------------------------------------------------------------------
def test_dst_fall_back_runs_a_daily_0130_job_once() -> None:
    trigger = guard_trigger(CronTrigger(hour=1, minute=30, timezone=NEW_YORK), "nightly")
    fires = walk(trigger, datetime(2026, 10, 30, 12, tzinfo=timezone.utc), 4)
    local_days = [f.astimezone(NEW_YORK).date() for f in fires]
    assert len(set(local_days)) == 4, f"01:30 ran twice on the fall-back day: {fires}"
    assert all(f.astimezone(NEW_YORK).strftime("%H:%M") == "01:30" for f in fires)


def test_dst_fall_back_runs_each_wall_clock_quarter_hour_once() -> None:
    trigger = guard_trigger(CronTrigger(minute="*/15", timezone=NEW_YORK), "quarterly")
    start = datetime(2026, 11, 1, 4, 50, tzinfo=timezone.utc)  # 00:50 EDT
    fires = walk(trigger, start, 12)
    walls = [f.astimezone(NEW_YORK).strftime("%H:%M") for f in fires]
    assert Counter(walls).most_common(1)[0][1] == 1, walls
    assert walls[:6] == ["01:00", "01:15", "01:30", "01:45", "02:00", "02:15"]
    utc = [f.astimezone(timezone.utc) for f in fires]
    assert utc == sorted(utc)


def test_dst_spring_forward_keeps_apschedulers_behaviour() -> None:
    trigger = guard_trigger(CronTrigger(hour=2, minute=30, timezone=NEW_YORK), "nightly")
    fires = walk(trigger, datetime(2026, 3, 7, 12, tzinfo=timezone.utc), 3)
    assert len({f.astimezone(NEW_YORK).date() for f in fires}) == 3


# -- A5: the catch-up walk --------------------------------------------------------------------
def test_catch_up_walk_across_the_fall_back_is_right_and_cheap() -> None:
    trigger = guard_trigger(CronTrigger(minute="*/15", timezone=NEW_YORK), "q")
    now = datetime(2026, 11, 1, 6, 50, tzinfo=timezone.utc)  # 01:50 EST, in the repeated hour
    began = time.thread_time()
    latest = latest_fire_time(trigger, now - timedelta(hours=3), now, after=None)
    assert time.thread_time() - began < 0.2
    # 01:00-01:45 EST repeat 01:00-01:45 EDT, which ran at 05:00-05:45 UTC: the latest slot is 01:45 EDT.
    assert latest is not None and latest.astimezone(timezone.utc) == datetime(2026, 11, 1, 5, 45, tzinfo=timezone.utc)
    plain = CronTrigger(minute="*/15", timezone=NEW_YORK)
    walked = latest_fire_time(plain, now - timedelta(hours=3), now, after=None)
    assert walked is not None
    assert walked.astimezone(timezone.utc) == datetime(2026, 11, 1, 6, 45, tzinfo=timezone.utc), (
        "the walk itself is right in UTC, also for a fold=1 time"
    )


def test_catch_up_walk_over_a_window_of_more_than_100k_fire_times_finds_the_latest_quickly() -> None:
    trigger = CronTrigger(second="*", timezone="UTC")
    now = datetime(2026, 6, 1, 12, 0, 0, 500000, tzinfo=timezone.utc)
    began = time.thread_time()
    latest = latest_fire_time(trigger, now - timedelta(days=2), now, after=None)
    assert time.thread_time() - began < 0.2
    assert latest == datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc), "not a fire time ~28 h old"


def test_catch_up_walk_honours_the_last_claim() -> None:
    trigger = CronTrigger(minute="*", timezone="UTC")
    now = datetime(2026, 6, 1, 12, 0, 30, tzinfo=timezone.utc)
    claimed = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)
    assert latest_fire_time(trigger, now - timedelta(minutes=5), now, after=claimed) is None
    assert latest_fire_time(trigger, now - timedelta(minutes=5), now, after=claimed - timedelta(minutes=1)) == claimed


class SlowTrigger(IntervalTrigger):  # a user's trigger that is slow to compute
    def get_next_fire_time(self, previous: Any, now: Any) -> Any:
        if threading.current_thread().name.startswith("mutexcron-heartbeat"):
            raise AssertionError("the catch-up walk ran on the heartbeat thread")
        time.sleep(0.01)
        return super().get_next_fire_time(previous, now)


def test_catch_up_walk_runs_off_the_heartbeat_thread(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"sqlite:///{tmp_path}/walk.db"
    sched = MutexScheduler(lock_url=url, node_id="a", unactive_interval=1)
    sched.add_job(print, SlowTrigger(seconds=1, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)), id="slow", mutex="w")
    sched.start()
    try:
        time.sleep(2.5)
    finally:
        sched.shutdown(wait=True)
    assert "catch-up after acquiring" not in caplog.text
    assert "the catch-up walk ran on the heartbeat thread" not in caplog.text


def test_a_lock_taken_with_an_old_claim_puts_its_job_back_on_the_fire_time_due_within_the_grace() -> None:
    """Balanced placement: a node that takes a lock puts its jobs back in the loop from the lock's last
    claimed fire time. A claim older than the job's misfire grace (the rule when this node's clock is
    ahead of the last holder's: ``mutexcron drill --skew``) made it start from now, so the fire time
    due just before it took the lock ran on no node."""
    from types import SimpleNamespace

    from apscheduler.triggers.cron import CronTrigger

    from mutexcron.placement.standby import _next_fire_time

    job = SimpleNamespace(trigger=CronTrigger(second="*", timezone="UTC"), misfire_grace_time=4)
    now = datetime(2026, 11, 29, 0, 36, 33, 90_000, tzinfo=timezone.utc)
    fresh = _next_fire_time(job, now - timedelta(seconds=1.09), 2.0, now)
    assert fresh == datetime(2026, 11, 29, 0, 36, 33, tzinfo=timezone.utc), "the slot after the last claim"
    old = _next_fire_time(job, now - timedelta(seconds=9.09), 2.0, now)
    assert old is not None and now - timedelta(seconds=4) <= old <= now, f"due within the grace, not after now: {old}"
    never = _next_fire_time(job, None, 2.0, now)
    assert never == datetime(2026, 11, 29, 0, 36, 34, tzinfo=timezone.utc), "never claimed: from now"
