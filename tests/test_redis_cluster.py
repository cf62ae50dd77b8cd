"""Redis Cluster (``redis+cluster://``): URLs, MOVED routing, resharding, outages and a failover drill.

A session-scoped fixture starts a real 3-primary cluster (three ``redis-server --cluster-enabled``
processes on free ports, joined by ``redis-cli --cluster create``) and kills it at the end of the
session. The store contract suite runs on it too (``tests/test_contract.py``, backend
``redis-cluster``), which starts the same cluster only when that backend is selected.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from mutexcron.drill import run_drill
from mutexcron.errors import ConfigurationError, StoreError, StoreUnavailableError
from mutexcron.locks import FireClaim, Node, lock_store_from_url
from mutexcron.locks.redis import RedisLockStore
from tests.backends import cleanup_redis
from tests.redis_servers import RedisClusterServers, ask, free_cluster_port, raw_client

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")
PASSWORD = "s3cr3t-hunter2"
UNACTIVE_INTERVAL = 2.0

# Every test on the real cluster is also marked ``cluster``: it runs three redis-server processes.
pytestmark = pytest.mark.redis


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterServers) -> Iterator[str]:
    """A fresh namespace, owned by a node other than the first URL node; destroyed afterwards."""
    url = redis_cluster.namespaced_url(f"cl-{secrets.token_hex(3)}")
    yield url
    cleanup_redis(url)


# -- URLs (no server) ---------------------------------------------------------------------------------
def _cluster_kwargs(store: RedisLockStore) -> dict[str, Any]:
    """What the store will pass to RedisCluster, read without connecting."""
    assert store._make_cluster is not None and store._redis is None, "a cluster store connects on first use"
    kwargs = dict(store._make_cluster.keywords)
    kwargs["nodes"] = [(n.host, n.port) for n in kwargs.pop("startup_nodes")]
    return kwargs


@pytest.mark.parametrize(
    ("url", "nodes"),
    [
        ("redis+cluster://10.0.0.1", [("10.0.0.1", 6379)]),
        ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001/", [("10.0.0.1", 7000), ("10.0.0.2", 7001)]),
        ("redis+cluster://a:7000,[::1]:7001,b/0?namespace=n", [("a", 7000), ("::1", 7001), ("b", 6379)]),
    ],
)
def test_cluster_urls_build_a_store_that_connects_on_first_use(url: str, nodes: list[tuple[str, int]]) -> None:
    store = lock_store_from_url(url)  # nothing listens there: building must not connect
    try:
        assert isinstance(store, RedisLockStore)
        kwargs = _cluster_kwargs(store)
        assert kwargs["nodes"] == nodes
        assert kwargs["socket_timeout"] == 5.0 and kwargs["socket_connect_timeout"] == 5.0
        assert kwargs["ssl"] is False and kwargs["decode_responses"] is True
        assert kwargs["require_full_coverage"] is False
        assert kwargs["retry"].get_retries() == 1, "one retry after a slot-map refresh, as the plain client"
        assert store._lock_key("x") == f"mutexcron:{{{store.namespace}}}:lock:x"
    finally:
        store.close()


def test_cluster_url_options_password_and_tls() -> None:
    url = (
        f"rediss+cluster://alice:{PASSWORD}@h1:7000,h2:7001/?namespace=billing&socket_timeout=1.5"
        "&ssl_cert_reqs=none&ssl_ca_certs=/etc/ssl/ca.pem&client_name=mc"
    )
    store = RedisLockStore(url)
    try:
        kwargs = _cluster_kwargs(store)
        assert (kwargs["username"], kwargs["password"]) == ("alice", PASSWORD)
        assert kwargs["ssl"] is True and kwargs["ssl_cert_reqs"] == "none" and kwargs["ssl_ca_certs"] == "/etc/ssl/ca.pem"
        assert kwargs["socket_timeout"] == 1.5 and kwargs["socket_connect_timeout"] == 1.5
        assert kwargs["client_name"] == "mc" and "namespace" not in kwargs
        assert store.namespace == "billing"
        assert PASSWORD not in store.masked_url and PASSWORD not in repr(store) and ":***@" in store.masked_url
    finally:
        store.close()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+cluster://h1:7000/1", "database 0 only"),
        ("redis+cluster://h1:7000/?db=2", "database 0 only"),
        ("redis+cluster://h1:x", "bad port"),
        ("redis+cluster:///?namespace=n", "at least one cluster node"),
        ("redis+cluster://h1/?ssl_cert_reqs=none", "rediss+cluster://"),
        ("redis+cluster://h1/?no_such_option=1", "no_such_option"),
        ("redis+cluster://h1/?socket_timeout=0", "positive"),
        ("rediss+cluster://h1/?ssl_cert_reqs=sometimes", "sometimes"),
    ],
)
def test_bad_cluster_urls_raise_configuration_error(url: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match="Accepted forms") as info:
        RedisLockStore(url.replace("h1", f"u:{PASSWORD}@h1"))
    assert why in str(info.value) and "redis+cluster://" in str(info.value)
    assert PASSWORD not in str(info.value)


def test_unreachable_cluster_is_unavailable_at_once_and_masks_the_password() -> None:
    ports = [free_cluster_port([]) for _ in range(2)]  # nothing listens on them
    store = RedisLockStore(f"redis+cluster://:{PASSWORD}@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/?socket_timeout=1")
    try:
        for call in (lambda: store.acquire_or_renew("l", A, ttl=10), store.list, store.ping):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="unavailable during") as info:
                call()
            assert time.monotonic() - started < 2.0
            assert PASSWORD not in str(info.value) and ":***@" in str(info.value)
    finally:
        store.close()


# -- on the cluster ------------------------------------------------------------------------------------
@pytest.mark.cluster
def test_keys_of_a_namespace_share_one_slot_and_live_on_its_owner(redis_cluster: RedisClusterServers) -> None:
    namespace = redis_cluster.namespace_off_first_node(f"slot-{secrets.token_hex(3)}")
    store = RedisLockStore(f"{redis_cluster.url}?namespace={namespace}")
    try:
        keys = [store._names_key] + [k for n in ("a", "b/c", "d e") for k in (store._lock_key(n), store._token_key(n))]
        slots = {ask(redis_cluster.ports[0], "CLUSTER KEYSLOT", key) for key in (*keys, store._floor_key)}
        assert len(slots) == 1, "the server hashes every key of a namespace to one slot: each script is single-slot"
        for name in ("a", "b/c", "d e"):  # acquire writes 3 keys, renew_many many: all in one script each
            assert store.acquire_or_renew(name, A, ttl=60, claim=FireClaim.new("job", 1_000_000)).claimed
        assert store.renew_many(A, {"a": 1, "b/c": 1, "d e": 1}) == {"a", "b/c", "d e"}
        with raw_client(redis_cluster.owner(namespace)) as owner:
            assert owner.exists(*keys) == len(keys)
    finally:
        store.destroy_namespace()
        store.close()


@pytest.mark.cluster
def test_plain_client_to_the_first_node_gets_moved_the_cluster_url_follows(redis_cluster: RedisClusterServers) -> None:
    namespace = redis_cluster.namespace_off_first_node(f"moved-{secrets.token_hex(3)}")
    first, owner = redis_cluster.ports[0], redis_cluster.owner(namespace)
    assert owner != first
    cluster = RedisLockStore(f"{redis_cluster.url}?namespace={namespace}")
    plain = RedisLockStore(f"redis://127.0.0.1:{first}/0?namespace={namespace}")
    try:
        with raw_client(first) as raw, pytest.raises(redis.exceptions.MovedError) as moved:  # a ResponseError
            raw.hgetall(cluster._lock_key("l"))
        assert moved.value.port == owner
        with pytest.raises(StoreError, match="MovedError") as info:
            plain.acquire_or_renew("l", A, ttl=60)
        assert not isinstance(info.value, StoreUnavailableError), "a misrouted request is not an outage"
        got = cluster.acquire_or_renew("l", A, ttl=60)
        assert got.acquired and got.token == 1
        assert cluster.hand_off("l", A, 1, {"k": 1}) and cluster.release("l", A, 1)
        assert [(r.name, r.state, dict(r.attrs)) for r in cluster.list()] == [("l", "released", {"k": 1})]
        cluster.ping()
    finally:
        cluster.destroy_namespace()
        cluster.close()
        plain.close()


def _migrate_slot(cluster: RedisClusterServers, namespace: str, target: int) -> None:
    """Move ``namespace``'s slot and its keys to the primary on ``target``, as a resharding does."""
    slot = key_slot(f"mutexcron:{{{namespace}}}:names".encode())
    source = cluster.owner(namespace)
    source_id, target_id = ask(source, "CLUSTER MYID"), ask(target, "CLUSTER MYID")
    ask(target, "CLUSTER SETSLOT", slot, "IMPORTING", source_id)
    ask(source, "CLUSTER SETSLOT", slot, "MIGRATING", target_id)
    keys = ask(source, "CLUSTER GETKEYSINSLOT", slot, 1000)
    ask(source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
    for port in cluster.ports:
        ask(port, "CLUSTER SETSLOT", slot, "NODE", target_id)


@pytest.mark.cluster
def test_a_resharded_namespace_is_followed_through_moved(redis_cluster: RedisClusterServers) -> None:
    """The store's cached slot map goes stale: the next calls get MOVED, follow it and keep the tokens."""
    namespace = redis_cluster.namespace_off_first_node(f"reshard-{secrets.token_hex(3)}")
    url = f"{redis_cluster.url}?namespace={namespace}"
    a, b = RedisLockStore(url), RedisLockStore(url)
    try:
        assert a.acquire_or_renew("l", A, ttl=60).token == 1
        assert a.release("l", A, 1) and a.acquire_or_renew("l", A, ttl=60).token == 2
        b.ping()  # b has its slot map too
        before = redis_cluster.owner(namespace)
        target = next(p for p in redis_cluster.ports if p != before)
        _migrate_slot(redis_cluster, namespace, target)
        assert redis_cluster.owner(namespace) == target
        assert a.hand_off("l", A, 2, {"moved": True}), "the holder's fenced write reaches the new owner"
        assert not b.acquire_or_renew("l", B, ttl=60).acquired, "the lease moved with the slot"
        assert a.release("l", A, 2)
        took = b.acquire_or_renew("l", B, ttl=60)
        assert took.acquired and took.token == 3 and dict(took.record.attrs) == {"moved": True}
        assert b.read("l").holder == B.node_id and [r.name for r in a.list()] == ["l"]  # type: ignore[union-attr]
        with raw_client(target) as raw:
            assert raw.hget(a._lock_key("l"), "token") == "3", "the data lives on the new owner"
    finally:
        a.destroy_namespace()
        a.close()
        b.close()


@contextmanager
def _password_on(cluster: RedisClusterServers, password: str) -> Iterator[None]:
    """``requirepass`` on every primary for the test (the cluster bus does not use it), then off again."""
    for port in cluster.ports:
        ask(port, "CONFIG", "SET", "requirepass", password)
    try:
        yield
    finally:
        for port in cluster.ports:
            with redis.Redis(host="127.0.0.1", port=port, password=password) as client:
                client.execute_command("CONFIG", "SET", "requirepass", "")


@pytest.mark.cluster
def test_password_in_the_url_authenticates_and_never_leaks(
    redis_cluster: RedisClusterServers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, redis-py's too
    namespace = redis_cluster.namespace_off_first_node(f"auth-{secrets.token_hex(3)}")
    hosts = ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports)
    good = RedisLockStore(f"redis+cluster://:{PASSWORD}@{hosts}/?namespace={namespace}")
    wrong = RedisLockStore(f"redis+cluster://default:wrong-{PASSWORD}@{hosts}/?namespace={namespace}")
    anonymous = RedisLockStore(f"redis+cluster://{hosts}/?namespace={namespace}")
    try:
        with _password_on(redis_cluster, PASSWORD):
            assert good.acquire_or_renew("l", A, ttl=60).acquired, "the password authenticates on every node"
            assert [r.name for r in good.list()] == ["l"]
            for store in (wrong, anonymous):
                with pytest.raises(StoreUnavailableError) as info:
                    store.acquire_or_renew("l", B, ttl=60)
                message = str(info.value)
                assert PASSWORD not in message and "unavailable during acquire_or_renew" in message
                logging.getLogger("mutexcron.test").error("store failed: %s", message)
            good.destroy_namespace()
    finally:
        for store in (good, wrong, anonymous):
            store.close()
    assert "default:***@" in caplog.text
    assert PASSWORD not in caplog.text


@contextmanager
def _stopped(cluster: RedisClusterServers, port: int) -> Iterator[None]:
    """SIGSTOP one primary (a hung server: it accepts connections and never answers), SIGCONT after."""
    proc = cluster.procs[cluster.ports.index(port)]
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.cluster
def test_hung_owner_is_unavailable_within_the_socket_timeout_then_recovers(redis_cluster: RedisClusterServers) -> None:
    namespace = redis_cluster.namespace_off_first_node(f"hung-{secrets.token_hex(3)}")
    store = RedisLockStore(f"{redis_cluster.url}?namespace={namespace}&socket_timeout=0.5")
    operations: dict[str, Callable[[], Any]] = {
        "acquire_or_renew": lambda: store.acquire_or_renew("l", A, ttl=60),
        "renew_many": lambda: store.renew_many(A, {"l": 1}),
        "read": lambda: store.read("l"),
        "ping": store.ping,
    }
    try:
        assert store.acquire_or_renew("l", A, ttl=60).token == 1
        # Kept short: the other primaries would mark it failing after cluster-node-timeout (15 s).
        with _stopped(redis_cluster, redis_cluster.owner(namespace)):
            for op, call in operations.items():
                started = time.monotonic()
                with pytest.raises(StoreUnavailableError, match="unavailable during"):
                    call()
                elapsed = time.monotonic() - started
                assert elapsed < 2.0, f"{op} took {elapsed:.1f}s against a hung primary (socket_timeout 0.5s)"
        assert store.acquire_or_renew("l", A, ttl=60).token == 1, "back once the primary answers; same lease"
    finally:
        store.destroy_namespace()
        store.close()


@pytest.mark.cluster
def test_failover_drill_on_redis_cluster(cluster_url: str) -> None:
    """Three ``mutexcron run`` nodes on the cluster URL: SIGKILL, SIGSTOP and SIGTERM of the holder."""
    progress: list[str] = []
    report = run_drill(cluster_url, nodes=3, unactive_interval=UNACTIVE_INTERVAL, duration=20, progress=progress.append)
    summary = json.dumps(report.to_json(), indent=1)
    print("\n[redis-cluster] " + summary)
    assert not report.duplicated, f"fire times run on two nodes: {report.duplicated}\n{summary}"
    assert report.attrs_repeats == 0, f"attrs counter repeated or went back\n{summary}"
    assert report.gaps["kill"] is not None and report.gaps["kill"] <= UNACTIVE_INTERVAL + 1.0, summary
    assert report.gaps["freeze"] is not None and report.gaps["freeze"] <= UNACTIVE_INTERVAL + 1.0, summary
    assert report.gaps["term"] is not None and report.gaps["term"] <= 1.5, summary
    assert report.passed, summary
