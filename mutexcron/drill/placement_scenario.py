"""The placement drill (``mutexcron drill --placement``): N nodes join one by one, one leaves
(SIGTERM), one is killed (SIGKILL), one comes back; after each change the locks must follow.

The nodes run :mod:`mutexcron.drill.placement_node_jobs` under balanced placement: every-second
jobs, each on its own lock of the drill's (``mutexcron-drill-<random>-<j>``). The drill reads
the lock records (one ``read_many`` every 0.1 s) to time, after each change, when the struck
node's locks were held by another node and when every live node held its fair share; it reads the
runs the nodes recorded to count the fire times run twice and those missed.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigurationError, MutexcronError
from ..locks import LockStore, lock_store_from_url
from .cluster import Cluster
from .placement_report import KILL_MOVED_MARGIN, TERM_MOVED_LIMIT, Change, PlacementDrillReport, shares_balanced
from .report import format_gap
from .scenario import check_drill_url, reachable_masked_url

#: What the nodes run: every-second jobs under balanced placement, each on its own lock.
PLACEMENT_NODE_JOBS = "mutexcron.drill.placement_node_jobs:sched"
#: Locks (one every-second job each) the drill's nodes share by default.
PLACEMENT_LOCKS = 30
#: Seconds a node may take to start (an interpreter on a loaded machine).
START_DEADLINE = 90.0
#: Seconds between two reads of the drill's lock records.
POLL = 0.1

Progress = Callable[[str], None]


def run_placement_drill(
    lock_url: str,
    *,
    nodes: int = 3,
    lease: float = 3.0,
    locks: int = PLACEMENT_LOCKS,
    duration: float = 60.0,
    progress: Progress = lambda _msg: None,
) -> PlacementDrillReport:
    """Play the joins, the leave, the kill and the return; return the report.

    Everything is cleaned up on the way out, including on KeyboardInterrupt: the nodes are
    stopped and the drill's locks released (their records stay, so fencing tokens never go back).
    The nodes' logs and records are removed if the drill passed, else kept (``report.logs``).

    Raises:
        ConfigurationError: a store the nodes cannot share, fewer than 3 nodes or no lock.
        StoreUnavailableError: the store cannot be reached.
        MutexcronError: a node did not start or crashed.
    """
    masked = _preflight(lock_url, nodes, locks)
    report = PlacementDrillReport(nodes=nodes, lease=lease, locks=locks, store=masked)
    cluster = Cluster(
        lock_url, nodes=1, unactive_interval=lease, jobs=PLACEMENT_NODE_JOBS, env={"MUTEXCRON_DRILL_LOCKS": str(locks)},
        progress=progress,
    )  # fmt: skip
    names = [f"{cluster.lock}-{j}" for j in range(locks)]
    cluster.release_locks, cluster.verdict_pending = tuple(names), True
    started = time.monotonic()
    store = lock_store_from_url(lock_url)
    try:
        with cluster:
            watch = Watch(cluster, store, names, report)
            progress(
                f"join: {nodes} nodes one by one, {locks} every-second jobs on locks {names[0]}..{names[-1]} in {cluster.workdir}"
            )
            watch.join(cluster.alive()[0])
            for index in range(1, nodes):
                watch.join(cluster.start_node(index))
            watch.strike("term", signal.SIGTERM, TERM_MOVED_LIMIT)
            watch.strike("kill", signal.SIGKILL, lease + KILL_MOVED_MARGIN)
            watch.join(cluster.start_node(nodes), kind="return")
            rest = max(duration - (time.monotonic() - started), 3.0)
            progress(f"cool-down: {rest:.0f}s")
            time.sleep(rest)
            cluster.check_nodes()
            until = time.time() - 1.0  # the fire times of the last second may still be running
        first = report.changes[0]
        since = first.wall + (first.balanced or 0.0)  # from when the first node held every lock
        report.count_runs(read_runs(cluster.out), since, until)
    finally:
        store.close()
    report.lock_left = cluster.lock_left
    report.seconds = time.monotonic() - started
    report.logs = cluster.keep_or_discard(report.passed)
    return report


def _preflight(lock_url: str, nodes: int, locks: int) -> str:
    """Check what the drill needs before it starts a node; return the store's masked URL."""
    if nodes < 3:
        raise ConfigurationError("the placement drill needs at least 3 nodes (one leaves, one is killed, one stays)")
    if locks < 1:
        raise ConfigurationError("the placement drill needs at least 1 lock")
    check_drill_url(lock_url)
    return reachable_masked_url(lock_url)


