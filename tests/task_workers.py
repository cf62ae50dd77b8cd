"""The task store race of tests/test_task_store.py.

What each racer runs (importable by a spawned interpreter), and how the test seeds the tasks and
starts the racers.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from datetime import timedelta
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


# -- run by the test process ---------------------------------------------------------------------
def seed_due(kind: str, store: Any, code: str, total: int, prefix: str = "k", minutes: float = -1) -> None:
    """``total`` tasks of ``code`` due ``minutes`` from the store's now, written in one transaction
    (one add per task would time the adds, not the race). The memory store gets plain adds."""
    if kind in ("memory", "redis", "redis-cluster"):  # a Redis add is one script: 10,000 take about a second
        for i in range(total):
            store.add(code, f"{prefix}{i:05d}", timedelta(minutes=minutes))
        return
    import sqlalchemy

    due = store.now() + timedelta(minutes=minutes)
    value: Any = {"sqlite": due.replace(tzinfo=None).isoformat(sep=" "), "mysql": due.replace(tzinfo=None)}.get(kind, due)
    rows = [{"code": code, "key": f"{prefix}{i:05d}", "due": value} for i in range(total)]
    sql = sqlalchemy.text(
        f"INSERT INTO {store.table} (code, task_key, due, run_at, payload, state, attempt, token, cancel_requested, "
        "created, updated) VALUES (:code, :key, :due, :due, 'null', 'queued', 0, 0, 0, :due, :due)"
    )
    with store.backend.engine.connect() as conn:
        conn.exec_driver_sql("BEGIN")
        conn.execute(sql, rows)
        conn.exec_driver_sql("COMMIT")


def race_threads(stores: list[TaskStore], nodes: list[str]) -> list[list[Any]]:
    """The race on an in-process store: one thread per racer, each with its own store client."""
    barrier = threading.Barrier(len(nodes))
    got: dict[int, list[Any]] = {}

    def run(i: int) -> None:
        got[i] = claim_until_empty(stores[i], nodes[i], "race", 20, 3600, barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [got[i] for i in range(len(nodes))]


def race_processes(url: str, nodes: list[str]) -> list[list[Any]]:
    """The race on a server: one spawned process per racer, started together behind a barrier."""
    mp = multiprocessing.get_context("spawn")
    barrier, results = mp.Barrier(len(nodes)), mp.Queue()
    procs = [
        mp.Process(target=claim_race_process, args=(url, node, "race", 20, 3600, barrier, results, i))
        for i, node in enumerate(nodes)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failed = [o["error"] for o in got.values() if "error" in o]
    assert not failed, failed
    return [got[i]["claimed"] for i in range(len(nodes))]
