"""Redis-specific tests: URLs, timeouts, password masking, restarts, the token floor, Sentinel.

The shared contract suite (``tests/test_contract.py -k redis``) covers the lock semantics; this
file covers what only Redis has. Tests that start their own ``redis-server`` (a private,
unpersisted one, or a sentinel) kill it in the fixture teardown.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from mutexcron.errors import ConfigurationError, StoreUnavailableError  # noqa: E402
from mutexcron.locks import FireClaim, Node, RunInfo, lock_store_from_url  # noqa: E402
from mutexcron.locks.redis import RedisLockStore  # noqa: E402
from tests.backends import require_server  # noqa: E402
from tests.redis_servers import REDIS_SERVER, PrivateRedis, free_port, wait_for_port  # noqa: E402

pytestmark = pytest.mark.redis

A = Node("node-a:1:aaaa", "10.0.0.1")
B = Node("node-b:2:bbbb", "10.0.0.2")
C = Node("node-c:3:cccc", "10.0.0.3")
PASSWORD = "s3cr3t-hunter2"


# -- helpers and fixtures ------------------------------------------------------------------------
@pytest.fixture
def shared_url() -> Iterator[str]:
    """A fresh namespace on the shared Redis (127.0.0.1:6379 or MUTEXCRON_TEST_REDIS_URL)."""
    base = require_server("redis")
    url = f"{base}{'&' if '?' in base else '?'}namespace=test-{secrets.token_hex(4)}"
    yield url
    store = RedisLockStore(url)
    try:
        store.destroy_namespace()
    finally:
        store.close()


@pytest.fixture
def hung_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.05)  # so the thread sees ``stop`` promptly
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)  # keep it open, say nothing

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        listener.close()
        for conn in accepted:
            conn.close()
        thread.join(timeout=2)


def count_commands(store: RedisLockStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every command the store's client sends outside pipelines (one entry per round trip)."""
    sent: list[str] = []
    client = store._client
    original: Callable[..., Any] = client.execute_command

    def counting(*args: Any, **kwargs: Any) -> Any:
        sent.append(str(args[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(client, "execute_command", counting)
    return sent


# -- URLs ----------------------------------------------------------------------------------------
def _conn_kwargs(store: RedisLockStore) -> dict[str, Any]:
    return dict(store._client.connection_pool.connection_kwargs)


def test_every_redis_scheme_builds_a_redis_store() -> None:
    for url in (
        "redis://127.0.0.1:6379/0",
        "rediss://127.0.0.1:6380/0",
        "unix:///tmp/redis.sock",
        "redis+sentinel://127.0.0.1:26379/mymaster",
    ):
        store = lock_store_from_url(url)
        try:
            assert isinstance(store, RedisLockStore)
        finally:
            store.close()


def test_redis_url_defaults_fail_closed_timeouts_and_namespace() -> None:
    store = RedisLockStore("redis://127.0.0.1:6379/3")
    kwargs = _conn_kwargs(store)
    assert store.namespace == "default"
    assert store._lock_key("billing") == "mutexcron:{default}:lock:billing"
    assert store._token_key("billing") == "mutexcron:{default}:token:billing"
    assert store._names_key == "mutexcron:{default}:names"
    assert store._floor_key == "mutexcron:{default}:lock_token_floor"
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 6379, 3)
    assert kwargs["socket_timeout"] == 5.0 and kwargs["socket_connect_timeout"] == 5.0
    assert kwargs["health_check_interval"] > 0
    assert kwargs["retry_on_timeout"] is False
    retry = kwargs["retry"]
    assert redis.exceptions.TimeoutError not in retry._supported_errors, "a hung server must not be retried"
    store.close()


def test_namespace_and_timeouts_come_from_the_query_and_are_not_passed_to_redis() -> None:
    store = RedisLockStore("redis://127.0.0.1/0?namespace=billing&socket_timeout=1.5")
    kwargs = _conn_kwargs(store)
    assert store.namespace == "billing"
    assert "namespace" not in kwargs
    assert kwargs["socket_timeout"] == 1.5 and kwargs["socket_connect_timeout"] == 1.5
    store.close()
    store = RedisLockStore("redis://127.0.0.1/0?socket_timeout=2&socket_connect_timeout=0.5")
    assert (_conn_kwargs(store)["socket_timeout"], _conn_kwargs(store)["socket_connect_timeout"]) == (2.0, 0.5)
    store.close()


def test_rediss_passes_tls_options_through() -> None:
    store = RedisLockStore(
        f"rediss://alice:{PASSWORD}@redis.example:6380/2?ssl_cert_reqs=none&ssl_ca_certs=/etc/ssl/ca.pem&namespace=x"
    )
    pool = store._client.connection_pool
    kwargs = _conn_kwargs(store)
    assert pool.connection_class is redis.connection.SSLConnection
    assert kwargs["ssl_cert_reqs"] == "none" and kwargs["ssl_ca_certs"] == "/etc/ssl/ca.pem"
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["username"]) == ("redis.example", 6380, 2, "alice")
    assert store.namespace == "x"
    store.close()


def test_unix_socket_url_with_db_and_namespace() -> None:
    store = RedisLockStore("unix:///var/run/redis/redis.sock?db=4&namespace=ops")
    pool = store._client.connection_pool
    kwargs = _conn_kwargs(store)
    assert pool.connection_class is redis.connection.UnixDomainSocketConnection
    assert kwargs["path"] == "/var/run/redis/redis.sock" and kwargs["db"] == 4
    assert store.namespace == "ops"
    store.close()


def test_sentinel_url_parsing() -> None:
    store = RedisLockStore(f"redis+sentinel://bob:{PASSWORD}@s1:26379,s2,[::1]:26380/mymaster/5?namespace=n")
    assert store._sentinel is not None
    hosts = [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
             for s in store._sentinel.sentinels]
    assert hosts == [("s1", 26379), ("s2", 26379), ("::1", 26380)]
    assert store.service_name == "mymaster"
    kwargs = _conn_kwargs(store)
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (5, "bob", PASSWORD)
    assert store.namespace == "n"
    assert PASSWORD not in store.masked_url and PASSWORD not in repr(store)
    store.close()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://127.0.0.1/notadb", "database number"),
        ("redis://127.0.0.1:port/0", "port"),
        ("unix://", "socket path"),
        ("redis+sentinel://s1:26379", "service_name"),
        ("redis+sentinel://s1:26379/a/b/c", "service_name"),
        ("redis+sentinel://s1:x/mymaster", "bad port"),
        ("redis://127.0.0.1/0?socket_timeout=soon", "socket_timeout"),
        ("redis://127.0.0.1/0?socket_timeout=0", "positive"),
        ("redis://127.0.0.1/0?no_such_option=1", "no_such_option"),
        ("redis://127.0.0.1/0?ssl_cert_reqs=none", "rediss://"),
        ("redis://127.0.0.1/0?namespace=a%7Bb%7D", "namespace"),
        ("redis://127.0.0.1/0?db=x", "db"),
    ],
)
def test_bad_urls_raise_configuration_error_naming_the_forms(url: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match="Accepted forms") as info:
        RedisLockStore(url)
    assert why in str(info.value)
    assert "redis+sentinel://" in str(info.value) and "unix://" in str(info.value)


