"""What a Mutex costs: ``hold()`` + release next to the same store's raw round trip.

    python benchmarks/mutex.py [--stores memory,sqlite,mysql,postgresql,redis,mongodb] [--iterations 1000]

For each reachable store, in one run and interleaved (so drift hits both alike), it times:

* ``store.ping()``: one raw round trip through the store's own plumbing (``SELECT 1``, ``PING``);
* ``with mutex.hold(name, wait=False): pass``, uncontended: an acquire and a conditional release,
  so two round trips at best, plus the renewer bookkeeping (a held lease is not renewed before
  lease/3, so no renewal happens here);
* the floor: the same ``acquire_or_renew`` + ``release`` called on the store directly, so the
  difference is what the Mutex itself adds (argument checks, bookkeeping, the renewer hand-off);
* the same hold while another Mutex holds the lock: the refused ``wait=False`` answer (one round trip).

It prints p50/p99 in milliseconds and the ratios to the raw round trip. Server URLs:
``MUTEXCRON_TEST_<KIND>_URL`` or the local defaults; MongoDB only when its variable is set. Every
store gets its own table / namespace / collection / file, removed at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from overhead import ALL_STORES, isolated

from mutexcron import Mutex
from mutexcron.errors import MutexcronError
from mutexcron.locks import Node


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def percentile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples``, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def measure(url: str, iterations: int) -> dict[str, list[float]]:
    """Interleaved samples (seconds) of ping, hold+release and a refused hold."""
    mutex, rival = Mutex(url), Mutex(url)
    store = mutex.store

    def hold_release() -> None:
        with mutex.hold("bench", lease=30, wait=False) as lease:
            assert lease, "uncontended"

    def refused() -> None:
        with mutex.hold("bench-busy", lease=30, wait=False) as lease:
            assert not lease, "held by the rival"

    node = Node("bench-raw:1:000000", "127.0.0.1")

    def raw_ops() -> None:
        result = store.acquire_or_renew("bench-raw", node, 30)
        assert result.acquired and store.release("bench-raw", node, result.token)

    samples: dict[str, list[float]] = {"ping": [], "hold": [], "raw": [], "refused": []}
    try:
        with rival.hold("bench-busy", lease=30):
            for i in range(iterations + iterations // 10):  # the first tenth warms pools and caches
                row = {"ping": timed(store.ping), "hold": timed(hold_release), "raw": timed(raw_ops), "refused": timed(refused)}
                if i >= iterations // 10:
                    for key, value in row.items():
                        samples[key].append(value)
    finally:
        mutex.close()
        rival.close()
    return samples


def row(kind: str, samples: dict[str, list[float]]) -> list[str]:
    ping50, ping99 = percentile(samples["ping"], 0.5), percentile(samples["ping"], 0.99)
    hold50, hold99 = percentile(samples["hold"], 0.5), percentile(samples["hold"], 0.99)
    raw50, busy50 = percentile(samples["raw"], 0.5), percentile(samples["refused"], 0.5)
    ms = lambda s: f"{s * 1000:.3f}"  # noqa: E731
    return [
        kind, ms(ping50), ms(ping99), ms(hold50), ms(hold99),
        f"{hold50 / ping50:.1f}x", f"{hold99 / ping99:.1f}x", ms(raw50), f"{(hold50 - raw50) * 1e6:+.0f}",
        f"{ms(busy50)} ({busy50 / ping50:.1f}x)",
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(ALL_STORES), help="comma-separated store kinds")
    parser.add_argument("--iterations", type=int, default=1000)
    args = parser.parse_args()
    header = ["store", "ping p50", "ping p99", "hold+release p50", "p99", "ratio p50", "ratio p99"]
    header += ["store ops p50", "Mutex adds (µs, p50)", "refused p50"]
    rows: list[list[str]] = []
    for kind in args.stores.split(","):
        try:
            iso = isolated(kind)
            try:
                rows.append(row(kind, measure(iso.url, args.iterations)))
            finally:
                iso.cleanup()
        except MutexcronError as exc:  # no server configured or reachable: say so, go on
            print(f"skipped {kind}: {exc}", file=sys.stderr)
    print(f"Mutex.hold()+release vs raw round trip, ms ({args.iterations} iterations, Python {sys.version.split()[0]})\n")
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    print(f"\nmedian of ratios: {statistics.median(float(r[5][:-1]) for r in rows):.1f}x" if rows else "no store reachable")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
