"""The runs file of scale.py's nodes: written by ``scale_jobs.py`` (guarded) and ``plain_jobs.py`` (plain), read by scale.py.

Each node appends one line per run of a job to ``<MUTEXCRON_SCALE_DIR>/runs-<pid>.txt``::

    <job index> <scheduled fire time, epoch s> <when the job's function started, epoch s> <node id>

Lines are buffered in memory and written once a second by a daemon thread, so recording a run costs
a deque append, the same in both kinds of node. This module imports nothing from mutexcron: the
plain baseline nodes run APScheduler alone.
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path


class RunLog:
    """This node's runs, flushed to ``<directory>/runs-<pid>.txt`` once a second."""

    def __init__(self, directory: str, node_id: str) -> None:
        self.path = os.path.join(directory, f"runs-{os.getpid()}.txt")
        self.node_id = node_id
        self._lines: collections.deque[str] = collections.deque()
        threading.Thread(target=self._flush_loop, name="scale-runs", daemon=True).start()
        atexit.register(self.flush)

    def add(self, job: int, fire: float, started: float) -> None:
        self._lines.append(f"{job} {fire:.3f} {started:.6f} {self.node_id}\n")

    def _flush_loop(self) -> None:
        while True:
            time.sleep(1.0)
            self.flush()

    def flush(self) -> None:
        """Append the runs recorded since the last flush (also at exit: a node stopped by SIGTERM keeps its last runs)."""
        batch = [self._lines.popleft() for _ in range(len(self._lines))]
        if batch:
            with open(self.path, "a") as fh:
                fh.write("".join(batch))


@dataclass(frozen=True)
class Run:
    """One line of a runs file."""

    node: str
    job: int
    fire: float
    started: float


def read_runs(directory: Path) -> list[Run]:
    """Every run the nodes wrote to ``directory`` (a half-written last line is skipped)."""
    runs = []
    for path in sorted(directory.glob("runs-*.txt")):
        for line in path.read_text().splitlines():
            parts = line.split()
            try:
                runs.append(Run(parts[3], int(parts[0]), float(parts[1]), float(parts[2])))
            except (IndexError, ValueError):
                continue
    return runs


def die_with_parent() -> None:
    """Die with scale.py (Linux ``PR_SET_PDEATHSIG``), like the drill's nodes, without importing mutexcron."""
    parent = int(os.environ.get("MUTEXCRON_DRILL_PARENT", "0") or 0)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: scale.py's own cleanup still stops the nodes
        return
    if parent and os.getppid() != parent:  # scale.py died before prctl took effect
        os._exit(1)
