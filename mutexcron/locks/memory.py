"""``memory://``: an in-process lock store for tests and single-process use.

``memory://`` gives a private store; ``memory://NAME`` shares one store between every
``memory://NAME`` in the same process (handy for several schedulers in one test). The rows live
in the ``locks`` table of a :class:`~mutexcron.backends.memory.MemoryBackend`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.memory import MemoryBackend
from ..record import LockRecord, dump_attrs
from .base import (
    AcquireResult,
    BatchClaimResult,
    FireClaim,
    HeldClaim,
    LockStore,
    Node,
    RunInfo,
    claim_won,
    fire_times_from_json,
    group_claims,
)


@dataclass
class _Row:
    holder: str | None
    active_ip: str | None
    token: int
    hb: float
    ttl: float
    attrs: str = "{}"
    fires: dict[str, list[Any]] = field(default_factory=dict)
    last_run_started: float | None = None
    last_run_finished: float | None = None
    last_error: str | None = None


class MemoryLockStore(LockStore):
    """A dict behind a mutex. Its clock is ``clock`` (monotonic seconds), injectable for tests.

    Args:
        url: ``memory://`` or ``memory://NAME``, or a ready :class:`MemoryBackend`.
        clock: the store's clock (with a URL only).
    """

    def __init__(self, url: str | MemoryBackend = "memory://", *, clock: Callable[[], float] | None = None) -> None:
        if isinstance(url, MemoryBackend):
            if clock is not None:
                raise TypeError("clock= belongs to the backend: MemoryBackend(url, clock=...)")
            backend = url
        else:
            backend = MemoryBackend(url, clock=clock)
        super().__init__(backend.url)
        self.backend = backend
        self._rows: dict[str, _Row] = backend.table("locks")

    @property
    def clock(self) -> Callable[[], float]:
        """The store's clock (the backend's)."""
        return self.backend.clock

    def _record(self, name: str, row: _Row, now: float) -> LockRecord:
        wall = self.backend.wall
        return LockRecord(
            name=name,
            holder=row.holder,
            active_ip=row.active_ip,
            token=row.token,
            update_time=wall(row.hb, now),
            heartbeat_age=max(0.0, now - row.hb),
            ttl=row.ttl,
            fire_times=fire_times_from_json(row.fires),
            last_run_started=wall(row.last_run_started, now),
            last_run_finished=wall(row.last_run_finished, now),
            last_error=row.last_error,
            attrs=json.loads(row.attrs),
        )

    # -- LockStore ---------------------------------------------------------------------------
    def acquire_or_renew(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None = None
    ) -> AcquireResult:
        with self.backend.mutex:
            now = self.clock()
            row = self._rows.get(name)
            if row is None:
                row = _Row(holder=None, active_ip=None, token=0, hb=now, ttl=ttl)
                self._rows[name] = row
            free = row.holder is None or row.holder == node.node_id or now - row.hb > row.ttl
            if free:
                if row.holder != node.node_id:
                    row.token += 1
                row.holder, row.active_ip, row.hb, row.ttl = node.node_id, node.ip, now, ttl
                if claim is not None:
                    stored = row.fires.get(claim.job_id)
                    if stored is None or int(stored[0]) < claim.fire_us:
                        row.fires[claim.job_id] = [claim.fire_us, claim.nonce]
            record = self._record(name, row, now)
            return AcquireResult(free, record, free and claim_won(copy.deepcopy(row.fires), claim))

    def hand_off(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        text = dump_attrs(attrs, job=name) if attrs is not None else None
        with self.backend.mutex:
            now = self.clock()
            row = self._rows.get(name)
            if row is None or row.holder != node.node_id or row.token != token:
                return False
            row.hb = now
            if text is not None:
                row.attrs = text
            if run is not None:
                row.last_run_finished = now
                row.last_run_started = now - run.duration
                row.last_error = run.error
            return True

    def renew_many(self, node: Node, leases: Mapping[str, int]) -> set[str]:
        renewed: set[str] = set()
        with self.backend.mutex:
            now = self.clock()
            for name, token in leases.items():
                row = self._rows.get(name)
                if row is not None and row.holder == node.node_id and row.token == token:
                    row.hb = now
                    renewed.add(name)
        return renewed

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        groups = group_claims(claims)
        renewed: set[str] = set()
        won: set[str] = set()
        with self.backend.mutex:
            now = self.clock()
            for name, group in groups.items():
                row = self._rows.get(name)
                if row is None or row.holder != node.node_id or row.token != group.token:
                    continue
                row.hb = now
                renewed.add(name)
                for claim in group.claims.values():
                    stored = row.fires.get(claim.job_id)
                    if stored is None or int(stored[0]) < claim.fire_us:
                        row.fires[claim.job_id] = [claim.fire_us, claim.nonce]
                    if claim_won(row.fires, claim):
                        won.add(claim.nonce)
        return BatchClaimResult(frozenset(renewed), frozenset(won))

    def release(self, name: str, node: Node, token: int) -> bool:
        with self.backend.mutex:
            row = self._rows.get(name)
            if row is None or row.holder != node.node_id or row.token != token:
                return False
            row.holder = None
            return True

    def read(self, name: str) -> LockRecord | None:
        with self.backend.mutex:
            row = self._rows.get(name)
            return None if row is None else self._record(name, row, self.clock())

    def list(self) -> list[LockRecord]:
        with self.backend.mutex:
            now = self.clock()
            return [self._record(n, r, now) for n, r in sorted(self._rows.items())]

    def ping(self) -> None:
        self.backend.ping()

    def close(self) -> None:
        self.backend.close()
