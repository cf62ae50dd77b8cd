"""The task worker (mutexcron/tasks/worker.py): handlers, outcomes, retries, leases, fencing, stop.

Worker-level tests run on the memory store with two injected clocks: the store's (due times,
leases) and the worker's monotonic one (its own deadlines), so a lease runs out without sleeping.
Scheduler-level tests run real schedulers on one SQLite file.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from mutexcron import MutexScheduler
from mutexcron.errors import ConfigurationError
from mutexcron.tasks import TaskRecord, TaskStore
from mutexcron.tasks.handlers import Handler, Task
from mutexcron.tasks.stores.memory import MemoryTaskStore
from mutexcron.tasks.wakeups.base import DEFAULT_POLL, PollWaker, Waker
from mutexcron.tasks.worker import TaskWorker
from tests.backends import FakeClock

NOW = timedelta(seconds=-1)  # already due by the store's clock
NODE, OTHER = "node-a:1:aaaa", "node-b:2:bbbb"


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


class Harness:
    """A memory task store with a fake store clock, and workers with a fake monotonic clock."""

    def __init__(self, name: str) -> None:
        self.store_clock = FakeClock()
        self.node_clock = FakeClock()
        self.store = MemoryTaskStore(f"memory://{name}", clock=self.store_clock)
        self.workers: list[TaskWorker] = []

    def worker(self, *handlers: Handler, store: TaskStore | None = None, **options: Any) -> TaskWorker:
        worker = TaskWorker(
            store or self.store, {h.code: h for h in handlers}, NODE, clock=self.node_clock, backstop=0.05, **options
        )
        self.workers.append(worker)
        worker.start()
        return worker

    def pass_time(self, seconds: float) -> None:
        """Both clocks move: the store's lease and the node's deadline run out together."""
        self.store_clock.advance(seconds)
        self.node_clock.advance(seconds)


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = Harness(f"worker-{request.node.name}")
    yield h
    for worker in h.workers:
        worker.stop(2)
    h.store.close()


# -- outcomes --------------------------------------------------------------------------------------
def test_none_means_done_and_the_task_is_gone(harness: Harness) -> None:
    ran: list[Task] = []
    harness.store.add("c", "k", NOW, {"n": 1})
    worker = harness.worker(Handler("c", ran.append))
    assert wait_for(lambda: worker.stats.done == 1)
    assert harness.store.get("c", "k") is None
    [task] = ran
    assert (task.code, task.key, task.payload, task.attempt, task.token) == ("c", "k", {"n": 1}, 1, 1)
    assert task.idempotency_key.startswith("c:k:") and not task.lost


@pytest.mark.parametrize("relative", [True, False], ids=["timedelta", "aware-datetime"])
def test_returning_a_time_runs_the_task_again_then(harness: Harness, relative: bool) -> None:
    runs: list[int] = []

    def again(task: Task) -> Any:
        runs.append(task.attempt)
        later = timedelta(hours=1)
        return later if relative else harness.store.now() + later

    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", again))
    assert wait_for(lambda: worker.stats.rescheduled == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "queued" and task.attempt == 0
    assert abs((task.due - harness.store.now()).total_seconds() - 3600) < 5
    assert runs == [1]


@pytest.mark.parametrize(
    ("result", "words"),
    [
        (datetime(2030, 1, 1), "naive datetime"),
        (42, "returned int 42"),
        ("tomorrow", "returned str 'tomorrow'"),
    ],
    ids=["naive", "int", "str"],
)
def test_a_bad_return_value_fails_the_task_with_the_fix(harness: Harness, result: Any, words: str) -> None:
    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", lambda task: result))
    assert wait_for(lambda: worker.stats.failed == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "failed"
    assert task.last_error is not None and words in task.last_error and "return None" in task.last_error


def test_a_bad_return_value_is_logged_like_a_raising_handler(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25 item 10: the task failed with no log line at all (a raising handler logs an ERROR)."""
    caplog.set_level("INFO", logger="mutexcron")
    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", lambda task: 42))
    assert wait_for(lambda: worker.stats.failed == 1)
    [line] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert line.getMessage().startswith("task c/k attempt 1 failed: handler ") and "returned int 42" in line.getMessage()


