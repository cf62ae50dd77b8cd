"""What a trigger request reports (mutexcron/guard/triggers.py, mutexcron/cli/trigger.py): the real
outcome of the run, ``unknown`` when no end of it is recorded, ``paused`` at once, and catch-up
requests that end instead of waiting forever. The handler with a fake scheduler on a memory store;
the whole path with real nodes is in tests/test_trigger.py."""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron.cli.main import main
from mutexcron.errors import Defer, FailTask
from mutexcron.events import EVENT_RUN_FINISHED, EVENT_RUN_SKIPPED, MutexEvent
from mutexcron.guard.triggers import NOT_DEFINED, NOT_GUARDED, PAUSED, TRIGGER_CODE, UNKNOWN, _TriggerHandler, trigger_code
from mutexcron.locks import FireClaim, Node, Presence, RunInfo, lock_store_from_url
from mutexcron.tasks.base import TaskRecord
from mutexcron.tasks.handlers import Task
from mutexcron.timeutil import us_from_datetime

pytestmark = pytest.mark.memory

DUE = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)
NODE = Node("n1:1:aaaa", "10.0.0.1")


class FakeScheduler:
    """The parts of a scheduler the trigger handler uses; ``ended`` is what its guard's run_now returns."""

    def __init__(self, ended: MutexEvent | None = None, *, has_job: bool = True, holds: tuple[str, ...] = ()) -> None:
        self.lock_store = lock_store_from_url(f"memory://trigger-{secrets.token_hex(4)}")
        self.ended = ended
        self.has_job = has_job
        self._leases = SimpleNamespace(held=lambda: dict.fromkeys(holds, 1))
        self.running: set[str] = set()  # locks with a guarded run going on this node

    def guard_of(self, job_id: str) -> Any:
        return SimpleNamespace(lock="reports", run_now=lambda *_a: self.ended) if self.has_job else None

    def get_job(self, job_id: str) -> Any:
        return SimpleNamespace(args=(), kwargs={}) if self.has_job else None

    def running_guarded_jobs(self) -> dict[str, int]:
        return dict.fromkeys(self.running, 1)

    def record_run(self, error: str | None, fire_time: datetime = DUE) -> None:
        token = self.lock_store.acquire_or_renew("reports", NODE, ttl=60).token
        assert self.lock_store.hand_off("reports", NODE, token, None, RunInfo(0.1, error, job="report", fire_time=fire_time))


