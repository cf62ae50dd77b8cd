"""What a lock costs: p50/p99 of each store operation next to the raw round trip of the same server.

    python benchmarks/overhead.py [--stores sqlite,mysql,postgresql,redis,memory] [--iterations 1000]

For each reachable store it times, in one run and on one connection pool:

* the raw round trip: ``SELECT 1`` on a connection already checked out (SQL), ``PING`` (Redis),
  ``{ping: 1}`` (MongoDB), and ``store.ping()`` (the same through the store's own plumbing);
* ``acquire_or_renew`` as the holder renewing with a fire claim (the per-tick hot path), and as
  a standby that is refused;
* ``hand_off`` with attrs and run info (what a run does when it finishes);
* ``renew_many`` with 1, 100 and 10,000 held locks;
* ``claim_many`` with 1, 10 and 100 fire claims per call (one per held lock, each a newer fire
  time: every claim is won), the batched form of the holder's ``acquire_or_renew`` with a claim
  (on MariaDB also through MySQL 8's statements, which read the rows back in a transaction),

and counts the round trips each operation makes: SQL statements (a ``before_cursor_execute``
listener on ``store.engine``) plus the pool's pre-ping on checkout (``dialect.do_ping``), Redis
packets written (``Connection.send_packed_command``; a pipeline or a script is one).

With ``--ticks`` it also times whole guarded runs on started schedulers, interleaved in one run,
in four set-ups: neither run history nor metrics (``?history=0``, no ``metrics_port``), the same again
(how far two identical set-ups differ: the noise floor of the comparison), run
history only (the default 20 runs per job), and history with metrics: the holder's run (claim,
events, hand-off) and a standby's tick (skipped: not the holder), wall time and this process's
CPU per run. The four set-ups share one table / namespace, each with a lock of its own (separate
tables differed by up to 13 % on MariaDB between identical set-ups).

Every store gets its own table / namespace (SQLite: a file in a temp dir), dropped at the end.
Server URLs: ``MUTEXCRON_TEST_<KIND>_URL`` or the local defaults below; MongoDB only when
``MUTEXCRON_TEST_MONGODB_URL`` is set. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mutexcron.drill import percentile
from mutexcron.errors import MutexcronError
from mutexcron.locks import FireClaim, HeldClaim, LockStore, Node, RunInfo, lock_store_from_url

log = logging.getLogger("benchmarks.overhead")

DEFAULT_URLS = {
    "mysql": "mysql://root@127.0.0.1:3306/test",
    "postgresql": "postgresql://postgres@127.0.0.1:5432/test",
    "redis": "redis://127.0.0.1:6379/0",
}
ALL_STORES = ("memory", "sqlite", "mysql", "postgresql", "redis", "mongodb")
BIG = 10_000
NONE = "-"


# -- shared with scale.py and failover.py ---------------------------------------------------------
def server_url(kind: str) -> str | None:
    """The base URL of a server store: ``MUTEXCRON_TEST_<KIND>_URL`` or the local default."""
    return os.environ.get(f"MUTEXCRON_TEST_{kind.upper()}_URL") or DEFAULT_URLS.get(kind)


@dataclass
class Isolated:
    """A store URL of its own (a table, namespace, collection or file) and how to remove it."""

    kind: str
    url: str
    cleanup: Callable[[], None] = lambda: None


def isolated(kind: str, tag: str | None = None) -> Isolated:
    """A fresh, isolated URL for ``kind``.

    Raises:
        MutexcronError: no URL is configured for ``kind`` (MongoDB without its variable).
    """
    tag = tag or secrets.token_hex(3)
    if kind == "memory":
        return Isolated(kind, f"memory://bench-{tag}")
    if kind == "sqlite":
        tmp = tempfile.mkdtemp(prefix="mutexcron-bench-")
        return Isolated(kind, f"sqlite:///{tmp}/locks.db", lambda: shutil.rmtree(tmp, ignore_errors=True))
    base = server_url(kind)
    if not base:
        raise MutexcronError(f"no {kind} server: set MUTEXCRON_TEST_{kind.upper()}_URL")
    sep = "&" if "?" in base else "?"
    # SQL: the task table too, so the nodes' task workers (`mutexcron trigger`) use one of the run's own
    sql = f"table=mc_bench_{tag}&tasks_table=mc_bench_{tag}_tasks"
    option = {"redis": f"namespace=bench-{tag}", "mongodb": f"collection=mc_bench_{tag}"}.get(kind, sql)
    url = f"{base}{sep}{option}"
    return Isolated(kind, url, lambda: drop(kind, url))


def drop(kind: str, url: str) -> None:
    """Remove the tables (locks, ``<table>_nodes``, ``_floor``, ``_feed``, tasks), namespace or collection of an isolated URL."""
    store: Any = lock_store_from_url(url)
    try:
        if kind in ("mysql", "postgresql"):
            from mutexcron.tasks.stores.sql import SQLTaskStore

            tasks = SQLTaskStore(url)
            try:
                with store.engine.connect() as conn:
                    for table in (store.table, store.nodes_table, store.floor_table, f"{store.table}_feed", tasks.table):
                        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
                    conn.commit()
            finally:
                tasks.close()
        elif kind == "redis":
            store.destroy_namespace()
        elif kind == "mongodb":
            store.collection.drop()
    finally:
        store.close()


def server_version(kind: str, store: LockStore) -> str:
    """The server's version string, for the tables' captions."""
    s: Any = store
    try:
        if kind in ("sqlite", "mysql", "postgresql"):
            import sqlalchemy

            query = {"sqlite": "SELECT sqlite_version()", "mysql": "SELECT VERSION()", "postgresql": "SHOW server_version"}
            with s.engine.connect() as conn:
                return f"{kind} {conn.execute(sqlalchemy.text(query[kind])).scalar()}"
        if kind == "redis":
            return f"redis {s._client.info('server')['redis_version']}"
        if kind == "mongodb":
            return f"mongodb {s.collection.database.client.server_info()['version']}"
    except Exception as exc:
        return f"{kind} (version unknown: {exc})"
    return kind


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- counting round trips -------------------------------------------------------------------------
@dataclass
class RoundTrips:
    """Counts what a store sends to its server."""

    count: int = 0
    statements: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.count = 0
        self.statements.clear()


@contextlib.contextmanager
def counting(kind: str, store: LockStore) -> Iterator[RoundTrips | None]:
    trips = RoundTrips()
    s: Any = store
    if kind in ("sqlite", "mysql", "postgresql"):
        from sqlalchemy import event

        def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            trips.count += 1
            trips.statements.append(statement.split(None, 1)[0].upper())

        dialect = s.engine.dialect
        original_ping = dialect.do_ping

        def do_ping(dbapi_connection: Any) -> bool:
            trips.count += 1
            trips.statements.append("PRE-PING")
            return bool(original_ping(dbapi_connection))

        event.listen(s.engine, "before_cursor_execute", on_execute)
        dialect.do_ping = do_ping
        try:
            yield trips
        finally:
            event.remove(s.engine, "before_cursor_execute", on_execute)
            del dialect.do_ping
    elif kind == "redis":
        from redis.connection import AbstractConnection

        original_send = AbstractConnection.send_packed_command

        def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
            trips.count += 1
            original_send(self, command, check_health)

        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
        try:
            yield trips
        finally:
            AbstractConnection.send_packed_command = original_send  # type: ignore[method-assign]
    else:
        yield None


# -- timing ---------------------------------------------------------------------------------------
@dataclass
class Row:
    operation: str
    samples: list[float]  # seconds
    trips: float | None = None  # round trips per call
    what: str = ""
    cpu: float = 0.0  # this process's CPU seconds per call

    @property
    def p50_ms(self) -> float:
        return percentile(self.samples, 50) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.samples, 99) * 1000


def timed(operation: str, call: Callable[[int], Any], iterations: int, trips: RoundTrips | None, warmup: int = 20) -> Row:
    """Time ``call(i)``: latency samples, round trips per call, statement kinds, client CPU per call."""
    for i in range(warmup):
        call(-1 - i)
    if trips is not None:
        trips.reset()
    samples = []
    clock = time.perf_counter
    cpu = time.process_time()
    for i in range(iterations):
        start = clock()
        call(i)
        samples.append(clock() - start)
    cpu = (time.process_time() - cpu) / iterations
    if trips is None:
        return Row(operation, samples, None, "", cpu)
    return Row(operation, samples, trips.count / iterations, "+".join(sorted(set(trips.statements))), cpu)


@contextlib.contextmanager
def raw_round_trip(kind: str, store: LockStore) -> Iterator[Callable[[int], Any]]:
    """One raw round trip on a connection that is already open (no pool checkout, no pre-ping)."""
    s: Any = store
    if kind in ("sqlite", "mysql", "postgresql"):
        with s.engine.connect() as conn:
            yield lambda _i: conn.exec_driver_sql("SELECT 1").fetchall()
    elif kind == "redis":
        yield lambda _i: s._client.ping()
    elif kind == "mongodb":
        db = s.collection.database
        yield lambda _i: db.command("ping")
    else:
        yield lambda _i: None


@contextlib.contextmanager
def raw_write(kind: str, store: LockStore) -> Iterator[Callable[[int], Any] | None]:
    """The cheapest durable write of the same server: a one-row UPDATE in autocommit, or a Redis SET."""
    s: Any = store
    if kind in ("sqlite", "mysql", "postgresql"):
        table = f"{s.table}_raw"
        with s.engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE TABLE IF NOT EXISTS {table} (id INTEGER PRIMARY KEY, v BIGINT)")
            conn.exec_driver_sql(f"INSERT INTO {table} (id, v) VALUES (1, 0)")
            try:
                yield lambda i: conn.exec_driver_sql(f"UPDATE {table} SET v = {i} WHERE id = 1")
            finally:
                conn.exec_driver_sql(f"DROP TABLE {table}")
    elif kind == "redis":
        key = f"mutexcron:{{{s.namespace}}}:bench-raw"
        yield lambda i: s._client.set(key, i)
    else:
        yield None


def bench_store(kind: str, iterations: int, big: int) -> tuple[str, list[Row]]:
    iso = isolated(kind)
    store = lock_store_from_url(iso.url)
    holder, other = Node("bench-holder", "10.0.0.1"), Node("bench-standby", "10.0.0.2")
    rows: list[Row] = []
    try:
        store.ping()
        version = server_version(kind, store)
        with counting(kind, store) as trips:
            with raw_round_trip(kind, store) as raw:
                rows.append(timed("raw round trip (SELECT 1 / PING)", raw, iterations, trips))
            with raw_write(kind, store) as write:
                if write is not None:
                    rows.append(timed("raw write (1-row UPDATE / SET)", write, iterations, trips))
            rows.append(timed("store.ping()", lambda _i: store.ping(), iterations, trips))

            token = store.acquire_or_renew("hot", holder, 30.0).token
            base_us = time.time_ns() // 1000
            rows.append(timed(
                "acquire_or_renew: holder + fire claim",
                lambda i: store.acquire_or_renew("hot", holder, 30.0, FireClaim.new("job", base_us + 1_000_000 * (i + 100))),
                iterations, trips,
            ))
            rows.append(timed(
                "acquire_or_renew: standby, refused",
                lambda i: store.acquire_or_renew("hot", other, 30.0, FireClaim.new("job", base_us)), iterations, trips,
            ))
            token = store.acquire_or_renew("hot", holder, 30.0).token
            rows.append(timed(
                "hand_off: attrs + run info",
                lambda i: store.hand_off("hot", holder, token, {"n": i, "cursor": "x" * 32}, RunInfo(0.01)),
                iterations, trips,
            ))

            rows += bench_claim_many(store, holder, iterations, trips)

            held: dict[str, int] = {}
            for size in (1, 100, big):
                while len(held) < size:
                    name = f"bulk-{len(held):05d}"
                    held[name] = store.acquire_or_renew(name, holder, 600.0).token
                leases = dict(list(held.items())[:size])
                rounds = iterations if size <= 100 else max(5, iterations // 50)
                rows.append(timed(
                    f"renew_many: {size:,} held", lambda _i, leases=leases: store.renew_many(holder, leases),
                    rounds, trips, warmup=2,
                ))
                renewed = store.renew_many(holder, leases)
                assert renewed == set(leases), f"renew_many renewed {len(renewed)} of {len(leases)}"
        if kind == "mysql":  # MySQL 8 has no RETURNING: its statements, run on this server, for comparison
            rows += bench_mysql8_claim_many(iso.url, holder, iterations)
    finally:
        store.close()
        iso.cleanup()
    return version, rows


def bench_claim_many(
    store: LockStore, holder: Node, iterations: int, trips: RoundTrips | None, label: str = "", run: int = 0
) -> list[Row]:
    """``claim_many`` of 1, 10 and 100 claims per call, one per held lock, each at a newer fire time.

    ``run``: how many times this ran before on the same locks (its fire times come after theirs).
    """
    rows = []
    tokens = {f"claim-{i:03d}": store.acquire_or_renew(f"claim-{i:03d}", holder, 600.0).token for i in range(100)}
    for k, size in enumerate((1, 10, 100)):
        locks = list(tokens.items())[:size]
        base_us = time.time_ns() // 1000 + 1_000_000 * (iterations + 200) * (k + 3 * run)  # after every fire time before

        def call(i: int, locks: list[tuple[str, int]] = locks, base_us: int = base_us) -> Any:
            fire = base_us + 1_000_000 * (i + 100)
            return store.claim_many(holder, [HeldClaim(name, token, FireClaim.new("job", fire)) for name, token in locks])

        rows.append(timed(f"claim_many{label}: {size} claims ({size} locks)", call, iterations, trips))
        last = call(iterations + 1)
        assert len(last.won) == size and len(last.renewed) == size, f"claim_many won {len(last.won)} of {size}"
    return rows


def bench_mysql8_claim_many(url: str, holder: Node, iterations: int) -> list[Row]:
    """``claim_many`` on MySQL 8's path (a joined UPDATE, read back in the same transaction) on a MariaDB server."""
    from mutexcron.locks.sql import SQLLockStore

    class MySQL8Path(SQLLockStore):
        _use_mariadb_returning = False

    store = MySQL8Path(url)
    try:
        store.ping()
        with counting("mysql", store) as trips:
            return bench_claim_many(store, holder, iterations, trips, " (MySQL 8 path)", run=1)
    finally:
        store.close()


