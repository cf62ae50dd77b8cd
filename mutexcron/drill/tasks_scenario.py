"""The task drill (``mutexcron drill --tasks``): the kill, freeze and terminate scenario against the task pool.

N ``mutexcron run`` nodes run :mod:`mutexcron.drill.task_node_jobs` (one handler for a task code
of the drill's own, ``mutexcron-drill-<random>``), while the drill adds tasks of that code at a
steady rate, due 0-3 s ahead. Then:

* **kill**: SIGKILL a node with a handler mid-run and claims ahead (a burst of tasks just before
  fills every node's threads and queue); its tasks must start again on another node once their
  lease runs out, and the claims it never started must cost no attempt;
* **freeze**: SIGSTOP a node with a handler mid-run and claims ahead for 2 x lease + 1 s, then
  SIGCONT; its tasks must start again elsewhere, the frozen handler's late completion must be
  refused, and its unstarted claims must cost no attempt;
* **term**: the drill holds the reply of one claim on a node (so the node has claimed tasks that
  have not started), then SIGTERMs it: those tasks must be handed back and start elsewhere at once.

Then the drill stops adding, lets the cluster drain, and checks that every task it added was
completed once, by its newest attempt. It removes its tasks from the store on the way out (also
after Ctrl-C).
"""

from __future__ import annotations

import random
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import ConfigurationError, MutexcronError, StoreError
from ..tasks import TaskStore, task_store_from_url
from .cluster import Cluster
from .report import format_gap
from .scenario import PHASES, Progress, check_drill_url
from .task_analysis import Ledger, analyse_tasks, read_refused_lines, read_task_events
from .task_report import TaskDrillReport, TaskPhase

__all__ = ["TASK_NODE_JOBS", "Adder", "TaskCluster", "run_task_drill"]

#: What the task drill's nodes run.
TASK_NODE_JOBS = "mutexcron.drill.task_node_jobs:sched"
#: Tasks are due this many seconds ahead at most (uniformly from 0).
DUE_AHEAD = 3.0
#: Each handler sleeps this long (uniformly), so a kill or a freeze lands mid-handler.
HANDLER_SLEEP = (0.3, 1.2)
#: A node to kill or freeze is one whose handler has at least this many seconds left.
MID_HANDLER = 0.3
#: Tasks added at once before a kill or a freeze, per node: more than its threads (8), so it claims ahead;
#: few enough that the others have threads free again when the struck node's lease runs out.
BURST_PER_NODE = 12
#: The burst's handlers sleep this long (uniformly): the claims ahead wait for a thread meanwhile.
BURST_SLEEP = (0.6, 1.0)
#: The node that removes the drill's tasks at the end.
CLEANUP_NODE = "mutexcron-drill-cleanup"


@dataclass
class TaskCluster(Cluster):
    """A :class:`Cluster` whose nodes run the drill's task handler for ``code``.

    :meth:`stop` removes the drill's tasks from the store instead of releasing a lock.
    """

    code: str = field(default_factory=lambda: f"mutexcron-drill-{secrets.token_hex(4)}")
    task_lease: float = 3.0

    def __post_init__(self) -> None:
        self.jobs = TASK_NODE_JOBS
        self.env = {**self.env, "MUTEXCRON_DRILL_TASK_CODE": self.code, "MUTEXCRON_DRILL_TASK_LEASE": str(self.task_lease)}

    def events(self, node: str | None = None) -> list[dict[str, Any]]:
        """Every node's task events so far (or ``node``'s)."""
        return read_task_events(self.workdir, node)

    def ledger(self) -> Ledger:
        return Ledger.of(self.events())

    def hold(self, node: str) -> None:
        """Ask ``node`` to hold the reply of its next claim that returns tasks."""
        (self.workdir / f"{node}.hold").touch()

    def unhold(self, node: str) -> None:
        (self.workdir / f"{node}.hold").unlink(missing_ok=True)

    def refused_lines(self) -> set[tuple[str, int]]:
        return read_refused_lines(self.workdir, self.code)

    def _release_lock(self) -> str:
        """Remove the drill's tasks (every node is stopped by now): cancel them, then drop the
        cancelled ones a dead node still held once their lease runs out (a claim drops them)."""
        try:
            store = task_store_from_url(self.lock_url)
        except ConfigurationError as exc:
            return f"could not open the store to remove the tasks of {self.code}: {exc}"
        removed: set[str] = set()
        deadline = time.monotonic() + self.task_lease + 3.0
        try:
            while True:
                left = store.list(code=self.code, limit=100_000)
                if not left:
                    break
                if time.monotonic() > deadline:
                    return (
                        f"{len(left)} task(s) of {self.code} still in the store (running under a lease): remove them "
                        f"with `mutexcron tasks cancel {self.code} KEY`"
                    )
                for task in left:
                    store.cancel(self.code, task.key)
                    removed.add(task.key)
                for task in store.claim(CLEANUP_NODE, [self.code], 1000, 5.0):  # claimable ones not dropped
                    store.cancel(self.code, task.key)
                time.sleep(0.2)
        except StoreError as exc:
            return f"could not remove the tasks of {self.code}: {exc}"
        finally:
            store.close()
        if removed:
            return f"removed the {len(removed)} task(s) of {self.code} left in the store"
        return f"no task of {self.code} left in the store"