def test_a_handler_reschedules_itself_with_a_new_payload(harness: Harness) -> None:
    """Issue 25 item 14: `return Reschedule(due, payload=...)`, one return value (before: an add
    inside the handler, then `return None`)."""
    from mutexcron import Reschedule

    seen: list[Any] = []

    def page(task: Task) -> Any:
        seen.append(task.payload["cursor"])
        if task.payload["cursor"] >= 3:
            return None
        return Reschedule(timedelta(0), payload={"cursor": task.payload["cursor"] + 1})

    harness.store.add("c", "k", NOW, {"cursor": 1})
    worker = harness.worker(Handler("c", page))
    assert wait_for(lambda: worker.stats.done == 1)
    assert seen == [1, 2, 3] and worker.stats.rescheduled == 2 and harness.store.get("c", "k") is None


def test_a_reschedule_with_a_payload_that_is_not_json_fails_the_task_saying_so(harness: Harness) -> None:
    from mutexcron import Reschedule

    harness.store.add("c", "k", NOW, {"cursor": 1})
    worker = harness.worker(Handler("c", lambda task: Reschedule(timedelta(hours=1), payload={"at": datetime(2030, 1, 1)})))
    assert wait_for(lambda: worker.stats.failed == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "failed" and task.payload == {"cursor": 1}
    assert task.last_error is not None and "payload of task 'c'/'k'" in task.last_error and "'at'" in task.last_error


def test_a_coroutine_handler_runs_to_completion(harness: Harness) -> None:
    seen: list[str] = []

    async def handle(task: Task) -> None:
        seen.append(task.key)

    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", handle))
    assert wait_for(lambda: worker.stats.done == 1) and seen == ["k"]


# -- retries ---------------------------------------------------------------------------------------
def test_exceptions_are_retried_with_backoff_then_kept_as_failed_and_retryable(harness: Harness) -> None:
    attempts: list[int] = []

    def boom(task: Task) -> None:
        attempts.append(task.attempt)
        raise ValueError(f"boom {task.attempt}")

    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", boom, max_attempts=3, backoff=10, jitter=0))
    assert wait_for(lambda: worker.stats.retried == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "queued" and task.attempt == 1
    assert task.last_error is not None and "ValueError: boom 1" in task.last_error and "test_task_worker.py" in task.last_error
    assert task.run_at is not None and abs((task.run_at - harness.store.now()).total_seconds() - 10) < 1  # by the store's clock
    first_key = task.idempotency_key
    harness.pass_time(10.5)
    worker.notify()
    assert wait_for(lambda: worker.stats.retried == 2)
    task = harness.store.get("c", "k")
    assert task is not None and task.run_at is not None
    assert abs((task.run_at - harness.store.now()).total_seconds() - 20) < 1  # doubled
    assert task.idempotency_key == first_key  # one occurrence: the same key for every attempt
    harness.pass_time(20.5)
    worker.notify()
    assert wait_for(lambda: worker.stats.failed == 1)
    failed = harness.store.get("c", "k")
    assert failed is not None and failed.state == "failed" and failed.attempt == 3
    assert failed.last_error is not None and failed.last_error.startswith("attempt 3 of 3: ValueError: boom 3")
    assert attempts == [1, 2, 3]
    assert harness.store.retry("c", "k")  # kept, queryable, retryable: nothing silently deleted
    worker.notify()
    assert wait_for(lambda: attempts == [1, 2, 3, 1])


def test_retry_delays_grow_exponentially_with_bounded_jitter() -> None:
    handler = Handler("c", print, backoff=2, backoff_max=30, jitter=0.5)
    assert [handler.retry_delay(n, rng=lambda: 0.0) for n in (1, 2, 3, 4, 5, 6)] == [2, 4, 8, 16, 30, 30]
    assert [handler.retry_delay(n, rng=lambda: 1.0) for n in (1, 2, 5)] == [1, 2, 15]


def test_a_task_claimed_beyond_max_attempts_fails_without_running(harness: Harness) -> None:
    """Its earlier workers died mid-run (each rescue counted an attempt): it is not run again."""
    harness.store.add("c", "k", NOW)
    for _ in range(2):  # two workers that died running it
        [task] = harness.store.claim(OTHER, ["c"], 1, 5)
        harness.store.start(OTHER, [("c", "k", task.token)])
        harness.pass_time(6)
    ran: list[Task] = []
    worker = harness.worker(Handler("c", ran.append, max_attempts=2))
    assert wait_for(lambda: worker.stats.failed == 1)
    task = harness.store.get("c", "k")
    assert task is not None and task.state == "failed" and "beyond max_attempts=2" in (task.last_error or "")
    assert ran == []


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"lease": 0}, "lease=0"),
        ({"max_attempts": 0}, "max_attempts=0"),
        ({"backoff": -1}, "backoff=-1"),
        ({"jitter": 2}, "jitter=2"),
        ({"poll": 0}, "poll=0"),
    ],
)
def test_bad_handler_settings_are_refused(options: dict[str, Any], words: str) -> None:
    sched = MutexScheduler(lock_url="memory://")
    with pytest.raises(ConfigurationError, match=words):
        sched.tasks.handler("c", **options)(print)