#: The --ticks set-ups: (label, run history kept, metrics port). "neither, again" is the baseline
#: measured twice (a store and schedulers of its own): how far two identical set-ups differ.
TICK_SETUPS: tuple[tuple[str, bool, int | None], ...] = (
    ("neither", False, None),
    ("neither, again", False, None),
    ("history", True, None),
    ("history + metrics", True, 0),
)


def bench_ticks(kind: str, iterations: int, replicas: int = 6) -> list[Row]:
    """Guarded runs end to end on started (paused) schedulers, without and with history and metrics, interleaved.

    Per set-up, ``replicas`` times: a holder and a standby, with a lock of their own in the one
    isolated store (and connections of their own: on MariaDB, identical set-ups differed by up to
    13 % between their connections; the replicas' samples are pooled). Each call runs the job's
    next fire time by hand, as mutexcron's executor would: on the holder, the claim, the run's
    events and its hand-off; on the standby, a tick skipped as not the holder.
    """
    from contextvars import copy_context
    from datetime import datetime, timedelta, timezone

    from mutexcron.guard.job import _FIRE_TIME

    def call(job: Any, fire: datetime) -> None:
        _FIRE_TIME.set(fire)
        job.func()

    variants: list[tuple[str, Any, Any]] = []  # (label, holder, standby): started MutexSchedulers
    iso = isolated(kind)  # one table / namespace for all set-ups, a lock each
    try:
        for replica in range(replicas):
            for index, (label, history, port) in enumerate(TICK_SETUPS):
                url = iso.url if history else f"{iso.url}{'&' if '?' in iso.url else '?'}history=0"
                lock = f"bench{replica}_{index}"
                holder, standby = (start_bench_scheduler(kind, url, lock, role, port) for role in ("holder", "standby"))
                variants.append((label, holder, standby))
        base = datetime.now(timezone.utc)
        samples: dict[str, list[float]] = {f"{r}, {label}": [] for label, *_ in variants for r in ("holder run", "standby tick")}
        cpu: dict[str, float] = dict.fromkeys(samples, 0.0)
        clock = time.perf_counter
        for i in range(-20, iterations):  # 20 warm-up calls each
            fire = base + timedelta(seconds=i + 100)  # a newer fire time each call: every claim is won
            shift = i % len(variants)  # each set-up takes each place in the round in turn: no place favours one
            for label, holder, standby in variants[shift:] + variants[:shift]:
                for role, sched in (("holder run", holder), ("standby tick", standby)):
                    job, ctx = sched.get_jobs()[0], copy_context()
                    start, cpu0 = clock(), time.process_time()
                    ctx.run(call, job, fire)
                    if i >= 0:
                        samples[f"{role}, {label}"].append(clock() - start)
                        cpu[f"{role}, {label}"] += time.process_time() - cpu0
        return [Row(name, values, None, "", cpu[name] / len(values)) for name, values in samples.items()]
    finally:
        for _, holder, standby in variants:
            holder.shutdown()
            standby.shutdown()
        iso.cleanup()


