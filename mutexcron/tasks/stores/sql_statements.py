"""Every statement the SQL task store runs, one table per dialect, side by side.

A new dialect is one more :class:`TaskStatements` row; the store has no per-dialect branches.
Templates are filled once per store by :meth:`TaskStatements.bind`:

* ``{t}`` the table, ``{cols}`` the record columns, ``{fence}`` the condition every worker write
  carries (the task is running, owned by ``:me``, with ``:token``);
* the database's clock: ``{now}``, ``{lease_end}`` (now + ``:lease`` seconds), ``{due}`` (the
  absolute ``:due``, or now + ``:delay`` seconds), ``{until_min}`` (seconds from now to the
  earliest ``m.run_at``).

``{each_code}``, ``{pairs}`` and ``{triples}`` stay in the bound text where a dialect spells a
list as parameters; each call fills them with its own. Every value is a bound parameter; the
table name is checked against :data:`mutexcron.backends.sql.TABLE_RE`.

``run_at`` is the one column claims look at: the due time of a queued task (or its retry's time:
a retry keeps ``due``, which names the occurrence), the lease's end of a running one, NULL for a
failed one. Every write keeps it so. The ``(code, run_at)`` index makes
the claim, per code it handles, an ordered range scan of that code's claimable tasks that stops
after ``:n`` rows: never a scan of the table, and never a walk past the due tasks of codes the
caller does not handle (a task whose code no node handles waits at no cost to the others). With
several codes, each code's pick is its own ordered scan (``{each_code}``: a LATERAL join over
the codes on PostgreSQL, a UNION ALL of one part per code elsewhere), and the earliest ``:n`` of
them are taken: a claim locks at most ``:n`` rows per code, for the one statement or transaction.

Each dialect's clock is *statement-stable* (PostgreSQL ``statement_timestamp()``, MySQL
``UTC_TIMESTAMP(6)``, SQLite ``'now'``), so one statement compares and writes one instant, and the
planner can use ``run_at <= {now}`` as an index bound (``clock_timestamp()`` is volatile: it
cannot). MySQL evaluates SET assignments left to right, each seeing the ones before; every
statement here either reads no column it assigns, or assigns it after all its readers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

__all__ = ["STATEMENTS", "TaskStatements"]

COLUMNS = (
    "code, task_key, due, payload, state, attempt, token, owner, lease_until, last_error, "
    "pending_due, pending_payload, cancel_requested, created, updated, run_at, occurrence"
)
#: A finished or cancelled task: a *tombstone* in state ``done`` that keeps only its token, so a task
#: added again goes on from it (tokens only go up across occurrences). Every read but the add's
#: lock skips it; ``run_at`` NULL keeps it out of claims. One UPDATE: the same cost as the DELETE it
#: replaces, and one small row per finished (code, key). Its ``cancel_requested`` is kept: 1 says a
#: cancel ended the occurrence (the dashboard counts it as cancelled, not finished); ``cancel_drop``
#: sets it, every other end keeps the running row's (a cancel asked during the attempt).
TOMBSTONE = (
    "state = 'done', run_at = NULL, payload = 'null', owner = NULL, lease_until = NULL, last_error = NULL, "
    "pending_due = NULL, pending_payload = NULL, updated = {now}"
)
#: The store-wide token floor: the highest token of every tombstone purged so far (see ``floor_*`` and
#: ``purge`` below). It lives in the task table itself, as the tombstone of the ``('', '')`` task (a code
#: and a key no add accepts), so it needs no table of its own; a new row starts its token from it.
FLOOR = "COALESCE((SELECT f.token FROM {t} AS f WHERE f.code = '' AND f.task_key = ''), 0)"
#: A tombstone (or a new row's conflict with one) becomes the task again: as a fresh insert, the token kept.
REVIVE = (
    "state = 'queued', due = {new}due, run_at = {new}due, payload = {new}payload, attempt = 0, owner = NULL, "
    "lease_until = NULL, last_error = NULL, pending_due = NULL, pending_payload = NULL, cancel_requested = 0, "
    "created = {now}, updated = {now}, occurrence = {t}.token"
)
#: Columns a task table created by an earlier mutexcron lacks; the store adds them.
ADDED_COLUMNS = (("occurrence", "BIGINT NULL"), ("started", "SMALLINT NOT NULL DEFAULT 0"))
#: A claim's attempt count: + 1, unless it rescues a running task whose claim never started (that
#: claim's attempt is this one). Assigned before ``state`` and ``started`` (MySQL assigns left to right).
COUNT_ATTEMPT = "attempt = attempt + CASE WHEN state = 'running' AND started = 0 THEN 0 ELSE 1 END, started = 0"
#: A summary's counts over one code's rows: queued, due now (``run_at`` has come: queued and due,
#: or running with its lease run out), running, failed, and the seconds from now to the oldest due
#: of the due ones (negative: overdue; NULL if none is due). ``run_at`` is in the (code, run_at)
#: index; the state is not, so counting by state reads the rows of the codes counted.
COUNTS = (
    "COALESCE(SUM(CASE WHEN state = 'queued' THEN 1 ELSE 0 END), 0), "
    "COALESCE(SUM(CASE WHEN run_at <= {now} THEN 1 ELSE 0 END), 0), "
    "COALESCE(SUM(CASE WHEN state = 'running' THEN 1 ELSE 0 END), 0), "
    "COALESCE(SUM(CASE WHEN state = 'failed' THEN 1 ELSE 0 END), 0), "
    "{oldest}"
)
FENCE = "code = :code AND task_key = :key AND owner = :me AND token = :token AND state = 'running'"
#: PostgreSQL claim's RETURNING: a time a hand edit put beyond what the driver reads ('-infinity',
#: year 10000) comes back NULL, so the record of that one row fails to decode (the row is failed
#: alone) instead of the driver's error taking the committed claim of the whole batch down.
PG_READABLE_TIMES = ("due", "pending_due", "created")
_PG_READABLE = (
    "CASE WHEN x.{c} BETWEEN timestamptz '0001-01-02 00:00+00' AND timestamptz '9999-12-30 00:00+00' THEN x.{c} END"
)

#: (statement, parameters) for a list of task keys ``(code, key)`` or leases ``(code, key, token)``.
ListShape = Callable[[str, Sequence[Any]], tuple[str, dict[str, Any]]]
#: (statement, parameters) for a statement, its per-code part (``:pcode`` in it) and the codes.
CodesShape = Callable[[str, str, Sequence[str]], tuple[str, dict[str, Any]]]


def _one_json(name: str, record: Callable[[Any], Any]) -> ListShape:
    """PostgreSQL, SQLite: the whole list as one JSON parameter ``name``."""

    def shape(sql: str, items: Sequence[Any]) -> tuple[str, dict[str, Any]]:
        return sql, {name: json.dumps([record(item) for item in items])}

    return shape


def _pg_codes(sql: str, _part: str, codes: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """PostgreSQL: the codes as one ``text[]``, unnested and joined LATERAL to each code's pick."""
    return sql, {"codes": list(codes)}


