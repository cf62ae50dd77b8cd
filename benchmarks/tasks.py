"""The task pool under load: throughput, due-to-start lag, recovery after SIGKILL and CPU, per store.

    python benchmarks/tasks.py [--stores sqlite,mysql,postgresql,redis] [--tasks 20000] [--nodes 3]
                               [--concurrency 8] [--peer pgqueuer,procrastinate] [--rounds 3]
                               [--profile DIR] [--quick]

Per store, on a table (``?tasks_table=``) or namespace of its own, with ``--nodes`` worker
processes (``mutexcron run benchmarks/task_nodes.py``: one no-op handler, ``--concurrency``
handler threads each, through ``$MUTEXCRON_TASK_CONCURRENCY``):

1. **Baseline: the raw write rate of the same server**, measured in the same run: ``--nodes``
   processes, each on one connection of its own, repeat a one-row ``UPDATE t SET v = v + 1 WHERE
   id = <its row>`` in autocommit (SQL, through the store's own engine and driver) or a ``SET``
   of a key of its own (Redis) for ``--raw-seconds``; the sum of their rates.
2. **Throughput**: ``--tasks`` tasks added due now by this process before any node runs (one
   ``TaskPool.add`` after the other: the producer's add rate is printed too, it is not part of the
   throughput), then the nodes start together (each waits at a gate after its start-up, so
   imports and connections are not timed) and the time runs from the first handler start to the
   last completion (every task started, then ``TaskPool.summary()`` shows none left). Also: tasks
   run twice, and each node's CPU seconds (``/proc/<pid>/stat``) over that window.
3. **Idle**: the same nodes with nothing to do for ``--idle-seconds``: CPU seconds per node.
4. **Lag**: tasks added by ``--producers``-style subprocesses at a steady rate, each due 1 to 10 s
   ahead (uniform; ``timedelta`` dues, so the store's clock sets the due time), first at a light
   load (``--light-rate``, 5/s) then at 50 % of the throughput just measured, for
   ``--lag-seconds``. Lag = the handler's first line (``time.time()`` on the node) minus the task's
   due (store clock), corrected by the store clock's offset from this host's clock (measured once
   per store with ``TaskPool.store.now()``, the sample with the shortest round trip).
5. **Recovery after SIGKILL**: ``--kills`` times, a fresh set of nodes whose handler sleeps 30 s
   with lease ``--lease``; the node that starts the task is SIGKILLed mid-handler, and the time
   until another node's handler starts the task is measured (seconds, and as a multiple of the
   lease), plus how long after the killed node's lease ended (the store's ``lease_until``, store
   clock) the other node started it. A fresh node replaces the killed one before the next kill.

``--peer pgqueuer,procrastinate`` first runs the **peer comparison**: ``--rounds`` interleaved
rounds (the order rotated each round), each configuration on a fresh store of the same local
PostgreSQL: mutexcron (``--nodes`` ``mutexcron run`` nodes), the same without started marks (the
baseline that says what they cost), PgQueuer at batch 10 (its default) and
100 (``benchmarks/task_pgqueuer.py``, ``--nodes`` workers), procrastinate at concurrency 10
(``benchmarks/task_peer.py``). Each drains ``--tasks`` no-op tasks added before its workers start
(drain rate: first handler start to last completion; queueing time: gate opened to each task's
handler start), then takes the light lag load. The table gives the medians over rounds and
mutexcron's rate over each peer's, round by round. ``--stores none`` runs the comparison alone.
``--profile DIR`` samples one node with py-spy during the throughput run and the 50 % lag run
(raw stacks and a summary of where the on-CPU time goes, in DIR).

The targets of the issue are printed next to the results. Prints markdown tables; the store URLs
are those of ``overhead.py`` (``MUTEXCRON_TEST_<KIND>_URL`` or the local defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from overhead import isolated, md_table, server_url

from mutexcron.drill import percentile
from mutexcron.errors import MutexcronError
from mutexcron.tasks.pool import TaskPool

log = logging.getLogger("benchmarks.tasks")

HERE = Path(__file__).resolve().parent
NODE_JOBS = str(HERE / "task_nodes.py")
PEER_WORKER = str(HERE / "task_peer.py")
PGQUEUER_WORKER = str(HERE / "task_pgqueuer.py")
STORES = ("sqlite", "mysql", "postgresql", "redis")
CODE = "bench_noop"
#: Tasks per add_many (mutexcron) or enqueue of lists (PgQueuer) when queueing the drain backlog.
BATCH = 1000
#: Tasks added one at a time after the backlog: their rate sizes the lag phases' producers.
SINGLE_ADDS = 200
SLOW_CODE = "bench_slow"
#: The issue's targets: tasks/s, lag p50 ms, lag p99 ms.
TARGETS = {"redis": (5000, 5, 50), "postgresql": (2000, 15, 100), "sqlite": (1000, 15, 100), "mysql": (1000, 25, 250)}
#: Server processes whose CPU is counted as "server CPU" (same host only).
#: The load average when the run started (printed under the tables: other work on the machine shows there).
STARTED_LOAD = ""
SERVER_COMMS = {"mysql": ("mariadbd", "mysqld"), "postgresql": ("postgres",), "redis": ("redis-server",)}


@dataclass(frozen=True)
class Settings:
    tasks: int
    nodes: int
    concurrency: int
    raw_seconds: float
    idle_seconds: float
    lag_seconds: float
    light_rate: float
    due_min: float
    due_max: float
    kills: int
    lease: float
    profile: Path | None
    analyze: bool = False
    claim_ahead: int | None = None


# -- small helpers ---------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from ``/proc/<pid>/stat``; NaN if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(kind: str) -> list[int]:
    """The store server's processes on this host (none for SQLite, or a remote server)."""
    names = SERVER_COMMS.get(kind, ())
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in names:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class ServerCPU:
    """CPU seconds of the server's processes between :meth:`start` and :meth:`stop` (processes that
    start meanwhile count from their start; those that end meanwhile are lost: a floor)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.before: dict[int, float] = {}

    def start(self) -> None:
        self.before = {pid: cpu_seconds(pid) for pid in server_pids(self.kind)}

    def stop(self) -> float:
        if self.kind not in SERVER_COMMS:
            return math.nan
        total = 0.0
        for pid in server_pids(self.kind):
            now = cpu_seconds(pid)
            if math.isfinite(now):
                total += now - self.before.get(pid, 0.0)
        return total


def number(value: float, digits: int = 0) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def ratio(value: float, base: float, digits: int = 2) -> str:
    if not (math.isfinite(value) and math.isfinite(base)) or base <= 0:
        return "-"
    return f"{value / base:.{digits}f}x"


def versus(value: float, target: float, higher_is_better: bool) -> str:
    """``met (2.1x)`` / ``missed (0.4x)``: the value as a multiple of its target."""
    if not (math.isfinite(value) and math.isfinite(target)) or target <= 0:
        return "-"
    met = value >= target if higher_is_better else value <= target
    return f"{'met' if met else 'MISSED'} ({value / target:.2f}x)"


def wait_until(at: float) -> None:
    time.sleep(max(0.0, at - time.time()))


# -- what the nodes report -------------------------------------------------------------------------
@dataclass
class Calls:
    """Store calls counted in the nodes (``task_nodes.py``): per method ``[calls, items, seconds, slowest, slow
    calls]``, and round trips. The slowest call of a difference is the later total's (the whole run's so far)."""

    ops: dict[str, list[float]] = field(default_factory=dict)
    trips: int = 0
    counted: bool = False

    def __sub__(self, other: Calls) -> Calls:
        ops = {}
        for name, (calls, items, seconds, slowest, slow) in self.ops.items():
            c0, i0, s0, _, w0 = other.ops.get(name, (0, 0, 0.0, 0.0, 0))
            ops[name] = [calls - c0, items - i0, seconds - s0, slowest, slow - w0]
        return Calls(ops, self.trips - other.trips, self.counted)

    def slow(self) -> tuple[int, float]:
        """Calls of 50 ms or more, and the slowest call (s), over every method."""
        return sum(int(c[4]) for c in self.ops.values()), max((c[3] for c in self.ops.values()), default=0.0)

    def get(self, *names: str) -> tuple[float, float, float]:
        """calls, items, seconds of ``names`` together."""
        rows = [self.ops.get(n, [0, 0, 0.0]) for n in names]
        return sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows)


@dataclass
class Start:
    code: str
    key: str
    due_us: int
    start_us: int
    node: str


class Starts:
    """Every handler start the nodes appended to ``<dir>/*.starts``, read incrementally."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.first: dict[tuple[str, str], Start] = {}  # (code, key) -> first start
        self.by_key: dict[tuple[str, str], list[Start]] = {}
        self.lines = 0

    def poll(self) -> int:
        """Read what is new; returns how many starts were read."""
        new = 0
        for path in sorted(self.workdir.glob("*.starts")):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = self.partial.pop(path, b"") + f.read()
                self.offsets[path] = f.tell()
            *lines, rest = data.split(b"\n")
            if rest:
                self.partial[path] = rest
            for line in lines:
                code, key, due_us, start_us, node = line.decode().split(" ")
                s = Start(code, key, int(due_us), int(start_us), node)
                self.by_key.setdefault((code, key), []).append(s)
                self.first.setdefault((code, key), s)
                self.lines += 1
                new += 1
        return new

    def started(self, code: str, keys: list[str]) -> int:
        return sum(1 for k in keys if (code, k) in self.first)


class Nodes:
    """Worker processes (``mutexcron run`` nodes or peer workers) that each wait at a gate after start-up."""

    def __init__(self, label: str, command: list[str], env: dict[str, str], count: int) -> None:
        self.label = label
        self.command = command
        self.workdir = Path(tempfile.mkdtemp(prefix=f"mutexcron-tasks-{label}-"))
        self.gate = self.workdir / "gate"
        base = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
        self.env = {
            **base,
            **env,
            "MUTEXCRON_BENCH_DIR": str(self.workdir),
            "MUTEXCRON_BENCH_GATE": str(self.gate),
            "MUTEXCRON_DRILL_PARENT": str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
        }
        self.count = count
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        self.starts = Starts(self.workdir)

    def __enter__(self) -> Nodes:
        try:
            for _ in range(self.count):
                self.add()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self) -> str:
        node = f"{self.label}-{len(self.procs)}-{secrets.token_hex(2)}"
        with open(self.workdir / f"{node}.log", "wb") as out:  # Popen keeps its own copy
            self.procs[node] = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**self.env, "MUTEXCRON_NODE_ID": node},
                start_new_session=True,
            )
        return node

    def alive(self) -> dict[str, subprocess.Popen[bytes]]:
        return {n: p for n, p in self.procs.items() if n not in self.killed}

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.alive().items()}

    def check(self) -> None:
        for node, proc in self.alive().items():
            if proc.poll() is not None:
                raise MutexcronError(f"{self.label} node {node} exited with {proc.returncode}:\n{self.log_tail(node)}")

    def log_tail(self, node: str, lines: int = 25) -> str:
        path = self.workdir / f"{node}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            if all((self.workdir / f"{n}.ready").exists() for n in self.alive()):
                return
            time.sleep(0.02)
        raise MutexcronError(f"{self.label} nodes not ready after {timeout:g}s")

    def open_gate(self) -> None:
        self.gate.write_text("go")

    def cpu(self) -> dict[str, float]:
        return {n: cpu_seconds(pid) for n, pid in self.pids().items()}

    def calls(self, settle: float = 0.7) -> Calls:
        """The store calls the nodes counted so far (each node rewrites its file every 0.5 s: ``settle`` first)."""
        time.sleep(settle)
        total = Calls()
        for path in self.workdir.glob("*.calls.json"):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            total.trips += int(data["trips"])
            for name, (calls, items, seconds, slowest, slow) in data["calls"].items():
                c = total.ops.setdefault(name, [0, 0, 0.0, 0.0, 0])
                c[0], c[1], c[2], c[3], c[4] = c[0] + calls, c[1] + items, c[2] + seconds, max(c[3], slowest), c[4] + slow
        total.counted = any(self.workdir.glob("*.calls.json"))
        return total

    def kill(self, node: str) -> None:
        self.procs[node].send_signal(signal.SIGKILL)
        self.killed.add(node)

    def stop(self, kill: bool = False) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- profiling -------------------------------------------------------------------------------------
class Profiler:
    """py-spy on one process from :meth:`start` to :meth:`stop` (SIGINT: py-spy writes its file then)."""

    def __init__(self, outdir: Path | None, name: str, pid: int) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.raw = outdir / f"{name}.raw.txt" if outdir else None
        self.pid = pid
        if outdir is None:
            return
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if spy is None:
            print("--profile: py-spy is not installed (pip install py-spy): not profiling", file=sys.stderr)
            self.raw = None
            return
        outdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [spy, "record", "-p", str(pid), "-o", str(self.raw), "-f", "raw", "-r", "100", "--gil", "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> Path | None:
        if self.proc is None or self.raw is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self.raw.exists():
            return None
        summary = self.raw.with_suffix("").with_suffix(".summary.txt")
        summary.write_text(summarize_profile(self.raw))
        return summary


def summarize_profile(raw: Path, top: int = 25) -> str:
    """Where the sampled on-CPU time goes: by leaf function (self), by function anywhere on the stack
    (inclusive), and by thread."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        threads[frames[0]] = threads.get(frames[0], 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in {re.sub(r":\d+\)$", ")", f) for f in frames[1:]}:
            incl[frame] = incl.get(frame, 0) + count

    def block(title: str, counts: dict[str, int]) -> str:
        rows = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return f"{title}\n" + "".join(f"  {100 * c / max(total, 1):5.1f}%  {c:7d}  {name}\n" for name, c in rows)

    return (
        f"{raw.name}: {total} on-CPU samples (py-spy, 100 Hz)\n\n"
        + block("by thread:", threads)
        + "\n"
        + block("self (leaf frame):", own)
        + "\n"
        + block("inclusive (function anywhere on the stack, file without line):", incl)
    )


# -- the systems under test ------------------------------------------------------------------------
class System:
    """What the phases need from mutexcron on one store, or from a peer."""

    name: str
    kind: str
    tag: str  # for file names

    def add_now(self, key: str) -> None:
        raise NotImplementedError

    def add_batch(self, keys: list[str]) -> None:
        """Queue ``keys`` due now the fastest way the system offers (here: one at a time)."""
        for key in keys:
            self.add_now(key)

    def left(self) -> int:
        """Tasks not finished yet."""
        raise NotImplementedError

    def store_offset(self) -> float:
        """Seconds the store's clock is ahead of this host's."""
        raise NotImplementedError

    def nodes(self, count: int, **extra: str) -> Nodes:
        raise NotImplementedError

    def producer_spec(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def offset_of(now: Callable[[], datetime], samples: int = 15) -> float:
    """Store clock minus host clock, from the sample with the shortest round trip."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        t0 = time.time()
        at = now().timestamp()
        t1 = time.time()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, at - (t0 + t1) / 2)
    assert best is not None
    return best[1]


class Mutexcron(System):
    def __init__(self, kind: str, url: str, settings: Settings, *, start_marks: bool = True) -> None:
        self.kind = self.tag = kind
        self.url = url
        self.settings = settings
        self.pool = TaskPool(url)
        self.pool.store.ping()
        self.name = f"mutexcron, {version(kind, self.pool)}" + ("" if start_marks else ", no started marks (baseline)")
        self.env = {} if start_marks else {"MUTEXCRON_BENCH_NO_START_MARKS": "1"}

    def add_now(self, key: str) -> None:
        self.pool.add(CODE, key, timedelta(0))

    def add_batch(self, keys: list[str]) -> None:
        for start in range(0, len(keys), BATCH):
            self.pool.add_many([(CODE, key, timedelta(0)) for key in keys[start : start + BATCH]])

    def analyze(self) -> None:
        """SQL: refresh the task table's planner statistics (ANALYZE) now, not when autovacuum gets to it."""
        store: Any = self.pool.store
        if self.kind == "redis":
            return
        statement = {"mysql": f"ANALYZE TABLE {store.table}"}.get(self.kind, f"ANALYZE {store.table}")
        with store.backend.engine.connect() as conn:
            result = conn.exec_driver_sql(statement)
            if result.returns_rows:  # MySQL's ANALYZE TABLE answers with a status table
                result.fetchall()

    def left(self) -> int:
        return sum(s.queued + s.running for s in self.pool.store.summary([CODE]))

    def store_offset(self) -> float:
        return offset_of(self.pool.store.now)

    def nodes(self, count: int, **extra: str) -> Nodes:
        command = [sys.executable, "-m", "mutexcron", "run", NODE_JOBS, "--shutdown-timeout", "2"]
        env = {
            "MUTEXCRON_LOCK_URL": self.url,
            "MUTEXCRON_TASK_CONCURRENCY": str(self.settings.concurrency),
            **({"MUTEXCRON_TASK_CLAIM_AHEAD": str(self.settings.claim_ahead)} if self.settings.claim_ahead is not None else {}),
            "MUTEXCRON_BENCH_CODE": CODE,
            "MUTEXCRON_BENCH_SLOW_CODE": SLOW_CODE,
            **self.env,
            **extra,
        }
        return Nodes(self.kind, command, env, count)

    def producer_spec(self) -> dict[str, Any]:
        return {"system": "mutexcron", "url": self.url}

    def close(self) -> None:
        self.pool.close()


def version(kind: str, pool: TaskPool) -> str:
    store: Any = pool.store
    try:
        if kind in ("sqlite", "mysql", "postgresql"):
            query = {"sqlite": "SELECT sqlite_version()", "mysql": "SELECT VERSION()", "postgresql": "SHOW server_version"}
            with store.backend.engine.connect() as conn:
                return f"{kind} {conn.exec_driver_sql(query[kind]).scalar()}"
        if kind == "redis":
            return f"redis {store.backend.client.info('server')['redis_version']}"
    except Exception as exc:
        return f"{kind} (version unknown: {exc})"
    return kind


class Procrastinate(System):
    """procrastinate 3 on a database of its own on the local PostgreSQL server."""

    def __init__(self, concurrency: int) -> None:
        import procrastinate
        import psycopg

        self.kind = "postgresql"
        self.tag = f"procrastinate-c{concurrency}"
        self.concurrency = concurrency
        self.name = f"procrastinate {procrastinate.__version__}, concurrency {concurrency}"
        self.admin = (server_url("postgresql") or "").split("?")[0]
        self.db = f"mc_bench_proc_{secrets.token_hex(3)}"
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.db}")
        self.conninfo = self.admin.rsplit("/", 1)[0] + "/" + self.db
        from task_peer import make_app

        self.app, self.task = make_app(self.conninfo)
        self.app.open()
        self.app.schema_manager.apply_schema()
        self.conn = psycopg.connect(self.conninfo, autocommit=True)

    def add_now(self, key: str) -> None:
        self.task.defer(key=key)

    def left(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')").fetchone()
        return int(row[0]) if row else 0

    def store_offset(self) -> float:
        def now() -> datetime:
            row = self.conn.execute("SELECT clock_timestamp()").fetchone()
            assert row is not None
            return row[0]  # type: ignore[no-any-return]

        return offset_of(now)

    def nodes(self, count: int, **extra: str) -> Nodes:
        env = {"MUTEXCRON_BENCH_PG": self.conninfo, "MUTEXCRON_BENCH_CONCURRENCY": str(self.concurrency), **extra}
        return Nodes(f"procrastinate{self.concurrency}", [sys.executable, PEER_WORKER], env, count)

    def producer_spec(self) -> dict[str, Any]:
        return {"system": "procrastinate", "url": self.conninfo}

    def close(self) -> None:
        import psycopg

        with contextlib.suppress(Exception):
            self.app.close()
        with contextlib.suppress(Exception):
            self.conn.close()
        try:
            with psycopg.connect(self.admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {self.db} WITH (FORCE)")
        except Exception as exc:
            print(f"could not drop database {self.db}: {exc}", file=sys.stderr)


class PgQueuer(System):
    """PgQueuer on a database of its own on the local PostgreSQL server (``benchmarks/task_pgqueuer.py``)."""

    def __init__(self, batch: int) -> None:
        import pgqueuer
        import psycopg
        from pgqueuer.adapters.drivers.psycopg import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries
        from task_pgqueuer import install

        self.kind = "postgresql"
        self.tag = f"pgqueuer-b{batch}"
        self.batch = batch
        self.name = f"PgQueuer {pgqueuer.__version__}, batch {batch}"
        self.admin = (server_url("postgresql") or "").split("?")[0]
        self.db = f"mc_bench_pgq_{secrets.token_hex(3)}"
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.db}")
        self.dsn = self.admin.rsplit("/", 1)[0] + "/" + self.db
        import asyncio

        asyncio.run(install(self.dsn))
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.queries = SyncQueries(SyncPsycopgDriver(self.conn))

    def add_now(self, key: str) -> None:
        self.queries.enqueue(CODE, key.encode())

    def add_batch(self, keys: list[str]) -> None:
        for start in range(0, len(keys), BATCH):
            part = keys[start : start + BATCH]
            self.queries.enqueue([CODE] * len(part), [k.encode() for k in part], [0] * len(part))

    def left(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
        return int(row[0]) if row else 0

    def store_offset(self) -> float:
        def now() -> datetime:
            row = self.conn.execute("SELECT clock_timestamp()").fetchone()
            assert row is not None
            return row[0]  # type: ignore[no-any-return]

        return offset_of(now)

    def nodes(self, count: int, **extra: str) -> Nodes:
        env = {"MUTEXCRON_BENCH_PG": self.dsn, "MUTEXCRON_BENCH_BATCH": str(self.batch), **extra}
        return Nodes(self.tag, [sys.executable, PGQUEUER_WORKER], env, count)

    def producer_spec(self) -> dict[str, Any]:
        return {"system": "pgqueuer", "url": self.dsn}

    def close(self) -> None:
        import psycopg

        with contextlib.suppress(Exception):
            self.conn.close()
        try:
            with psycopg.connect(self.admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {self.db} WITH (FORCE)")
        except Exception as exc:
            print(f"could not drop database {self.db}: {exc}", file=sys.stderr)


# -- children: raw writers and producers -----------------------------------------------------------
def child_main(spec: dict[str, Any]) -> None:
    """A subprocess of this script: a raw writer or a producer. Prints one JSON line."""
    from mutexcron.drill import die_with_parent

    die_with_parent()
    if spec["role"] == "raw":
        print(json.dumps(raw_writer(spec)), flush=True)
    else:
        print(json.dumps(producer(spec)), flush=True)


def raw_writer(spec: dict[str, Any]) -> dict[str, float]:
    """One connection of its own; the cheapest durable write on its own row/key, as often as it can."""
    pool = TaskPool(spec["url"])
    store: Any = pool.store
    n, index = 0, int(spec["index"])
    try:
        if spec["kind"] == "redis":
            client, key = store.backend.client, store.backend.key(f"bench-raw:{index}")
            client.ping()
            wait_until(spec["start_at"])
            m0 = time.monotonic()
            end = m0 + spec["seconds"]
            while time.monotonic() < end:
                client.set(key, n)
                n += 1
        else:
            sql = f"UPDATE {spec['table']} SET v = v + 1 WHERE id = {index}"
            with store.backend.engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
                wait_until(spec["start_at"])
                m0 = time.monotonic()
                end = m0 + spec["seconds"]
                while time.monotonic() < end:
                    conn.exec_driver_sql(sql)
                    n += 1
        return {"writes": n, "seconds": time.monotonic() - m0}
    finally:
        pool.close()


def producer(spec: dict[str, Any]) -> dict[str, float]:
    """Add ``rate`` tasks per second for ``seconds``, each due ``uniform(due_min, due_max)`` s ahead."""
    rng = random.Random(spec["seed"])
    rate, prefix = spec["rate"], spec["prefix"]
    if spec["system"] == "procrastinate":
        from task_peer import make_app

        app, task = make_app(spec["url"])
        app.open()

        def add(key: str, ahead: float) -> None:
            task.configure(schedule_in={"seconds": ahead}).defer(key=key)

        close = app.close
    elif spec["system"] == "pgqueuer":
        import psycopg
        from pgqueuer.adapters.drivers.psycopg import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        conn = psycopg.connect(spec["url"], autocommit=True)
        queries = SyncQueries(SyncPsycopgDriver(conn))

        def add(key: str, ahead: float) -> None:
            queries.enqueue(CODE, key.encode(), 0, timedelta(seconds=ahead))

        close = conn.close
    else:
        pool = TaskPool(spec["url"])

        def add(key: str, ahead: float) -> None:
            pool.add(CODE, key, timedelta(seconds=ahead))

        close = pool.close
    add(f"{prefix}-warm", spec["due_max"])  # connect before the clock starts (a task like the others, not counted)
    wait_until(spec["start_at"])
    m0 = time.monotonic()
    count = int(rate * spec["seconds"])
    behind = 0.0
    for i in range(count):
        at = m0 + i / rate
        now = time.monotonic()
        if at > now:
            time.sleep(at - now)
        else:
            behind = max(behind, now - at)
        add(f"{prefix}-{i}", rng.uniform(spec["due_min"], spec["due_max"]))
    elapsed = time.monotonic() - m0
    close()
    return {"added": count, "seconds": elapsed, "behind_max": behind}


def run_children(specs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=HERE,
        )
        for spec in specs
    ]
    out = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise MutexcronError(f"benchmark child failed ({proc.returncode}): {stderr.decode(errors='replace')[-2000:]}")
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


# -- phases ----------------------------------------------------------------------------------------
@dataclass
class Throughput:
    tasks: int = 0
    add_rate: float = math.nan  # producer adds/s (one thread, before the nodes start)
    batch_seconds: float = math.nan  # queueing the --tasks tasks in batches of BATCH
    rate: float = math.nan  # tasks/s, first start -> last completion
    seconds: float = math.nan
    first_start_ms: float = math.nan  # gate -> first handler start
    queue_ms: list[float] = field(default_factory=list, repr=False)  # per task: gate -> its handler's start
    duplicates: int = 0
    cpu_nodes: list[float] = field(default_factory=list)  # CPU s per node, gate -> last completion
    cpu_server: float = math.nan
    calls: Calls | None = None
    profile: Path | None = None


@dataclass
class Lag:
    load: str
    offered: float  # tasks/s asked of the producers
    producers: int = 1
    added: int = 0
    add_rate: float = math.nan  # achieved
    started: int = 0
    duplicates: int = 0
    lags_ms: list[float] = field(default_factory=list, repr=False)
    cpu_nodes: list[float] = field(default_factory=list)
    calls: Calls | None = None
    profile: Path | None = None

    def p(self, q: float) -> float:
        return percentile(self.lags_ms, q)


@dataclass
class Recovery:
    lease: float
    gaps: list[float] = field(default_factory=list)  # s, SIGKILL -> another node's handler start
    after_expiry_ms: list[float] = field(default_factory=list)  # ms, killed lease's end (store) -> restart
    failed: int = 0


@dataclass
class Idle:
    seconds: float = math.nan
    cpu_nodes: list[float] = field(default_factory=list)
    cpu_server: float = math.nan


@dataclass
class Outcome:
    name: str
    kind: str
    peer: bool = False
    raw_rate: float = math.nan
    raw_detail: str = ""
    offset_ms: float = math.nan
    throughput: Throughput | None = None
    idle: Idle | None = None
    lags: list[Lag] = field(default_factory=list)
    recovery: Recovery | None = None
    notes: list[str] = field(default_factory=list)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def raw_rate(kind: str, url: str, settings: Settings) -> tuple[float, str]:
    """The sum of ``--nodes`` processes' one-row write rates, each on a connection of its own."""
    pool = TaskPool(url)
    store: Any = pool.store
    table = ""
    try:
        if kind != "redis":
            table = f"{store.table}_raw"
            with store.backend.engine.connect() as conn:
                conn.exec_driver_sql(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, v BIGINT)")
                for i in range(settings.nodes):
                    conn.exec_driver_sql(f"INSERT INTO {table} (id, v) VALUES ({i}, 0)")
        start_at = time.time() + 2.5
        specs = [
            {
                "role": "raw",
                "kind": kind,
                "url": url,
                "table": table,
                "index": i,
                "seconds": settings.raw_seconds,
                "start_at": start_at,
            }
            for i in range(settings.nodes)
        ]
        results = run_children(specs, timeout=settings.raw_seconds + 60)
        what = "1-row UPDATE, autocommit" if kind != "redis" else "SET"
        return sum(r["writes"] / r["seconds"] for r in results), f"{settings.nodes} processes x 1 connection, {what}"
    finally:
        if table:
            with store.backend.engine.connect() as conn:
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        pool.close()


def run_throughput(system: System, nodes: Nodes, settings: Settings) -> Throughput:
    result = Throughput(tasks=settings.tasks)
    keys = [f"t-{i}" for i in range(settings.tasks)]
    m0 = time.monotonic()
    system.add_batch(keys)  # add_many / enqueue of lists, 1,000 at a time (procrastinate: one by one)
    result.batch_seconds = time.monotonic() - m0
    singles = [f"t-single-{i}" for i in range(min(SINGLE_ADDS, max(20, len(keys) // 10)))]  # sizes the lag producers
    m0 = time.monotonic()
    for key in singles:
        system.add_now(key)
    result.add_rate = len(singles) / (time.monotonic() - m0)
    keys += singles
    result.tasks = len(keys)
    if settings.analyze and isinstance(system, Mutexcron):
        system.analyze()
    say(f"  {system.name}: {len(keys):,} tasks added ({result.add_rate:,.0f}/s); starting {nodes.count} nodes...")
    nodes.wait_ready()
    server = ServerCPU(system.kind)
    server.start()
    cpu0 = nodes.cpu()
    gate_wall = time.time()
    nodes.open_gate()
    profiler = Profiler(settings.profile, f"{system.tag}-throughput", next(iter(nodes.pids().values())))
    deadline = time.monotonic() + max(120.0, settings.tasks / 20)
    while nodes.starts.started(CODE, keys) < len(keys):
        if time.monotonic() > deadline:
            raise MutexcronError(f"only {nodes.starts.started(CODE, keys):,} of {len(keys):,} tasks started in time")
        nodes.check()
        time.sleep(0.1)
        nodes.starts.poll()
    while system.left() > 0:
        if time.monotonic() > deadline:
            raise MutexcronError(f"{system.left():,} tasks still not finished")
        time.sleep(0.02)
    end_wall = time.time()
    cpu1 = nodes.cpu()
    result.cpu_server = server.stop()
    result.profile = profiler.stop()
    calls = nodes.calls()
    result.calls = calls if calls.counted else None
    first = min(nodes.starts.first[(CODE, k)].start_us for k in keys) / 1e6
    result.seconds = end_wall - first
    result.rate = len(keys) / result.seconds
    result.first_start_ms = (first - gate_wall) * 1000
    result.queue_ms = [(nodes.starts.first[(CODE, k)].start_us / 1e6 - gate_wall) * 1000 for k in keys]
    result.duplicates = sum(len(nodes.starts.by_key[(CODE, k)]) - 1 for k in keys)
    result.cpu_nodes = [cpu1[n] - cpu0[n] for n in cpu0]
    return result


def run_idle(system: System, nodes: Nodes, settings: Settings) -> Idle:
    time.sleep(min(2.0, settings.idle_seconds))  # let the last round trips of the busy phase settle
    server = ServerCPU(system.kind)
    server.start()
    cpu0, m0 = nodes.cpu(), time.monotonic()
    time.sleep(settings.idle_seconds)
    cpu1, m1 = nodes.cpu(), time.monotonic()
    nodes.check()
    return Idle(m1 - m0, [cpu1[n] - cpu0[n] for n in cpu0], server.stop())


def run_lag(system: System, nodes: Nodes, settings: Settings, load: str, rate: float, add_rate: float, offset: float) -> Lag:
    """Producers add ``rate`` tasks/s for ``--lag-seconds``, each due 1-10 s ahead; wait for them all to start."""
    producers = max(1, min(4, math.ceil(rate / max(1.0, 0.4 * add_rate)))) if math.isfinite(add_rate) else 1
    result = Lag(load, rate, producers)
    prefix = f"lag-{load}-{secrets.token_hex(2)}"
    start_at = time.time() + 2.0  # the producers' imports and connections
    specs = [
        {
            **system.producer_spec(),
            "role": "producer",
            "rate": rate / producers,
            "seconds": settings.lag_seconds,
            "start_at": start_at,
            "prefix": f"{prefix}-{p}",
            "seed": p,
            "due_min": settings.due_min,
            "due_max": settings.due_max,
        }
        for p in range(producers)
    ]
    say(f"  {system.name}: lag at {load} load, {rate:,.1f} tasks/s from {producers} producer(s) for {settings.lag_seconds:g}s...")
    cpu0, calls0 = nodes.cpu(), nodes.calls(settle=0)
    pid = next(iter(nodes.pids().values()))
    phase = "lag-half" if load == "50%" else f"lag-{load}"
    profiler = Profiler(settings.profile if load != "light" else None, f"{system.tag}-{phase}", pid)
    results = run_children(specs, timeout=settings.lag_seconds + 120)
    keys = [f"{prefix}-{p}-{i}" for p, r in enumerate(results) for i in range(int(r["added"]))]
    result.added = len(keys)
    result.add_rate = sum(r["added"] / r["seconds"] for r in results)
    deadline = time.monotonic() + settings.due_max + 60
    while time.monotonic() < deadline:
        nodes.starts.poll()
        if nodes.starts.started(CODE, keys) >= len(keys):
            break
        nodes.check()
        time.sleep(0.2)
    result.profile = profiler.stop()
    cpu1, calls1 = nodes.cpu(), nodes.calls()
    result.cpu_nodes = [cpu1[n] - cpu0[n] for n in cpu0]
    result.calls = calls1 - calls0 if calls1.counted else None
    firsts = [nodes.starts.first[(CODE, k)] for k in keys if (CODE, k) in nodes.starts.first]
    result.started = len(firsts)
    result.duplicates = sum(len(nodes.starts.by_key[(CODE, k)]) - 1 for k in keys if (CODE, k) in nodes.starts.by_key)
    result.lags_ms = [((s.start_us / 1e6 + offset) - s.due_us / 1e6) * 1000 for s in firsts]
    return result


def run_recovery(system: Mutexcron, settings: Settings) -> Recovery:
    result = Recovery(settings.lease)
    extra = {
        "MUTEXCRON_BENCH_HANDLER": "slow",
        "MUTEXCRON_BENCH_SLOW_LEASE": str(settings.lease),
        "MUTEXCRON_BENCH_SLOW_SECONDS": "30",
    }
    say(f"  {system.name}: recovery after SIGKILL, lease {settings.lease:g}s, {settings.kills} kill(s)...")
    with system.nodes(settings.nodes, **extra) as nodes:
        nodes.open_gate()
        nodes.wait_ready()
        time.sleep(1.0)  # the schedulers start after the gate
        rng = random.Random(7)
        for k in range(settings.kills):
            key = f"kill-{k}-{secrets.token_hex(2)}"
            system.pool.add(SLOW_CODE, key, timedelta(0))
            holder = wait_start(nodes, key, exclude=None, timeout=30)
            if holder is None:
                result.failed += 1
                continue
            time.sleep(rng.uniform(0.3, 0.3 + settings.lease / 3))  # anywhere in the renewal cycle
            killed_at = time.time()
            nodes.kill(holder.node)
            time.sleep(0.1)
            record = system.pool.get(SLOW_CODE, key)
            lease_until = record.lease_until.timestamp() if record and record.lease_until else math.nan
            rescuer = wait_start(nodes, key, exclude=holder.node, timeout=settings.lease * 3 + 15)
            if rescuer is None:
                result.failed += 1
            else:
                result.gaps.append(rescuer.start_us / 1e6 - killed_at)
                offset = system.store_offset()
                result.after_expiry_ms.append((rescuer.start_us / 1e6 + offset - lease_until) * 1000)
            if k + 1 < settings.kills:
                nodes.add()
                nodes.wait_ready()
                time.sleep(1.0)
        nodes.stop(kill=True)
    return result


def wait_start(nodes: Nodes, key: str, exclude: str | None, timeout: float) -> Start | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes.starts.poll()
        for s in nodes.starts.by_key.get((SLOW_CODE, key), []):
            if s.node != exclude:
                return s
        time.sleep(0.01)
    return None


# -- one system ------------------------------------------------------------------------------------
def run_system(system: System, settings: Settings, out: Outcome, half_rate: float | None) -> None:
    """Throughput, idle, light and half lag on one node set; recovery (mutexcron only) on another."""
    out.offset_ms = system.store_offset() * 1000
    with system.nodes(settings.nodes) as nodes:
        out.throughput = run_throughput(system, nodes, settings)
        say(f"  {system.name}: {out.throughput.rate:,.0f} tasks/s; idle {settings.idle_seconds:g}s...")
        out.idle = run_idle(system, nodes, settings)
        offset = out.offset_ms / 1000
        out.lags.append(run_lag(system, nodes, settings, "light", settings.light_rate, out.throughput.add_rate, offset))
        rate = half_rate if half_rate is not None else 0.5 * out.throughput.rate
        out.lags.append(run_lag(system, nodes, settings, "50%", rate, out.throughput.add_rate, offset))
    if isinstance(system, Mutexcron) and settings.kills > 0:
        out.recovery = run_recovery(system, settings)


def task_url(kind: str) -> tuple[str, Callable[[], None]]:
    """A fresh URL: SQL ``?table=`` and ``?tasks_table=`` of their own, a Redis namespace, a SQLite file."""
    tag = secrets.token_hex(3)
    iso = isolated(kind, tag)
    if kind in ("mysql", "postgresql"):
        url = f"{iso.url}&tasks_table=mc_bench_{tag}_tasks"

        def cleanup() -> None:
            pool = TaskPool(url)
            store: Any = pool.store
            try:
                with store.backend.engine.connect() as conn:
                    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {store.table}")
            finally:
                pool.close()
            iso.cleanup()

        return url, cleanup
    return iso.url, iso.cleanup


def bench_store(kind: str, settings: Settings) -> Outcome:
    out = Outcome(kind, kind)
    try:
        url, cleanup = task_url(kind)
    except MutexcronError as exc:
        out.notes.append(f"{kind}: skipped ({exc})")
        return out
    system: Mutexcron | None = None
    try:
        system = Mutexcron(kind, url, settings)
        out.name = system.name
        say(f"{system.name}: raw write rate ({settings.nodes} processes, {settings.raw_seconds:g}s)...")
        out.raw_rate, out.raw_detail = raw_rate(kind, url, settings)
        run_system(system, settings, out, None)
    except MutexcronError as exc:
        out.notes.append(f"{kind}: failed ({exc})")
    finally:
        if system is not None:
            system.close()
        try:
            cleanup()
        except MutexcronError as exc:
            out.notes.append(f"{kind}: cleanup failed ({exc})")
    return out


# -- peers: interleaved rounds on the same PostgreSQL ----------------------------------------------
PEERS = ("pgqueuer", "procrastinate")


@dataclass
class PeerRow:
    """One configuration of the interleaved comparison, its figures per round."""

    name: str
    rates: list[float] = field(default_factory=list)  # drain tasks/s per round
    batch_seconds: list[float] = field(default_factory=list)  # queueing --tasks tasks, per round
    queue_ms: list[float] = field(default_factory=list, repr=False)  # every round's per-task gate -> start
    lags_ms: list[float] = field(default_factory=list, repr=False)  # light load, every round
    duplicates: int = 0
    cpu_ms_per_task: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


Maker = Callable[[], tuple[System, Callable[[], None]]]


def peer_makers(peers: list[str], settings: Settings, quick: bool) -> list[tuple[str, Maker]]:
    """(label, make) for mutexcron on PostgreSQL and each peer configuration; make returns a fresh system and its cleanup."""

    def mutexcron(start_marks: bool = True) -> tuple[System, Callable[[], None]]:
        url, cleanup = task_url("postgresql")
        return Mutexcron("postgresql", url, settings, start_marks=start_marks), cleanup

    def pgqueuer(batch: int) -> Maker:
        return lambda: (PgQueuer(batch), lambda: None)

    def procrastinate(concurrency: int) -> Maker:
        return lambda: (Procrastinate(concurrency), lambda: None)

    # the baseline without started marks: what counting only started attempts costs on the drain rate
    makers: list[tuple[str, Maker]] = [("mutexcron", mutexcron), ("mutexcron-no-marks", lambda: mutexcron(False))]
    if "pgqueuer" in peers and peer_installed("pgqueuer"):
        makers += [(f"pgqueuer-b{b}", pgqueuer(b)) for b in ((10,) if quick else (10, 100))]
    if "procrastinate" in peers and peer_installed("procrastinate"):
        makers.append(("procrastinate-c10", procrastinate(10)))
    return makers


def peer_installed(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        say(f"--peer {name}: not installed (pip install -e '.[bench]'): left out")
        return False
    return True


def bench_peers(peers: list[str], settings: Settings, rounds: int, quick: bool) -> dict[str, PeerRow]:
    """Every configuration once per round, the order rotated each round, each on a fresh store:
    drain ``--tasks`` tasks added before the workers start, then the light lag load."""
    makers = peer_makers(peers, settings, quick)
    rows: dict[str, PeerRow] = {}
    for r in range(rounds):
        order = makers[r % len(makers) :] + makers[: r % len(makers)]
        for label, make in order:
            row = rows.setdefault(label, PeerRow(label))
            say(f"round {r + 1}/{rounds}: {label}...")
            try:
                peer_round(make, settings, row)
            except Exception as exc:  # one configuration's failure must not cost the others' rows
                row.failures.append(f"round {r + 1}: {type(exc).__name__}: {exc}")
                row.rates.append(math.nan)
    return {label: rows[label] for label, _ in makers if label in rows}


def peer_round(make: Maker, settings: Settings, row: PeerRow) -> None:
    system, cleanup = make()
    try:
        row.name = system.name
        offset = system.store_offset()
        with system.nodes(settings.nodes) as nodes:
            t = run_throughput(system, nodes, settings)
            lag = run_lag(system, nodes, settings, "light", settings.light_rate, t.add_rate, offset)
        row.rates.append(t.rate)
        row.batch_seconds.append(t.batch_seconds)
        row.queue_ms += t.queue_ms
        row.lags_ms += lag.lags_ms
        row.duplicates += t.duplicates + lag.duplicates
        row.cpu_ms_per_task.append(1000 * sum(t.cpu_nodes) / max(t.tasks, 1))
        if lag.started < lag.added:
            row.failures.append(f"only {lag.started} of {lag.added} light-load tasks started")
    finally:
        system.close()
        cleanup()


def render_peers(rows: dict[str, PeerRow], settings: Settings, rounds: int) -> str:
    """The comparison table: the ratio is mutexcron's drain rate over the configuration's, round by round."""
    base = rows.get("mutexcron")
    header = [
        "system",
        "drain tasks/s (median of rounds)",
        "each round",
        "mutexcron / this (median of per-round ratios)",
        f"adding {settings.tasks:,} tasks, s (batches of {BATCH:,}; median)",
        "queueing ms p50 / p99 (drain)",
        "lag ms p50 / p99 (light load)",
        "run twice",
        "node CPU ms per task",
    ]
    out = []
    for label, row in rows.items():
        pairs = zip(base.rates, row.rates, strict=False) if base else []
        ratios = [m / p for m, p in pairs if math.isfinite(m) and math.isfinite(p) and p > 0]
        out.append(
            [
                row.name,
                number(percentile([x for x in row.rates if math.isfinite(x)], 50)),
                ", ".join(number(x) for x in row.rates),
                "-" if label == "mutexcron" or not ratios else f"{percentile(ratios, 50):.2f}x",
                f"{percentile(row.batch_seconds, 50):.2f}" + ("" if label != "procrastinate-c10" else " (one by one)"),
                f"{number(percentile(row.queue_ms, 50))} / {number(percentile(row.queue_ms, 99))}",
                f"{number(percentile(row.lags_ms, 50), 1)} / {number(percentile(row.lags_ms, 99), 1)}",
                f"{row.duplicates:,}",
                number(percentile(row.cpu_ms_per_task, 50), 3),
            ]
        )
    notes = [f"_{row.name}: {f}_" for row in rows.values() for f in row.failures]
    title = (
        f"## Peers on the same PostgreSQL: {rounds} interleaved round(s), {settings.tasks:,} no-op tasks drained by "
        f"{settings.nodes} workers, then {settings.light_rate:g} tasks/s for {settings.lag_seconds:g}s due "
        f"{settings.due_min:g}-{settings.due_max:g}s ahead"
    )
    return title + "\n\n" + md_table(header, out) + ("\n\n" + "\n\n".join(notes) if notes else "") + "\n"


# -- output ----------------------------------------------------------------------------------------
def mean(values: list[float]) -> float:
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def render(outcomes: list[Outcome], settings: Settings) -> str:
    pg = next((o for o in outcomes if o.kind == "postgresql" and not o.peer and o.throughput), None)
    parts = []

    # throughput
    header = [
        "system",
        "tasks",
        f"added in batches of {BATCH:,}, s",
        "producer adds/s",
        "raw writes/s (baseline)",
        "tasks/s",
        "tasks/s / raw writes/s",
        "target tasks/s",
        "vs target",
        "first start after gate ms",
        "run twice",
        "node CPU s (mean / max)",
        "node CPU ms per task",
        "server CPU s",
    ]
    rows = []
    for o in outcomes:
        t = o.throughput
        if t is None:
            continue
        target = TARGETS.get(o.kind, (math.nan,))[0] if not o.peer else math.nan
        peer_ratio = f" ({ratio(t.rate, pg.throughput.rate)} of mutexcron)" if o.peer and pg and pg.throughput else ""
        rows.append(
            [
                o.name,
                f"{t.tasks:,}",
                f"{t.batch_seconds:.2f}",
                number(t.add_rate),
                number(o.raw_rate),
                number(t.rate) + peer_ratio,
                ratio(t.rate, o.raw_rate),
                number(target),
                versus(t.rate, target, True),
                number(t.first_start_ms),
                f"{t.duplicates:,}",
                f"{number(mean(t.cpu_nodes), 2)} / {number(max(t.cpu_nodes, default=math.nan), 2)}",
                number(1000 * sum(t.cpu_nodes) / max(t.tasks, 1), 3),
                number(t.cpu_server, 2),
            ]
        )
    parts.append("## Throughput\n\n" + md_table(header, rows))

    # store calls
    header = [
        "system",
        "round trips per task",
        "claims per task",
        "tasks per claim",
        "claim ms (mean)",
        "completion calls per task",
        "tasks per completion call",
        "completion call ms (mean)",
        "next_due per task",
        "calls >= 50 ms / slowest ms",
        "other calls",
    ]
    rows = []
    for o in outcomes:
        t = o.throughput
        if t is None or t.calls is None:
            continue
        n = max(t.tasks, 1)
        claims, claimed, claim_s = t.calls.get("claim")
        done_calls, done_items, done_s = t.calls.get("complete_many", "complete")
        next_due = t.calls.get("next_due")[0]
        known = ("claim", "complete_many", "complete", "next_due")
        other = ", ".join(f"{name} {int(c[0])}" for name, c in sorted(t.calls.ops.items()) if name not in known and c[0])
        rows.append(
            [
                o.name,
                number(t.calls.trips / n, 2),
                number(claims / n, 2),
                number(claimed / max(claims, 1), 2),
                number(1000 * claim_s / max(claims, 1), 2),
                number(done_calls / n, 2),
                number(done_items / max(done_calls, 1), 2),
                number(1000 * done_s / max(done_calls, 1), 2),
                number(next_due / n, 3),
                f"{t.calls.slow()[0]:,} / {number(1000 * t.calls.slow()[1])}",
                other or "-",
            ]
        )
    if rows:
        parts.append("## Store calls in the throughput run (counted in the nodes, all together)\n\n" + md_table(header, rows))

    # lag
    header = [
        "system",
        "load",
        "tasks/s offered / added",
        "producers",
        "tasks started",
        "lag p50 ms",
        "lag p99 ms",
        "lag max ms",
        "target p50 / p99 ms",
        "p50 vs target",
        "p99 vs target",
        "run twice",
        "node CPU s (mean)",
        "round trips per task",
        "store calls >= 50 ms",
    ]
    rows = []
    for o in outcomes:
        pg_lags = {lag.load: lag for lag in pg.lags} if pg else {}
        for lag in o.lags:
            _, t50, t99 = TARGETS.get(o.kind, (0, math.nan, math.nan)) if not o.peer else (0, math.nan, math.nan)
            p50, p99 = lag.p(50), lag.p(99)
            base = pg_lags.get(lag.load) if o.peer else None
            rel = f" ({ratio(p50, base.p(50))} of mutexcron)" if base else ""
            rel99 = f" ({ratio(p99, base.p(99))} of mutexcron)" if base else ""
            rows.append(
                [
                    o.name,
                    lag.load,
                    f"{number(lag.offered, 1)} / {number(lag.add_rate, 1)}",
                    str(lag.producers),
                    f"{lag.started:,} / {lag.added:,}",
                    number(p50, 1) + rel,
                    number(p99, 1) + rel99,
                    number(max(lag.lags_ms, default=math.nan), 1),
                    f"{number(t50)} / {number(t99)}",
                    versus(p50, t50, False),
                    versus(p99, t99, False),
                    f"{lag.duplicates:,}",
                    number(mean(lag.cpu_nodes), 2),
                    number(lag.calls.trips / max(lag.added, 1), 2) if lag.calls else "-",
                    f"{lag.calls.slow()[0]:,}" if lag.calls else "-",
                ]
            )
    parts.append("## Due-to-start lag\n\n" + md_table(header, rows))

    # recovery
    header = [
        "system",
        "lease s",
        "kills",
        "recovered",
        "SIGKILL -> restart median s",
        "max s",
        "median / lease",
        "max / lease",
        "after the lease ended (store clock) median ms",
        "max ms",
    ]
    rows = []
    for o in outcomes:
        r = o.recovery
        if r is None:
            continue
        med, top = percentile(r.gaps, 50), max(r.gaps, default=math.nan)
        rows.append(
            [
                o.name,
                number(r.lease, 1),
                str(len(r.gaps) + r.failed),
                f"{len(r.gaps)}",
                number(med, 2),
                number(top, 2),
                number(med / r.lease, 2),
                number(top / r.lease, 2),
                number(percentile(r.after_expiry_ms, 50), 1),
                number(max(r.after_expiry_ms, default=math.nan), 1),
            ]
        )
    if rows:
        parts.append("## Recovery after SIGKILL\n\n" + md_table(header, rows))

    # idle
    header = ["system", "idle s", "node CPU s (mean / max)", "% of a core per node", "server CPU s"]
    rows = []
    for o in outcomes:
        i = o.idle
        if i is None:
            continue
        rows.append(
            [
                o.name,
                number(i.seconds, 1),
                f"{number(mean(i.cpu_nodes), 3)} / {number(max(i.cpu_nodes, default=math.nan), 3)}",
                number(100 * mean(i.cpu_nodes) / i.seconds, 2),
                number(i.cpu_server, 2),
            ]
        )
    parts.append("## Idle (no due task)\n\n" + md_table(header, rows))

    notes = [n for o in outcomes for n in o.notes]
    offsets = ", ".join(f"{o.name}: {number(o.offset_ms, 2)} ms" for o in outcomes if math.isfinite(o.offset_ms))
    profiles = [
        str(p) for o in outcomes for p in [o.throughput.profile if o.throughput else None, *(lag.profile for lag in o.lags)] if p
    ]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    tail = [f"_load average at the end (1, 5, 15 min): {load}; at the start: {STARTED_LOAD}_"]
    tail += [f"_store clock - host clock (the lag correction): {offsets}_"] if offsets else []
    tail += [f"_profile summaries: {', '.join(profiles)}_"] if profiles else []
    tail += [f"_{n}_" for n in notes]
    return "\n\n".join(parts) + ("\n\n" + "\n\n".join(tail) if tail else "") + "\n"


def legend(settings: Settings, argv: list[str]) -> str:
    import mutexcron

    where = Path(mutexcron.__file__).resolve().parent.parent
    git = ["git", "-C", str(where)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--short", "--", "mutexcron"], capture_output=True, text=True).stdout.split()
    changed = [p for p in dirty if p.startswith("mutexcron/")]
    lib = f"library at {head}" if head else f"library from {where} ({getattr(mutexcron, '__version__', '?')})"
    lib += f" + uncommitted changes in {', '.join(changed)}" if changed else ""
    return (
        f"# Task pool: {settings.nodes} worker nodes x {settings.concurrency} handler threads, {os.cpu_count()} CPUs "
        f"(`python benchmarks/tasks.py {' '.join(argv)}`; {lib})\n\n"
        f"Throughput: {settings.tasks:,} no-op tasks due now, added before the nodes start; tasks/s from the first "
        "handler start to the last completion, next to the raw write rate of the same server measured in the same "
        f"run ({settings.nodes} processes, one connection each: a 1-row autocommit UPDATE of its own row, or a Redis "
        f"SET of its own key, for {settings.raw_seconds:g}s). Lag: tasks added at a steady rate for "
        f"{settings.lag_seconds:g}s, each due {settings.due_min:g}-{settings.due_max:g}s ahead (uniform, by the store's "
        "clock); lag = the handler's first line (the node's time.time()) minus the due time, corrected by the store "
        "clock's offset from this host's (nodes and servers share this host's clock here). Light load: "
        f"{settings.light_rate:g}/s; 50%: half the throughput measured just before (a peer gets the same rate as "
        f"mutexcron's PostgreSQL). Idle: the same nodes, {settings.idle_seconds:g}s without a due task. Recovery: "
        f"the node running a 30 s handler (lease {settings.lease:g}s) is SIGKILLed; time until another node's "
        "handler starts the task. "
        + ("The task table was ANALYZEd after the throughput run's adds. " if settings.analyze else "")
        + "Server CPU: the server's processes on this host (a floor: processes that ended "
        "meanwhile are not counted).\n"
    )


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(STORES), help=f"comma-separated [{','.join(STORES)}]")
    parser.add_argument("--tasks", type=int, default=None, help="tasks in the throughput run [20000; --quick 300]")
    parser.add_argument("--nodes", type=int, default=3, help="worker processes [3]")
    parser.add_argument("--concurrency", type=int, default=8, help="handler threads per node [8, the default]")
    parser.add_argument("--claim-ahead", type=int, default=None, help="tasks a node claims beyond its free threads [the default]")
    parser.add_argument("--raw-seconds", type=float, default=None, help="seconds of the raw write baseline [5]")
    parser.add_argument("--idle-seconds", type=float, default=None, help="seconds of the idle run [30]")
    parser.add_argument("--lag-seconds", type=float, default=None, help="seconds producers add tasks, per lag load [30]")
    parser.add_argument("--light-rate", type=float, default=5.0, help="tasks/s of the light lag load [5]")
    parser.add_argument("--kills", type=int, default=None, help="SIGKILLs per store in the recovery run; 0: none [3]")
    parser.add_argument("--lease", type=float, default=3.0, help="the slow handler's lease in the recovery run [3]")
    parser.add_argument(
        "--peer",
        default="none",
        help=f"comma-separated [{','.join(PEERS)}]: interleaved rounds of mutexcron (PostgreSQL) and these peers against "
        "the same PostgreSQL (benchmark-only dependencies: pip install -e '.[bench]') [none]",
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the peer comparison [3; --quick 1]")
    parser.add_argument("--profile", type=Path, default=None, help="sample a node with py-spy; write the profiles here")
    parser.add_argument(
        "--analyze",
        action="store_true",
        help="SQL stores: ANALYZE the task table once the throughput run's tasks are added [no: autovacuum's timing]",
    )
    parser.add_argument("--due-min", type=float, default=1.0, help="lag runs: tasks due at least this many s ahead [1]")
    parser.add_argument("--due-max", type=float, default=None, help="lag runs: due at most this many s ahead [10; --quick 3]")
    parser.add_argument("--quick", action="store_true", help="small numbers for a smoke run (due 1-3 s ahead)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.stores.split(",") if k.strip() and k.strip() != "none"]
    args.peers = [p.strip() for p in args.peer.split(",") if p.strip() and p.strip() != "none"]
    if set(args.peers) - set(PEERS):
        parser.error(f"choose peers from {', '.join(PEERS)}")
    args.compare = bool(args.peers) or args.rounds is not None  # --rounds alone: mutexcron's rows only
    args.rounds = args.rounds or (1 if args.quick else 3)
    if set(args.kinds) - set(STORES):
        parser.error(f"choose stores from {', '.join(STORES)}")
    quick = args.quick
    args.settings = Settings(
        tasks=args.tasks or (300 if quick else 20_000),
        nodes=args.nodes,
        concurrency=args.concurrency,
        raw_seconds=args.raw_seconds or (1.0 if quick else 5.0),
        idle_seconds=args.idle_seconds or (2.0 if quick else 30.0),
        lag_seconds=args.lag_seconds or (3.0 if quick else 30.0),
        light_rate=args.light_rate,
        due_min=args.due_min,
        due_max=args.due_max or (3.0 if quick else 10.0),
        kills=args.kills if args.kills is not None else (1 if quick else 3),
        lease=args.lease,
        profile=args.profile,
        analyze=args.analyze,
        claim_ahead=args.claim_ahead,
    )
    return args


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    logging.basicConfig(level=logging.WARNING)
    global STARTED_LOAD
    STARTED_LOAD = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    settings: Settings = args.settings
    print(legend(settings, raw_argv), flush=True)
    if args.compare:
        rows = bench_peers(args.peers, settings, args.rounds, args.quick)
        print(render_peers(rows, settings, args.rounds), flush=True)
    outcomes = [bench_store(kind, settings) for kind in args.kinds]
    if outcomes:
        print(render(outcomes, settings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
