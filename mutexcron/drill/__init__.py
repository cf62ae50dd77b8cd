"""A failover drill: N real ``mutexcron run`` processes on one store, with kill/freeze/terminate.

Used by ``mutexcron drill``, the cluster tests and ``benchmarks/``; nothing in the library imports it.

* :mod:`~mutexcron.drill.scenario`: :func:`run_drill`, the phases and their timing;
* :mod:`~mutexcron.drill.cluster`: :class:`Cluster`, the node processes, their temp dir, cleanup;
* :mod:`~mutexcron.drill.node_jobs`: the jobs module the nodes run (``mutexcron.drill.node_jobs:sched``),
  configured by ``MUTEXCRON_DRILL_*`` environment variables;
* :mod:`~mutexcron.drill.node_side`: what runs in the nodes: :class:`TimedLockStore` (store
  latency, measured in the nodes, never on the library's hot path), :func:`die_with_parent`;
* :mod:`~mutexcron.drill.records`: the ticks and timing files the nodes write, read back;
* :mod:`~mutexcron.drill.analysis` and :mod:`~mutexcron.drill.report`: gaps, duplicates, attrs
  repeats, latency, PASS/FAIL reasons; :func:`format_report` and :meth:`DrillReport.to_json`.

The task drill (``mutexcron drill --tasks``), the same faults against the task pool:
:mod:`~mutexcron.drill.tasks_scenario` (:func:`run_task_drill`), :mod:`~mutexcron.drill.task_node_jobs`
and :mod:`~mutexcron.drill.task_node_side` (the nodes' handler and recording store),
:mod:`~mutexcron.drill.task_analysis` and :mod:`~mutexcron.drill.task_report` (:func:`format_task_report`).

The shared-jobs drill (``mutexcron drill --shared-jobs``), the faults and a web app's changes against
nodes sharing one APScheduler job store: :mod:`~mutexcron.drill.shared_scenario` (:func:`run_shared_drill`),
:mod:`~mutexcron.drill.shared_node_jobs` (the nodes' scheduler), :mod:`~mutexcron.drill.shared_jobs`
(the job store and the job, importable without side effects) and :mod:`~mutexcron.drill.shared_report`
(:func:`format_shared_report`).

The placement drill (``mutexcron drill --placement``), nodes under balanced placement joining,
leaving, killed and coming back: :mod:`~mutexcron.drill.placement_scenario` (:func:`run_placement_drill`),
:mod:`~mutexcron.drill.placement_node_jobs` (the nodes' every-second jobs, one lock each) and
:mod:`~mutexcron.drill.placement_report` (:func:`format_placement_report`).
"""

from __future__ import annotations

from .analysis import percentile
from .cluster import NODE_JOBS, Cluster, libfaketime
from .node_side import TimedLockStore, die_with_parent, timed_store_from_env
from .placement_report import PlacementDrillReport, format_placement_report
from .placement_scenario import PLACEMENT_NODE_JOBS, run_placement_drill
from .records import NodeOps, Tick
from .report import DrillReport, PhaseMark, format_report
from .scenario import PHASES, check_drill_url, run_drill
from .shared_report import SharedDrillReport, format_shared_report
from .shared_scenario import SHARED_NODE_JOBS, run_shared_drill
from .task_report import TaskDrillReport, format_task_report
from .tasks_scenario import TASK_NODE_JOBS, run_task_drill

__all__ = [
    "NODE_JOBS",
    "PHASES",
    "PLACEMENT_NODE_JOBS",
    "SHARED_NODE_JOBS",
    "TASK_NODE_JOBS",
    "Cluster",
    "DrillReport",
    "NodeOps",
    "PhaseMark",
    "PlacementDrillReport",
    "SharedDrillReport",
    "TaskDrillReport",
    "Tick",
    "TimedLockStore",
    "check_drill_url",
    "die_with_parent",
    "format_placement_report",
    "format_report",
    "format_shared_report",
    "format_task_report",
    "libfaketime",
    "percentile",
    "run_drill",
    "run_placement_drill",
    "run_shared_drill",
    "run_task_drill",
    "timed_store_from_env",
]
