"""``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` and ``redis+cluster://``: the Redis lock store.

Every lock is one hash that never expires, ``mutexcron:{<namespace>}:lock:<name>``, beside a
token counter ``mutexcron:{<namespace>}:token:<name>`` (INCR only, never expires, so a deleted
hash cannot reset the fencing tokens) and the names set ``mutexcron:{<namespace>}:names``.
All keys of a namespace share the hash tag ``{<namespace>}``, so every script touches one slot
and, on Redis Cluster (``redis+cluster://``, redis-py's ``RedisCluster``), runs on the one primary
that owns the namespace. Each write is one Lua script judged by the server's ``TIME``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, NoReturn, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.cluster import REDIS_ALLOWED_KEYS, ClusterNode, RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, to_bool
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..errors import ConfigurationError, StoreError, StoreUnavailableError
from ..record import LockRecord, dump_attrs, load_attrs
from ..urls import mask_url, pop_query, redact, url_scheme
from .base import AcquireResult, FireClaim, LockStore, Node, RunInfo, claim_won, fire_times_from_json

logger = logging.getLogger(__name__)

__all__ = ["RedisLockStore"]

URL_FORMS = (
    "redis://[user:password@]host[:port][/db], "
    "rediss://[user:password@]host[:port][/db][?ssl_cert_reqs=required|optional|none&ssl_ca_certs=/path/ca.pem], "
    "unix:///path/to/redis.sock[?db=N], "
    "redis+sentinel://[user:password@]host1:26379[,host2:26379...]/service_name[/db], "
    "redis+cluster://[user:password@]host1:6379[,host2:6379...][/] (Redis Cluster; rediss+cluster:// for TLS); "
    "mutexcron options: ?namespace=NAME&socket_timeout=SECONDS"
)
DEFAULT_NAMESPACE = "default"
DEFAULT_SOCKET_TIMEOUT = 5.0
DEFAULT_HEALTH_CHECK_INTERVAL = 30
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_CLUSTER_PORT = 6379
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_OWN_OPTIONS = ("namespace", "socket_timeout", "socket_connect_timeout")
# What the server is doing when it answers like this: it is down, restarting or demoted.
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    # Redis Cluster: no reachable node, the slot uncovered or in failover (CLUSTERDOWN), resharding
    # (TRYAGAIN), too many redirections. RedisClusterException is not a RedisError.
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
)

# Shared by every script: the server clock in ms (TIME is safe to replicate on Redis >= 5).
_NOW = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# acquire_or_renew: take the lock if it is free, released, ours or stale by the *holder's* stored
# ttl (new token on every change of holder), claim a fire time if asked; return the whole record.
# KEYS: hash, token counter, names set. ARGV: node_id, ip, ttl_ms, token floor, name[, job, fire_us, nonce].
ACQUIRE_LUA = (
    _NOW
    + """
local h = redis.call('HMGET', KEYS[1], 'holder', 'hb', 'ttl', 'token')
local holder, hb, ttl, token = h[1], tonumber(h[2]), tonumber(h[3]), tonumber(h[4]) or 0
local floor = tonumber(ARGV[4]) or 0
local acquired = 0
if holder == ARGV[1] then
  acquired = 1
  redis.call('HSET', KEYS[1], 'hb', string.format('%d', now), 'ttl', ARGV[3], 'active_ip', ARGV[2])
elseif (not holder) or holder == '' or (not hb) or now - hb > (ttl or 0) then
  acquired = 1
  -- Never issue a token at or below one already issued: the counter's, the hash's own, or the
  -- client's floor (the highest token that client process saw: it survives a server restart).
  local counter = tonumber(redis.call('GET', KEYS[2])) or 0
  local base = math.max(counter, token, floor)
  if base > counter then redis.call('SET', KEYS[2], string.format('%d', base)) end
  token = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'active_ip', ARGV[2], 'hb', string.format('%d', now),
             'ttl', ARGV[3], 'token', string.format('%d', token))
  redis.call('SADD', KEYS[3], ARGV[5])
elseif floor > token then
  -- Refused, but this client saw a higher token (the data was lost): lift the counter so the
  -- next holder, whoever it is, still gets a token above it.
  local counter = tonumber(redis.call('GET', KEYS[2])) or 0
  if floor > counter then redis.call('SET', KEYS[2], string.format('%d', floor)) end
