"""SQL lock stores: ``sqlite://``, ``mysql://``/``mariadb://``, ``postgresql://``.

One row per lock. Every operation is one statement (see :mod:`mutexcron.locks.sql_statements`),
run in autocommit (READ COMMITTED) by a :class:`~mutexcron.backends.sql.SQLBackend`:

* acquire/renew is a conditional upsert; the lock is free when it has no holder, the caller holds
  it, or the holder's heartbeat is older than the holder's own ``ttl_ms`` **by the database
  clock** (``clock_timestamp()``, ``UTC_TIMESTAMP(6)``, SQLite ``'now'``). The per-tick fire claim
  is part of the same statement. PostgreSQL, SQLite and MariaDB return the row with
  ``RETURNING``; MySQL (no ``RETURNING``) reads it back in the same short transaction, whose row
  lock keeps other writers out until the read is done.
* hand_off, renew_many and release are conditional UPDATEs on holder **and** token.
* claim_many is one statement over every claimed lock (the claims passed as one JSON array) that,
  on each row naming this node with the given token, renews the lease and writes the newer
  claims, and returns the rows: an UPDATE ... RETURNING on PostgreSQL and SQLite, an INSERT ...
  SELECT ... ON DUPLICATE KEY UPDATE ... RETURNING of existing rows on MariaDB (its UPDATE has no
  RETURNING). MySQL 8 runs a joined UPDATE and reads the rows back in the same short
  transaction, as its acquire does.

Failures: contention makes an acquire *uncertain* and the other writes raise
StoreUnavailableError; the backend reports outages and refused requests (see
:mod:`mutexcron.backends.sql`).

The schema (see :meth:`SQLLockStore.ddl`) is created if missing; teams that manage their own
schema can create it beforehand and the store will use it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine

from ..backends.base import UncertainOutcome
from ..backends.sql import SQLBackend
from ..errors import StoreError
from ..record import LockRecord, dump_attrs, load_attrs
from ..timeutil import as_utc
from .base import (
    AcquireResult,
    BatchClaimResult,
    FireClaim,
    HeldClaim,
    LockStore,
    Node,
    RunInfo,
    claim_won,
    fire_times_from_json,
    group_claims,
    won_claims,
)
from .sql_statements import MARIADB, NO_CLAIM, STATEMENTS
from .sql_statements import json_path as _json_path

__all__ = ["SQLLockStore"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _load_fires(fires: Any) -> dict[str, Any]:
    """The ``fires`` column as a dict (PostgreSQL returns it parsed, the others as JSON text)."""
    if isinstance(fires, (str, bytes)):
        fires = json.loads(fires or "{}")
    return fires if isinstance(fires, dict) else {}


class SQLLockStore(LockStore):
    """Lock records in one SQL table (``?table=``, default ``mutexcron_locks``).

    Args:
        url: ``sqlite:///path``, ``mysql://``, ``mysql+pymysql://``, ``mariadb://``,
            ``postgresql://`` or ``postgres://`` (any driver options SQLAlchemy accepts), or a
            ready :class:`SQLBackend`.
        connect_timeout: seconds to wait for a connection before failing closed (with a URL only).
        **engine_options: passed to the backend's engine (with a URL only).
    """

    #: Use ``RETURNING`` when the server turns out to be MariaDB. Tests set it False in a subclass to
    #: run the MySQL 8 path (upsert and read-back in one transaction) on MariaDB.
    _use_mariadb_returning = True

    def __init__(self, url: str | SQLBackend, *, connect_timeout: float | None = None, **engine_options: Any) -> None:
        if isinstance(url, SQLBackend):
            if connect_timeout is not None or engine_options:
                raise TypeError("connection options belong to the backend: SQLBackend(url, connect_timeout=..., ...)")
            backend = url
        elif connect_timeout is None:
            backend = SQLBackend(url, **engine_options)
        else:
            backend = SQLBackend(url, connect_timeout=connect_timeout, **engine_options)
        super().__init__(backend.url)
        self.backend = backend
        #: The lock table.
        self.table = backend.table
        self._sql = STATEMENTS[backend.dialect.name].bind(self.table, backend.clock)

    @property
    def engine(self) -> Engine:
        """The backend's SQLAlchemy engine."""
        return self.backend.engine

    def ddl(self) -> list[str]:
        """The CREATE statements for this table and database (``mutexcron ddl`` prints them)."""
        return list(self._sql.ddl)

    # -- plumbing ----------------------------------------------------------------------------
    def _ensure_table(self) -> None:
        self.backend.setup_once(
            self.table,
            self._create_table,
            f"creating table {self.table!r}",
            "create it yourself with the DDL that `mutexcron ddl` prints",
        )

    def _create_table(self, conn: Connection) -> None:
        # The mysql dialect serves MySQL 8 and MariaDB; only the server can say which one it is.
        if self._use_mariadb_returning and self._sql.dialect == "mysql" and self.backend.is_mariadb(conn):
            self._sql = MARIADB.bind(self.table, self.backend.clock)
        for statement in self._sql.ddl:
            self.backend.create(conn, statement)

    def _run(self, work: Callable[[Connection], _T], what: str) -> _T:
        self._ensure_table()
        return self.backend.run(work, what)

    def _execute(self, sql: str, params: Mapping[str, Any], what: str, *, write: bool = False) -> tuple[list[Any], int]:
        """Run one statement; return the fetched rows and the rowcount.

        Raises UncertainOutcome on contention if ``write``; a read that meets contention is an outage.
        """
        self._ensure_table()
        return self.backend.execute(sql, params, what, write=write)

    def _write(self, sql: str, params: Mapping[str, Any], what: str) -> tuple[list[Any], int]:
        """A fenced write other than acquire: contention is not a refusal, the caller retries."""
        try:
            return self._execute(sql, params, what, write=True)
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc

    def _parse(self, row: Any) -> tuple[LockRecord, dict[str, Any]]:
        """A row -> (record, raw fires JSON incl. claim nonces)."""
        (name, holder, ip, token, hb, ttl_ms, attrs, fires, started, finished, error, age) = tuple(row)
        if isinstance(fires, (str, bytes)):
            fires = json.loads(fires or "{}")
        record = LockRecord(
            name=name,
            holder=holder,
            active_ip=ip,
            token=int(token),
            update_time=as_utc(hb),
            heartbeat_age=None if age is None else max(0.0, float(age)),
            ttl=int(ttl_ms) / 1000.0,
            fire_times=fire_times_from_json(fires),
            last_run_started=as_utc(started),
            last_run_finished=as_utc(finished),
            last_error=error,
            attrs=load_attrs(attrs),
        )
        return record, fires or {}

    def _record(self, row: Any) -> LockRecord:
        return self._parse(row)[0]

    # -- LockStore ---------------------------------------------------------------------------
    def acquire_or_renew(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None = None
    ) -> AcquireResult:
        job = claim.job_id if claim else ""
        params = {
            "name": name,
            "me": node.node_id,
            "ip": node.ip,
            "ttl_ms": max(1, int(ttl * 1000)),
            "job": job,
            "jpath0": _json_path(job) + "[0]",
            "ft": claim.fire_us if claim else NO_CLAIM,
            "nonce": claim.nonce if claim else "",
        }
        try:
            rows = self._upsert(params)
        except UncertainOutcome:
            # Contention: a lost insert race, a lock wait timeout, a deadlock, a busy database.
            log.debug("acquire of %r met contention; uncertain", name)
            return AcquireResult(False, self.read(name) or LockRecord(name=name), False, uncertain=True)
        if rows:  # the row as this statement left it (RETURNING, or MySQL's read in the same transaction)
            record, fires = self._parse(rows[0])
            acquired = record.holder == node.node_id
            return AcquireResult(acquired, record, acquired and claim_won(fires, claim))
        # Refused (PostgreSQL and SQLite return no row): re-read to show the holder.
        current = self.read(name)
        if current is None:  # the first acquire creates the row; only a DELETE by hand removes it
            raise StoreError(f"lock {name!r} vanished from {self.table} on {self.masked_url} during acquire")
        # Held by this node although this statement was refused: another call of this node took it
        # in between. Not this call's renewal.
        return AcquireResult(False, current, False, uncertain=current.holder == node.node_id)

    def _upsert(self, params: Mapping[str, Any]) -> list[Any]:
        """Run the conditional upsert; return the row it left, or [] if refused without RETURNING."""
        self._ensure_table()  # first: it picks MariaDB's statements once it knows the server
        if self._sql.acquire_returns_row:
            return self._execute(self._sql.acquire, params, "acquire", write=True)[0]
        return self._run(lambda conn: self.backend.transaction(conn, lambda c: self._upsert_and_read(c, params)), "acquire")

    def _upsert_and_read(self, conn: Connection, params: Mapping[str, Any]) -> list[Any]:
        """MySQL 8 has no RETURNING: upsert, then read the row back, in one short transaction.

        The upsert keeps the row locked until COMMIT, so the read (READ COMMITTED, set per session)
        sees exactly what this upsert left. Two autocommit statements would let another claim of
        the same lock land in between, and this call would read that claim's nonce as a loss.
        """
        text = self.backend.text
        conn.execute(text(self._sql.acquire), dict(params))
        return list(conn.execute(text(self._sql.read_one), {"name": params["name"]}).fetchall())

    def hand_off(
        self,
        name: str,
        node: Node,
        token: int,
        attrs: Mapping[str, Any] | None = None,
        run: RunInfo | None = None,
    ) -> bool:
        params: dict[str, Any] = {"name": name, "me": node.node_id, "token": token}
        if attrs is not None:
            params["attrs"] = dump_attrs(attrs, job=name)
        if run is not None:
            params.update(dur=max(0.0, run.duration), dur_us=int(max(0.0, run.duration) * 1e6), err=run.error)
        _, count = self._write(self._sql.hand_off[attrs is not None, run is not None], params, "hand_off")
        return bool(count == 1)

    def renew_many(self, node: Node, leases: Mapping[str, int]) -> set[str]:
        if not leases:
            return set()
        sql, params = self._sql.renew_shape(self._sql.renew_many, leases)
        rows, count = self._write(sql, {"me": node.node_id, **params}, "renew")
        if self._sql.renew_returns_names:
            return {r[0] for r in rows}
        if count == len(leases):
            return set(leases)
        # MySQL/MariaDB UPDATE has no RETURNING: one read says which ones were renewed.
        current = self.read_many(leases)
        return {n for n, rec in current.items() if rec.holder == node.node_id and rec.token == leases[n]}

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        groups = group_claims(claims)
        if not groups:
            return BatchClaimResult()
        self._ensure_table()  # first: it picks MariaDB's statements once it knows the server
        params = {"me": node.node_id, **self._sql.claim_shape(groups)}
        if self._sql.claim_returns_rows:
            rows, _ = self._write(self._sql.claim_many, params, "claim_many")
        else:
            rows = self._claim_and_read(params, {name: group.token for name, group in groups.items()})
        fires = {
            name: _load_fires(value)
            for name, holder, token, value in rows
            if holder == node.node_id and name in groups and int(token) == groups[name].token
        }
        return BatchClaimResult(frozenset(fires), won_claims(groups, fires))

    def _claim_and_read(self, params: Mapping[str, Any], leases: Mapping[str, int]) -> list[Any]:
        """MySQL 8: the claiming UPDATE, then the renewed rows, in one short transaction.

        The UPDATE keeps the rows it renewed locked until COMMIT, so the read sees exactly what it
        wrote; a row it did not renew cannot come to name this node with that token meanwhile (a
        token never comes back).
        """
        read, read_params = self._sql.renew_shape(self._sql.claim_read, leases)
        read_params["me"] = params["me"]

        def work(conn: Connection) -> list[Any]:
            text = self.backend.text
            conn.execute(text(self._sql.claim_many), dict(params))
            return list(conn.execute(text(read), read_params).fetchall())

        try:
            return self._run(lambda conn: self.backend.transaction(conn, work), "claim_many")
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc

    def release(self, name: str, node: Node, token: int) -> bool:
        _, count = self._write(self._sql.release, {"name": name, "me": node.node_id, "token": token}, "release")
        return bool(count == 1)

    def read(self, name: str) -> LockRecord | None:
        rows, _ = self._execute(self._sql.read_one, {"name": name}, "read")
        return self._record(rows[0]) if rows else None

    def read_many(self, names: Iterable[str]) -> dict[str, LockRecord]:
        names = list(names)
        if not names:
            return {}
        params = {f"n{i}": n for i, n in enumerate(names)}
        sql = self._sql.read_many.replace("{names}", ", ".join(f":n{i}" for i in range(len(names))))
        rows, _ = self._execute(sql, params, "read")
        return {rec.name: rec for rec in map(self._record, rows)}

    def list(self) -> list[LockRecord]:
        rows, _ = self._execute(self._sql.read_all, {}, "list")
        return [self._record(r) for r in rows]

    def ping(self) -> None:
        self._execute("SELECT 1", {}, "ping")  # through _execute: the first call creates the table

    def close(self) -> None:
        self.backend.close()
