"""SQL task stores: ``sqlite://``, ``mysql://``/``mariadb://``, ``postgresql://``.

One row per task in its own table (``?tasks_table=``, default ``mutexcron_tasks``), on the same
:class:`~mutexcron.backends.sql.SQLBackend` (engine, pool, clock, error translation) as the lock
store. The statements are in :mod:`mutexcron.tasks.sql_statements`, one row per dialect:

* ``add`` first inserts the task unless it exists: one statement, the common case. If it
  exists, one short transaction locks the row (``FOR UPDATE``; SQLite ``BEGIN IMMEDIATE``), reads
  its state, due and the database's clock, decides with the one rule every store shares
  (:func:`mutexcron.tasks.checks.decide_add`) and writes. A task removed between the two steps is
  inserted again.
* ``claim`` is one statement on PostgreSQL (``FOR UPDATE SKIP LOCKED`` in a CTE, ``UPDATE ...
  RETURNING``) and SQLite (``UPDATE ... WHERE rowid IN (SELECT ... LIMIT n) RETURNING``), and one
  short READ COMMITTED transaction on MySQL/MariaDB (``SELECT ... FOR UPDATE SKIP LOCKED``, the
  UPDATE, the read back).
* Every worker write (renew, complete, release) carries the fence: running, owned by the caller,
  with the caller's token. ``complete`` and ``release`` are a short list of conditional
  statements that exclude each other (cancelled / a pending re-add / neither): the first that
  matches is the only write; if none does, one read says whether the fence failed (False) or the
  row changed between two statements (try again).

Failures: the backend reports outages and refused requests; contention (a lock wait timeout, a
busy SQLite file) raises StoreUnavailableError, as for the lock store's writes.

The schema (:meth:`SQLTaskStore.ddl`) is created if missing; teams that manage their own schema
can create it beforehand.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from ..backends.base import UncertainOutcome
from ..backends.sql import TABLE_RE, SQLBackend
from ..errors import ConfigurationError, StoreError, StoreUnavailableError
from ..timeutil import as_utc
from ..urls import mask_url, pop_query
from .base import AddResult, Done, Due, Fail, Outcome, Reschedule, TaskRecord, TaskStore
from .checks import (
    check_claim,
    check_codes,
    check_due,
    check_lease,
    check_on_conflict,
    check_outcome,
    check_state,
    check_task,
    check_time,
    decide_add,
    dump_payload,
    error_text,
    load_payload,
    resolve_due,
)
from .sql_statements import STATEMENTS

__all__ = ["DEFAULT_TASKS_TABLE", "SQLTaskStore"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_TASKS_TABLE = "mutexcron_tasks"
#: Rounds of a multi-statement write whose row keeps changing between statements before giving up.
_ROUNDS = 5


class SQLTaskStore(TaskStore):
    """Tasks in one SQL table.

    Args:
        url: ``sqlite:///path``, ``mysql://``, ``mariadb://``, ``postgresql://`` (any driver options
            SQLAlchemy accepts, the backend's ``?table=``/``?pool_size=``, and ``?tasks_table=``),
            or a ready :class:`SQLBackend` (shared with a lock store).
        tasks_table: the table, instead of ``?tasks_table=``.
        connect_timeout: seconds to wait for a connection before failing closed (with a URL only).
        **engine_options: passed to the backend's engine (with a URL only).
    """

    def __init__(
        self,
        url: str | SQLBackend,
        *,
        tasks_table: str | None = None,
        connect_timeout: float | None = None,
        **engine_options: Any,
    ) -> None:
        if isinstance(url, SQLBackend):
            if connect_timeout is not None or engine_options:
                raise TypeError("connection options belong to the backend: SQLBackend(url, connect_timeout=..., ...)")
            backend, shown = url, url.url
        else:
            shown = url
            url, options = pop_query(url, "tasks_table")  # the backend would hand it to the driver
            tasks_table = tasks_table or options.get("tasks_table")
            extra = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
            backend = SQLBackend(url, **extra, **engine_options)
        super().__init__(shown)
        self.backend = backend
        #: The task table.
        self.table = tasks_table or DEFAULT_TASKS_TABLE
        if not TABLE_RE.fullmatch(self.table):
            raise ConfigurationError(
                f"bad tasks table {self.table!r} in {mask_url(shown)}: use letters, digits and _ "
                "(at most 63, not starting with a digit)"
            )
        self._sql = STATEMENTS[backend.dialect.name].bind(self.table)

    def ddl(self) -> list[str]:
        """The CREATE statements for this table and database."""
        return list(self._sql.ddl)

    # -- plumbing ----------------------------------------------------------------------------
    def _ensure_table(self) -> None:
        self.backend.setup_once(
            self.table,
            self._create_table,
            f"creating table {self.table!r}",
            "create it yourself with the DDL that `mutexcron ddl` prints (SQLTaskStore.ddl())",
        )

    def _create_table(self, conn: Connection) -> None:
        for statement in self._sql.ddl:
            self.backend.create(conn, statement)

    def _read(self, sql: str, params: Mapping[str, Any], what: str) -> list[Any]:
        self._ensure_table()
        return self.backend.execute(sql, params, what)[0]

    def _write(self, sql: str, params: Mapping[str, Any], what: str) -> tuple[list[Any], int]:
        """One write; contention is not a refusal: StoreUnavailableError, the caller retries."""
        self._ensure_table()
        try:
            return self.backend.execute(sql, params, what, write=True)
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc

    def _transaction(self, work: Callable[[Connection], _T], what: str) -> _T:
        """``work`` in one short transaction opened with the dialect's ``begin`` (SQLite: BEGIN IMMEDIATE)."""
        self._ensure_table()
        begin = self._sql.begin

        def run(conn: Connection) -> _T:
            conn.exec_driver_sql(begin)
            try:
                result = work(conn)
                conn.exec_driver_sql("COMMIT")
            except BaseException:
                try:
                    conn.exec_driver_sql("ROLLBACK")
                except sa_exc.SQLAlchemyError:
                    conn.invalidate()  # never return a connection to the pool with row locks held
                raise
            return result

        try:
            return self.backend.run(run, what)
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc

    def _time(self, value: datetime | None) -> Any:
        return None if value is None else self._sql.time_param(value)

    def _record(self, row: Any) -> TaskRecord:
        (code, key, due, payload, state, attempt, token, owner, lease_until, last_error) = tuple(row[:10])
        (pending_due, pending_payload, cancel_requested, created, updated) = tuple(row[10:15])
        return TaskRecord(
            code=code,
            key=key,
            due=_utc(due),
            payload=load_payload(payload),
            state=state,
            attempt=int(attempt),
            token=int(token),
            owner=owner,
            lease_until=as_utc(lease_until),
            last_error=last_error,
            pending_due=as_utc(pending_due),
            pending_payload=load_payload(pending_payload),
            cancel_requested=bool(cancel_requested),
            created=as_utc(created),
            updated=as_utc(updated),
        )

    # -- producers ---------------------------------------------------------------------------
    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        code, key = check_task(code, key)
        at, delay = check_due(due)
        mode = check_on_conflict(on_conflict)
        text = dump_payload(payload, code, key)
        params = {"code": code, "key": key, "due": self._time(at), "delay": delay, "payload": text}
        for _ in range(_ROUNDS):
            if self._insert(params):
                return AddResult.INSERTED
            result = self._transaction(lambda conn: self._update_existing(conn, params, at, delay, mode), "add")
            if result is not None:
                return result
            # Cancelled or finished between the insert and the lock: insert again.
        raise StoreUnavailableError(f"{self._where(code, key)}: add did not settle (the task kept appearing and vanishing)")

    def _insert(self, params: Mapping[str, Any]) -> bool:
        """Insert the task unless it exists; True if this call inserted it."""
        self._ensure_table()
        try:
            _, count = self.backend.execute(self._sql.insert, params, "add", write=True)
        except UncertainOutcome:
            return False  # MySQL's duplicate key, or contention: the locked path decides (or reports it)
        return count == 1

    def _update_existing(
        self, conn: Connection, params: Mapping[str, Any], at: datetime | None, delay: float | None, mode: str
    ) -> AddResult | None:
        """Within the transaction: lock the task, decide, write. None if the task is gone."""
        text = self.backend.text
        key = {"code": params["code"], "key": params["key"]}
        row = conn.execute(text(self._sql.lock_row), key).fetchone()
        if row is None:
            return None
        state, due, pending_due, now = tuple(row)
        new_due = resolve_due(at, delay, _utc(now))
        result = decide_add(state, _utc(due), as_utc(pending_due), new_due, mode)
        values = {**key, "due": self._time(new_due), "payload": params["payload"]}
        if result is AddResult.REPLACED:
            conn.execute(text(self._sql.replace), values)
        elif result is AddResult.PENDING:
            conn.execute(text(self._sql.set_pending), values)
        return result

    def cancel(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        params = {"code": code, "key": key}
        for _ in range(_ROUNDS):
            if self._write(self._sql.cancel_drop, params, "cancel")[1]:
                return True
            if self._write(self._sql.cancel_mark, params, "cancel")[1]:
                return True  # running: dropped when its attempt ends
            if self.get(code, key) is None:
                return False
        raise StoreUnavailableError(f"{self._where(code, key)}: cancel did not settle (the task kept changing state)")

    def get(self, code: str, key: str) -> TaskRecord | None:
        code, key = check_task(code, key)
        rows = self._read(self._sql.read_one, {"code": code, "key": key}, "get")
        return self._record(rows[0]) if rows else None

    def list(
        self,
        *,
        code: str | None = None,
        key_contains: str | None = None,
        due_before: datetime | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> list[TaskRecord]:
        where = ["1 = 1"]
        params: dict[str, Any] = {"limit": max(0, int(limit))}
        if code is not None:
            where.append("code = :code")
            params["code"] = code
        if key_contains is not None:
            where.append(self._sql.contains)
            params["contains"] = key_contains
        if due_before is not None:
            where.append("due < :before")
            params["before"] = self._time(check_time(due_before, "due_before"))
        if state is not None:
            where.append("state = :state")
            params["state"] = check_state(state)
        sql = self._sql.list_tasks.replace("{where}", " AND ".join(where))
        return [self._record(r) for r in self._read(sql, params, "list")]

    def retry(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        return bool(self._write(self._sql.retry, {"code": code, "key": key}, "retry")[1] == 1)

    # -- workers -----------------------------------------------------------------------------
    def claim(self, node: str, codes: Iterable[str], limit: int, lease: float) -> builtins.list[TaskRecord]:
        wanted = check_codes(codes)
        limit, lease = check_claim(limit, lease)
        if not wanted:
            return []
        params = {"me": node, "n": limit, "lease": lease}
        if self._sql.claim:
            sql, listed = self._sql.codes_shape(self._sql.claim, self._sql.claim_part, wanted)
            rows = self._write(sql, {**params, **listed}, "claim")[0]
        else:
            rows = self._transaction(lambda conn: self._pick_and_take(conn, wanted, params), "claim")
        claimed = sorted(map(self._record, rows), key=lambda r: (r.due, r.code, r.key))
        for task in claimed:
            if task.cancel_requested:  # cancelled, then its worker died: drop it, never run it
                self.complete(node, task.code, task.key, task.token, Done())
        return [task for task in claimed if not task.cancel_requested]

    def _pick_and_take(self, conn: Connection, codes: Sequence[str], params: Mapping[str, Any]) -> builtins.list[Any]:
        """MySQL/MariaDB, within the transaction: lock the claimable rows (skipping locked ones), take them, read them."""
        text, sql = self.backend.text, self._sql
        assert sql.pairs_shape is not None
        pick, listed = sql.codes_shape(sql.claim_pick, sql.claim_part, codes)
        picked = [(r[0], r[1]) for r in conn.execute(text(pick), {"n": params["n"], **listed})]
        if not picked:
            return []
        take, pairs = sql.pairs_shape(sql.claim_take, picked)
        conn.execute(text(take), {"me": params["me"], "lease": params["lease"], **pairs})
        read, pairs = sql.pairs_shape(sql.claim_read, picked)
        return list(conn.execute(text(read), pairs))

    def renew(self, node: str, tokens: Mapping[tuple[str, str], int], lease: float) -> set[tuple[str, str]]:
        lease = check_lease(lease)
        if not tokens:
            return set()
        shape = self._sql.leases_shape
        assert shape is not None
        items = [(code, key, token) for (code, key), token in tokens.items()]
        sql, listed = shape(self._sql.renew, items)
        rows, count = self._write(sql, {"me": node, "lease": lease, **listed}, "renew")
        if not self._sql.renew_read:
            return {(r[0], r[1]) for r in rows}
        if count == len(items):
            return set(tokens)
        sql, listed = shape(self._sql.renew_read, items)
        return {(r[0], r[1]) for r in self._read(sql, {"me": node, **listed}, "renew")}

    def complete(self, node: str, code: str, key: str, token: int, outcome: Outcome) -> bool:
        check_outcome(outcome)
        sql = self._sql
        steps: builtins.list[tuple[str, dict[str, Any]]]
        if isinstance(outcome, Done):
            steps = [(sql.done, {}), (sql.apply_pending, {})]
        elif isinstance(outcome, Fail):
            steps = [(sql.fail, {"err": error_text(outcome.error)}), (sql.apply_pending, {}), (sql.drop_cancelled, {})]
        else:
            at, delay = check_due(outcome.due)
            due = {"due": self._time(at), "delay": delay}
            if isinstance(outcome, Reschedule):
                steps = [(sql.reschedule, due)]
            else:
                steps = [(sql.retry_later, {**due, "err": error_text(outcome.error)})]
            steps += [(sql.apply_pending, {}), (sql.drop_cancelled, {})]
        return self._finish(steps, {"code": code, "key": key, "me": node, "token": token}, "complete")

    def _finish(self, steps: Sequence[tuple[str, Mapping[str, Any]]], fence: Mapping[str, Any], what: str) -> bool:
        """Run the first of ``steps`` (fenced, mutually exclusive writes) that matches; False if the fence fails."""
        for _ in range(_ROUNDS):
            for statement, params in steps:
                if self._write(statement, {**fence, **params}, what)[1]:
                    return True
            current = self.get(fence["code"], fence["key"])
            if current is None or (current.state, current.owner, current.token) != ("running", fence["me"], fence["token"]):
                log.debug("%s of %s refused: the task was taken over or is gone", what, self._where(fence["code"], fence["key"]))
                return False
            # Still ours: a cancel or a re-add changed the row between two statements. Again.
        raise StoreUnavailableError(f"{self._where(fence['code'], fence['key'])}: {what} did not settle (the task kept changing)")

    def release(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        sql = self._sql
        no_params: Mapping[str, Any] = {}
        steps = [(sql.release, no_params), (sql.release_pending, no_params), (sql.drop_cancelled, no_params)]
        return sum(
            self._finish(steps, {"code": code, "key": key, "me": node, "token": token}, "release") for code, key, token in tasks
        )

    def next_due(self, codes: Iterable[str]) -> float | None:
        wanted = check_codes(codes)
        if not wanted:
            return None
        sql, listed = self._sql.codes_shape(self._sql.next_due, self._sql.next_due_part, wanted)
        rows = self._read(sql, listed, "next_due")
        return max(0.0, float(rows[0][0])) if rows and rows[0][0] is not None else None

    def now(self) -> datetime:
        return _utc(self._read(self._sql.select_now, {}, "now")[0][0])

    def ping(self) -> None:
        self._read("SELECT 1", {}, "ping")  # through _read: the first call creates the table

    def close(self) -> None:
        self.backend.close()

    def _where(self, code: str, key: str) -> str:
        return f"task {code!r}/{key!r} in {self.table} on {self.masked_url}"



def _utc(value: Any) -> datetime:
    """A time the database must have (a NOT NULL column, its clock) as an aware UTC datetime."""
    when = as_utc(value)
    if when is None:
        raise StoreError(f"the database returned {value!r} where a time must be")
    return when
