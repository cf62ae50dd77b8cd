"""The shared-jobs drill (``mutexcron drill --shared-jobs``): kill, freeze and terminate against
nodes sharing one APScheduler job store.

The drill adds every-second jobs of its own (``mutexcron-drill-<random>-j<N>``) to a job store
of its own (``--jobstore``: a SQLite file in its temp dir by default, a table of its own on any
SQLAlchemy URL, keys of its own on Redis) through a scheduler started paused, as a web app would,
then starts N ``mutexcron run`` nodes on that job store (:mod:`mutexcron.drill.shared_node_jobs`)
and the lock store of ``--lock-url``. Then:

* **changes** from the drill's scheduler: a reschedule (every 2 s), a pause and later a resume, a
  removal; every node must show APScheduler's job event within 2 s, and each change must hold;
* **kill**, **freeze**, **term** of the node holding the most jobs: each of its jobs must run on
  another node within the lease + 1 s (1.5 s after SIGTERM);
* **freeze all**: every node SIGSTOPped past the lease, then resumed: each job must run again
  within the lease + 2 s;
* **rolling restart** to a changed jobs file (it adds ``j0`` again with a new argument): each node
  replaced by a new one, which starts before the old one gets SIGTERM; no job waits more than its
  interval + 1.5 s between two runs, and the change holds.

Verdict: each (job, fire time) once, failover within the lease, changes propagated and kept. The
job table (or keys) is dropped at the end; the jobs' locks are forgotten (their tokens stay spent).
"""

from __future__ import annotations

import itertools
import json
import random
import secrets
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from apscheduler.events import EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED

from ..errors import ConfigurationError, MutexcronError
from ..urls import mask_url, url_scheme
from .cluster import Cluster
from .records import read_ops
from .report import format_gap
from .scenario import PHASES, Progress, check_drill_url, reachable_masked_url
from .shared_jobs import TICK_REF, drop_jobstore, jobstore_from_spec, jobstore_spec, ready_nodes
from .shared_report import PROPAGATION_LIMIT, ROLLING_LIMIT, Change, Run, SharedDrillReport, Strike, analyse, read_shared

__all__ = ["SHARED_NODE_JOBS", "run_shared_drill"]

#: What the shared-jobs drill's nodes run.
SHARED_NODE_JOBS = "mutexcron.drill.shared_node_jobs:sched"
#: Every-second jobs the drill adds.
JOBS = 4


