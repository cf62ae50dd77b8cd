"""The drill's scenario: warm-up, then SIGKILL, SIGSTOP/SIGCONT and SIGTERM of the holder, then cool-down."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable

from ..errors import ConfigurationError, MutexcronError
from ..locks import lock_store_from_url
from ..urls import url_scheme
from .analysis import analyse
from .cluster import Cluster, libfaketime
from .records import Tick
from .report import DrillReport, PhaseMark, format_gap

PHASES: tuple[str, ...] = ("kill", "freeze", "term")

Progress = Callable[[str], None]


def check_drill_url(lock_url: str, skew: float = 0.0) -> None:
    """Reject stores the drill's separate processes cannot share, and skew that cannot be simulated.

    Raises:
        ConfigurationError: ``memory://`` (private to one process); ``sqlite://`` with a skew.
    """
    scheme = url_scheme(lock_url.strip())
    if scheme == "memory":
        raise ConfigurationError(
            "the drill runs separate node processes and memory:// is private to one process: "
            "use sqlite:///path/to/drill.db or your real store's URL"
        )
    if skew and scheme == "sqlite":
        # SQLite's 'now' is read inside each node process, so libfaketime would skew the store's
        # clock too; real processes on one host share one clock, so that case cannot happen.
        raise ConfigurationError(
            "--skew cannot be simulated with sqlite://: SQLite reads its clock inside each node process, so "
            "libfaketime would shift the store's clock too, while real processes on one host always share one "
            "clock. Drill skew against a server store (PostgreSQL, MariaDB/MySQL, Redis, MongoDB)"
        )


def run_drill(
    lock_url: str,
    *,
    nodes: int = 3,
    unactive_interval: float = 3.0,
    duration: float = 60.0,
    skew: float = 0.0,
    progress: Progress = lambda _msg: None,
    phases: tuple[str, ...] = PHASES,
) -> DrillReport:
    """Play warm-up, SIGKILL, SIGSTOP/SIGCONT, SIGTERM, cool-down; return the report.

    Everything is cleaned up on the way out, including on KeyboardInterrupt: the nodes are
    stopped and the drill lock is released. The temporary directory with the nodes' logs is
    removed if the drill passed (or was interrupted); else it is kept and ``report.logs`` names it.

    Raises:
        ConfigurationError: a bad URL, too few nodes, an unknown phase, ``--skew`` without libfaketime.
        StoreUnavailableError: the store cannot be reached.
        MutexcronError: the nodes did not run (a node crashed, or no tick during the warm-up).
    """
    masked = _preflight(lock_url, nodes, skew, phases)
    report = DrillReport(nodes=nodes, unactive_interval=unactive_interval, store=masked, skew=skew)
    spread = abs(skew) * (nodes - 1)  # the most a run can wait for a lagging clock
    started = time.monotonic()
    wall_minus_mono = time.time() - time.monotonic()
    cluster = Cluster(lock_url, nodes=nodes, unactive_interval=unactive_interval, skew=skew, progress=progress)
    cluster.verdict_pending = True
    report.lock = cluster.lock
    with cluster:
        _warm_up(cluster, spread, progress)
        for phase in phases:
            _play(cluster, report, phase, spread, progress)
        _cool_down(cluster, max(duration - (time.monotonic() - started), 2.0), progress)
        cluster.check_nodes()
        ticks = cluster.ticks()
        ops = cluster.ops()
        finished = time.monotonic()
    report.lock_left = cluster.lock_left
    report.seconds = finished - started
    analyse(ticks, report, ops, mono_range=(started, finished), wall_minus_mono=wall_minus_mono)
    report.logs = cluster.keep_or_discard(report.passed)
    return report


def _preflight(lock_url: str, nodes: int, skew: float, phases: tuple[str, ...]) -> str:
    """Check what the drill needs before it starts a node; return the store's masked URL."""
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ConfigurationError(f"unknown drill phase(s) {', '.join(unknown)}: choose from {', '.join(PHASES)}")
    if nodes < 2 + ("kill" in phases) + ("term" in phases) - 1:
        raise ConfigurationError("the drill needs at least 3 nodes (2 without the kill or the term phase)")
    check_drill_url(lock_url, skew)
    if skew:
        libfaketime()
    return reachable_masked_url(lock_url)


