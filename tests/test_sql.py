"""SQL-store specifics against the real servers: dropped connections, round trips per operation."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from mutexcron.backends.sql_dialects import OPERATION_TIMEOUT
from mutexcron.backends.sql_pool import POOL_IDLE_TIMEOUT, POOL_MIN_IDLE, IdleTrimmingPool
from mutexcron.errors import ConfigurationError, StoreError, StoreUnavailableError
from mutexcron.locks import FireClaim, Node, RunInfo
from mutexcron.locks.sql import SQLLockStore
from tests.backends import FakeClock, StoreCtx, backend_params

A = Node("a:1:aa", "10.0.0.1")
B = Node("b:2:bb", "10.0.0.2")


def _own_connection_id(store: SQLLockStore) -> int:
    query = "SELECT pg_backend_pid()" if store.engine.dialect.name == "postgresql" else "SELECT CONNECTION_ID()"
    with store.engine.connect() as conn:
        return int(conn.execute(sqlalchemy.text(query)).scalar_one())


@pytest.mark.parametrize("kind", backend_params("mysql", "postgresql"))
def test_a_connection_the_server_dropped_is_replaced_without_failing_the_operation(ctx: StoreCtx) -> None:
    store = ctx.make()
    assert isinstance(store, SQLLockStore)
    assert store.acquire_or_renew("l", A, ttl=60).acquired
    victim = _own_connection_id(store)
    killer = ctx.make()
    assert isinstance(killer, SQLLockStore)
    kill = "SELECT pg_terminate_backend(:id)" if store.engine.dialect.name == "postgresql" else "KILL :id"
    with killer.engine.connect() as conn:
        conn.execute(sqlalchemy.text(kill), {"id": victim})
    result = store.acquire_or_renew("l", A, ttl=60, claim=FireClaim.new("job", 1))
    assert result.acquired and result.claimed and result.token == 1


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql"))
def test_holder_hot_path_is_one_statement_and_renew_many_is_one_for_any_count(ctx: StoreCtx) -> None:
    store = ctx.make()
    assert isinstance(store, SQLLockStore)
    store.acquire_or_renew("hot", A, ttl=60)
    statements: list[str] = []
    sqlalchemy.event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    store.acquire_or_renew("hot", A, ttl=60, claim=FireClaim.new("job", 5))
    mysql_without_returning = store.engine.dialect.name == "mysql" and not store.engine.dialect.is_mariadb
    # MySQL 8: START TRANSACTION, the upsert, the read-back, COMMIT (see test_mysql8_path_is_one_short_transaction).
    assert len(statements) == (4 if mysql_without_returning else 1), statements
    for count in (1, 100, 2000):
        leases = {f"n{i}": store.acquire_or_renew(f"n{i}", A, ttl=60).token for i in range(count)}
        statements.clear()
        assert store.renew_many(A, leases) == set(leases)
        assert len(statements) == 1, f"renew_many of {count} locks took {len(statements)} statements"


# -- contention is uncertain: neither a renewal nor a loss (B8) --------------------------------
def _short_lock_waits(store: SQLLockStore) -> None:
    """Make ``store`` give up a row or database lock after a fraction of a second (1 s on MariaDB, its minimum)."""
    dialect = store.engine.dialect.name
    if dialect == "sqlite":
        return  # the test builds the SQLite store with connect_timeout=0.2, its busy timeout
    statement = "SET SESSION innodb_lock_wait_timeout = 1" if dialect == "mysql" else "SET lock_timeout = 200"

    @sqlalchemy.event.listens_for(store.engine, "connect")
    def _set(dbapi_conn: Any, _record: Any) -> None:  # runs after the store's own session settings
        cur = dbapi_conn.cursor()
        cur.execute(statement)
        cur.close()
        dbapi_conn.commit()


@contextmanager
def _writer_in_the_way(store: SQLLockStore, name: str, *, insert: bool = False) -> Iterator[None]:
    """Another session holds the write lock on lock ``name`` (SQLite: the whole database) until the block ends.

    ``insert``: the other session is inserting ``name`` (not committed yet), as in a lost insert race.
    """
    if store.engine.dialect.name == "sqlite":
        raw = sqlite3.connect(store.engine.url.database or "", isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")  # takes the database's write lock, as a frozen writer would
        try:
            yield
        finally:
            raw.execute("ROLLBACK")
            raw.close()
        return
    other = sqlalchemy.create_engine(store.engine.url)
    try:
        if insert:
            sql = f"INSERT INTO {store.table} (name, attrs, fires) VALUES (:n, '{{}}', '{{}}')"
        else:
            sql = f"SELECT name FROM {store.table} WHERE name = :n FOR UPDATE"
        with other.connect() as conn:  # not autocommit: the row lock is held until the block ends
            conn.execute(sqlalchemy.text(sql), {"n": name})
            yield
            conn.rollback()
    finally:
        other.dispose()


def _contended_store(ctx: StoreCtx) -> SQLLockStore:
    store = SQLLockStore(ctx.url or "", connect_timeout=0.2) if ctx.kind == "sqlite" else ctx.make()
    assert isinstance(store, SQLLockStore)
    ctx.opened.append(store)
    _short_lock_waits(store)
    return store


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql"))
def test_acquire_that_meets_contention_is_uncertain_not_a_renewal(ctx: StoreCtx) -> None:
    store = _contended_store(ctx)
    held = store.acquire_or_renew("l", A, ttl=60)
    assert held.acquired and not held.uncertain
    with _writer_in_the_way(store, "l"):
        busy = store.acquire_or_renew("l", A, ttl=60, claim=FireClaim.new("job", 1))
        assert busy.uncertain is True and busy.acquired is False and busy.claimed is False, busy
        assert busy.record.holder == A.node_id and busy.token == 1, "the re-read record still shows the holder"
        # The other writes meet the same contention: an outage for the caller, never a refusal.
        for write in (
            lambda: store.hand_off("l", A, 1, {"k": 1}),
            lambda: store.renew_many(A, {"l": 1}),
            lambda: store.release("l", A, 1),
        ):
            with pytest.raises(StoreUnavailableError):
                write()
    after = store.acquire_or_renew("l", A, ttl=60, claim=FireClaim.new("job", 1))
    assert after.acquired and after.claimed and not after.uncertain and after.token == 1


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql"))
def test_lost_insert_race_on_a_new_lock_is_uncertain(ctx: StoreCtx) -> None:
    store = _contended_store(ctx)
    store.ping()  # creates the table
    with _writer_in_the_way(store, "new", insert=True):
        lost = store.acquire_or_renew("new", A, ttl=60, claim=FireClaim.new("job", 1))
    assert lost.uncertain and not lost.acquired and not lost.claimed, lost
    assert lost.record.name == "new" and lost.record.holder is None, "nothing committed to show yet"
    assert store.acquire_or_renew("new", A, ttl=60).acquired


@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_refused_upsert_then_held_by_this_node_is_uncertain(ctx: StoreCtx) -> None:
    """The upsert is refused (B holds the lock); before the re-read, another thread of node A takes it.

    That acquire is not this call's: the call reports uncertain, not a renewal. (PostgreSQL returns
    no row from a refused upsert, so the store re-reads; MariaDB returns the row it refused.)
    """
    store, other = ctx.make(), ctx.make()
    assert isinstance(store, SQLLockStore)
    assert other.acquire_or_renew("l", B, ttl=60).acquired
    done: list[bool] = []

    @sqlalchemy.event.listens_for(store.engine, "after_cursor_execute")
    def _other_thread(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().startswith("INSERT") and not done:
            done.append(True)
            assert other.release("l", B, 1)
            assert other.acquire_or_renew("l", A, ttl=60).acquired

    result = store.acquire_or_renew("l", A, ttl=60, claim=FireClaim.new("job", 1))
    assert done and result.uncertain and not result.acquired and not result.claimed, result
    assert result.record.holder == A.node_id and result.token == 2


# -- MySQL 8 (no RETURNING): the upsert and its read-back are one transaction (C14) -----------
class MySQL8Store(SQLLockStore):
    """MySQL 8's code path on MariaDB: upsert, then read the row back (MariaDB would use RETURNING)."""

    _use_mariadb_returning = False


