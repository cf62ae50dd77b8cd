"""Retention of finished tasks: the purge by hand (``TaskPool.purge``, ``mutexcron tasks purge``)
and the automatic pruning of a running cluster (one node at a time, under its own lease).

The token floor itself is in the store contract (tests/test_task_store.py); here: the purge's
loop, its command, the options, and real `mutexcron run` nodes pruning while tasks flow.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron import MutexScheduler, TaskPool
from mutexcron.cli.main import main
from mutexcron.errors import ConfigurationError
from mutexcron.mutex.lock import Mutex
from mutexcron.tasks import Done, TaskStore, task_store_from_url
from mutexcron.tasks.retention import DEFAULT_RETENTION, PRUNE_LOCK, Pruner, check_retention, parse_age, purge
from tests.test_task_cluster import TaskCluster, wait_until

A = "node-a:1:aaaa"


def _finish(store: TaskStore, code: str, keys: list[str]) -> None:
    """Add, claim and complete each key: one tombstone each."""
    for key in keys:
        store.add(code, key, timedelta(seconds=-1))
    claimed = store.claim(A, [code], len(keys), 30)
    assert store.complete_many(A, [(t.code, t.key, t.token, Done()) for t in claimed]) == [True] * len(keys)


# -- input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [("7d", timedelta(days=7)), ("2h30m", timedelta(hours=2, minutes=30)), ("90", timedelta(seconds=90)), ("0", timedelta(0))],
)
def test_parse_age(text: str, expected: timedelta) -> None:
    assert parse_age(text) == expected


@pytest.mark.parametrize("text", ["", "x", "7x", "-1d", "d"])
def test_parse_age_refuses_with_the_forms_to_write(text: str) -> None:
    with pytest.raises(ValueError, match="write 7d, 12h"):
        parse_age(text)


def test_retention_zero_keeps_everything_and_a_negative_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_retention(0) is None and check_retention(timedelta(0)) is None and check_retention(None) is None
    assert check_retention(60) == timedelta(minutes=1)
    for bad in (timedelta(seconds=-1), "7d", True):
        with pytest.raises(ConfigurationError, match=r"0 keeps everything|keep everything"):
            check_retention(bad)
    assert MutexScheduler(lock_url="memory://r").task_retention == DEFAULT_RETENTION
    assert MutexScheduler(lock_url="memory://r", task_retention=0).task_retention is None
    monkeypatch.setenv("MUTEXCRON_TASK_RETENTION", "12h")
    assert MutexScheduler(lock_url="memory://r").task_retention == timedelta(hours=12)
    assert MutexScheduler(lock_url="memory://r", task_retention=timedelta(days=1)).task_retention == timedelta(days=1)
    monkeypatch.setenv("MUTEXCRON_TASK_RETENTION", "soon")
    with pytest.raises(ConfigurationError, match="MUTEXCRON_TASK_RETENTION"):
        MutexScheduler(lock_url="memory://r")


# -- by hand -----------------------------------------------------------------------------------------
def test_purge_removes_only_old_tombstones_in_bounded_batches(tmp_path: Path) -> None:
    with TaskPool(f"sqlite:///{tmp_path}/t.db") as pool:
        store = pool.store
        _finish(store, "a", [f"k{i}" for i in range(25)])
        _finish(store, "b", ["x"])
        store.add("a", "queued", timedelta(hours=1))
        time.sleep(0.05)
        assert pool.purge(timedelta(hours=1)) == 0  # nothing that old
        batches: list[int] = []
        plain = store.purge_batch
        store.purge_batch = lambda *a, **k: plain(*a, **{**k, "limit": 10})  # type: ignore[method-assign]
        assert purge(store, timedelta(0), code="a", on_batch=batches.append) == 25
        assert batches == [10, 10, 5]
        assert store.count_purgeable(0) == 1 and pool.purge(timedelta(0)) == 1
        assert [t.key for t in pool.list()] == ["queued"]
        with pytest.raises(ConfigurationError, match="timedelta"):
            pool.purge(timedelta(seconds=-1))


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_purge_command_counts_removes_and_dry_runs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    with TaskPool(url) as pool:
        _finish(pool.store, "mail", ["a", "b", "c"])
        _finish(pool.store, "sms", ["d"])
    time.sleep(0.05)
    dry = _cli("tasks", "purge", "--older-than", "0", "--dry-run", "--lock-url", url)
    assert dry.exit_code == 0 and "would remove 4 finished task(s) older than 0s" in dry.output, dry.output
    one = _cli("tasks", "purge", "--older-than", "0", "--code", "sms", "--lock-url", url)
    assert one.exit_code == 0 and "removed 1 finished task(s) of code 'sms'" in one.output, one.output
    kept = _cli("tasks", "purge", "--older-than", "7d", "--lock-url", url)
    assert kept.exit_code == 0 and "removed 0 finished task(s) older than 7d" in kept.output, kept.output
    rest = _cli("tasks", "purge", "--older-than", "0", "--lock-url", url)
    assert rest.exit_code == 0 and "removed 3 finished task(s)" in rest.output, rest.output
    bad = _cli("tasks", "purge", "--older-than", "soon", "--lock-url", url)
    assert bad.exit_code == 2 and "write 7d, 12h" in bad.output
    absent = tmp_path / "absent.db"
    none = _cli("tasks", "purge", "--older-than", "0", "--dry-run", "--lock-url", f"sqlite:///{absent}")
    assert none.exit_code == 0 and "nothing to purge" in none.output and not absent.exists(), none.output
    memory = _cli("tasks", "purge", "--older-than", "7d", "--lock-url", "memory://purge")
    assert memory.exit_code == 0 and "nothing to purge: memory://purge deletes a task when it finishes" in memory.output


# -- automatic ---------------------------------------------------------------------------------------
def test_two_pruners_never_prune_at_once_and_the_holder_does_it_all(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    stores = [task_store_from_url(url) for _ in range(2)]
    _finish(stores[0], "c", [f"k{i}" for i in range(30)])
    busy, most = [0], [0]
    guard = threading.Lock()

    def counted(store: TaskStore) -> None:
        plain = store.purge_batch

        def batch(*args: Any, **kwargs: Any) -> Any:
            with guard:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            try:
                time.sleep(0.01)
                return plain(*args, **{**kwargs, "limit": 4})
            finally:
                with guard:
                    busy[0] -= 1

        store.purge_batch = batch  # type: ignore[method-assign]

    mutexes = [Mutex(url) for _ in range(2)]
    pruners = []
    for store, mutex in zip(stores, mutexes, strict=True):
        counted(store)
        pruners.append(Pruner(store, timedelta(milliseconds=1), lambda m=mutex: m.hold(PRUNE_LOCK, lease=30, wait=False),
                              interval=0.05, on_stop=mutex.close))  # fmt: skip
    try:
        for pruner in pruners:
            pruner.start()
        assert wait_until(lambda: sum(p.removed for p in pruners) == 30, 20)
        assert sorted(p.removed for p in pruners) == [0, 30]  # one node prunes
        assert most[0] == 1
    finally:
        for pruner in pruners:
            pruner.stop()
        for store in stores:
            store.close()


def _prune_spans(workdir: Path) -> list[dict[str, Any]]:
    lines = []
    for path in workdir.glob("prune-*.log"):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return lines


@pytest.mark.cluster
def test_real_nodes_prune_one_at_a_time_and_a_killed_pruner_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = TaskCluster(f"sqlite:///{tmp_path}/tasks.db", tmp_path, lease=3.0, concurrency=4)
    monkeypatch.setenv("MUTEXCRON_TASK_RETENTION", "1s")

    def start(name: str) -> None:
        monkeypatch.setenv("PRUNE_LOG", str(tmp_path / f"prune-{name}.log"))
        c.start(name)

    try:
        start("n0")
        start("n1")
        keys = [f"k{i}" for i in range(400)]
        c.pool.add_many([("work", key, timedelta(seconds=-1)) for key in keys[:200]])
        assert wait_until(lambda: "this node prunes" in c.output("n0") + c.output("n1"), 20)
        pruner = "n0" if "this node prunes" in c.output("n0") else "n1"
        other = "n1" if pruner == "n0" else "n0"
        assert wait_until(lambda: any(s["node"] == pruner and s.get("removed") for s in _prune_spans(tmp_path)), 20)
        c.pool.add_many([("work", key, timedelta(seconds=-1)) for key in keys[200:]])
        c.signal(pruner, signal.SIGKILL)  # while it prunes the first tasks' tombstones and others finish
        assert wait_until(lambda: "this node prunes" in c.output(other), 60), c.output(other)
        started = {e["key"] for e in c.events() if e["event"] == "start"}
        seen = lambda: started.update(e["key"] for e in c.events() if e["event"] == "start") or started >= set(keys)  # noqa: E731
        assert wait_until(seen, 30)
        assert wait_until(lambda: c.pool.store.count_purgeable(0) == 0 and not c.pool.list(), 30)  # all ran, all pruned
        ends = [e["key"] for e in c.events() if e["event"] == "end"]
        twice = [k for k in set(ends) if ends.count(k) > 1]
        assert not twice or all(k in started for k in twice)  # only a killed node's own runs may run again
        spans = [s for s in _prune_spans(tmp_path) if s["event"] == "end"]
        by_node = {node: [(s["begun"], s["t"]) for s in spans if s["node"] == node] for node in ("n0", "n1")}
        for begun, ended in by_node[pruner]:
            assert all(ended <= b or e <= begun for b, e in by_node[other]), "two nodes pruned at once"
    finally:
        c.stop()


def test_status_says_when_the_jobs_file_keeps_finished_tasks_forever(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    with TaskPool(url) as pool:
        _finish(pool.store, "mail", ["a"])
    for retention, said in (("0", True), ("timedelta(days=1)", False)):
        jobs = tmp_path / f"jobs_{said}.py"
        jobs.write_text(f"from datetime import timedelta\nfrom mutexcron import MutexScheduler\n"
                        f"sched = MutexScheduler(lock_url={url!r}, task_retention={retention})\n")  # fmt: skip
        result = _cli("status", str(jobs), "--lock-url", url)
        assert result.exit_code == 0, result.output
        assert ("task retention: off (task_retention=0): finished tasks are kept forever" in result.output) is said, result.output


@pytest.mark.parametrize(
    ("url", "retention", "prunes"),
    [("sqlite", DEFAULT_RETENTION, True), ("sqlite", 0, False), ("memory://no-tombstones", DEFAULT_RETENTION, False)],
)
def test_a_node_prunes_only_with_a_task_worker_a_retention_and_tombstones(
    tmp_path: Path, url: str, retention: Any, prunes: bool
) -> None:
    sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/t.db" if url == "sqlite" else url, task_retention=retention)
    sched.tasks.handler("c")(lambda task: None)
    sched.start()
    try:
        assert (sched._pruner is not None) is prunes
    finally:
        sched.shutdown()
    assert sched._pruner is None or not sched._pruner._thread or not sched._pruner._thread.is_alive()  # stopped with the node