def run_shared_drill(
    lock_url: str,
    *,
    jobstore: str | None = None,
    nodes: int = 3,
    lease: float = 3.0,
    duration: float = 60.0,
    progress: Progress = lambda _msg: None,
    phases: tuple[str, ...] = PHASES,
) -> SharedDrillReport:
    """Add the drill's jobs, start the nodes, make the changes, play the faults; return the report.

    Everything is cleaned up on the way out, also on KeyboardInterrupt: the nodes are stopped, the
    jobs' locks released, the job table or keys removed. The nodes' logs are kept if the verdict
    is FAIL (``report.logs``).

    Raises:
        ConfigurationError: a bad URL, too few nodes, an unknown phase.
        StoreUnavailableError: a store cannot be reached.
        MutexcronError: the nodes did not run (a node crashed, or no job ran during the warm-up).
    """
    if jobstore:
        jobstore_spec(jobstore, "check")  # bad input fails before anything is made
        if url_scheme(lock_url) == "sqlite" and url_scheme(jobstore) != "sqlite":
            raise ConfigurationError(
                f"lock store {mask_url(lock_url)} is a SQLite file only this host reaches, beside a job store on a "
                "server: use a --lock-url every node reaches (the job store's server is fine)"
            )
    masked = _preflight(lock_url, nodes, phases)
    tag = secrets.token_hex(4)
    cluster = Cluster(lock_url, nodes=nodes, unactive_interval=lease, lock=f"mutexcron-drill-{tag}", jobs=SHARED_NODE_JOBS,
                      progress=progress, verdict_pending=True)  # fmt: skip
    spec = jobstore_spec(jobstore or f"sqlite:///{cluster.workdir}/jobs.db", tag)
    job_ids = [f"{cluster.lock}-j{i}" for i in range(JOBS)]
    out = cluster.workdir / "shared.jsonl"
    cluster.env = {"MUTEXCRON_DRILL_JOBSTORE": json.dumps(spec), "MUTEXCRON_DRILL_SHARED_OUT": str(out)}
    cluster.release_locks = tuple(job_ids)
    report = SharedDrillReport(nodes=nodes, lease=lease, lock_store=masked, job_store=spec["where"], jobs=job_ids)
    started = time.monotonic()
    admin = _admin(spec, lock_url)
    dropped = ""
    try:
        progress(f"adding {JOBS} every-second jobs to {spec['where']} from a paused scheduler")
        for job in job_ids:
            admin.add_job(TICK_REF, "interval", seconds=1, id=job, kwargs={"job": job}, replace_existing=True)
        with cluster:
            _warm_up(cluster, out, job_ids, progress)
            _changes(cluster, admin, report, job_ids, progress)
            sqlite_jobs = (spec["options"]["url"],) if str(spec["options"].get("url", "")).startswith("sqlite") else ()
            for phase in phases:
                _strike(cluster, report, phase, out, job_ids, sqlite_jobs, progress)
            _freeze_all(cluster, report, out, job_ids, progress)
            _rolling_restart(cluster, report, out, job_ids, progress)
            _cool_down(max(duration - (time.monotonic() - started), 2.0), progress)
            cluster.check_nodes()
            runs, events = read_shared(out)
            ops = read_ops(cluster.workdir)
            finished = time.monotonic()
    finally:
        admin.shutdown(wait=False)
        dropped = _drop(spec)
        progress(f"cleanup: {dropped}")
    report.seconds = finished - started
    report.cleanup = f"{dropped}; {cluster.lock_left}"
    analyse(report, runs, events)
    if not ops.samples:
        report.failures.append("the nodes timed no lock store operation: their timing files are empty")
    report.logs = cluster.keep_or_discard(report.passed)
    return report


def _preflight(lock_url: str, nodes: int, phases: tuple[str, ...]) -> str:
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ConfigurationError(f"unknown drill phase(s) {', '.join(unknown)}: choose from {', '.join(PHASES)}")
    if nodes < 3:
        raise ConfigurationError("the shared-jobs drill needs at least 3 nodes")
    check_drill_url(lock_url)
    return reachable_masked_url(lock_url)


def _admin(spec: dict[str, Any], lock_url: str) -> Any:
    """The drill's own scheduler on the job store, started paused (it runs nothing, holds no lock)."""
    from .. import MutexScheduler

    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(spec)}, lock_url=lock_url, triggers=False,
                           node_id=f"mutexcron-drill-admin-{secrets.token_hex(2)}")  # fmt: skip
    admin.start(paused=True)
    return admin


def _drop(spec: dict[str, Any]) -> str:
    try:
        return drop_jobstore(spec)
    except Exception as exc:  # noqa: BLE001 - reported, the drill's verdict stands
        return f"could not remove the drill's jobs ({type(exc).__name__}); remove {spec['where']} yourself"


def _runs(out: Any) -> list[Run]:
    return read_shared(out)[0]


def _warm_up(cluster: Cluster, out: Any, jobs: list[str], progress: Progress) -> None:
    progress(f"warm-up: {cluster.nodes} nodes on the shared job store, in {cluster.workdir}")
    deadline = time.monotonic() + 20 + 3 * cluster.unactive_interval
    while time.monotonic() < deadline:
        counts = Counter(r.job for r in _runs(out))
        # Every node watching the store (a change made before a node started is no change to it).
        if all(counts[job] >= 2 for job in jobs) and ready_nodes(out) >= set(cluster.procs):
            return
        cluster.check_nodes()
        time.sleep(0.1)
    tails = "\n".join(f"--- {n}\n{cluster.log_tail(n)}" for n in cluster.procs)
    raise MutexcronError(
        f"the drill's nodes did not all start, or its jobs did not all run, during the warm-up; node logs:\n{tails}"
    )


