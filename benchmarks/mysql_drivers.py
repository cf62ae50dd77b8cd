"""PyMySQL against mysqlclient on one MySQL/MariaDB server: client CPU and latency per lock operation.

    python benchmarks/mysql_drivers.py [--iterations 2000] [--connects 200] [--rounds 10]

Two lock stores on one table of the server (``MUTEXCRON_TEST_MYSQL_URL`` or the local default),
one per driver: the store as mutexcron ships it (PyMySQL), and the same store with only
SQLAlchemy's drivername swapped to ``mysql+mysqldb`` (mysqlclient: same connect arguments, session
set-up and error handling), if mysqlclient is installed (``pip install mysqlclient``, which builds
against the MariaDB/MySQL C library: on Debian ``apt-get install libmariadb-dev pkg-config`` and a
C compiler first). In one run, for each driver it times:

* ``SELECT 1`` on a connection already checked out (the raw round trip);
* ``acquire_or_renew`` as the holder renewing with a fire claim (the per-tick hot path);
* ``hand_off`` with attrs and run info (what a run does when it finishes);
* a connection opened (with the session set-up) and closed: what a pool that churns pays each time.

The drivers take turns in ``--rounds`` slices of each operation, so a change in the machine's load
hits both alike. Client CPU is this process's ``time.process_time()`` per call (the benchmark is
single-threaded: it is the driver's and the store's CPU); latency is the wall time of each call.
Prints a markdown table with each driver's CPU and p50 as a ratio to PyMySQL's, then the client CPU
of a guarded run (one claim and one hand-off) per driver.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from overhead import isolated, md_table, server_version

from mutexcron.backends.sql_dialects import DIALECTS
from mutexcron.drill import percentile
from mutexcron.errors import MutexcronError
from mutexcron.locks import FireClaim, Node, RunInfo, lock_store_from_url
from mutexcron.locks.sql import SQLLockStore

log = logging.getLogger("benchmarks.mysql_drivers")

HOLDER = Node("bench-holder", "10.0.0.1")
#: Operations timed, in the table's order; connections are fewer (each is a TCP handshake and a login).
OPERATIONS = (
    "raw round trip (SELECT 1)",
    "acquire_or_renew: holder + fire claim",
    "hand_off: attrs + run info",
    "connection opened (session set-up) and closed",
)


@dataclass
class Timing:
    """Samples of one operation on one driver, gathered over the rounds."""

    samples: list[float] = field(default_factory=list)  # wall seconds per call
    cpu: float = 0.0  # process CPU seconds, all calls

    @property
    def cpu_ms(self) -> float:
        return self.cpu / max(len(self.samples), 1) * 1000

    def p(self, q: float) -> float:
        return percentile(self.samples, q) * 1000


def timed_slice(timing: Timing, call: Callable[[int], Any], start: int, count: int) -> None:
    """Time ``call(i)`` for ``count`` values of i from ``start``: wall time per call, CPU for the slice."""
    clock = time.perf_counter
    cpu = time.process_time()
    for i in range(start, start + count):
        began = clock()
        call(i)
        timing.samples.append(clock() - began)
    timing.cpu += time.process_time() - cpu


@contextlib.contextmanager
def drivername(name: str | None) -> Iterator[None]:
    """Stores built inside use SQLAlchemy's driver ``name`` (None: mutexcron's own), all else unchanged."""
    original = DIALECTS["mysql"]
    if name is not None:
        DIALECTS["mysql"] = dataclasses.replace(original, driver=name)
    try:
        yield
    finally:
        DIALECTS["mysql"] = original


class Driver:
    """One driver's store on the shared table, and the calls timed on it."""

    def __init__(self, label: str, url: str, sa_driver: str | None) -> None:
        self.label = label
        with drivername(sa_driver):
            self.store: Any = lock_store_from_url(url)
        if not isinstance(self.store, SQLLockStore):
            raise MutexcronError(f"{url} is not a SQL store")
        self.name = self.store.engine.dialect.driver  # what the store really chose
        # The distribution's version: PyMySQL's __version__ imitates mysqlclient's.
        self.version = metadata.version({"pymysql": "PyMySQL", "mysqldb": "mysqlclient"}.get(self.name, self.name))
        self.lock = f"hot-{label}"
        self.timings = {op: Timing() for op in OPERATIONS}
        self.token = self.store.acquire_or_renew(self.lock, HOLDER, 600.0).token
        self.base_us = time.time_ns() // 1000
        self.conn = self.store.engine.connect()  # the raw round trip's connection, kept checked out

    def calls(self) -> dict[str, Callable[[int], Any]]:
        store, lock = self.store, self.lock

        def claim(i: int) -> None:
            # A fresh fire time each call, as every tick is: the claim is really written.
            result = store.acquire_or_renew(lock, HOLDER, 600.0, FireClaim.new("job", self.base_us + 1_000_000 * (i + 100)))
            assert result.acquired and result.claimed, result

        def hand_off(i: int) -> None:
            assert store.hand_off(lock, HOLDER, self.token, {"n": i, "cursor": "x" * 32}, RunInfo(0.01))

        def connect(_i: int) -> None:
            store.engine.pool.dispose()  # no idle connection left: the next call opens one
            with store.engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1").fetchall()

        return {
            OPERATIONS[0]: lambda _i: self.conn.exec_driver_sql("SELECT 1").fetchall(),
            OPERATIONS[1]: claim,
            OPERATIONS[2]: hand_off,
            OPERATIONS[3]: connect,
        }

    def close(self) -> None:
        self.conn.close()
        self.store.close()