class Watch:
    """Makes the changes and times how the drill's locks follow them, from their records."""

    def __init__(self, cluster: Cluster, store: LockStore, names: list[str], report: PlacementDrillReport) -> None:
        self.cluster, self.store, self.names, self.report = cluster, store, names, report
        self.live: list[str] = []
        self.ready_file = Path(f"{cluster.out}.ready")

    def holders(self) -> dict[str, str | None]:
        """Lock -> its holder while its lease runs (None: free, released or stale), one read."""
        records = self.store.read_many(self.names)
        return {n: (r.holder if (r := records.get(n)) is not None and r.state == "active" else None) for n in self.names}

    def join(self, node: str, kind: str = "join") -> None:
        """Wait for ``node`` to start, then time its share."""
        started = self._wait_ready(node)
        self.live.append(node)
        change = Change(kind, node, at=started, wall=time.time() - (time.monotonic() - started), live=list(self.live))
        self._say(f"{kind}: {node} started ({len(self.live)} live)")
        self._settle(change, moved_from=None)

    def strike(self, kind: str, sig: int, moved_limit: float) -> None:
        """Signal the longest-running live node; time until its locks are held elsewhere, and the shares."""
        node = self.live.pop(0)
        held = {lock for lock, holder in self.holders().items() if holder == node}
        self._say(f"{kind}: {signal.Signals(sig).name} {node}, which holds {len(held)} lock(s)")
        at, wall = self.cluster.signal(node, sig), time.time()
        change = Change(kind, node, at=at, wall=wall, live=list(self.live), moved_limit=moved_limit)
        self._settle(change, moved_from=held)

    def _settle(self, change: Change, moved_from: set[str] | None) -> None:
        """Poll the records until the shares are balanced (and the struck node's locks held
        elsewhere), or a generous bound passes; record the times in ``change``."""
        lease = self.report.lease
        change.balanced_limit = 2 * lease
        deadline = change.at + max(4 * lease, lease + 10.0)
        counts: Counter[str] = Counter()
        while time.monotonic() < deadline:
            holders = self.holders()
            now = time.monotonic()
            counts = Counter(h for h in holders.values() if h is not None)
            elsewhere = moved_from is not None and all(holders[lock] not in (None, change.node) for lock in moved_from)
            if elsewhere and change.moved is None:
                change.moved = now - change.at
            if change.balanced is None and shares_balanced(counts, change.live, len(self.names)):
                change.balanced = now - change.at
            if change.balanced is not None and (moved_from is None or change.moved is not None):
                break
            self.cluster.check_nodes()
            time.sleep(POLL)
        change.shares = dict(sorted(counts.items()))
        self.report.changes.append(change)
        moved = "" if change.moved_limit is None else f"its locks held elsewhere after {format_gap(change.moved)}, "
        self._say(f"{change.kind}: {moved}shares balanced after {format_gap(change.balanced)}")

    def _wait_ready(self, node: str) -> float:
        """``time.monotonic()`` when ``node``'s scheduler started (its ready line)."""
        deadline = time.monotonic() + START_DEADLINE
        while time.monotonic() < deadline:
            for line in self.ready_file.read_text().splitlines() if self.ready_file.exists() else []:
                try:
                    mark = json.loads(line)
                except ValueError:
                    continue  # a half-written last line
                if mark.get("ready") == node:
                    return float(mark["mono"])
            self.cluster.check_nodes()
            time.sleep(0.05)
        raise MutexcronError(f"drill node {node} did not start within {START_DEADLINE:g}s:\n{self.cluster.log_tail(node)}")

    def _say(self, message: str) -> None:
        if self.cluster.progress is not None:
            self.cluster.progress(message)


def read_runs(path: Path) -> list[tuple[int, float]]:
    """(job, fire time) of every run the nodes recorded (none if the file does not exist)."""
    if not path.exists():
        return []
    runs = []
    for line in path.read_text().splitlines():
        try:
            run = json.loads(line)
            runs.append((int(run["job"]), float(run["fire"])))
        except (ValueError, KeyError, TypeError):
            continue  # a half-written last line
    return runs