def _union_per_code(sql: str, part: str, codes: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """MySQL, SQLite: ``{each_code}`` as a UNION ALL of ``part`` once per code (``:pcode`` -> ``:c0``, ``:c1``...)."""
    union = " UNION ALL ".join(part.replace(":pcode", f":c{i}") for i in range(len(codes)))
    return sql.replace("{each_code}", union), {f"c{i}": code for i, code in enumerate(codes)}


def _my_list(slot: str, columns: tuple[tuple[str, str], ...]) -> ListShape:
    """MySQL: ``slot`` spelled out as parameters: ``:c0, :c1`` for codes, an OR of equalities for keys.

    ``columns`` are ``(column, parameter prefix)``. An OR of ``(code = :c0 AND task_key = :k0)`` is
    a range on the primary key for every MySQL and MariaDB version; row-constructor ``IN`` lists
    are not, on older ones.
    """

    def shape(sql: str, items: Sequence[Any]) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = {}
        parts = []
        for i, item in enumerate(items):
            values = item if isinstance(item, tuple) else (item,)
            names = [f"{prefix}{i}" for _, prefix in columns]
            params.update(zip(names, values, strict=True))
            if len(columns) == 1:
                parts.append(f":{names[0]}")
            else:
                parts.append("(" + " AND ".join(f"{c} = :{n}" for (c, _), n in zip(columns, names, strict=True)) + ")")
        return sql.replace(slot, (", " if len(columns) == 1 else " OR ").join(parts)), params

    return shape


def _pg_time(value: datetime) -> Any:
    return value  # timestamptz takes an aware datetime


def _mysql_time(value: datetime) -> Any:
    return value.astimezone(timezone.utc).replace(tzinfo=None)  # DATETIME(6) holds UTC, naive


def _sqlite_time(value: datetime) -> Any:
    # The stored form of every time: 'YYYY-MM-DD HH:MM:SS.ffffff' (26 characters, UTC), so text
    # order is time order. isoformat keeps four-digit years, which strftime does not promise.
    return value.astimezone(timezone.utc).replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")


@dataclass(frozen=True)
class TaskStatements:
    """The task store's statements on one dialect. Defaults are the statements every dialect shares."""

    dialect: str
    ddl: tuple[str, ...]
    #: Opens the short transactions of ``add`` (and MySQL's claim): SQLite takes its write lock at once.
    begin: str
    #: Clock fragments: the current time; now + ``:{p}`` seconds ({p} is a parameter name).
    now: str
    plus: str
    #: Seconds from now to ``{m}``.
    until: str
    #: A datetime as this dialect's driver binds it into a time column.
    time_param: Callable[[datetime], Any]
    #: ``:due`` where the database must know its type without a column to infer it from.
    due_param: str
    #: Fills ``{each_code}`` (or binds the codes) for ``claim``, ``claim_pick``, ``next_due`` and ``summary``.
    codes_shape: CodesShape
    #: ``task_key`` contains ``:contains`` (case-sensitive on every dialect; LIKE is not on SQLite).
    contains: str
    #: Inserts the task unless it exists: 1 row, or 0 rows (or a duplicate-key error) if it exists.
    insert: str
    #: Reads ``state, due, pending_due, now`` of one task, locking it until the transaction ends.
    lock_row: str
    #: One statement that claims and returns the claimed rows; "" (MySQL): the three below, in one transaction.
    claim: str
    #: One code's pick (``:pcode``), for the UNION ALL dialects.
    claim_part: str = ""
    claim_pick: str = ""
    claim_take: str = ""
    claim_read: str = ""
    pairs_shape: ListShape | None = None
    #: Renews the leases of ``leases_shape``'s list; returns the renewed keys unless ``renew_read`` is set.
    renew: str = ""
    renew_read: str = ""
    leases_shape: ListShape | None = None
    #: start: marks the claims of ``leases_shape``'s list whose handler started (each fenced); a rescue counts them.
    start: str = ""
    read_one: str = "SELECT {cols} FROM {t} WHERE code = :code AND task_key = :key AND state <> 'done'"
    #: Reads ``state, owner, token`` of one task, locking it until the transaction ends (the fence
    #: check of a batch of completions or hand-backs, when none of an item's writes matched).
    lock_fence: str = "SELECT state, owner, token FROM {t} WHERE code = :code AND task_key = :key FOR UPDATE"
    list_tasks: str = "SELECT {cols} FROM {t} WHERE state <> 'done' AND {where} ORDER BY due, code, task_key LIMIT :limit"
    select_now: str = "SELECT {now}"
    #: Seconds until the earliest ``run_at`` of the codes: one index seek per code (``next_due_part``).
    next_due: str = "SELECT {until_min} FROM ({each_code}) AS m"
    next_due_part: str = ""
    #: The earliest ``run_at`` of the codes (SQLite's waker, on its own connection: text order is time order).
    head: str = "SELECT MIN(m.run_at) FROM ({each_code}) AS m"
    #: Run in the add's transaction after a replace, and once per code in a hand-back's: the task
    #: notice (PostgreSQL's ``NOTIFY``), or "".
    notify: str = ""
    #: Inserts many new tasks in one statement (``:codes``, ``:keys``, ``:dues``, ``:delays``,
    #: ``:payloads``: arrays), reviving tombstones; returns ``code, task_key`` of each one it
    #: inserted. "": the dialect adds a batch one statement per task.
    insert_many: str = ""
    #: Counts per code of every code with a task (``{counts}``: see :data:`COUNTS`), one GROUP BY.
    summary_all: str = "SELECT code, {counts} FROM {t} WHERE state <> 'done' GROUP BY code"
    #: Counts of the listed codes, one row each (zeros for a code without tasks): ``summary_part``
    #: once per code (``{each_code}``), or PostgreSQL's LATERAL join over the codes.
    summary: str = "{each_code}"
    summary_part: str = "SELECT :pcode, {counts} FROM {t} WHERE code = :pcode AND state <> 'done'"
    replace: str = (
        "UPDATE {t} SET due = :due, run_at = :due, payload = :payload, state = 'queued', attempt = 0, lease_until = NULL, "
        "last_error = NULL, pending_due = NULL, pending_payload = NULL, cancel_requested = 0, updated = {now}, "
        "occurrence = token WHERE code = :code AND task_key = :key"
    )
    #: A tombstone added again (MySQL's add, after the insert met it): the task anew, its token kept.
    revive: str = "UPDATE {t} SET {revive} WHERE code = :code AND task_key = :key AND state = 'done'"
    set_pending: str = (
        "UPDATE {t} SET pending_due = :due, pending_payload = :payload, cancel_requested = 0, updated = {now} "
        "WHERE code = :code AND task_key = :key"
    )
    #: A queued or failed task cancelled: its tombstone, marked cancelled (``cancel_requested = 1``).
    cancel_drop: str = (
        "UPDATE {t} SET {tombstone}, cancel_requested = 1 "
        "WHERE code = :code AND task_key = :key AND state IN ('queued', 'failed')"
    )
    cancel_mark: str = (
        "UPDATE {t} SET cancel_requested = 1, pending_due = NULL, pending_payload = NULL, updated = {now} "
        "WHERE code = :code AND task_key = :key AND state = 'running'"
    )
    # A failed task queued again by hand: claimable now, the same occurrence (due kept), attempts reset.
    retry: str = (
        "UPDATE {t} SET state = 'queued', run_at = {now}, attempt = 0, updated = {now} "
        "WHERE code = :code AND task_key = :key AND state = 'failed'"
    )
    # The ends of an attempt. The three cases of a fenced row exclude each other (cancelled; a
    # pending re-add; neither), so each outcome is a short list of conditional writes of which
    # exactly one matches a row still fenced (see SQLTaskStore._finish).
    done: str = "UPDATE {t} SET {tombstone} WHERE {fence} AND (cancel_requested = 1 OR pending_due IS NULL)"
    #: ``done`` for ``leases_shape``'s list of (code, key, token) in one statement, each row fenced on
    #: its own; returns code, key, token of the rows it ended ("": the dialect runs ``done`` per item).
    done_many: str = ""
    drop_cancelled: str = "UPDATE {t} SET {tombstone} WHERE {fence} AND cancel_requested = 1"
    apply_pending: str = (
        "UPDATE {t} SET state = 'queued', due = pending_due, run_at = pending_due, payload = pending_payload, "
        "occurrence = token, attempt = 0, last_error = NULL, lease_until = NULL, pending_due = NULL, pending_payload = NULL, "
        "updated = {now} WHERE {fence} AND cancel_requested = 0 AND pending_due IS NOT NULL"
    )
    reschedule: str = (
        "UPDATE {t} SET state = 'queued', due = {due}, run_at = {due}, attempt = 0, last_error = NULL, occurrence = token, "
        "payload = COALESCE(:payload, payload), lease_until = NULL, updated = {now} "
        "WHERE {fence} AND cancel_requested = 0 AND pending_due IS NULL"
    )
    # The same occurrence again: due (and so the idempotency key) kept, claimable from the retry's time.
    retry_later: str = (
        "UPDATE {t} SET state = 'queued', run_at = {due}, last_error = :err, "
        "lease_until = NULL, updated = {now} WHERE {fence} AND cancel_requested = 0 AND pending_due IS NULL"
    )
    fail: str = (
        "UPDATE {t} SET state = 'failed', run_at = NULL, lease_until = NULL, last_error = :err, updated = {now} "
        "WHERE {fence} AND cancel_requested = 0 AND pending_due IS NULL"
    )
    # A hand-back raises the token (the claim that handed it back can no longer write) and does not
    # count the attempt that never started; it is claimable at once (it was: it was claimed), its
    # due kept. A pending re-add is applied as at the end of a run.
    release: str = (
        "UPDATE {t} SET state = 'queued', token = token + 1, attempt = attempt - 1, run_at = {now}, lease_until = NULL, "
        "updated = {now} WHERE {fence} AND cancel_requested = 0 AND pending_due IS NULL"
    )
    release_pending: str = (
        "UPDATE {t} SET state = 'queued', occurrence = token + 1, token = token + 1, due = pending_due, run_at = pending_due, "
        "payload = pending_payload, attempt = 0, last_error = NULL, lease_until = NULL, pending_due = NULL, "
        "pending_payload = NULL, updated = {now} WHERE {fence} AND cancel_requested = 0 AND pending_due IS NOT NULL"
    )

    # -- retention: the token floor and the purge of old tombstones (SQLTaskStore.purge_batch) ------
    #: Creates the floor's row (token 0) unless it exists.
    floor_create: str = (
        "INSERT INTO {t} (code, task_key, due, payload, state, attempt, token, cancel_requested, created, updated, occurrence) "
        "VALUES ('', '', {now}, 'null', 'done', 0, 0, 0, {now}, {now}, 0) ON CONFLICT (code, task_key) DO NOTHING"
    )
    #: The floor and the seconds since it was last raised.
    floor_read: str = "SELECT token, {since_updated} FROM {t} WHERE code = '' AND task_key = ''"
    #: Raises the floor to ``:top`` (never lowers it); ``updated`` says since when it holds.
    floor_raise: str = "UPDATE {t} SET token = :top, updated = {now} WHERE code = '' AND task_key = '' AND token < :top"
    #: The highest token above ``:floor`` of the tombstones finished before ``{cutoff}`` (now - ``:age`` seconds).
    purge_top: str = (
        "SELECT MAX(token) FROM {t} WHERE state = 'done' AND code <> '' AND updated < {cutoff} AND token > :floor{and_code}"
    )
    #: How many tombstones finished before ``{cutoff}`` (``mutexcron tasks purge --dry-run``).
    purge_count: str = "SELECT COUNT(*) FROM {t} WHERE state = 'done' AND code <> '' AND updated < {cutoff}{and_code}"
    #: Deletes up to ``:n`` tombstones finished before ``{cutoff}`` whose token is at most ``:floor``.
    purge: str = ""
    #: Every task's row, and the tombstones among them, the floor's row aside (``mutexcron_task_store_rows``).
    count_stored: str = "SELECT COUNT(*), COALESCE(SUM(CASE WHEN state = 'done' THEN 1 ELSE 0 END), 0) FROM {t} WHERE code <> ''"

    def bind(self, table: str) -> TaskStatements:
        """This row with every template filled for ``table`` (``{codes}``, ``{pairs}``, ``{triples}``, ``{where}`` kept)."""
        due = f"COALESCE({self.due_param}, {self.plus.replace('{p}', 'delay')})"
        oldest = self.until.replace("{m}", "MIN(CASE WHEN run_at <= {now} THEN due END)")
        fill = {
            "{tombstone}": TOMBSTONE,
            "{floor}": FLOOR,
            "{revive}": REVIVE.replace("{new}", ":"),
            "{revive_excluded}": REVIVE.replace("{new}due", "excluded.due").replace("{new}", "excluded."),
            "{counts}": COUNTS.replace("{oldest}", oldest),
            "{fence}": FENCE,
            "{count_attempt}": COUNT_ATTEMPT,
            "{cols}": COLUMNS,
            "{x_cols}": ", ".join(f"x.{c}" for c in COLUMNS.split(", ")),
            "{x_readable}": ", ".join(
                _PG_READABLE.replace("{c}", c) if c in PG_READABLE_TIMES else f"x.{c}" for c in COLUMNS.split(", ")
            ),
            "{due}": due,
            "{lease_end}": self.plus.replace("{p}", "lease"),
            "{until_min}": self.until.replace("{m}", "MIN(m.run_at)"),
            "{since_updated}": "-(" + self.until.replace("{m}", "updated") + ")",
            "{cutoff}": self.plus.replace("{p}", "ago"),
            "{now}": self.now,
            "{t}": table,
        }

        def bound(template: str) -> str:
            for slot, value in fill.items():  # in this order: fragments first, then what they contain
                template = template.replace(slot, value)
            return template

        skip = {"dialect", "begin", "now", "plus", "until", "due_param"}
        changes: dict[str, Any] = {"ddl": tuple(bound(s) for s in self.ddl)}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.name not in skip and item.name != "ddl" and isinstance(value, str):
                changes[item.name] = bound(value)
        return dataclasses.replace(self, **changes)


_PG_PLUS = "statement_timestamp() + CAST(:{p} AS double precision) * interval '1 second'"

POSTGRESQL = TaskStatements(
    dialect="postgresql",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    code             varchar(191) NOT NULL,
    task_key         varchar(191) NOT NULL,
    due              timestamptz  NOT NULL,
    run_at           timestamptz,
    payload          text         NOT NULL,
    state            varchar(16)  NOT NULL DEFAULT 'queued',
    attempt          integer      NOT NULL DEFAULT 0,
    token            bigint       NOT NULL DEFAULT 0,
    owner            varchar(255),
    lease_until      timestamptz,
    last_error       text,
    pending_due      timestamptz,
    pending_payload  text,
    cancel_requested smallint     NOT NULL DEFAULT 0,
    created          timestamptz  NOT NULL,
    updated          timestamptz  NOT NULL,
    occurrence       bigint,
    started          smallint     NOT NULL DEFAULT 0,
    PRIMARY KEY (code, task_key)
)""",
        "CREATE INDEX IF NOT EXISTS {t}_run_at ON {t} (code, run_at)",
        "CREATE INDEX IF NOT EXISTS {t}_done ON {t} (updated) WHERE state = 'done'",
    ),
    begin="START TRANSACTION",
    now="statement_timestamp()",
    plus=_PG_PLUS,
    until="EXTRACT(EPOCH FROM ({m} - statement_timestamp()))",
    time_param=_pg_time,
    due_param="CAST(:due AS timestamptz)",  # psycopg sends None untyped: COALESCE needs the type
    codes_shape=_pg_codes,
    contains="strpos(task_key, :contains) > 0",
    insert="""
WITH ins AS (
    INSERT INTO {t} (code, task_key, due, run_at, payload, state, attempt, token, cancel_requested, created, updated, occurrence)
    VALUES (:code, :key, {due}, {due}, :payload, 'queued', 0, {floor}, 0, {now}, {now}, {floor})
    ON CONFLICT (code, task_key) DO UPDATE SET {revive_excluded} WHERE {t}.state = 'done'
    RETURNING code
)
SELECT pg_notify('{t}', code) FROM ins""",
    insert_many="""
INSERT INTO {t} (code, task_key, due, run_at, payload, state, attempt, token, cancel_requested, created, updated, occurrence)
SELECT r.code, r.task_key, r.due, r.due, r.payload, 'queued', 0, {floor}, 0, {now}, {now}, {floor}
FROM (
    SELECT code, task_key, payload, COALESCE(at, statement_timestamp() + delay * interval '1 second') AS due
    FROM unnest(CAST(:codes AS text[]), CAST(:keys AS text[]), CAST(:dues AS timestamptz[]),
                CAST(:delays AS double precision[]), CAST(:payloads AS text[])) AS b(code, task_key, at, delay, payload)
) AS r
ON CONFLICT (code, task_key) DO UPDATE SET {revive_excluded} WHERE {t}.state = 'done'
RETURNING code, task_key""",
    lock_row="SELECT state, due, pending_due, {now} FROM {t} WHERE code = :code AND task_key = :key FOR UPDATE",
    # The task notice (tasks.wakeup_postgresql) on the channel named after the table, sent when the
    # insert, the replace, the retry or the hand-back commits. The insert returns one row if it inserted.
    notify="SELECT pg_notify('{t}', :code)",
    retry=TaskStatements.retry + " RETURNING pg_notify('{t}', code)",
    # SKIP LOCKED: concurrent claimers walk past each other's rows instead of queueing on them, so
    # each takes a different batch in one statement. A row changed and committed meanwhile is
    # re-checked against the WHERE before it is locked. Rows a code's pick locked but the outer
    # LIMIT left out are unlocked when the statement ends.
    claim="""
WITH c AS (
    SELECT p.code, p.task_key FROM unnest(CAST(:codes AS text[])) AS k(code)
    CROSS JOIN LATERAL (
        SELECT s.code, s.task_key, s.run_at FROM {t} AS s
        WHERE s.code = k.code AND s.run_at <= {now}
        ORDER BY s.run_at LIMIT :n
        FOR UPDATE SKIP LOCKED
    ) AS p
    ORDER BY p.run_at LIMIT :n
)
UPDATE {t} AS x SET {count_attempt}, state = 'running', owner = :me, token = x.token + 1,
    lease_until = {lease_end}, run_at = {lease_end}, updated = {now}
FROM c WHERE x.code = c.code AND x.task_key = c.task_key
RETURNING {x_readable}""",
    renew="""
UPDATE {t} AS x SET lease_until = {lease_end}, run_at = {lease_end}
FROM jsonb_to_recordset(CAST(:leases AS jsonb)) AS v(vc text, vk text, vt bigint)
WHERE x.code = v.vc AND x.task_key = v.vk AND x.token = v.vt AND x.owner = :me AND x.state = 'running'
RETURNING x.code, x.task_key""",
    leases_shape=_one_json("leases", lambda item: {"vc": item[0], "vk": item[1], "vt": item[2]}),
    start="""
UPDATE {t} AS x SET started = 1
FROM jsonb_to_recordset(CAST(:leases AS jsonb)) AS v(vc text, vk text, vt bigint)
WHERE x.code = v.vc AND x.task_key = v.vk AND x.token = v.vt AND x.owner = :me AND x.state = 'running'""",
    done_many="""
UPDATE {t} AS x SET {tombstone}
FROM jsonb_to_recordset(CAST(:leases AS jsonb)) AS v(vc text, vk text, vt bigint)
WHERE x.code = v.vc AND x.task_key = v.vk AND x.token = v.vt AND x.owner = :me AND x.state = 'running'
    AND (x.cancel_requested = 1 OR x.pending_due IS NULL)
RETURNING x.code, x.task_key, x.token""",
    next_due="""
SELECT {until_min} FROM unnest(CAST(:codes AS text[])) AS k(code)
CROSS JOIN LATERAL (
    SELECT s.run_at FROM {t} AS s WHERE s.code = k.code AND s.run_at IS NOT NULL ORDER BY s.run_at LIMIT 1
) AS m""",
    summary="""
SELECT k.code, s.* FROM unnest(CAST(:codes AS text[])) AS k(code)
CROSS JOIN LATERAL (SELECT {counts} FROM {t} WHERE {t}.code = k.code AND {t}.state <> 'done') AS s""",
    summary_part="",
    # SKIP LOCKED: a tombstone an add is reviving is left for the next purge; the outer WHERE checks
    # again what a concurrent writer may have changed before the row was locked.
    purge="""
DELETE FROM {t} AS x USING (
    SELECT code, task_key FROM {t}
    WHERE state = 'done' AND code <> '' AND updated < {cutoff} AND token <= :floor{and_code}
    LIMIT :n FOR UPDATE SKIP LOCKED
) AS c
WHERE x.code = c.code AND x.task_key = c.task_key AND x.state = 'done' AND x.token <= :floor""",
)

MYSQL = TaskStatements(
    dialect="mysql",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    code             VARCHAR(191) NOT NULL,
    task_key         VARCHAR(191) NOT NULL,
    due              DATETIME(6)  NOT NULL,
    run_at           DATETIME(6)  NULL,
    payload          LONGTEXT     NOT NULL,
    state            VARCHAR(16)  NOT NULL DEFAULT 'queued',
    attempt          INT          NOT NULL DEFAULT 0,
    token            BIGINT       NOT NULL DEFAULT 0,
    owner            VARCHAR(255) NULL,
    lease_until      DATETIME(6)  NULL,
    last_error       TEXT         NULL,
    pending_due      DATETIME(6)  NULL,
    pending_payload  LONGTEXT     NULL,
    cancel_requested TINYINT      NOT NULL DEFAULT 0,
    created          DATETIME(6)  NOT NULL,
    updated          DATETIME(6)  NOT NULL,
    occurrence       BIGINT       NULL,
    started          SMALLINT     NOT NULL DEFAULT 0,
    PRIMARY KEY (code, task_key),
    INDEX {t}_run_at (code, run_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
    ),
    begin="START TRANSACTION",
    now="UTC_TIMESTAMP(6)",
    plus="UTC_TIMESTAMP(6) + INTERVAL ROUND(:{p} * 1000000) MICROSECOND",
    until="TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {m}) / 1000000.0",
    time_param=_mysql_time,
    due_param=":due",
    codes_shape=_union_per_code,
    contains="LOCATE(:contains, task_key) > 0",  # the table's binary collation: case-sensitive
    # No ON DUPLICATE KEY: with the found-rows flag SQLAlchemy sets, its row count cannot tell an
    # insert from an unchanged row. A duplicate key raises, and the store takes the update path.
    insert="""
INSERT INTO {t} (code, task_key, due, run_at, payload, state, attempt, token, cancel_requested, created, updated, occurrence)
VALUES (:code, :key, {due}, {due}, :payload, 'queued', 0, {floor}, 0, {now}, {now}, {floor})""",
    lock_row="SELECT state, due, pending_due, {now} FROM {t} WHERE code = :code AND task_key = :key FOR UPDATE",
    # MySQL 8 and MariaDB >= 10.6 lock with SKIP LOCKED in a SELECT only (MariaDB's UPDATE has no
    # RETURNING either): pick, take and read back in one short READ COMMITTED transaction. The
    # picked rows stay locked until COMMIT, so the UPDATE and the read see exactly them. Each code
    # is picked by its own ordered range: one `code IN (...)` range would be sorted after a
    # locking read of *every* due row of those codes, all of them locked until COMMIT.
    claim="",
    claim_part="""(SELECT code, task_key, run_at FROM {t}
WHERE code = :pcode AND run_at <= {now}
ORDER BY run_at LIMIT :n FOR UPDATE SKIP LOCKED)""",
    claim_pick="{each_code} ORDER BY run_at LIMIT :n",
    claim_take="""
UPDATE {t} SET {count_attempt}, state = 'running', owner = :me, token = token + 1,
    lease_until = {lease_end}, run_at = {lease_end}, updated = {now}
WHERE {pairs}""",
    claim_read="SELECT {cols} FROM {t} WHERE {pairs}",
    pairs_shape=_my_list("{pairs}", (("code", "c"), ("task_key", "k"))),
    renew="UPDATE {t} SET lease_until = {lease_end}, run_at = {lease_end} "
    "WHERE owner = :me AND state = 'running' AND ({triples})",
    # No RETURNING on UPDATE: when fewer rows matched than were asked, one read says which. A row
    # not renewed cannot come to match afterwards: a token is never given out twice.
    renew_read="SELECT code, task_key FROM {t} WHERE owner = :me AND state = 'running' AND ({triples})",
    leases_shape=_my_list("{triples}", (("code", "c"), ("task_key", "k"), ("token", "n"))),
    start="UPDATE {t} SET started = 1 WHERE owner = :me AND state = 'running' AND ({triples})",
    next_due_part="(SELECT run_at FROM {t} WHERE code = :pcode AND run_at IS NOT NULL ORDER BY run_at LIMIT 1)",
    floor_create=TaskStatements.floor_create.replace("INSERT INTO", "INSERT IGNORE INTO").replace(
        " ON CONFLICT (code, task_key) DO NOTHING", ""
    ),
    # No partial index on MySQL/MariaDB: the purge reads the table in primary-key order, locking only
    # the rows it deletes (READ COMMITTED's semi-consistent reads skip the others without waiting).
    purge="DELETE FROM {t} WHERE state = 'done' AND code <> '' AND updated < {cutoff} AND token <= :floor{and_code} LIMIT :n",
)

SQLITE = TaskStatements(
    dialect="sqlite",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    code             TEXT    NOT NULL,
    task_key         TEXT    NOT NULL,
    due              TEXT    NOT NULL,
    run_at           TEXT,
    payload          TEXT    NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'queued',
    attempt          INTEGER NOT NULL DEFAULT 0,
    token            INTEGER NOT NULL DEFAULT 0,
    owner            TEXT,
    lease_until      TEXT,
    last_error       TEXT,
    pending_due      TEXT,
    pending_payload  TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created          TEXT    NOT NULL,
    updated          TEXT    NOT NULL,
    occurrence       INTEGER,
    started          INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (code, task_key)
)""",
        "CREATE INDEX IF NOT EXISTS {t}_run_at ON {t} (code, run_at)",
        "CREATE INDEX IF NOT EXISTS {t}_done ON {t} (updated) WHERE state = 'done'",
    ),
    # BEGIN IMMEDIATE takes the database's write lock at once: the read and the write of add are
    # one step for every other writer (SQLite has no row locks to take instead).
    begin="BEGIN IMMEDIATE",
    # Times are text in one 26-character form (see _sqlite_time); SQLite's clock gives milliseconds.
    now="(strftime('%Y-%m-%d %H:%M:%f', 'now') || '000')",
    plus="(CASE WHEN :{p} IS NULL THEN NULL "
    "ELSE strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', :{p})) || '000' END)",
    until="(julianday({m}) - julianday('now')) * 86400.0",
    time_param=_sqlite_time,
    due_param=":due",
    codes_shape=_union_per_code,
    contains="instr(task_key, :contains) > 0",
    insert="""
INSERT INTO {t} (code, task_key, due, run_at, payload, state, attempt, token, cancel_requested, created, updated, occurrence)
VALUES (:code, :key, {due}, {due}, :payload, 'queued', 0, {floor}, 0, {now}, {now}, {floor})
ON CONFLICT (code, task_key) DO UPDATE SET {revive_excluded} WHERE {t}.state = 'done'""",
    lock_row="SELECT state, due, pending_due, {now} FROM {t} WHERE code = :code AND task_key = :key",
    lock_fence="SELECT state, owner, token FROM {t} WHERE code = :code AND task_key = :key",
    # One writer at a time: the subquery picks and the UPDATE takes under the database's write lock.
    claim="""
UPDATE {t} SET {count_attempt}, state = 'running', owner = :me, token = token + 1,
    lease_until = {lease_end}, run_at = {lease_end}, updated = {now}
WHERE rowid IN (SELECT id FROM ({each_code}) ORDER BY run_at LIMIT :n)
RETURNING {cols}""",
    claim_part="SELECT * FROM (SELECT rowid AS id, run_at FROM {t} WHERE code = :pcode AND run_at <= {now} "
    "ORDER BY run_at LIMIT :n)",
    renew="""
UPDATE {t} SET lease_until = {lease_end}, run_at = {lease_end}
FROM (SELECT json_extract(value, '$[0]') AS vc, json_extract(value, '$[1]') AS vk, json_extract(value, '$[2]') AS vt
      FROM json_each(:leases)) AS v
WHERE {t}.code = v.vc AND {t}.task_key = v.vk AND {t}.token = v.vt AND {t}.owner = :me AND {t}.state = 'running'
RETURNING code, task_key""",
    leases_shape=_one_json("leases", list),
    start="""
UPDATE {t} SET started = 1
FROM (SELECT json_extract(value, '$[0]') AS vc, json_extract(value, '$[1]') AS vk, json_extract(value, '$[2]') AS vt
      FROM json_each(:leases)) AS v
WHERE {t}.code = v.vc AND {t}.task_key = v.vk AND {t}.token = v.vt AND {t}.owner = :me AND {t}.state = 'running'""",
    done_many="""
UPDATE {t} SET {tombstone}
FROM (SELECT json_extract(value, '$[0]') AS vc, json_extract(value, '$[1]') AS vk, json_extract(value, '$[2]') AS vt
      FROM json_each(:leases)) AS v
WHERE {t}.code = v.vc AND {t}.task_key = v.vk AND {t}.token = v.vt AND {t}.owner = :me AND {t}.state = 'running'
    AND ({t}.cancel_requested = 1 OR {t}.pending_due IS NULL)
RETURNING code, task_key, token""",
    next_due_part="SELECT * FROM (SELECT run_at FROM {t} WHERE code = :pcode AND run_at IS NOT NULL ORDER BY run_at LIMIT 1)",
    purge="""
DELETE FROM {t} WHERE rowid IN (
    SELECT rowid FROM {t} WHERE state = 'done' AND code <> '' AND updated < {cutoff} AND token <= :floor{and_code} LIMIT :n
)""",
)

#: The statements for each backend dialect (the registry family of the URL).
STATEMENTS: dict[str, TaskStatements] = {"postgresql": POSTGRESQL, "mysql": MYSQL, "sqlite": SQLITE}
