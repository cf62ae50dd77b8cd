"""What a guarded coroutine job's store call costs on the event loop: a worker thread or a native
asyncio client?

    python benchmarks/asyncio_tick.py [--iterations 2000] [--redis redis://127.0.0.1:6379/0]

AsyncIOMutexScheduler runs the tick's claim and the hand-off with ``asyncio.to_thread`` around
the ordinary (blocking) store. The alternative is a native asyncio driver (redis.asyncio here).
This prints, per call, in the same run: the blocking call itself (the baseline), the same call
through ``asyncio.to_thread``, and the native asyncio client's call, for a raw ``PING`` and for
the lock store's ``acquire_or_renew`` (holder renew + fire claim, one Lua script).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mutexcron.locks import FireClaim, Node, lock_store_from_url


def _p50_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure_sync(call: Callable[[], Any], n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return _p50_us(samples)


async def measure_async(call: Callable[[], Awaitable[Any]], n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - t0)
    return _p50_us(samples)


async def run(url: str, n: int) -> list[tuple[str, float, float, float | None]]:
    import redis.asyncio

    store = lock_store_from_url(f"{url}?namespace=bench-aio-{time.time_ns()}")
    node = Node("bench", "127.0.0.1")
    fire = [0]

    def acquire() -> Any:
        fire[0] += 1
        return store.acquire_or_renew("bench", node, 30.0, FireClaim.new("job", fire[0]))

    client = redis.asyncio.from_url(url)
    try:
        ping = store.ping
        rows = [
            ("PING", measure_sync(ping, n), await measure_async(lambda: asyncio.to_thread(ping), n),
             await measure_async(client.ping, n)),
            ("acquire_or_renew + claim", measure_sync(acquire, n),
             await measure_async(lambda: asyncio.to_thread(acquire), n), None),
        ]
    finally:
        await client.aclose()
        store.destroy_namespace()  # type: ignore[attr-defined]
        store.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    rows = asyncio.run(run(args.redis, args.iterations))
    print(f"p50 per call, microseconds ({args.iterations} calls each, same run)\n")
    print("| call | blocking (baseline) | asyncio.to_thread | x baseline | redis.asyncio | x baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, sync, threaded, native in rows:
        native_cells = f"{native:.0f} | {native / sync:.2f}x" if native is not None else "n/a | n/a"
        print(f"| {name} | {sync:.0f} | {threaded:.0f} | {threaded / sync:.2f}x | {native_cells} |")


if __name__ == "__main__":
    main()
