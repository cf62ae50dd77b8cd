"""Shared job stores: how fast a change reaches another node, and what a shared job costs per tick.

    python benchmarks/shared_jobs.py [--stores sqlite,mysql,postgresql,redis,mongodb] [--changes 30] [--ticks 300]

For each reachable store family, in one run:

* **propagation**: a node in a process of its own runs a ``MutexScheduler`` on the shared job store;
  this process (a scheduler started paused, as a web app's) makes ``--changes`` ``modify_job``
  calls, each after a random pause of 0.2-0.6 s, and the node writes the time it dispatched
  APScheduler's ``EVENT_JOB_MODIFIED``. The delay is that time minus the time ``modify_job``
  returned (one host, one clock). PostgreSQL: ``LISTEN``; Redis: a subscription; SQLite:
  ``PRAGMA data_version``; MariaDB and MongoDB: the watcher's poll.
* **per tick**: what APScheduler's loop does with one due job on its holder, ``get_due_jobs`` +
  the advance (``update_job``) + ``get_next_run_time``, timed on the shared store and on a
  ``MemoryJobStore`` of the same started scheduler, interleaved (wall and this thread's CPU, p50/p99).
  The guard's claim is the same for both (the lock store) and is not in these figures.
* **standby**: the CPU one watcher read of the store takes (a standby makes no loop call for a
  shared job; it reads the store when a notice, the data version or its poll says so).
* **poll**: a standby's watcher woken with nothing changed and ``--poll-jobs`` jobs in the store:
  reading every job against reading the change counter (SQL, MongoDB), interleaved in one run.

Server URLs: ``MUTEXCRON_TEST_<KIND>_URL`` or the local defaults; MongoDB only when
``MUTEXCRON_TEST_MONGODB_URL`` is set. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

DEFAULT_URLS = {
    "mysql": "mysql://root@127.0.0.1:3306/test",
    "postgresql": "postgresql://postgres@127.0.0.1:5432/test",
    "redis": "redis://127.0.0.1:6379/0",
}


def bench_job(n: int = 0) -> None:
    """The benchmark's job (never due during a run)."""


def server(kind: str) -> str | None:
    return os.environ.get(f"MUTEXCRON_TEST_{kind.upper()}_URL") or DEFAULT_URLS.get(kind)


def spec_for(kind: str, workdir: Path, tag: str) -> dict[str, Any] | None:
    """``{"kind", "options"}`` of an isolated APScheduler job store, or None if the server is unknown."""
    if kind == "sqlite":
        return {"kind": kind, "options": {"url": f"sqlite:///{workdir}/jobs.db", "tablename": f"bench_{tag}"}}
    base = server(kind)
    if base is None:
        return None
    rest = base.split("://", 1)[1]
    if kind in ("mysql", "postgresql"):
        driver = "mysql+pymysql" if kind == "mysql" else "postgresql+psycopg"
        return {"kind": kind, "options": {"url": f"{driver}://{rest}", "tablename": f"bench_{tag}"}}
    if kind == "redis":
        from urllib.parse import urlsplit

        parts = urlsplit(base)
        return {"kind": kind, "options": {"host": parts.hostname, "port": parts.port or 6379,
                                          "jobs_key": f"bench.{tag}.jobs", "run_times_key": f"bench.{tag}.times"}}  # fmt: skip
    return {"kind": kind, "options": {"host": base, "database": "bench", "collection": f"jobs_{tag}"}}


def jobstore(spec: dict[str, Any]) -> Any:
    kind, options = spec["kind"], spec["options"]
    if kind == "redis":
        from apscheduler.jobstores.redis import RedisJobStore

        return RedisJobStore(**options)
    if kind == "mongodb":
        from apscheduler.jobstores.mongodb import MongoDBJobStore

        return MongoDBJobStore(**options)
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

    return SQLAlchemyJobStore(**options)


def drop(spec: dict[str, Any]) -> None:
    store = jobstore(spec)
    if spec["kind"] == "redis":
        store.redis.delete(store.jobs_key, store.run_times_key)
    elif spec["kind"] == "mongodb":
        store.collection.drop()
        store.collection.database[f"{store.collection.name}_changes"].drop()
    else:
        from mutexcron.jobstores.sqlalchemy import changes_table

        store.jobs_t.drop(store.engine, checkfirst=True)
        changes_table(store.jobs_t).drop(store.engine, checkfirst=True)
    store.shutdown()