def test_one_handler_per_code() -> None:
    sched = MutexScheduler(lock_url="memory://")
    sched.tasks.handler("c")(print)
    with pytest.raises(ConfigurationError, match="already has a handler"):
        sched.tasks.handler("c")(repr)
    with pytest.raises(ConfigurationError, match="task code"):
        sched.tasks.handler("")(print)


# -- leases and fencing ------------------------------------------------------------------------------
def test_a_stale_worker_is_told_lost_and_its_completion_is_refused(harness: Harness) -> None:
    release = threading.Event()
    seen: list[Task] = []

    def slow(task: Task) -> None:
        seen.append(task)
        release.wait(10)

    harness.store.add("c", "k", NOW, {"v": 1})
    worker = harness.worker(Handler("c", slow, lease=3))
    # The handler started and its started mark is written (batched): the rescue counts the attempt.
    assert wait_for(lambda: bool(seen) and worker.completions.marked == 1)
    harness.pass_time(4)  # the node froze past its lease: no renewal ran
    [taken] = harness.store.claim(OTHER, ["c"], 1, 30)  # another node rescues the task
    assert taken.token == 2 and taken.attempt == 2
    assert seen[0].lost  # by this node's own clock, before any store call
    worker.renew_round()
    assert worker.stats.lost == 1
    release.set()
    assert wait_for(lambda: worker.stats.refused == 1)
    task = harness.store.get("c", "k")
    assert task is not None and (task.state, task.owner, task.token) == ("running", OTHER, 2)  # the new attempt's
    assert worker.stats.done == 0


def test_a_long_handler_keeps_its_lease_through_renewals(harness: Harness) -> None:
    release = threading.Event()
    seen: list[Task] = []
    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", lambda t: (seen.append(t), release.wait(10))[-1] and None, lease=3))
    assert wait_for(lambda: bool(seen))
    for _ in range(6):  # 6 s of a 3 s lease, renewed every second
        harness.pass_time(1)
        worker.renew_round()
        assert harness.store.claim(OTHER, ["c"], 1, 30) == []
    assert not seen[0].lost
    release.set()
    assert wait_for(lambda: worker.stats.done == 1)
    assert worker.stats.lost == 0 and worker.stats.refused == 0