def _mysql8_store(ctx: StoreCtx) -> MySQL8Store:
    store = MySQL8Store(ctx.url or "")
    ctx.opened.append(store)
    store.ping()  # connects (and creates the table) with the dialect forced
    assert not store._sql.acquire_returns_row, "the seam must select the MySQL 8 path"
    return store


@contextmanager
def _audited_fires(store: SQLLockStore) -> Iterator[Callable[[], set[str]]]:
    """Log every ``fires`` value written to the lock table; yield a function returning the nonces written."""
    audit = f"{store.table}_audit"
    ddl = [
        f"CREATE TABLE {audit} (id INT AUTO_INCREMENT PRIMARY KEY, fires LONGTEXT)",
        f"CREATE TRIGGER {store.table}_ai AFTER INSERT ON {store.table} FOR EACH ROW "
        f"INSERT INTO {audit} (fires) VALUES (NEW.fires)",
        f"CREATE TRIGGER {store.table}_au AFTER UPDATE ON {store.table} FOR EACH ROW "
        f"INSERT INTO {audit} (fires) SELECT NEW.fires FROM DUAL WHERE NOT (NEW.fires <=> OLD.fires)",
    ]
    with store.engine.connect() as conn:
        for statement in ddl:
            conn.execute(sqlalchemy.text(statement))

    def written() -> set[str]:
        with store.engine.connect() as conn:
            rows = conn.execute(sqlalchemy.text(f"SELECT fires FROM {audit}")).scalars().all()
        return {json.loads(fires)["job"][1] for fires in rows if "job" in json.loads(fires)}

    try:
        yield written
    finally:
        with store.engine.connect() as conn:
            conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {audit}"))