def test_bad_url_error_masks_the_password() -> None:
    with pytest.raises(ConfigurationError) as info:
        RedisLockStore(f"redis://:{PASSWORD}@127.0.0.1/notadb")
    assert PASSWORD not in str(info.value) and "***" in str(info.value)


def test_masked_url_hides_the_password() -> None:
    for url in (
        f"redis://:{PASSWORD}@127.0.0.1:6379/0",
        f"rediss://user:{PASSWORD}@127.0.0.1:6379/0?ssl_cert_reqs=none",
        f"redis+sentinel://user:{PASSWORD}@s1:26379,s2:26379/mymaster",
        f"unix:///tmp/redis.sock?password={PASSWORD}",
    ):
        store = RedisLockStore(url)
        assert PASSWORD not in store.masked_url and "***" in store.masked_url
        assert PASSWORD not in repr(store)
        store.close()


# -- timeouts and outages: fail closed, fast ------------------------------------------------------
def test_hung_server_raises_store_unavailable_within_the_socket_timeout(hung_server: int) -> None:
    store = RedisLockStore(f"redis://127.0.0.1:{hung_server}/0?socket_timeout=0.5")
    operations: dict[str, Callable[[], Any]] = {
        "acquire_or_renew": lambda: store.acquire_or_renew("l", A, ttl=10, claim=FireClaim.new("j", 1)),
        "heartbeat": lambda: store.hand_off("l", A, 1, {"k": 1}),
        "renew_many": lambda: store.renew_many(A, {"l": 1}),
        "release": lambda: store.release("l", A, 1),
        "read": lambda: store.read("l"),
        "list": store.list,
        "ping": store.ping,
    }
    try:
        for op, call in operations.items():
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="unavailable during") as info:
                call()
            elapsed = time.monotonic() - started
            assert elapsed < 2.0, f"{op} took {elapsed:.1f}s against a hung server"
            assert isinstance(info.value.__cause__, redis.exceptions.TimeoutError)
    finally:
        store.close()


