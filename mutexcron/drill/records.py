"""What the drill's nodes write, read back: the shared ticks file and each node's timing file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
