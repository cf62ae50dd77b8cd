"""Redis servers the tests start and kill: a private, unpersisted redis-server, and a 3-primary
Redis Cluster (``redis-server --cluster-enabled`` three times, joined by ``redis-cli --cluster create``).

A plain helper module; the fixtures that use it are in ``tests/conftest.py``.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@dataclass
class PrivateRedis:
    """A redis-server started by the test: no RDB, no AOF, so a restart loses every key."""

    workdir: Path
    port: int = field(default_factory=free_port)
    password: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> str:
        return str(self.workdir / "redis.sock")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.workdir), "--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)

    def kill(self) -> None:
        """SIGKILL: the server dies at once and, being unpersisted, comes back empty."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


# -- the cluster -------------------------------------------------------------------------------------
def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port(taken: list[int]) -> int:
    """A free port P whose cluster bus port P + 10000 is free too (so P <= 55535, as Redis demands)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 45000)
        if port not in taken and port + 10000 not in taken and _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair P, P+10000 for a Redis Cluster node")


def raw_client(port: int) -> redis.Redis:
    """A plain client to one node: it sees MOVED instead of following it."""
    return redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=5)


def ask(port: int, *command: Any) -> Any:
    """One command to one node, on a connection of its own."""
    with raw_client(port) as client:
        return client.execute_command(*command)


def _cluster_ok(port: int) -> bool:
    return bool(ask(port, "CLUSTER INFO")["cluster_state"] == "ok")


@dataclass
class RedisClusterServers:
    """Three cluster-enabled ``redis-server`` primaries (slots split evenly, no replicas), unpersisted."""

    workdir: Path
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    startup_seconds: float = 0.0

    @property
    def url(self) -> str:
        """The cluster URL with every node, the first URL node being ``ports[0]``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        started = time.monotonic()
        for _ in range(3):
            self.ports.append(free_cluster_port(self.ports))
        for port in self.ports:
            args = [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--dir", str(self.workdir), "--logfile", str(self.workdir / f"{port}.log"),
            ]  # fmt: skip
            self.procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in self.ports:
            self._wait(functools.partial(ask, port, "PING"), f"node {port} to answer PING")
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
        for port in self.ports:
            self._wait(functools.partial(_cluster_ok, port), f"cluster_state:ok on {port}")
        self.startup_seconds = time.monotonic() - started

    def _wait(self, check: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            try:
                if check():
                    return
            except redis.exceptions.RedisError:
                pass  # not listening or not joined yet
            time.sleep(0.05)
        logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in self.workdir.glob("*.log"))
        raise RuntimeError(f"the Redis Cluster did not come up: gave up waiting for {what}\n{logs}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- slots ---------------------------------------------------------------------------------
    def owner(self, namespace: str) -> int:
        """The port of the primary that owns ``namespace``'s slot now (asked live: slots can move)."""
        slot = key_slot(f"mutexcron:{{{namespace}}}:names".encode())
        for first, last, primary, *_replicas in ask(self.ports[0], "CLUSTER SLOTS"):
            if int(first) <= slot <= int(last):
                return int(primary[1])
        raise LookupError(f"slot {slot} is not covered")

    def namespace_off_first_node(self, prefix: str) -> str:
        """A namespace ``prefix-N`` whose slot is NOT on the first URL node (which answers MOVED for it)."""
        for n in range(1000):
            namespace = f"{prefix}-{n}"
            if self.owner(namespace) != self.ports[0]:
                return namespace
        raise LookupError("no namespace off the first node")  # pragma: no cover - 2/3 of slots qualify

    def namespaced_url(self, prefix: str) -> str:
        return f"{self.url}/?namespace={self.namespace_off_first_node(prefix)}"


class _Shared:
    """One cluster per session, though two modules import the fixture (two fixture definitions)."""

    cluster: RedisClusterServers | None = None
    users = 0


@contextmanager
def shared_cluster() -> Iterator[RedisClusterServers]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        reason = "redis-server or redis-cli is not installed: the Redis Cluster tests need both"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: a missing server fails the run)")
        pytest.skip(reason)
    cluster = _Shared.cluster
    if cluster is None:
        cluster = RedisClusterServers(Path(tempfile.mkdtemp(prefix="mc-rcluster-")))
        try:
            cluster.start()
        except BaseException:
            cluster.stop()
            raise
        _Shared.cluster = cluster
        print(f"\nRedis Cluster on ports {cluster.ports} up in {cluster.startup_seconds:.2f}s")  # visible with -s
    _Shared.users += 1
    try:
        yield cluster
    finally:
        _Shared.users -= 1
        if _Shared.users == 0:
            cluster.stop()
            _Shared.cluster = None


