"""The task pool on a cluster of real `mutexcron run` processes: kill, freeze, terminate, store restart.

Each node runs tests/nodes/task_node.py, whose handler writes a JSON line per start and end. The
tests kill, freeze (SIGSTOP past the lease) and terminate nodes, and restart a persisted Redis,
then check from those lines and the store's final state that no task is lost, that a task runs
twice only after a stall past its lease, that the stale completion is refused, and how fast a
task moves on. Timed assertions leave room for a loaded CI machine; the benchmark carries the
tight numbers (benchmarks/tasks.py).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mutexcron import TaskPool
from mutexcron.errors import StoreUnavailableError
from tests.backends import backend_params, cleanup_redis, drop_store_tables, require_server
from tests.redis_servers import REDIS_SERVER, PrivateRedis, wait_for_port

pytestmark = pytest.mark.cluster

JOBS_FILE = Path(__file__).parent / "nodes" / "task_node.py"
NOW = timedelta(seconds=-0.5)
SLACK = 2.0  # seconds a loaded CI machine may add to a timed step


class TaskCluster:
    """`mutexcron run` nodes on one store, each logging its handler runs to a file of its own."""

    def __init__(self, url: str, workdir: Path, lease: float, concurrency: int = 8) -> None:
        self.url, self.workdir, self.lease, self.concurrency = url, workdir, lease, concurrency
        self.shutdown_timeout = 15.0
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.pool = TaskPool(url)

    def start(self, *names: str) -> None:
        for name in names:
            env = {
                **os.environ,
                "MUTEXCRON_LOCK_URL": self.url,
                "TASK_NODE_LOG": str(self.workdir / f"{name}.jsonl"),
                "TASK_LEASE": str(self.lease),
                "MUTEXCRON_NODE_ID": name,
            }
            with open(self.workdir / f"{name}.out", "ab") as out:
                options = ["--task-concurrency", str(self.concurrency), "--shutdown-timeout", str(self.shutdown_timeout)]
                options += ["--log-level", "info"]
                self.nodes[name] = subprocess.Popen(
                    [sys.executable, "-m", "mutexcron", "run", str(JOBS_FILE), "--node-id", name, *options],
                    env=env, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
        for name in names:
            assert wait_until(lambda n=name: "runs task handlers" in self.output(n), 20), self.output(name)

    def output(self, name: str) -> str:
        path = self.workdir / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        found = []
        for path in self.workdir.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                if line.endswith("}"):
                    found.append(json.loads(line))
        return sorted(found, key=lambda e: e["t"])

    def wait_event(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        found: list[dict[str, Any]] = []
        wait_until(lambda: bool(found.extend(e for e in self.events() if match(e)) or found), timeout)
        assert found, f"no matching event within {timeout}s: {self.events()[-5:]}"
        return found[0]

    def signal(self, name: str, signum: int) -> None:
        self.nodes[name].send_signal(signum)

    def stop(self) -> dict[str, int | None]:
        for node in self.nodes.values():
            if node.poll() is None:
                node.send_signal(signal.SIGCONT)
                node.send_signal(signal.SIGTERM)
        codes = {}
        for name, node in self.nodes.items():
            try:
                codes[name] = node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
                codes[name] = None
        self.pool.close()
        return codes


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _url(kind: str, tmp_path: Path) -> tuple[str, Callable[[], None] | None]:
    tag = secrets.token_hex(3)
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/tasks.db", None
    base = require_server(kind)
    sep = "&" if "?" in base else "?"
    if kind == "redis":
        url = f"{base}{sep}namespace=taskcluster-{tag}"
        return url, lambda: cleanup_redis(url)
    # A lock table of the test's own too: a node takes the pruner's lock and writes its event feed there.
    url = f"{base}{sep}table=mc_tc_{tag}_locks&tasks_table=mc_tc_{tag}"
    return url, lambda: drop_store_tables(url)


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., TaskCluster]]:
    made: list[TaskCluster] = []
    cleanups: list[Callable[[], None]] = []

    def make(kind: str, lease: float, concurrency: int = 8) -> TaskCluster:
        url, cleanup = _url(kind, tmp_path)
        if cleanup is not None:
            cleanups.append(cleanup)
        made.append(TaskCluster(url, tmp_path, lease, concurrency))
        return made[-1]

    yield make
    for c in made:
        c.stop()
    for cleanup in cleanups:
        cleanup()


# -- faults ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("sqlite", "redis"))
def test_sigkill_mid_handler_the_task_completes_on_another_node_within_the_lease(
    kind: str, cluster: Callable[..., TaskCluster]
) -> None:
    c = cluster(kind, lease=2.0)
    c.start("n0", "n1", "n2")
    c.pool.add("work", "victim", NOW, {"sleep": 1.0})
    first = c.wait_event(lambda e: e["key"] == "victim" and e["event"] == "start", 10)
    # The handler's started mark is written by the node's completion thread (within 2 ms, more on a
    # loaded machine): killed before it, the rescue is attempt 1 again, as documented (an attempt
    # counts once its start is recorded; seen once in CI). Kill mid-handler, after the mark.
    time.sleep(0.4)
    c.signal(first["node"], signal.SIGKILL)
    killed_at = time.time()
    again = c.wait_event(lambda e: e["key"] == "victim" and e["event"] == "start" and e["token"] > first["token"], 15)
    recovery = again["t"] - killed_at
    print(f"{kind}: SIGKILL mid-handler -> restarted on {again['node']} after {recovery:.2f}s (lease 2.0s)")
    assert again["node"] != first["node"] and again["attempt"] == first["attempt"] + 1
    assert recovery <= c.lease + 1.0 + SLACK
    c.wait_event(lambda e: e["key"] == "victim" and e["event"] == "end", 10)
    assert wait_until(lambda: c.pool.get("work", "victim") is None, 10)  # done: never lost


@pytest.mark.parametrize("kind", backend_params("sqlite", "redis"))
def test_a_node_frozen_past_its_lease_has_its_stale_completion_refused(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    c = cluster(kind, lease=2.0)
    c.start("n0", "n1")
    # Each attempt reschedules the task token x 1 hour ahead: the final due says which one counted.
    c.pool.add("work", "victim", NOW, {"sleep": 1.0, "reschedule_hours_per_token": 1})
    first = c.wait_event(lambda e: e["key"] == "victim" and e["event"] == "start", 10)
    frozen = first["node"]
    c.signal(frozen, signal.SIGSTOP)
    try:
        newer = c.wait_event(lambda e: e["key"] == "victim" and e["event"] == "end" and e["node"] != frozen, 15)
        assert newer["token"] == first["token"] + 1
    finally:
        c.signal(frozen, signal.SIGCONT)
    assert wait_until(lambda: "completion refused" in c.output(frozen), 10), c.output(frozen)
    stale = c.wait_event(lambda e: e["key"] == "victim" and e["event"] == "end" and e["node"] == frozen, 5)
    assert stale["token"] == first["token"]  # the stale attempt did finish its handler...
    # ...but the store keeps the newer attempt's outcome (recorded once its worker gets to it: on a
    # loaded machine that can come after the stale node's refusal)
    assert wait_until(lambda: getattr(c.pool.get("work", "victim"), "state", None) == "queued", 10)
    task = c.pool.get("work", "victim")
    assert task is not None and task.token == newer["token"]
    hours_ahead = (task.due - c.pool.store.now()).total_seconds() / 3600
    assert 1.9 < hours_ahead < 2.1


@pytest.mark.parametrize("kind", backend_params("sqlite", "redis"))
def test_sigterm_lets_the_running_handler_finish_and_stops_claiming(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    c = cluster(kind, lease=3.0)
    c.start("n0", "n1")
    c.pool.add("work", "long", NOW, {"sleep": 2.0})
    first = c.wait_event(lambda e: e["key"] == "long" and e["event"] == "start", 10)
    stopping = first["node"]
    c.signal(stopping, signal.SIGTERM)
    termed_at = time.time()
    for i in range(20):
        c.pool.add("work", f"after-{i}", timedelta(seconds=0.3))
    assert c.nodes[stopping].wait(timeout=15) == 0
    stopped_after = time.time() - termed_at
    events = c.events()
    ends = [e for e in events if e["key"] == "long" and e["event"] == "end"]
    assert [(e["node"], e["token"]) for e in ends] == [(stopping, first["token"])]  # finished, once, where it began
    assert 1.0 < stopped_after < 10.0
    assert wait_until(lambda: len([e for e in c.events() if e["event"] == "end" and e["key"].startswith("after-")]) == 20, 15)
    late = [e for e in c.events() if e["node"] == stopping and e["event"] == "start" and e["t"] > termed_at + 0.1]
    assert late == []  # no claim after the signal
    assert "stopped" in c.output(stopping)


def test_a_handler_outliving_the_shutdown_timeout_does_not_keep_the_node_alive(
    cluster: Callable[..., TaskCluster],
) -> None:
    c = cluster("sqlite", lease=3.0)
    c.shutdown_timeout = 1.0
    c.start("n0")
    c.pool.add("work", "endless", NOW, {"sleep": 60})
    c.wait_event(lambda e: e["key"] == "endless" and e["event"] == "start", 10)
    c.signal("n0", signal.SIGTERM)
    began = time.monotonic()
    assert c.nodes["n0"].wait(timeout=20) == 1  # not 0: a handler was abandoned
    assert time.monotonic() - began < 10
    assert "task work/endless" in c.output("n0")
    task = c.pool.get("work", "endless")  # left to its lease: another node runs it again
    assert task is not None and task.state == "running" and task.owner == "n0"


def test_sigterm_hands_back_claims_that_have_not_started(cluster: Callable[..., TaskCluster]) -> None:
    """A stop caught between claim and start: the claim goes back at once, token + 1, attempt not counted."""
    c = cluster("sqlite", lease=30.0, concurrency=50)
    for i in range(400):
        c.pool.add("work", f"t{i}", NOW, {"sleep": 0.05})
    c.start("n0")
    c.wait_event(lambda e: e["event"] == "start", 10)
    c.signal("n0", signal.SIGTERM)
    try:  # --shutdown-timeout is 15 s; the rest is room for a loaded machine
        code = c.nodes["n0"].wait(timeout=40)
    except subprocess.TimeoutExpired:
        c.nodes["n0"].kill()
        c.nodes["n0"].wait()
        pytest.fail(f"n0 did not stop within 40 s of SIGTERM:\n{c.output('n0')[-3000:]}")
    out = c.output("n0")
    assert code == 0, out[-3000:]
    left = c.pool.list(limit=1000)
    assert all(t.state == "queued" for t in left), [t for t in left if t.state != "queued"][:3]
    handed = [t for t in left if t.token > 0]  # claimed once, handed back: queued again with token + 1
    assert all(t.attempt == 0 and t.token == 2 for t in handed)
    if handed:
        assert "handed back" in out
    # Nothing waits for a 30 s lease: another node takes every task at once.
    c.start("n1")
    assert wait_until(lambda: not c.pool.list(limit=1), 30)


# -- the store restarts --------------------------------------------------------------------------------
class PersistedRedis(PrivateRedis):
    """A private redis-server that writes every command to its AOF before answering."""

    def start(self) -> None:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)


@pytest.fixture
def persisted_redis(tmp_path: Path) -> Iterator[PersistedRedis]:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed")
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = PersistedRedis(workdir)
    server.start()
    yield server
    server.kill()


def test_a_redis_restart_mid_run_loses_nothing(persisted_redis: PersistedRedis, tmp_path: Path) -> None:
    c = TaskCluster(f"{persisted_redis.url}?namespace=restart", tmp_path, lease=3.0)
    try:
        keys = [f"t{i}" for i in range(300)]
        for i, key in enumerate(keys):
            c.pool.add("work", key, timedelta(seconds=1 + 5 * i / len(keys)), {"sleep": 0.01})
        c.start("n0", "n1", "n2")
        time.sleep(2.0)
        persisted_redis.kill()  # SIGKILL: the AOF (fsync always) holds every acknowledged write
        time.sleep(1.5)
        persisted_redis.start()
        assert wait_until(lambda: not _list_when_up(c.pool), 60), c.pool.list(limit=5)
        ends = Counter(e["key"] for e in c.events() if e["event"] == "end")
        assert set(ends) == set(keys)  # every task ran; none lost
        twice = [k for k, n in ends.items() if n > 1]
        print(f"redis restart: {len(keys)} tasks, 0 lost, {len(twice)} ran twice (at-least-once around the outage)")
        assert any("unreachable" in c.output(n) for n in c.nodes)
    finally:
        c.stop()


def _list_when_up(pool: TaskPool) -> list[Any] | None:
    """The first task, or None while the restarted server still loads its data (unavailable: fail closed)."""
    try:
        return pool.list(limit=1)
    except StoreUnavailableError:
        return [None]


# -- no faults: exactly once -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql"))
def test_three_nodes_run_2000_tasks_each_exactly_once(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    c = cluster(kind, lease=30.0)
    keys = [f"t{i}" for i in range(2000)]
    c.pool.add("work", "warm-up", NOW)  # creates the table before three nodes race to
    c.start("n0", "n1", "n2")
    for i, key in enumerate(keys):
        c.pool.add("work", key, timedelta(seconds=2 * i / len(keys)))
    assert wait_until(lambda: not c.pool.list(limit=1), 120)
    codes = c.stop()
    starts = Counter(e["key"] for e in c.events() if e["event"] == "start" and e["key"] != "warm-up")
    assert set(starts) == set(keys) and max(starts.values()) == 1  # each exactly once
    assert all(e["token"] == 1 for e in c.events() if e["event"] == "start")
    per_node = Counter(e["node"] for e in c.events() if e["event"] == "start")
    print(f"{kind}: 2000 tasks on 3 nodes, each exactly once; per node {dict(per_node)}")
    assert codes == {"n0": 0, "n1": 0, "n2": 0}


# -- wake-up ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql", "redis"))
def test_tasks_added_by_another_process_start_at_their_due_time(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    """The nodes sleep toward a task 10 minutes away; tasks added from this process, due in 1-2 s,
    start on time (store notices or the short poll), not at the next backstop poll.

    Start and due are both read on this host's clock: the store runs on this host, so the store's
    clock and the node's agree here (the benchmark measures the lag with the store's own clock).
    """
    c = cluster(kind, lease=30.0)
    c.pool.add("work", "far", timedelta(minutes=10))
    c.start("n0", "n1")
    time.sleep(0.5)  # both nodes are asleep now
    for i in range(5):
        c.pool.add("work", f"soon-{i}", timedelta(seconds=1 + i / 4))
    starts = [c.wait_event(lambda e, k=f"soon-{i}": e["key"] == k and e["event"] == "start", 10) for i in range(5)]
    lags = sorted(e["t"] - e["due"] for e in starts)
    print(f"{kind}: due-to-start lag of 5 tasks due in 1-2 s: " + ", ".join(f"{lag * 1000:.0f} ms" for lag in lags))
    assert all(-0.05 < lag < 1.0 for lag in lags), lags  # loose: a loaded CI machine; the benchmark has p50/p99