def reachable_masked_url(lock_url: str) -> str:
    """The store's masked URL, once it answered a ping (the last check before a drill starts a node)."""
    store = lock_store_from_url(lock_url)
    try:
        store.ping()
        return store.masked_url
    finally:
        store.close()


def _warm_up(cluster: Cluster, spread: float, progress: Progress) -> None:
    nodes, skew = cluster.nodes, cluster.skew
    skewed = f", node clocks shifted by {', '.join(f'{i * skew:+g}s' for i in range(nodes))}" if skew else ""
    progress(f"warm-up: starting {nodes} nodes on lock {cluster.lock} in {cluster.workdir}{skewed}")
    if cluster.wait_ticks(3, timeout=20 + 3 * cluster.unactive_interval + spread) is None:
        tails = "\n".join(f"--- {n}\n{cluster.log_tail(n)}" for n in cluster.procs)
        raise MutexcronError(f"the drill job did not run during the warm-up; node logs:\n{tails}")


def _play(cluster: Cluster, report: DrillReport, phase: str, spread: float, progress: Progress) -> None:
    """Strike the holder, measure the gap to the next run on another node, let the cluster settle."""
    cluster.wait_stable_holder(4, timeout=10 + 3 * cluster.unactive_interval + spread)
    # Strike at a random moment of the second, as a real crash or freeze would, not in the
    # few milliseconds after a tick line appears, when the holder is still saving its run.
    time.sleep(random.uniform(0.2, 0.8))
    holder = cluster.holder()
    mark, first = _strike(cluster, phase, holder, cluster.unactive_interval * 3 + 10 + spread, progress)
    report.marks.append(mark)
    # From the signal; the analysis counts the SIGTERM hand-off from the fire time the standby
    # could run first instead (the stopping node runs the one due while it hands over).
    report.gaps[phase] = None if first is None else first.mono - mark.at
    where = "" if first is None else f" ({first.node})"
    progress(f"{phase}: next run on another node{where} after {format_gap(report.gaps[phase])} (from the signal)")
    cluster.wait_ticks(3, timeout=10 + spread, after=time.monotonic())  # settle


def _strike(cluster: Cluster, phase: str, holder: str, timeout: float, progress: Progress) -> tuple[PhaseMark, Tick | None]:
    """Signal the holder for ``phase``; return the mark and the first run on another node after it."""
    ui = cluster.unactive_interval
    if phase == "kill":
        progress(f"kill: SIGKILL the holder {holder}")
        mark = PhaseMark(phase, holder, cluster.signal(holder, signal.SIGKILL))
    elif phase == "freeze":
        progress(f"freeze: SIGSTOP the holder {holder} for {2 * ui + 1:.0f}s (the lease is {ui:g}s), then SIGCONT")
        mark = PhaseMark(phase, holder, cluster.freeze(holder))
    else:
        progress(f"term: SIGTERM the holder {holder}")
        mark = PhaseMark(phase, holder, cluster.signal(holder, signal.SIGTERM))
    first = cluster.wait_ticks(1, timeout=timeout, after=mark.at, not_node=holder)
    if phase == "freeze":  # the frozen ex-holder wakes after its lease is long gone
        remaining = mark.at + 2 * ui + 1 - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        mark.until = cluster.signal(holder, signal.SIGCONT)
    return mark, first


def _cool_down(cluster: Cluster, rest: float, progress: Progress) -> None:
    progress(f"cool-down: {rest:.0f}s")
    end = time.monotonic() + rest
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 10.0))
        if end - time.monotonic() > 1.0:
            ticks = cluster.ticks()
            dups = len(ticks) - len({round(t.fire, 3) for t in ticks})
            progress(f"cool-down: {end - time.monotonic():.0f}s left, {len(ticks)} runs so far, {dups} duplicated")
