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
* hand_off with a run also appends it to the job's history in the same UPDATE, cut to the last
  ``?history=N``: the ``runs`` text column for the only job of a lock (one history line per run), the
  ``history`` JSON object ``{job: runs}`` for the jobs of a lock group.
* set_paused is one upsert of the operator's flag (MySQL 8: upsert and read-back in one transaction).
* renew_many with a presence also upserts the node's row of ``<table>_nodes``: in the same
  statement on PostgreSQL (data-modifying CTEs) and MySQL/MariaDB (an UPDATE joining the node's
  row, inserted by a first upsert), in the same transaction on SQLite (two statements, in-process).
* claim_many is one statement over every claimed lock (the claims passed as one JSON array) that,
  on each row naming this node with the given token, renews the lease and writes the newer
  claims, and returns the rows: an UPDATE ... RETURNING on PostgreSQL and SQLite, an INSERT ...
  SELECT ... ON DUPLICATE KEY UPDATE ... RETURNING of existing rows on MariaDB (its UPDATE has no
  RETURNING). MySQL 8 runs a joined UPDATE and reads the rows back in the same short
  transaction, as its acquire does.

Failures: contention makes an acquire *uncertain* and the other writes raise
StoreUnavailableError; the backend reports outages and refused requests (see
:mod:`mutexcron.backends.sql`).

The schema (see :meth:`SQLLockStore.ddl`) is created if missing, and the columns added since the
first schema are added to an older table (``ALTER TABLE ... ADD COLUMN``, once per process, for
each column the table lacks); teams that manage their own schema can create it beforehand and the
store will use it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from ..backends.base import UncertainOutcome
from ..backends.sql import SQLBackend
from ..errors import StoreError
from ..node import NodeTraits
from ..timeutil import as_utc
from .base import (
    FORGET_CLEARED,
    FORGET_DELETED,
    FORGET_HELD,
    FORGET_MISSING,
    PRESENCE_TTL,
    AcquireResult,
    BatchClaimResult,
    FireClaim,
    HandOff,
    HeldClaim,
    LockStore,
    Node,
    Presence,
    RunInfo,
    claim_won,
    fire_times_from_json,
    group_claims,
    hand_off_rounds,
    history_option,
    lost_claims,
    stored_nonce,
    won_claims,
)
from .record import (
    LockRecord,
    NodePresence,
    dump_attrs,
    dump_triggers,
    entry_ended,
    entry_job,
    is_history_entry,
    load_attrs,
    load_locks,
    load_triggers,
    optional_float,
)
from .sql_statements import HISTORY_COLUMN, HISTORY_NONE, HISTORY_OBJECT, MARIADB, NO_CLAIM, STATEMENTS
from .sql_statements import json_path as _json_path

if TYPE_CHECKING:
    from ..tasks.wakeups.base import Waker

