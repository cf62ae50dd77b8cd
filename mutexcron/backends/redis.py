"""``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` and ``redis+cluster://``: the Redis backend.

One client per backend: a plain client, a client of the master a Sentinel names, or redis-py's
``RedisCluster`` (built on first use: it connects in its constructor). Every key of a namespace
(``?namespace=``, default ``default``) starts with ``mutexcron:{<namespace>}:``; the hash tag
``{<namespace>}`` puts them all in one slot, so every script touches one slot and, on Redis
Cluster, runs on the one primary that owns the namespace. The store's clock is the server's
``TIME``, read inside each script (:data:`LUA_NOW`).

Timeouts fail closed and fast: one immediate retry on a dropped connection (a pooled socket to a
restarted server), never on a timeout (a hung server), so no call outlasts ~``socket_timeout``.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.cluster import REDIS_ALLOWED_KEYS, ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, to_bool
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..errors import ConfigurationError
from ..urls import mask_url, pop_query, url_scheme
from . import family
from .base import Backend

log = logging.getLogger(__name__)

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
_OWN_OPTIONS = ("namespace", "socket_timeout", "socket_connect_timeout", "history")  # history: the lock store's
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

#: The store's clock, for the top of every script: the server's ``TIME`` in ms as ``now``
#: (TIME is safe to replicate on Redis >= 5).
LUA_NOW = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"


def now_ms(time_reply: Sequence[int]) -> int:
    """The server clock in ms from a ``TIME`` reply (seconds, microseconds), as :data:`LUA_NOW` computes it."""
    return int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000


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


class RedisBackend(Backend):
    """A Redis client and the key namespace of one URL.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``, ``redis+cluster://`` or
            ``rediss+cluster://`` (see ``URL_FORMS``).
        **options: ``namespace``, ``socket_timeout``, ``socket_connect_timeout`` (the URL query wins
            over these), ``sentinel_kwargs`` (connection options for the sentinels themselves, e.g.
            their password), and any other redis-py connection keyword.
    """

    kind = "Redis"
    driver_errors = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url)
        scheme = url_scheme(url)
        schemes = family("redis").schemes
        if scheme not in schemes:
            _config_error(url, f"scheme {scheme or '(none)'!r} is not one of {', '.join(schemes)}")
        rest, found = pop_query(url, *_OWN_OPTIONS)
        namespace = found.get("namespace", options.pop("namespace", DEFAULT_NAMESPACE))
        if not namespace or any(c in namespace for c in "{}"):
            _config_error(url, f"namespace {namespace!r} must be non-empty and must not contain '{{' or '}}'")
        self.namespace: str = namespace
        #: Every key of the namespace starts with this; ``{namespace}`` is the hash tag (one slot).
        self.prefix = f"mutexcron:{{{namespace}}}:"
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
        conn: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": connect_timeout,
            "health_check_interval": DEFAULT_HEALTH_CHECK_INTERVAL,
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            "retry_on_timeout": False,
            "decode_responses": True,
            **options,
        }
        self.sentinel: Sentinel | None = None
        self.service_name: str | None = None
        #: The client, once built (a cluster client is built on first use of :attr:`client`).
        self.redis: redis.Redis | RedisCluster | None = None
        #: What builds the cluster client (``redis+cluster://`` only).
        self.make_cluster: functools.partial[_FailFastCluster] | None = None
        self._connect_mutex = threading.Lock()
        if scheme == "redis+sentinel":
            self.redis = self._sentinel_client(url, rest, conn, sentinel_kwargs)
        elif scheme in CLUSTER_SCHEMES:
            self.make_cluster = self._cluster_factory(url, rest, conn)
        else:
            self.redis = self._plain_client(url, rest, conn)
        log.debug("Redis backend %s (namespace %r, timeout %ss)", self.masked_url, namespace, timeout)

    # -- clients -----------------------------------------------------------------------------
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
            _config_error(url, self.redact(_explain(exc)))
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
        self.sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_conn, **conn)  # type: ignore[no-untyped-call]
        self.service_name = service
        client: redis.Redis = self.sentinel.master_for(service)  # type: ignore[no-untyped-call]
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
            _config_error(url, self.redact(_explain(exc)))
        return conn

    @property
    def client(self) -> redis.Redis | RedisCluster:
        """The client; a cluster client is built (and connects) on first use, so use it inside :meth:`errors`."""
        if self.redis is None:
            with self._connect_mutex:
                if self.redis is None:
                    assert self.make_cluster is not None
                    self.redis = self.make_cluster()
        return self.redis

    def script(self, lua: str) -> Script:
        """Register a Lua script; call it with ``client=`` the live :attr:`client` (or a pipeline).

        A script needs a client only for its encoder (its SHA; the scripts are ASCII), so a cluster
        backend can register scripts before it connects.
        """
        registrar = self.redis if self.redis is not None else redis.Redis(decode_responses=True)
        return registrar.register_script(lua)

    def key(self, suffix: str) -> str:
        """The key ``suffix`` in this namespace."""
        return self.prefix + suffix

    # -- errors ------------------------------------------------------------------------------
    def is_unavailable(self, exc: BaseException) -> bool:
        return isinstance(exc, _UNAVAILABLE)

    # -- life cycle --------------------------------------------------------------------------
    def ping(self) -> None:
        with self.errors("ping"):
            client = self.client
            if isinstance(client, RedisCluster):  # the primary that owns this namespace, not every node
                client.ping(target_nodes=client.get_node_from_key(self.prefix))  # type: ignore[no-untyped-call]
            else:
                client.ping()

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        if self.sentinel is not None:
            for sentinel in self.sentinel.sentinels:
                sentinel.close()

    def destroy_namespace(self) -> int:
        """Delete every key of this namespace. For tests only.

        Returns:
            The number of keys deleted.
        """
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "*"
        deleted = 0
        with self.errors("destroy_namespace"):
            batch: list[str] = []
            for key in self.client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += int(self.client.unlink(*batch))
                    batch.clear()
            if batch:
                deleted += int(self.client.unlink(*batch))
        return deleted
