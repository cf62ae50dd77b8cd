"""SQL task stores: ``sqlite://``, ``mysql://``/``mariadb://``, ``postgresql://``.

One row per task in its own table (``?tasks_table=``, default ``mutexcron_tasks``), on the same
:class:`~mutexcron.backends.sql.SQLBackend` (engine, pool, clock, error translation) as the lock
store. The statements are in :mod:`mutexcron.tasks.stores.sql_statements`, one row per dialect:

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
  row changed between two statements (try again). ``complete`` runs them in autocommit;
  ``complete_many`` and ``release`` run every item's in one short transaction (one commit; items
  in ``(code, key)`` order, so two batches never wait on each other's rows in a cycle), where the
  read locks the row (``FOR UPDATE``; SQLite's transaction holds the write lock) so the second try
  settles it. ``release`` on PostgreSQL sends the task notice once per code it queued, in the
  same transaction.

Failures: the backend reports outages and refused requests; contention (a lock wait timeout, a
busy SQLite file) raises StoreUnavailableError, as for the lock store's writes.

The schema (:meth:`SQLTaskStore.ddl`) is created if missing; teams that manage their own schema
can create it beforehand.
"""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar, Union

import sqlalchemy
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from ...backends.base import UncertainOutcome
from ...backends.sql import TABLE_RE, SQLBackend, absolute_sqlite_url
from ...errors import ConfigurationError, PartlyCompletedError, StaleTaskError, StoreError, StoreUnavailableError
from ...timeutil import as_utc
from ...urls import mask_url, pop_query
from .. import base as task_base
from ..base import AddResult, CodeSummary, Done, Due, Fail, NewTask, Outcome, Reschedule, TaskRecord, TaskStore
from ..checks import (
    CheckedTask,
    check_claim,
    check_codes,
    check_due,
    check_lease,
    check_on_conflict,
    check_outcome,
    check_state,
    check_task,
    check_time,
    checked_batch,
    decide_add,
    decode_claimed,
    dump_payload,
    error_text,
    load_payload,
    reschedule_payload,
    resolve_due,
)
from ..transactions import CallerTransaction, adapt, caller_database, own_connection
from ..wakeups.base import DEFAULT_POLL, PollWaker, Waker
from ..wakeups.listen import LOCAL_WAKERS, RegisteredPollWaker
from .sql_statements import ADDED_COLUMNS, STATEMENTS

