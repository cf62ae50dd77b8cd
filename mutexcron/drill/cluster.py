"""The drill's node processes: start, signal and stop N ``mutexcron run`` nodes, and clean up after them.

Each node runs in a session of its own, logs to ``<workdir>/<node>.log`` and dies with the drill
(``PR_SET_PDEATHSIG``). :meth:`Cluster.stop` (also on Ctrl-C, through the context manager) stops
every node and releases the drill's locks; the temporary directory is removed when the drill
passed (or was interrupted), and kept, as the evidence, when it did not.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigurationError, MutexcronError, StoreError
from ..locks import LockStore, Node, lock_store_from_url
from ..locks.base import FORGET_CLEARED, FORGET_DELETED
from .records import NodeOps, Tick, read_ops, read_ticks

#: Where Debian/Ubuntu, Fedora and source installs put libfaketime (checked in this order).
LIBFAKETIME_PATHS: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)

#: What the nodes run by default: the drill's every-second job (``mutexcron run`` loads module:attr).
NODE_JOBS = "mutexcron.drill.node_jobs:sched"

#: Node exit codes that are not a crash: running, clean exit, the drill's SIGKILL/SIGTERM, refused start.
_EXPECTED_EXITS = (None, 0, -signal.SIGKILL, -signal.SIGTERM, 1)


def libfaketime() -> str:
    """The path of libfaketime, for ``--skew``.

    Raises:
        ConfigurationError: libfaketime is not installed.
    """
    for candidate in LIBFAKETIME_PATHS:
        if os.path.exists(candidate):
            return candidate
    raise ConfigurationError(
        "--skew needs libfaketime, which is not installed: apt-get install faketime (Debian/Ubuntu), "
        "dnf install libfaketime (Fedora); looked in " + ", ".join(LIBFAKETIME_PATHS)
    )


@dataclass
class Cluster:
    """N ``mutexcron run`` node processes guarding one every-second job (or running ``jobs``).

    Attributes:
        jobs: what each node runs, as ``mutexcron run`` takes it: ``module:attr`` or a jobs file path.
        env: extra environment for the nodes (on top of the drill's ``MUTEXCRON_DRILL_*``).
        release_locks: the locks to release on :meth:`stop` (default: ``(lock,)``).
        lock_left: after :meth:`stop`, what the drill left in the store.
    """

    lock_url: str
    nodes: int = 3
    unactive_interval: float = 2.0
    lock: str = field(default_factory=lambda: f"mutexcron-drill-{secrets.token_hex(4)}")
    skew: float = 0.0
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mutexcron-drill-")))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    jobs: str = NODE_JOBS
    env: dict[str, str] = field(default_factory=dict)
    progress: Callable[[str], None] | None = None
    release_locks: tuple[str, ...] | None = None
    lock_left: str = ""
    #: True: the temp dir outlives a normal end, for the caller's :meth:`keep_or_discard` (a drill
    #: keeps it when its verdict is FAIL).
    verdict_pending: bool = False

    @property
    def out(self) -> Path:
        """The ticks file all nodes append to."""
        return self.workdir / "ticks.jsonl"

    # -- processes ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the nodes; with ``skew``, node i's wall clock is shifted by i x ``skew`` (libfaketime)."""
        faketime = libfaketime() if self.skew else None
        for i in range(self.nodes):
            self.start_node(i, faketime=faketime)

    def start_node(self, index: int, env: dict[str, str] | None = None, faketime: str | None = None) -> str:
        """Start one node (``env`` on top of the cluster's: a changed jobs file); returns its id."""
        node_id = f"drill-{index}-{secrets.token_hex(2)}"
        log_file = open(self.workdir / f"{node_id}.log", "wb")  # closed just below: Popen keeps its own copy
        cmd = [
            sys.executable, "-m", "mutexcron", "run", self.jobs, "--node-id", node_id,
            "--unactive-interval", str(self.unactive_interval), "--shutdown-timeout", "5",
        ]
        # Own session: a Ctrl-C in the terminal reaches the drill only, which then stops the
        # nodes in order (SIGCONT, SIGTERM, release) instead of racing them.
        self.procs[node_id] = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**self._node_env(index, node_id, faketime), **(env or {})},
            cwd=self.workdir, start_new_session=True,
        )
        log_file.close()
        return node_id

    def _node_env(self, index: int, node_id: str, faketime: str | None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
        env = {
            **base,
            "MUTEXCRON_DRILL_URL": self.lock_url,
            "MUTEXCRON_DRILL_OUT": str(self.out),
            "MUTEXCRON_DRILL_OPS": str(self.workdir / f"{node_id}.ops.jsonl"),
            "MUTEXCRON_DRILL_LOCK": self.lock,
            "MUTEXCRON_DRILL_PARENT": str(os.getpid()),
            "MUTEXCRON_NODE_ID": node_id,
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        if faketime and index:
            env["LD_PRELOAD"] = ":".join(p for p in (faketime, os.environ.get("LD_PRELOAD", "")) if p)
            env["FAKETIME"] = f"{index * self.skew:+.3f}"
            env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
        return env

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def signal(self, node: str, sig: int) -> float:
        """Send ``sig`` to ``node``; return when (``time.monotonic()``)."""
        at = time.monotonic()
        self.procs[node].send_signal(sig)
        return at

    def freeze(self, node: str, attempts: int = 5, also: tuple[str, ...] = ()) -> float:
        """SIGSTOP ``node``, on SQLite outside a write of its own; return when (``time.monotonic()``).

        A process stopped inside a SQLite write keeps the file's write lock, so every node stalls
        until it resumes or dies: no lease can be taken over meanwhile (the limit is documented in
        the guarantees). The drill is after the lease path, so if the stopped node holds the lock,
        it is resumed at once and stopped again a moment later (and the progress says so). ``also``:
        more SQLite URLs to look at (a shared job store's file).
        """
        at = self.signal(node, signal.SIGSTOP)
        for _ in range(attempts - 1):
            if not any(sqlite_write_lock_held(url) for url in (self.lock_url, *also)):
                break
            self._say(f"freeze: {node} stopped inside a SQLite write (holding the file's write lock): resumed, to stop again")
            self.signal(node, signal.SIGCONT)
            time.sleep(random.uniform(0.05, 0.25))
            at = self.signal(node, signal.SIGSTOP)
        return at

    def check_nodes(self) -> None:
        """Raise MutexcronError, with the node's log, if a node crashed."""
        for node, proc in self.procs.items():
            code = proc.poll()
            if code not in _EXPECTED_EXITS:
                raise MutexcronError(f"drill node {node} exited with {code}:\n{self.log_tail(node)}")

    def log_tail(self, node: str, lines: int = 20) -> str:
        path = self.workdir / f"{node}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # -- what the nodes wrote -----------------------------------------------------------------
    def ticks(self) -> list[Tick]:
        return read_ticks(self.out)

    def ops(self) -> NodeOps:
        """Read every node's timing file."""
        return read_ops(self.workdir)

    def wait_ticks(self, count: int, timeout: float, *, after: float = 0.0, not_node: str | None = None) -> Tick | None:
        """Wait until ``count`` ticks with ``mono > after`` (and not by ``not_node``) exist; return the first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            new = [t for t in self.ticks() if t.mono > after and t.node != not_node]
            if len(new) >= count:
                return new[0]
            self.check_nodes()
            time.sleep(0.05)
        return None

    def wait_stable_holder(self, count: int, timeout: float) -> None:
        """Wait until the last ``count`` ticks ran on one node: placement has settled (a node that
        joins or comes back may be handed the lock), so the node to strike holds it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.ticks()[-count:]
            if len(last) == count and len({t.node for t in last}) == 1:
                return
            self.check_nodes()
            time.sleep(0.05)

    def holder(self) -> str:
        """The node that ran the last tick."""
        ticks = self.ticks()
        if not ticks:
            raise MutexcronError("the drill job has not run yet")
        return ticks[-1].node

    # -- cleanup ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every node (SIGCONT, SIGTERM, then SIGKILL after 15 s) and release the lock.

        The temp dir (the nodes' logs and records) stays until :meth:`discard`: a drill that did
        not pass keeps it as the evidence. SIGINT and SIGTERM are ignored meanwhile (when called
        from the main thread), so a second Ctrl-C cannot leave half the cleanup undone.
        """
        with _signals_ignored():
            self._say(f"cleanup: stopping {len(self.alive())} node(s)")
            self._stop_nodes()
            self.lock_left = self._release_lock()
            self._say(f"cleanup: {self.lock_left}")

    def discard(self) -> None:
        """Remove the temp dir with the nodes' logs and records."""
        shutil.rmtree(self.workdir, ignore_errors=True)
        self._say(f"cleanup: removed {self.workdir}")

    def keep_or_discard(self, passed: bool) -> str:
        """Remove the temp dir if the drill ``passed``; else keep it and return its path ("" if removed)."""
        if passed:
            self.discard()
            return ""
        self._say(f"cleanup: the nodes' logs and records are kept in {self.workdir}")
        return str(self.workdir)

    def _stop_nodes(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    def _release_lock(self) -> str:
        """Release the drill's locks that a node still holds, through the store API, then forget them.

        Every node is stopped by now, so releasing on behalf of the recorded holder (conditional on
        its token, like any release) cannot take a lease from a live node. ``forget`` then lets
        each record go (at once, or retired and deleted later: see ``LockStore.forget``); the
        store's token floor keeps their tokens spent. The drill's evidence is in its own ledger.
        """
        names = self.release_locks or (self.lock,)
        try:
            store = lock_store_from_url(self.lock_url)
        except ConfigurationError as exc:
            return f"could not open the store to release {names[0]}: {exc}"
        released = held = forgotten = 0
        try:
            records = store.read_many(names)
            for record in records.values():
                if record.holder:
                    held += 1
                    node = Node(record.holder, record.active_ip or "")
                    released += int(store.release(record.name, node, record.token))
                forgotten += int(_forgets(store, record.name))
        except StoreError as exc:
            return f"could not release {names[0]}: {exc} (it expires after its lease)"
        finally:
            store.close()
        what = names[0] if len(names) == 1 else f"{len(names)} drill locks ({names[0]}...)"
        if not records:
            return f"no record of {what} in the store"
        by_us = f"released {released} still held by a stopped node; " if held else ""
        if forgotten == len(records):
            return f"{what}: {by_us}forgotten (their fencing tokens stay spent)"
        return f"{what}: {by_us}{forgotten} of {len(records)} forgotten, the rest left as released records"

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Stop the nodes; remove the temp dir after a normal end (unless ``verdict_pending``: the
        caller then decides, :meth:`keep_or_discard`) and on Ctrl-C; keep it after an error."""
        self.stop()
        if exc_type is not None:
            self.keep_or_discard(passed=issubclass(exc_type, KeyboardInterrupt))
        elif not self.verdict_pending:
            self.discard()


def sqlite_write_lock_held(url: str, wait: float = 1.5) -> bool:
    """True if ``url`` is a SQLite file whose write lock nobody released within ``wait`` seconds
    (False for every other store)."""
    if not url.startswith("sqlite"):
        return False
    from sqlalchemy.engine import make_url

    path = make_url(url).database
    if not path or path == ":memory:":
        return False
    conn = sqlite3.connect(path, timeout=wait, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return True
        raise
    finally:
        conn.close()


@contextmanager
def _signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _forgets(store: LockStore, name: str) -> bool:
    """``forget`` of a drill lock (never forced: a live lease stays); False where it stays."""
    try:
        return store.forget(name) in (FORGET_DELETED, FORGET_CLEARED)
    except NotImplementedError:
        return False