@pytest.mark.parametrize("kind", backend_params("mysql"))
def test_mysql8_path_reports_every_claim_it_wrote(ctx: StoreCtx) -> None:
    """Two claims for one job from one node (a catch-up and a regular fire): each one's answer is its own.

    The audit trigger logs every nonce the database stored; a claim whose nonce was stored must
    report ``claimed``, or its fire time is never run. With two autocommit statements, the earlier
    claim could read back the later claim's nonce.
    """
    store = _mysql8_store(ctx)
    rounds = 300
    barrier = threading.Barrier(2)
    results: list[tuple[str, bool]] = []
    errors: list[BaseException] = []

    def claim(offset: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(timeout=30)
                fire = FireClaim.new("job", 2 * r + offset)  # thread 2 always claims the later time
                results.append((fire.nonce, store.acquire_or_renew("l", A, ttl=60, claim=fire).claimed))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    with _audited_fires(store) as written:
        threads = [threading.Thread(target=claim, args=(offset,)) for offset in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        stored = written()
    wrong = [(nonce, claimed) for nonce, claimed in results if claimed != (nonce in stored)]
    assert not wrong, f"{len(wrong)} of {len(results)} claims misreported, e.g. {wrong[:3]}"
    assert len(stored) >= rounds, "every round stores at least the later claim"


@pytest.mark.parametrize("kind", backend_params("mysql"))
def test_mysql8_path_is_one_short_transaction(ctx: StoreCtx) -> None:
    store = _mysql8_store(ctx)
    store.acquire_or_renew("hot", A, ttl=60)
    statements: list[str] = []
    sqlalchemy.event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2].split()[0]))
    assert store.acquire_or_renew("hot", A, ttl=60, claim=FireClaim.new("job", 5)).claimed
    assert statements == ["START", "INSERT", "SELECT", "COMMIT"]
    assert not store.acquire_or_renew("hot", B, ttl=60).acquired
    with store.engine.connect() as conn:  # the pooled connection is back in autocommit, no transaction open
        assert conn.execute(sqlalchemy.text("SELECT @@in_transaction")).scalar_one() == 0


