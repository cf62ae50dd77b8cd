"""APScheduler's ``RedisJobStore``, shared.

Same keys (the ``apscheduler.jobs`` hash of pickled states, the ``apscheduler.run_times`` sorted
set). Every write is one Lua script: the add only if the id is free (``HSETNX``), a change or a
removal only if the stored state is the one read, each with its run time, and a ``PUBLISH`` of
``jobs`` on :func:`channel_of` (``<jobs_key>.changes``) when it changes a job (the loop's advance
of a next run time publishes nothing). Each node's watcher subscribes to that channel.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import redis
from apscheduler.jobstores.redis import RedisJobStore

from ..urls import redact
from .base import SharedJobStore

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

CODE = "jobs"

_INSERT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[3] ~= '' then redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1]) end
redis.call('PUBLISH', ARGV[4], 'jobs')
return 1
"""

_REPLACE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1]) else redis.call('ZREM', KEYS[2], ARGV[1]) end
if ARGV[5] ~= '' then redis.call('PUBLISH', ARGV[5], 'jobs') end
return 1
"""

_DELETE = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return 0 end
if ARGV[3] == '1' and current ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[4], 'jobs')
return 1
"""

_DELETE_ALL = """
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('PUBLISH', ARGV[1], 'jobs')
return 1
"""


def channel_of(jobs_key: str) -> str:
    return f"{jobs_key}.changes"


def _score(ts: float | None) -> str:
    return "" if ts is None else repr(ts)


class SharedRedisJobStore(SharedJobStore, RedisJobStore):  # type: ignore[misc]
    """A ``RedisJobStore`` every node shares (made from yours by ``MutexScheduler.start()``)."""

    redis: Any
    jobs_key: str
    run_times_key: str

    @property
    def where(self) -> str:
        kw = self.redis.connection_pool.connection_kwargs
        at = kw.get("path") or f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
        return f"Redis job store {self.jobs_key} on {at}/{kw.get('db', 0)}"

    @property
    def channel(self) -> str:
        return channel_of(self.jobs_key)

    def _keys(self) -> list[str]:
        return [self.jobs_key, self.run_times_key]

    def _script(self, source: str) -> Any:
        cache = self.__dict__.setdefault("_mc_scripts", {})
        if source not in cache:
            cache[source] = self.redis.register_script(source)
        return cache[source]

    # -- reads ---------------------------------------------------------------------------------
    def _read_states(self, ids: Collection[str] | None = None) -> dict[str, bytes]:
        if ids is None:
            found = self.redis.hgetall(self.jobs_key)
            return {_text(k): bytes(v) for k, v in found.items()}
        wanted = sorted(ids)
        if not wanted:
            return {}
        values = self.redis.hmget(self.jobs_key, wanted)
        return {job_id: bytes(v) for job_id, v in zip(wanted, values, strict=True) if v is not None}

    def _read_due(self, ts: float, ids: Collection[str]) -> list[tuple[str, bytes]]:
        due = [_text(k) for k in self.redis.zrangebyscore(self.run_times_key, "-inf", ts)]
        wanted = [job_id for job_id in due if job_id in ids]
        if not wanted:
            return []
        values = self.redis.hmget(self.jobs_key, wanted)
        return [(job_id, bytes(v)) for job_id, v in zip(wanted, values, strict=True) if v is not None]

    def _earliest(self, ids: Collection[str]) -> float | None:
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.zscore(self.run_times_key, job_id)
            scores = pipe.execute()
        return min((float(s) for s in scores if s is not None), default=None)

    # -- writes --------------------------------------------------------------------------------
    def _insert(self, job_id: str, ts: float | None, state: bytes) -> bool:
        return bool(self._script(_INSERT)(keys=self._keys(), args=[job_id, state, _score(ts), self.channel]))

    def _replace(self, job_id: str, base: bytes, ts: float | None, state: bytes, announce: bool) -> bool:
        args = [job_id, base, state, _score(ts), self.channel if announce else ""]
        return bool(self._script(_REPLACE)(keys=self._keys(), args=args))

    def _delete(self, job_id: str, base: bytes | None) -> bool:
        args = [job_id, base or b"", "0" if base is None else "1", self.channel]
        return bool(self._script(_DELETE)(keys=self._keys(), args=args))

    def _delete_all(self) -> None:
        self._script(_DELETE_ALL)(keys=self._keys(), args=[self.channel])

    # -- the watcher's waker ---------------------------------------------------------------------
    def waker(self) -> Waker:
        from ..tasks.wakeups.redis import RedisWaker

        class _Subscribed(RedisWaker):
            about = "job store changes"

        return _Subscribed(_RedisSide(self), [CODE])


class _RedisSide:
    """The job store's server, as the Redis waker wants a store: a client that decodes replies."""

    def __init__(self, store: SharedRedisJobStore) -> None:
        pool = store.redis.connection_pool
        kwargs = {**pool.connection_kwargs, "decode_responses": True}
        self.client = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))
        self.socket_timeout = float(kwargs.get("socket_timeout") or 5.0)
        self.masked_url = store.where
        self._channel = store.channel
        password, user = str(kwargs.get("password") or ""), str(kwargs.get("username") or "")
        #: The store's credentials as a URL, for the one masking rule (:func:`mutexcron.urls.redact`).
        self._url = f"redis://{quote(user, safe='')}:{quote(password, safe='')}@redis" if password else None

    def key(self, suffix: str) -> str:
        return self._channel

    def detail(self, exc: BaseException) -> str:
        first = (str(exc).strip().splitlines() or [""])[0]
        return redact(f"{type(exc).__name__}: {first}", self._url)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