end
if acquired == 1 then
  if ARGV[6] then
    local raw = redis.call('HGET', KEYS[1], 'fires')
    local ok, fires = pcall(cjson.decode, raw or '{}')
    if not ok or type(fires) ~= 'table' then fires = {} end
    local cur = fires[ARGV[6]]
    local fire_us = tonumber(ARGV[7])
    if type(cur) ~= 'table' or (tonumber(cur[1]) or 0) < fire_us then
      fires[ARGV[6]] = {fire_us, ARGV[8]}
      -- Encoded by hand: cjson prints numbers with 14 digits, epoch microseconds need 16.
      local parts = {}
      for job, v in pairs(fires) do
        if type(v) == 'table' then
          parts[#parts + 1] = cjson.encode(tostring(job)) .. ':[' .. string.format('%d', tonumber(v[1]) or 0)
                              .. ',' .. cjson.encode(tostring(v[2])) .. ']'
        end
      end
      redis.call('HSET', KEYS[1], 'fires', '{' .. table.concat(parts, ',') .. '}')
    end
  end
end
-- One JSON string: the client parses it in C instead of a nested reply field by field.
return cjson.encode({acquired, string.format('%d', now), redis.call('HGETALL', KEYS[1])})
"""
)

# heartbeat: refresh the lease if ARGV[1] still holds it with token ARGV[2]; optionally store
# attrs (ARGV[3]=='1', text ARGV[4]) and the last run (ARGV[5]=='1', duration_ms ARGV[6], error ARGV[7..8]).
HEARTBEAT_LUA = (
    _NOW
    + """
local h = redis.call('HMGET', KEYS[1], 'holder', 'token')
if h[1] ~= ARGV[1] or tonumber(h[2]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'hb', string.format('%d', now))
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'attrs', ARGV[4]) end
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'last_run_finished', string.format('%d', now),
             'last_run_started', string.format('%d', now - tonumber(ARGV[6])))
  if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'last_error', ARGV[8])
  else redis.call('HDEL', KEYS[1], 'last_error') end
end
return 1
"""
)

# renew_many: refresh every lease KEYS[i] that ARGV[1] holds with token ARGV[i+1]; return those i.
RENEW_MANY_LUA = (
    _NOW
    + """
local stamp = string.format('%d', now)
local out = {}
for i, key in ipairs(KEYS) do
  local h = redis.call('HMGET', key, 'holder', 'token')
  if h[1] == ARGV[1] and tonumber(h[2]) == tonumber(ARGV[i + 1]) then
    redis.call('HSET', key, 'hb', stamp)
    out[#out + 1] = i
  end
end
return out
"""
)

# release: free the lock if ARGV[1] holds it with token ARGV[2]; keep token, attrs, fires, active_ip.
RELEASE_LUA = """
local h = redis.call('HMGET', KEYS[1], 'holder', 'token')
if h[1] ~= ARGV[1] or tonumber(h[2]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[1], 'holder')
return 1
"""

# read_many on Redis Cluster: every hash KEYS[i] and the clock of the primary that wrote their
# heartbeats, in one round trip. (A cluster pipeline would ask TIME of another node, and on a hung
# node it re-sends each queued command alone, each waiting out the socket timeout.)
READ_LUA = (
    _NOW
    + """
local rows = {}
for i, key in ipairs(KEYS) do rows[i] = redis.call('HGETALL', key) end
return cjson.encode({string.format('%d', now), rows})
"""
)


def _config_error(url: str, why: str) -> NoReturn:
    raise ConfigurationError(f"bad Redis lock URL {mask_url(url)!r}: {why}. Accepted forms: {URL_FORMS}")


def _positive_float(url: str, key: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        _config_error(url, f"{key}={value!r} is not a number of seconds")
    if not math.isfinite(number) or number <= 0:
        _config_error(url, f"{key}={value!r} must be a positive number of seconds")
    return number


def _explain(exc: Exception) -> str:
    """A redis-py option error in the user's terms."""
    unknown = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
    if unknown:
        return f"unknown option {unknown[1]!r} for this scheme (ssl_* options need rediss://)"
    return str(exc)


def _ms_to_datetime(value: str | None) -> datetime | None:
    if value is None or value == "":
        return None
    return datetime.fromtimestamp(int(value) / 1000, tz=timezone.utc)


def _parse_hosts(
    url: str, netloc: str, role: str = "sentinel", default_port: int = DEFAULT_SENTINEL_PORT
) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    """(user, password, [(host, port)...]) of ``user:password@host1:port1,host2:port2``."""
    userinfo, _, hostlist = netloc.rpartition("@")
    username: str | None = None
    password: str | None = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):  # [ipv6]:port
            host, _, tail = item[1:].partition("]")
            port_text = tail.lstrip(":")
        else:
            host, _, port_text = item.partition(":")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            _config_error(url, f"{role} address {item!r} has a bad port")
        if not host or not 0 < port < 65536:
            _config_error(url, f"{role} address {item!r} is not host:port")
        hosts.append((host, port))
    if not hosts:
        _config_error(url, f"{url_scheme(url)}:// needs at least one {role} host:port")
    return username, password, hosts