def scheduler(spec: dict[str, Any], lock_url: str, **jobstores: Any) -> Any:
    from mutexcron import MutexScheduler

    return MutexScheduler(jobstores={"default": jobstore(spec), **jobstores}, lock_url=lock_url, triggers=False,
                          node_id=f"bench-{secrets.token_hex(2)}")  # fmt: skip


# -- propagation ----------------------------------------------------------------------------------
def watch(spec_json: str, lock_url: str, out: str) -> None:
    """The other node (a process of its own): write each EVENT_JOB_MODIFIED's dispatch time to ``out``."""
    from apscheduler.events import EVENT_JOB_MODIFIED

    sched = scheduler(json.loads(spec_json), lock_url)

    def seen(event: Any) -> None:
        with open(out, "a") as fh:
            fh.write(f"{event.job_id} {time.time()}\n")

    sched.add_listener(seen, EVENT_JOB_MODIFIED)
    sched.start()
    with open(out, "a") as fh:
        fh.write("ready 0\n")
    while True:
        time.sleep(1)


def propagation(spec: dict[str, Any], lock_url: str, workdir: Path, changes: int) -> list[float]:
    out = workdir / f"events-{spec['kind']}.txt"
    admin = scheduler(spec, lock_url)
    admin.start(paused=True)
    admin.add_job(bench_job, "interval", hours=1, id="p", replace_existing=True)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, __file__, "--watch", json.dumps(spec), lock_url, str(out)], env=env,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and "ready" in out.read_text()):
            if time.monotonic() > deadline or child.poll() is not None:
                raise RuntimeError(f"the watching node did not start ({spec['kind']})")
            time.sleep(0.05)
        time.sleep(1.0)
        delays = []
        for n in range(changes):
            time.sleep(random.uniform(0.2, 0.6))
            admin.modify_job("p", args=(n,))
            done = time.time()
            expected = n + 1
            while True:
                events = [line for line in out.read_text().splitlines() if line.startswith("p ")]
                if len(events) >= expected:
                    delays.append(float(events[expected - 1].split()[1]) - done)
                    break
                if time.time() - done > 10:
                    raise RuntimeError(f"change {n} not seen within 10 s ({spec['kind']})")
                time.sleep(0.002)
        return delays
    finally:
        child.kill()
        child.wait()
        admin.shutdown(wait=False)


# -- per tick -------------------------------------------------------------------------------------
def per_tick(spec: dict[str, Any], lock_url: str, ticks: int) -> dict[str, list[tuple[float, float]]]:
    from apscheduler.jobstores.memory import MemoryJobStore

    sched = scheduler(spec, lock_url, memory=MemoryJobStore())
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    sched.add_job(bench_job, "interval", hours=1, id="shared", next_run_time=later, replace_existing=True)
    sched.add_job(bench_job, "interval", hours=1, id="local", next_run_time=later, jobstore="memory", mutex=True)
    sched.start()
    try:
        shared, local = sched._jobstores["default"], sched._jobstores["memory"]
        deadline = time.monotonic() + 15
        while not shared.shared.held_jobs(shared):
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark's node did not take the shared job's lock")
            time.sleep(0.05)
        out: dict[str, list[tuple[float, float]]] = {"memory": [], "shared": []}
        for i in range(ticks + 20):
            for name, store in (("memory", local), ("shared", shared)):
                sample = one_tick(store)
                if i >= 20:
                    out[name].append(sample)
        cpu = []
        for _ in range(50):
            started = time.thread_time()
            shared.shared.refresh(shared)
            cpu.append(time.thread_time() - started)
        out["standby read"] = [(0.0, c) for c in cpu]
        return out
    finally:
        sched.shutdown(wait=False)


# -- a standby's poll -----------------------------------------------------------------------------
def poll_cost(spec: dict[str, Any], lock_url: str, jobs: int, polls: int) -> dict[str, list[tuple[float, float]]]:
    """A standby's watcher waking with nothing changed, ``jobs`` jobs in the store: reading every job
    (what each wake-up did before the change counter, and still does on Redis) against reading the
    counter (SQL, MongoDB), interleaved (wall, CPU)."""
    sched = scheduler(spec, lock_url)
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    for i in range(jobs):
        sched.add_job(bench_job, "interval", hours=1, id=f"p{i}", kwargs={"n": i}, next_run_time=later, replace_existing=True)
    sched.start(paused=True)
    try:
        store = sched._jobstores["default"]
        out: dict[str, list[tuple[float, float]]] = {"every job": [], "counter": []}
        for i in range(polls + 5):
            for name, read in (("every job", lambda: store.shared.refresh(store)), ("counter", store.change_marker)):
                wall, cpu = time.perf_counter(), time.thread_time()
                read()
                if i >= 5:
                    out[name].append((time.perf_counter() - wall, time.thread_time() - cpu))
        if store.change_marker() is None:
            out["counter"] = []
        sched.remove_all_jobs()  # the next figures of this store are for one job
        return out
    finally:
        sched.shutdown(wait=False)


