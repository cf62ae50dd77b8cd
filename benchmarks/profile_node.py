"""Where a guarded node's CPU goes: yappi (CPU clock, all threads) inside one node of a real cluster.

    python benchmarks/profile_node.py [--store postgresql] [--jobs 100] [--placement balanced]
                                      [--seconds 30] [--top 40] [--out FILE]

Starts ``--nodes`` ``mutexcron run benchmarks/scale_jobs.py`` nodes as ``scale.py`` does (the store URLs of
``overhead.py``); the first node profiles itself (``MUTEXCRON_SCALE_PROFILE``) for ``--seconds`` after
``--warmup`` seconds, writes the stats, and the driver prints the top functions by total and own
time, each with its share of the node's profiled CPU. Profiling slows the node: read shares, not times.
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import shutil
import sys
import threading
import time
from pathlib import Path

from overhead import ALL_STORES, isolated
from scale import RowSet, Settings, guarded_cluster


def profile_in_node(spec: str) -> None:
    """In a node: profile every thread for the given seconds after the warm-up (``spec``:
    ``warmup:seconds:file``), then write the stats as pstats."""
    import yappi

    warmup, seconds, path = spec.split(":", 2)

    def run() -> None:
        time.sleep(float(warmup))
        yappi.set_clock_type("cpu")
        yappi.start(builtins=True, profile_threads=True)
        time.sleep(float(seconds))
        yappi.stop()
        yappi.get_func_stats().save(path + ".tmp", type="pstat")
        os.replace(path + ".tmp", path)

    threading.Thread(target=run, name="scale-profile", daemon=True).start()


def report(path: Path, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    total = max(stats.total_tt, 1e-9)  # type: ignore[attr-defined]
    out.write(f"profiled CPU: {total:.2f}s\n")
    for key in ("cumulative", "tottime"):
        out.write(f"\n## by {key} (share of the profiled CPU)\n")
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3] if key == "cumulative" else kv[1][2], reverse=True)  # type: ignore[attr-defined]
        for (file, line, name), (_cc, calls, tt, ct, _callers) in rows[:top]:
            value = ct if key == "cumulative" else tt
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if file != "~" else "builtin"
            out.write(f"{100 * value / total:5.1f}%  {calls:>8}  {name}  ({where})\n")
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="postgresql", choices=[s for s in ALL_STORES if s != "memory"])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--placement", default="balanced")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", help="also keep the stats (pstats) in this file")
    args = ap.parse_args()
    settings = Settings(duration=args.seconds, warmup=args.warmup, drain=0, nodes=args.nodes, lease=10.0, workers=0,
                        pool_size=None, placement=args.placement)  # fmt: skip
    iso = isolated(args.store)
    try:
        cluster = guarded_cluster(args.store, iso.url, RowSet(args.jobs, args.jobs), settings)
        path = cluster.workdir / "node.pstat"
        with cluster:
            first = next(iter(cluster.procs))
            cluster.procs[first].kill()  # restarted with the profiler on
            cluster.procs.pop(first)
            cluster.start_node(0, env={"MUTEXCRON_SCALE_PROFILE": f"{args.warmup}:{args.seconds}:{path}"})
            deadline = time.monotonic() + args.warmup + args.seconds + 60
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.5)
            if not path.exists():
                sys.exit("the profiled node wrote no stats")
            print(report(path, args.top))
            if args.out:
                shutil.copyfile(path, args.out)
    finally:
        iso.cleanup()


if __name__ == "__main__":
    main()