@pytest.mark.parametrize("kind", backend_params("mysql"))
@pytest.mark.parametrize("insert", [False, True], ids=["held-row", "new-row"])
def test_mysql8_path_contention_is_uncertain_and_leaves_no_transaction_open(ctx: StoreCtx, insert: bool) -> None:
    store = MySQL8Store(ctx.url or "", pool_size=1, max_overflow=0)  # one connection: the one that failed
    ctx.opened.append(store)
    _short_lock_waits(store)
    name = "new" if insert else "l"
    store.ping()  # creates the table
    if not insert:
        assert store.acquire_or_renew(name, A, ttl=60).acquired
    with _writer_in_the_way(store, name, insert=insert):
        busy = store.acquire_or_renew(name, A, ttl=60, claim=FireClaim.new("job", 1))
        assert busy.uncertain and not busy.acquired and not busy.claimed, busy
        with store.engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("SELECT @@in_transaction")).scalar_one() == 0
    assert store.acquire_or_renew(name, A, ttl=60, claim=FireClaim.new("job", 1)).claimed


# -- table names, timeouts (C15) -----------------------------------------------------------------
@pytest.mark.parametrize("table", ["locks%0A", "locks%0D", "locks%0A%0A", "%0Alocks", "9locks", "a" * 64, "lo-cks"])
def test_bad_table_names_are_refused(tmp_path: Path, table: str) -> None:
    with pytest.raises(ConfigurationError, match="bad \\?table="):
        SQLLockStore(f"sqlite:///{tmp_path}/l.db?table={table}")


@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_postgresql_connections_detect_a_dead_peer(ctx: StoreCtx) -> None:
    """TCP keepalives and tcp_user_timeout are set on the real socket: a partitioned connection fails within seconds."""
    store = ctx.make()
    assert isinstance(store, SQLLockStore)
    store.ping()
    with store.engine.connect() as conn:
        fd = conn.connection.dbapi_connection.pgconn.socket  # type: ignore[union-attr]
        with socket.socket(fileno=os.dup(fd)) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            count = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
            assert idle + interval * count <= OPERATION_TIMEOUT
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == OPERATION_TIMEOUT * 1000
        settings = "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
        assert tuple(conn.execute(sqlalchemy.text(settings)).one()) == ("10s", "5s")


@pytest.fixture
def hung_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # keep it open, say nothing
            except TimeoutError:
                continue
            except OSError:
                return

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


@pytest.mark.parametrize("scheme", ["mysql://root", "postgresql://postgres"])
def test_hung_server_fails_closed_within_the_connect_timeout(hung_server: int, scheme: str) -> None:
    # PyMySQL waits for the server's greeting under read_timeout (OPERATION_TIMEOUT): shortened here.
    options = {"connect_args": {"read_timeout": 1}} if scheme.startswith("mysql") else {}
    store = SQLLockStore(f"{scheme}:s3cret@127.0.0.1:{hung_server}/test", connect_timeout=1, **options)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            store.acquire_or_renew("l", A, ttl=60)
        assert time.monotonic() - started < 4  # PostgreSQL's driver waits at least 2 s
        assert "s3cret" not in str(info.value)
    finally:
        store.close()


# -- a request the database refuses is not an outage (F20) ---------------------------------------
def _refused(store: SQLLockStore, call: Callable[[], object]) -> StoreError:
    with pytest.raises(StoreError) as info:
        call()
    assert not isinstance(info.value, StoreUnavailableError), f"a request error reported as an outage: {info.value}"
    return info.value


