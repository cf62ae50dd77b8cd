"""``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` and ``redis+cluster://``: the Redis lock store.

Every lock is one hash that never expires, ``mutexcron:{<namespace>}:lock:<name>``, beside a
token counter ``mutexcron:{<namespace>}:token:<name>`` (INCR only, never expires) and the names
set ``mutexcron:{<namespace>}:names``. ``forget`` deletes a lock's keys, its counter included,
after raising the namespace's token floor ``mutexcron:{<namespace>}:lock_token_floor`` (only
goes up, never expires) to the counter and the hash's token, in the same script; every token given
to a new holder is above the name's counter, the hash's token and that floor, so no token comes
back after a forget, a deletion or a re-add. A job's run
history is the list ``mutexcron:{<namespace>}:runs:<len(name)>:<name>:<job>``, indexed by the hash
``mutexcron:{<namespace>}:history:<name>`` (one field per job), and the nodes' presence the hash
``mutexcron:{<namespace>}:nodes`` with the zset ``mutexcron:{<namespace>}:nodes:seen``. Each
write is one Lua script (:mod:`mutexcron.locks.redis_scripts`) judged by the server's ``TIME``;
the client, the namespace and the error translation are the
:class:`~mutexcron.backends.redis.RedisBackend`'s.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from ..backends.redis import RedisBackend, now_ms
from ..node import NodeTraits
from ..timeutil import MILLISECONDS, as_utc
from .base import (
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
from .record import (
    LockRecord,
    NodePresence,
    dump_attrs,
    dump_triggers,
    load_attrs,
    load_locks,
    load_triggers,
    optional_float,
)
from .redis_scripts import (
    ACQUIRE_LUA,
    CLAIM_MANY_LUA,
    FORGET_LUA,
    FORGET_NODE_LUA,
    HAND_OFF_LUA,
    HAND_OFF_MANY_LUA,
    HAND_OVER_LUA,
    HISTORY_LUA,
    NODES_LUA,
    NODES_READ_LUA,
    READ_LUA,
    RELEASE_LUA,
    RENEW_MANY_LUA,
    RENEW_PRESENCE_LUA,
    SET_PAUSED_LUA,
    SET_ZONE_LUA,
)

__all__ = ["RedisLockStore"]

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

#: The channel (in the namespace) a hand-over publishes its successor's id on.
HAND_OVER_CHANNEL = "lock_hand_over"


class RedisLockStore(LockStore):
    """Leased, fenced locks in Redis: one Lua script per operation, judged by the server's clock.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``, ``redis+cluster://`` or
            ``rediss+cluster://`` (see :data:`mutexcron.backends.redis.URL_FORMS`), or a ready
            :class:`RedisBackend`.
        **options: with a URL, the backend's: ``namespace``, ``socket_timeout``,
            ``socket_connect_timeout`` (the URL query wins over these), ``sentinel_kwargs``, and any
            other redis-py connection keyword.
        history: runs kept per job in the run history (wins over ``?history=``; default 20).
    """

    def __init__(self, url: str | RedisBackend, *, history: int | None = None, **options: Any) -> None:
        if isinstance(url, RedisBackend):
            if options:
                raise TypeError("connection options belong to the backend: RedisBackend(url, ...)")
            backend = url
            _, self.history_length = history_option(url.url, history)
        else:
            url, self.history_length = history_option(url, history)  # redis-py must not see ?history=
            backend = RedisBackend(url, **options)
        super().__init__(backend.url)
        self.backend = backend
        self._acquire = backend.script(ACQUIRE_LUA)
        self._hand_off = backend.script(HAND_OFF_LUA)
        self._hand_off_many = backend.script(HAND_OFF_MANY_LUA)
        self._renew_many = backend.script(RENEW_MANY_LUA)
        self._claim_many = backend.script(CLAIM_MANY_LUA)
        self._release = backend.script(RELEASE_LUA)
        self._hand_over = backend.script(HAND_OVER_LUA)
        self._set_zone = backend.script(SET_ZONE_LUA)
        self._read = backend.script(READ_LUA)
        self._renew_presence = backend.script(RENEW_PRESENCE_LUA)
        self._nodes = backend.script(NODES_LUA)
        self._nodes_read = backend.script(NODES_READ_LUA)
        self._set_paused = backend.script(SET_PAUSED_LUA)
        self._history = backend.script(HISTORY_LUA)
        self._forget = backend.script(FORGET_LUA)
        self._forget_node = backend.script(FORGET_NODE_LUA)
        self._floor: dict[str, int] = {}
        self._floor_mutex = threading.Lock()

    # -- the backend's, under the names tests and benchmarks use ------------------------------
    @property
    def namespace(self) -> str:
        return self.backend.namespace

    @property
    def socket_timeout(self) -> float:
        return self.backend.socket_timeout

    @property
    def service_name(self) -> str | None:
        return self.backend.service_name

    @property
    def _client(self) -> redis.Redis | RedisCluster:
        return self.backend.client

    @property
    def _redis(self) -> redis.Redis | RedisCluster | None:
        return self.backend.redis

    @property
    def _sentinel(self) -> Sentinel | None:
        return self.backend.sentinel

    @property
    def _make_cluster(self) -> functools.partial[Any] | None:
        return self.backend.make_cluster

    def destroy_namespace(self) -> int:
        """Delete every key of this namespace (locks, token counters, names set). For tests only.

        Returns:
            The number of keys deleted.
        """
        return self.backend.destroy_namespace()

    # -- keys and records --------------------------------------------------------------------
    def _lock_key(self, name: str) -> str:
        return self.backend.key(f"lock:{name}")

    def _token_key(self, name: str) -> str:
        return self.backend.key(f"token:{name}")

    def _history_key(self, name: str) -> str:
        return self.backend.key(f"history:{name}")

    def _runs_key(self, name: str, job: str) -> str:
        """A job's list of history lines; the name's length keeps ``("a:b", "c")`` and ``("a", "b:c")`` apart."""
        return self.backend.key(f"runs:{len(name)}:{name}:{job}")

    @property
    def _names_key(self) -> str:
        return self.backend.key("names")

    @property
    def _floor_key(self) -> str:
        """The namespace's token floor: the highest token of a lock ``forget`` deleted."""
        return self.backend.key("lock_token_floor")

    @property
    def _presence_keys(self) -> list[str]:
        """The nodes hash and its seen zset."""
        return [self.backend.key("nodes"), self.backend.key("nodes:seen")]

    def _seen(self, name: str, token: int) -> None:
        with self._floor_mutex:
            if token > self._floor.get(name, 0):
                self._floor[name] = token

    def token_floor(self, name: str) -> int:
        """The highest token this store object has seen for ``name`` (0 if none)."""
        with self._floor_mutex:
            return self._floor.get(name, 0)

    def _record(
        self, name: str, fields: Mapping[str, str], now: int, fires: Mapping[str, Any] | None = None
    ) -> LockRecord:
        hb = fields.get("hb")
        token = int(fields.get("token") or 0)
        self._seen(name, token)
        return LockRecord(
            name=name,
            holder=fields.get("holder") or None,
            active_ip=fields.get("active_ip") or None,
            token=token,
            update_time=as_utc(hb, epoch_unit=MILLISECONDS),
            heartbeat_age=None if not hb else max(0.0, (now - int(hb)) / 1000),
            ttl=int(fields.get("ttl") or 0) / 1000,
            fire_times=fire_times_from_json(self._fires(fields) if fires is None else fires),
            last_run_started=as_utc(fields.get("last_run_started"), epoch_unit=MILLISECONDS),
            last_run_finished=as_utc(fields.get("last_run_finished"), epoch_unit=MILLISECONDS),
            last_error=fields.get("last_error"),
            attrs=load_attrs(fields.get("attrs")),
            paused=fields.get("paused") == "1",
            paused_at=as_utc(fields.get("paused_at"), epoch_unit=MILLISECONDS),
            paused_by=fields.get("paused_by"),
            resume_catch_up=fields.get("resume_catch_up") == "1",
            zone=fields.get("zone") or None,
            triggers=load_triggers(fields.get("triggers")),
        )

    @staticmethod
    def _fires(fields: Mapping[str, str]) -> dict[str, Any]:
        value = json.loads(fields.get("fires") or "{}")
        return value if isinstance(value, dict) else {}

    @staticmethod
    def _pairs(flat: Sequence[str]) -> dict[str, str]:
        return dict(zip(flat[::2], flat[1::2], strict=True))

    # -- LockStore ---------------------------------------------------------------------------
    def acquire_or_renew(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None = None
    ) -> AcquireResult:
        ttl_ms = max(1, round(ttl * 1000))
        args: list[str | int] = [node.node_id, node.ip, ttl_ms, self.token_floor(name), name]
        if claim is not None:
            args += [claim.job_id, claim.fire_us, claim.nonce]
        with self.backend.errors("acquire_or_renew"):
            keys = [self._lock_key(name), self._token_key(name), self._names_key, self._floor_key]
            reply = self._acquire(keys=keys, args=args, client=self.backend.client)
        acquired, now, flat = json.loads(reply)
        fields = self._pairs(flat) if isinstance(flat, list) else {}
        fires = self._fires(fields)
        record = self._record(name, fields, int(now), fires)
        won = bool(acquired) and claim_won(fires, claim)
        return AcquireResult(bool(acquired), record, won, claimed_by=stored_nonce(fires, claim))

    def hand_off(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        keys, args = self._hand_off_args(node, HandOff(name, token, attrs, run))  # AttrsError before any write
        with self.backend.errors("hand_off"):
            return bool(self._hand_off(keys=keys, args=args, client=self.backend.client))

    def hand_off_many(self, node: Node, items: Sequence[HandOff]) -> list[bool]:
        """One script (``HAND_OFF_MANY_LUA``): each item's hand-off in order, each fenced on its own."""
        if not items:
            return []
        keys: list[str] = []
        args: list[str | int] = []
        for item in items:  # every item's attrs checked before anything is sent
            item_keys, item_args = self._hand_off_args(node, item)
            keys += item_keys
            args += item_args
        with self.backend.errors("hand_off"):
            reply = self._hand_off_many(keys=keys, args=args, client=self.backend.client)
        return [bool(int(flag)) for flag in reply]

    def _hand_off_args(self, node: Node, item: HandOff) -> tuple[list[str], list[str | int]]:
        """HAND_OFF_LUA's KEYS and ARGV for one hand-off. Raises AttrsError for bad attrs."""
        name, token, run = item.lock, item.token, item.run
        text = dump_attrs(item.attrs, job=name) if item.attrs is not None else None
        args: list[str | int] = [node.node_id, token, "0" if text is None else "1", text or ""]
        if run is None:
            args += ["0", 0, "0", "", "", "", 0]
        else:
            args += ["1", max(0, round(run.duration * 1000)), "0" if run.error is None else "1", run.error or ""]
            args += [run.job or name, run.history_tail(node, token) if self.history_length else "", self.history_length]
        keys = [self._lock_key(name), self._history_key(name), self._runs_key(name, (run.job or name) if run else name)]
        return keys, args

    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        if not leases and presence is None:
            return set()
        names = list(leases)
        keys = [self._lock_key(n) for n in names]
        args: list[str | int] = [node.node_id, *(leases[n] for n in names)]
        script = self._renew_many
        if presence is not None:
            script = self._renew_presence
            keys += self._presence_keys
            args += [self._presence_text(node, presence, leases), PRESENCE_TTL * 1000]
        with self.backend.errors("renew_many"):
            renewed = script(keys=keys, args=args, client=self.backend.client)
        return {names[int(i) - 1] for i in renewed}

    @staticmethod
    def _presence_text(node: Node, presence: Presence, leases: Mapping[str, int]) -> str:
        """The presence as stored, but for ``seen`` (the script adds it)."""
        fields: dict[str, Any] = {"ip": node.ip, "version": presence.version, "clock_offset": presence.clock_offset}
        fields["locks"] = presence.held(leases)
        fields["traits"] = presence.traits.to_json()
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":"))

    def nodes(self, *, prune: bool = True) -> list[NodePresence]:
        script = self._nodes if prune else self._nodes_read
        with self.backend.errors("nodes"):
            reply = script(keys=self._presence_keys, args=[PRESENCE_TTL * 1000], client=self.backend.client)
        now, flat = json.loads(reply)
        fields = self._pairs(flat) if isinstance(flat, list) else {}  # cjson: an empty table is {}
        return [self._presence(node_id, text, int(now)) for node_id, text in sorted(fields.items())]

    @staticmethod
    def _presence(node_id: str, text: str, now: int) -> NodePresence:
        value = json.loads(text)
        seen = value.get("seen")
        return NodePresence(
            node_id=node_id,
            ip=value.get("ip"),
            version=value.get("version"),
            last_seen=as_utc(seen, epoch_unit=MILLISECONDS),
            age=None if seen is None else max(0.0, (now - int(seen)) / 1000),
            clock_offset=optional_float(value.get("clock_offset")),
            locks=load_locks(value.get("locks")),
            traits=NodeTraits.from_json(value.get("traits")),
        )

    def set_paused(self, name: str, paused: bool, by: str, *, catch_up: bool = False) -> LockRecord:
        args = ["1" if paused else "0", by, "1" if catch_up and not paused else "0", name]
        with self.backend.errors("set_paused"):
            reply = self._set_paused(keys=[self._lock_key(name), self._names_key], args=args, client=self.backend.client)
        now, flat = json.loads(reply)
        return self._record(name, self._pairs(flat), int(now))

    def forget(self, name: str, *, force: bool = False) -> str:
        """Two round trips: the jobs of the history hash (their runs lists' keys), then the script,
        which alone decides. A run recorded in between leaves its list behind (a few bytes)."""
        with self.backend.errors("forget"):
            jobs = self.backend.client.hkeys(self._history_key(name))
            keys = [self._lock_key(name), self._token_key(name), self._names_key, self._floor_key, self._history_key(name)]
            keys += [self._runs_key(name, job.decode() if isinstance(job, bytes) else job) for job in jobs]
            outcome = self._forget(keys=keys, args=[name, "1" if force else "0"], client=self.backend.client)
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome)

    def forget_node(self, node_id: str, *, min_age: float = 0.0) -> bool:
        with self.backend.errors("forget_node"):
            args: list[str | int] = [node_id, int(min_age * 1000)]
            return bool(self._forget_node(keys=self._presence_keys, args=args, client=self.backend.client))

    def _stored_history(self, locks: Sequence[str]) -> dict[str, Mapping[str, Any]]:
        keys = [key for name in locks for key in (self._lock_key(name), self._history_key(name))]
        with self.backend.errors("history"):
            rows = json.loads(self._history(keys=keys, client=self.backend.client))
        out: dict[str, dict[str, Any]] = {}
        for name, (exists, flat) in zip(locks, rows, strict=True):
            if int(exists):
                jobs = self._pairs(flat) if isinstance(flat, list) else {}
                out[name] = {job: _entries(text) for job, text in jobs.items()}
        listed = [(name, job) for name, jobs in out.items() for job, entries in jobs.items() if not entries]
        if listed:  # the jobs whose runs are in their lists: one more round trip, a pipeline
            with self.backend.errors("history"):
                pipe = self.backend.client.pipeline(transaction=False)
                for name, job in listed:
                    pipe.lrange(self._runs_key(name, job), 0, -1)
                for (name, job), lines in zip(listed, pipe.execute(), strict=True):
                    out[name][job] = [json.loads(line) for line in lines]
        return {name: jobs for name, jobs in out.items()}  # as Mappings

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        groups = group_claims(claims)
        if not groups:
            return BatchClaimResult()
        names = list(groups)
        args: list[str | int] = [node.node_id]
        for group in groups.values():
            args += [group.token, len(group.claims)]
            for claim in group.claims.values():
                args += [claim.job_id, claim.fire_us, claim.nonce]
        with self.backend.errors("claim_many"):
            reply = self._claim_many(keys=[self._lock_key(n) for n in names], args=args, client=self.backend.client)
        renewed, won, paused, lost = json.loads(reply)  # cjson encodes an empty table as {}: iterating it yields nothing
        return BatchClaimResult(
            frozenset(names[int(i) - 1] for i in renewed), frozenset(won), frozenset(names[int(i) - 1] for i in paused),
            {str(mine): str(stored) for mine, stored in lost},
        )  # fmt: skip

    def release(self, name: str, node: Node, token: int) -> bool:
        with self.backend.errors("release"):
            return bool(self._release(keys=[self._lock_key(name)], args=[node.node_id, token], client=self.backend.client))

    def hand_over(self, name: str, node: Node, token: int, successor: str, within: float) -> bool:
        args: list[str | int] = [node.node_id, token, successor, max(1, round(within * 1000)), self._hand_over_channel]
        with self.backend.errors("hand_over"):
            keys = [self._lock_key(name), self._token_key(name), self._floor_key]
            return bool(self._hand_over(keys=keys, args=args, client=self.backend.client))

    @property
    def _hand_over_channel(self) -> str:
        return self.backend.key(HAND_OVER_CHANNEL)

    def hand_over_waker(self, node_id: str) -> Waker | None:
        from ..tasks.wakeups.redis import RedisWaker

        return RedisWaker(self.backend, [node_id], channel=HAND_OVER_CHANNEL)

    def set_zone(
        self, name: str, node: Node, token: int, zone: str | None, triggers: Mapping[str, str] | None = None
    ) -> bool:
        with self.backend.errors("set_zone"):
            args: list[str | int] = [node.node_id, token, zone or "", dump_triggers(triggers) or ""]
            return bool(self._set_zone(keys=[self._lock_key(name)], args=args, client=self.backend.client))

    def read(self, name: str) -> LockRecord | None:
        return self.read_many([name]).get(name)

    def read_many(self, names: Iterable[str]) -> dict[str, LockRecord]:
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        with self.backend.errors("read"):
            client = self.backend.client
            if isinstance(client, RedisCluster):
                rows, now = self._read_cluster(client, wanted)
            else:
                pipe = client.pipeline(transaction=False)
                for name in wanted:
                    pipe.hgetall(self._lock_key(name))
                pipe.time()
                *rows, time_reply = pipe.execute()
                now = now_ms(time_reply)
        return {name: self._record(name, row, now) for name, row in zip(wanted, rows, strict=True) if row}

    def _read_cluster(self, client: RedisCluster, names: Sequence[str]) -> tuple[list[dict[str, str]], int]:
        """(fields of each lock, the owning primary's clock in ms): one script, see READ_LUA."""
        now, rows = json.loads(self._read(keys=[self._lock_key(n) for n in names], client=client))
        # cjson encodes an empty table (a missing hash) as {}, a filled one as a flat list.
        return [self._pairs(row) if isinstance(row, list) else {} for row in rows], int(now)

    def list(self) -> list[LockRecord]:
        with self.backend.errors("list"):
            names: set[str] = self.backend.client.smembers(self._names_key)  # type: ignore[assignment]
        records = self.read_many(sorted(names))
        return [records[n] for n in sorted(records)]

    def ping(self) -> None:
        self.backend.ping()

    def close(self) -> None:
        self.backend.close()


def _entries(text: str) -> list[Any]:
    """A history field: history lines (or earlier entry objects), one per line; in the earlier form
    a JSON array of entry texts (``["{...}", ...]``, which cjson wrote as ``{}`` when empty)."""
    if text.startswith(('["', "[]", "{}")):
        texts = json.loads(text)
        return [json.loads(entry) for entry in texts] if isinstance(texts, list) else []
    return [json.loads(line) for line in text.split("\n") if line]
