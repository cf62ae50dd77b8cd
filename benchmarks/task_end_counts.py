"""What the Redis task store's per-minute counts of ended tasks cost a completion, before/after in one run.

    python benchmarks/task_end_counts.py [--tasks 2000] [--batch 50] [--rounds 9] [--url redis://...]

The complete script counts every occurrence it ends (``count_end`` and ``save_ends`` in
:mod:`mutexcron.tasks.stores.redis_scripts`: per call, one ``HINCRBY`` of the minute's hash per
code and way, and an ``EXPIRE`` on the first count of a field) for the dashboard's finished and
cancelled per minute. Here stores on the same server, each in a namespace of its own, complete
the same work: one with the script as shipped ("counted"), one with the same script without
``count_end`` and ``save_ends`` ("uncounted": the script before the counts), and a second
uncounted store ("uncounted again": how far two identical set-ups differ, the noise floor). Per
round, each variant's ``--tasks`` tasks are added and claimed (not timed), then completed Done
(every completion ends its task, so every one is counted: the worst case) in ``complete_many``
calls of ``--batch`` (a worker's batch under load) and, for a quarter of them, in calls of one
(a worker's batch when it is idle). Two measures of the completions alone: the client's wall time, and the
server's CPU time (``INFO cpu``, user + system: what the counts add to the server; unlike a wall
time, a CPU time does not grow when other processes take the cores of a loaded machine). By
default on a private, unpersisted ``redis-server`` this script starts (no other client's work in
its CPU time); ``--url`` uses a running server instead. The variants' calls are interleaved one
by one, so a moment of load on the machine falls on each alike. Prints the median wall time per
completion over calls and the mean server CPU per completion.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta

import redis

from mutexcron.tasks import Done, NewTask, TaskRecord
from mutexcron.tasks.stores.redis import RedisTaskStore
from mutexcron.tasks.stores.redis_scripts import COMPLETE_LUA

UNCOUNTED_LUA = COMPLETE_LUA.replace("  count_end(code, ended)\n", "").replace("\nsave_ends()\n", "\n")
# Only the definitions are left (the script changed if not).
assert UNCOUNTED_LUA.count("count_end(") == 1 and UNCOUNTED_LUA.count("save_ends()") == 1, "the script changed"
NODE = "bench-node"
VARIANTS = ("counted", "uncounted", "uncounted again")
#: Per call: (completions, wall seconds per completion, server CPU seconds per completion).
Measures = tuple[int, float, float]


@contextlib.contextmanager
def private_server() -> Iterator[str]:
    """An unpersisted redis-server on a free port, stopped at the end."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def open_store(base: str, variant: str) -> RedisTaskStore:
    """A store in a namespace of its own; ``uncounted``: its complete script without the counts."""
    name = f"endcount-{variant.replace(' ', '-')}-{secrets.token_hex(3)}"
    store = RedisTaskStore(f"{base}{'&' if '?' in base else '?'}namespace={name}")
    if variant.startswith("uncounted"):
        store._scripts["complete"] = store.backend.script(UNCOUNTED_LUA)
    return store


def server_cpu(client: redis.Redis) -> float:
    """CPU seconds (user + system) the server has used so far."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def claimed_tasks(store: RedisTaskStore, tasks: int) -> list[TaskRecord]:
    store.add_many([NewTask("bench", f"k{i}", timedelta(0)) for i in range(tasks)])
    claimed: list[TaskRecord] = []
    while len(claimed) < tasks:
        claimed += store.claim(NODE, ["bench"], 500, 300)
    return claimed


def one_round(stores: dict[str, RedisTaskStore], stats: redis.Redis, tasks: int, batch: int) -> dict[str, list[Measures]]:
    """Every variant's ``tasks`` added and claimed (not timed), then completed call by call, the
    variants' calls interleaved (the order rotating), so that a moment of load on the machine falls
    on every variant alike: per call, (wall, server CPU) seconds per completion, batched then single."""
    claimed = {variant: claimed_tasks(store, tasks) for variant, store in stores.items()}
    singles = tasks // 4
    calls = [(i, min(i + batch, tasks)) for i in range(singles, tasks, batch)] + [(i, i + 1) for i in range(singles)]
    out: dict[str, list[Measures]] = {variant: [] for variant in stores}
    order = list(stores)
    for n, (first, last) in enumerate(calls):
        for variant in order[n % len(order) :] + order[: n % len(order)]:
            chunk = [(t.code, t.key, t.token, Done()) for t in claimed[variant][first:last]]
            server, started = server_cpu(stats), time.perf_counter()
            assert all(stores[variant].complete_many(NODE, chunk))
            wall = (time.perf_counter() - started) / len(chunk)
            out[variant].append((len(chunk), wall, (server_cpu(stats) - server) / len(chunk)))
    return out


def run(base: str, tasks: int, batch: int, rounds: int) -> dict[str, list[Measures]]:
    stores = {variant: open_store(base, variant) for variant in VARIANTS}
    stats = redis.Redis.from_url(base)
    results: dict[str, list[Measures]] = {variant: [] for variant in VARIANTS}
    try:
        one_round(stores, stats, 200, batch)  # warm-up: scripts loaded, connections open
        for _ in range(rounds):
            for variant, measures in one_round(stores, stats, tasks, batch).items():
                results[variant] += measures
    finally:
        for store in stores.values():
            store.destroy_namespace()
            store.close()
        stats.close()
    return results


def figures(measures: list[Measures]) -> list[float]:
    """Batched then single: the median wall time per completion over calls, and the mean server CPU
    per completion (the kernel charges CPU time a tick at a time: one call's share is a sample, the
    sum over many calls is right)."""
    out = []
    for batched in (True, False):
        calls = [m for m in measures if (m[0] > 1) == batched]
        out.append(statistics.median(wall for _, wall, _ in calls))
        out.append(sum(n * cpu for n, _, cpu in calls) / sum(n for n, _, _ in calls))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="tasks completed per round and variant [2000]")
    parser.add_argument("--batch", type=int, default=50, help="completions per complete_many call [50]")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds [9]")
    parser.add_argument("--url", help="a running Redis server instead of a private one")
    args = parser.parse_args()
    with contextlib.nullcontext(args.url) if args.url else private_server() as base:
        results = run(base, args.tasks, args.batch, args.rounds)
    medians = {variant: figures(measures) for variant, measures in results.items()}
    print(f"Redis completions, {args.tasks:,} tasks x {args.rounds} rounds per variant, calls interleaved; "
          "µs per completion (wall: median over calls; server CPU: mean):\n")  # fmt: skip
    print(f"| variant | complete_many (batch of {args.batch}): wall | server CPU | complete (one call each): wall | server CPU |")
    print("|---|---:|---:|---:|---:|")
    for variant, values in medians.items():
        print(f"| {variant} | " + " | ".join(f"{v * 1e6:.1f}" for v in values) + " |")
    for label, top in (("counted / uncounted", "counted"), ("uncounted again / uncounted (noise)", "uncounted again")):
        ratios = [medians[top][i] / medians["uncounted"][i] for i in range(4)]
        print(f"| {label} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