@pytest.mark.parametrize("kind", backend_params("mysql"))
def test_mysql_oversized_write_is_a_request_error_sent_once(ctx: StoreCtx) -> None:
    store = ctx.make()
    assert isinstance(store, SQLLockStore)
    token = store.acquire_or_renew("big", A, ttl=60).token
    with store.engine.connect() as conn:
        limit = int(conn.execute(sqlalchemy.text("SELECT @@max_allowed_packet")).scalar_one())
    sent: list[int] = []
    sqlalchemy.event.listen(
        store.engine, "before_cursor_execute", lambda c, cur, sql, params, *a: sent.append(len(str(params)))
    )
    error = _refused(store, lambda: store.hand_off("big", A, token, {"blob": "x" * (limit + 1_000_000)}))
    assert "max_allowed_packet" in str(error)
    assert len([n for n in sent if n > limit]) == 1, "an oversized request is not sent twice"
    assert store.hand_off("big", A, token, {"blob": "small"}), "the store still works"


@pytest.mark.parametrize("kind", backend_params("mysql", "postgresql"))
def test_values_the_database_refuses_are_request_errors(ctx: StoreCtx) -> None:
    store = ctx.make()
    assert isinstance(store, SQLLockStore)
    token = store.acquire_or_renew("bad", A, ttl=60).token
    # Out of range for the database's integer/interval arithmetic (MySQL 1916, PostgreSQL 22008).
    _refused(store, lambda: store.hand_off("bad", A, token, None, RunInfo(duration=1e300)))
    # A NUL byte or a lone surrogate in an error text is no longer refused: RunInfo stores it sanitised
    # (test_history.py). A value too long for its column still is (MySQL 1406).
    if store.engine.dialect.name != "postgresql":
        _refused(store, lambda: store.hand_off("bad", A, token, None, RunInfo(duration=1, error="e" * 70_000)))  # 1406
    assert store.hand_off("bad", A, token, {"ok": 1}, RunInfo(duration=1, error="fine"))


@pytest.mark.parametrize("kind", backend_params("mysql"))
def test_mysql_operations_send_no_hidden_rollback(ctx: StoreCtx) -> None:
    """Closing an autocommit connection must not cost a ROLLBACK round trip (PyMySQL sends one)."""
    store = SQLLockStore(ctx.url or "", pool_size=1, max_overflow=0)  # one connection: its session counters
    ctx.opened.append(store)
    store.acquire_or_renew("l", A, ttl=60)

    def rollbacks() -> int:
        with store.engine.connect() as conn:
            rows = conn.execute(sqlalchemy.text("SHOW SESSION STATUS LIKE 'Com_rollback'")).all()
        return int(rows[0][1])

    before = rollbacks()
    for _ in range(10):
        store.acquire_or_renew("l", A, ttl=60)
        store.hand_off("l", A, 1, {"k": 1})
    assert rollbacks() - before == 0


# -- the pool rule: keep what the node uses at once, close what it stopped using ------------------
def _pool(store: SQLLockStore) -> IdleTrimmingPool:
    pool = store.engine.pool
    assert isinstance(pool, IdleTrimmingPool)
    return pool


def _opened_and_closed(store: SQLLockStore) -> tuple[list[int], list[int]]:
    """Lists that grow by one for each DBAPI connection the store's pool opens, and closes."""
    opened: list[int] = []
    closed: list[int] = []
    sqlalchemy.event.listen(store.engine, "connect", lambda *_: opened.append(1))
    sqlalchemy.event.listen(store.engine, "close", lambda *_: closed.append(1))
    return opened, closed


def _burst(store: SQLLockStore, width: int) -> None:
    """``width`` connections in use at once, then all returned: a burst of concurrent store calls."""
    connections = [store.engine.connect() for _ in range(width)]
    for conn in connections:
        conn.close()


def _threads_at_once(store: SQLLockStore, threads: int) -> None:
    """``threads`` threads each in a store call at the same time (each holds its connection until all do)."""
    barrier = threading.Barrier(threads, timeout=10)

    def call() -> None:
        store.backend.run(lambda conn: (conn.exec_driver_sql("SELECT 1").all(), barrier.wait()), "burst")

    workers = [threading.Thread(target=call) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=15)
    assert not barrier.broken


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql"))
def test_every_second_bursts_on_all_threads_reuse_their_connections(ctx: StoreCtx) -> None:
    """10 executor threads + heartbeat + catch-up calling at once, burst after burst: no connection churn."""
    store = ctx.make()
    assert isinstance(store, SQLLockStore)
    store.ping()
    opened, closed = _opened_and_closed(store)
    _threads_at_once(store, 12)
    assert len(opened) == 11, "the first burst opens what it needs (one was open already)"
    for _ in range(3):
        _threads_at_once(store, 12)
    assert (len(opened), len(closed)) == (11, 0), "later bursts open and close nothing"
    assert (_pool(store).checkedin(), _pool(store).checkedout()) == (12, 0)


