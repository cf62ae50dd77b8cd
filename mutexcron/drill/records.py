"""What the drill's nodes write, and read back: the shared ticks file and each node's timing file."""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class OpTimings:
    """A node's store-call timings: ``[op, start, seconds]`` samples (monotonic) buffered in memory
    and handed to ``write`` as one ``{"ops": [...]}`` line a second by a daemon thread (and at exit
    and :meth:`close`), so timing adds no file I/O to a call."""

    def __init__(self, write: Callable[[Mapping[str, Any]], None]) -> None:
        self._write = write
        self._mutex = threading.Lock()
        self._samples: list[tuple[str, float, float]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._flush_loop, name="mutexcron-drill-timing", daemon=True).start()
        atexit.register(self.flush)

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Time the block as one ``op`` sample (also when it raises)."""
        start = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - start
            with self._mutex:
                self._samples.append((op, start, elapsed))

    def _flush_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.flush()

    def flush(self) -> None:
        """Write the buffered samples."""
        with self._mutex:
            samples, self._samples = self._samples, []
        if samples:
            self._write({"ops": [[op, round(t, 6), round(s, 7)] for op, t, s in samples]})

    def close(self) -> None:
        """Stop the flushing thread and write what is left."""
        self._stop.set()
        self.flush()


@dataclass
class Tick:
    """One run of the drill job, as :mod:`mutexcron.drill.node_jobs` wrote it."""

    node: str
    fire: float
    n: int
    token: int
    mono: float
    wall: float = 0.0


@dataclass
class NodeOps:
    """What the nodes' :class:`~mutexcron.drill.TimedLockStore` files say."""

    samples: list[tuple[str, str, float, float]] = field(default_factory=list)  # node, op, start, seconds
    acquired: list[dict[str, Any]] = field(default_factory=list)  # {"lock", "node", "token", "mono"}
    starts: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> {"pid", "wall", "mono"}


def read_ticks(path: Path) -> list[Tick]:
    """Every tick in the shared ticks file (none if it does not exist yet)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(Tick(**json.loads(line)))
        except (ValueError, TypeError):
            continue  # a half-written last line
    return out


def read_ops(workdir: Path) -> NodeOps:
    """Read every node's timing file (``<node>.ops.jsonl``) in ``workdir``."""
    result = NodeOps()
    for path in sorted(workdir.glob("*.ops.jsonl")):
        node = path.name[: -len(".ops.jsonl")]
        for line in path.read_text(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if "ops" in obj:
                result.samples.extend((node, op, t, s) for op, t, s in obj["ops"])
            elif obj.get("event") == "acquired":
                result.acquired.append(obj)
            elif obj.get("event") == "start":
                result.starts[node] = obj
    return result
