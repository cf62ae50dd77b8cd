"""Failover timing: the drill, run several times per store; gaps after SIGKILL and SIGTERM.

    python benchmarks/failover.py [--stores sqlite,mysql,postgresql,redis] [--runs 5] [--unactive-interval 3]

Each run is :func:`mutexcron.drill.run_drill` (3 real nodes: SIGKILL, SIGSTOP/SIGCONT, SIGTERM of
the holder). For each store it prints the median and the max of

* the gap after SIGKILL and after SIGSTOP: from the signal to the next run on another node, and
  the takeover alone (the new holder's lease in the store), also as a ratio to ``unactive_interval``;
* the gap after SIGTERM (a graceful hand-off, limit 1.5 s),

and how many runs passed the drill's verdict. The store URLs are those of ``overhead.py``; each
store gets one table / namespace for all its runs, dropped at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

from overhead import ALL_STORES, isolated, md_table

from mutexcron.drill import DrillReport, run_drill
from mutexcron.errors import MutexcronError

log = logging.getLogger("benchmarks.failover")


def summarize(kind: str, reports: list[DrillReport], ui: float) -> list[list[str]]:
    rows = []
    for phase, label in (("kill", "SIGKILL"), ("freeze", "SIGSTOP"), ("term", "SIGTERM")):
        for what, values in (
            ("next run", [r.gaps.get(phase) for r in reports]),
            ("lock moved", [r.takeover.get(phase) for r in reports]),
        ):
            done = [v for v in values if v is not None]
            if not done:
                continue
            med, top = statistics.median(done), max(done)
            never = len(values) - len(done)
            rows.append([
                kind, f"{label}: {what}", f"{med:.2f}", f"{top:.2f}", f"{med / ui:.2f}", f"{top / ui:.2f}",
                f"{sum(r.passed for r in reports)}/{len(reports)}" + (f", {never} never" if never else ""),
            ])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,mysql,postgresql,redis", help="comma-separated")
    parser.add_argument("--runs", type=int, default=5, help="drills per store [5]")
    parser.add_argument("--unactive-interval", type=float, default=3.0, help="lease length [3, the drill's default]")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per drill [30]")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    if set(kinds) - set(ALL_STORES) or "memory" in kinds:
        parser.error(f"choose stores from {', '.join(k for k in ALL_STORES if k != 'memory')}")
    ui = args.unactive_interval
    print(f"# Failover ({args.runs} drills per store, 3 nodes, unactive_interval {ui:g}s, {os.cpu_count()} CPUs)\n")
    rows: list[list[str]] = []
    failures: list[str] = []
    for kind in kinds:
        if kind == "mongodb" and not os.environ.get("MUTEXCRON_TEST_MONGODB_URL"):
            print("_mongodb: skipped (set MUTEXCRON_TEST_MONGODB_URL)_\n")
            continue
        try:
            iso = isolated(kind)
        except MutexcronError as exc:
            print(f"_{kind}: skipped ({exc})_\n")
            continue
        reports = []
        try:
            for i in range(args.runs):
                print(f"{kind}: drill {i + 1}/{args.runs}", file=sys.stderr, flush=True)
                report = run_drill(iso.url, nodes=3, unactive_interval=ui, duration=args.duration)
                reports.append(report)
                failures += [f"{kind} run {i + 1}: {f}" for f in report.failures]
        except MutexcronError as exc:
            print(f"_{kind}: the drill could not run ({exc})_\n")
        finally:
            iso.cleanup()
        rows += summarize(kind, reports, ui)
    header = ["store", "gap", "median s", "max s", "median / unactive_interval", "max / unactive_interval", "drills passed"]
    print(md_table(header, rows))
    if failures:
        print("\nFailures:\n\n" + "\n".join(f"* {f}" for f in failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
