"""A Flask app that runs a guarded every-second job in its gunicorn workers.

    pip install flask gunicorn
    MUTEXCRON_LOCK_URL=postgresql://app@db/ops gunicorn -w 4 -b 127.0.0.1:8000 examples.flask_app:app
    curl 127.0.0.1:8000/scheduler

Every worker process runs its own MutexScheduler and is a node of its own (node id
``hostname:pid:random``). Across the four workers, and across every server that runs the same
app, ``refresh_rates`` runs once per second: one worker holds the lease, the others stand by.
``/scheduler`` shows the lock record (holder, token, heartbeat age, attrs) and this worker's jobs.

Where to start the scheduler
----------------------------
A ``BackgroundScheduler`` is threads: the APScheduler thread, the executor's job threads and
mutexcron's heartbeat thread. ``fork()`` copies only the thread that calls it, so a scheduler
started before a fork keeps running in the parent and is a dead copy in the child (its
``running`` still says True, its threads are gone, its locks may be stuck in the state the fork
caught them in, and its store connections are the parent's sockets). Start it after the fork,
in the process that is meant to run the jobs.

1. **A scheduler per worker (the default, what this file does).** Without ``--preload``,
   gunicorn imports this module in each worker after forking it, so the ``start_scheduler()``
   call at the bottom runs once per worker. N workers are N nodes; the lease picks one holder.
   The cost is one heartbeat thread and the store connections per worker.
2. **With ``--preload``** gunicorn imports the app once, in the master, before forking the
   workers: do not start the scheduler at import. Set ``SCHEDULER_AUTOSTART=0`` and start it in
   each worker from gunicorn's ``post_fork`` hook (``gunicorn.conf.py``)::

       def post_fork(server, worker):
           from examples.flask_app import start_scheduler
           start_scheduler()

   The result is pattern 1 with a shared, preloaded app; each worker must still be a node of
   its own (leave ``node_id`` and ``MUTEXCRON_NODE_ID`` unset: workers sharing one node id all
   count as the holder). Starting it in the master instead (``when_ready``, or at import with
   ``--preload``) runs the jobs in one process per host that lives through reloads, but inside
   the gunicorn master (a job that hangs or leaks takes the whole server with it), every worker
   inherits a dead copy of ``sched`` and its exit hook (this module's ``/scheduler`` route opens
   a store of its own there), and ``HUP`` does not reload the preloaded code. Prefer 1 or
   ``post_fork``.

uWSGI: the same rules with ``--lazy-apps`` (load the app in each worker, like pattern 1), or
without it start the scheduler from a ``uwsgidecorators.postfork`` function; uWSGI needs
``--enable-threads`` for the scheduler's threads to run at all.

Exits and reloads
-----------------
A worker that exits normally (gunicorn's ``SIGTERM`` on shutdown, on ``HUP``, on a rolling
deploy, after ``max_requests``) stops its scheduler on the way out: ``MutexScheduler.start()``
registers an interpreter-exit hook that stops scheduling, waits up to ``shutdown_timeout`` for a
running guarded job and releases the leases this process holds (fenced by holder and token), so
another worker takes the next tick instead of waiting out a whole lease. Nothing to call here.
Keep ``shutdown_timeout`` below gunicorn's ``--graceful-timeout`` (30 s by default): after that
gunicorn kills the worker with ``SIGKILL`` and the lease runs out on its own. A worker killed
that way, or one that crashes, costs up to one lease (``unactive_interval``) of missed ticks, as
any dead node does. On ``HUP`` gunicorn stops the old workers as soon as it has forked the new
ones, without waiting for them to load the app, so the ticks that fall while the new workers
start (about a second) are skipped even with the release.

``FLASK_APP_RUNS_LOG`` (tests only): append one JSON line per run to that file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from flask import Flask, jsonify

from mutexcron import LockStore, MutexScheduler, current_lease, lock_store_from_url

logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(process)d] %(name)s %(levelname)s: %(message)s")
logging.getLogger("apscheduler").setLevel(logging.WARNING)  # not a line per run and worker
log = logging.getLogger("flask_app")

LOCK = "flask-app-rates"
RUNS_LOG = os.environ.get("FLASK_APP_RUNS_LOG")

# Built at import, but nothing runs and no store connection opens until start_scheduler().
# Store from $MUTEXCRON_LOCK_URL (default sqlite:///mutexcron.db), lease from
# $MUTEXCRON_UNACTIVE_INTERVAL (default 10 s).
sched = MutexScheduler(shutdown_timeout=10)


@sched.mutex(lock=LOCK)
@sched.cron_schedule(second="*")
def refresh_rates(**attrs):
    """Runs on one worker per second, cluster-wide; the returned dict goes to the next run."""
    lease = current_lease()
    runs = attrs.get("runs", 0) + 1
    log.debug("refreshing rates (run %d, token %d, fire time %s)", runs, lease.token, lease.fire_time)
    if RUNS_LOG:
        _record_run(lease.fire_time.timestamp(), lease.token, lease.node_id)
    return {"runs": runs}


def _record_run(fire: float, token: int, node: str) -> None:
    line = json.dumps({"pid": os.getpid(), "node": node, "fire": fire, "token": token, "wall": time.time()})
    fd = os.open(RUNS_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # one write per line: no interleaving
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


_started_in: int | None = None  # the pid that started sched
_start_lock = threading.Lock()
_own_store: tuple[int, LockStore] | None = None


def start_scheduler() -> None:
    """Start ``sched`` in this process, once. Call it after any fork (see the module docstring)."""
    global _started_in
    with _start_lock:
        if _started_in == os.getpid():
            return
        if _started_in is not None:
            raise RuntimeError(
                f"the scheduler was started in process {_started_in}, which this one was forked from: "
                "its threads did not survive the fork; start it after forking (post_fork)"
            )
        sched.start()
        _started_in = os.getpid()
        log.info("scheduler started in process %d (node %s)", _started_in, sched.node_id)


def _store() -> LockStore:
    """The scheduler's store in the process that runs it; a store of this process's own elsewhere."""
    global _own_store
    if _started_in == os.getpid():
        return sched.lock_store
    with _start_lock:
        if _own_store is None or _own_store[0] != os.getpid():  # never reuse a parent's connections
            _own_store = (os.getpid(), lock_store_from_url(sched.lock_url))
        return _own_store[1]


app = Flask(__name__)


@app.get("/")
def index():
    return "ok\n"


@app.get("/scheduler")
def scheduler_status():
    here = _started_in == os.getpid()
    record = _store().read(LOCK)
    jobs = [
        {"id": job.id, "next_run_time": job.next_run_time.isoformat() if job.next_run_time else None}
        for job in (sched.get_jobs() if here else [])
    ]
    return jsonify(
        pid=os.getpid(),
        scheduler_running_here=here,
        node_id=sched.node_id if here else None,
        holds_lock=here and record is not None and record.holder == sched.node_id,
        lock=record.to_json() if record is not None else None,
        jobs=jobs,
    )


if os.environ.get("SCHEDULER_AUTOSTART", "1") != "0":
    start_scheduler()
