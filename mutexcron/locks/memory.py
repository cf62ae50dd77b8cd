"""``memory://``: an in-process lock store for tests and single-process use.

``memory://`` gives a private store; ``memory://NAME`` shares one store between every
``memory://NAME`` in the same process (handy for several schedulers in one test). The rows live
in the ``locks`` table of a :class:`~mutexcron.backends.memory.MemoryBackend`; the store's token
floor (the highest token of a record ``forget`` deleted) in its ``lock_token_floor`` table. Every
operation runs under the backend's mutex, so ``forget`` deletes a record at once: raising the
floor and deleting are one step.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.memory import MemoryBackend
from ..node import NodeTraits
from .base import (
    FORGET_DELETED,
    FORGET_HELD,
    FORGET_MISSING,
    PRESENCE_TTL,
    AcquireResult,
    BatchClaimResult,
    FireClaim,
    HandOff,
    HeldClaim,
    LockStore,
    Node,
    Presence,
    RunInfo,
    claim_won,
    fire_times_from_json,
    group_claims,
    history_option,
    stored_nonce,
)
from .record import LockRecord, NodePresence, dump_attrs


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
    paused: bool = False
    paused_at: float | None = None
    paused_by: str | None = None
    resume_catch_up: bool = False
    zone: str | None = None
    triggers: dict[str, str] | None = None
    #: ``{job: [entry, ...]}``, oldest first; ``started``/``ended`` as aware datetimes.
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class _NodeRow:
    ip: str
    version: str
    seen: float
    clock_offset: float | None
    locks: tuple[str, ...]
    traits: NodeTraits


class MemoryLockStore(LockStore):
    """A dict behind a mutex. Its clock is ``clock`` (monotonic seconds), injectable for tests.

    Args:
        url: ``memory://`` or ``memory://NAME`` (``?history=N``: runs kept per job), or a ready
            :class:`MemoryBackend`.
        clock: the store's clock (with a URL only).
        history: runs kept per job (wins over ``?history=``; default 20).
    """

    def __init__(
        self, url: str | MemoryBackend = "memory://", *, clock: Callable[[], float] | None = None, history: int | None = None
    ) -> None:
        if isinstance(url, MemoryBackend):
            if clock is not None:
                raise TypeError("clock= belongs to the backend: MemoryBackend(url, clock=...)")
            backend = url
            _, self.history_length = history_option(url.url, history)
        else:
            url, self.history_length = history_option(url, history)
            backend = MemoryBackend(url, clock=clock)
        super().__init__(backend.url)
        self.backend = backend
        self._rows: dict[str, _Row] = backend.table("locks")
        self._nodes: dict[str, _NodeRow] = backend.table("nodes")
        self._floor: dict[str, int] = backend.table("lock_token_floor")

    def _next_token(self, token: int) -> int:
        """The token of a new holder (held under the mutex): above the record's and the store's floor."""
        return max(token, self._floor.get("tokens", 0)) + 1

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
            paused=row.paused,
            paused_at=wall(row.paused_at, now),
            paused_by=row.paused_by,
            resume_catch_up=row.resume_catch_up,
            zone=row.zone,
            triggers=None if row.triggers is None else dict(row.triggers),
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
                    row.token = self._next_token(row.token)
                row.holder, row.active_ip, row.hb, row.ttl = node.node_id, node.ip, now, ttl
                if claim is not None and not row.paused:
                    stored = row.fires.get(claim.job_id)
                    if stored is None or int(stored[0]) < claim.fire_us:
                        row.fires[claim.job_id] = [claim.fire_us, claim.nonce]
            record = self._record(name, row, now)
            fires = copy.deepcopy(row.fires)
            return AcquireResult(free, record, free and claim_won(fires, claim), claimed_by=stored_nonce(fires, claim))

    def hand_off(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        return self.hand_off_many(node, [HandOff(name, token, attrs, run)])[0]

    def hand_off_many(self, node: Node, items: Sequence[HandOff]) -> list[bool]:
        texts = [dump_attrs(item.attrs, job=item.lock) if item.attrs is not None else None for item in items]
        with self.backend.mutex:
            now = self.clock()
            return [self._hand_off_one(node, item, text, now) for item, text in zip(items, texts, strict=True)]

    def _hand_off_one(self, node: Node, item: HandOff, text: str | None, now: float) -> bool:
        row = self._rows.get(item.lock)
        if row is None or row.holder != node.node_id or row.token != item.token:
            return False
        row.hb = now
        if text is not None:
            row.attrs = text
        run = item.run
        if run is not None:
            row.last_run_finished = now
            row.last_run_started = now - run.duration
            row.last_error = run.error
            if self.history_length:
                self._append_run(row, item.lock, node, item.token, run, now)
        return True

    def _append_run(self, row: _Row, name: str, node: Node, token: int, run: RunInfo, now: float) -> None:
        entry = run.history_entry(node, token)
        entry["started"] = self.backend.wall(now - max(0.0, run.duration), now)
        entry["ended"] = self.backend.wall(now, now)
        runs = row.history.setdefault(run.job or name, [])
        runs.append(entry)
        del runs[: max(0, len(runs) - self.history_length)]

    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        renewed: set[str] = set()
        with self.backend.mutex:
            now = self.clock()
            for name, token in leases.items():
                row = self._rows.get(name)
                if row is not None and row.holder == node.node_id and row.token == token:
                    row.hb = now
                    renewed.add(name)
            if presence is not None:
                held = tuple(presence.held(leases))
                self._nodes[node.node_id] = _NodeRow(
                    node.ip, presence.version, now, presence.clock_offset, held, presence.traits
                )
                self._prune(now)
        return renewed

    def _prune(self, now: float) -> None:
        for node_id in [n for n, r in self._nodes.items() if now - r.seen > PRESENCE_TTL]:
            del self._nodes[node_id]

    def nodes(self, *, prune: bool = True) -> list[NodePresence]:
        with self.backend.mutex:
            now = self.clock()
            if prune:
                self._prune(now)
            wall = self.backend.wall
            return [
                NodePresence(
                    node_id, r.ip, r.version, wall(r.seen, now), max(0.0, now - r.seen), r.clock_offset, r.locks, r.traits
                )
                for node_id, r in sorted(self._nodes.items())
                if now - r.seen <= PRESENCE_TTL
            ]

    def set_paused(self, name: str, paused: bool, by: str, *, catch_up: bool = False) -> LockRecord:
        with self.backend.mutex:
            now = self.clock()
            row = self._rows.get(name)
            if row is None:  # paused before any node ran it: a released record, token 0
                row = _Row(holder=None, active_ip=None, token=0, hb=now, ttl=0.0)
                self._rows[name] = row
            row.paused, row.paused_at, row.paused_by = paused, now, by
            row.resume_catch_up = catch_up and not paused
            return self._record(name, row, now)

    def forget(self, name: str, *, force: bool = False) -> str:
        with self.backend.mutex:
            now = self.clock()
            row = self._rows.get(name)
            if row is None:
                return FORGET_MISSING
            if row.holder is not None and now - row.hb <= row.ttl and not force:
                return FORGET_HELD
            # One step under the mutex: the floor keeps the record's tokens spent, then it goes.
            self._floor["tokens"] = max(self._floor.get("tokens", 0), row.token)
            del self._rows[name]
            return FORGET_DELETED

    def forget_node(self, node_id: str, *, min_age: float = 0.0) -> bool:
        with self.backend.mutex:
            row = self._nodes.get(node_id)
            if row is None or self.clock() - row.seen < min_age:
                return False
            del self._nodes[node_id]
            return True

    def _stored_history(self, locks: Sequence[str]) -> dict[str, Mapping[str, Any]]:
        with self.backend.mutex:
            return {n: copy.deepcopy(self._rows[n].history) for n in locks if n in self._rows}

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        groups = group_claims(claims)
        renewed: set[str] = set()
        won: set[str] = set()
        paused: set[str] = set()
        lost: dict[str, str] = {}
        with self.backend.mutex:
            now = self.clock()
            for name, group in groups.items():
                row = self._rows.get(name)
                if row is None or row.holder != node.node_id or row.token != group.token:
                    continue
                row.hb = now
                renewed.add(name)
                if row.paused:
                    paused.add(name)
                    continue
                for claim in group.claims.values():
                    stored = row.fires.get(claim.job_id)
                    if stored is None or int(stored[0]) < claim.fire_us:
                        row.fires[claim.job_id] = [claim.fire_us, claim.nonce]
                    if claim_won(row.fires, claim):
                        won.add(claim.nonce)
                    else:
                        lost[claim.nonce] = str(row.fires[claim.job_id][1])
        return BatchClaimResult(frozenset(renewed), frozenset(won), frozenset(paused), lost)

    def release(self, name: str, node: Node, token: int) -> bool:
        with self.backend.mutex:
            row = self._rows.get(name)
            if row is None or row.holder != node.node_id or row.token != token:
                return False
            row.holder = None
            return True

    def hand_over(self, name: str, node: Node, token: int, successor: str, within: float) -> bool:
        with self.backend.mutex:
            row = self._rows.get(name)
            if row is None or row.holder != node.node_id or row.token != token:
                return False
            row.holder, row.active_ip, row.hb, row.ttl = successor, None, self.clock(), within
            row.token = self._next_token(token)
            return True

    def set_zone(
        self, name: str, node: Node, token: int, zone: str | None, triggers: Mapping[str, str] | None = None
    ) -> bool:
        with self.backend.mutex:
            row = self._rows.get(name)
            if row is None or row.holder != node.node_id or row.token != token:
                return False
            row.zone, row.triggers = zone, None if triggers is None else dict(triggers)
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
