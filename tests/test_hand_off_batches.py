"""A node's hand-offs batched across locks (:class:`mutexcron.guard.handoff.HandOffBatcher`).

Hand-offs that come while a store call is in flight go together in the next call; each item stays
fenced on its own; the hand-offs of one lock keep their order; no hand-off waits for more than the
call in flight; and the waits are measured. A store that blocks on an Event (no sleeps) makes each
batch's make-up deterministic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from mutexcron.errors import StoreUnavailableError
from mutexcron.guard import handoff
from mutexcron.guard.handoff import AttrsHandOff, HandOffBatcher
from mutexcron.locks import HandOff, LockStore, Node, RunInfo, lock_store_from_url
from mutexcron.locks.base import LockStore as BaseStore

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")


class GatedStore:
    """A memory store whose ``hand_off_many`` calls are recorded and, while ``gate`` is clear, wait for it."""

    def __init__(self) -> None:
        self.inner: LockStore = lock_store_from_url("memory://")
        self.calls: list[list[HandOff]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail: BaseException | None = None

    def hand_off_many(self, node: Node, items: Sequence[HandOff]) -> list[bool]:
        self.calls.append(list(items))
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        return self.inner.hand_off_many(node, items)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def held(store: GatedStore, names: Sequence[str]) -> dict[str, int]:
    return {n: store.inner.acquire_or_renew(n, A, 60).token for n in names}


def wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def start(target: Callable[[], Any], results: list[Any]) -> threading.Thread:
    def run() -> None:
        try:
            results.append(target())
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_hand_offs_that_come_during_a_call_go_together_in_the_next_one() -> None:
    store = GatedStore()
    names = [f"lock-{i}" for i in range(20)]
    tokens = held(store, names)
    batcher = HandOffBatcher(store, A)  # type: ignore[arg-type]
    results: list[Any] = []
    first = start(lambda: batcher.hand_off(HandOff(names[0], tokens[names[0]], {"i": 0})), results)
    assert store.entered.wait(30)
    others = [
        start(lambda n=n, i=i: batcher.hand_off(HandOff(n, tokens[n], {"i": i}, RunInfo(0.1, job=n))), results)
        for i, n in enumerate(names[1:], 1)
    ]
    wait_until(lambda: len(batcher._queue) == 19)
    store.gate.set()
    for thread in [first, *others]:
        thread.join(30)
    assert results == [True] * 20
    assert [len(call) for call in store.calls] == [1, 19], "one call in flight, everything else in the next"
    assert all(dict(store.inner.read(n).attrs) == {"i": i} for i, n in enumerate(names))  # type: ignore[union-attr]
    stats = batcher.snapshot()
    assert (stats["calls"], stats["items"]) == (2, 20)
    assert 0 <= stats["p50_wait"] <= stats["p99_wait"] <= stats["max_wait"] < 30


def test_each_item_is_fenced_on_its_own_and_a_store_error_reaches_every_caller_of_its_call() -> None:
    store = GatedStore()
    tokens = held(store, ["mine", "moved"])
    store.inner.release("moved", A, tokens["moved"])
    assert store.inner.acquire_or_renew("moved", B, 60).acquired
    batcher = HandOffBatcher(store, A)  # type: ignore[arg-type]
    store.gate.set()
    assert batcher.hand_off(HandOff("mine", tokens["mine"], {"ok": 1}))
    assert not batcher.hand_off(HandOff("moved", tokens["moved"], {"late": 1})), "the lock moved on: refused"
    store.fail = StoreUnavailableError("store down")
    store.gate.clear()
    store.entered.clear()
    results: list[Any] = []
    threads = [start(lambda: batcher.hand_off(HandOff("mine", tokens["mine"], {"n": 1})), results)]
    assert store.entered.wait(30)
    threads.append(start(lambda: batcher.hand_off(HandOff("mine", tokens["mine"], {"n": 2})), results))
    wait_until(lambda: len(batcher._queue) == 1)
    store.gate.set()
    for thread in threads:
        thread.join(30)
    assert len(results) == 2 and all(isinstance(r, StoreUnavailableError) for r in results)
    store.fail = None
    assert batcher.hand_off(HandOff("mine", tokens["mine"], {"again": 1})), "the next call goes on"


def test_the_hand_offs_of_one_lock_keep_their_order_across_batches() -> None:
    store = GatedStore()
    token = held(store, ["ordered", "other"])["ordered"]
    attrs = AttrsHandOff(store, A, None)  # type: ignore[arg-type]
    attrs.batcher = HandOffBatcher(store, A)  # type: ignore[arg-type]
    record = store.inner.read("ordered")
    assert record is not None
    attrs.remember("ordered", token, record)
    results: list[Any] = []
    threads = [start(lambda: attrs.write("ordered", token, set(), {"step": 1}, RunInfo(0.1), "job"), results)]
    assert store.entered.wait(30)
    threads.append(start(lambda: attrs.write("ordered", token, {"step"}, {"step": 2}, RunInfo(0.1), "job"), results))
    other = store.inner.read("other")
    assert other is not None
    threads.append(start(lambda: attrs.write("other", other.token, set(), {"x": 1}, None, "job"), results))
    wait_until(lambda: len(attrs.batcher._queue) == 1)  # "other" queued; the second of "ordered" waits its turn
    store.gate.set()
    for thread in threads:
        thread.join(30)
    assert results.count(True) == 3
    order = [item.attrs for call in store.calls for item in call if item.lock == "ordered"]
    assert order == [{"step": 1}, {"step": 2}]
    assert dict(store.inner.read("ordered").attrs) == {"step": 2}  # type: ignore[union-attr]
    assert [r.node for r in store.inner.history("ordered", job="job")] == [A.node_id, A.node_id]


def test_a_backlog_larger_than_a_batch_goes_in_several_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "MAX_BATCH", 3)
    store = GatedStore()
    names = [f"n{i}" for i in range(8)]
    tokens = held(store, names)
    batcher = HandOffBatcher(store, A)  # type: ignore[arg-type]
    results: list[Any] = []
    threads = [start(lambda: batcher.hand_off(HandOff(names[0], tokens[names[0]])), results)]
    assert store.entered.wait(30)
    threads += [start(lambda n=n: batcher.hand_off(HandOff(n, tokens[n])), results) for n in names[1:]]
    wait_until(lambda: len(batcher._queue) == 7)
    store.gate.set()
    for thread in threads:
        thread.join(30)
    assert results == [True] * 8
    assert [len(call) for call in store.calls] == [1, 3, 3, 1]


def test_a_store_without_its_own_hand_off_many_writes_each_item() -> None:
    """The interface's fallback, for stores outside mutexcron: one hand_off per item, same answers."""
    inner = lock_store_from_url("memory://")
    token = inner.acquire_or_renew("l", A, 60).token
    items = [HandOff("l", token, {"a": 1}), HandOff("l", token + 1, {"a": 2})]
    assert BaseStore.hand_off_many(inner, A, items) == [True, False]
    assert dict(inner.read("l").attrs) == {"a": 1}  # type: ignore[union-attr]


def test_close_ends_the_sending_thread_after_what_is_queued_and_a_later_hand_off_starts_it_again() -> None:
    store = GatedStore()
    tokens = held(store, ["a", "b"])
    batcher = HandOffBatcher(store, A)  # type: ignore[arg-type]
    results: list[Any] = []
    first = start(lambda: batcher.hand_off(HandOff("a", tokens["a"], {"n": 1})), results)
    assert store.entered.wait(30)
    thread = batcher._thread
    assert thread is not None
    batcher.close()
    second = start(lambda: batcher.hand_off(HandOff("b", tokens["b"], {"n": 2})), results)
    wait_until(lambda: len(batcher._queue) == 1)
    batcher.close()  # queued before this close: still sent
    store.gate.set()
    first.join(30)
    second.join(30)
    thread.join(30)
    assert results == [True, True] and not thread.is_alive() and batcher.idle()
    assert batcher.hand_off(HandOff("a", tokens["a"], {"n": 3})), "a later hand-off starts a new thread"
    assert dict(store.inner.read("a").attrs) == {"n": 3}  # type: ignore[union-attr]