def test_refused_connection_raises_store_unavailable_at_once() -> None:
    store = RedisLockStore(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError) as info:
            store.acquire_or_renew("l", A, ttl=10)
    finally:
        store.close()
    assert time.monotonic() - started < 2.0
    assert PASSWORD not in str(info.value) and ":***@" in str(info.value)


def test_password_never_reaches_the_logs_or_errors(
    private_redis: PrivateRedis, hung_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the driver's too
    private_redis.kill()
    private_redis.password = PASSWORD
    private_redis.start()
    messages: list[str] = []
    good = RedisLockStore(f"{private_redis.url}?namespace=auth")
    wrong = RedisLockStore(f"redis://:wrong-{PASSWORD}@127.0.0.1:{private_redis.port}/0")
    hung = RedisLockStore(f"redis://:{PASSWORD}@127.0.0.1:{hung_server}/0?socket_timeout=0.3")
    try:
        assert good.acquire_or_renew("l", A, ttl=10).acquired, "the password authenticates"
        for store in (wrong, hung):
            with pytest.raises(StoreUnavailableError) as info:
                store.acquire_or_renew("l", A, ttl=10)
            messages.append(str(info.value))
            logging.getLogger("mutexcron.test").error("store failed: %s", info.value)
    finally:
        for store in (good, wrong, hung):
            store.close()
    assert all(":***@" in m for m in messages), messages
    assert PASSWORD not in "\n".join(messages)
    assert caplog.records, "the debug log was captured"
    assert PASSWORD not in caplog.text


# -- layout, round trips, staleness --------------------------------------------------------------
def test_key_layout_never_expires_and_keeps_16_digit_fire_times(shared_url: str) -> None:
    store = RedisLockStore(shared_url)
    raw = redis.Redis.from_url(shared_url.partition("?")[0], decode_responses=True)
    try:
        fire_us = 1_767_225_600_123_456  # 2026-01-01, microseconds: 16 digits
        claim = FireClaim.new('job "x"/y', fire_us)
        result = store.acquire_or_renew("jobs.tick", A, ttl=10, claim=claim)
        assert result.claimed
        ns = store.namespace
        lock, token = f"mutexcron:{{{ns}}}:lock:jobs.tick", f"mutexcron:{{{ns}}}:token:jobs.tick"
        names = f"mutexcron:{{{ns}}}:names"
        assert raw.ttl(lock) == -1 and raw.ttl(token) == -1 and raw.ttl(names) == -1
        fields = raw.hgetall(lock)
        assert fields["holder"] == A.node_id and fields["active_ip"] == A.ip and fields["token"] == "1"
        assert fields["ttl"] == "10000"
        assert int(fields["hb"]) // 1000 == pytest.approx(int(raw.time()[0]), abs=2)
        assert raw.get(token) == "1" and raw.smembers(names) == {"jobs.tick"}
        assert json.loads(fields["fires"]) == {claim.job_id: [fire_us, claim.nonce]}, "no precision lost"
        assert int(result.record.fire_times['job "x"/y'].timestamp() * 1_000_000) == pytest.approx(fire_us, abs=1)
        # Released: holder gone, the rest kept; the hash still never expires.
        assert store.release("jobs.tick", A, 1)
        fields = raw.hgetall(lock)
        assert "holder" not in fields and fields["token"] == "1" and fields["active_ip"] == A.ip and "fires" in fields
        assert raw.ttl(lock) == -1
    finally:
        store.close()
        raw.close()


def test_acquire_with_claim_and_renew_many_of_10000_are_one_round_trip_each(
    shared_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisLockStore(shared_url)
    try:
        store.acquire_or_renew("warm", A, ttl=60)  # loads the script (NOSCRIPT fallback) once
        names = [f"lock-{i}" for i in range(10_000)]
        pipe = store._client.pipeline(transaction=False)
        for name in names:  # 10,000 acquisitions in one pipeline: the same script, fewer waits
            store._acquire(keys=[store._lock_key(name), store._token_key(name), store._names_key, store._floor_key],
                           args=[A.node_id, A.ip, 60_000, 0, name], client=pipe)
        assert all(json.loads(r)[0] == 1 for r in pipe.execute())
        sent = count_commands(store, monkeypatch)
        result = store.acquire_or_renew("warm", A, ttl=60, claim=FireClaim.new("job", 5_000_000))
        assert result.acquired and result.claimed and result.record.heartbeat_age is not None
        assert sent == ["EVALSHA"], sent
        sent.clear()
        renewed = store.renew_many(A, {name: 1 for name in names})
        assert renewed == set(names)
        assert sent == ["EVALSHA"], f"renew_many of 10,000 locks sent {len(sent)} commands"
        sent.clear()
        assert store.renew_many(B, {name: 1 for name in names[:10]}) == set()
        assert sent == ["EVALSHA"]
    finally:
        store.close()


def test_staleness_uses_the_holders_stored_ttl_not_the_callers(shared_url: str) -> None:
    a, b = RedisLockStore(shared_url), RedisLockStore(shared_url)
    try:
        assert a.acquire_or_renew("long", A, ttl=60).acquired
        assert a.acquire_or_renew("short", A, ttl=0.2).acquired
        time.sleep(0.35)
        assert not b.acquire_or_renew("long", B, ttl=0.1).acquired, "B's short ttl must not make A's lease stale"
        took = b.acquire_or_renew("short", B, ttl=60)
        assert took.acquired and took.token == 2
    finally:
        a.close()
        b.close()


def test_run_info_and_error_round_trip(shared_url: str) -> None:
    store = RedisLockStore(shared_url)
    try:
        token = store.acquire_or_renew("r", A, ttl=60).token
        assert store.hand_off("r", A, token, None, RunInfo(duration=2.0, error="KeyError: 'x'"))
        rec = store.read("r")
        assert rec is not None and rec.last_error == "KeyError: 'x'"
        assert rec.last_run_started is not None and rec.last_run_finished is not None
        assert (rec.last_run_finished - rec.last_run_started).total_seconds() == pytest.approx(2.0, abs=0.01)
        assert store.hand_off("r", A, token, None, RunInfo(duration=0.0))
        assert store.read("r").last_error is None  # type: ignore[union-attr]
        assert not store.hand_off("r", B, token), "a non-holder's heartbeat changes nothing"
    finally:
        store.close()

def test_history_is_a_list_per_job_and_earlier_fields_are_carried_over(shared_url: str) -> None:
    """A job's runs are a list of history lines, trimmed to the last N by each run; a history-hash
    field in an earlier form (a JSON array of entry texts, or entry texts one per line) is read as
    it is, and moved in front of the list, runs kept, by the job's next run."""
    store = RedisLockStore(shared_url)
    store.history_length = 3
    try:
        token = store.acquire_or_renew("old", A, ttl=60).token
        client, key = store.backend.client, store._history_key("old")

        def earlier(i: int) -> str:
            return json.dumps({"node": f"n{i}", "token": 1, "outcome": "success", "started": 1_000 + i, "ended": 1_001 + i})

        client.hset(key, "j", json.dumps([earlier(i) for i in range(3)]))  # a JSON array of entry texts
        client.hset(key, "k", "\n".join(earlier(i) for i in range(2)))  # entry texts one per line
        assert [r.node for r in store.history("old", job="j")] == ["n2", "n1", "n0"]
        assert [r.node for r in store.history("old", job="k")] == ["n1", "n0"]
        assert store.hand_off("old", A, token, None, RunInfo(0.1, "boom\nline two", job="j"))
        assert store.hand_off("old", A, token, None, RunInfo(0.1, None, job="k"))
        assert client.hget(key, "j") == "" and client.hget(key, "k") == "", "the jobs' runs are in their lists now"
        lines = client.lrange(store._runs_key("old", "j"), 0, -1)
        assert len(lines) == 3 and json.loads(lines[-1])[1] == A.node_id, "moved over, cut to the last 3"
        runs = store.history("old", job="j")
        assert [(r.node, r.outcome) for r in runs] == [(A.node_id, "error"), ("n2", "success"), ("n1", "success")]
        assert runs[0].error == "boom\nline two"
        assert [r.node for r in store.history("old", job="k")] == [A.node_id, "n1", "n0"]
        for _ in range(5):
            assert store.hand_off("old", A, token, None, RunInfo(0.1, None, job="k"))
        assert client.llen(store._runs_key("old", "k")) == 3, "every run trims the list"
    finally:
        store.close()


def test_history_lists_of_names_with_colons_stay_apart(shared_url: str) -> None:
    store = RedisLockStore(shared_url)
    try:
        assert store._runs_key("a:b", "c") != store._runs_key("a", "b:c")
        for lock, job in (("a:b", "c"), ("a", "b:c")):
            token = store.acquire_or_renew(lock, A, ttl=60).token
            assert store.hand_off(lock, A, token, None, RunInfo(0.1, None, job=job))
        assert [r.job for r in store.history("a:b")] == ["c"] and [r.job for r in store.history("a")] == ["b:c"]
    finally:
        store.close()


# -- the client-side token floor -----------------------------------------------------------------
def test_token_floor_survives_a_wiped_namespace(shared_url: str) -> None:
    """FLUSHALL, a failover to an empty replica, a deleted key: tokens still go up for this client."""
    store = RedisLockStore(shared_url)
    wiper = RedisLockStore(shared_url)
    try:
        for expected in (1, 2, 3):
            token = store.acquire_or_renew("l", A, ttl=60).token
            assert token == expected
            assert store.release("l", A, token)
        assert store.token_floor("l") == 3
        assert wiper.destroy_namespace() >= 3
        assert not store.hand_off("l", A, 3), "the lost lease is not renewed"
        again = store.acquire_or_renew("l", A, ttl=60)
        assert again.acquired and again.token == 4, "never at or below a token this client saw"
        assert wiper.read("l").token == 4  # type: ignore[union-attr]
    finally:
        store.close()
        wiper.close()


def test_unpersisted_restart_loses_locks_but_not_this_clients_tokens(private_redis: PrivateRedis) -> None:
    url = f"{private_redis.url}?namespace=restart&socket_timeout=1"
    a = RedisLockStore(url)
    try:
        for name in ("l", "m"):
            for expected in (1, 2, 3):
                token = a.acquire_or_renew(name, A, ttl=60).token
                assert token == expected
                if expected < 3:
                    assert a.release(name, A, token)

        private_redis.kill()
        with pytest.raises(StoreUnavailableError):
            a.acquire_or_renew("l", A, ttl=60)
        with pytest.raises(StoreUnavailableError):
            a.renew_many(A, {"l": 3, "m": 3})
        private_redis.start()  # same port, empty: no RDB, no AOF, no scripts loaded

        # The pooled connection died with the server: the store reconnects, reloads the script
        # (NOSCRIPT fallback) and A gets a token above the 3 it had, not a fresh 1.
        assert a.read("l") is None, "an unpersisted restart loses the lock data"
        assert a.renew_many(A, {"l": 3, "m": 3}) == set(), "old leases are gone, not silently renewed"
        again = a.acquire_or_renew("l", A, ttl=60)
        assert again.acquired and again.token == 4

        # The floor lives in this store object only: a fresh process knows no floor...
        b, c = RedisLockStore(url), RedisLockStore(url)
        try:
            got = b.acquire_or_renew("m", B, ttl=60)
            assert got.acquired and got.token == 1, "documented limit: a new client starts from the server's counter"
            # ...but a client that saw more (A saw 3) lifts the counter even when refused,
            refused = a.acquire_or_renew("m", A, ttl=60)
            assert not refused.acquired and refused.record.holder == B.node_id
            assert b.release("m", B, 1)
            # so the next holder, even a fresh one, gets a token above everything A saw.
            assert c.acquire_or_renew("m", C, ttl=60).token == 4
            assert a.acquire_or_renew("l", A, ttl=60).token == 4, "renewal keeps the token"
        finally:
            b.close()
            c.close()
    finally:
        a.close()


def test_unix_socket_store_works(private_redis: PrivateRedis) -> None:
    store = lock_store_from_url(f"unix://{private_redis.socket_path}?db=2&namespace=uds")
    try:
        result = store.acquire_or_renew("u", A, ttl=60, claim=FireClaim.new("j", 1_000_000))
        assert result.acquired and result.claimed and result.token == 1
        assert [r.name for r in store.list()] == ["u"]
        assert store.release("u", A, 1)
        store.ping()
    finally:
        store.close()
    raw = redis.Redis(unix_socket_path=private_redis.socket_path, db=2)
    try:
        assert raw.exists("mutexcron:{uds}:lock:u") == 1
    finally:
        raw.close()


# -- Sentinel ------------------------------------------------------------------------------------
@pytest.fixture
def sentinel_port() -> Iterator[int]:
    """A real ``redis-server --sentinel`` on a free port, monitoring the shared master."""
    base = require_server("redis")
    if not base.startswith("redis://127.0.0.1:6379"):
        pytest.skip("the sentinel test monitors the local master at 127.0.0.1:6379")
    workdir = Path(tempfile.mkdtemp(prefix="mc-sentinel-"))
    port = free_port()
    conf = workdir / "sentinel.conf"  # sentinel rewrites its config file: it must be writable
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
        "sentinel monitor mymaster 127.0.0.1 6379 1\n"
        "sentinel down-after-milliseconds mymaster 60000\n"
    )
    proc = subprocess.Popen(
        [REDIS_SERVER, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_port(port)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def test_sentinel_acquire_renew_release(sentinel_port: int) -> None:
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/0?namespace=test-sentinel-{secrets.token_hex(4)}"
    a, b = lock_store_from_url(url), lock_store_from_url(url)
    assert isinstance(a, RedisLockStore)
    try:
        first = a.acquire_or_renew("s", A, ttl=60, claim=FireClaim.new("job", 1_000_000))
        assert first.acquired and first.claimed and first.token == 1
        assert not b.acquire_or_renew("s", B, ttl=60).acquired
        assert a.acquire_or_renew("s", A, ttl=60).token == 1, "renewed"
        assert a.renew_many(A, {"s": 1}) == {"s"}
        assert a.hand_off("s", A, 1, {"via": "sentinel"})
        assert a.release("s", A, 1)
        got = b.acquire_or_renew("s", B, ttl=60)
        assert got.acquired and got.token == 2 and dict(got.record.attrs) == {"via": "sentinel"}
        assert [r.name for r in b.list()] == ["s"]
        b.ping()
    finally:
        a.destroy_namespace()
        a.close()
        b.close()


def test_sentinel_unknown_service_is_unavailable_not_a_hang(sentinel_port: int) -> None:
    store = RedisLockStore(f"redis+sentinel://127.0.0.1:{sentinel_port}/no-such-master?socket_timeout=1")
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError, match="no-such-master"):
            store.acquire_or_renew("s", A, ttl=60)
    finally:
        store.close()
    assert time.monotonic() - started < 3.0


# -- a Redis restart in the middle of a cluster run ---------------------------------------------------
@pytest.mark.cluster
def test_restart_mid_cluster_run_fails_closed_and_resumes_with_one_holder(private_redis: PrivateRedis) -> None:
    """Three ``mutexcron run`` nodes; the unpersisted Redis dies for 3 s and comes back empty.

    The nodes log the outage once, run nothing while Redis is down, resume with one holder, and
    the fencing tokens keep going up (every node saw the last token, so every floor is above it).
    """
    drill = pytest.importorskip("mutexcron.drill")
    private_redis.kill()
    private_redis.password = PASSWORD
    private_redis.start()
    url = f"{private_redis.url}?namespace=cluster&socket_timeout=1"
    cluster = drill.Cluster(url, nodes=3, unactive_interval=2.0)
    with cluster:
        assert cluster.wait_ticks(3, timeout=30) is not None, "no ticks before the restart"
        before = cluster.ticks()
        down_at = time.monotonic()
        private_redis.kill()
        time.sleep(3.0)
        private_redis.start()
        up_at = time.monotonic()
        assert cluster.wait_ticks(4, timeout=20, after=up_at) is not None, "no ticks after the restart"
        time.sleep(1.0)
        ticks = cluster.ticks()
        logs = {node: (cluster.workdir / f"{node}.log").read_text(errors="replace") for node in cluster.procs}

    # Fail closed: a run that started before the kill may finish writing just after it, nothing later.
    during = [t for t in ticks if down_at + 0.3 < t.mono < up_at]
    assert not during, f"guarded runs while Redis was down: {during}"
    fires = [round(t.fire, 3) for t in ticks]
    assert len(fires) == len(set(fires)), "a fire time ran on two nodes"
    after = [t for t in ticks if t.mono > up_at]
    assert len({t.node for t in after[-3:]}) == 1, f"not one holder after the restart: {after}"
    assert min(t.token for t in after) > max(t.token for t in before), "tokens went back after the restart"
    for node, text in logs.items():
        assert text.count("is unreachable") == 1, f"{node} should log the outage once:\n{text}"
        assert text.count("reachable again") == 1, f"{node} should log the recovery once:\n{text}"
        assert PASSWORD not in text, f"{node} logged the password"