def run(iterations: int, rounds: int, connects: int) -> tuple[str, list[Driver]]:
    iso = isolated("mysql")
    drivers: list[Driver] = []
    try:
        drivers.append(Driver("pymysql", iso.url, None))
        if importlib.util.find_spec("MySQLdb") is not None:
            drivers.append(Driver("mysqlclient", iso.url, "mysql+mysqldb"))
        else:
            print("_mysqlclient is not installed (pip install mysqlclient): PyMySQL only_\n", flush=True)
        version = server_version("mysql", drivers[0].store)
        calls = {d.label: d.calls() for d in drivers}
        for op in OPERATIONS:
            total = connects if op == OPERATIONS[3] else iterations
            for d in drivers:  # warm-up: statements parsed, connections open (i rising: fire times only go up)
                for i in range(-min(20, total), 0):
                    calls[d.label][op](i)
            step = max(1, total // rounds)
            for start in range(0, total, step):
                for d in drivers:
                    timed_slice(d.timings[op], calls[d.label][op], start, min(step, total - start))
        return version, drivers
    finally:
        for d in drivers:
            d.close()
        iso.cleanup()


def render(version: str, drivers: list[Driver]) -> str:
    base = drivers[0]
    rows = []
    for op in OPERATIONS:
        for d in drivers:
            t, ref = d.timings[op], base.timings[op]
            ratio = "-" if d is base else f"{t.cpu_ms / ref.cpu_ms:.2f}x CPU, {t.p(50) / ref.p(50):.2f}x p50"
            rows.append([
                op, f"{d.name} {d.version}", f"{t.cpu_ms:.3f}", f"{t.p(50):.3f}", f"{t.p(99):.3f}", ratio, str(len(t.samples)),
            ])
    header = ["operation", "driver", "client CPU ms per call", "p50 ms", "p99 ms", f"vs {base.name}", "n"]
    # A guarded run costs one claim and one hand-off: their sum is the client CPU per tick.
    per_run = {d.name: d.timings[OPERATIONS[1]].cpu_ms + d.timings[OPERATIONS[2]].cpu_ms for d in drivers}
    summary = ", ".join(f"{name} {ms:.3f} ms ({ms / per_run[base.name]:.2f}x)" for name, ms in per_run.items())
    return f"**{version}**\n\n{md_table(header, rows)}\n\nClient CPU per guarded run (claim + hand-off): {summary}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000, help="timed calls per lock operation and driver [2000]")
    parser.add_argument("--connects", type=int, default=200, help="timed new connections per driver [200]")
    parser.add_argument("--rounds", type=int, default=10, help="slices the drivers take turns in [10]")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        version, drivers = run(args.iterations, args.rounds, args.connects)
    except MutexcronError as exc:
        print(f"_mysql: skipped ({exc})_")
        return 1
    print(f"# MySQL drivers ({args.iterations} calls per operation and driver, {args.rounds} rounds)\n")
    print(render(version, drivers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