def _query_options(url: str, query: str, conn: dict[str, Any]) -> None:
    """Parse the redis-py options of a hand-split URL's query into ``conn``, typed as redis-py does."""
    for key, value in parse_qsl(query, keep_blank_values=True):
        parser = cast("Callable[[str], Any] | None", URL_QUERY_ARGUMENT_PARSERS.get(key))
        if key == "ssl":
            parser = to_bool
        try:
            conn[key] = parser(value) if parser else value
        except (TypeError, ValueError):
            _config_error(url, f"invalid value for {key!r}")


class _FailFastCluster(RedisCluster):
    """RedisCluster that retries (after refreshing the slot map) a dropped connection or a failover, never a timeout.

    RedisCluster retries on its own ``ERRORS_ALLOW_RETRY``, which includes timeouts: a hung primary
    would then hold every call for several socket timeouts. Same policy as the plain client.
    """

    ERRORS_ALLOW_RETRY = (  # type: ignore[assignment]
        redis.exceptions.ConnectionError,
        redis.exceptions.ClusterDownError,
        redis.exceptions.SlotNotCoveredError,
    )


class RedisLockStore(LockStore):
    """Leased, fenced locks in Redis: one Lua script per operation, judged by the server's clock.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``, ``redis+cluster://`` or
            ``rediss+cluster://`` (see ``URL_FORMS``).
        **options: ``namespace``, ``socket_timeout``, ``socket_connect_timeout`` (the URL query wins
            over these), ``sentinel_kwargs`` (connection options for the sentinels themselves, e.g.
            their password), and any other redis-py connection keyword.
    """

    schemes = ("redis", "rediss", "unix", "redis+sentinel", *CLUSTER_SCHEMES)

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url)
        scheme = url_scheme(url)
        if scheme not in self.schemes:
            _config_error(url, f"scheme {scheme or '(none)'!r} is not one of {', '.join(self.schemes)}")
        rest, found = pop_query(url, *_OWN_OPTIONS)
        namespace = found.get("namespace", options.pop("namespace", DEFAULT_NAMESPACE))
        if not namespace or any(c in namespace for c in "{}"):
            _config_error(url, f"namespace {namespace!r} must be non-empty and must not contain '{{' or '}}'")
        self.namespace: str = namespace
        self._prefix = f"mutexcron:{{{namespace}}}:"
        timeout = _positive_float(
            url, "socket_timeout", found.get("socket_timeout", options.pop("socket_timeout", DEFAULT_SOCKET_TIMEOUT))
        )
        connect_timeout = _positive_float(
            url,
            "socket_connect_timeout",
            found.get("socket_connect_timeout", options.pop("socket_connect_timeout", timeout)),
        )
        self.socket_timeout = timeout
        sentinel_kwargs: dict[str, Any] = dict(options.pop("sentinel_kwargs", None) or {})
        # Fail closed and fast: one immediate retry on a dropped connection (a pooled socket to a
        # restarted server), never on a timeout (a hung server), so no call outlasts ~socket_timeout.
        conn: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": connect_timeout,
            "health_check_interval": DEFAULT_HEALTH_CHECK_INTERVAL,
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            "retry_on_timeout": False,
            "decode_responses": True,
            **options,
        }
        self._sentinel: Sentinel | None = None
        self._redis: redis.Redis | RedisCluster | None = None  # None: the cluster client is not built yet
        self._make_cluster: functools.partial[_FailFastCluster] | None = None
        self._connect_mutex = threading.Lock()
        if scheme == "redis+sentinel":
            self._redis = self._sentinel_client(url, rest, conn, sentinel_kwargs)
        elif scheme in CLUSTER_SCHEMES:
            self._make_cluster = self._cluster_factory(url, rest, conn)
        else:
            self._redis = self._plain_client(url, rest, conn)
        # A script needs a client only for its encoder (its SHA; the scripts are ASCII); every call
        # passes the live client, so a cluster store can register them before it connects.
        registrar = self._redis if self._redis is not None else redis.Redis(decode_responses=True)
        self._acquire = registrar.register_script(ACQUIRE_LUA)
        self._heartbeat = registrar.register_script(HEARTBEAT_LUA)
        self._renew_many = registrar.register_script(RENEW_MANY_LUA)
        self._release = registrar.register_script(RELEASE_LUA)
        self._read = registrar.register_script(READ_LUA)
        self._floor: dict[str, int] = {}
        self._floor_mutex = threading.Lock()
        logger.debug("Redis lock store %s (namespace %r, timeout %ss)", self.masked_url, namespace, timeout)

    # -- connection --------------------------------------------------------------------------
    def _plain_client(self, url: str, rest: str, conn: dict[str, Any]) -> redis.Redis:
        parts = urlsplit(rest)
        if parts.scheme.lower() == "unix":
            if not parts.path or parts.path == "/":
                _config_error(url, "unix:// needs the socket path, e.g. unix:///run/redis/redis.sock")
        else:
            try:
                parts.port  # noqa: B018 - validates the port
            except ValueError:
                _config_error(url, "the port is not a number")
            db = parts.path.strip("/")
            if db and not db.isdigit():
                _config_error(url, f"the path {parts.path!r} must be a database number like /0")
        try:
            client = redis.Redis.from_url(rest, **conn)
            pool = client.connection_pool
            pool.connection_class(**pool.connection_kwargs)  # unknown query options fail here, not later
        except (ValueError, TypeError) as exc:
            _config_error(url, self._scrub(_explain(exc)))
        return client

    def _sentinel_client(
        self, url: str, rest: str, conn: dict[str, Any], sentinel_kwargs: dict[str, Any]
    ) -> redis.Redis:
        # Split by hand: urllib refuses a host list with a bracketed IPv6 sentinel in it.
        body, _, query = rest.partition("://")[2].partition("?")
        netloc, _, path = body.partition("/")
        username, password, hosts = _parse_hosts(url, netloc)
        segments = [unquote(s) for s in path.split("/") if s]
        if not segments or len(segments) > 2:
            _config_error(url, "redis+sentinel:// needs /service_name or /service_name/db after the hosts")
        service = segments[0]
        if len(segments) == 2:
            if not segments[1].isdigit():
                _config_error(url, f"the database {segments[1]!r} must be a number")
            conn["db"] = int(segments[1])
        _query_options(url, query, conn)
        if username:
            conn["username"] = username
        if password is not None:
            conn["password"] = password
        sentinel_conn: dict[str, Any] = {
            "socket_timeout": conn["socket_timeout"],
            "socket_connect_timeout": conn["socket_connect_timeout"],
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": True,
            **sentinel_kwargs,
        }
        self._sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_conn, **conn)  # type: ignore[no-untyped-call]
        self.service_name = service
        client: redis.Redis = self._sentinel.master_for(service)  # type: ignore[no-untyped-call]
        pool = client.connection_pool
        try:
            pool.connection_class(**pool.connection_kwargs)  # unknown query options fail here, not later
        except TypeError as exc:
            _config_error(url, _explain(exc))
        return client

    def _cluster_factory(self, url: str, rest: str, conn: dict[str, Any]) -> functools.partial[_FailFastCluster]:
        """Check a ``redis+cluster://`` URL now; return what builds the client on first use.

        RedisCluster connects in its constructor (slot map, COMMAND): built here, a cluster that is
        down at start-up would make the store fail to build instead of being unavailable for a while.
        """
        # Split by hand, as for sentinels: urllib refuses a host list with a bracketed IPv6 host.
        body, _, query = rest.partition("://")[2].partition("?")
        netloc, _, path = body.partition("/")
        username, password, hosts = _parse_hosts(url, netloc, "cluster node", DEFAULT_CLUSTER_PORT)
        if path.strip("/") not in ("", "0"):
            _config_error(url, f"the path {'/' + path!r}: Redis Cluster has database 0 only")
        _query_options(url, query, conn)
        conn.update(ssl=url_scheme(url) == "rediss+cluster", username=username, password=password)
        conn = self._cluster_options(url, conn)
        nodes = [ClusterNode(host, port) for host, port in hosts]  # type: ignore[no-untyped-call]
        retry = Retry(NoBackoff(), 1)
        # require_full_coverage=False: a namespace lives in one slot; another shard being down is the
        # server's business (it answers CLUSTERDOWN if it must), not a reason to refuse to start.
        return functools.partial(_FailFastCluster, startup_nodes=nodes, retry=retry, require_full_coverage=False, **conn)

    def _cluster_options(self, url: str, conn: dict[str, Any]) -> dict[str, Any]:
        """The node connection options RedisCluster accepts, checked now (it would drop unknown ones silently)."""
        if not conn["ssl"] and any(key.startswith("ssl_") for key in conn):
            _config_error(url, "ssl_* options need rediss+cluster://")
        if conn.pop("db", 0) != 0:
            _config_error(url, "Redis Cluster has database 0 only")
        # The plain client's retry policy is the cluster client's own here (see _FailFastCluster),
        # which makes its nodes' connections never retry; health checks are not a RedisCluster option.
        conn = {k: v for k, v in conn.items() if k not in ("retry", "retry_on_timeout", "health_check_interval")}
        unknown = sorted(set(conn) - set(REDIS_ALLOWED_KEYS))
        if unknown:
            _config_error(url, f"unknown option {unknown[0]!r} for Redis Cluster")
        try:  # a node's connection, built as RedisCluster builds them: bad option values fail here
            pool = redis.Redis(**conn).connection_pool
            pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError, redis.exceptions.RedisError) as exc:
            _config_error(url, self._scrub(_explain(exc)))
        return conn

    @property
    def _client(self) -> redis.Redis | RedisCluster:
        """The client; a cluster client is built (and connects) on first use, inside ``_errors``."""
        if self._redis is None:
            with self._connect_mutex:
                if self._redis is None:
                    assert self._make_cluster is not None
                    self._redis = self._make_cluster()
        return self._redis

    def _scrub(self, text: str) -> str:
        """Remove the URL's secrets from a driver message (belt and braces: redis-py omits them)."""
        return redact(text, self.url)

    @contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        try:
            yield
        except _UNAVAILABLE as exc:
            reason = self._scrub(f"{type(exc).__name__}: {exc}")
            raise StoreUnavailableError(
                f"Redis lock store {self.masked_url} unavailable during {operation}: {reason}"
            ) from exc
        except redis.exceptions.RedisError as exc:
            reason = self._scrub(f"{type(exc).__name__}: {exc}")
            raise StoreError(f"Redis lock store {self.masked_url} failed during {operation}: {reason}") from exc

    # -- keys and records --------------------------------------------------------------------
    def _lock_key(self, name: str) -> str:
        return f"{self._prefix}lock:{name}"

    def _token_key(self, name: str) -> str:
        return f"{self._prefix}token:{name}"

    @property
    def _names_key(self) -> str:
        return f"{self._prefix}names"

    def _seen(self, name: str, token: int) -> None:
        with self._floor_mutex:
            if token > self._floor.get(name, 0):
                self._floor[name] = token

    def token_floor(self, name: str) -> int:
        """The highest token this store object has seen for ``name`` (0 if none)."""
        with self._floor_mutex:
            return self._floor.get(name, 0)

    def _record(
        self, name: str, fields: Mapping[str, str], now_ms: int, fires: Mapping[str, Any] | None = None
    ) -> LockRecord:
        hb = fields.get("hb")
        token = int(fields.get("token") or 0)
        self._seen(name, token)
        return LockRecord(
            name=name,
            holder=fields.get("holder") or None,
            active_ip=fields.get("active_ip") or None,
            token=token,
            update_time=_ms_to_datetime(hb),
            heartbeat_age=None if not hb else max(0.0, (now_ms - int(hb)) / 1000),
            ttl=int(fields.get("ttl") or 0) / 1000,
            fire_times=fire_times_from_json(self._fires(fields) if fires is None else fires),
            last_run_started=_ms_to_datetime(fields.get("last_run_started")),
            last_run_finished=_ms_to_datetime(fields.get("last_run_finished")),
            last_error=fields.get("last_error"),
            attrs=load_attrs(fields.get("attrs")),
        )

    @staticmethod
    def _fires(fields: Mapping[str, str]) -> dict[str, Any]:
        value = json.loads(fields.get("fires") or "{}")
        return value if isinstance(value, dict) else {}

    @staticmethod
    def _pairs(flat: Sequence[str]) -> dict[str, str]:
        return dict(zip(flat[::2], flat[1::2], strict=True))

    @staticmethod
    def _now_ms(time_reply: Sequence[int]) -> int:
        return int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000

    # -- LockStore ---------------------------------------------------------------------------
    def acquire_or_renew(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None = None
    ) -> AcquireResult:
        ttl_ms = max(1, round(ttl * 1000))
        args: list[str | int] = [node.node_id, node.ip, ttl_ms, self.token_floor(name), name]
        if claim is not None:
            args += [claim.job, claim.fire_us, claim.nonce]
        with self._errors("acquire_or_renew"):
            keys = [self._lock_key(name), self._token_key(name), self._names_key]
            reply = self._acquire(keys=keys, args=args, client=self._client)
        acquired, now_ms, flat = json.loads(reply)
        fields = self._pairs(flat) if isinstance(flat, list) else {}
        fires = self._fires(fields)
        record = self._record(name, fields, int(now_ms), fires)
        return AcquireResult(bool(acquired), record, bool(acquired) and claim_won(fires, claim))

    def heartbeat(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        text = dump_attrs(attrs, job=name) if attrs is not None else None  # raises before any write
        args: list[str | int] = [node.node_id, token, "0" if text is None else "1", text or ""]
        if run is None:
            args += ["0", 0, "0", ""]
        else:
            args += ["1", max(0, round(run.duration * 1000)), "0" if run.error is None else "1", run.error or ""]
        with self._errors("heartbeat"):
            return bool(self._heartbeat(keys=[self._lock_key(name)], args=args, client=self._client))

    def renew_many(self, node: Node, leases: Mapping[str, int]) -> set[str]:
        if not leases:
            return set()
        names = list(leases)
        with self._errors("renew_many"):
            renewed = self._renew_many(
                keys=[self._lock_key(n) for n in names],
                args=[node.node_id, *(leases[n] for n in names)],
                client=self._client,
            )
        return {names[int(i) - 1] for i in renewed}

    def release(self, name: str, node: Node, token: int) -> bool:
        with self._errors("release"):
            return bool(self._release(keys=[self._lock_key(name)], args=[node.node_id, token], client=self._client))

    def read(self, name: str) -> LockRecord | None:
        return self.read_many([name]).get(name)

    def read_many(self, names: Iterable[str]) -> dict[str, LockRecord]:
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        with self._errors("read"):
            client = self._client
            if isinstance(client, RedisCluster):
                rows, now_ms = self._read_cluster(client, wanted)
            else:
                pipe = client.pipeline(transaction=False)
                for name in wanted:
                    pipe.hgetall(self._lock_key(name))
                pipe.time()
                *rows, now = pipe.execute()
                now_ms = self._now_ms(now)
        return {name: self._record(name, row, now_ms) for name, row in zip(wanted, rows, strict=True) if row}

    def _read_cluster(self, client: RedisCluster, names: Sequence[str]) -> tuple[list[dict[str, str]], int]:
        """(fields of each lock, the owning primary's clock in ms): one script, see READ_LUA."""
        now, rows = json.loads(self._read(keys=[self._lock_key(n) for n in names], client=client))
        # cjson encodes an empty table (a missing hash) as {}, a filled one as a flat list.
        return [self._pairs(row) if isinstance(row, list) else {} for row in rows], int(now)

    def list(self) -> list[LockRecord]:
        with self._errors("list"):
            names: set[str] = self._client.smembers(self._names_key)  # type: ignore[assignment]
        records = self.read_many(sorted(names))
        return [records[n] for n in sorted(records)]

    def ping(self) -> None:
        with self._errors("ping"):
            client = self._client
            if isinstance(client, RedisCluster):  # the primary that owns this namespace, not every node
                client.ping(target_nodes=client.get_node_from_key(self._names_key))  # type: ignore[no-untyped-call]
            else:
                client.ping()

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                sentinel.close()

    # -- tests and tools ---------------------------------------------------------------------
    def destroy_namespace(self) -> int:
        """Delete every key of this namespace (locks, token counters, names set). For tests only.

        Returns:
            The number of keys deleted.
        """
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self._prefix) + "*"
        deleted = 0
        with self._errors("destroy_namespace"):
            batch: list[str] = []
            for key in self._client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += int(self._client.unlink(*batch))
                    batch.clear()
            if batch:
                deleted += int(self._client.unlink(*batch))
        return deleted