# -- claiming ahead ---------------------------------------------------------------------------------
class Blocking:
    """A handler that records (key, token) at its first line, then waits until ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.started: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, task: Task) -> None:
        with self.lock:
            self.started.append((task.key, task.token))
        self.go.wait(10)


def _running_tokens(store: TaskStore) -> dict[str, int]:
    return {t.key: t.token for t in store.list(state="running") if t.owner == NODE}


def test_a_node_claims_ahead_and_hands_back_what_waits_a_third_of_its_lease(harness: Harness) -> None:
    handler = Blocking()
    for i in range(4):
        harness.store.add("c", f"k{i}", NOW)
    worker = harness.worker(Handler("c", handler, lease=9), concurrency=2, claim_ahead=2)
    assert wait_for(lambda: len(handler.started) == 2)
    first = _running_tokens(harness.store)
    assert len(first) == 4  # 2 running + 2 claimed ahead, waiting under their lease for a thread
    waiting = sorted(set(first) - {key for key, _ in handler.started})
    harness.pass_time(3.1)  # a third of the lease gone: the waiting ones are handed back, not renewed
    worker.renew_round()
    assert worker.stats.released == 2
    handler.go.set()
    assert wait_for(lambda: worker.stats.done == 4)
    handed_back = {(key, first[key]) for key in waiting}
    assert not handed_back & set(handler.started)  # never started on the claim it handed back
    assert {key for key, _ in handler.started} == {f"k{i}" for i in range(4)} and len(handler.started) == 4
    assert worker.stats.expired_before_start == 0 and worker.stats.refused == 0


def test_a_task_claimed_ahead_never_starts_after_its_lease_ran_out_while_it_waited(harness: Harness) -> None:
    handler = Blocking()
    for i in range(2):
        harness.store.add("c", f"k{i}", NOW)
    worker = harness.worker(Handler("c", handler, lease=6), concurrency=1, claim_ahead=1)
    assert wait_for(lambda: len(handler.started) == 1)
    first = _running_tokens(harness.store)
    assert len(first) == 2  # one running, one claimed ahead
    [(running_key, _)] = handler.started
    [waiting_key] = set(first) - {running_key}
    harness.pass_time(7)  # the node froze past the whole lease: no hand-back, no renewal ran meanwhile
    handler.go.set()  # the thread frees: the waiting claim's lease is over by the node's clock
    assert wait_for(lambda: worker.stats.done + worker.stats.refused == 2)
    assert (waiting_key, first[waiting_key]) not in handler.started  # never run on the expired claim
    assert worker.stats.released + worker.stats.expired_before_start >= 1
    assert [key for key, _ in handler.started].count(waiting_key) == 1  # run once, on a fresh claim


def test_claim_ahead_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryTaskStore("memory://claim-ahead-env")
    monkeypatch.setenv("MUTEXCRON_TASK_CLAIM_AHEAD", "5")
    assert TaskWorker(store, {}, NODE).claim_ahead == 5
    assert TaskWorker(store, {}, NODE, claim_ahead=0).claim_ahead == 0
    monkeypatch.setenv("MUTEXCRON_TASK_CLAIM_AHEAD", "many")
    with pytest.raises(ConfigurationError):
        TaskWorker(store, {}, NODE)
    store.close()


class SlowReplies(MemoryTaskStore):
    """A memory store whose claim replies arrive late: after ``delay`` of the node's clock."""

    def __init__(self, base: MemoryTaskStore, node_clock: FakeClock, delay: float) -> None:
        super().__init__(base.backend)
        self.node_clock, self.delay = node_clock, delay
        self.replied = threading.Event()
        self.hold = threading.Event()
        self.hold.set()

    def claim(self, node: str, codes: Iterable[str], limit: int, lease: float) -> list[TaskRecord]:
        tasks = super().claim(node, codes, limit, lease)
        if tasks:
            self.node_clock.advance(self.delay)
            self.replied.set()
            self.hold.wait(10)
        return tasks


def test_a_claim_whose_reply_comes_after_its_lease_is_never_run(harness: Harness) -> None:
    ran: list[Task] = []
    slow = SlowReplies(harness.store, harness.node_clock, delay=5)
    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", ran.append, lease=3), store=slow)
    assert wait_for(lambda: worker.stats.expired_before_start == 1)
    time.sleep(0.1)
    assert ran == [] and worker.stats.done == 0


def test_stop_hands_back_a_claim_that_arrives_while_stopping(harness: Harness) -> None:
    ran: list[Task] = []
    slow = SlowReplies(harness.store, harness.node_clock, delay=0)
    slow.hold.clear()
    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", ran.append, lease=30), store=slow)
    assert slow.replied.wait(5)
    stopper = threading.Thread(target=worker.stop, args=(5,))
    stopper.start()
    assert wait_for(lambda: worker.stopping)
    slow.hold.set()  # the claim's reply lands after the stop began
    stopper.join(10)
    assert ran == [] and worker.stats.released == 1
    task = harness.store.get("c", "k")
    assert task is not None and (task.state, task.attempt, task.token) == ("queued", 0, 2)  # at once, token + 1
    assert harness.store.claim(OTHER, ["c"], 1, 30)[0].token == 3


def test_stop_lets_running_handlers_finish(harness: Harness) -> None:
    started, release = threading.Event(), threading.Event()

    def handle(task: Task) -> None:
        started.set()
        release.wait(10)

    harness.store.add("c", "k", NOW)
    worker = harness.worker(Handler("c", handle))
    assert started.wait(5)
    threading.Timer(0.3, release.set).start()
    began = time.monotonic()
    worker.stop(5)
    assert 0.2 < time.monotonic() - began < 4
    assert worker.stats.done == 1 and harness.store.get("c", "k") is None


class QuietStore(MemoryTaskStore):
    """A memory store without store notices or a useful poll: only an in-process wake-up helps."""

    def waker(self, codes: Iterable[str], poll: float | None = None) -> Waker:
        return PollWaker(interval=60)


