"""What an open dashboard costs the store: statements and time per refresh, next to `mutexcron status --json`.

A store is filled like a busy cluster's (``--locks`` locks with two jobs each and their kept run
history, three node presences, ``--codes`` task codes with queued and failed tasks), then, in one
run and interleaved, ``--repeats`` times each:

* **dashboard refresh**: one ``GET /api/sections/overview`` of the dashboard's WSGI app with its
  snapshot read again (what every refresh of an open page costs the store when it is the only
  page; more pages in the same second share it), with ``--events`` events in the event feed;
* **locks page refresh**: the same for ``GET /api/sections/locks`` (every lock one table row);
* **status --json**: the ``mutexcron status --json`` command in process (it opens its stores for
  the call, as a terminal's ``status --watch`` redraw does not: ``--watch`` keeps them);
* **throughput read**: the Tasks page's read of the finished tasks' times for its throughput
  chart (made at most every 30 s while a Tasks page is open), over ``--finished`` finished
  tasks (tombstones, as the store keeps them) spread over the last two hours.

SQL statements are counted by a ``before_cursor_execute`` listener (every statement a connection
sends); time is the wall time of the call (store and rendering). Prints a markdown table of the
medians per store.

    python benchmarks/dashboard.py --stores sqlite,postgresql --repeats 30
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy
from click.testing import CliRunner
from sqlalchemy import event

from mutexcron.cli.main import main as cli
from mutexcron.dashboard import create_app
from mutexcron.locks import lock_store_from_url
from mutexcron.locks.base import FireClaim, Node, Presence, RunInfo
from mutexcron.observability.feed import FeedEvent, feed_store_for
from mutexcron.tasks import Fail, task_store_from_url

SERVERS = {
    "mysql": os.environ.get("MUTEXCRON_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
    "postgresql": os.environ.get("MUTEXCRON_TEST_POSTGRESQL_URL", "postgresql://postgres@127.0.0.1:5432/test"),
}


def _url(store: str, tmp: str, suffix: str) -> str:
    if store == "sqlite":
        return f"sqlite:///{tmp}/dashboard-bench.db"
    return f"{SERVERS[store]}?table=mc_bench_{suffix}&tasks_table=mc_bench_tasks_{suffix}"


def fill(url: str, locks: int, codes: int) -> None:
    nodes = [Node(f"node-{i}:1:ab", f"10.0.0.{i}") for i in range(3)]
    store = lock_store_from_url(url)
    try:
        held: dict[int, dict[str, int]] = {i: {} for i in range(3)}
        for n in range(locks):
            name, node = f"lock-{n:03d}", n % 3
            got = store.acquire_or_renew(name, nodes[node], ttl=30, claim=FireClaim.new(f"{name}-a", 1_000_000))
            held[node][name] = got.token
            for run in range(20):
                for job in (f"{name}-a", f"{name}-b"):
                    when = datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=run)
                    store.hand_off(name, nodes[node], got.token, run=RunInfo(0.05, None if run % 7 else "boom", job, when))
        for i, node in enumerate(nodes):
            store.renew_many(node, held[i], presence=Presence("0.1.0", 0.001))
    finally:
        store.close()
    tasks = task_store_from_url(lock_store_from_url(url).url)
    try:
        for c in range(codes):
            for k in range(50):
                tasks.add(f"code-{c}", f"key-{k}", timedelta(0) if k < 5 else timedelta(hours=1))
            for claimed in tasks.claim("node-0", [f"code-{c}"], 5, 30):
                tasks.complete("node-0", claimed.code, claimed.key, claimed.token, Fail("no"))
    finally:
        tasks.close()


def fill_feed(url: str, events: int) -> None:
    """``events`` events in the event feed (acquired, failed runs with a traceback), in batches."""
    store = lock_store_from_url(url)
    feed = feed_store_for(store)
    assert feed is not None
    try:
        for start in range(0, events, 500):
            feed.append([FeedEvent("run_failed" if i % 5 == 0 else "lock_acquired", f"node-{i % 3}:1:ab", f"lock-{i % 50:03d}",
                                   f"event {i}", "Traceback ...\n" * 20 if i % 5 == 0 else None, {"token": i})
                         for i in range(start, min(events, start + 500))])  # fmt: skip
    finally:
        store.close()


def fill_finished(url: str, finished: int, codes: int) -> None:
    """``finished`` tombstones (finished tasks, as the store keeps them), spread over the last two
    hours by the store's clock: written in one batch, as thousands of completions would leave them."""
    from mutexcron.tasks.stores.sql_statements import STATEMENTS

    tasks: Any = task_store_from_url(lock_store_from_url(url).url)
    try:
        tasks.summary()  # the table
        now, param = tasks.now(), STATEMENTS[tasks.backend.dialect.name].time_param
        rows = [{"code": f"code-{i % codes}", "key": f"done-{i}", "t": param(now - timedelta(seconds=7200 * i / finished))}
                for i in range(finished)]  # fmt: skip
        sql = (f"INSERT INTO {tasks.table} (code, task_key, due, run_at, payload, state, attempt, token, cancel_requested, "
               "created, updated) VALUES (:code, :key, :t, NULL, 'null', 'done', 1, 1, 0, :t, :t)")  # fmt: skip
        with tasks.backend.engine.begin() as conn:
            conn.execute(sqlalchemy.text(sql), rows)
    finally:
        tasks.close()