class Adder:
    """Adds the drill's tasks at ``rate`` per second on a thread of its own, due 0-3 s ahead."""

    def __init__(self, store: TaskStore, code: str, rate: float) -> None:
        self.store = store
        self.code = code
        self.rate = rate
        self.added: dict[str, float] = {}  # key -> when (monotonic)
        self.errors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mutexcron-drill-adder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def burst(self, tag: str, count: int) -> None:
        """Add ``count`` tasks due now at once (one ``add_many``), counted with the others."""
        keys = [f"{tag}-{i:03d}" for i in range(count)]
        tasks = [(self.code, key, timedelta(0), {"sleep": round(random.uniform(*BURST_SLEEP), 3)}) for key in keys]
        try:
            self.store.add_many(tasks)
        except StoreError as exc:
            self.errors.update((key, str(exc)) for key in keys)
            return
        now = time.monotonic()
        self.added.update((key, now) for key in keys)

    def _loop(self) -> None:
        n = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            n += 1
            key = f"t{n:06d}"
            due = timedelta(seconds=random.uniform(0.0, DUE_AHEAD))
            try:
                self.store.add(self.code, key, due, {"sleep": round(random.uniform(*HANDLER_SLEEP), 3)})
                self.added[key] = time.monotonic()
            except StoreError as exc:
                self.errors[key] = str(exc)  # its outcome is unknown: counted if a node runs it
            next_at += random.expovariate(self.rate)
            self._stop.wait(max(0.0, next_at - time.monotonic()))


def run_task_drill(
    lock_url: str,
    *,
    nodes: int = 3,
    lease: float = 3.0,
    duration: float = 60.0,
    rate: float = 4.0,
    progress: Progress = lambda _msg: None,
    phases: tuple[str, ...] = PHASES,
) -> TaskDrillReport:
    """Play warm-up, SIGKILL, SIGSTOP/SIGCONT, SIGTERM, cool-down and drain against the task pool; return the report.

    Args:
        lock_url: the store (its task pool: the default tasks table, or the namespace).
        nodes: node processes.
        lease: the drill handler's lease, in seconds.
        duration: seconds of adding tasks, from the start (the drain comes after).
        rate: tasks added per second.
        progress: called with one line per step.
        phases: the faults to play, in order.

    Raises:
        ConfigurationError: a bad URL, a store without a task pool, too few nodes, an unknown phase.
        StoreUnavailableError: the store cannot be reached.
        MutexcronError: the nodes did not run (a node crashed, or no task ran during the warm-up).
    """
    store, masked = _preflight(lock_url, nodes, phases, rate)
    cluster = TaskCluster(lock_url, nodes=nodes, unactive_interval=max(lease, 1.0), task_lease=lease, progress=progress)
    cluster.verdict_pending = True
    report = TaskDrillReport(nodes=nodes, lease=lease, rate=rate, store=masked, code=cluster.code)
    adder = Adder(store, cluster.code, rate)
    started = time.monotonic()
    try:
        with cluster:
            try:
                adder.start()
                measure_from = _warm_up(cluster, progress)
                for phase in phases:
                    _play(cluster, report, phase, progress, adder)
                _cool_down(cluster, started + duration - time.monotonic(), progress)
            finally:
                adder.stop()
            _drain(cluster, adder, store, progress)
            cluster.check_nodes()
            events, ops = cluster.events(), cluster.ops()
            refused = cluster.refused_lines()
            left = {t.key: t.state for t in store.list(code=cluster.code, limit=100_000)}
            finished = time.monotonic()
    finally:
        store.close()
    report.cleanup = cluster.lock_left
    report.seconds = finished - started
    report.add_errors = len(adder.errors)
    analyse_tasks(report, events, adder.added, ops=ops, refused_lines=refused, left_in_store=left, measure_from=measure_from)
    report.logs = cluster.keep_or_discard(report.passed)
    return report