def _changes(cluster: Cluster, admin: Any, report: SharedDrillReport, jobs: list[str], progress: Progress) -> None:
    """Reschedule, pause, remove, then resume, from the drill's paused scheduler."""
    moved, paused, removed = jobs[1], jobs[2], jobs[3]

    def change(what: str, job: str, event: int, call: Callable[[], Any]) -> None:
        call()
        report.changes.append(Change(what, job, time.monotonic(), event, cluster.alive()))
        progress(f"changes: {what} {job}")

    change("reschedule", moved, EVENT_JOB_MODIFIED, lambda: admin.reschedule_job(moved, trigger="interval", seconds=2))
    change("pause", paused, EVENT_JOB_MODIFIED, lambda: admin.pause_job(paused))
    change("remove", removed, EVENT_JOB_REMOVED, lambda: admin.remove_job(removed))
    time.sleep(3.0)
    change("resume", paused, EVENT_JOB_MODIFIED, lambda: admin.resume_job(paused))
    time.sleep(PROPAGATION_LIMIT + 0.5)


def _holders(out: Any, jobs: list[str]) -> dict[str, str]:
    """Job -> the node that ran its latest run."""
    latest: dict[str, Run] = {}
    for run in _runs(out):
        if run.job in jobs and (run.job not in latest or run.mono > latest[run.job].mono):
            latest[run.job] = run
    return {job: run.node for job, run in latest.items()}


def _strike(cluster: Cluster, report: SharedDrillReport, phase: str, out: Any, jobs: list[str],
            sqlite_jobs: tuple[str, ...], progress: Progress) -> None:  # fmt: skip
    """Strike the node that ran the most jobs last; wait until its jobs ran elsewhere; let it settle."""
    time.sleep(random.uniform(0.2, 0.8))  # a random moment of the second, as a real crash
    live = set(cluster.alive())
    removed = {c.job for c in report.changes if c.what == "remove"}
    holders = {job: node for job, node in _holders(out, jobs).items() if job not in removed and node in live}
    node, _count = Counter(holders.values()).most_common(1)[0]
    held = sorted(job for job, holder in holders.items() if holder == node)
    lease = cluster.unactive_interval
    if phase == "kill":
        progress(f"kill: SIGKILL {node}, which runs {len(held)} job(s)")
        at = cluster.signal(node, signal.SIGKILL)
    elif phase == "freeze":
        progress(f"freeze: SIGSTOP {node} ({len(held)} job(s)) for {2 * lease + 1:.0f}s (the lease is {lease:g}s), then SIGCONT")
        at = cluster.freeze(node, also=sqlite_jobs)
    else:
        progress(f"term: SIGTERM {node}, which runs {len(held)} job(s)")
        at = cluster.signal(node, signal.SIGTERM)
    report.strikes.append(Strike(phase, node, at, time.time() - (time.monotonic() - at), held))
    deadline = at + 3 * lease + 10
    while time.monotonic() < deadline:
        moved = {r.job for r in _runs(out) if r.mono > at and r.node != node}
        if moved >= set(held):
            break
        time.sleep(0.05)
    if phase == "freeze":
        remaining = at + 2 * lease + 1 - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        cluster.signal(node, signal.SIGCONT)
    progress(f"{phase}: {node}'s jobs ran on other nodes" if moved >= set(held) else f"{phase}: not all of {node}'s jobs moved")
    time.sleep(2.0)  # settle


