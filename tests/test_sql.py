"""SQL-store specifics against the real servers: dropped connections, round trips per operation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy

from mutexcron.locks import FireClaim, Node
from mutexcron.locks.sql import SQLLockStore
from tests.backends import StoreCtx, backend_params, open_backend

A = Node("a:1:aa", "10.0.0.1")
B = Node("b:2:bb", "10.0.0.2")


@pytest.fixture
def ctx(kind: str, tmp_path: Path) -> Iterator[StoreCtx]:
    with open_backend(kind, tmp_path) as ctx:
        yield ctx


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
    assert len(statements) == (2 if mysql_without_returning else 1), statements
    for count in (1, 100, 2000):
        leases = {f"n{i}": store.acquire_or_renew(f"n{i}", A, ttl=60).token for i in range(count)}
        statements.clear()
        assert store.renew_many(A, leases) == set(leases)
        assert len(statements) == 1, f"renew_many of {count} locks took {len(statements)} statements"