__all__ = ["SQLLockStore"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _history_lists(lock: str, history: Any, runs: str | None, keep: int) -> dict[str, list[Any]]:
    """The ``history`` object and the ``runs`` column as ``{job: [entry, ...]}``, each job's runs
    oldest first (a job that was in a lock group and alone on its lock has runs in both), the last
    ``keep`` (0: all). In the object a job's runs are one entry per line (in the earlier form, a
    JSON array of entries); in the column each line also names its job, unless it is ``lock``."""
    jobs = {job: _entries(text) for job, text in _load_fires(history).items()}
    in_object, merged = {job for job, entries in jobs.items() if entries}, set()
    for entry in _entries(runs):
        if is_history_entry(entry):
            job = entry_job(entry, lock)
            merged.update({job} & in_object)
            jobs.setdefault(job, []).append(entry)
    for job in merged:  # runs from both places: by end time before the cut
        jobs[job].sort(key=entry_ended)
    return {job: entries[-keep:] if keep else entries for job, entries in jobs.items()}


def _entries(runs: Any) -> list[Any]:
    if isinstance(runs, list):
        return runs
    return [json.loads(line) for line in str(runs or "").split("\n") if line]


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
        history: runs kept per job in the run history (wins over ``?history=``; default 20).
        **engine_options: passed to the backend's engine (with a URL only).
    """

    #: Use ``RETURNING`` when the server turns out to be MariaDB. Tests set it False in a subclass to
    #: run the MySQL 8 path (upsert and read-back in one transaction) on MariaDB.
    _use_mariadb_returning = True

    def __init__(
        self, url: str | SQLBackend, *, connect_timeout: float | None = None, history: int | None = None, **engine_options: Any
    ) -> None:
        if isinstance(url, SQLBackend):
            if connect_timeout is not None or engine_options:
                raise TypeError("connection options belong to the backend: SQLBackend(url, connect_timeout=..., ...)")
            backend = url
            _, self.history_length = history_option(url.url, history)
        else:
            url, self.history_length = history_option(url, history)  # the driver must not see ?history=
            extra = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
            backend = SQLBackend(url, **extra, **engine_options)
        super().__init__(backend.url)
        self.backend = backend
        #: The lock table.
        self.table = backend.table
        self._sql = STATEMENTS[backend.dialect.name].bind(self.table, backend.clock)
        #: The presence table (the lock table's name + ``_nodes``).
        self.nodes_table = f"{self.table}_nodes"
        self.floor_table = f"{self.table}_floor"  # one row: the token floor (see ``forget``)
        self._floor_mutex = threading.Lock()
        self._floor_copy: tuple[float | None, int] = (None, 0)  # (time.monotonic() read, value): MySQL
        self._presence_rows: set[str] = set()  # nodes whose presence row this store object has written
        self._nodes_sql: str | None = None  # the presence read, chosen at its first use (:meth:`_nodes_read`)
        self._pads = False  # set when the table is first used: a MySQL table whose collation ignores trailing spaces
        # One node's writes of many rows (renewals, claims, hand-offs: its own held rows, from three
        # threads) go one at a time: two of them locking the same rows in different orders would
        # deadlock each other, and the database would break the tie only after its deadlock timeout.
        self._many_rows = threading.RLock()

    @property
    def engine(self) -> Engine:
        """The backend's SQLAlchemy engine."""
        return self.backend.engine

    def ddl(self) -> list[str]:
        """The CREATE statements for this table and database (``mutexcron ddl`` prints them).

        Then the presence table's, and, as a ``--`` comment, the ``ALTER TABLE`` statements that
        bring a lock table created by an earlier mutexcron up to date (the store runs them itself).
        """
        statements = [*self._add_column_statements(), *self._add_column_statements(nodes=True)]
        upgrade = "\n".join(f"--   {statement};" for statement in statements)
        note = f"-- lock and presence tables created by an earlier mutexcron get these columns:\n{upgrade}"
        tables = [s.replace("COLLATE=utf8mb4_bin", "COLLATE=utf8mb4_nopad_bin") for s in (*self._sql.ddl, *self._sql.nodes_ddl)]
        if self._sql.dialect == "mysql":
            tables.append("-- on MySQL 8, COLLATE=utf8mb4_0900_bin (a binary collation that does not ignore trailing spaces)")
        return [*tables, note]

    def _add_column_statements(self, names: Iterable[str] | None = None, *, nodes: bool = False) -> list[str]:
        wanted = None if names is None else set(names)
        table, columns = (self.nodes_table, self._sql.added_node_columns) if nodes else (self.table, self._sql.added_columns)
        wanted_columns = [(name, definition) for name, definition in columns if wanted is None or name in wanted]
        return [f"ALTER TABLE {table} ADD COLUMN {name} {definition}" for name, definition in wanted_columns]

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
        for statement in (*self._sql.ddl, *self._sql.nodes_ddl):
            self.backend.create(conn, self.backend.with_key_collation(conn, statement))
        self._add_columns(conn)
        self._pads = self.backend.pads_spaces(conn, self.table, "name")

    def _columns(self, conn: Connection, table: str) -> set[str]:
        return {str(column["name"]).lower() for column in sqlalchemy.inspect(conn).get_columns(table)}

    def _add_columns(self, conn: Connection) -> None:
        """Add the columns the lock and presence tables created by an earlier mutexcron lack (another
        node may add them at the same time)."""
        tables = ((self.table, self._sql.added_columns), (self.nodes_table, self._sql.added_node_columns))
        for nodes, (table, added) in enumerate(tables):
            missing = {name for name, _ in added} - self._columns(conn, table)
            for statement in self._add_column_statements(missing, nodes=bool(nodes)):
                try:
                    conn.execute(self.backend.text(statement))
                except sa_exc.DBAPIError:
                    if missing - self._columns(conn, table):  # not a concurrent ALTER that added them: a real failure
                        raise
                    break
                log.info("%s: %s", self.masked_url, statement)

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
        (name, holder, ip, token, hb, ttl_ms, attrs, fires, started, finished, error, *pause, age) = tuple(row)
        paused, paused_at, paused_by, catch_up, zone, triggers = pause
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
            paused=bool(paused),
            paused_at=as_utc(paused_at),
            paused_by=paused_by,
            resume_catch_up=bool(catch_up),
            zone=zone,
            triggers=load_triggers(triggers),
        )
        return record, fires or {}

    def _record(self, row: Any) -> LockRecord:
        return self._parse(row)[0]

    # -- LockStore ---------------------------------------------------------------------------
    def acquire_or_renew(
        self, name: str, node: Node, ttl: float, claim: FireClaim | None = None
    ) -> AcquireResult:
        job = claim.job_id if claim else ""
        self._ensure_table()
        if self._pads:  # a name ending with a space would be another lock's row
            self.backend.refuse_padded([name], "lock name", self.table)
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
        if self._sql.floor_cached:
            params["floor"] = self._floor()
        try:
            rows = self._upsert(params)
        except UncertainOutcome:
            # Contention: a lost insert race, a lock wait timeout, a deadlock, a busy database.
            log.debug("acquire of %r met contention; uncertain", name)
            return AcquireResult(False, self.read(name) or LockRecord(name=name), False, uncertain=True)
        if rows:  # the row as this statement left it (RETURNING, or MySQL's read in the same transaction)
            record, fires = self._parse(rows[0])
            acquired = record.holder == node.node_id
            return AcquireResult(acquired, record, acquired and claim_won(fires, claim), claimed_by=stored_nonce(fires, claim))
        # Refused (PostgreSQL and SQLite return no row): re-read to show the holder.
        current = self.read(name)
        if current is None:  # refused: a row is there (forget deletes only rows retired long ago, with no holder)
            raise StoreError(f"lock {name!r} vanished from {self.table} on {self.masked_url} during acquire")
        # Held by this node although this statement was refused: another call of this node took it
        # in between. Not this call's renewal.
        return AcquireResult(False, current, False, uncertain=current.holder == node.node_id)

    def _floor(self) -> int:
        """The token floor as read at most ``retired_keep / 4`` seconds ago (MySQL's ``acquire`` binds it).

        Safe: a record is deleted only ``retired_keep`` seconds after the floor was raised for it
        (:meth:`forget`), so a floor read less than that ago already covers every record deleted
        before a write that uses it.
        """
        with self._floor_mutex:
            read_at, value = self._floor_copy
            if read_at is not None and time.monotonic() - read_at < max(0.0, self.retired_keep) / 4:
                return value
        rows, _ = self._execute(self._sql.floor_read, {}, "acquire (token floor)")
        fresh = int(rows[0][0]) if rows else 0
        with self._floor_mutex:
            self._floor_copy = (time.monotonic(), max(fresh, self._floor_copy[1]))
            return self._floor_copy[1]

    def _upsert(self, params: Mapping[str, Any]) -> list[Any]:
        """Run the conditional upsert; return the row it left, or [] if refused without RETURNING."""
        self._ensure_table()  # first: it picks MariaDB's statements once it knows the server
        if self._sql.acquire_returns_row:
            return self._execute(self._sql.acquire, params, "acquire", write=True)[0]
        return self._run(lambda conn: self.backend.transaction(conn, lambda c: self._upsert_and_read(c, params)), "acquire")

    def _upsert_and_read(self, conn: Connection, params: Mapping[str, Any], sql: str | None = None) -> list[Any]:
        """MySQL 8 has no RETURNING: upsert (``sql``, default the acquire), then read the row back, in one short transaction.

        The upsert keeps the row locked until COMMIT, so the read (READ COMMITTED, set per session)
        sees exactly what this upsert left. Two autocommit statements would let another claim of
        the same lock land in between, and this call would read that claim's nonce as a loss.
        """
        text = self.backend.text
        conn.execute(text(sql or self._sql.acquire), dict(params))
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
        history = HISTORY_NONE
        if run is not None:
            params.update(dur=max(0.0, run.duration), dur_us=int(max(0.0, run.duration) * 1e6), err=run.error)
            if self.history_length > 0:  # ?history=0: no history written
                history = HISTORY_COLUMN if run.sole_job else HISTORY_OBJECT
                params.update(self._history_params(name, node, token, run))
        _, count = self._write(self._sql.hand_off[attrs is not None, run is not None, history], params, "hand_off")
        return bool(count == 1)

    def hand_off_many(self, node: Node, items: Sequence[HandOff]) -> list[bool]:
        with self._many_rows:
            return self._hand_off_many(node, items)

    def _hand_off_many(self, node: Node, items: Sequence[HandOff]) -> list[bool]:
        """One UPDATE over every item (``hand_off_many``; items of one lock in rounds, one UPDATE
        each, in one transaction). MySQL/MariaDB return a count: if not every item was written, one
        read says which were (as ``renew_many`` does)."""
        if not items:
            return []
        records = [self._item_record(node, item) for item in items]  # AttrsError before any write
        self._ensure_table()
        rounds = hand_off_rounds(items)
        if len(rounds) == 1:
            written = self._hand_off_round(node, rounds[0], records, None)
        else:

            def work(conn: Connection) -> set[int]:
                return {i for r in rounds for i in self._hand_off_round(node, r, records, conn)}

            written = self._transaction(work, "hand_off")
        return [i in written for i in range(len(items))]

    def _hand_off_round(
        self, node: Node, round_: Sequence[tuple[int, HandOff]], records: Sequence[dict[str, Any]], conn: Connection | None
    ) -> set[int]:
        """One UPDATE of one round (no lock twice): the indexes of the items it wrote."""
        params = {"me": node.node_id, "hn": self.history_length, "items": json.dumps([records[i] for i, _ in round_])}
        if conn is None:
            rows, count = self._write(self._sql.hand_off_many, params, "hand_off")
        else:
            result = conn.execute(self.backend.text(self._sql.hand_off_many), params)
            rows, count = (list(result.fetchall()) if result.returns_rows else []), result.rowcount
        if self._sql.hand_off_many_returns_names:
            names = {row[0] for row in rows}
        elif count == len(round_):
            names = {item.lock for _, item in round_}
        else:
            names = self._still_held(node, {item.lock: item.token for _, item in round_}, conn)
        return {i for i, item in round_ if item.lock in names}

    def _still_held(self, node: Node, leases: Mapping[str, int], conn: Connection | None) -> set[str]:
        """The names of ``leases`` whose row names ``node`` with that token (MySQL/MariaDB: what a count cannot say)."""
        if conn is None:
            current = self.read_many(leases)
            return {n for n, rec in current.items() if rec.holder == node.node_id and rec.token == leases[n]}
        sql, params = self._sql.renew_shape(self._sql.claim_read, leases)
        rows = conn.execute(self.backend.text(sql), {"me": node.node_id, **params}).fetchall()
        return {row[0] for row in rows}

    def _item_record(self, node: Node, item: HandOff) -> dict[str, Any]:
        """One item of ``hand_off_many`` as the statement reads it (keys without a value left out)."""
        record: dict[str, Any] = {"n": item.lock, "tok": item.token, "set_attrs": 0, "has_run": 0, "hkind": ""}
        if item.attrs is not None:
            record.update(set_attrs=1, new_attrs=dump_attrs(item.attrs, job=item.lock))
        run = item.run
        if run is not None:
            duration = max(0.0, run.duration)
            record.update(has_run=1, dur=duration, dur_us=int(duration * 1e6))
            if run.error is not None:
                record["err"] = run.error
            if self.history_length > 0:
                record["hkind"] = HISTORY_COLUMN if run.sole_job else HISTORY_OBJECT
                record.update(self._history_params(item.lock, node, item.token, run))
                record.pop("hn", None)
        return record

    def _history_params(self, name: str, node: Node, token: int, run: RunInfo) -> dict[str, Any]:
        job = run.job or name
        if run.sole_job:  # the runs column: a line names its job, unless it is the lock's own name
            return {"htail": run.history_tail(node, token, None if job == name else job), "hn": self.history_length}
        return {"hjob": job, "hpath": _json_path(job), "htail": run.history_tail(node, token), "hn": self.history_length}

    def renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        with self._many_rows:
            return self._renew_many(node, leases, presence)

    def _renew_many(self, node: Node, leases: Mapping[str, int], presence: Presence | None = None) -> set[str]:
        if presence is not None:
            return self._renew_with_presence(node, leases, presence)
        if not leases:
            return set()
        sql, params = self._sql.renew_shape(self._sql.renew_many, leases)
        rows, count = self._write(sql, {"me": node.node_id, **params}, "renew")
        return self._renewed(node, leases, rows, count)

    def _renewed(self, node: Node, leases: Mapping[str, int], rows: list[Any], count: int) -> set[str]:
        """The names a renewal renewed: returned by it, or (MySQL/MariaDB: a count only) read back if not all were."""
        if self._sql.renew_returns_names:
            return {r[0] for r in rows}
        if count == len(leases):
            return set(leases)
        # MySQL/MariaDB UPDATE has no RETURNING: one read says which ones were renewed.
        current = self.read_many(leases)
        return {n for n, rec in current.items() if rec.holder == node.node_id and rec.token == leases[n]}

    # -- presence ----------------------------------------------------------------------------
    def _presence_params(self, node: Node, leases: Mapping[str, int], presence: Presence) -> dict[str, Any]:
        return {
            "me": node.node_id,
            "ip": node.ip,
            "version": presence.version[:64],
            "offset": presence.clock_offset,
            "locks": presence.locks_text(leases),
            "traits": presence.traits.json_text(),
            "dur": float(PRESENCE_TTL),
            "dur_us": PRESENCE_TTL * 1_000_000,
        }

    def _renew_with_presence(self, node: Node, leases: Mapping[str, int], presence: Presence) -> set[str]:
        """The renewal and the presence upsert in one statement (PostgreSQL, MySQL/MariaDB) or one transaction (SQLite)."""
        self._ensure_table()
        params = self._presence_params(node, leases, presence)
        first = node.node_id not in self._presence_rows
        if first or not leases or not self._sql.renew_presence:
            # The node's first presence from this store object (stale rows are pruned then), a
            # presence alone, or SQLite: the upsert, with the renewal in the same transaction.
            renewed = self._upsert_presence(node, leases, params, prune=first)
            self._presence_rows.add(node.node_id)
            return renewed
        sql, lease_params = self._sql.renew_shape(self._sql.renew_presence, leases)
        rows, count = self._write(sql, {**params, **lease_params}, "renew")
        if not self._sql.renew_returns_names:  # MySQL: the count includes the node's row
            if count == 0:  # the node's row is gone (pruned after 10 minutes of silence): insert it again
                self._presence_rows.discard(node.node_id)
                return self._renew_with_presence(node, leases, presence)
            count -= 1
        return self._renewed(node, leases, rows, count)

    def _upsert_presence(self, node: Node, leases: Mapping[str, int], params: Mapping[str, Any], *, prune: bool) -> set[str]:
        """Upsert this node's presence (after pruning stale ones if ``prune``) and renew ``leases``: one transaction."""
        renew_sql, lease_params = self._sql.renew_shape(self._sql.renew_many, leases) if leases else ("", {})

        def work(conn: Connection) -> tuple[list[Any], int]:
            text = self.backend.text
            if prune:
                conn.execute(text(self._sql.presence_prune), dict(params))
            conn.execute(text(self._sql.presence_upsert), dict(params))
            if not leases:
                return [], 0
            result = conn.execute(text(renew_sql), {"me": node.node_id, **lease_params})
            return (list(result.fetchall()) if result.returns_rows else []), result.rowcount

        rows, count = self._transaction(work, "renew")
        return self._renewed(node, leases, rows, count) if leases else set()

    def _transaction(self, work: Callable[[Connection], _T], what: str) -> _T:
        """``work`` in one short transaction (:meth:`SQLBackend.run_in_transaction`)."""
        self._ensure_table()
        return self.backend.run_in_transaction(work, self._sql.begin, what)

    def nodes(self, *, prune: bool = True) -> list[NodePresence]:
        params = {"dur": float(PRESENCE_TTL), "dur_us": PRESENCE_TTL * 1_000_000}
        if prune:  # the read below skips the old rows either way
            self._write(self._sql.presence_prune, params, "nodes (prune)")
        rows, _ = self._execute(self._nodes_read(), params, "nodes")
        return [
            NodePresence(
                node_id=node_id,
                ip=ip,
                version=version,
                last_seen=as_utc(seen),
                age=None if age is None else max(0.0, float(age)),
                clock_offset=optional_float(offset),
                locks=load_locks(locks),
                traits=NodeTraits.from_json(traits),
            )
            for node_id, ip, version, seen, offset, locks, traits, age in rows
        ]

    def _nodes_read(self) -> str:
        """The presence read. A reader alters nothing: on a presence table from before the nodes'
        weight and tags (a cluster not upgraded yet), it reads none (every node weighs 1)."""
        self._ensure_table()  # first: it picks MariaDB's statements once it knows the server
        if self._nodes_sql is None:
            sql = self._sql.nodes_read
            if self.backend.read_only:
                columns = self.backend.run(lambda conn: self._columns(conn, self.nodes_table), "checking columns")
                if columns and "traits" not in columns:
                    sql = sql.replace("locks, traits,", "locks, NULL AS traits,")
            self._nodes_sql = sql
        return self._nodes_sql

    # -- pause and history -------------------------------------------------------------------
    def set_paused(self, name: str, paused: bool, by: str, *, catch_up: bool = False) -> LockRecord:
        params = {"name": name, "paused": bool(paused), "by": by, "catch_up": bool(catch_up and not paused)}
        self._ensure_table()  # first: it picks MariaDB's statements once it knows the server
        if self._pads:
            self.backend.refuse_padded([name], "lock name", self.table)
        if self._sql.acquire_returns_row:
            rows, _ = self._write(self._sql.set_paused, params, "set_paused")
        else:
            work = lambda conn: self._upsert_and_read(conn, params, self._sql.set_paused)  # noqa: E731
            rows = self._transaction(work, "set_paused")
        if not rows:
            raise StoreError(f"lock {name!r} vanished from {self.table} on {self.masked_url} during set_paused")
        return self._record(rows[0])

    def forget(self, name: str, *, force: bool = False) -> str:
        """One transaction: delete a record never held; else, unless a holder's lease is live (and
        not ``force``), raise the token floor to its token and retire it; then delete the records
        retired at least ``retired_keep`` seconds ago."""
        keep = max(0.0, float(self.retired_keep))
        reap = {"dur": keep, "dur_us": int(keep * 1_000_000)}

        def work(conn: Connection) -> str:
            text = self.backend.text
            if conn.execute(text(self._sql.forget_unheld), {"name": name}).rowcount == 1:
                return FORGET_DELETED
            found = conn.execute(text(self._sql.forget_lock_row), {"name": name}).fetchall()
            if not found:
                return FORGET_MISSING
            token, free = int(found[0][0]), bool(found[0][1])
            if not (free or force):
                return FORGET_HELD
            conn.execute(text(self._sql.floor_raise), {"token": token})
            with self._floor_mutex:  # this process's own acquires see the new floor at once
                self._floor_copy = (self._floor_copy[0], max(self._floor_copy[1], token))
            conn.execute(text(self._sql.forget), {"name": name, "token": token, "off": False})
            conn.execute(text(self._sql.forget_retired), reap)
            return FORGET_CLEARED

        return self._transaction(work, "forget")

    def forget_node(self, node_id: str, *, min_age: float = 0.0) -> bool:
        params = {"node": node_id, "dur": float(min_age), "dur_us": int(min_age * 1_000_000)}
        _, count = self._write(self._sql.forget_node, params, "forget_node")
        return bool(count == 1)

    def _stored_history(self, locks: Sequence[str]) -> dict[str, Mapping[str, Any]]:
        params = {f"n{i}": n for i, n in enumerate(locks)}
        sql = self._sql.history_read.replace("{names}", ", ".join(f":n{i}" for i in range(len(locks))))
        rows, _ = self._execute(sql, params, "history")
        return {name: _history_lists(name, history, runs, self.history_length) for name, history, runs in rows}

    def claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        with self._many_rows:
            return self._claim_many(node, claims)

    def _claim_many(self, node: Node, claims: Sequence[HeldClaim]) -> BatchClaimResult:
        groups = group_claims(claims)
        if not groups:
            return BatchClaimResult()
        self._ensure_table()  # first: it picks MariaDB's statements once it knows the server
        params = {"me": node.node_id, **self._sql.claim_shape(groups)}
        if self._sql.claim_returns_rows:
            rows, _ = self._write(self._sql.claim_many, params, "claim_many")
        else:
            rows = self._claim_and_read(params, {name: group.token for name, group in groups.items()})
        ours = [row for row in rows if row[1] == node.node_id and row[0] in groups and int(row[2]) == groups[row[0]].token]
        fires = {name: _load_fires(value) for name, _, _, value, _ in ours}
        paused = frozenset(name for name, _, _, _, flag in ours if flag)
        lost = lost_claims(groups, {name: value for name, value in fires.items() if name not in paused})
        return BatchClaimResult(frozenset(fires), won_claims(groups, fires), paused, lost)

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

        return self._transaction(work, "claim_many")

    def release(self, name: str, node: Node, token: int) -> bool:
        _, count = self._write(self._sql.release, {"name": name, "me": node.node_id, "token": token}, "release")
        return bool(count == 1)

    def hand_over(self, name: str, node: Node, token: int, successor: str, within: float) -> bool:
        params = {"name": name, "me": node.node_id, "token": token, "to": successor, "ttl_ms": max(1, int(within * 1000))}
        self._ensure_table()
        notice = self._sql.hand_over_notice
        if not notice:
            _, count = self._write(self._sql.hand_over, params, "hand_over")
            return bool(count == 1)

        def work(conn: Connection) -> bool:  # the notice leaves only if the hand-over commits
            text = self.backend.text
            if conn.execute(text(self._sql.hand_over), params).rowcount != 1:
                return False
            conn.execute(text(notice), {"channel": self.hand_over_channel, "to": successor})
            return True

        return self._transaction(work, "hand_over")

    @property
    def hand_over_channel(self) -> str:
        """PostgreSQL: the channel of hand-over notices (the lock table's name + ``_hand_over``)."""
        return f"{self.table}_hand_over"

    def hand_over_waker(self, node_id: str) -> Waker | None:
        if not self._sql.hand_over_notice:
            return None
        from ..tasks.wakeups.postgresql import PostgreSQLWaker  # psycopg: imported only here

        return PostgreSQLWaker(self.backend, self.hand_over_channel, [node_id])

    def set_zone(
        self, name: str, node: Node, token: int, zone: str | None, triggers: Mapping[str, str] | None = None
    ) -> bool:
        params = {"name": name, "me": node.node_id, "token": token, "zone": zone, "triggers": dump_triggers(triggers)}
        _, count = self._write(self._sql.set_zone, params, "set_zone")
        return count == 1

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
