"""Group commit of task completions (mutexcron/tasks/completions.py) on the memory store."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import pytest

from mutexcron.errors import StoreUnavailableError
from mutexcron.tasks import Done, Outcome
from mutexcron.tasks.completions import CompletionBatcher
from mutexcron.tasks.memory import MemoryTaskStore

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


def test_completions_that_arrive_together_share_store_calls_and_each_gets_its_result(store: SlowStore) -> None:
    claimed = _claim_all(store, 40)
    batcher = CompletionBatcher(store, NODE)
    results: dict[str, bool] = {}

    def finish(key: str, token: int) -> None:
        results[key] = batcher.complete("c", key, token if key != "k7" else token + 5, Done())  # k7: a stale token

    threads = [threading.Thread(target=finish, args=item) for item in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 40 and results.pop("k7") is False and all(results.values())
    assert sum(store.batches) == 40 and len(store.batches) < 40  # batched while a call was in flight
    assert [t.key for t in store.list()] == ["k7"]  # only the refused one is left, still running


def test_a_lone_completion_goes_at_once(store: SlowStore) -> None:
    [(key, token)] = _claim_all(store, 1)
    began = time.monotonic()
    assert CompletionBatcher(store, NODE).complete("c", key, token, Done())
    assert time.monotonic() - began < store.delay + 0.5 and store.batches == [1]


def test_a_store_error_reaches_every_waiter(store: SlowStore) -> None:
    claimed = _claim_all(store, 10)
    store.fail = True
    batcher = CompletionBatcher(store, NODE)
    errors: list[BaseException] = []

    def finish(key: str, token: int) -> None:
        try:
            batcher.complete("c", key, token, Done())
        except StoreUnavailableError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=finish, args=item) for item in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 10 and not any(t.is_alive() for t in threads)
    store.fail = False
    assert batcher.complete("c", claimed[0][0], claimed[0][1], Done())  # the batcher still works
