"""How the command line and the dashboard show values: ages, times, durations, clock offsets,
clipped text, a node's share, weight and tags, a task's fields. Plain functions of plain values: no store, no terminal."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tasks.base import TaskRecord

__all__ = ["age", "clip", "duration", "offset", "record_json", "share", "tags", "weight", "when"]


def age(seconds: float | None) -> str:
    """``12.3s``, ``5m``, ``3h``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def share(held: int, total: int) -> str:
    """A node's share of the locks: ``100 of 300 (33%)``; ``-`` when there are no locks."""
    if total <= 0:
        return "-"
    return f"{held} of {total} ({100 * held / total:.0f}%)"


def weight(value: float) -> str:
    """A node's placement weight: ``1``, ``2.5``."""
    return f"{value:g}"


def tags(values: Iterable[str]) -> str:
    """A node's tags: ``eu, reports``; ``-`` for none."""
    return ", ".join(values) or "-"


def when(value: datetime | None) -> str:
    """``YYYY-MM-DD HH:MM:SS`` (the value's own zone: UTC everywhere we show one); ``-`` for None."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def clip(text: str | None, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters (an ellipsis says so); ``-`` for nothing."""
    text = "-" if text in (None, "") else " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def duration(seconds: float | None) -> str:
    """``840ms``, ``12.5s``, then as :func:`age`; ``-`` for None."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.1f}s" if seconds < 120 else age(seconds)


def offset(seconds: float | None) -> str:
    """A signed clock offset, ``+0.012s``; ``-`` for None."""
    return "-" if seconds is None else f"{seconds:+.3f}s"


def record_json(task: TaskRecord) -> dict[str, Any]:
    """Every field of ``task``; times as ISO 8601 UTC."""
    out: dict[str, Any] = {}
    for item in dataclasses.fields(task):
        value = getattr(task, item.name)
        out[item.name] = value.astimezone(timezone.utc).isoformat() if isinstance(value, datetime) else value
    return out
