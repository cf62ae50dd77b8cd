"""What tasks cost the store: MB per million tasks, queued and as tombstones, and what the token floor costs an add.

    python benchmarks/storage_cost.py --stores sqlite,postgresql,mysql,redis --tasks 100000 --adds 3000

Per store, in a table (namespace) of its own: add ``--tasks`` queued tasks (a 40-byte payload,
keys like ``order-0000123``), measure; claim and complete them all (tombstones on SQL, nothing
left on Redis), measure; purge them, measure. SQL sizes are the table and its indexes as the
server reports them (PostgreSQL ``pg_total_relation_size`` after ``VACUUM``; MySQL/MariaDB
``data_length + index_length`` after ``ANALYZE``; SQLite the file after ``VACUUM`` and a WAL checkpoint); Redis sums
``MEMORY USAGE`` of every key of the namespace. Figures are scaled to one million tasks.

Then, per SQL store, what the token floor costs an add (``--adds``, 0 to skip): ``add`` of new keys
with the floor read in the insert (as shipped) against the same insert starting from token 0 (the
statement before the floor), alternating between two tables (the order swapped every add); p50
and p99 per side and the ratio of the p50s. Redis and the memory store kept a floor before.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from mutexcron.tasks import Done, task_store_from_url
from mutexcron.tasks.stores.sql_statements import STATEMENTS

NODE = "bench:1:cost"


def store_url(kind: str, tag: str, table: str = "mc_cost") -> str:
    if kind == "sqlite":
        return f"sqlite:///{tempfile.mkdtemp(prefix='mc-cost-')}/cost.db?tasks_table={table}_{tag}"
    base = os.environ[f"MUTEXCRON_TEST_{kind.upper()}_URL"]
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}namespace=cost-{tag}" if kind == "redis" else f"{base}{sep}tasks_table={table}_{tag}"


def size_bytes(store: Any, kind: str) -> int:
    backend = getattr(store, "backend", None)
    if kind == "redis":
        client = store.backend.client
        return sum(int(client.memory_usage(key) or 0) for key in client.scan_iter(match=store.backend.key("*"), count=10_000))
    if kind == "sqlite":
        import sqlite3

        path = backend.engine.url.database  # type: ignore[union-attr]
        with sqlite3.connect(path, isolation_level=None) as conn:
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return Path(path).stat().st_size
    with backend.engine.connect() as conn:  # type: ignore[union-attr]
        raw = conn.connection.dbapi_connection
        raw.autocommit = True  # VACUUM refuses a transaction
        cursor = raw.cursor()
        if kind == "postgresql":
            cursor.execute(f"VACUUM {store.table}")
            cursor.execute(f"SELECT pg_total_relation_size('{store.table}')")
        else:
            cursor.execute(f"ANALYZE TABLE {store.table}")
            cursor.fetchall()
            query = "SELECT data_length + index_length FROM information_schema.tables WHERE table_name = %s"
            cursor.execute(query, (store.table,))
        return int(cursor.fetchone()[0])


def measure(kind: str, tasks: int) -> dict[str, float]:
    url = store_url(kind, secrets.token_hex(3))
    store = task_store_from_url(url)
    store.floor_settle = 0.0  # one client: nothing to wait for
    try:
        store.ping()
        empty = size_bytes(store, kind)
        for start in range(0, tasks, 1000):
            store.add_many([("cost", f"order-{i:07d}", timedelta(seconds=-1), {"order": i, "note": "x" * 20})
                            for i in range(start, min(tasks, start + 1000))])  # fmt: skip
        queued = size_bytes(store, kind)
        while claimed := store.claim(NODE, ["cost"], 1000, 60):
            store.complete_many(NODE, [(t.code, t.key, t.token, Done()) for t in claimed])
        finished = size_bytes(store, kind)
        while store.purge_batch(0).ready_in is not None:
            pass
        purged = size_bytes(store, kind)
        per_million = 1_000_000 / tasks / 1_000_000  # bytes per task x 1e6 tasks, in MB
        return {"queued": (queued - empty) * per_million, "tombstones": (finished - empty) * per_million,
                "purged": (purged - empty) * per_million}  # fmt: skip
    finally:
        drop(store, kind)
        store.close()


def measure_adds(kind: str, adds: int) -> dict[str, list[float]]:
    tag = secrets.token_hex(3)
    shipped = task_store_from_url(store_url(kind, tag, "mc_floor"))
    zero = task_store_from_url(store_url(kind, tag, "mc_zero"))
    raw = STATEMENTS[zero.backend.dialect.name]  # type: ignore[attr-defined]
    zero._sql = dataclasses.replace(raw, insert=raw.insert.replace("{floor}", "0")).bind(zero.table)  # type: ignore[attr-defined]
    times: dict[str, list[float]] = {"floor": [], "zero": []}
    try:
        for store in (shipped, zero):
            store.add("warm", "up", timedelta(hours=1))
        for i in range(adds):
            sides = [("floor", shipped), ("zero", zero)]
            for name, store in sides if i % 2 else sides[::-1]:
                started = time.perf_counter()
                store.add("c", f"k{i}", timedelta(hours=1))
                times[name].append(time.perf_counter() - started)
        return times
    finally:
        for store in (shipped, zero):
            drop(store, kind)
            store.close()


def ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000


def drop(store: Any, kind: str) -> None:
    if kind == "redis":
        client = store.backend.client
        keys = list(client.scan_iter(match=store.backend.key("*"), count=10_000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
    elif kind == "sqlite":
        store.close()  # its file's directory goes with it
        shutil.rmtree(Path(store.backend.engine.url.database).parent, ignore_errors=True)
    else:
        store.backend.execute(f"DROP TABLE {store.table}", {}, "drop", write=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="sqlite,postgresql,mysql,redis")
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--adds", type=int, default=3000, help="adds per side for the token floor's cost (0: skip)")
    args = parser.parse_args()
    kinds = args.stores.split(",")
    print("| store | MB per million queued tasks | MB per million tombstones (finished) | MB left after the purge |")
    print("|---|---|---|---|")
    for kind in kinds:
        r = measure(kind, args.tasks)
        print(f"| {kind} | {r['queued']:.0f} | {r['tombstones']:.0f} | {r['purged']:.0f} |", flush=True)
    if not args.adds:
        return
    print("\n| store | add p50 / p99 ms, floor read in the insert | add p50 / p99 ms, from token 0 | p50 ratio |")
    print("|---|---|---|---|")
    for kind in (k for k in kinds if k != "redis"):
        t = measure_adds(kind, args.adds)
        ratio = statistics.median(t["floor"]) / statistics.median(t["zero"])
        floor, zero = (f"{ms(t[side], 0.5):.3f} / {ms(t[side], 0.99):.3f}" for side in ("floor", "zero"))
        print(f"| {kind} | {floor} | {zero} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
