"""Soak: a million distinct tasks through real nodes with a short retention; storage stays bounded.

    python benchmarks/retention_soak.py --stores postgresql --tasks 1000000 --retention 5

Per store: ``--nodes`` ``mutexcron run benchmarks/retention_nodes.py`` processes (a no-op handler
that records each start) with ``MUTEXCRON_TASK_RETENTION`` set to ``--retention`` seconds, and one
producer adding ``--tasks`` distinct keys (``add_many``, 1,000 a call) as fast as the nodes take
them (it pauses while more than ``--backlog`` tasks wait). Every ``--every`` seconds it samples:
the task table's rows (Redis: the namespace's keys), and how long ``summary()`` and the
dashboard's finished-tasks read take (medians of the run's second quarter, once the table is full,
and of its last quarter; the samples are left in the run's directory as ``samples.json``). At
the end it waits for every task to finish and every tombstone to go, then prints one table:
tasks/s, the largest row
count next to the bound docs/storage.md states (live tasks + finish rate x (retention + 2 x
(floor settle + prune interval)), at the run's peak rate), the reads' times, and keys that ran
twice. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from mutexcron.tasks import TaskStore, task_store_from_url

HERE = Path(__file__).parent
NODES = HERE / "retention_nodes.py"
CHUNK = 1000


@dataclass
class Samples:
    rows: list[int] = field(default_factory=list)
    summary_ms: list[float] = field(default_factory=list)
    finished_ms: list[float] = field(default_factory=list)
    added: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, tasks added so far)

    def peak_rate(self) -> float:
        """The highest add rate over two consecutive sample intervals (tasks/s)."""
        pairs = zip(self.added, self.added[2:], strict=False)
        return max(((b - a) / (tb - ta) for (ta, a), (tb, b) in pairs if tb > ta), default=0.0)


def store_url(kind: str, workdir: Path, tag: str) -> str:
    if kind == "sqlite":
        return f"sqlite:///{workdir}/soak.db"
    base = os.environ[f"MUTEXCRON_TEST_{kind.upper()}_URL"]
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}namespace=soak-{tag}" if kind == "redis" else f"{base}{sep}tasks_table=mc_soak_{tag}"


def count_rows(store: Any) -> int:
    """The task table's rows, or the Redis namespace's keys (SCAN: the soak's own namespace only)."""
    if hasattr(store, "table"):
        return int(store.backend.execute(f"SELECT COUNT(*) FROM {store.table}", {}, "rows")[0][0][0])
    client, pattern = store.backend.client, store.backend.key("*")
    return sum(1 for _ in client.scan_iter(match=pattern, count=10_000))


def timed_ms(call: Any) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def finished_read(store: TaskStore) -> Any:
    from mutexcron.dashboard.finished import finished_since
    from mutexcron.dashboard.reads import THROUGHPUT_ROWS

    since = store.now() - timedelta(hours=1)
    return lambda: finished_since(store, since, THROUGHPUT_ROWS)


def start_nodes(url: str, workdir: Path, count: int, retention: float) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(count):
        env = {**os.environ, "MUTEXCRON_LOCK_URL": url, "MUTEXCRON_BENCH_DIR": str(workdir),
               "MUTEXCRON_TASK_RETENTION": f"{retention}s", "MUTEXCRON_NODE_ID": f"soak{i}"}  # fmt: skip
        with open(workdir / f"soak{i}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "mutexcron", "run", str(NODES), "--log-level", "info"],
                                          env=env, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
    return procs


def sample(store: TaskStore, samples: Samples, read_finished: Any) -> int:
    samples.rows.append(count_rows(store))
    queued = 0

    def summary() -> None:
        nonlocal queued
        queued = sum(s.queued + s.running for s in store.summary(["soak"]))

    samples.summary_ms.append(timed_ms(summary))
    if read_finished is not None:
        samples.finished_ms.append(timed_ms(read_finished))
    return queued


def soak(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    tag = secrets.token_hex(3)
    workdir = Path(tempfile.mkdtemp(prefix="mc-soak-"))
    url = store_url(kind, workdir, tag)
    store = task_store_from_url(url)
    store.ping()  # the table exists before the nodes race to create it
    procs = start_nodes(url, workdir, args.nodes, args.retention)
    samples = Samples()
    read_finished = finished_read(store) if hasattr(store, "table") else None
    started, added, next_sample, queued = time.monotonic(), 0, 0.0, 0
    try:
        while added < args.tasks:
            if time.monotonic() >= next_sample:
                queued = sample(store, samples, read_finished)
                samples.added.append((time.monotonic(), added))
                next_sample = time.monotonic() + args.every
                print(f"{kind}: {added:,} added, {queued:,} live, {samples.rows[-1]:,} rows", file=sys.stderr, flush=True)
            if queued > args.backlog:
                time.sleep(0.2)
                queued = sum(s.queued + s.running for s in store.summary(["soak"]))
                continue
            store.add_many([("soak", f"k{added + i}", timedelta(0)) for i in range(min(CHUNK, args.tasks - added))])
            added += min(CHUNK, args.tasks - added)
            queued += CHUNK
        while sample(store, samples, read_finished) > 0:
            time.sleep(args.every)
        produced_s = time.monotonic() - started
        settle = getattr(store, "floor_settle", 0.0)
        wait_out = args.retention + 2 * (settle + max(1.0, args.retention / 10)) + 10
        deadline = time.monotonic() + wait_out
        while time.monotonic() < deadline and store.count_purgeable(0) > 0:  # every tombstone gone
            time.sleep(1)
        sample(store, samples, read_finished)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    starts = Counter()
    for path in workdir.glob("*.starts"):
        starts.update(line.split(" ", 1)[0] for line in path.read_text().splitlines())
    twice = sum(1 for n in starts.values() if n > 1)
    rate, peak = args.tasks / produced_s, samples.peak_rate()
    settle = getattr(store, "floor_settle", 0.0)
    interval = min(60.0, max(1.0, args.retention / 10))
    kept = peak * (args.retention + 2 * (settle + interval)) if hasattr(store, "table") else 0.0  # Redis keeps no tombstone
    (workdir / "samples.json").write_text(json.dumps(dataclasses.asdict(samples)))
    bound = args.backlog + CHUNK + kept
    drop(store, kind)
    store.close()
    return {"store": kind, "tasks": args.tasks, "ran": len(starts), "twice": twice, "seconds": produced_s, "rate": rate,
            "peak": peak, "rows_max": max(samples.rows), "rows_end": samples.rows[-1], "bound": bound,
            "samples": samples}  # fmt: skip


def drop(store: Any, kind: str) -> None:
    if hasattr(store, "table"):
        store.backend.execute(f"DROP TABLE {store.table}", {}, "drop", write=True)
    else:
        client = store.backend.client
        keys = list(client.scan_iter(match=store.backend.key("*"), count=10_000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])


def steady_last(values: list[float]) -> str:
    """Medians of the second quarter (the table has filled up to its bound) and the last quarter, and the largest."""
    if not values:
        return "-"
    quarter = max(1, len(values) // 4)
    second, last = values[quarter : 2 * quarter] or values[:quarter], values[-quarter:]
    return f"{statistics.median(second):.1f} / {statistics.median(last):.1f} / {max(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="sqlite,postgresql,redis")
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--retention", type=float, default=5.0, help="seconds")
    parser.add_argument("--backlog", type=int, default=20_000, help="the producer pauses above this many live tasks")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    args = parser.parse_args()
    results = [soak(kind, args) for kind in args.stores.split(",")]
    print("| store | tasks | ran | ran twice | seconds | tasks/s (peak) | rows max (bound) | rows at the end |"
          " summary ms 2nd quarter / last quarter / max | dashboard read ms 2nd quarter / last quarter / max |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["samples"]
        reads = f"{steady_last(s.summary_ms)} | {steady_last(s.finished_ms)}"
        rates = f"{r['rate']:,.0f} ({r['peak']:,.0f})"
        print(f"| {r['store']} | {r['tasks']:,} | {r['ran']:,} | {r['twice']} | {r['seconds']:.0f} | {rates} | "
              f"{r['rows_max']:,} ({r['bound']:,.0f}) | {r['rows_end']:,} | {reads} |")  # fmt: skip


if __name__ == "__main__":
    main()
