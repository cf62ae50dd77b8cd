"""What runs inside the drill's node processes: the timed store, its configuration, death with the drill.

Imported by the nodes' jobs modules (:mod:`mutexcron.drill.node_jobs`, ``benchmarks/scale_jobs.py``)
only. The timing wraps the store that those jobs modules hand to their scheduler, so store round
trips are measured in the nodes without touching the library's code or its hot path.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ConfigurationError, StoreError
from ..locks import (
    AcquireResult,
    BatchClaimResult,
    FireClaim,
    HandOff,
    HeldClaim,
    LockStore,
    Node,
    Presence,
    RunInfo,
    lock_store_from_url,
)
from ..locks.record import LockRecord, NodePresence, RunRecord
from .records import OpTimings

log = logging.getLogger(__name__)


def drill_env(name: str) -> str:
    """The environment variable ``name`` that the drill set for this node.

    Raises:
        ConfigurationError: it is not set (the module runs outside a drill node).
    """
    try:
        return os.environ[name]
    except KeyError:
        raise ConfigurationError(
            f"${name} is not set: this module runs inside the node processes that mutexcron.drill starts"
        ) from None


class TimedLockStore(LockStore):
    """A LockStore that times every call of the store it wraps, for the drill and the benchmarks.

    Samples ``[op, start, seconds]`` (monotonic) are buffered and appended to ``path`` as JSON
    lines once a second by a daemon thread (and at exit), so timing adds no file I/O to a call.
    Each change of lease (a new token from ``acquire_or_renew``) is written at once as an
    ``{"event": "acquired"}`` line: the drill reads takeover times from those.

    Args:
        inner: the store to time.
        path: the node's samples file.
        node_id: written in the file's first line with this process's wall and monotonic clocks,
            from which the drill measures each node's clock offset.
    """

    def __init__(self, inner: LockStore, path: str | os.PathLike[str], *, node_id: str = "") -> None:
        super().__init__(inner.url)
        self.inner = inner
        self.node_id = node_id
        self._fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._tokens: dict[str, int] = {}
        self._write({"event": "start", "node": node_id, "pid": os.getpid(), "wall": time.time(), "mono": time.monotonic()})
        self._timings = OpTimings(self._write)
        self._timed = self._timings.timed

    # -- recording ----------------------------------------------------------------------------
    def _write(self, obj: Mapping[str, Any]) -> None:
        try:
            os.write(self._fd, (json.dumps(obj, separators=(",", ":")) + "\n").encode())
        except OSError:  # the drill removed its directory: nothing left to report to
            pass

    def flush(self) -> None:
        """Append the buffered samples to the file."""
        self._timings.flush()

    # -- LockStore ----------------------------------------------------------------------------
    def acquire_or_renew(self, name: str, node: Node, ttl: float, claim: FireClaim | None = None) -> AcquireResult:
        with self._timed("acquire_or_renew"):
            result = self.inner.acquire_or_renew(name, node, ttl, claim)
        if result.acquired and self._tokens.get(name) != result.token:
            self._tokens[name] = result.token
            self._write(
                {"event": "acquired", "lock": name, "node": node.node_id, "token": result.token, "mono": time.monotonic()}
            )
        return result

    def hand_off(
        self, name: str, node: Node, token: int, attrs: Mapping[str, Any] | None = None, run: RunInfo | None = None
    ) -> bool:
        with self._timed("hand_off"):
            return self.inner.hand_off(name, node, token, attrs, run)

    def hand_off_many(self, node: Node, items: Sequence[HandOff]) -> list[bool]:
        with self._timed("hand_off_many"):
            return self.inner.hand_off_many(node, items)

    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        with self._timed("renew_many"):
            return self.inner.renew_many(node, leases, presence=presence)

    def set_paused(self, name: str, paused: bool, by: str, *, catch_up: bool = False) -> LockRecord:
        return self.inner.set_paused(name, paused, by, catch_up=catch_up)

    def set_zone(
        self, name: str, node: Node, token: int, zone: str | None, triggers: Mapping[str, str] | None = None
    ) -> bool:
        return self.inner.set_zone(name, node, token, zone, triggers)

    def history_many(
        self, locks: Iterable[str], job: str | None = None, limit: int | None = None
    ) -> dict[str, list[RunRecord]]:
        return self.inner.history_many(locks, job, limit)

    def nodes(self, *, prune: bool = True) -> list[NodePresence]:
        return self.inner.nodes(prune=prune)

    def forget_node(self, node_id: str, *, min_age: float = 0.0) -> bool:
        return self.inner.forget_node(node_id, min_age=min_age)

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        with self._timed("claim_many"):
            return self.inner.claim_many(node, claims)

    def release(self, name: str, node: Node, token: int) -> bool:
        with self._timed("release"):
            return self.inner.release(name, node, token)

    def read(self, name: str) -> LockRecord | None:
        with self._timed("read"):
            return self.inner.read(name)

    def read_many(self, names: Iterable[str]) -> dict[str, LockRecord]:
        with self._timed("read_many"):
            return self.inner.read_many(names)

    def list(self) -> list[LockRecord]:
        with self._timed("list"):
            return self.inner.list()

    def ping(self) -> None:
        with self._timed("ping"):
            self.inner.ping()

    def close(self) -> None:
        self._timings.close()
        self.inner.close()


def timed_store_from_env(**options: Any) -> TimedLockStore:
    """The store of a drill or benchmark node: ``$MUTEXCRON_DRILL_URL``, timed into ``$MUTEXCRON_DRILL_OPS``.

    Args:
        options: passed to :func:`~mutexcron.locks.lock_store_from_url` (e.g. ``pool_size`` for SQL).
    """
    inner = lock_store_from_url(drill_env("MUTEXCRON_DRILL_URL"), **options)
    try:
        inner.ping()  # opens the connection (and creates the table) before anything is timed
    except StoreError as exc:
        log.debug("warm-up ping failed: %s", exc)  # the scheduler logs the outage itself
    return TimedLockStore(inner, drill_env("MUTEXCRON_DRILL_OPS"), node_id=os.environ.get("MUTEXCRON_NODE_ID", ""))


def die_with_parent() -> None:
    """Make this node die with the drill (Linux ``PR_SET_PDEATHSIG``): a killed drill leaves no orphans."""
    parent = int(os.environ.get("MUTEXCRON_DRILL_PARENT", "0") or 0)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the drill's own cleanup still stops the nodes
        return
    if parent and os.getppid() != parent:  # the drill died before prctl took effect
        os._exit(1)