def test_an_add_in_this_process_wakes_the_worker_at_once(tmp_path: Path) -> None:
    sched = MutexScheduler(lock_url="memory://wake-local")
    seen: list[float] = []
    sched.tasks.handler("c")(lambda task: seen.append(time.monotonic()))
    sched.tasks._store = QuietStore("memory://wake-local")  # the scheduler's pool, without notices
    sched.start()
    try:
        assert sched._tasks.worker is not None
        sched._tasks.worker.backstop = 60
        time.sleep(0.3)  # the worker sleeps: nothing is due
        added = time.monotonic()
        sched.tasks.add("c", "k", NOW)
        assert wait_for(lambda: bool(seen), timeout=5)
        assert seen[0] - added < 1.0
    finally:
        sched.shutdown()


@pytest.mark.parametrize("own_handler", [False, True])
def test_a_node_serving_only_triggers_looks_once_a_second_and_with_a_handler_as_often_as_the_store_allows(
    tmp_path: Path, own_handler: bool
) -> None:
    """Every node with guarded jobs serves `mutexcron trigger`: on SQLite (and the stores without
    notices) that alone must not cost a look at the store every 25 ms; a delayed-task handler of the
    user's keeps the store's own cadence."""
    from mutexcron.guard.triggers import TRIGGER_POLL
    from mutexcron.tasks.wakeups.sqlite import VERSION_POLL, SQLiteWaker

    sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/poll.db")
    sched.add_job(print, "interval", hours=1, id="job", mutex="lock")
    if own_handler:
        sched.tasks.handler("c")(print)
    sched.start(paused=True)
    try:
        worker = sched._tasks.worker
        assert worker is not None and isinstance(worker._waker, SQLiteWaker)
        assert worker._waker.version_poll == (VERSION_POLL if own_handler else TRIGGER_POLL)
    finally:
        sched.shutdown()


@pytest.mark.parametrize(
    ("polls", "looks_every"),
    [
        ((None,), DEFAULT_POLL),
        ((1.0,), 1.0),
        ((1.0, None), DEFAULT_POLL),  # the handler without poll= keeps the store's cadence
        ((0.05, None), 0.05),  # and one that asks for more looks gets them
        ((2.0, 0.5), 0.5),
    ],
)
def test_a_worker_looks_as_often_as_its_most_eager_handler_asks(
    harness: Harness, polls: tuple[float | None, ...], looks_every: float
) -> None:
    handlers = [Handler(f"c{i}", print, poll=poll) for i, poll in enumerate(polls)]
    worker = harness.worker(*handlers)
    assert worker.poll == looks_every
    assert isinstance(worker._waker, PollWaker) and worker._waker.interval == looks_every


# -- schedulers on one SQLite file -------------------------------------------------------------------
def _node(url: str, ran: list[tuple[str, int]], lock: threading.Lock, lease: float = 30.0, sleep: float = 0.0) -> MutexScheduler:
    sched = MutexScheduler(lock_url=url, task_concurrency=4)

    @sched.tasks.handler("job", lease=lease)
    def handle(task: Task) -> None:
        if sleep:
            time.sleep(sleep)
        with lock:
            ran.append((task.key, task.token))
        assert not task.lost

    return sched


def test_two_schedulers_run_each_task_exactly_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/tasks.db"
    ran: list[tuple[str, int]] = []
    lock = threading.Lock()
    nodes = [_node(url, ran, lock), _node(url, ran, lock)]
    for node in nodes:
        node.start()
    try:
        for i in range(300):
            nodes[i % 2].tasks.add("job", f"k{i}", timedelta(milliseconds=i))
        assert wait_for(lambda: len(ran) >= 300, timeout=30)
        time.sleep(0.3)
    finally:
        for node in nodes:
            node.shutdown()
    assert sorted(k for k, _ in ran) == sorted(f"k{i}" for i in range(300))
    assert all(token == 1 for _, token in ran)  # never rescued, never run twice


def test_a_handler_longer_than_its_lease_is_renewed_and_runs_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/tasks.db"
    ran: list[tuple[str, int]] = []
    lock = threading.Lock()
    nodes = [_node(url, ran, lock, lease=1.0, sleep=2.5), _node(url, ran, lock, lease=1.0, sleep=2.5)]
    for node in nodes:
        node.start()
    try:
        nodes[0].tasks.add("job", "long", NOW)
        assert wait_for(lambda: len(ran) >= 1, timeout=10)
        time.sleep(1.5)  # a second run would have started by now if the lease had lapsed
    finally:
        for node in nodes:
            node.shutdown()
    assert ran == [("long", 1)]