def _preflight(lock_url: str, nodes: int, phases: tuple[str, ...], rate: float) -> tuple[TaskStore, str]:
    """Check what the drill needs before it starts a node; return the drill's own store and its masked URL."""
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ConfigurationError(f"unknown drill phase(s) {', '.join(unknown)}: choose from {', '.join(PHASES)}")
    if nodes < 2 + ("kill" in phases) + ("term" in phases) - 1:
        raise ConfigurationError("the drill needs at least 3 nodes (2 without the kill or the term phase)")
    if not rate > 0:
        raise ConfigurationError(f"the task drill adds tasks at a rate > 0 per second, not {rate!r}")
    check_drill_url(lock_url)
    store = task_store_from_url(lock_url)
    try:
        store.ping()
        store.now()
    except BaseException:
        store.close()
        raise
    return store, store.masked_url


def _warm_up(cluster: TaskCluster, progress: Progress) -> float:
    """Wait until the nodes have completed a few tasks; return when (monotonic)."""
    progress(
        f"warm-up: starting {cluster.nodes} nodes on task code {cluster.code} (lease {cluster.task_lease:g}s) "
        f"in {cluster.workdir}"
    )
    deadline = time.monotonic() + 30 + 3 * cluster.task_lease
    while time.monotonic() < deadline:
        done = cluster.ledger().completed()
        if len(done) >= 3:
            progress(f"warm-up: {len(done)} tasks completed")
            return time.monotonic()
        cluster.check_nodes()
        time.sleep(0.1)
    tails = "\n".join(f"--- {n}\n{cluster.log_tail(n)}" for n in cluster.procs)
    raise MutexcronError(f"the drill's tasks did not run during the warm-up; node logs:\n{tails}")


def _play(cluster: TaskCluster, report: TaskDrillReport, phase: str, progress: Progress, adder: Adder) -> None:
    """Strike a node for ``phase``, wait until its tasks start elsewhere, let the cluster settle."""
    time.sleep(random.uniform(0.2, 0.8))  # a random moment, as a real crash would come
    down = {p.node for p in report.phases.values() if p.phase in ("kill", "term")}
    if phase == "term":
        mark = _terminate(cluster, down, progress)
    else:
        adder.burst(f"{phase}-burst", BURST_PER_NODE * len(set(cluster.alive()) - down))
        mark = _strike(cluster, phase, down, progress)
    report.phases[phase] = mark
    if mark.note:
        progress(f"{phase}: {mark.note}")
    # Let the cluster settle: a few more tasks completed after the fault.
    _wait_completions(cluster, 3, after=time.monotonic(), timeout=10 + cluster.task_lease)