class ClaimingScheduler(FakeScheduler):
    """A guard whose run_now makes the real fire claim on the memory store (no job runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.claims: list[tuple[str, datetime]] = []

    def claim(self, fire_time: datetime) -> bool:
        claim = FireClaim.new("report", us_from_datetime(fire_time))
        got = self.lock_store.acquire_or_renew("reports", NODE, ttl=60, claim=claim)
        return bool(got.acquired and got.claimed)

    def guard_of(self, job_id: str) -> Any:
        def run_now(fire_time: datetime, *_a: Any) -> MutexEvent:
            claimed = self.claim(fire_time)
            self.claims.append(("claimed" if claimed else "refused", fire_time))
            return finished("success") if claimed else skipped("already-run")

        return SimpleNamespace(lock="reports", run_now=run_now)


def task(payload: Any = None, age: float = 0.0) -> Task:
    created = DUE
    record = TaskRecord(TRIGGER_CODE, "report", DUE, payload, "running", attempt=2, token=2, created=created,
                        updated=created + timedelta(seconds=age))  # fmt: skip
    return Task(record, lambda: False)


def skipped(reason: str) -> MutexEvent:
    return MutexEvent(EVENT_RUN_SKIPPED, lock="reports", job_id="report", fire_time=DUE, reason=reason)


def finished(outcome: str, error: str | None = None) -> MutexEvent:
    return MutexEvent(EVENT_RUN_FINISHED, lock="reports", job_id="report", fire_time=DUE, outcome=outcome, error=error)


# -- the run's real outcome (issue 22, item 12) --------------------------------------------------------
def test_a_retried_request_whose_run_never_ended_is_unknown_not_success() -> None:
    """The node running it was killed: the retry finds the fire time claimed and no end recorded."""
    sched = FakeScheduler(skipped("already-run"))
    sched.record_run(None, fire_time=DUE - timedelta(hours=6))  # an earlier run of the job: not this one
    with pytest.raises(FailTask) as info:
        _TriggerHandler(sched)(task())
    assert str(info.value).startswith(f"{UNKNOWN}the run at fire time {DUE.isoformat()} started")


def test_a_retried_request_reports_the_recorded_outcome_of_its_fire_time() -> None:
    failed = FakeScheduler(skipped("already-run"))
    failed.record_run("RuntimeError: the report server said no")
    with pytest.raises(FailTask, match=r"^RuntimeError: the report server said no$"):
        _TriggerHandler(failed)(task())
    ran = FakeScheduler(skipped("already-run"))
    ran.record_run(None)
    _TriggerHandler(ran)(task())  # completes: success


def test_a_request_whose_fire_time_a_scheduled_run_claimed_past_reports_that_run() -> None:
    """The dashboard's flaky browser test: a `resume --catch-up` request (due 11:24:45.944) was seen
    by the holder after the job's scheduled slot 11:24:46 had been claimed; the store refuses any
    fire time not after the claimed one, so the request's claim was refused (already-run), and with
    no history entry at its own fire time it failed as 'outcome unknown'. The run it asked for is
    the scheduled one: it started after the request."""
    sched = ClaimingScheduler()
    scheduled = DUE + timedelta(milliseconds=56)
    sched.claim(scheduled)
    sched.record_run(None, fire_time=DUE - timedelta(seconds=2))  # before the request: not its run
    sched.record_run(None, fire_time=scheduled)
    _TriggerHandler(sched)(task())  # completes: that run succeeded, and nothing runs again
    assert sched.claims == [("refused", DUE)]
    failed = ClaimingScheduler()
    failed.claim(scheduled)
    failed.record_run("ConnectionError: SMTP 451", fire_time=scheduled)
    with pytest.raises(FailTask, match=r"^ConnectionError: SMTP 451$"):
        _TriggerHandler(failed)(task())


def test_a_claimed_run_still_going_on_this_node_is_waited_for_not_unknown() -> None:
    """An earlier attempt's run (or the scheduled run that claimed past the request) has not ended
    yet: its end may still be recorded, so the request waits; once no run of the lock is going on
    this node (the holder), nothing can record it any more and the outcome is unknown."""
    sched = FakeScheduler(skipped("already-run"))
    sched.running.add("reports")
    with pytest.raises(Defer, match="has not ended yet"):
        _TriggerHandler(sched)(task())
    sched.record_run(None)
    _TriggerHandler(sched)(task())  # it ended: success
    stopped = FakeScheduler(skipped("already-run"))
    stopped.running.add("billing")  # another lock's run: not one that could record this request's
    with pytest.raises(FailTask, match=f"^{UNKNOWN}"):
        _TriggerHandler(stopped)(task())


def test_a_run_error_with_a_nul_byte_fails_the_request_with_storable_text() -> None:
    with pytest.raises(FailTask) as info:
        _TriggerHandler(FakeScheduler(finished("error", "ValueError: b'\x00'")))(task())
    assert str(info.value) == "ValueError: b'\ufffd'"


# -- paused, stale catch-ups (issue 22, item 17) --------------------------------------------------------
def test_a_paused_lock_fails_the_request_at_once() -> None:
    with pytest.raises(FailTask, match=f"^{PAUSED}lock 'reports' is paused: run `mutexcron resume reports` first"):
        _TriggerHandler(FakeScheduler(skipped("paused")))(task())


def test_a_catch_up_request_for_a_job_its_locks_holder_lacks_fails_at_once() -> None:
    catch_up = {"lock": "reports", "deadline": 300.0}
    with pytest.raises(FailTask, match="is not defined on 'reports''s holder"):
        _TriggerHandler(FakeScheduler(has_job=False, holds=("reports",)))(task(catch_up))
    with pytest.raises(Defer):  # a node that does not hold the lock leaves it to the holder
        _TriggerHandler(FakeScheduler(has_job=False))(task(catch_up))


def test_a_catch_up_request_no_node_runs_fails_at_its_deadline_by_the_store_clock() -> None:
    catch_up = {"lock": "reports", "deadline": 300.0}
    with pytest.raises(Defer):
        _TriggerHandler(FakeScheduler(has_job=False))(task(catch_up, age=299.0))
    with pytest.raises(FailTask, match="no node ran job 'report' within 300s"):
        _TriggerHandler(FakeScheduler(has_job=False))(task(catch_up, age=301.0))
    with pytest.raises(FailTask, match="within 300s"):  # on the holder, deferred by the cluster as long
        _TriggerHandler(FakeScheduler(skipped("not-holder")))(task(catch_up, age=301.0))


# -- what `mutexcron trigger` says and exits with -------------------------------------------------------
@pytest.mark.parametrize(
    ("error", "code", "said"),
    [
        ("RuntimeError: no", 1, "ran at fire time 2030-01-01T12:00:00.123456+00:00 on n1: error: RuntimeError: no"),
        (f"{UNKNOWN}the run started, but no end of it is recorded", 4, "unknown: the run started"),
        (f"{PAUSED}lock 'reports' is paused", 5, "not run: lock 'reports' is paused"),
    ],
)
def test_trigger_exits_with_the_outcome(error: str, code: int, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    url = seeded()
    failed = SimpleNamespace(state="failed", last_error=error, owner="n1", due=DUE)
    store = SimpleNamespace(add=lambda *_a, **_k: "added", get=lambda *_a: failed, cancel=lambda *_a: True,
                            close=lambda: None, masked_url=url)  # fmt: skip
    monkeypatch.setattr("mutexcron.cli.trigger.task_store_from_url", lambda _url: store)
    result = CliRunner().invoke(main, ["trigger", "report", "--lock-url", url])
    assert result.exit_code == code and said in result.output, result.output


def seeded(*, paused: bool = False, presence: bool = True) -> str:
    """A memory store where n1 ran job 'report' under lock 'reports' and announced itself."""
    url = f"memory://trigger-cli-{secrets.token_hex(4)}"
    store = lock_store_from_url(url)
    token = store.acquire_or_renew("reports", NODE, ttl=60, claim=FireClaim.new("report", 1_000_000)).token
    assert store.set_zone("reports", NODE, token, None, {"report": "interval[6:00:00]"})  # as its holder writes
    if presence:
        store.renew_many(NODE, {"reports": token}, presence=Presence("1"))
    if paused:
        store.set_paused("reports", True, "ops")
    return url


# -- answered at once from the records (issue 25, item 7) -----------------------------------------------
class Requests:
    """A task store that records the trigger requests added to it (none must be, for a refused trigger)."""

    def __init__(self, task: Any = None) -> None:
        self.added: list[tuple[Any, ...]] = []
        self.task = task

    def add(self, *args: Any, **_kwargs: Any) -> str:
        self.added.append(args)
        return "added"

    def get(self, *_args: Any) -> Any:
        return self.task

    def cancel(self, *_args: Any) -> bool:
        return True

    def close(self) -> None:
        pass

    masked_url = "memory://x"


def trigger(url: str, *args: str, monkeypatch: pytest.MonkeyPatch, requests: Requests) -> Any:
    monkeypatch.setattr("mutexcron.cli.trigger.task_store_from_url", lambda _url: requests)
    started = time.monotonic()
    result = CliRunner().invoke(main, ["trigger", *args, "--lock-url", url, "--timeout", "30"])
    assert time.monotonic() - started < 5, "answered at once, not at the timeout"
    return result


def test_a_mistyped_or_unguarded_job_is_refused_at_once_with_the_jobs_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = Requests()
    result = trigger(seeded(), "reprot", monkeypatch=monkeypatch, requests=requests)
    assert result.exit_code == 2, result.output
    assert "no lock record" in result.output and "names a job 'reprot'" in result.output
    assert "Did you mean 'report'?" in result.output and "unguarded job cannot be triggered" in result.output
    assert requests.added == []


def test_a_job_on_a_paused_lock_is_refused_at_once_without_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = Requests()
    result = trigger(seeded(paused=True), "report", monkeypatch=monkeypatch, requests=requests)
    assert result.exit_code == 5 and "lock 'reports' is paused: run `mutexcron resume reports` first" in result.output
    assert requests.added == []


def test_no_running_node_is_said_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = Requests()
    result = trigger(seeded(presence=False), "report", monkeypatch=monkeypatch, requests=requests)
    assert result.exit_code == 3 and "no node is running" in result.output and requests.added == []


def test_the_request_names_the_lock_and_its_holder_fails_a_job_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = SimpleNamespace(state="failed", last_error=f"{NOT_DEFINED}job 'report' is not defined on 'reports''s holder",
                           owner="n1", due=DUE)  # fmt: skip
    requests = Requests(gone)
    result = trigger(seeded(), "report", monkeypatch=monkeypatch, requests=requests)
    assert result.exit_code == 2 and "not run: job 'report' is not defined" in result.output
    assert requests.added[0][0] == trigger_code("report") and requests.added[0][3]["lock"] == "reports"
    with pytest.raises(FailTask, match=f"^{NOT_DEFINED}job 'report' is not defined on 'reports''s holder"):
        _TriggerHandler(FakeScheduler(has_job=False, holds=("reports",)))(task({"lock": "reports"}))


def test_an_unguarded_job_fails_a_forced_request_on_the_node_that_defines_it() -> None:
    sched = FakeScheduler()
    sched.guard_of = lambda _job: None  # type: ignore[method-assign]  # defined, without a lock
    with pytest.raises(FailTask, match=f"^{NOT_GUARDED}job 'report' has no lock"):
        _TriggerHandler(sched)(task())


def test_a_job_that_never_ran_is_found_in_its_holders_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder writes its jobs and their triggers when it takes the lock (issue 25 item 3): a
    weekly job deployed today is known before it ever ran, no --force needed."""
    url = seeded()
    store = lock_store_from_url(url)
    record = store.read("reports")
    assert record is not None and store.set_zone("reports", NODE, record.token, None, {"weekly": "cron[day_of_week='mon']"})
    done = SimpleNamespace(state="failed", last_error=f"{PAUSED}x", owner="n1", due=DUE)  # ends the wait at once
    requests = Requests(done)
    trigger(url, "weekly", monkeypatch=monkeypatch, requests=requests)
    assert requests.added and requests.added[0][1] == "weekly" and requests.added[0][3]["lock"] == "reports"
    assert requests.added[0][3]["deadline"] == 60.0, "--timeout 30 + 30: an orphan request ends (issue 32, C2)"
    typo = trigger(url, "weekyl", monkeypatch=monkeypatch, requests=Requests())
    assert typo.exit_code == 2 and "Did you mean 'weekly'?" in typo.output


def test_a_failed_earlier_request_never_answers_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32, C2: a failed catch-up request of the job (its lock was paused then) was kept by the new
    request's add, and every later `mutexcron trigger` answered with that old failure."""
    url = seeded()
    old = SimpleNamespace(state="failed", last_error=f"{PAUSED}lock 'reports' is paused", owner="n1", due=DUE)
    tasks: dict[str, Any] = {"report": old}

    def add(_code: str, key: str, *_a: Any, **_k: Any) -> str:
        if key in tasks:
            return "kept"
        tasks[key] = SimpleNamespace(state="pending", last_error=None, owner=None, due=DUE)
        return "added"

    def get(_code: str, key: str) -> Any:
        task = tasks.get(key)
        if task is not None and task is not old:
            del tasks[key]  # the holder ran the new request at once
        return task

    store = SimpleNamespace(add=add, get=get, cancel=lambda _c, key: tasks.pop(key, None) is not None,
                            close=lambda: None, masked_url=url)  # fmt: skip
    monkeypatch.setattr("mutexcron.cli.trigger.task_store_from_url", lambda _url: store)
    result = CliRunner().invoke(main, ["trigger", "report", "--lock-url", url])
    assert result.exit_code == 0 and "success" in result.output, result.output