__all__ = ["DEFAULT_TASKS_TABLE", "SQLTaskStore"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_TASKS_TABLE = "mutexcron_tasks"
#: Where the store's statements run: its own connection, or the caller's transaction.
Executor = Union[Connection, CallerTransaction]
#: Rounds of a multi-statement write whose row keeps changing between statements before giving up.
_ROUNDS = 5
#: The add results after which the task can be claimed now: the local workers are woken.
#: Tasks one multi-row insert of ``add_many`` carries (PostgreSQL).
INSERT_MANY_CHUNK = 1000
_WAKING = frozenset({AddResult.INSERTED, AddResult.REPLACED})
#: Seconds a raised token floor holds before the purge deletes under it (TaskStore.floor_settle),
#: where several writers read the floor at once: three times the longest a statement may live on
#: the store's connections (OPERATION_TIMEOUT; PostgreSQL's statement_timeout).
FLOOR_SETTLE = 30.0


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

    keeps_tombstones = True

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
            shown = url = absolute_sqlite_url(url)  # the file the logs name, whatever the working directory
            url, options = pop_query(url, "tasks_table")  # the backend would hand it to the driver
            tasks_table = tasks_table or options.get("tasks_table")
            extra = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
            backend = SQLBackend(url, **extra, **engine_options)
            if backend.dialect.name == "postgresql":
                event.listen(backend.engine, "connect", _plan_claims_by_index)
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
        #: SQLite: every add reads the floor under the database's write lock, so no wait is needed.
        self.floor_settle = 0.0 if backend.dialect.name == "sqlite" else FLOOR_SETTLE
        self._floor_ready = False
        #: The task table in this process's registry of wakers (tasks.wakeup_listen.LOCAL_WAKERS).
        self._wake_key = self._table_identity()
        self._pads = False  # set when the table is first used: a MySQL table whose collation ignores trailing spaces
        self._database: str | None = None  # the database name, for transactions of the caller's (read once)

    def ddl(self) -> list[str]:
        """The CREATE statements for this table and database (MySQL: MariaDB's collation, with MySQL 8's in a note)."""
        statements = [s.replace("COLLATE=utf8mb4_bin", "COLLATE=utf8mb4_nopad_bin") for s in self._sql.ddl]
        if self.backend.dialect.name == "mysql":
            statements.append("-- on MySQL 8, COLLATE=utf8mb4_0900_bin (a binary collation that does not ignore trailing spaces)")
        return statements

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
            self.backend.create(conn, self.backend.with_key_collation(conn, statement))
        self._add_columns(conn)
        self._pads = self.backend.pads_spaces(conn, self.table, "task_key")

    def _check_names(self, *names: str) -> None:
        """On a MySQL table whose collation pads, a name ending with a space would be another task's row: refused."""
        self._ensure_table()
        if self._pads:
            self.backend.refuse_padded(names, "task code or key", self.table)

    def _add_columns(self, conn: Connection) -> None:
        """Add the columns a table created by an earlier mutexcron lacks (another node may add them at the same time)."""

        def present() -> set[str]:
            return {str(column["name"]).lower() for column in sqlalchemy.inspect(conn).get_columns(self.table)}

        missing = [(name, definition) for name, definition in ADDED_COLUMNS if name not in present()]
        for name, definition in missing:
            statement = f"ALTER TABLE {self.table} ADD COLUMN {name} {definition}"
            try:
                conn.execute(self.backend.text(statement))  # autocommit, as every statement here
            except sa_exc.DBAPIError:
                if name not in present():  # not a concurrent ALTER that added it: a real failure
                    raise
                continue
            log.info("%s: %s", self.masked_url, statement)

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
        """``work`` in one short transaction (:meth:`SQLBackend.run_in_transaction`)."""
        self._ensure_table()
        return self.backend.run_in_transaction(work, self._sql.begin, what)

    def _time(self, value: datetime | None) -> Any:
        return None if value is None else self._sql.time_param(value)

    def _record(self, row: Any) -> TaskRecord:
        (code, key, due, payload, state, attempt, token, owner, lease_until, last_error) = tuple(row[:10])
        (pending_due, pending_payload, cancel_requested, created, updated, run_at, occurrence) = tuple(row[10:17])
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
            run_at=as_utc(run_at),
            last_error=last_error,
            pending_due=as_utc(pending_due),
            pending_payload=load_payload(pending_payload),
            cancel_requested=bool(cancel_requested),
            created=as_utc(created),
            updated=as_utc(updated),
            occurrence=None if occurrence is None else int(occurrence),
        )

    # -- producers ---------------------------------------------------------------------------
    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        code, key = check_task(code, key)
        at, delay = check_due(due)
        mode = check_on_conflict(on_conflict)
        text = dump_payload(payload, code, key)
        self._check_names(code, key)
        params = {"code": code, "key": key, "due": self._time(at), "delay": delay, "payload": text}
        for _ in range(_ROUNDS):
            if self._insert(params):
                self._wake_local(code)
                return AddResult.INSERTED
            result = self._transaction(lambda conn: self._update_existing(conn, params, at, delay, mode), "add")
            if result in (AddResult.REPLACED, AddResult.INSERTED):
                self._wake_local(code)
            if result is not None:
                return result
            # Cancelled or finished between the insert and the lock: insert again.
        raise StoreUnavailableError(f"{self._where(code, key)}: add did not settle (the task kept appearing and vanishing)")

    def add_many(self, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace") -> builtins.list[AddResult]:
        """All of ``tasks`` in one transaction: every one added, or none (see :meth:`TaskStore.add_many`)."""
        batch, mode = checked_batch(tasks), check_on_conflict(on_conflict)
        for task in batch:
            self._check_names(task.code, task.key)

        def add_all(conn: Connection) -> builtins.list[AddResult]:
            caller = own_connection(conn)
            inserted = self._insert_new(conn, batch)
            return [
                AddResult.INSERTED if (task.code, task.key) in inserted else self._add_checked(caller, task, mode)
                for task in batch
            ]

        results = self._transaction(add_all, "add_many") if batch else []
        for code in {task.code for task, result in zip(batch, results, strict=True) if result in _WAKING}:
            self._wake_local(code)
        return results

    def _insert_new(self, conn: Connection, batch: Sequence[CheckedTask]) -> set[tuple[str, str]]:
        """Where the dialect can (PostgreSQL), insert the batch's new tasks in one statement per
        :data:`INSERT_MANY_CHUNK` (tombstones revived, token kept), and notify each code once; the
        ``(code, key)`` it inserted. The others, or all elsewhere, take the one-by-one path."""
        if not self._sql.insert_many or not batch:
            return set()
        inserted: set[tuple[str, str]] = set()
        text = self.backend.text
        for start in range(0, len(batch), INSERT_MANY_CHUNK):
            chunk = batch[start : start + INSERT_MANY_CHUNK]
            params = {
                "codes": [task.code for task in chunk],
                "keys": [task.key for task in chunk],
                "dues": [task.at for task in chunk],
                "delays": [task.delay for task in chunk],
                "payloads": [task.text for task in chunk],
            }
            inserted.update((str(code), str(key)) for code, key in conn.execute(text(self._sql.insert_many), params))
        for code in sorted({code for code, _ in inserted}):
            conn.execute(text(self._sql.notify), {"code": code}).fetchall()
        return inserted

    def _insert(self, params: Mapping[str, Any]) -> bool:
        """Insert the task unless it exists; True if this call inserted it."""
        self._ensure_table()
        try:
            rows, count = self.backend.execute(self._sql.insert, params, "add", write=True)
        except UncertainOutcome:
            return False  # MySQL's duplicate key, or contention: the locked path decides (or reports it)
        return len(rows) == 1 if self._sql.notify else count == 1  # PostgreSQL's returns the notice's row

    def _update_existing(
        self, conn: Executor, params: Mapping[str, Any], at: datetime | None, delay: float | None, mode: str
    ) -> AddResult | None:
        """Within the transaction: lock the task, decide, write. None if the task is gone."""
        text = self.backend.text
        key = {"code": params["code"], "key": params["key"]}
        row = conn.execute(text(self._sql.lock_row), key).fetchone()
        if row is None:
            return None
        state, due, pending_due, now = tuple(row)
        new_due = resolve_due(at, delay, _utc(now))
        values = {**key, "due": self._time(new_due), "payload": params["payload"]}
        if state == "done":  # the tombstone of a finished task: added anew, its token kept
            conn.execute(text(self._sql.revive), values)
            if self._sql.notify:
                conn.execute(text(self._sql.notify), key)
            return AddResult.INSERTED
        result = decide_add(state, _utc(due), as_utc(pending_due), new_due, mode)
        if result is AddResult.REPLACED:
            conn.execute(text(self._sql.replace), values)
            if self._sql.notify:
                conn.execute(text(self._sql.notify), key)  # delivered when the transaction commits
        elif result is AddResult.PENDING:
            conn.execute(text(self._sql.set_pending), values)
        return result

    def cancel(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        self._check_names(code, key)
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
        self._check_names(code, key)
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
        self._check_names(code, key)
        rows, count = self._write(self._sql.retry, {"code": code, "key": key}, "retry")
        retried = (len(rows) if self._sql.notify else count) == 1  # PostgreSQL's returns the notice's row
        if retried:
            self._wake_local(code)
        return retried

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
        decoded = decode_claimed(self, node, rows, self._record, lambda r: (str(r[0]), str(r[1]), int(r[6])))
        claimed = sorted(decoded, key=lambda r: (r.due, r.code, r.key))
        cancelled = [(t.code, t.key, t.token, Done()) for t in claimed if t.cancel_requested]
        if cancelled:  # cancelled, then its worker died: drop it, never run it
            try:
                self.complete_many(node, cancelled)
            except StoreError as exc:  # the claim stands: the healthy tasks run; these are dropped by a later claim
                log.warning("claim on %s: could not drop %d cancelled task(s): %s", self.masked_url, len(cancelled), exc)
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

    def start(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        """One fenced statement marks every claim of ``tasks`` started."""
        items = [(code, key, int(token)) for code, key, token in tasks]
        shape = self._sql.leases_shape
        assert shape is not None
        if not items:
            return 0
        sql, listed = shape(self._sql.start, items)
        return self._write(sql, {"me": node, **listed}, "start")[1]

    def complete(self, node: str, code: str, key: str, token: int, outcome: Outcome) -> bool:
        steps = self._outcome_steps(check_outcome(outcome), reschedule_payload(outcome, code, key))
        return self._finish(steps, {"code": code, "key": key, "me": node, "token": token}, "complete")

    def complete_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> builtins.list[bool]:
        """Every completion's fenced statements in one short transaction (one commit).

        On PostgreSQL and SQLite, the :class:`Done` items first go in one fenced statement (the
        common case of a busy worker: the whole batch in one round trip); those it did not end
        (refused, cancelled or re-added meanwhile) go the usual way with the other outcomes. One
        completion is :meth:`complete` (one autocommit statement: fewer round trips than a
        transaction). Each item is settled as :meth:`complete` settles it, in ``(code, key)`` order.
        """
        items = [
            (code, key, int(token), self._outcome_steps(check_outcome(outcome), reschedule_payload(outcome, code, key)))
            for code, key, token, outcome in completions
        ]
        ended = self._done_many(node, completions) if self._sql.done_many else set()
        if ended:  # the rest (refused, or with a pending re-add, or another outcome) go the usual way
            rest = [i for i, (c, k, t, outcome) in enumerate(completions) if not self._ended(ended, c, k, t, outcome)]
            results = [True] * len(items)
            try:
                settled = self._complete_each(node, [items[i] for i in rest])
            except StoreUnavailableError as exc:  # the Done items are committed: a retry must not count them refused
                raise PartlyCompletedError(str(exc), frozenset(range(len(items))) - frozenset(rest)) from exc
            for i, result in zip(rest, settled, strict=True):
                results[i] = result
            return results
        return self._complete_each(node, items)

    def _done_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> set[tuple[str, str, int]]:
        """PostgreSQL, SQLite: every :class:`Done` of the batch in one fenced statement (two or more of them);
        the (code, key, token) it ended."""
        seen: dict[tuple[str, str], int] = {}
        for code, key, _, _ in completions:
            seen[(code, key)] = seen.get((code, key), 0) + 1
        # a task with two completions in the batch keeps the order of its items: the usual way
        done = [(c, k, int(t)) for c, k, t, outcome in completions if isinstance(outcome, Done) and seen[(c, k)] == 1]
        if len(done) < 2:
            return set()
        shape = self._sql.leases_shape
        assert shape is not None
        sql, listed = shape(self._sql.done_many, done)
        rows = self._write(sql, {"me": node, **listed}, "complete")[0]
        return {(str(r[0]), str(r[1]), int(r[2])) for r in rows}

    @staticmethod
    def _ended(ended: set[tuple[str, str, int]], code: str, key: str, token: int, outcome: Outcome) -> bool:
        return isinstance(outcome, Done) and (code, key, int(token)) in ended

    def _complete_each(self, node: str, items: builtins.list[tuple[str, str, int, Any]]) -> builtins.list[bool]:
        """Each completion's fenced statements: one alone in autocommit, several in one short transaction."""
        if len(items) <= 1:
            return [self._finish(steps, {"code": c, "key": k, "me": node, "token": t}, "complete") for c, k, t, steps in items]

        def work(conn: Connection) -> builtins.list[bool]:
            results = [False] * len(items)
            for i in sorted(range(len(items)), key=lambda i: items[i][:2]):  # stable: a task's items keep their order
                code, key, token, steps = items[i]
                fence = {"code": code, "key": key, "me": node, "token": token}
                results[i] = self._settle(conn, steps, fence, "complete") is not None
            return results

        return self._transaction(work, "complete")

    def _outcome_steps(self, outcome: Outcome, payload: str | None = None) -> builtins.list[tuple[str, dict[str, Any]]]:
        """The fenced statements that record ``outcome`` (they exclude each other), and their parameters
        (``payload``: a Reschedule's new payload as JSON text, None to keep the task's)."""
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
                steps = [(sql.reschedule, {**due, "payload": payload})]
            else:
                steps = [(sql.retry_later, {**due, "err": error_text(outcome.error)})]
            steps += [(sql.apply_pending, {}), (sql.drop_cancelled, {})]
        return steps

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

    def _settle(
        self, conn: Executor, steps: Sequence[tuple[str, Mapping[str, Any]]], fence: Mapping[str, Any], what: str
    ) -> str | None:
        """Within a transaction: the first of ``steps`` that matches (the statement run), or None if the fence fails.

        If none matches, the row is read and locked: still fenced (a cancel or a re-add landed
        between two statements), the steps run again on the locked row, where one must match.
        """
        text = self.backend.text
        for _ in range(2):
            for statement, params in steps:
                if conn.execute(text(statement), {**fence, **params}).rowcount:
                    return statement
            row = conn.execute(text(self._sql.lock_fence), {"code": fence["code"], "key": fence["key"]}).fetchone()
            if row is None or (row[0], row[1], int(row[2])) != ("running", fence["me"], fence["token"]):
                log.debug("%s of %s refused: the task was taken over or is gone", what, self._where(fence["code"], fence["key"]))
                return None
        raise StoreUnavailableError(f"{self._where(fence['code'], fence['key'])}: {what} did not settle (the task kept changing)")

    def release(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        """Every hand-back in one short transaction; on PostgreSQL the task notice once per code queued again
        (sent when it commits), and this process's wakers of those codes at once."""
        sql = self._sql
        items = sorted((code, key, int(token)) for code, key, token in tasks)  # one lock order
        if not items:
            return 0
        no_params: Mapping[str, Any] = {}
        steps = [(sql.release, no_params), (sql.release_pending, no_params), (sql.drop_cancelled, no_params)]

        def work(conn: Connection) -> tuple[int, set[str]]:
            count, queued = 0, set()
            for code, key, token in items:
                settled = self._settle(conn, steps, {"code": code, "key": key, "me": node, "token": token}, "release")
                if settled is not None:
                    count += 1
                    if settled != sql.drop_cancelled:
                        queued.add(code)
            if sql.notify:
                for code in sorted(queued):
                    conn.execute(self.backend.text(sql.notify), {"code": code})  # delivered when the transaction commits
            return count, queued

        count, queued = self._transaction(work, "release")
        for code in sorted(queued):
            self._wake_local(code)
        return count

    # -- inside the caller's transaction (the executor: mutexcron.tasks.transactions) ------------
    def add_many_in(
        self, transaction: Any, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace"
    ) -> builtins.list[AddResult]:
        """Every task checked first, then each added with this store's statements on the caller's transaction."""
        batch, mode = checked_batch(tasks), check_on_conflict(on_conflict)
        caller = self._bind(transaction, "adding a task")
        for task in batch:
            self._check_names_in(caller, task.code, task.key)
        return [self._add_checked(caller, task, mode) for task in batch]

    def cancel_in(self, transaction: Any, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        caller = self._bind(transaction, "cancelling a task")
        self._check_names_in(caller, code, key)
        sql, clause, params = self._sql, self.backend.text, {"code": code, "key": key}
        for _ in range(_ROUNDS):
            if caller.execute(clause(sql.cancel_drop), params).rowcount:
                return True
            if caller.execute(clause(sql.cancel_mark), params).rowcount:
                return True  # running: dropped when its attempt ends
            if caller.execute(clause(sql.read_one), params).fetchone() is None:
                return False
        raise StoreUnavailableError(f"{self._where(code, key)}: cancel did not settle (the task kept changing state)")

    def complete_in(self, transaction: Any, node: str, code: str, key: str, token: int, outcome: Outcome) -> None:
        checked = check_outcome(outcome)
        caller = self._bind(transaction, "completing a task")
        steps = self._outcome_steps(checked, reschedule_payload(checked, code, key))
        fence = {"code": code, "key": key, "me": node, "token": int(token)}
        if self._settle(caller, steps, fence, "complete") is None:
            raise StaleTaskError(
                f"{self._where(code, key)}: completion of attempt token {token} refused: this node's lease ran out "
                "and a newer attempt took the task over (or it is gone). Let this error roll your transaction back: "
                "the newer attempt's writes are the ones that count"
            )

    def _add_checked(self, caller: CallerTransaction, task: CheckedTask, mode: str) -> AddResult:
        """One checked task added in the open transaction ``caller``: insert it, or decide on the row
        that is there (locked) as :func:`~mutexcron.tasks.checks.decide_add` says."""
        sql, clause = self._sql, self.backend.text
        params = {"code": task.code, "key": task.key, "due": self._time(task.at), "delay": task.delay, "payload": task.text}
        for _ in range(_ROUNDS):
            try:
                result = caller.execute(clause(sql.insert), params)
                inserted = result.fetchone() is not None if sql.notify else result.rowcount == 1  # PostgreSQL's: the notice's row
            except Exception as exc:
                if not caller.is_duplicate(exc):  # MySQL: the task exists (the statement alone is rolled back)
                    raise
                inserted = False
            if inserted:
                return AddResult.INSERTED
            decided = self._update_existing(caller, params, task.at, task.delay, mode)
            if decided is not None:
                return decided
            # Finished between the insert and the lock (a READ COMMITTED transaction sees it): insert again.
        where = self._where(task.code, task.key)
        raise StoreUnavailableError(f"{where}: add did not settle (the task kept appearing and vanishing)")

    def _bind(self, transaction: Any, what: str) -> CallerTransaction:
        """The caller's transaction on this store's database; refused if it is on another one."""
        caller = adapt(transaction)
        wanted = self.backend.dialect
        if caller.dialect != wanted.name:
            raise ConfigurationError(
                f"{what}: your transaction is on {caller.dialect}, the task store {self.masked_url} on {wanted.kind}: "
                "the task would not commit with your writes. Pass a connection to the store's database, or build the "
                "TaskPool on your application's database URL"
            )
        mine, theirs = self._database_name(), caller_database(caller)
        if theirs is not None and mine != theirs:
            raise ConfigurationError(
                f"{what}: your transaction is on the database {theirs!r}, the task store {self.masked_url} on {mine!r}: "
                "the task would not commit with your writes. Build the TaskPool on your application's database URL"
            )
        return caller

    def _database_name(self) -> str:
        """This store's database name (SQLite: the real path of its file), read once."""
        if self._database is None:
            url = self.backend.engine.url
            if self.backend.dialect.name == "sqlite":
                self._database = os.path.realpath(url.database or "")
            elif url.database:
                self._database = str(url.database)
            else:  # PostgreSQL's default database (the user's name): ask the server once
                query = "SELECT current_database()" if self.backend.dialect.name == "postgresql" else "SELECT DATABASE()"
                self._database = str(self.backend.execute(query, {}, "database name")[0][0][0])
        return self._database

    def _check_names_in(self, caller: CallerTransaction, code: str, key: str) -> None:
        """:meth:`_check_names` without a connection of the store's own on SQLite: the caller's
        transaction may hold the file's write lock already, and a second connection of this thread
        would wait for it until its busy timeout (opening one can switch the file to WAL, which needs
        the lock too). There the table must exist: it is looked up on the caller's connection."""
        if self.backend.dialect.name != "sqlite" or self.table in self.backend._set_up:
            self._check_names(code, key)
            return
        lookup = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :t"
        if caller.execute(self.backend.text(lookup), {"t": self.table}).fetchone() is None:
            raise ConfigurationError(
                f"no task table {self.table!r} in {self.masked_url} yet: create it before adding tasks inside a "
                "transaction (a migration with the statements of `mutexcron ddl`, or any use of the pool outside a "
                "transaction, e.g. pool.store.ping(), at start)"
            )

    def next_due(self, codes: Iterable[str]) -> float | None:
        wanted = check_codes(codes)
        if not wanted:
            return None
        sql, listed = self._sql.codes_shape(self._sql.next_due, self._sql.next_due_part, wanted)
        rows = self._read(sql, listed, "next_due")
        return max(0.0, float(rows[0][0])) if rows and rows[0][0] is not None else None

    def summary(self, codes: Iterable[str] | None = None) -> builtins.list[CodeSummary]:
        """Counts per code in one statement: a GROUP BY over the table (``codes=None``), or one
        aggregate per listed code (a LATERAL join on PostgreSQL, a UNION ALL elsewhere), each
        restricted to its code by the ``(code, run_at)`` index; the state of each row is read."""
        if codes is None:
            rows = self._read(self._sql.summary_all, {}, "summary")
        else:
            wanted = check_codes(codes)
            if not wanted:
                return []
            sql, listed = self._sql.codes_shape(self._sql.summary, self._sql.summary_part, wanted)
            rows = self._read(sql, listed, "summary")
        found = [
            CodeSummary(
                str(code),
                queued=int(queued),
                due_now=int(due_now),
                running=int(running),
                failed=int(failed),
                oldest_overdue=None if until is None else max(0.0, -float(until)),
            )
            for code, queued, due_now, running, failed, until in (tuple(row) for row in rows)
        ]
        return sorted(found, key=lambda summary: summary.code)

    # -- retention ---------------------------------------------------------------------------
    def purge_batch(
        self, older_than: float, *, code: str | None = None, limit: int = task_base.PURGE_BATCH
    ) -> task_base.PurgeBatch:
        """Delete up to ``limit`` old tombstones under the settled token floor, in one statement;
        once none is left under it, raise the floor over the rest (see :meth:`TaskStore.purge_batch`)."""
        params, and_code = self._purge_params(older_than, code)
        floor, age = self._read_floor()
        if age < self.floor_settle:
            return task_base.PurgeBatch(0, self.floor_settle - age)
        sql = self._sql.purge.replace("{and_code}", and_code)
        removed = self._write(sql, {**params, "floor": floor, "n": max(1, int(limit))}, "purge")[1]
        if removed >= limit:
            return task_base.PurgeBatch(removed, 0.0)
        rows = self._read(self._sql.purge_top.replace("{and_code}", and_code), {**params, "floor": floor}, "purge")
        top = rows[0][0] if rows else None
        if top is None:
            return task_base.PurgeBatch(removed, None)
        self._write(self._sql.floor_raise, {"top": int(top)}, "purge")
        return task_base.PurgeBatch(removed, self.floor_settle)

    def count_purgeable(self, older_than: float, *, code: str | None = None) -> int:
        params, and_code = self._purge_params(older_than, code)
        return int(self._read(self._sql.purge_count.replace("{and_code}", and_code), params, "purge count")[0][0])

    def count_stored(self) -> dict[str, int]:
        rows, tombstones = self._read(self._sql.count_stored, {}, "count rows")[0]
        return {"rows": int(rows), "tombstones": int(tombstones)}

    def _purge_params(self, older_than: float, code: str | None) -> tuple[dict[str, Any], str]:
        params: dict[str, Any] = {"ago": -float(older_than)}
        if code is None:
            return params, ""
        return {**params, "code": check_codes([code])[0]}, " AND code = :code"

    def _read_floor(self) -> tuple[int, float]:
        """The token floor and the seconds since it was raised (its row created first if missing)."""
        if not self._floor_ready:
            self._write(self._sql.floor_create, {}, "purge")
            self._floor_ready = True
        rows = self._read(self._sql.floor_read, {}, "purge")
        if not rows:  # dropped under us (a table recreated): create it again next time
            self._floor_ready = False
            return 0, 0.0
        return int(rows[0][0]), float(rows[0][1])

    @property
    def default_poll(self) -> float:
        """SQLite's change check looks every 25 ms (it reads no page); elsewhere DEFAULT_POLL."""
        if self.backend.dialect.name == "sqlite":
            from ..wakeups.sqlite import VERSION_POLL

            return VERSION_POLL
        return DEFAULT_POLL

    def waker(self, codes: Iterable[str], poll: float | None = None) -> Waker:
        """What a worker of ``codes`` sleeps on (:mod:`mutexcron.tasks.wakeups.base`), by database (``poll``:
        the seconds between two looks where there is no notice, None for the defaults below):

        * PostgreSQL: ``LISTEN`` on a connection of its own for the ``NOTIFY`` an insert, a
          replace, a retry or a hand-back sends (:class:`~mutexcron.tasks.wakeups.postgresql.PostgreSQLWaker`).
        * SQLite: ``PRAGMA data_version`` read every 25 ms (``poll``) on a connection of its own, and the
          adds of this process at once (:class:`~mutexcron.tasks.wakeups.sqlite.SQLiteWaker`).
        * MySQL/MariaDB (no notices): a poll every :data:`~mutexcron.tasks.wakeups.base.DEFAULT_POLL`
          seconds (``poll``), the worker's own :meth:`next_due` (an index-only seek per code on the
          ``(code, run_at)`` index), and the adds and hand-backs of this process at once.
        """
        wanted = check_codes(codes)
        if not wanted:
            return PollWaker(poll or DEFAULT_POLL)
        name = self.backend.dialect.name
        if name == "postgresql":
            from ..wakeups.postgresql import PostgreSQLWaker

            return PostgreSQLWaker(self.backend, self.table, wanted, self.masked_url)
        if name == "sqlite":
            from ..wakeups.sqlite import SQLiteWaker

            self._ensure_table()  # its first look reads the table
            head = self._sql.codes_shape(self._sql.head, self._sql.next_due_part, wanted)
            path = self.backend.engine.url.database
            assert path is not None  # the backend refuses an in-memory SQLite
            return SQLiteWaker(path, self._wake_key, wanted, head, self.masked_url, version_poll=poll)
        return RegisteredPollWaker(self._wake_key, wanted, poll or DEFAULT_POLL)

    def _table_identity(self) -> str:
        """The task table, the same for every store of this process on it (whatever the URL's spelling)."""
        url = self.backend.engine.url
        if self.backend.dialect.name == "sqlite":
            where = os.path.realpath(url.database or "")
        else:
            where = f"{url.host}:{url.port}/{url.database}"
        return f"{self.backend.dialect.name}:{where}#{self.table}"

    def _wake_local(self, code: str) -> None:
        """Wake this process's workers of ``code`` now (PostgreSQL's notice comes back by itself)."""
        if not self._sql.notify:
            LOCAL_WAKERS.notify(self._wake_key, code)

    def now(self) -> datetime:
        return _utc(self._read(self._sql.select_now, {}, "now")[0][0])

    def ping(self) -> None:
        self._read("SELECT 1", {}, "ping")  # through _read: the first call creates the table

    def close(self) -> None:
        self.backend.close()

    def _where(self, code: str, key: str) -> str:
        return f"task {code!r}/{key!r} in {self.table} on {self.masked_url}"


def _plan_claims_by_index(dbapi_conn: Any, _record: Any) -> None:
    """PostgreSQL, on the task store's own connections: no bitmap scans, no sequential scans where an index serves.

    Until autovacuum first analyzes a new task table (a minute or more), the planner estimates a
    couple of rows and runs the claim's per-code pick as a bitmap scan of every due row plus a sort
    (10 ms and 361 buffers per pick at 20,000 due rows, against 0.07 ms and 6 buffers as an ordered
    scan of the (code, run_at) index): a backlog on a new table drained at half speed. Likewise it
    ran a batch of completions (a join of the batch's (code, key, token) list to the table) as a
    sequential scan of every row, filtered on owner and state (6 ms on a fresh table of 20,000
    rows, 50 ms once dead rows piled up, against 1.3 ms through the primary key). An index scan is
    the right plan for every task statement whatever the statistics say.
    """
    cursor = dbapi_conn.cursor()
    cursor.execute("SET enable_bitmapscan = off")
    cursor.execute("SET enable_seqscan = off")
    cursor.close()


def _utc(value: Any) -> datetime:
    """A time the database must have (a NOT NULL column, its clock) as an aware UTC datetime."""
    when = as_utc(value)
    if when is None:
        raise StoreError(f"the database returned {value!r} where a time must be")
    return when
