"""How far it scales, and what the guard costs: J every-second jobs on 3 nodes, guarded vs plain APScheduler.

    python benchmarks/scale.py [--stores sqlite,redis] [--jobs 10,100,1000] [--groups 10] [--duration 30] [--json [FILE]]
    python benchmarks/scale.py --quick   # a smoke run: SQLite, 10 jobs, 2 nodes, 3 s
    python benchmarks/scale.py --placement balanced,first   # each store's row with each placement

Row sets: each ``--jobs`` count J with one lock per job, and the largest J in ``--groups`` lock
groups (J / G jobs per lock). For each row set it first runs the **plain baseline**: ``--nodes``
processes of ``plain_jobs.py``, each running all J jobs unguarded on a plain APScheduler
``BlockingScheduler`` (APScheduler's floor). Then, for each store, ``--nodes`` ``mutexcron run``
nodes of ``scale_jobs.py`` (through :class:`mutexcron.drill.Cluster`, so they are real processes
and are cleaned up the same way) run the same J jobs guarded. Each run warms up, then measures for
``--duration`` seconds starting on a whole second:

* CPU seconds per node per minute: user + system of each node process, ``/proc/<pid>/stat``;
* start delay p50/p99: when the job's function started minus its scheduled fire time;
* store calls per second per node, counted in the nodes by the drill's
  :class:`~mutexcron.drill.TimedLockStore` (plain: 0), and the ``acquire_or_renew`` latency they saw;
* fire times run (within ``--drain`` s), missed, duplicated: guarded, cluster-wide (each fire time
  of each job exactly once across the nodes); plain, per node (each node runs each fire time once);
* APScheduler's warnings in the node logs: runs skipped by ``max_instances``, misfires;
* the batched hand-offs: how long a run's hand-off waited for the store call that carried it
  (p50 / p99 of the worst node, max of all), and hand-offs per store call.

With ``--operations`` each store runs two clusters **side by side**, measured in one window: one
without run history or metrics (``?history=0``, no port), one with both (the default 20 runs per
job, ``/metrics`` served on a free port by each node), each on a table / namespace / file of its
own; ``--repeats`` such pairs, the order in which they start swapped each time. Run one after the
other, two rows of the same set-up differed by up to 25 % on this 2-core machine (the machine's own
drift, which no row order cancels); side by side, both clusters see the same drift, so the
change between them is what history and metrics cost. A note under the table gives each pair's
change in CPU per node and their mean.

Every guarded figure is also printed as a ratio to the plain baseline of the same row set. Prints one
markdown table per row set; ``--json`` prints JSON instead (or, with a file name, writes it there as
well). The store URLs are those of ``overhead.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import apscheduler
from overhead import ALL_STORES, Isolated, isolated, md_table, server_version
from scale_runs import Run, read_runs

from mutexcron.drill import Cluster, percentile
from mutexcron.errors import MutexcronError
from mutexcron.locks import lock_store_from_url

log = logging.getLogger("benchmarks.scale")

GUARDED_JOBS = str(Path(__file__).with_name("scale_jobs.py"))  # what the guarded nodes run (mutexcron run)
PLAIN_JOBS = str(Path(__file__).with_name("plain_jobs.py"))  # what the plain nodes run (python)
PLAIN = f"plain APScheduler {apscheduler.__version__}"
#: The figures printed as guarded / plain.
RATIO_FIELDS = (
    "cpu_per_node_min", "delay_p50", "delay_p99", "calls_per_s_node", "run", "missed", "duplicated",
    "skipped_max_instances", "misfired",
)


@dataclass(frozen=True)
class Settings:
    duration: float
    warmup: float
    drain: float
    nodes: int
    lease: float
    workers: int
    pool_size: int | None
    metrics: bool = False  # the guarded nodes serve /metrics (mutexcron run --metrics-port, a free port each)
    history: bool = True  # False: the nodes keep no run history (?history=0 on their URL)
    repeat: int = 0  # --operations: which side-by-side pair (1, 2, ...), shown in the row's name
    placement: str = "balanced"  # the guarded nodes' --placement


@dataclass(frozen=True)
class RowSet:
    """J every-second jobs on L locks (L = J: each job its own lock)."""

    jobs: int
    locks: int

    @property
    def title(self) -> str:
        if self.locks == self.jobs:
            return f"{self.jobs:,} every-second jobs, each with its own lock"
        return f"{self.jobs:,} every-second jobs in {self.locks:,} lock groups ({self.jobs / self.locks:g} jobs per lock)"


@dataclass
class Window:
    """The measured window: wall-clock ``[w0, w1)``, the same on the monotonic clock, CPU per node."""

    wall: tuple[float, float]
    mono: tuple[float, float]
    cpu_per_min: list[float]  # CPU seconds per minute of each node in the window

    @property
    def seconds(self) -> float:
        return self.mono[1] - self.mono[0]


@dataclass
class FireCounts:
    """What happened to the fire times of the window, for one node (plain) or the cluster (guarded)."""

    expected: int
    run: float  # fire times run within --drain s of their time
    missed: float  # expected - run
    duplicated: float  # runs beyond the first of a fire time
    delays: list[float] = field(default_factory=list, repr=False)  # seconds, every run


@dataclass
class Result:
    name: str  # "plain APScheduler 3.11.3" or "sqlite 3.40.1"
    kind: str  # "plain" or the store kind
    jobs: int
    locks: int  # 0 for plain
    seconds: float
    expected: int  # fire times in the window (plain: per node)
    run: float  # plain: mean per node
    missed: float
    duplicated: float
    delay_p50: float  # ms
    delay_p99: float
    cpu_per_node_min: float
    cpu_max_node_min: float
    calls_per_s_node: float = 0.0
    acquire_p50: float = math.nan  # ms
    acquire_p99: float = math.nan
    skipped_max_instances: int = 0  # all nodes
    misfired: int = 0
    #: Guarded: how long a run's hand-off waited for the store call carrying it (p50 / p99 / max over
    #: the nodes' latest 4,096 hand-offs each, ms), and hand-offs per store call.
    handoff_wait_p50: float = math.nan
    handoff_wait_p99: float = math.nan
    handoff_wait_max: float = math.nan
    handoffs_per_call: float = math.nan
    #: By node: plain, its run/missed/duplicated; guarded, its CPU s per minute and the runs it started per second.
    per_node: dict[str, dict[str, float]] = field(default_factory=dict)


# -- measuring ------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def observe(check: Callable[[], None], pids: list[int], settings: Settings) -> Window:
    """Warm up, measure ``duration`` s from a whole second (so every job has the same fire times in
    it), then wait ``drain`` s for late runs to finish and be flushed. ``check`` raises if a node died."""
    time.sleep(settings.warmup)
    check()
    w0 = float(int(time.time()) + 1)
    time.sleep(max(0.0, w0 - time.time()))
    cpu0 = [cpu_seconds(pid) for pid in pids]
    m0 = time.monotonic()
    time.sleep(settings.duration)
    cpu1 = [cpu_seconds(pid) for pid in pids]
    m1 = time.monotonic()
    time.sleep(settings.drain)
    check()
    per_min = [(b - a) / (m1 - m0) * 60 for a, b in zip(cpu0, cpu1, strict=True)]
    return Window((w0, w0 + (m1 - m0)), (m0, m1), per_min)


def count_fires(runs: list[Run], window: Window, jobs: int, drain: float) -> FireCounts:
    """Every (job, fire time) of the window: ran in time, missed, or ran more than once."""
    w0, w1 = window.wall
    by_fire: dict[tuple[int, float], list[float]] = {}
    for r in runs:
        if w0 <= r.fire < w1:
            by_fire.setdefault((r.job, round(r.fire, 3)), []).append(r.started - r.fire)
    expected = jobs * (math.ceil(w1) - int(w0))  # whole-second fire times in [w0, w1)
    in_time = sum(1 for delays in by_fire.values() if min(delays) <= drain)
    return FireCounts(
        expected=expected,
        run=in_time,
        missed=expected - in_time,
        duplicated=sum(len(delays) - 1 for delays in by_fire.values()),
        delays=[d for delays in by_fire.values() for d in delays],
    )


def log_warnings(workdir: Path, nodes: list[str]) -> tuple[int, int]:
    """APScheduler's "skipped: max_instances" and "was missed by" warnings in the nodes' logs."""
    text = "".join((workdir / f"{n}.log").read_text(errors="replace") for n in nodes if (workdir / f"{n}.log").exists())
    return (
        len(re.findall(r"maximum number of running instances reached", text)),
        len(re.findall(r"was missed by", text)),
    )


def result(name: str, kind: str, rs: RowSet, window: Window, counts: FireCounts, **extra: Any) -> Result:
    """A Result from the window and the fire-time counts (``extra``: the other fields)."""
    return Result(
        name=name, kind=kind, jobs=rs.jobs, locks=rs.locks if kind != "plain" else 0, seconds=window.seconds,
        expected=counts.expected, run=counts.run, missed=counts.missed, duplicated=counts.duplicated,
        delay_p50=percentile(counts.delays, 50) * 1000, delay_p99=percentile(counts.delays, 99) * 1000,
        cpu_per_node_min=sum(window.cpu_per_min) / len(window.cpu_per_min), cpu_max_node_min=max(window.cpu_per_min),
        **extra,
    )


# -- the plain baseline ---------------------------------------------------------------------------
class PlainNodes:
    """N ``plain_jobs.py`` processes, started, checked and stopped the way the drill's Cluster does it."""

    def __init__(self, nodes: int, env: dict[str, str]) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="mutexcron-scale-plain-"))
        self.nodes = nodes
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
        self.env.update(env, MUTEXCRON_SCALE_DIR=str(self.workdir), MUTEXCRON_DRILL_PARENT=str(os.getpid()))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> PlainNodes:
        try:
            for i in range(self.nodes):
                node = f"plain-{i}-{secrets.token_hex(2)}"
                with open(self.workdir / f"{node}.log", "wb") as out:  # Popen keeps its own copy
                    self.procs[node] = subprocess.Popen(
                        [sys.executable, PLAIN_JOBS], stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                        env={**self.env, "MUTEXCRON_NODE_ID": node, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                    )
        except BaseException:
            self.__exit__()
            raise
        return self

    def check(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / f"{node}.log").read_text(errors="replace")[-2000:]
                raise MutexcronError(f"plain node {node} exited with {proc.returncode}:\n{tail}")

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def run_plain(rs: RowSet, settings: Settings) -> Result:
    """Every node runs all J jobs unguarded; fire-time counts are per node, averaged over the nodes."""
    env = {"MUTEXCRON_SCALE_JOBS": str(rs.jobs), "MUTEXCRON_SCALE_WORKERS": str(settings.workers or "")}
    with PlainNodes(settings.nodes, env) as plain:
        window = observe(plain.check, [p.pid for p in plain.procs.values()], settings)
        runs = read_runs(plain.workdir)
        skipped, misfired = log_warnings(plain.workdir, list(plain.procs))
        nodes = list(plain.procs)
    by_node = {n: count_fires([r for r in runs if r.node == n], window, rs.jobs, settings.drain) for n in nodes}
    counts = FireCounts(
        expected=by_node[nodes[0]].expected,
        run=sum(c.run for c in by_node.values()) / len(nodes),
        missed=sum(c.missed for c in by_node.values()) / len(nodes),
        duplicated=sum(c.duplicated for c in by_node.values()) / len(nodes),
        delays=[d for c in by_node.values() for d in c.delays],
    )
    per_node = {n: {"run": c.run, "missed": c.missed, "duplicated": c.duplicated} for n, c in by_node.items()}
    return result(PLAIN, "plain", rs, window, counts, skipped_max_instances=skipped, misfired=misfired, per_node=per_node)


# -- guarded --------------------------------------------------------------------------------------
def guarded_cluster(kind: str, url: str, rs: RowSet, settings: Settings) -> Cluster:
    """``--nodes`` ``mutexcron run`` nodes of ``scale_jobs.py`` running J guarded jobs on ``url`` (not started)."""
    prefix = f"scale-{secrets.token_hex(3)}"
    locks = tuple(f"{prefix}-{i}" for i in range(rs.locks))
    cluster = Cluster(
        url, nodes=settings.nodes, unactive_interval=settings.lease, lock=locks[0], jobs=GUARDED_JOBS, release_locks=locks
    )
    pool = {"pool_size": settings.pool_size} if settings.pool_size and kind != "redis" else {}
    cluster.env.update(
        MUTEXCRON_SCALE_DIR=str(cluster.workdir),
        MUTEXCRON_SCALE_PREFIX=prefix,
        MUTEXCRON_SCALE_JOBS=str(rs.jobs),
        MUTEXCRON_SCALE_LOCKS=str(rs.locks),
        MUTEXCRON_SCALE_STORE_OPTIONS=json.dumps(pool),
        MUTEXCRON_SCALE_WORKERS=str(settings.workers or ""),
    )
    if settings.metrics:
        cluster.env.update(MUTEXCRON_METRICS_PORT="0", MUTEXCRON_METRICS_HOST="127.0.0.1")
    cluster.env.update(MUTEXCRON_PLACEMENT=settings.placement)
    return cluster


def setup_name(name: str, settings: Settings) -> str:
    """The row's name: the store, then what is on beyond the default and which repeat it is."""
    name += {(False, False): " (no history)", (True, True): " + history + metrics"}.get((settings.history, settings.metrics), "")
    name += f" placement={settings.placement}" if settings.placement != "balanced" else ""
    return name + (f" #{settings.repeat}" if settings.repeat else "")


def run_guarded(kind: str, name: str, setups: list[tuple[str, Settings]], rs: RowSet) -> list[Result]:
    """J guarded jobs on ``--nodes`` nodes for each ``(url, settings)``, all clusters at once, measured
    in one window (so the machine's drift is the same for each); fire-time counts are cluster-wide."""
    with contextlib.ExitStack() as stack:
        clusters = [stack.enter_context(guarded_cluster(kind, url, rs, st)) for url, st in setups]
        pids = [[p.pid for p in c.procs.values()] for c in clusters]

        def check() -> None:
            for cluster in clusters:
                cluster.check_nodes()

        window = observe(check, [pid for group in pids for pid in group], setups[0][1])
        results, at = [], 0
        for cluster, group, (_, settings) in zip(clusters, pids, setups, strict=True):
            own = dataclasses.replace(window, cpu_per_min=window.cpu_per_min[at : at + len(group)])
            at += len(group)
            results.append(guarded_result(kind, setup_name(name, settings), rs, settings, cluster, own))
        return results


def guarded_result(kind: str, name: str, rs: RowSet, settings: Settings, cluster: Cluster, window: Window) -> Result:
    """One cluster's row: its fire times, store calls and warnings in ``window`` (its nodes' CPU in it)."""
    runs = read_runs(cluster.workdir)
    ops = cluster.ops()
    skipped, misfired = log_warnings(cluster.workdir, list(cluster.procs))
    m0, m1 = window.mono
    calls = [s for s in ops.samples if m0 <= s[2] < m1]
    acquire = [s[3] * 1000 for s in calls if s[1] == "acquire_or_renew"]
    w0, w1 = window.wall
    per_node = {
        node: {"cpu_per_min": cpu, "runs_per_s": sum(1 for r in runs if r.node == node and w0 <= r.fire < w1) / window.seconds}
        for node, cpu in zip(cluster.procs, window.cpu_per_min, strict=True)
    }
    return result(
        name, kind, rs, window, count_fires(runs, window, rs.jobs, settings.drain),
        **hand_off_figures(cluster.workdir),
        calls_per_s_node=len(calls) / window.seconds / settings.nodes,
        acquire_p50=percentile(acquire, 50), acquire_p99=percentile(acquire, 99),
        skipped_max_instances=skipped, misfired=misfired, per_node=per_node,
    )


def hand_off_figures(workdir: Path) -> dict[str, float]:
    """The nodes' batched hand-offs (``handoff-<pid>.json``, written by ``scale_jobs.py``): the waits
    for a batch (the worst node's p50 and p99, the max of all, ms) and hand-offs per store call."""
    stats = [json.loads(p.read_text()) for p in sorted(workdir.glob("handoff-*.json"))]
    if not stats:
        return {}
    return {
        "handoff_wait_p50": max(s["p50_wait"] for s in stats) * 1000,
        "handoff_wait_p99": max(s["p99_wait"] for s in stats) * 1000,
        "handoff_wait_max": max(s["max_wait"] for s in stats) * 1000,
        "handoffs_per_call": sum(s["items"] for s in stats) / max(1, sum(s["calls"] for s in stats)),
    }


def guarded_rows(kind: str, rs: RowSet, setups: list[Settings], notes: list[str]) -> list[Result]:
    """A store's guarded runs of a row set, side by side, each on a table/namespace/file of its own;
    none (and a note) if they could not run."""
    if kind == "mongodb" and not os.environ.get("MUTEXCRON_TEST_MONGODB_URL"):
        notes.append("mongodb: skipped (set MUTEXCRON_TEST_MONGODB_URL)")
        return []
    with contextlib.ExitStack() as cleanups:
        stores: list[Isolated] = []
        try:
            for _ in setups:
                stores.append(isolated(kind))
                cleanups.callback(stores[-1].cleanup)
        except MutexcronError as exc:
            notes.append(f"{kind}: skipped ({exc})")
            return []
        try:
            name = store_name(kind, stores[0].url)
            print(f"{name}: {rs.title}" + (f", {len(setups)} set-ups side by side" if len(setups) > 1 else "") + "...",
                  file=sys.stderr, flush=True)  # fmt: skip
            urls = [
                iso.url if st.history else f"{iso.url}{'&' if '?' in iso.url else '?'}history=0"
                for iso, st in zip(stores, setups, strict=True)
            ]
            return run_guarded(kind, name, list(zip(urls, setups, strict=True)), rs)
        except MutexcronError as exc:
            notes.append(f"{kind}: failed ({exc})")
            return []


def store_name(kind: str, url: str) -> str:
    """The store's kind and server version, e.g. ``sqlite 3.40.1`` (raises MutexcronError if unreachable)."""
    store = lock_store_from_url(url)
    try:
        store.ping()
        return server_version(kind, store)
    finally:
        store.close()


def operations_changes(guarded: list[Result]) -> list[str]:
    """--operations: each store's CPU per node with both against without, per side-by-side pair and on average."""
    lines = []
    for kind in dict.fromkeys(r.kind for r in guarded):
        rows = [r for r in guarded if r.kind == kind]
        pairs = [(a, b) if "no history" in a.name else (b, a) for a, b in zip(rows[::2], rows[1::2], strict=False)]
        changes = [on.cpu_per_node_min / off.cpu_per_node_min - 1 for off, on in pairs]
        if changes:
            lines.append(
                f"{kind}: CPU per node with history + metrics against without, side by side: "
                f"{', '.join(f'{100 * c:+.1f} %' for c in changes)}; mean {100 * sum(changes) / len(changes):+.1f} %"
            )
    return lines


# -- output ---------------------------------------------------------------------------------------
def ratios(r: Result, plain: Result | None) -> dict[str, float | None]:
    """guarded / plain for each of RATIO_FIELDS; None where there is no ratio (no plain run, plain 0, NaN)."""
    out: dict[str, float | None] = {}
    for name in RATIO_FIELDS:
        value, base = getattr(r, name), getattr(plain, name) if plain else math.nan
        out[name] = value / base if base and math.isfinite(base) and math.isfinite(value) else None
    return out


def cell(r: Result, plain: Result | None, name: str, text: str) -> str:
    """``text`` and, on a guarded row, its ratio to plain: ``(2.3x)``, ``(=)`` both 0, ``(plain 0)``."""
    if r.kind == "plain":
        return text
    value, base = getattr(r, name), getattr(plain, name) if plain else math.nan
    ratio = ratios(r, plain)[name]
    if ratio is not None:
        return f"{text} ({ratio:.0f}x)" if ratio >= 100 else f"{text} ({ratio:.1f}x)" if ratio >= 1 else f"{text} ({ratio:.2f}x)"
    if base == 0:
        return f"{text} (=)" if value == 0 else f"{text} (plain 0)"
    return text


def number(value: float, digits: int = 0) -> str:
    return "-" if not math.isfinite(value) else f"{value:,.{digits}f}"


def table_row(r: Result, plain: Result | None) -> list[str]:
    return [
        r.name,
        cell(r, plain, "cpu_per_node_min", f"{number(r.cpu_per_node_min, 2)} / {number(r.cpu_max_node_min, 2)}"),
        cell(r, plain, "delay_p50", number(r.delay_p50)),
        cell(r, plain, "delay_p99", number(r.delay_p99)),
        cell(r, plain, "calls_per_s_node", number(r.calls_per_s_node)),
        f"{r.expected:,}",
        cell(r, plain, "run", number(r.run)),
        cell(r, plain, "missed", f"{number(r.missed)} ({100 * r.missed / max(r.expected, 1):.1f}%)"),
        cell(r, plain, "duplicated", number(r.duplicated)),
        f"{number(r.acquire_p50, 1)} / {number(r.acquire_p99, 1)}" if r.kind != "plain" else "-",
        cell(r, plain, "skipped_max_instances", f"{r.skipped_max_instances:,}"),
        cell(r, plain, "misfired", f"{r.misfired:,}"),
        "-" if r.kind == "plain" else
        f"{number(r.handoff_wait_p50, 1)} / {number(r.handoff_wait_p99, 1)} / {number(r.handoff_wait_max, 1)} "
        f"({number(r.handoffs_per_call, 1)})",
    ]


def render(rs: RowSet, plain: Result | None, guarded: list[Result], notes: list[str]) -> str:
    header = [
        "nodes running", "CPU s per node per min (mean / max)", "start delay p50 ms", "start delay p99 ms",
        "store calls/s per node", "fire times", "run", "missed", "duplicated", "acquire p50 / p99 ms",
        "skipped: max_instances", "misfire warnings", "hand-off wait p50 / p99 / max ms (hand-offs per call)",
    ]
    rows = [table_row(r, plain) for r in ([plain] if plain else []) + guarded]
    text = f"## {rs.title}\n\n" + md_table(header, rows) + "\n"
    return text + "".join(f"\n_{note}_\n" for note in notes)


def legend(settings: Settings) -> str:
    return (
        f"# Scale: guarded vs plain APScheduler ({settings.nodes} nodes, {os.cpu_count()} CPUs, "
        f"{settings.duration:g}s measured per row after {settings.warmup:g}s warm-up, lease {settings.lease:g}s"
        + (f", pool_size={settings.pool_size}" if settings.pool_size else "")
        + (f", {settings.workers} executor threads per node" if settings.workers else "")
        + ")\n\n"
        "First row: every node runs every job unguarded on a plain BlockingScheduler (APScheduler's floor); "
        "its fire times, run, missed and duplicated are per node (mean of the nodes). Then each store, "
        "guarded: those counts are cluster-wide (each fire time once across the nodes). In brackets: "
        "guarded / plain; (=): both 0; (plain 0): no ratio. Missed: not run, or run more than "
        f"{settings.drain:g}s late. Warnings are totals of all nodes.\n"
    )


def finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def to_json(rs: RowSet, plain: Result | None, guarded: list[Result], notes: list[str]) -> dict[str, Any]:
    return finite(
        {
            "jobs": rs.jobs,
            "locks": rs.locks,
            "title": rs.title,
            "plain": asdict(plain) if plain else None,
            "guarded": [{**asdict(r), "ratio_to_plain": ratios(r, plain)} for r in guarded],
            "notes": notes,
        }
    )


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--stores", default="sqlite,mysql,postgresql,redis", help="comma-separated [sqlite,mysql,postgresql,redis]"
    )
    parser.add_argument("--jobs", default="10,100,1000", help="comma-separated job counts, each job its own lock [10,100,1000]")
    parser.add_argument(
        "--groups", type=int, default=10, help="also run the largest --jobs count in this many lock groups; 0: no such row [10]"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per row [30]")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring [8]")
    parser.add_argument("--drain", type=float, default=5.0, help="a run later than this counts as missed [5]")
    parser.add_argument("--nodes", type=int, default=3, help="node processes per run, plain and guarded [3]")
    parser.add_argument("--unactive-interval", type=float, default=10.0, help="lease length [10, the default]")
    parser.add_argument("--workers", type=int, default=0, help="threads of each node's executor [APScheduler's default, 10]")
    parser.add_argument(
        "--pool-size", type=int, default=None,
        help="SQL stores: SQLAlchemy pool_size for the nodes' engines [the store's default]",
    )
    parser.add_argument(
        "--operations", action="store_true",
        help="run each store's guarded row without run history or metrics (?history=0) and with both (history "
        "kept, /metrics served), two clusters side by side in one window, --repeats times: to compare them",
    )
    parser.add_argument(
        "--repeats", type=int, default=4, help="--operations: how many side-by-side pairs per store [4]"
    )
    parser.add_argument(
        "--placement", default="balanced",
        help="comma-separated placements of the guarded nodes, one row each: balanced, first [balanced]",
    )
    parser.add_argument(
        "--json", nargs="?", const="-", metavar="FILE", help="print JSON instead of the tables; with FILE, write it there too"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run (tests/test_benchmarks_scale.py): SQLite unless --stores is given, 10 jobs on 2 nodes, "
        "3 s measured after 3 s warm-up, no group row",
    )
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--stores" not in given:
            args.stores = "sqlite"
        args.jobs, args.groups, args.nodes = "10", 0, 2
        args.duration, args.warmup, args.drain = 3.0, 3.0, 2.0
    args.kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    if set(args.kinds) - set(ALL_STORES) or "memory" in args.kinds:
        parser.error(f"choose stores from {', '.join(k for k in ALL_STORES if k != 'memory')}")
    try:
        counts = [int(j) for j in args.jobs.split(",") if j.strip()]
    except ValueError:
        parser.error("--jobs takes comma-separated whole numbers")
    args.row_sets = [RowSet(j, j) for j in counts]
    if counts and 0 < args.groups < max(counts):
        args.row_sets.append(RowSet(max(counts), args.groups))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    settings = Settings(
        args.duration, args.warmup, args.drain, args.nodes, args.unactive_interval, args.workers, args.pool_size
    )
    tables = args.json != "-"
    if tables:
        print(legend(settings), flush=True)
    plain_by_jobs: dict[int, Result | None] = {}  # one baseline per job count: a group row reuses it
    doc: dict[str, Any] = {"settings": asdict(settings), "cpus": os.cpu_count(), "baseline": PLAIN, "row_sets": []}
    for rs in args.row_sets:
        notes: list[str] = []
        if rs.jobs not in plain_by_jobs:
            print(f"{PLAIN}: {rs.jobs:,} every-second jobs...", file=sys.stderr, flush=True)
            try:
                plain_by_jobs[rs.jobs] = run_plain(rs, settings)
            except MutexcronError as exc:
                plain_by_jobs[rs.jobs] = None
                notes.append(f"plain baseline: failed ({exc})")
        plain = plain_by_jobs[rs.jobs]
        rounds = [[dataclasses.replace(settings, placement=p.strip())] for p in args.placement.split(",") if p.strip()]
        if args.operations:  # without and with both, side by side, the order swapped each repeat
            off, on = dataclasses.replace(settings, history=False), dataclasses.replace(settings, metrics=True)
            rounds = [
                [dataclasses.replace(st, repeat=n) for st in ((off, on) if n % 2 else (on, off))]
                for n in range(1, args.repeats + 1)
            ]
        guarded = [r for kind in args.kinds for setups in rounds for r in guarded_rows(kind, rs, setups, notes)]
        if args.operations:
            notes += operations_changes(guarded)
        if tables:
            print(render(rs, plain, guarded, notes), flush=True)
        doc["row_sets"].append(to_json(rs, plain, guarded, notes))
    if args.json:
        text = json.dumps(doc, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
