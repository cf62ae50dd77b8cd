"""How far it scales: 3 ``mutexcron run`` nodes, J guarded every-second jobs, each job its own lock.

    python benchmarks/scale.py [--stores sqlite,postgresql] [--jobs 10,100,1000] [--duration 60]

For each store and J it starts the nodes (through :class:`mutexcron.drill.Cluster`, so they are
real processes and are cleaned up the same way), lets them warm up, then measures for
``--duration`` seconds:

* duplicates: a (job, fire time) that ran more than once (target 0);
* missed: fire times in the window that never ran, or ran more than ``--drain`` s late (target 0);
* start delay: when the job's function started minus its scheduled fire time, p50 and p99;
* CPU seconds per node per minute, from ``/proc/<pid>/stat`` of each node;
* store calls per second by all nodes, counted in the nodes by :class:`~mutexcron.drill.TimedLockStore`
  (server-wide counters would also count other clients of a shared server), and the
  ``acquire_or_renew`` latency the nodes saw under that load;
* APScheduler's own warnings in the node logs: runs skipped because the previous run of the
  job was still queued (``max_instances``), and runs later than the misfire grace time.

Prints markdown tables. The store URLs are those of ``overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overhead import ALL_STORES, isolated, md_table, server_version

from mutexcron.drill import Cluster, percentile
from mutexcron.errors import MutexcronError
from mutexcron.locks import lock_store_from_url

log = logging.getLogger("benchmarks.scale")

JOBS_FILE = str(Path(__file__).with_name("scale_jobs.py"))  # what the nodes run


@dataclass
class Result:
    kind: str
    jobs: int
    seconds: float
    expected: int
    runs: int
    duplicates: int
    missed: int
    delay_p50: float
    delay_p99: float
    cpu_per_node_min: float
    cpu_max_node_min: float
    calls_per_s: float
    acquire_p50: float
    acquire_p99: float
    skipped_max_instances: int
    misfired: int


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(
    kind: str, url: str, jobs: int, duration: float, warmup: float, drain: float, nodes: int, ui: float,
    store_options: dict[str, Any] | None = None, workers: int = 0,
) -> Result:
    prefix = f"scale-{secrets.token_hex(3)}"
    cluster = Cluster(
        url,
        nodes=nodes,
        unactive_interval=ui,
        lock=f"{prefix}-0",
        jobs=JOBS_FILE,
        release_locks=tuple(f"{prefix}-{j}" for j in range(jobs)),
    )
    cluster.env.update(
        MUTEXCRON_SCALE_DIR=str(cluster.workdir),
        MUTEXCRON_SCALE_PREFIX=prefix,
        MUTEXCRON_SCALE_JOBS=str(jobs),
        MUTEXCRON_SCALE_STORE_OPTIONS=json.dumps(store_options or {}),
        MUTEXCRON_SCALE_WORKERS=str(workers or ""),
    )
    with cluster:
        time.sleep(warmup)
        cluster.check_nodes()
        pids = [p.pid for p in cluster.procs.values()]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        # The window starts on a whole second of the wall clock, so every job has the same fire times in it.
        w0 = float(int(time.time()) + 1)
        time.sleep(w0 - time.time())
        m0 = time.monotonic()
        time.sleep(duration)
        m1 = time.monotonic()
        w1 = w0 + (m1 - m0)
        cpu1 = [cpu_seconds(pid) for pid in pids]
        time.sleep(drain)  # let late runs of the window's fire times finish and be flushed
        cluster.check_nodes()
        runs: dict[tuple[int, float], list[float]] = {}
        for path in cluster.workdir.glob("runs-*.txt"):
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) != 4:
                    continue
                j, fire, started = int(parts[0]), float(parts[1]), float(parts[2])
                if w0 <= fire < w1:
                    runs.setdefault((j, fire), []).append(started - fire)
        ops = cluster.ops()
        logs = "".join(
            (cluster.workdir / f"{n}.log").read_text(errors="replace")
            for n in cluster.procs
            if (cluster.workdir / f"{n}.log").exists()
        )
    fires = math.ceil(w1) - int(w0)  # whole-second fire times in [w0, w1)
    expected = jobs * fires
    in_time = {key: delays for key, delays in runs.items() if min(delays) <= drain}
    delays = [d for ds in runs.values() for d in ds]
    calls = [s for s in ops.samples if m0 <= s[2] < m1]
    acquire = [s[3] * 1000 for s in calls if s[1] == "acquire_or_renew"]
    cpu = [(b - a) / (m1 - m0) * 60 for a, b in zip(cpu0, cpu1, strict=True)]
    return Result(
        kind=kind,
        jobs=jobs,
        seconds=m1 - m0,
        expected=expected,
        runs=sum(len(v) for v in runs.values()),
        duplicates=sum(len(v) - 1 for v in runs.values() if len(v) > 1),
        missed=expected - len(in_time),
        delay_p50=percentile(delays, 50) * 1000,
        delay_p99=percentile(delays, 99) * 1000,
        cpu_per_node_min=sum(cpu) / len(cpu),
        cpu_max_node_min=max(cpu),
        calls_per_s=len(calls) / (m1 - m0),
        acquire_p50=percentile(acquire, 50),
        acquire_p99=percentile(acquire, 99),
        skipped_max_instances=len(re.findall(r"maximum number of running instances reached", logs)),
        misfired=len(re.findall(r"was missed by", logs)),
    )


def render(version: str, results: list[Result], nodes: int, ui: float, note: str = "") -> str:
    header = [
        "jobs", "fire times", "duplicates", "missed", "start delay p50 / p99 ms", "CPU s per node per min (max)",
        "store calls/s", "acquire p50 / p99 ms", "skipped: max_instances", "misfire warnings",
    ]
    rows = [
        [
            f"{r.jobs:,}", f"{r.expected:,}", str(r.duplicates),
            f"{r.missed:,} ({100 * r.missed / max(r.expected, 1):.1f}%)",
            f"{r.delay_p50:.0f} / {r.delay_p99:.0f}", f"{r.cpu_per_node_min:.1f} ({r.cpu_max_node_min:.1f})",
            f"{r.calls_per_s:,.0f}", f"{r.acquire_p50:.1f} / {r.acquire_p99:.1f}",
            f"{r.skipped_max_instances:,}", f"{r.misfired:,}",
        ]
        for r in results
    ]
    seconds = results[0].seconds if results else 0
    return (
        f"**{version}**: {nodes} nodes, every-second jobs, lease {ui:g}s, {seconds:.0f}s measured per row{note}\n\n"
        + md_table(header, rows) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,mysql,postgresql,redis", help="comma-separated")
    parser.add_argument("--jobs", default="10,100,1000", help="comma-separated job counts [10,100,1000]")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per store and job count [60]")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring [8]")
    parser.add_argument("--drain", type=float, default=5.0, help="a run later than this counts as missed [5]")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--unactive-interval", type=float, default=10.0, help="lease length [10, the default]")
    parser.add_argument(
        "--workers", type=int, default=0, help="threads of each node's executor [APScheduler's default, 10]"
    )
    parser.add_argument(
        "--pool-size", type=int, default=None,
        help="SQL stores: SQLAlchemy pool_size for the nodes' engines [the store's default]",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    if set(kinds) - set(ALL_STORES) - {"memory"} or "memory" in kinds:
        parser.error(f"choose stores from {', '.join(k for k in ALL_STORES if k != 'memory')}")
    counts = [int(j) for j in args.jobs.split(",")]
    print(f"# Scale ({args.nodes} nodes, {os.cpu_count()} CPUs, {args.duration:g}s per row)\n")
    for kind in kinds:
        if kind == "mongodb" and not os.environ.get("MUTEXCRON_TEST_MONGODB_URL"):
            print("_mongodb: skipped (set MUTEXCRON_TEST_MONGODB_URL)_\n")
            continue
        results = []
        version = kind
        for jobs in counts:
            try:
                iso = isolated(kind)
            except MutexcronError as exc:
                print(f"_{kind}: skipped ({exc})_\n")
                break
            try:
                store = lock_store_from_url(iso.url)
                try:
                    store.ping()
                    version = server_version(kind, store)
                finally:
                    store.close()
                print(f"{kind}: {jobs} jobs...", file=sys.stderr, flush=True)
                results.append(
                    run_one(
                        kind, iso.url, jobs, args.duration, args.warmup, args.drain, args.nodes, args.unactive_interval,
                        {"pool_size": args.pool_size} if args.pool_size and kind != "redis" else None,
                        args.workers,
                    )
                )
            except MutexcronError as exc:
                print(f"_{kind}, {jobs} jobs: failed ({exc})_\n")
            finally:
                iso.cleanup()
        if results:
            note = f", pool_size={args.pool_size}" if args.pool_size and kind != "redis" else ""
            note += f", {args.workers} executor threads per node" if args.workers else ""
            print(render(version, results, args.nodes, args.unactive_interval, note), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
