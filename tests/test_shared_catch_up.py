"""Catch-up after a hand-over, for a shared job whose stored next run time is off its trigger's slots.

APScheduler's interval trigger adds its interval to the previous fire time, so a job added with
``next_run_time=`` some instant, or moved by ``modify_job(next_run_time=...)`` ("run it now"),
fires from then on at that instant plus whole intervals, not on the trigger's anchored slots. The
node a lock is handed over to must catch up only a fire time the giver's loop moved the stored next
run time past without running it; it must not run an anchored slot the job never had.

In-process schedulers on one SQLite job store and one memory lock store (balanced placement: a
stopping node hands its locks over); the decision itself on hand-made records below that.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from apscheduler.job import Job
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from mutexcron.guard.catchup import CatchUp
from mutexcron.guard.firetimes import EPOCH, guard_trigger
from mutexcron.locks.memory import MemoryLockStore
from mutexcron.locks.record import LockRecord
from tests import shared_jobs
from tests.shared_jobs import open_jobstore, runs_of
from tests.test_shared_jobstores import Nodes, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

INTERVAL = 8  # seconds; its slots are anchored at the Unix epoch


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    shared_jobs.clear_runs()
    with open_jobstore("sqlite", tmp_path) as jobs:
        made = Nodes(jobs, MemoryLockStore("memory://shared-catch-up"))
        try:
            yield made
        finally:
            made.close()


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def _between_two_slots(lead: float) -> float:
    """The first instant halfway between two of the trigger's slots at least ``lead`` seconds ahead."""
    ahead = time.time() + lead - INTERVAL / 2
    return math.ceil(ahead / INTERVAL) * INTERVAL + INTERVAL / 2


@pytest.mark.sqlite
def test_a_hand_over_runs_no_slot_of_the_trigger_that_the_shared_job_does_not_have(nodes: Nodes) -> None:
    """Added with ``next_run_time`` between two slots, the job fires at R, R + 8 s, ...; the lock is
    handed over at R + 5 s, after the anchored slot R + 4 s: the new holder must not run R + 4 s."""
    first, second = nodes.new(), nodes.new()
    web = nodes.new(paused=True)
    off = _between_two_slots(lead=2.5)
    web.add_job(shared_jobs.tick, "interval", seconds=INTERVAL, id="off", kwargs={"job": "off"},
                misfire_grace_time=60, next_run_time=datetime.fromtimestamp(off, timezone.utc))  # fmt: skip
    web.shutdown()  # a paused web process is no successor: the lock goes from one worker to the other
    wait_for(lambda: runs_of("off"), timeout=INTERVAL + 6)
    holder = next(s for s in (first, second) if s.node_id == runs_of("off")[0][2])
    _sleep_until(off + INTERVAL / 2 + 1)  # past the anchored slot, before the job's next fire time
    holder.shutdown()  # hands the job's lock over to the other node
    _sleep_until(off + INTERVAL + 1.5)
    wait_for(lambda: len(runs_of("off")) >= 2, timeout=5)
    time.sleep(0.5)
    fires = sorted(r[1] for r in runs_of("off"))
    assert fires == [off, off + INTERVAL], f"fire times run, after {off}: {[f - off for f in fires]}"


