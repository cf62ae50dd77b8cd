"""scale.py's baseline nodes: the same J every-second jobs as ``scale_jobs.py``, unguarded, on plain APScheduler.

    python benchmarks/plain_jobs.py   # started by scale.py, once per node; every node runs all J jobs

A ``BlockingScheduler`` with APScheduler's defaults (a thread pool of 10 unless
``MUTEXCRON_SCALE_WORKERS`` says otherwise) and the logging ``mutexcron run`` sets up (INFO, with
APScheduler's own logger at WARNING), so the two kinds of node differ by the guard only. Nothing
from mutexcron is imported. Configured by ``MUTEXCRON_SCALE_JOBS``, ``MUTEXCRON_SCALE_DIR``,
``MUTEXCRON_SCALE_WORKERS``, ``MUTEXCRON_NODE_ID`` and ``MUTEXCRON_DRILL_PARENT`` (the node dies with scale.py).

APScheduler 3 does not tell a job its scheduled fire time, so the executor is APScheduler's
``ThreadPoolExecutor`` with one change, the one mutexcron's own executor makes too: each run's
fire time is set in a thread-local before APScheduler's ``run_job`` calls the job (private
members used: ``_pool``, ``_logger``, ``_run_job_success``/``_run_job_error``, ``Job._jobstore_alias``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from apscheduler.executors.base import run_job
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.blocking import BlockingScheduler
from scale_runs import RunLog, die_with_parent  # run as a script: its directory is sys.path[0]

_fire = threading.local()  # .time: the scheduled fire time of the run this worker thread is in


class FireTimeExecutor(ThreadPoolExecutor):
    """APScheduler's thread pool executor that tells each run its fire time (``_fire.time``)."""

    def _do_submit_job(self, job: Any, run_times: list[Any]) -> None:
        def work() -> list[Any]:
            events: list[Any] = []
            for run_time in run_times:  # one, as jobs coalesce by default
                _fire.time = run_time
                events += run_job(job, job._jobstore_alias, [run_time], self._logger.name)
            return events

        def done(future: Any) -> None:  # what BasePoolExecutor._do_submit_job's callback does
            exc = future.exception()
            if exc:
                self._run_job_error(job.id, exc, exc.__traceback__)
            else:
                self._run_job_success(job.id, future.result())

        self._pool.submit(work).add_done_callback(done)


def make(j: int, runs: RunLog) -> Callable[[], None]:
    def job() -> None:
        started = time.time()
        runs.add(j, _fire.time.timestamp(), started)

    return job


def build(jobs: int, workers: int, runs: RunLog) -> BlockingScheduler:
    """The node's scheduler: ``jobs`` every-second cron jobs, each run recorded in ``runs``."""
    sched = BlockingScheduler(executors={"default": FireTimeExecutor(workers or 10)})  # 10: APScheduler's default
    for j in range(jobs):
        sched.add_job(make(j, runs), "cron", second="*", id=f"job{j}")
    return sched


def main() -> None:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    runs = RunLog(os.environ["MUTEXCRON_SCALE_DIR"], os.environ.get("MUTEXCRON_NODE_ID", str(os.getpid())))
    workers = int(os.environ.get("MUTEXCRON_SCALE_WORKERS") or 0)
    build(int(os.environ["MUTEXCRON_SCALE_JOBS"]), workers, runs).start()  # until SIGTERM (its default: exit)


if __name__ == "__main__":
    main()