def start_bench_scheduler(kind: str, url: str, lock: str, role: str, metrics_port: int | None) -> Any:
    """A started (paused) scheduler with one guarded job on ``lock``; the holder waits for its lease."""
    from mutexcron import MutexScheduler

    sched = MutexScheduler(lock_url=url, node_id=f"bench-{role}", unactive_interval=60,
                           metrics_port=metrics_port, metrics_host="127.0.0.1")  # fmt: skip
    sched.add_job(lambda: None, "interval", hours=24, id=lock, mutex=lock)
    sched.start(paused=True)
    deadline = time.monotonic() + 10
    while role == "holder" and lock not in sched._leases.held():  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            raise MutexcronError(f"{kind}: the bench holder never got its lease")
        time.sleep(0.01)
    return sched


def render_ticks(kind: str, rows: list[Row]) -> str:
    out = [[r.operation, f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", f"{r.cpu * 1000:.3f}", str(len(r.samples))] for r in rows]
    by = {r.operation: r for r in rows}
    notes = []
    for role in ("holder run", "standby tick"):
        off = by[f"{role}, neither"]
        for label in ("neither, again", "history", "history + metrics"):
            on = by[f"{role}, {label}"]
            notes.append(f"{role} with {label}: {(on.p50_ms - off.p50_ms) * 1000:+.1f} µs p50 "
                         f"({(on.p50_ms / off.p50_ms - 1) * 100:+.1f} %), {(on.cpu - off.cpu) * 1e6:+.1f} µs CPU")  # fmt: skip
    table = md_table(["guarded run (" + kind + ")", "p50 ms", "p99 ms", "client CPU ms", "n"], out)
    return f"{table}\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def render(kind: str, version: str, rows: list[Row]) -> str:
    raw = rows[0].p50_ms
    write = next((r.p50_ms for r in rows if r.operation.startswith("raw write")), None)
    out = []
    for row in rows:
        reference = kind == "memory" or row.operation.startswith("raw ")
        ratio = NONE if reference or raw <= 0 else f"{row.p50_ms / raw:.1f}x"
        to_write = NONE if reference or not write else f"{row.p50_ms / write:.1f}x"
        trips = NONE if row.trips is None else f"{row.trips:g}" + (f" ({row.what})" if row.what else "")
        out.append([
            row.operation, f"{row.p50_ms:.3f}", f"{row.p99_ms:.3f}", ratio, to_write, f"{row.cpu * 1000:.3f}", trips,
            str(len(row.samples)),
        ])
    title = f"**{version}**" + (" (in-process reference: no server)" if kind == "memory" else "")
    header = [
        "operation", "p50 ms", "p99 ms", "p50 / raw RTT", "p50 / raw write", "client CPU ms", "round trips per call", "n"
    ]
    return f"{title}\n\n{md_table(header, out)}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="memory,sqlite,mysql,postgresql,redis,mongodb", help="comma-separated")
    parser.add_argument("--iterations", type=int, default=1000, help="timed calls per operation [1000]")
    parser.add_argument("--big", type=int, default=BIG, help=f"held locks in the largest renew_many [{BIG}]")
    parser.add_argument(
        "--ticks", action="store_true",
        help="also time guarded runs without history or metrics, with history, and with both",
    )  # fmt: skip
    parser.add_argument("--ticks-only", action="store_true", help="only the guarded runs (implies --ticks)")
    parser.add_argument(
        "--replicas", type=int, default=None,
        help="--ticks: holder-standby pairs per set-up, samples pooled [6; PostgreSQL 3: more schedulers "
             "exceed its default max_connections of 100]",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    unknown = set(kinds) - set(ALL_STORES)
    if unknown:
        parser.error(f"unknown store(s) {', '.join(sorted(unknown))}; choose from {', '.join(ALL_STORES)}")
    print(f"# Lock overhead ({args.iterations} calls per operation, {os.cpu_count()} CPUs)\n")
    for kind in kinds:
        if kind == "mongodb" and not os.environ.get("MUTEXCRON_TEST_MONGODB_URL"):
            print("_mongodb: skipped (set MUTEXCRON_TEST_MONGODB_URL)_\n")
            continue
        try:
            if not args.ticks_only:
                version, rows = bench_store(kind, args.iterations, args.big)
                print(render(kind, version, rows), flush=True)
            if args.ticks or args.ticks_only:
                replicas = args.replicas or (3 if kind == "postgresql" else 6)
                print(render_ticks(kind, bench_ticks(kind, args.iterations, replicas)), flush=True)
        except MutexcronError as exc:
            print(f"_{kind}: skipped ({exc})_\n")
            continue
    return 0


if __name__ == "__main__":
    sys.exit(main())
