"""Functions run in child processes by tests/test_task_store.py (importable by a spawned interpreter)."""

from __future__ import annotations

import time
from typing import Any

from mutexcron.tasks import TaskStore, task_store_from_url


def claim_until_empty(store: TaskStore, node: str, code: str, batch: int, lease: float, barrier: Any) -> list[list[Any]]:
    """Claim batches of ``code`` until three claims in a row come back empty; return ``[key, token, attempt]`` per task.

    An empty claim can also mean that every remaining task is locked by another racer's claim in
    flight (SKIP LOCKED): those are being claimed, so stopping is safe once claims stay empty.
    """
    got: list[list[Any]] = []
    empty = 0
    barrier.wait(timeout=60)
    while empty < 3:
        tasks = store.claim(node, [code], batch, lease)
        if not tasks:
            empty += 1
            time.sleep(0.01)
            continue
        empty = 0
        got.extend([t.key, t.token, t.attempt] for t in tasks if t.owner == node)
    return got


def claim_race_process(url: str, node: str, code: str, batch: int, lease: float, barrier: Any, results: Any, index: int) -> None:
    """One racing process: its claims go back through ``results`` as ``(index, outcome)``."""
    try:
        store = task_store_from_url(url)
        try:
            outcome: dict[str, Any] = {"claimed": claim_until_empty(store, node, code, batch, lease, barrier)}
        finally:
            store.close()
    except BaseException as exc:
        barrier.abort()
        outcome = {"error": repr(exc)}
    results.put((index, outcome))