def one_tick(store: Any) -> tuple[float, float]:
    """One loop pass over one due job: the due read, the advance, the next run time (wall, CPU)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    job = store.get_due_jobs(datetime.now(timezone.utc) + timedelta(days=3650))[0]
    job._modify(next_run_time=job.next_run_time + timedelta(seconds=1))
    store.update_job(job)
    store.get_next_run_time()
    return time.perf_counter() - wall, time.thread_time() - cpu


# -- output ---------------------------------------------------------------------------------------
def ms(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,mysql,postgresql,redis,mongodb")
    parser.add_argument("--changes", type=int, default=30)
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--poll-jobs", type=int, default=200, help="jobs in the store for the standby's poll")
    parser.add_argument("--polls", type=int, default=100)
    parser.add_argument("--only-poll", action="store_true", help="only the standby's poll figures")
    parser.add_argument("--watch", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.watch:
        watch(*args.watch)
        return 0
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="mutexcron-bench-"))
    prop_rows, tick_rows, poll_rows = [], [], []
    for kind in args.stores.split(","):
        tag = secrets.token_hex(3)
        spec = spec_for(kind, workdir, tag)
        if spec is None:
            print(f"{kind}: no server configured, skipped", file=sys.stderr)
            continue
        # Each process's own locks (the figures leave the fire claim out): a SQLite lock file beside a
        # server job store is refused, and a server lock store would leave records behind.
        lock_url = f"sqlite:///{workdir}/locks-{tag}.db" if kind == "sqlite" else f"memory://bench-{tag}"
        try:
            polled = poll_cost(spec, lock_url, args.poll_jobs, args.polls)
            for name, samples in polled.items():
                if samples:
                    walls, cpus = [w for w, _ in samples], [c for _, c in samples]
                    poll_rows.append([kind, str(args.poll_jobs), name, ms(walls, 0.5), ms(walls, 0.99), ms(cpus, 0.5)])
            if args.only_poll:
                continue
            delays = propagation(spec, lock_url, workdir, args.changes)
            prop_rows.append([kind, str(len(delays)), ms(delays, 0.5), ms(delays, 0.95), f"{max(delays) * 1000:.2f}"])
            ticks = per_tick(spec, lock_url, args.ticks)
            mem_wall = statistics.median(w for w, _ in ticks["memory"])
            for name in ("memory", "shared"):
                walls = [w for w, _ in ticks[name]]
                cpus = [c for _, c in ticks[name]]
                extra = "" if name == "memory" else f"+{(statistics.median(walls) - mem_wall) * 1000:.2f}"
                tick_rows.append([kind, name, ms(walls, 0.5), ms(walls, 0.99), ms(cpus, 0.5), extra])
            standby = [c for _, c in ticks["standby read"]]
            tick_rows.append([kind, "standby: one watcher read", "", "", ms(standby, 0.5), ""])
        finally:
            drop(spec)
    print("\n### A standby's watcher woken with nothing changed: every job read vs the change counter, ms\n")
    print("| store | jobs | read | wall p50 | wall p99 | CPU p50 |\n|---|---|---|---|---|---|")
    for row in poll_rows:
        print("| " + " | ".join(row) + " |")
    print("\n### Change propagation (modify_job in one process -> EVENT_JOB_MODIFIED in another), ms\n")
    print("| store | changes | p50 | p95 | max |\n|---|---|---|---|---|")
    for row in prop_rows:
        print("| " + " | ".join(row) + " |")
    print("\n### One due job per loop pass on its holder (get_due_jobs + update_job + get_next_run_time), ms\n")
    print("| store | job store | wall p50 | wall p99 | CPU p50 | wall vs memory |\n|---|---|---|---|---|---|")
    for row in tick_rows:
        print("| " + " | ".join(row) + " |")
    return 0



if __name__ == "__main__":
    sys.exit(main())