@pytest.mark.sqlite
def test_no_hand_over_between_the_loop_reading_a_due_shared_job_and_counting_its_run(nodes: Nodes) -> None:
    """The holder's loop reads the job due at F, writes its next run time (F + 2 s), then its run
    claims F. A hand-over asked for in between (here a stop, as on SIGTERM) waits until the run is
    counted, and the holder runs F. Had it gone ahead, the successor's catch-up could read F (due:
    its loop's to run) and its loop then F + 2 s (the giver's write): F would run nowhere. That
    loss needs one interleaving of three threads on two nodes; this test checks the rule that
    rules it out: the lock stays with the holder through the pass."""
    first, second = nodes.new(), nodes.new()
    web = nodes.new(paused=True)
    web.add_job(shared_jobs.tick, "interval", seconds=2, id="pass", kwargs={"job": "pass"}, misfire_grace_time=5)
    web.shutdown()
    wait_for(lambda: len(runs_of("pass")) >= 2, timeout=10)  # placed: the second node joined
    holder = first if runs_of("pass")[-1][2] == first.node_id else second
    store = holder._jobstores["default"]
    write = store._replace
    struck: list[float] = []
    holders_meanwhile: list[str | None] = []
    stop = threading.Thread(target=holder.shutdown)

    def advance_during_a_stop(job_id: str, base: bytes, ts: float | None, state: bytes, announce: bool) -> bool:
        if not announce and not struck and job_id == "pass" and ts is not None:
            struck.append(ts - 2)  # the fire time this pass read due: F
            stop.start()  # the holder stops: it hands its lock over to the other node (after 0.3 s)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not holders_meanwhile:
                record = nodes.locks.read("pass")
                if record is not None and record.holder != holder.node_id:
                    holders_meanwhile.append(record.holder)
                time.sleep(0.02)
        return bool(write(job_id, base, ts, state, announce))

    store._replace = advance_during_a_stop
    wait_for(lambda: struck and any(r[1] >= struck[0] + 2 for r in runs_of("pass")), timeout=12)
    stop.join(timeout=20)
    assert not holders_meanwhile, f"lock handed over to {holders_meanwhile[0]} between the pass's read and its run"
    fires = sorted((round(r[1] - struck[0], 3), r[2] == holder.node_id) for r in runs_of("pass") if r[1] >= struck[0])
    assert fires[:2] == [(0.0, True), (2.0, False)], f"(fire time - F, run by the giver) from F on: {fires}"


# -- the decision, on hand-made records ----------------------------------------------------------------

#: The moment of the hand-over in the cases below: 1 s past a slot of the epoch-anchored 8 s grid
#: (and of ``second="*/8"``: 1_764_000_000 is a whole minute).
NOW = 1_764_000_000.0 + 1.0


class _Executor:
    def __init__(self) -> None:
        self.submitted: list[datetime] = []

    def submit_job(self, job: Any, run_times: list[datetime]) -> None:
        self.submitted.extend(run_times)


class _Scheduler:
    """What :class:`CatchUp` reads of a scheduler: one job and the executor it is submitted to."""

    running = True

    def __init__(self, job: Any) -> None:
        self.job = job
        self._executors = {"default": _Executor()}

    def get_job(self, job_id: str) -> Any:
        return self.job if job_id == self.job.id else None

    def _lookup_executor(self, alias: str) -> _Executor:
        return self._executors[alias]


class _Guard:
    def __init__(self, job_id: str, lock: str) -> None:
        self.job_id, self.lock = job_id, lock


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def _caught_up(
    trigger: Any, stored: float, last: float | None, *, shared: bool = True, grace: int = 60, coalesce: bool = True,
    now: float = NOW,
) -> list[float]:
    """What a node that a lock was handed over to at ``now`` submits for the lock's job, as seconds
    from ``now``: its trigger, its stored next run time, the record's last claimed fire time."""
    job = Job.__new__(Job)
    job.id, job.executor, job.coalesce, job.misfire_grace_time = "j", "default", coalesce, grace
    job.trigger = guard_trigger(trigger, "j", anchor=False)
    job.next_run_time = _at(stored)
    scheduler = _Scheduler(job)
    record = LockRecord(name="lock", holder="giver", fire_times={} if last is None else {"j": _at(last)})
    catch_up = CatchUp(
        scheduler, lambda: {"j": _Guard("j", "lock")}, emit=lambda event: None, skip=lambda job_id: True,
        skip_handed=lambda job_id: False, stored=lambda job_id: shared, clock=lambda: _at(now),
    )  # fmt: skip
    catch_up.started_at = _at(now - 3600)
    try:
        catch_up.run("lock", record, handed=True)
    finally:
        catch_up.shutdown()
    return [round(d.timestamp() - now, 3) for d in scheduler._executors["default"].submitted]


def _every(seconds: int) -> IntervalTrigger:
    return IntervalTrigger(seconds=seconds, start_date=EPOCH, timezone=timezone.utc)


def _every_second_of_eight() -> CronTrigger:
    return CronTrigger(second="*/8", timezone=timezone.utc)


