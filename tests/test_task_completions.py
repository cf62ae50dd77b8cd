"""Task completions batched on a thread of their own (mutexcron/tasks/completions.py), on the memory store (and SQLite)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mutexcron.errors import ConfigurationError, StoreUnavailableError
from mutexcron.tasks import Done, Fail, Outcome
from mutexcron.tasks.completions import Completion, CompletionQueue
from mutexcron.tasks.stores.memory import MemoryTaskStore

NODE = "node-a:1:aaaa"


class SlowStore(MemoryTaskStore):
    """Each store call takes ``delay`` seconds, so completions pile up behind one in flight."""

    delay = 0.05
    fail = False
    batches: list[int]

    def complete_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> list[bool]:
        self.batches.append(len(completions))
        time.sleep(self.delay)
        if self.fail:
            raise StoreUnavailableError("store down")
        return super().complete_many(node, completions)


@pytest.fixture
def store(request: pytest.FixtureRequest) -> SlowStore:
    s = SlowStore(f"memory://batch-{request.node.name}")
    s.batches = []
    return s


def _claim_all(store: SlowStore, n: int) -> list[tuple[str, int]]:
    for i in range(n):
        store.add("c", f"k{i}", timedelta(seconds=-1))
    return [(t.key, t.token) for t in store.claim(NODE, ["c"], n, 60)]


class Results:
    """What the queue settled, per key; ``wait`` until ``n`` are in."""

    def __init__(self) -> None:
        self.by_key: dict[str, bool | BaseException] = {}
        self.cond = threading.Condition()

    def __call__(self, item: Completion, result: bool | BaseException) -> None:
        with self.cond:
            self.by_key[item.key] = result
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> dict[str, bool | BaseException]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.by_key) >= n, timeout), self.by_key
            return dict(self.by_key)


def _queue(store: SlowStore, results: Results, linger: Callable[[], bool] = lambda: False, **options: Any) -> CompletionQueue:
    queue = CompletionQueue(store, NODE, results, linger=linger, **options)
    queue.start()
    return queue


def test_completions_that_arrive_together_share_a_store_call_and_a_stale_one_is_refused_alone(store: SlowStore) -> None:
    claimed = _claim_all(store, 40)
    results = Results()
    queue = _queue(store, results)
    for key, token in claimed:  # k7: a stale worker's completion (its token was taken over)
        queue.submit(Completion("c", key, token if key != "k7" else token - 1, Done(), give_up=60))
    got = results.wait(40)
    queue.close()
    assert got.pop("k7") is False and all(r is True for r in got.values())
    assert sum(store.batches) == 40 and len(store.batches) < 40  # batched while a call was in flight
    assert queue.calls == len(store.batches) and queue.completed == 40
    assert [t.key for t in store.list()] == ["k7"]  # only the refused one is left, still running


def test_a_lone_completion_goes_at_once_when_no_handler_runs(store: SlowStore) -> None:
    [(key, token)] = _claim_all(store, 1)
    results = Results()
    queue = _queue(store, results, linger=lambda: False, max_delay=30)
    queue.submit(Completion("c", key, token, Done(), give_up=60))
    assert results.wait(1, timeout=10) == {key: True}  # not held back for the 30 s a batch may wait
    queue.close()
    assert store.batches == [1] and queue.delay_max < 10


def test_while_handlers_run_a_completion_waits_for_company_at_most_max_delay(store: SlowStore) -> None:
    claimed = _claim_all(store, 3)
    results = Results()
    queue = _queue(store, results, linger=lambda: True, max_delay=0.3)
    queue.submit(Completion("c", claimed[0][0], claimed[0][1], Done(), give_up=60))
    time.sleep(0.05)
    for key, token in claimed[1:]:  # arrive within the first one's wait: the same batch
        queue.submit(Completion("c", key, token, Done(), give_up=60))
    assert set(results.wait(3).values()) == {True}
    queue.close()
    assert store.batches == [3]
    assert 0.25 <= queue.delay_max < 10  # it did wait (lingered), and the wait ended by itself


def test_a_batch_is_tried_again_while_the_store_is_briefly_down_then_given_up_after_give_up(store: SlowStore) -> None:
    claimed = _claim_all(store, 4)
    store.fail = True
    results = Results()
    queue = _queue(store, results)
    for key, token in claimed[:2]:
        queue.submit(Completion("c", key, token, Done(), give_up=0.1))  # gives up after one try
    got = results.wait(2)
    assert all(isinstance(r, StoreUnavailableError) for r in got.values())
    for key, token in claimed[2:]:
        queue.submit(Completion("c", key, token, Done(), give_up=60))
    time.sleep(0.3)
    store.fail = False  # back: the queued ones go through
    got = results.wait(4)
    queue.close()
    assert [got[k] for k, _ in claimed[2:]] == [True, True]


def test_a_completion_the_store_refuses_as_bad_input_does_not_take_its_batch_down(store: SlowStore) -> None:
    claimed = _claim_all(store, 3)
    results = Results()
    queue = _queue(store, results, linger=lambda: True, max_delay=0.2)
    queue.submit(Completion("c", claimed[0][0], claimed[0][1], Done(), give_up=60))
    queue.submit(Completion("c", claimed[1][0], claimed[1][1], "done", give_up=60))  # type: ignore[arg-type]
    queue.submit(Completion("c", claimed[2][0], claimed[2][1], Done(), give_up=60))
    got = results.wait(3)
    queue.close()
    assert got[claimed[0][0]] is True and got[claimed[2][0]] is True
    assert isinstance(got[claimed[1][0]], ConfigurationError)


@pytest.mark.sqlite
def test_an_outage_between_a_batchs_two_writes_never_counts_its_recorded_completions_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Done items of a batch end in one statement, the others after it: an outage in between
    left the first recorded and the retried batch reported them refused (their fence was gone)."""
    from mutexcron.tasks import task_store_from_url
    from mutexcron.tasks.stores.sql import SQLTaskStore

    sql: Any = task_store_from_url(f"sqlite:///{tmp_path}/tasks.db")
    for i in range(3):
        sql.add("c", f"k{i}", timedelta(seconds=-1))
    claimed = {t.key: t.token for t in sql.claim(NODE, ["c"], 3, 60)}
    real, down = SQLTaskStore._complete_each, [True]

    def complete_each(self: Any, node: str, items: Any) -> Any:
        if down:
            down.pop()
            raise StoreUnavailableError("store down between the two writes")
        return real(self, node, items)

    monkeypatch.setattr(SQLTaskStore, "_complete_each", complete_each)
    results = Results()
    queue = CompletionQueue(sql, NODE, results, linger=lambda: True, max_delay=0.2)
    queue.start()
    try:
        queue.submit(Completion("c", "k0", claimed["k0"], Done(), give_up=60))
        queue.submit(Completion("c", "k1", claimed["k1"], Done(), give_up=60))
        queue.submit(Completion("c", "k2", claimed["k2"], Fail("boom"), give_up=60))
        got = results.wait(3)
    finally:
        queue.close()
        sql.close()
    assert got == {"k0": True, "k1": True, "k2": True}, "recorded before the outage: done, not refused"