def test_connections_left_unused_for_the_idle_timeout_are_closed_down_to_the_minimum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(IdleTrimmingPool, "_clock", staticmethod(clock))
    store = SQLLockStore(f"sqlite:///{tmp_path}/l.db")
    store.ping()
    _, closed = _opened_and_closed(store)
    _burst(store, 8)
    assert _pool(store).checkedin() == 8
    clock.advance(POOL_IDLE_TIMEOUT - 1)
    store.ping()  # a quiet node: one call at a time, on the most recently used connection
    assert _pool(store).checkedin() == 8 and not closed, "not idle long enough yet"
    clock.advance(2)
    store.ping()
    assert _pool(store).checkedin() == POOL_MIN_IDLE
    assert len(closed) == 8 - POOL_MIN_IDLE
    _burst(store, 8)  # the next peak opens what it needs again
    assert _pool(store).checkedin() == 8
    store.close()


def test_one_call_at_a_time_reuses_the_most_recent_connection(tmp_path: Path) -> None:
    """Last in, first out: the connections a quiet node does not need stay unused, so they can age out."""
    store = SQLLockStore(f"sqlite:///{tmp_path}/l.db")
    _burst(store, 5)
    seen = set()
    for _ in range(10):
        with store.engine.connect() as conn:
            seen.add(id(conn.connection.dbapi_connection))
    assert len(seen) == 1
    store.close()


def test_size_pool_sets_how_many_connections_are_kept(tmp_path: Path) -> None:
    store = SQLLockStore(f"sqlite:///{tmp_path}/l.db")
    opened, closed = _opened_and_closed(store)
    _burst(store, 15)
    assert _pool(store).checkedin() == 12, "default: 10 executor threads + heartbeat + catch-up"
    assert len(closed) == 3, "connections over the pool size are closed when they come back"
    store.backend.size_pool(20)  # the scheduler, with a 18-thread executor
    _burst(store, 20)
    assert _pool(store).checkedin() == 20
    store.backend.size_pool(4)
    assert _pool(store).checkedin() == 4, "idle connections beyond the new size are closed at once"
    assert len(opened) - len(closed) == 4
    with pytest.raises(ValueError, match="at least 1"):
        store.backend.size_pool(0)
    store.close()
    assert _pool(store).size() == 4 and _pool(store).checkedin() == 0, "closing keeps the size, not the connections"


@pytest.mark.parametrize("url_option, engine_options", [("?pool_size=3", {}), ("", {"pool_size": 3})])
def test_an_explicit_pool_size_keeps_that_many_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url_option: str, engine_options: dict[str, Any]
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(IdleTrimmingPool, "_clock", staticmethod(clock))
    store = SQLLockStore(f"sqlite:///{tmp_path}/l.db{url_option}", **engine_options)
    _burst(store, 6)
    assert _pool(store).checkedin() == 3
    clock.advance(10 * POOL_IDLE_TIMEOUT)
    store.ping()
    assert _pool(store).checkedin() == 3, "never trimmed below the size the user chose"
    store.backend.size_pool(12)
    assert _pool(store).size() == 3, "size_pool leaves an explicit choice alone"
    store.close()


@pytest.mark.parametrize("size", ["0", "-1", "abc", "1.5"])
def test_bad_pool_sizes_are_refused(tmp_path: Path, size: str) -> None:
    with pytest.raises(ConfigurationError, match="bad \\?pool_size="):
        SQLLockStore(f"sqlite:///{tmp_path}/l.db?pool_size={size}")


