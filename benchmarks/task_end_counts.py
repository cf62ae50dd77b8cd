"""What the Redis task store's per-minute counts of ended tasks cost a completion, before/after in one run.

    python benchmarks/task_end_counts.py [--tasks 2000] [--batch 50] [--rounds 8]

The complete script counts every occurrence it ends (``count_end`` in
:mod:`mutexcron.tasks.stores.redis_scripts`: an ``HINCRBY`` of the minute's hash, and an
``EXPIRE`` on the first count of a field) for the dashboard's finished and cancelled per minute.
Here two stores on the same server, each in a namespace of its own, complete the same work: one
with the script as shipped ("counted"), one with the same script without the ``count_end`` call
("uncounted": the script before the counts), and a second uncounted store ("uncounted again":
how far two identical set-ups differ, the noise floor). Per round and variant (the order rotates):
``--tasks`` tasks added and claimed (not timed), then completed Done (every completion ends its
task, so every one is counted: the worst case) in ``complete_many`` calls of ``--batch`` (a
worker's batch) and, for a quarter of them, in single ``complete`` calls; the wall time of the
completions alone. Prints the medians over rounds and counted/uncounted. Server URL:
``MUTEXCRON_TEST_REDIS_URL`` or ``redis://127.0.0.1:6379/0``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
from datetime import timedelta

from mutexcron.tasks import Done, NewTask
from mutexcron.tasks.stores.redis import RedisTaskStore
from mutexcron.tasks.stores.redis_scripts import COMPLETE_LUA

UNCOUNTED_LUA = COMPLETE_LUA.replace("  count_end(code, ended)\n", "")
NODE = "bench-node"


def open_store(base: str, variant: str) -> RedisTaskStore:
    """A store in a namespace of its own; ``uncounted``: its complete script without the counts."""
    name = f"endcount-{variant.replace(' ', '-')}-{secrets.token_hex(3)}"
    store = RedisTaskStore(f"{base}{'&' if '?' in base else '?'}namespace={name}")
    if variant.startswith("uncounted"):
        store._scripts["complete"] = store.backend.script(UNCOUNTED_LUA)
    return store


def one_round(store: RedisTaskStore, tasks: int, batch: int) -> tuple[float, float]:
    """Seconds per completion: in batches of ``batch``, and one by one (a quarter of the tasks)."""
    store.add_many([NewTask("bench", f"k{i}", timedelta(0)) for i in range(tasks)])
    claimed = []
    while len(claimed) < tasks:
        claimed += store.claim(NODE, ["bench"], 500, 300)
    singles, batched = claimed[: tasks // 4], claimed[tasks // 4 :]
    started = time.perf_counter()
    for i in range(0, len(batched), batch):
        chunk = batched[i : i + batch]
        assert all(store.complete_many(NODE, [(t.code, t.key, t.token, Done()) for t in chunk]))
    per_batched = (time.perf_counter() - started) / len(batched)
    started = time.perf_counter()
    for t in singles:
        assert store.complete(NODE, t.code, t.key, t.token, Done())
    per_single = (time.perf_counter() - started) / len(singles)
    return per_batched, per_single


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="tasks completed per round and variant [2000]")
    parser.add_argument("--batch", type=int, default=50, help="completions per complete_many call [50]")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds [8]")
    args = parser.parse_args()
    base = os.environ.get("MUTEXCRON_TEST_REDIS_URL") or "redis://127.0.0.1:6379/0"
    variants = ("counted", "uncounted", "uncounted again")
    stores = {variant: open_store(base, variant) for variant in variants}
    results: dict[str, list[tuple[float, float]]] = {variant: [] for variant in stores}
    try:
        for variant in variants:  # warm-up: scripts loaded, connections open
            one_round(stores[variant], 200, args.batch)
        for r in range(args.rounds):
            for variant in variants[r % 3 :] + variants[: r % 3]:
                results[variant].append(one_round(stores[variant], args.tasks, args.batch))
    finally:
        for store in stores.values():
            store.destroy_namespace()
            store.close()
    medians = {v: (statistics.median(b for b, _ in rs), statistics.median(s for _, s in rs)) for v, rs in results.items()}
    print(f"Redis completions, {args.tasks:,} tasks x {args.rounds} rounds per variant, medians (µs per completion):\n")
    print(f"| variant | complete_many (batch of {args.batch}) | complete (one call each) |")
    print("|---|---:|---:|")
    for variant, (batched, single) in medians.items():
        print(f"| {variant} | {batched * 1e6:.1f} | {single * 1e6:.1f} |")
    for label, top in (("counted / uncounted", "counted"), ("uncounted again / uncounted (noise)", "uncounted again")):
        ratios = [medians[top][i] / medians["uncounted"][i] for i in (0, 1)]
        print(f"| {label} | {ratios[0]:.3f} | {ratios[1]:.3f} |")


if __name__ == "__main__":
    main()