def drop(url: str) -> None:
    if url.startswith("sqlite"):
        return
    from mutexcron.backends.sql import SQLBackend

    backend = SQLBackend(url)
    try:
        tasks = url.rpartition("tasks_table=")[2]
        with backend.engine.connect() as conn:
            for name in (backend.table, f"{backend.table}_nodes", f"{backend.table}_floor", f"{backend.table}_feed", tasks):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    finally:
        backend.close()


class Counter:
    def __init__(self) -> None:
        self.count = 0
        event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", self._one)

    def _one(self, *_args: Any) -> None:
        self.count += 1

    def close(self) -> None:
        event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", self._one)


def _refresh(app: Any, page: str = "overview") -> float:
    app.reader.invalidate()
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": f"/api/sections/{page}", "QUERY_STRING": "", "SERVER_NAME": "x",
               "SERVER_PORT": "1", "wsgi.input": io.BytesIO(b""), "wsgi.url_scheme": "http"}  # fmt: skip
    body = json.loads(b"".join(app(environ, lambda status, headers: None)))
    return float(body["store_ms"])


def _throughput(app: Any, now: datetime) -> None:
    app.reader.invalidate()  # the read is made again (a refresh shares it for 30 s)
    flow = app.reader.throughput(now)
    assert flow is not None and flow.note is None and flow.per_minute, flow


def _status(url: str) -> None:
    result = CliRunner().invoke(cli, ["status", "--json", "--lock-url", url])
    assert result.exit_code == 0, result.output


def measure(store: str, repeats: int, locks: int, codes: int, finished: int, events: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url = _url(store, tmp, uuid.uuid4().hex[:8])
        drop(url)
        try:
            fill(url, locks, codes)
            fill_finished(url, finished, codes)
            fill_feed(url, events)
            app = create_app(url)
            counter = Counter()
            samples: dict[str, list[tuple[int, float]]] = {"dashboard refresh": [], "locks page refresh": [],
                                                           "status --json": [], "throughput read": []}  # fmt: skip
            store_ms: list[float] = []
            locks_ms: list[float] = []
            try:
                _refresh(app)
                _status(url)  # warm: imports, the dashboard's table check
                now = app.reader.snapshot().now
                _throughput(app, now)
                for _ in range(repeats):
                    calls = (("dashboard refresh", lambda: store_ms.append(_refresh(app))),
                             ("locks page refresh", lambda: locks_ms.append(_refresh(app, "locks"))),
                             ("status --json", lambda: _status(url)),
                             ("throughput read", lambda: _throughput(app, now)))  # fmt: skip
                    for name, call in calls:
                        before, started = counter.count, time.perf_counter()
                        call()
                        samples[name].append((counter.count - before, time.perf_counter() - started))
            finally:
                counter.close()
                app.close()
        finally:
            drop(url)
    out = {name: (statistics.median(n for n, _ in rows), statistics.median(t for _, t in rows) * 1000, "")
           for name, rows in samples.items()}  # fmt: skip
    statements, ms, _ = out["dashboard refresh"]
    out["dashboard refresh"] = (statements, ms, f"{statistics.median(store_ms):.1f}")
    statements, ms, _ = out["locks page refresh"]
    out["locks page refresh"] = (statements, ms, f"{statistics.median(locks_ms):.1f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default="sqlite,postgresql", help="comma-separated: sqlite, mysql, postgresql")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--locks", type=int, default=50, help="locks (two jobs each, 20 kept runs per job)")
    parser.add_argument("--codes", type=int, default=5, help="task codes (50 tasks each, 5 failed)")
    parser.add_argument("--finished", type=int, default=20_000, help="finished tasks kept (over the last two hours)")
    parser.add_argument("--events", type=int, default=10_000, help="events in the event feed")
    args = parser.parse_args()
    print(f"{args.locks} locks x 2 jobs x 20 kept runs, 3 nodes, {args.codes} task codes x 50 tasks, "
          f"{args.finished} finished tasks, {args.events} events; medians of {args.repeats} interleaved calls\n")  # fmt: skip
    print("| store | what | SQL statements | of it in the store's reads (ms) | wall time (ms) |")
    print("|---|---|---:|---:|---:|")
    for store in args.stores.split(","):
        found = measure(store, args.repeats, args.locks, args.codes, args.finished, args.events)
        for name, (statements, ms, reads) in found.items():
            print(f"| {store} | {name} | {statements:.0f} | {reads or '-'} | {ms:.1f} |")


if __name__ == "__main__":
    main()