def test_a_pool_class_of_the_callers_own_is_used_as_given(tmp_path: Path) -> None:
    store = SQLLockStore(f"sqlite:///{tmp_path}/l.db", poolclass=sqlalchemy.pool.NullPool)
    assert store.acquire_or_renew("l", A, ttl=60).acquired
    assert isinstance(store.engine.pool, sqlalchemy.pool.NullPool)
    store.backend.size_pool(12)  # nothing to size: no error
    store.close()


def test_a_caller_waits_for_a_connection_to_come_back_then_fails_closed(tmp_path: Path) -> None:
    store = SQLLockStore(f"sqlite:///{tmp_path}/l.db", pool_size=1, max_overflow=0, connect_timeout=0.5)
    store.ping()
    held = store.engine.connect()
    threading.Timer(0.1, held.close).start()
    store.ping()  # waits for the held connection, then uses it
    held = store.engine.connect()
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        store.ping()
    assert 0.4 < time.monotonic() - started < 3, "waits pool_timeout (the connect timeout), no longer"
    held.close()
    store.ping()
    store.close()


# -- SQLite: one writer at a time -------------------------------------------------------------------
def test_sqlite_writers_of_one_process_take_turns_on_one_mutex_per_file(tmp_path: Path) -> None:
    """A holder's executor threads hand off together: they queue on the file's mutex in this process
    (not in SQLite's busy handler, which sleeps 1, 2, 5 ms... between tries), whatever store and
    URL spelling they write through; every write lands."""
    from mutexcron.backends.sql import write_mutex
    from mutexcron.tasks import task_store_from_url

    path = tmp_path / "turns.db"
    locks = SQLLockStore(f"sqlite:///{path}")
    again = SQLLockStore(f"sqlite:///{tmp_path}/./turns.db")
    tasks = task_store_from_url(f"sqlite:///{path}")
    try:
        mutex = write_mutex(str(path))
        assert locks.backend._write_mutex is mutex and again.backend._write_mutex is mutex
        assert tasks.backend._write_mutex is mutex  # type: ignore[attr-defined]
        tokens = {f"l{i}": locks.acquire_or_renew(f"l{i}", A, ttl=60).token for i in range(12)}
        failures: list[BaseException] = []

        def hand_off(name: str) -> None:
            try:
                for run in range(30):
                    assert (again if run % 2 else locks).hand_off(name, A, tokens[name], {"run": run}, RunInfo(0.001))
            except BaseException as exc:  # reported below
                failures.append(exc)

        threads = [threading.Thread(target=hand_off, args=(name,)) for name in tokens]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not failures, failures
        assert all(locks.read(name).attrs == {"run": 29} for name in tokens)  # type: ignore[union-attr]
    finally:
        for store in (locks, again, tasks):
            store.close()


def test_a_sqlite_write_that_waits_past_the_busy_timeout_for_its_turn_is_contention(tmp_path: Path) -> None:
    """A write waits for this process's other writers no longer than for another process's (the
    busy timeout), and then fails as contention does; reads never wait for a turn."""
    from mutexcron.backends.sql import SQLBackend, write_mutex

    path = tmp_path / "held.db"
    store = SQLLockStore(SQLBackend(f"sqlite:///{path}", connect_timeout=0.3))
    try:
        token = store.acquire_or_renew("l", A, ttl=60).token
        mutex = write_mutex(str(path))
        taken = threading.Event()
        release = threading.Event()

        def hold() -> None:  # another thread of this process in the middle of a write
            with mutex.lock:
                taken.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert taken.wait(5)
        try:
            assert store.read("l") is not None  # a read does not queue
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="other writers of this process"):
                store.hand_off("l", A, token, {"k": 1})
            assert 0.25 < time.monotonic() - started < 5
            assert store.acquire_or_renew("l", A, ttl=60).uncertain  # an acquire is uncertain, not refused
        finally:
            release.set()
            holder.join(timeout=10)
        assert store.hand_off("l", A, token, {"k": 2}) and store.read("l").attrs == {"k": 2}  # type: ignore[union-attr]
    finally:
        store.close()
