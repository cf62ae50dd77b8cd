"""How the cluster shares its locks: N real `mutexcron run` nodes x J every-second jobs, each on its own lock.

    python benchmarks/placement.py [--stores sqlite,mysql,postgresql,redis] [--jobs 300] [--nodes 3] [--lease 10]

For each store, the scenario of the issue's "Sharing" target, one phase after the other:

1. the nodes join one after another (the first alone until it holds every lock, then each once
   the previous one runs): seconds from the last node's start until every node holds its share
   (J / N, within 10 %), and the shares then;
2. one node leaves by SIGTERM: seconds until all of its locks are held by the others;
3. one node is killed (SIGKILL): seconds until all of its locks are held by the survivors;
4. the first node comes back: seconds until every live node holds its share again.

Then, over the whole run, every fire time of every job in whole seconds from the second node's
start to the end: how many ran twice (must be 0), how many ran on no node outside the kill's outage (the fire
times lost in the moves), and how many the kill cost (from the kill until its locks were held
again, plus a second: by design, a lease's worth of the killed node's fire times, coalesced into
one run each when taken over). The nodes run ``scale_jobs.py`` (each job appends its runs, see ``scale_runs.py``). Prints one
markdown table; the store URLs are those of ``overhead.py`` (``MUTEXCRON_TEST_<KIND>_URL``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from overhead import Isolated, isolated, md_table, server_version
from scale_runs import read_runs

from mutexcron.errors import MutexcronError
from mutexcron.locks import lock_store_from_url
from mutexcron.locks.base import LockStore

JOBS_FILE = str(Path(__file__).with_name("scale_jobs.py"))
START_DEADLINE = 120.0  # a loaded machine may take long to start an interpreter


class Nodes:
    """The node processes of one store's run, started and stopped one at a time."""

    def __init__(self, url: str, jobs: int, lease: float, workdir: Path) -> None:
        self.lease, self.workdir = lease, workdir
        self.prefix = f"placement-{secrets.token_hex(3)}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        base = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
        self.env = {
            **base, "MUTEXCRON_DRILL_URL": url, "MUTEXCRON_DRILL_PARENT": str(os.getpid()),
            "MUTEXCRON_SCALE_DIR": str(workdir), "MUTEXCRON_SCALE_PREFIX": self.prefix,
            "MUTEXCRON_SCALE_JOBS": str(jobs), "MUTEXCRON_SCALE_LOCKS": str(jobs), "MUTEXCRON_SCALE_STORE_OPTIONS": "{}",
            "MUTEXCRON_SCALE_WORKERS": "", "PYTHONUNBUFFERED": "1", "MUTEXCRON_PLACEMENT": "balanced",
        }  # fmt: skip

    def start(self, node_id: str, store: LockStore) -> None:
        log = open(self.workdir / f"{node_id}.log", "ab")  # the process keeps its own copy
        self.procs[node_id] = subprocess.Popen(
            [sys.executable, "-m", "mutexcron", "run", JOBS_FILE, "--node-id", node_id,
             "--unactive-interval", str(self.lease), "--log-level", "warning"],
            env={**self.env, "MUTEXCRON_NODE_ID": node_id, "MUTEXCRON_DRILL_OPS": str(self.workdir / f"{node_id}.ops.jsonl")},
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )  # fmt: skip
        log.close()
        wait(lambda: held_by(store, self.prefix)[node_id] > 0 or self.procs[node_id].poll() is not None, START_DEADLINE)
        if self.procs[node_id].poll() is not None:
            raise MutexcronError(f"node {node_id} exited at start; see {self.workdir / (node_id + '.log')}")

    def stop(self, node_id: str, sig: int) -> None:
        proc = self.procs.pop(node_id)
        proc.send_signal(sig)
        proc.wait(timeout=60)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait(condition: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``condition`` held (polled every 50 ms), or None after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            return None
        time.sleep(0.05)
    return time.monotonic() - start


def held_by(store: LockStore, prefix: str) -> Counter[str | None]:
    return Counter(r.holder if r.state == "active" else None for r in store.list() if r.name.startswith(prefix))


def fair(counts: Counter[str | None], nodes: list[str], jobs: int) -> bool:
    share = jobs / len(nodes)
    return sum(counts[n] for n in nodes) == jobs and all(abs(counts[n] - share) <= max(1.0, 0.1 * share) for n in nodes)


def run_store(kind: str, jobs: int, count: int, lease: float) -> dict[str, object]:
    iso: Isolated = isolated(kind)
    workdir = Path(tempfile.mkdtemp(prefix="mutexcron-placement-"))
    store = lock_store_from_url(iso.url)
    nodes = Nodes(iso.url, jobs, lease, workdir)
    ids = [f"n{i}" for i in range(count)]
    bound = 6 * lease
    row: dict[str, object] = {"store": server_version(kind, store)}
    try:
        nodes.start(ids[0], store)
        wait(lambda: held_by(store, nodes.prefix)[ids[0]] == jobs, bound)
        first = time.time() + 1  # from here on, every fire time runs somewhere
        for node_id in ids[1:]:
            nodes.start(node_id, store)
        row["join"] = wait(lambda: fair(held_by(store, nodes.prefix), ids, jobs), bound)
        row["shares"] = "/".join(str(held_by(store, nodes.prefix)[n]) for n in ids)
        nodes.stop(ids[0], signal.SIGTERM)
        rest = ids[1:]
        row["sigterm"] = wait(lambda: sum(held_by(store, nodes.prefix)[n] for n in rest) == jobs, bound)
        wait(lambda: fair(held_by(store, nodes.prefix), rest, jobs), bound)
        killed_at = time.time()
        nodes.stop(ids[1], signal.SIGKILL)
        survivors = ids[2:]
        row["sigkill"] = wait(lambda: sum(held_by(store, nodes.prefix)[n] for n in survivors) == jobs, bound)
        outage = range(int(killed_at), int(time.time()) + 2)  # the killed node's fire times until its locks are held again
        nodes.start(ids[0], store)
        back = [ids[0], *survivors]
        row["return"] = wait(lambda: fair(held_by(store, nodes.prefix), back, jobs), bound)
        last = time.time()
    finally:
        nodes.close()
        store.close()
        iso.cleanup()
    time.sleep(1.5)  # the nodes' run logs are flushed once a second
    runs = Counter((r.job, round(r.fire)) for r in read_runs(workdir))
    window = range(int(first) + 1, int(last))
    expected = {(j, t) for j in range(jobs) for t in window}
    row["doubled"] = sum(1 for key, n in runs.items() if n > 1 and key[1] in window)
    missed = expected - set(runs)
    in_moves = sum(1 for _job, t in missed if t not in outage)
    row["missed"], row["kill_outage"] = in_moves, len(missed) - in_moves
    row["fire_times"] = len(expected)
    return row


def seconds(value: object) -> str:
    return "timeout" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,mysql,postgresql,redis", help="comma-separated stores")
    parser.add_argument("--jobs", type=int, default=300, help="every-second jobs, each on its own lock [300]")
    parser.add_argument("--nodes", type=int, default=3, help="nodes (at least 3) [3]")
    parser.add_argument("--lease", type=float, default=10.0, help="lease length, seconds [10, the default]")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if args.nodes < 3:
        parser.error("--nodes: at least 3 (one leaves, one is killed, one stays)")
    rows = []
    for kind in [k.strip() for k in args.stores.split(",") if k.strip()]:
        print(f"{kind}: {args.nodes} nodes x {args.jobs} locks...", file=sys.stderr, flush=True)
        rows.append(run_store(kind, args.jobs, args.nodes, args.lease))
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print(f"# Placement: {args.nodes} nodes x {args.jobs} every-second jobs, each on its own lock, lease {args.lease:g}s\n")
    header = ["store", "share after last join (s)", "shares", "SIGTERM: held elsewhere (s)", "SIGKILL: held elsewhere (s)",
              "return: share again (s)", "fire times", "missed in moves", "lost to the kill", "doubled"]  # fmt: skip
    body = [
        [str(r["store"]), seconds(r["join"]), str(r["shares"]), seconds(r["sigterm"]), seconds(r["sigkill"]),
         seconds(r["return"]), f"{r['fire_times']:,}", str(r["missed"]), str(r["kill_outage"]), str(r["doubled"])]
        for r in rows
    ]  # fmt: skip
    print(md_table(header, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