def _freeze_all(cluster: Cluster, report: SharedDrillReport, out: Any, jobs: list[str], progress: Progress) -> None:
    """SIGSTOP every node past the lease, then SIGCONT them all: nobody took a lock meanwhile, so each
    node is handed its locks back (often with the same token), and every job must run again soon."""
    _top_up(cluster, out, progress)
    lease, live = cluster.unactive_interval, cluster.alive()
    removed = {c.job for c in report.changes if c.what == "remove"}
    progress(f"freeze all: SIGSTOP every node ({len(live)}) for {2 * lease + 1:.0f}s (the lease is {lease:g}s), then SIGCONT")
    for node in live:
        cluster.signal(node, signal.SIGSTOP)
    time.sleep(2 * lease + 1)
    resumed = time.monotonic()
    for node in live:
        cluster.signal(node, signal.SIGCONT)
    wanted = [job for job in jobs if job not in removed]
    deadline = resumed + report.resume_limit + 3
    while time.monotonic() < deadline and len(report.resumed) < len(wanted):
        for run in _runs(out):
            if run.job in wanted and run.mono > resumed and run.job not in report.resumed:
                report.resumed[run.job] = run.mono - resumed
        time.sleep(0.05)
    for job in wanted:
        gap = report.resumed.setdefault(job, None)
        if gap is None or gap > report.resume_limit:
            report.failures.append(f"after every node was frozen and resumed, job {job} ran again after "
                                   f"{format_gap(gap)} (limit {report.resume_limit:.1f}s)")  # fmt: skip
    every = all(g is not None for g in report.resumed.values())
    progress("freeze all: every job ran again" if every else "freeze all: not every job ran again")
    time.sleep(2.0)  # settle


def _top_up(cluster: Cluster, out: Any, progress: Progress) -> None:
    """Start new nodes in place of the struck ones, so the whole cluster is frozen together."""
    missing = cluster.nodes - len(cluster.alive())
    if missing <= 0:
        return
    progress(f"freeze all: {missing} new node(s) in place of the struck ones")
    started = [cluster.start_node(len(cluster.procs)) for _ in range(missing)]
    deadline = time.monotonic() + 30
    while not set(started) <= ready_nodes(out) and time.monotonic() < deadline:
        cluster.check_nodes()
        time.sleep(0.1)
    time.sleep(cluster.unactive_interval)  # let them take some locks over


def _rolling_restart(cluster: Cluster, report: SharedDrillReport, out: Any, jobs: list[str], progress: Progress) -> None:
    """Replace each node, one at a time, by one whose jobs file adds ``j0`` again with a change (a new
    argument): start the new node, wait until it is ready, SIGTERM the old one. No fire time runs
    twice, none is lost to a hand-over, and the change holds."""
    removed = {c.job for c in report.changes if c.what == "remove"}
    wanted, changed = [job for job in jobs if job not in removed], jobs[0]
    old = cluster.alive()
    progress(f"rolling restart: {len(old)} node(s) replaced by nodes whose jobs file changes {changed}")
    began = time.monotonic()
    for node in old:
        new = cluster.start_node(len(cluster.procs), env={"MUTEXCRON_DRILL_JOBS_V2": changed})
        deadline = time.monotonic() + 30
        while new not in ready_nodes(out) and time.monotonic() < deadline:
            cluster.check_nodes()
            time.sleep(0.1)
        cluster.signal(node, signal.SIGTERM)
        cluster.procs[node].wait(15)
    time.sleep(3.0)
    ended = time.monotonic()
    runs = [r for r in _runs(out) if began <= r.mono <= ended]
    intervals = {job: 2.0 if any(c.what == "reschedule" and c.job == job for c in report.changes) else 1.0 for job in wanted}
    for job in wanted:
        monos = sorted([began] + [r.mono for r in runs if r.job == job] + [ended])
        gap = max(b - a for a, b in itertools.pairwise(monos))
        report.rolling[job] = gap
        if gap > intervals[job] + ROLLING_LIMIT:
            report.failures.append(f"rolling restart: job {job} waited {format_gap(gap)} between two runs "
                                   f"(limit {intervals[job] + ROLLING_LIMIT:.1f}s)")  # fmt: skip
    late = [r for r in runs if r.job == changed and r.mono > ended - 2.0]
    if not late or any(r.version != "v2" for r in late):
        report.failures.append(f"rolling restart: the changed jobs file's {changed} did not hold: versions "
                               f"{sorted({r.version for r in late})} after the restart")  # fmt: skip
    progress("rolling restart: done")


def _cool_down(rest: float, progress: Progress) -> None:
    progress(f"cool-down: {rest:.0f}s")
    time.sleep(rest)
