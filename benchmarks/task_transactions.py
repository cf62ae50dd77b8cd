"""What an enqueue inside the application's transaction costs, next to the same insert through ``TaskPool.add``.

    python benchmarks/task_transactions.py [--stores sqlite,mysql,postgresql] [--iterations 500] [--quick]

For each reachable SQL store, in one run and interleaved (so drift hits every variant alike), it
times one application transaction that inserts one business row (an order), three ways:

* ``business only``: the transaction alone (``engine.begin()``, one INSERT, COMMIT): the baseline
  (and the same on the driver's own DB-API connection);
* ``add in tx``: the same transaction plus ``pool.add(..., transaction=conn)``: the task commits with
  the order (the task store's insert on the application's connection, after its checks);
* ``add after commit``: the same transaction, then ``pool.add(...)`` on the pool's own connection
  (autocommit): what an application did before, with a window in which the order exists without
  its task.

and the ``add`` calls alone (``add in tx`` without the COMMIT it shares with the order;
``TaskPool.add`` with its own). Each task is new (a distinct key), as for a new order. The
``in tx`` rows are given for a SQLAlchemy ``Connection`` and for the driver's own DB-API connection.
It prints p50/p99 in microseconds and the ratios. Server URLs: ``MUTEXCRON_TEST_<KIND>_URL`` or
the local defaults; every store gets its own tables (or SQLite file), removed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import sqlalchemy

from mutexcron import TaskPool
from mutexcron.errors import MutexcronError

DEFAULT_URLS = {
    "mysql": "mysql://root@127.0.0.1:3306/test",
    "postgresql": "postgresql://postgres@127.0.0.1:5432/test",
}
DRIVERS = {"sqlite": "sqlite+pysqlite", "mysql": "mysql+pymysql", "postgresql": "postgresql+psycopg"}
DUE = timedelta(minutes=30)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class Bench:
    """One store: a task table and a business table of its own on the same database."""

    def __init__(self, kind: str, workdir: str) -> None:
        tag = secrets.token_hex(3)
        if kind == "sqlite":
            base = app = f"sqlite:///{workdir}/bench-{tag}.db"
        else:
            base = os.environ.get(f"MUTEXCRON_TEST_{kind.upper()}_URL") or DEFAULT_URLS[kind]
            app = str(sqlalchemy.make_url(base).set(drivername=DRIVERS[kind]))
        self.kind = kind
        self.pool = TaskPool(f"{base}{'&' if '?' in base else '?'}tasks_table=bench_tx_{tag}")
        self.pool.store.ping()  # creates the task table
        self.engine = sqlalchemy.create_engine(app)
        self.orders = f"bench_orders_{tag}"
        with self.engine.begin() as conn:
            conn.execute(sqlalchemy.text(f"CREATE TABLE {self.orders} (id BIGINT PRIMARY KEY, amount INTEGER)"))
        self.insert = sqlalchemy.text(f"INSERT INTO {self.orders} (id, amount) VALUES (:id, 1999)")
        self.raw_insert = f"INSERT INTO {self.orders} (id, amount) VALUES ({{id}}, 1999)"
        self.ids = itertools.count(1)
        self.raw = self.engine.raw_connection()  # a DB-API connection kept for the run, as an app's would be

    def business_only(self, timings: dict[str, list[float]]) -> None:
        start = time.perf_counter()
        with self.engine.begin() as conn:
            conn.execute(self.insert, {"id": next(self.ids)})
        timings["business only"].append(time.perf_counter() - start)

    def add_in_tx(self, timings: dict[str, list[float]]) -> None:
        order = next(self.ids)
        start = time.perf_counter()
        with self.engine.begin() as conn:
            conn.execute(self.insert, {"id": order})
            call = time.perf_counter()
            self.pool.add("close", f"o{order}", DUE, {"amount": 1999}, transaction=conn)
            timings["add call, in tx (Connection)"].append(time.perf_counter() - call)
        timings["+ add in tx (Connection)"].append(time.perf_counter() - start)

    def business_only_dbapi(self, timings: dict[str, list[float]]) -> None:
        raw = self.raw.driver_connection
        start = time.perf_counter()
        cur = raw.cursor()
        cur.execute(self.raw_insert.format(id=next(self.ids)))
        cur.close()
        raw.commit()
        timings["business only (DB-API)"].append(time.perf_counter() - start)

    def add_in_tx_dbapi(self, timings: dict[str, list[float]]) -> None:
        order, raw = next(self.ids), self.raw.driver_connection
        start = time.perf_counter()
        cur = raw.cursor()
        cur.execute(self.raw_insert.format(id=order))
        cur.close()
        call = time.perf_counter()
        self.pool.add("close", f"o{order}", DUE, {"amount": 1999}, transaction=raw)
        timings["add call, in tx (DB-API)"].append(time.perf_counter() - call)
        raw.commit()
        timings["+ add in tx (DB-API)"].append(time.perf_counter() - start)

    def add_after_commit(self, timings: dict[str, list[float]]) -> None:
        order = next(self.ids)
        start = time.perf_counter()
        with self.engine.begin() as conn:
            conn.execute(self.insert, {"id": order})
        call = time.perf_counter()
        self.pool.add("close", f"o{order}", DUE, {"amount": 1999})
        end = time.perf_counter()
        timings["add call, TaskPool.add (own connection)"].append(end - call)
        timings["+ add after commit (TaskPool.add)"].append(end - start)

    def close(self) -> None:
        self.raw.close()
        with self.engine.begin() as conn:
            conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {self.orders}"))
            conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {self.pool.store.table}"))  # type: ignore[attr-defined]
        self.engine.dispose()
        self.pool.close()


ROWS = (
    "business only",
    "+ add in tx (Connection)",
    "business only (DB-API)",
    "+ add in tx (DB-API)",
    "+ add after commit (TaskPool.add)",
    "add call, in tx (Connection)",
    "add call, in tx (DB-API)",
    "add call, TaskPool.add (own connection)",
)


def measure(bench: Bench, iterations: int, warmup: int) -> dict[str, list[float]]:
    variants: list[Callable[[dict[str, list[float]]], None]] = [
        bench.business_only,
        bench.add_in_tx,
        bench.business_only_dbapi,
        bench.add_in_tx_dbapi,
        bench.add_after_commit,
    ]
    scratch: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(warmup):
        for variant in variants:
            variant(scratch)
    timings: dict[str, list[float]] = {row: [] for row in ROWS}
    for i in range(iterations):
        for variant in variants[i % len(variants) :] + variants[: i % len(variants)]:  # rotate: no fixed order
            variant(timings)
    return timings


def table(kind: str, timings: dict[str, list[float]]) -> list[str]:
    lines = []
    for row in ROWS:
        samples = timings[row]
        p50, p99 = statistics.median(samples) * 1e6, percentile(samples, 0.99) * 1e6
        extra = ""
        if row.startswith("+"):  # against the business transaction of the same connection kind
            base = statistics.median(timings["business only (DB-API)" if "DB-API" in row else "business only"])
            extra = f"{(statistics.median(samples) - base) * 1e6:,.0f}"
        lines.append(f"| {kind} | {row} | {len(samples)} | {p50:,.0f} | {p99:,.0f} | {extra} |")
    return lines


def summary(kind: str, timings: dict[str, list[float]]) -> str:
    base = statistics.median(timings["business only"])
    in_tx = statistics.median(timings["+ add in tx (Connection)"]) - base
    after = statistics.median(timings["+ add after commit (TaskPool.add)"]) - base
    calls = statistics.median(timings["add call, in tx (Connection)"]) / statistics.median(
        timings["add call, TaskPool.add (own connection)"]
    )
    return (
        f"| {kind} | {in_tx * 1e6:,.0f} | {after * 1e6:,.0f} | {in_tx / after:.2f}x | {calls:.2f}x |"
        if after > 0
        else f"| {kind} | {in_tx * 1e6:,.0f} | {after * 1e6:,.0f} | - | {calls:.2f}x |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,mysql,postgresql", help="comma-separated SQL store kinds")
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="a few iterations: the suite's smoke run")
    args = parser.parse_args()
    iterations, warmup = (20, 3) if args.quick else (args.iterations, 30)
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for kind in args.stores.split(","):
            try:
                bench = Bench(kind, workdir)
            except (MutexcronError, sqlalchemy.exc.SQLAlchemyError) as exc:
                print(f"{kind}: skipped ({exc})", file=sys.stderr)
                continue
            try:
                results[kind] = measure(bench, iterations, warmup)
            finally:
                bench.close()
    print("## One order and its close task: enqueue inside the transaction vs TaskPool.add (microseconds)\n")
    print("| store | variant | n | p50 | p99 | p50 minus business only |")
    print("|---|---|---|---|---|---|")
    for kind, timings in results.items():
        print("\n".join(table(kind, timings)))
    print("\n## Summary: what the enqueue adds to the order's transaction (p50, microseconds)\n")
    print("| store | add in tx | add after commit (TaskPool.add) | in tx / after | add call: in tx / TaskPool.add |")
    print("|---|---|---|---|---|")
    for kind, timings in results.items():
        print(summary(kind, timings))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