def test_a_fire_time_the_stored_next_run_time_was_moved_past_runs_once() -> None:
    """The giver ran -9 s, its loop moved the stored time past -1 s to +7 s, and the run of -1 s
    began while it handed the lock over (so it did not run): the new holder runs -1 s, once."""
    assert _caught_up(_every(8), stored=NOW + 7, last=NOW - 9) == [-1.0]
    assert _caught_up(_every(8), stored=NOW + 7, last=NOW - 25) == [-1.0]  # several passed: coalesced
    assert _caught_up(_every(8), stored=NOW + 7, last=None) == [-1.0]  # the job's first fire time
    assert _caught_up(_every_second_of_eight(), stored=NOW + 7, last=NOW - 5) == [-1.0]  # cron alike
    # Under the misfire rules: 5 s late, within a grace time of 60 s, not within one of 4 s.
    assert _caught_up(_every(8), stored=NOW + 7, last=NOW - 9, now=NOW + 4) == [-5.0]
    assert _caught_up(_every(8), stored=NOW + 7, last=NOW - 9, now=NOW + 4, grace=4) == []


def test_a_stored_next_run_time_off_the_triggers_slots_catches_up_no_slot() -> None:
    """A job whose stored next run time was set between two slots: its fire times are that instant
    plus whole intervals, so the slot -1 s is none of its fire times and nothing runs (the old code
    ran it: the same cases with the slots' walk, below, show it)."""
    run_now = NOW - 5  # modify_job(next_run_time=...) at -5 s, half-way between two slots; it ran
    assert _caught_up(_every(8), stored=run_now + 8, last=run_now) == []
    assert _caught_up(_every(8), stored=run_now + 8, last=run_now, shared=False) == [-1.0]  # the slots' walk
    # Added with next_run_time= at +3 s, between two slots, not run yet: no slot before it runs.
    assert _caught_up(_every(8), stored=NOW + 3, last=None) == []
    assert _caught_up(_every(8), stored=NOW + 3, last=None, shared=False) == [-1.0]
    # Run now at -5 s, then moved on to +20 s (off its fire times too): nothing.
    assert _caught_up(_every(8), stored=NOW + 20, last=run_now) == []
    # A cron job claimed at -5 s and moved to +3 s, past its slot at -1 s: that slot is not run.
    assert _caught_up(_every_second_of_eight(), stored=NOW + 3, last=NOW - 5) == []


def test_a_stored_next_run_time_already_due_is_left_to_the_loop() -> None:
    """Due at -1 s, the loop runs it (coalesced with the fire time passed before it): no catch-up;
    without coalescing, the one passed runs too."""
    assert _caught_up(_every(8), stored=NOW - 1, last=NOW - 17) == []
    assert _caught_up(_every(8), stored=NOW - 1, last=NOW - 17, coalesce=False) == [-9.0]


def test_a_claimed_fire_time_is_never_caught_up_again() -> None:
    assert _caught_up(_every(8), stored=NOW + 7, last=NOW - 1) == []  # -1 s claimed: nothing after it passed
    assert _caught_up(_every(8), stored=NOW + 7, last=NOW - 1, shared=False) == []


def _alarms(stored: float, last: float, now: float, *, grace: int = 1) -> list[float]:
    """The missed-run alarms a node raises for a shared job from its lock's record at ``now``, as
    seconds from ``now``."""
    job = Job.__new__(Job)
    job.id, job.executor, job.coalesce, job.misfire_grace_time = "j", "default", True, grace
    job.trigger = guard_trigger(_every(8), "j", anchor=False)
    job.next_run_time = _at(stored)
    events: list[Any] = []
    catch_up = CatchUp(_Scheduler(job), lambda: {"j": _Guard("j", "lock")}, emit=events.append,
                       stored=lambda job_id: True, clock=lambda: _at(now))  # fmt: skip
    try:
        catch_up.check_missed("lock", LockRecord(name="lock", holder="holder", fire_times={"j": _at(last)}))
        catch_up._pool.submit(lambda: None).result(timeout=5)  # the check ran on the catch-up thread
    finally:
        catch_up.shutdown()
    return [round(e.fire_time.timestamp() - now, 3) for e in events]


def test_the_missed_run_alarm_names_no_slot_the_shared_job_does_not_have() -> None:
    """Run now at -5 s between two slots, next at +3 s: the slot -1 s (older than the 1 s grace
    time at +1.5 s) is none of its fire times, so no alarm; its stored time overdue is one."""
    run_now = NOW - 5
    assert _alarms(stored=run_now + 8, last=run_now, now=NOW + 1.5) == []
    assert _alarms(stored=run_now + 8, last=run_now, now=run_now + 10) == [-2.0]  # +3 s not run by +5 s
    assert _alarms(stored=NOW + 7, last=NOW - 9, now=NOW + 1.5) == [-2.5]  # -1 s passed without a run