def _busy_node(cluster: TaskCluster, down: set[str], timeout: float, *, ahead: bool = False) -> str | None:
    """A live node with a handler that has at least MID_HANDLER seconds left (with ``ahead``: and
    the most claims not started, once one holds some), waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ledger, now = cluster.ledger(), time.monotonic()
        busy = []
        for node in cluster.alive():
            if node in down:
                continue
            left = [s for _k, s in ledger.running_handlers(node, now) if s >= MID_HANDLER]
            waiting = len(ledger.unstarted(node, now)) if ahead else 0
            if left and (waiting or not ahead or time.monotonic() > deadline - 1.0):
                busy.append((waiting, len(left), random.random(), node))
        if busy:
            return max(busy)[3]
        cluster.check_nodes()
        time.sleep(0.03)
    return None


def _strike(cluster: TaskCluster, phase: str, down: set[str], progress: Progress) -> TaskPhase:
    """SIGKILL, or SIGSTOP for 2 x lease + 1 s, a node running a handler; wait for its tasks to start elsewhere."""
    lease = cluster.task_lease
    node = _busy_node(cluster, down, timeout=15.0, ahead=True)
    if node is None:
        return TaskPhase(phase, "", time.monotonic(), note="no node ran a handler within 15 s: nothing to strike")
    if phase == "kill":
        progress(f"kill: SIGKILL {node} mid-handler")
        mark = TaskPhase(phase, node, cluster.signal(node, signal.SIGKILL))
        deadline = mark.at + 3 * lease + 10
    else:
        progress(f"freeze: SIGSTOP {node} mid-handler for {2 * lease + 1:g}s (the lease is {lease:g}s), then SIGCONT")
        mark = TaskPhase(phase, node, cluster.freeze(node))
        deadline = mark.at + 2 * lease + 1
    in_flight, gap, where = _wait_restart(cluster, node, mark.at, deadline)
    if phase == "freeze":
        remaining = mark.at + 2 * lease + 1 - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        mark.until = cluster.signal(node, signal.SIGCONT)
    progress(f"{phase}: {len(in_flight)} in-flight task(s) of {node} started again{where} after {format_gap(gap)}")
    return mark


def _wait_restart(cluster: TaskCluster, node: str, at: float, deadline: float) -> tuple[list[str], float | None, str]:
    """Wait until every task ``node`` held at ``at`` started on another node; (keys, seconds, " on nodes")."""
    keys: list[str] = []
    while True:
        ledger = cluster.ledger()
        ahead = set(ledger.unstarted(node, at))  # timed apart: they wait for the others' free threads too
        keys = [k for k in ledger.in_flight(node, at) if k not in ahead]
        starts = [ledger.restart(k, node, at) for k in keys]
        if keys and all(starts):
            where = sorted({s["node"] for s in starts if s})
            return keys, max(float(s["mono"]) for s in starts if s) - at, f" on {', '.join(where)}"
        if time.monotonic() > deadline:
            return keys, None, ""
        cluster.check_nodes()
        time.sleep(0.03)


def _terminate(cluster: TaskCluster, down: set[str], progress: Progress) -> TaskPhase:
    """Hold a claim's reply on a live node, SIGTERM it while its claimed tasks have not started,
    and wait for them to start on another node."""
    lease = cluster.task_lease
    candidates = [n for n in cluster.alive() if n not in down]
    node = _busy_node(cluster, down, timeout=5.0) or random.choice(candidates)
    since = time.monotonic()
    cluster.hold(node)
    held = None
    deadline = since + 15.0
    while held is None and time.monotonic() < deadline:
        held = next((e for e in cluster.events(node) if e["event"] == "held" and e["mono"] >= since), None)
        if held is None:
            cluster.check_nodes()
            time.sleep(0.005)
    if held is None:
        cluster.unhold(node)
        progress(f"term: SIGTERM {node} (it claimed no task within 15 s)")
        return TaskPhase("term", node, cluster.signal(node, signal.SIGTERM), note=f"{node} claimed no task within 15 s")
    progress(f"term: SIGTERM {node} while it holds {len(held['tasks'])} claimed task(s) that have not started")
    mark = TaskPhase("term", node, cluster.signal(node, signal.SIGTERM))
    keys = [k for k, _t in held["tasks"]]
    end = mark.at + 3 * lease + 10
    while time.monotonic() < end:
        ledger = cluster.ledger()
        starts = [ledger.restart(k, node, mark.at) for k in keys]
        if all(starts):
            where = ", ".join(sorted({s["node"] for s in starts if s}))
            gap = max(float(s["mono"]) for s in starts if s) - mark.at
            progress(f"term: the {len(keys)} handed-back task(s) started on {where} after {format_gap(gap)}")
            break
        cluster.check_nodes()
        time.sleep(0.03)
    else:
        progress(f"term: the claimed task(s) of {node} did not start elsewhere within {3 * lease + 10:g}s")
    return mark


def _wait_completions(cluster: TaskCluster, count: int, *, after: float, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ledger = cluster.ledger()
        done = sum(1 for cs in ledger.completes.values() for c in cs if c["ok"] and float(c["mono"]) > after)
        if done >= count:
            return
        cluster.check_nodes()
        time.sleep(0.1)


def _cool_down(cluster: TaskCluster, rest: float, progress: Progress) -> None:
    rest = max(rest, 2.0)
    progress(f"cool-down: adding tasks for {rest:.0f}s more")
    end = time.monotonic() + rest
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 10.0))
        cluster.check_nodes()
        if end - time.monotonic() > 1.0:
            progress(f"cool-down: {end - time.monotonic():.0f}s left, {len(cluster.ledger().completed())} tasks completed")


def _drain(cluster: TaskCluster, adder: Adder, store: TaskStore, progress: Progress) -> None:
    """Wait until every task added was completed, or the cluster had its chance: the latest due,
    a handler's run and two leases, plus a margin. A task that is gone from the store without a
    recorded completion will never complete: once every missing one is gone, the wait ends."""
    limit = DUE_AHEAD + HANDLER_SLEEP[1] + 2 * cluster.task_lease + 10.0
    progress(f"drain: stopped adding ({len(adder.added)} tasks added); waiting up to {limit:.0f}s for the rest")
    end = time.monotonic() + limit
    gone_since: float | None = None
    while True:
        missing = set(adder.added) - cluster.ledger().completed()
        if not missing or time.monotonic() > end:
            break
        try:
            in_store = {t.key for t in store.list(code=cluster.code, limit=100_000)}
        except StoreError:
            in_store = missing
        if missing & in_store:
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > 1.0:  # not an event still being written
            break
        cluster.check_nodes()
        time.sleep(0.2)
    progress(f"drain: {len(missing)} task(s) not completed" if missing else "drain: every task completed")
