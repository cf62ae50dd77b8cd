"""Every statement the SQL lock store runs, one table per dialect, side by side.

A new dialect (or a dialect's variant, like MariaDB's ``RETURNING``) is one more
:class:`LockStatements` row; the store has no per-dialect branches. Templates are filled once per
store by :meth:`LockStatements.bind`, with the backend's table and clock:

* ``{t}`` the table, ``{cols}`` the record columns;
* the database's clock (:class:`mutexcron.backends.sql_dialects.SQLClock`): ``{now}``, ``{age}`` (seconds
  since ``hb``), ``{stale}`` (``hb`` older than the holder's ``ttl_ms``), ``{run_started}``
  (``{now}`` minus the run's ``:dur``); ``{l_age}`` and ``{l_stale}`` are the same on the row
  alias ``l`` (PostgreSQL's upsert needs it: unqualified columns are ambiguous there).

``{pairs}`` and ``{names}`` stay in the bound text: each call fills them with its own parameters.
Every value is a bound parameter; the table name is checked against
:data:`mutexcron.backends.sql.TABLE_RE`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..backends.sql_dialects import SQLClock
from .base import LockClaims

COLUMNS = (
    "name, holder, active_ip, token, hb, ttl_ms, attrs, fires, last_run_started, last_run_finished, last_error, "
    "paused, paused_at, paused_by, resume_catch_up, zone, triggers"
)
#: The presence columns ``nodes`` reads (then the age of ``seen``).
NODE_COLUMNS = "node_id, ip, version, seen, clock_offset, locks, traits"
#: A fire time no claim can be below: ``COALESCE(stored, -1) < -1`` is always false.
NO_CLAIM = -1

#: (statement, parameters) for ``renew_many`` of ``{name: token}``: each dialect passes the list its own way.
RenewShape = Callable[[str, Mapping[str, int]], tuple[str, dict[str, Any]]]
#: The parameters of ``claim_many`` for the claims grouped by lock (:func:`mutexcron.locks.base.group_claims`).
ClaimShape = Callable[[Mapping[str, LockClaims]], dict[str, Any]]


def json_path(job: str) -> str:
    """A JSON path to the key ``job`` (quoted, so dots and spaces are literal)."""
    return '$."' + job.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _renew_json_records(sql: str, leases: Mapping[str, int]) -> tuple[str, dict[str, Any]]:
    """PostgreSQL: one JSON array of ``{name, token}`` records (``jsonb_to_recordset``)."""
    return sql, {"leases": json.dumps([{"name": n, "token": t} for n, t in leases.items()])}


def _renew_joined_keys(sql: str, leases: Mapping[str, int]) -> tuple[str, dict[str, Any]]:
    """SQLite: one JSON array of ``name<US>token`` keys (``json_each``)."""
    return sql, {"keys": json.dumps([f"{n}\x1f{t}" for n, t in leases.items()])}


def _renew_row_values(sql: str, leases: Mapping[str, int]) -> tuple[str, dict[str, Any]]:
    """MySQL/MariaDB: ``(name, token) IN ((:n0, :t0), ...)``, two parameters per lease."""
    params: dict[str, Any] = {}
    pairs = []
    for i, (n, t) in enumerate(leases.items()):
        params[f"n{i}"], params[f"t{i}"] = n, t
        pairs.append(f"(:n{i}, :t{i})")
    return sql.replace("{pairs}", ", ".join(pairs)), params


def _claim_rows(groups: Mapping[str, LockClaims], *, paths: bool = False) -> str:
    """One JSON array of ``{name, token, job, ft, nonce}`` records, one per claim (``p``: the path to the job's fire time)."""
    rows = []
    for name, group in groups.items():
        for claim in group.claims.values():
            row: dict[str, Any] = {"name": name, "token": group.token, "job": claim.job_id}
            row.update(ft=claim.fire_us, nonce=claim.nonce)
            if paths:
                row["p"] = json_path(claim.job_id) + "[0]"
            rows.append(row)
    return json.dumps(rows)


def _claims_json(groups: Mapping[str, LockClaims]) -> dict[str, Any]:
    """PostgreSQL, SQLite: the claims as one JSON array (``jsonb_to_recordset``, ``json_each``)."""
    return {"claims": _claim_rows(groups)}


def _claims_json_with_paths(groups: Mapping[str, LockClaims]) -> dict[str, Any]:
    """MySQL/MariaDB: the same array (``JSON_TABLE``), with each job's JSON path (``JSON_EXTRACT``)."""
    return {"claims": _claim_rows(groups, paths=True)}


#: Where a run's history entry goes: nowhere (``?history=0`` or no run), the job's text in the
#: ``history`` object (a job of a lock group), or the ``runs`` column (the only job of its lock).
HISTORY_NONE, HISTORY_OBJECT, HISTORY_COLUMN = "", "object", "column"


def _hand_off(attrs: bool, run: bool, history: str) -> str:
    """The fenced ``hand_off`` UPDATE that stores attrs, the last run, and appends the run to its history."""
    sets = ["hb = {now}"] + ["attrs = :attrs"] * attrs
    sets += ["last_run_started = {run_started}", "last_run_finished = {now}", "last_error = :err"] * run
    sets += {HISTORY_NONE: [], HISTORY_OBJECT: ["history = {history}"], HISTORY_COLUMN: ["runs = {runs}"]}[history]
    return f"UPDATE {{t}} SET {', '.join(sets)} WHERE name = :name AND holder = :me AND token = :token"  # noqa: S608 - fixed fragments


#: ``hand_off`` by (stores attrs, stores the last run, where the history entry goes): the same on
#: every dialect but for the clock, ``{history}`` and ``{runs}``, the dialect's appends of the run
#: to its job's text (``LockStatements.history_set``, ``runs_set``).
_HAND_OFFS: Mapping[tuple[bool, bool, str], str] = {
    (attrs, run, history): _hand_off(attrs, run, history)
    for attrs in (False, True)
    for run in (False, True)
    for history in (HISTORY_NONE, HISTORY_OBJECT, HISTORY_COLUMN)
    if run or not history
}

#: ``hand_off_many``'s SET list (``{batch_sets}``): ``hand_off``'s assignments, each item's parts
#: switched on by its own flags, with the item's values read from the derived table ``v`` (one row
#: per item: n, tok, set_attrs, new_attrs, has_run, dur, dur_us, err, hkind, hjob, hpath, htail).
_BATCH_SETS = """hb = {now},
    attrs = CASE WHEN v.set_attrs = 1 THEN v.new_attrs ELSE attrs END,
    last_run_started = CASE WHEN v.has_run = 1 THEN {run_started} ELSE last_run_started END,
    last_run_finished = CASE WHEN v.has_run = 1 THEN {now} ELSE last_run_finished END,
    last_error = CASE WHEN v.has_run = 1 THEN v.err ELSE last_error END,
    history = CASE WHEN v.hkind = 'object' THEN {history} ELSE history END,
    runs = CASE WHEN v.hkind = 'column' THEN {runs} ELSE runs END"""
_ITEM_PARAMS = re.compile(r":(hjob|hpath|htail|dur_us|dur)\b")


def _batch_sets(fill: Mapping[str, str]) -> str:
    """:data:`_BATCH_SETS` filled, each per-run parameter of the single statement read from ``v``."""
    parts = {k: _ITEM_PARAMS.sub(r"v.\1", fill[k]) for k in ("now", "run_started", "history", "runs")}
    return _BATCH_SETS.format(**parts)


# Run history: one JSON object per lock row, ``{job: runs}``, where a job's runs are its history
# lines (``mutexcron.locks.record.HISTORY_LINE``: JSON arrays, which never hold a raw newline) one per
# line, oldest first, cut to the newest :hn in the same UPDATE. Appending and cutting are string
# operations: only the row's object is parsed (to find the job's text and to write it back), never
# the lines. Parameters: :hjob (the job), :hpath (its JSON path), :htail (the line after its end
# time: ``RunInfo.history_tail``; the statement writes ``[`` and the end time, epoch ms by the
# database clock, before it), :hn (runs kept). A job's value in the earlier form, a JSON array of
# entries (written by development builds), is turned into lines by its next write on PostgreSQL
# and SQLite, replaced by it on MySQL and MariaDB; it is read until then. PostgreSQL addresses the
# job as a key (``ARRAY[:hjob]``).
_PG_ENTRY = "'[' || CAST(floor(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS bigint) || CAST(:htail AS text)"
_PG_OLD_RUNS = """CASE jsonb_typeof(history -> CAST(:hjob AS text))
        WHEN 'array' THEN (SELECT string_agg(CAST(a.e AS text), chr(10) ORDER BY a.i)
                           FROM jsonb_array_elements(history -> CAST(:hjob AS text)) WITH ORDINALITY AS a(e, i))
        ELSE NULLIF(history ->> CAST(:hjob AS text), '') END"""


def _pg_last_runs(old: str) -> str:
    """``old`` (a job's lines, or NULL) with the run's entry appended, cut to the last :hn lines."""
    return f"""(SELECT array_to_string(r.lines[greatest(1, cardinality(r.lines) - CAST(:hn AS int) + 1):], chr(10))
    FROM (SELECT string_to_array(concat_ws(chr(10), {old}, {_PG_ENTRY}), chr(10)) AS lines) AS r)"""  # noqa: S608


_PG_HISTORY = (
    "jsonb_set(COALESCE(history, '{{}}'::jsonb), ARRAY[CAST(:hjob AS text)], to_jsonb("
    + _pg_last_runs(_PG_OLD_RUNS)
    + "))"
)
# MySQL/MariaDB: SUBSTRING_INDEX keeps the last :hn lines. No subquery: MariaDB runs an UPDATE with
# one (even one never evaluated) much more slowly, so a job's runs in the earlier form (an array)
# are not carried over here but replaced by its next run's line (they are read until then).
_MY_NEWLINE = "CHAR(10 USING utf8mb4)"
_MY_ENTRY = "CONCAT('[', FLOOR(UNIX_TIMESTAMP({now}) * 1000), :htail)"  # the session's time zone is UTC
_MY_LAST_RUNS = f"SUBSTRING_INDEX(CONCAT_WS({_MY_NEWLINE}, {{old}}, {_MY_ENTRY}), {_MY_NEWLINE}, -:hn)"
# MySQL 8: JSON_VALUE returns at most 512 characters unless told a type: the job's text is
# JSON_UNQUOTE(JSON_EXTRACT()) of a string value.
_MY_HISTORY = "JSON_SET(COALESCE(history, '{{}}'), :hpath, " + _MY_LAST_RUNS.replace(
    "{old}",
    """CASE WHEN JSON_TYPE(JSON_EXTRACT(history, :hpath)) = 'STRING'
         THEN NULLIF(JSON_UNQUOTE(JSON_EXTRACT(history, :hpath)), '') END""",
) + ")"
# MariaDB: JSON_VALUE gives a string value of any length, unescaped (NULL for an array or no value):
# the usual write parses the row's object twice (JSON_VALUE, JSON_SET).
_MARIADB_HISTORY = "JSON_SET(COALESCE(history, '{{}}'), :hpath, " + _MY_LAST_RUNS.replace(
    "{old}", "NULLIF(JSON_VALUE(history, :hpath), '')"
) + ")"
# SQLite: no JSON path for the job (its paths cannot quote every key): the job's text is found by
# key (json_each) and written back by a merge patch (json_patch replaces a value whole). The text
# and the entry are computed once (derived rows; LIMIT keeps SQLite from inlining them into each
# use); ``_sqlite_last_runs`` says how the text is cut.
_SQLITE_OLD_RUNS = """(SELECT CASE h.type WHEN 'array' THEN (SELECT group_concat(x.value, char(10)) FROM json_each(h.value) AS x)
                         ELSE NULLIF(h.value, '') END
        FROM json_each(COALESCE(history, '{{}}')) AS h WHERE h.key = :hjob)"""
_SQLITE_ENTRY = "('[' || CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER) || :htail)"


def _sqlite_last_runs(old: str) -> str:
    """``old`` (a job's lines, or NULL) with the run's entry appended, cut to the last :hn lines.
    The usual write appends (fewer than :hn lines) or drops the first line and appends (:hn); only
    a longer text (the length lowered meanwhile) is cut through json_each (lines joined by commas
    are a JSON array of the entries)."""
    return f"""(SELECT CASE
        WHEN r.k < :hn THEN r.x
        WHEN r.k = :hn THEN substr(r.x, instr(r.x, char(10)) + 1)
        ELSE (SELECT group_concat(e.value, char(10)) FROM json_each('[' || replace(r.x, char(10), ',') || ']') AS e
              WHERE e.key > r.k - :hn) END
    FROM (SELECT x, length(x) - length(replace(x, char(10), '')) AS k FROM (
          SELECT CASE WHEN o IS NULL THEN e ELSE o || char(10) || e END AS x
          FROM (SELECT {old} AS o, {_SQLITE_ENTRY} AS e LIMIT 1) LIMIT 1) LIMIT 1) AS r)"""  # noqa: S608 - fixed fragments


_SQLITE_HISTORY = "json_patch(COALESCE(history, '{{}}'), json_object(:hjob, " + _sqlite_last_runs(_SQLITE_OLD_RUNS) + "))"

# The ``runs`` column: the runs of a lock's only job, one line each (naming its job if that is not
# the lock's name), oldest first, the last :hn kept: the same string operations as above on a plain
# text column, with no JSON to parse. Parameters: :htail and :hn, as above.
_PG_RUNS = _pg_last_runs("NULLIF(runs, '')")
_MY_RUNS = _MY_LAST_RUNS.replace("{old}", "NULLIF(runs, '')")
_SQLITE_RUNS = _sqlite_last_runs("NULLIF(runs, '')")

#: The presence of nodes (``{n}``: the lock table's name + ``_nodes``), upserted with a renewal.
#: Parameters: me, ip, version, offset, locks (JSON text), traits (JSON text: the node's weight and tags).
_PRESENCE_VALUES = (
    "(node_id, ip, version, seen, clock_offset, locks, traits) VALUES (:me, :ip, :version, {now}, :offset, :locks, :traits)"
)
_PRESENCE_UPSERT = f"""INSERT INTO {{n}} {_PRESENCE_VALUES}
ON CONFLICT (node_id) DO UPDATE SET ip = excluded.ip, version = excluded.version, seen = excluded.seen,
    clock_offset = excluded.clock_offset, locks = excluded.locks, traits = excluded.traits"""
#: Presence rows older than :data:`mutexcron.locks.base.PRESENCE_TTL` (``{cutoff}``: :dur/:dur_us seconds ago).
_PRESENCE_PRUNE = "DELETE FROM {n} WHERE seen < {cutoff}"
_NODES_READ = "SELECT {node_cols}, {seen_age} AS age FROM {n} WHERE seen >= {cutoff} ORDER BY node_id"

#: ``set_paused``: the operator's flag, on an existing row or a new released one (token 0).
#: Parameters: name, paused, by, catch_up.
_PAUSE_VALUES = """(name, token, ttl_ms, attrs, fires, paused, paused_at, paused_by, resume_catch_up)
VALUES (:name, 0, 0, '{{}}', '{{}}', :paused, {now}, :by, :catch_up)"""


@dataclass(frozen=True)
class LockStatements:
    """The lock store's statements on one dialect. Defaults are the statements every dialect shares."""

    dialect: str
    ddl: tuple[str, ...]
    #: The conditional upsert, with the fire claim: params name, me, ip, ttl_ms, job, jpath0, ft, nonce.
    acquire: str
    #: False (MySQL 8): no RETURNING; the store reads the row back in the same transaction.
    acquire_returns_row: bool
    renew_many: str
    renew_shape: RenewShape
    #: True: ``renew_many`` returns the renewed names; False: the store checks the count, then reads.
    renew_returns_names: bool
    #: ``claim_many``: renew the held locks and write their newer claims (params me, and ``claim_shape``'s).
    claim_many: str
    claim_shape: ClaimShape
    #: True: ``claim_many`` returns ``(name, holder, token, fires)`` of the claimed locks as it left
    #: them. False (MySQL 8: no RETURNING): the store runs ``claim_read`` (its ``{pairs}`` filled by
    #: ``renew_shape``), which returns the same, in the same transaction.
    claim_returns_rows: bool
    #: ``hand_off``'s ``{history}``: the job's history with the run appended and cut (see ``_PG_HISTORY``).
    history_set: str
    #: ``hand_off``'s ``{runs}``: the ``runs`` column with the run appended and cut (see ``_PG_RUNS``).
    runs_set: str
    #: The presence table's CREATE statements (``{n}``).
    nodes_ddl: tuple[str, ...]
    #: Columns added since the first schema: ``(name, definition)``, added to older tables by ``ALTER TABLE``.
    added_columns: tuple[tuple[str, str], ...]
    #: The same for the presence table.
    added_node_columns: tuple[tuple[str, str], ...]
    #: ``set_paused``: returns the row like ``acquire`` (MySQL 8: the store reads it back in the same transaction).
    set_paused: str
    #: ``renew_many`` with a presence, one statement: PostgreSQL returns the renewed names; MySQL
    #: (joined UPDATE, ``{pairs}`` by ``renew_shape``) the matched rows' count, node row included.
    #: Empty (SQLite): ``renew_many`` and ``presence_upsert`` in one transaction.
    renew_presence: str
    presence_upsert: str = _PRESENCE_UPSERT
    presence_prune: str = _PRESENCE_PRUNE
    nodes_read: str = _NODES_READ
    history_read: str = "SELECT name, history, runs FROM {t} WHERE name IN ({names})"
    begin: str = "START TRANSACTION"
    claim_read: str = ""
    hand_off: Mapping[tuple[bool, bool, str], str] = field(default_factory=lambda: dict(_HAND_OFFS))
    #: ``hand_off_many``: every item's fenced hand-off in one UPDATE over the items (params me, hn,
    #: items: a JSON array of one record per item, at most one per lock), ``{batch_sets}``.
    hand_off_many: str = ""
    #: True: ``hand_off_many`` returns the names it wrote; False (MySQL/MariaDB): only the count.
    hand_off_many_returns_names: bool = True
    release: str = "UPDATE {t} SET holder = NULL WHERE name = :name AND holder = :me AND token = :token"
    #: ``hand_over``: the lock offered to :to (the next token, a lease of :ttl_ms from the database's
    #: clock, no IP yet), conditional on holder and token; attrs and fire claims are kept.
    hand_over: str = (
        "UPDATE {t} SET holder = :to, active_ip = NULL, token = token + 1, hb = {now}, ttl_ms = :ttl_ms "
        "WHERE name = :name AND holder = :me AND token = :token"
    )
    #: PostgreSQL: the notice to the successor, in the hand-over's transaction (empty: no notices).
    hand_over_notice: str = ""
    set_zone: str = "UPDATE {t} SET zone = :zone, triggers = :triggers WHERE name = :name AND holder = :me AND token = :token"
    #: The token floor in ``acquire``: read in the statement, or (``floor_cached``) the store's copy,
    #: bound as :floor (see :meth:`mutexcron.locks.sql.SQLLockStore.forget`).
    floor: str = "COALESCE((SELECT token FROM {f} WHERE id = 1), 0)"
    floor_cached: bool = False
    floor_read: str = "SELECT token FROM {f} WHERE id = 1"
    #: ``forget`` of a record no node ever held (token 0, e.g. paused by name only): it goes.
    forget_unheld: str = "DELETE FROM {t} WHERE name = :name AND token = 0"
    #: ``forget``: the record's token, and whether its lease is free (no holder, or stale), its row
    #: locked for the rest of the transaction (SQLite: the transaction holds the write lock).
    forget_lock_row: str = (
        "SELECT token, CASE WHEN holder IS NULL OR {stale} THEN 1 ELSE 0 END FROM {t} WHERE name = :name FOR UPDATE"
    )
    #: ``forget``: the store-wide token floor raised to at least :token (the one-row ``{f}`` table).
    floor_raise: str = (
        "INSERT INTO {f} AS f (id, token) VALUES (1, :token) "
        "ON CONFLICT (id) DO UPDATE SET token = GREATEST(f.token, excluded.token)"
    )
    #: ``forget`` of any other record: retired, a released record cleared of everything but its
    #: name and token, stamped ``retired_at``; an acquire or a pause revives it (``retired_at = NULL``).
    forget: str = (
        "UPDATE {t} SET holder = NULL, attrs = '{{}}', fires = '{{}}', history = '{{}}', runs = NULL, "
        "last_run_started = NULL, last_run_finished = NULL, last_error = NULL, paused = :off, paused_at = NULL, "
        "paused_by = NULL, resume_catch_up = :off, zone = NULL, triggers = NULL, retired_at = {now} "
        "WHERE name = :name AND token = :token"
    )
    #: ``forget``: delete the records retired at least :dur seconds ago and not taken since (see
    #: :data:`mutexcron.locks.base.RETIRED_KEEP`: no write that read an older floor is still going).
    forget_retired: str = "DELETE FROM {t} WHERE retired_at <= {cutoff} AND holder IS NULL"
    #: ``forget_node``: the node's presence row, if last seen at least :dur seconds ago.
    forget_node: str = "DELETE FROM {n} WHERE node_id = :node AND seen <= {cutoff}"
    read_one: str = "SELECT {cols}, {age} AS age FROM {t} WHERE name = :name"
    read_many: str = "SELECT {cols}, {age} AS age FROM {t} WHERE name IN ({names})"
    #: ``list``: retired records (``forget``) are left out.
    read_all: str = "SELECT {cols}, {age} AS age FROM {t} WHERE retired_at IS NULL ORDER BY name"

    def bind(self, table: str, clock: SQLClock) -> LockStatements:
        """This row with every template filled for ``table`` and the backend's ``clock`` (``{pairs}`` and ``{names}`` kept)."""
        fill = {
            "t": table,
            "n": f"{table}_nodes",
            "f": f"{table}_floor",
            # The token floor (``forget``): every token given to a new or taken-over record is above it.
            "floor": self.floor.format(f=f"{table}_floor"),
            "cols": COLUMNS,
            "node_cols": NODE_COLUMNS,
            "now": clock.now,
            "age": clock.age_of("hb"),
            "stale": clock.stale_of("hb", "ttl_ms"),
            "run_started": clock.minus_seconds,
            "cutoff": clock.minus_seconds,
            "seen_age": clock.age_of("seen"),
            "l_age": clock.age_of("l.hb"),
            "l_stale": clock.stale_of("l.hb", "l.ttl_ms"),
            "pairs": "{pairs}",
            "names": "{names}",
        }
        fill["history"] = self.history_set.format(**fill)
        fill["runs"] = self.runs_set.format(**fill)
        fill["presence_upsert"] = self.presence_upsert.format(**fill)
        fill["batch_sets"] = _batch_sets(fill)

        def filled(value: Any) -> Any:
            if isinstance(value, str):
                return value.format(**fill)
            if isinstance(value, tuple):
                return tuple(filled(v) for v in value)
            if isinstance(value, Mapping):
                return {k: filled(v) for k, v in value.items()}
            return value  # the shapes (callables) and flags

        return dataclasses.replace(self, **{f.name: filled(getattr(self, f.name)) for f in dataclasses.fields(self)})


POSTGRESQL = LockStatements(
    dialect="postgresql",
    hand_over_notice="SELECT pg_notify(:channel, :to)",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    name              varchar(191) PRIMARY KEY,
    holder            varchar(255),
    active_ip         varchar(64),
    token             bigint       NOT NULL DEFAULT 0,
    hb                timestamptz,
    ttl_ms            bigint       NOT NULL DEFAULT 0,
    attrs             text         NOT NULL DEFAULT '{{}}',
    fires             jsonb        NOT NULL DEFAULT '{{}}',
    last_run_started  timestamptz,
    last_run_finished timestamptz,
    last_error        text,
    paused            boolean      NOT NULL DEFAULT false,
    paused_at         timestamptz,
    paused_by         varchar(255),
    resume_catch_up   boolean      NOT NULL DEFAULT false,
    zone              varchar(64),
    triggers          text,
    history           jsonb        NOT NULL DEFAULT '{{}}',
    runs              text,
    retired_at        timestamptz
)""",
        "CREATE INDEX IF NOT EXISTS {t}_holder ON {t} (holder)",
        "CREATE TABLE IF NOT EXISTS {f} (id smallint PRIMARY KEY, token bigint NOT NULL DEFAULT 0)",
    ),
    nodes_ddl=(
        """CREATE TABLE IF NOT EXISTS {n} (
    node_id      varchar(255) PRIMARY KEY,
    ip           varchar(64),
    version      varchar(64),
    seen         timestamptz  NOT NULL,
    clock_offset double precision,
    locks        text         NOT NULL DEFAULT '[]',
    traits       text
)""",
        "CREATE INDEX IF NOT EXISTS {n}_seen ON {n} (seen)",
    ),
    added_columns=(
        ("paused", "boolean NOT NULL DEFAULT false"),
        ("paused_at", "timestamptz"),
        ("paused_by", "varchar(255)"),
        ("resume_catch_up", "boolean NOT NULL DEFAULT false"),
        ("history", "jsonb NOT NULL DEFAULT '{{}}'"),
        ("runs", "text"),
        ("zone", "varchar(64)"),
        ("triggers", "text"),
        ("retired_at", "timestamptz"),
    ),
    added_node_columns=(("traits", "text"),),
    history_set=_PG_HISTORY,
    runs_set=_PG_RUNS,
    set_paused=f"""
INSERT INTO {{t}} AS l {_PAUSE_VALUES}
ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, paused_at = excluded.paused_at,
    paused_by = excluded.paused_by, resume_catch_up = excluded.resume_catch_up, retired_at = NULL
RETURNING {{cols}}, {{l_age}} AS age""",
    # One statement: the renewal and the presence upsert are data-modifying CTEs of one query.
    renew_presence="""
WITH r AS (
    UPDATE {t} AS l SET hb = {now}
    FROM jsonb_to_recordset(CAST(:leases AS jsonb)) AS v(name text, token bigint)
    WHERE l.name = v.name AND l.token = v.token AND l.holder = :me
    RETURNING l.name
), p AS (
{presence_upsert}
)
SELECT name FROM r""",
    presence_upsert="""INSERT INTO {n} (node_id, ip, version, seen, clock_offset, locks, traits)
VALUES (:me, :ip, :version, {now}, CAST(:offset AS double precision), :locks, :traits)
ON CONFLICT (node_id) DO UPDATE SET ip = excluded.ip, version = excluded.version, seen = excluded.seen,
    clock_offset = excluded.clock_offset, locks = excluded.locks, traits = excluded.traits""",
    acquire="""
INSERT INTO {t} AS l (name, holder, active_ip, token, hb, ttl_ms, attrs, fires)
VALUES (:name, :me, :ip, {floor} + 1, {now}, :ttl_ms, '{{}}',
        CASE WHEN CAST(:ft AS bigint) >= 0
             THEN jsonb_build_object(CAST(:job AS text), jsonb_build_array(CAST(:ft AS bigint), CAST(:nonce AS text)))
             ELSE '{{}}'::jsonb END)
ON CONFLICT (name) DO UPDATE SET
    token = CASE WHEN l.holder IS NOT DISTINCT FROM CAST(:me AS varchar) THEN l.token ELSE GREATEST(l.token, {floor}) + 1 END,
    holder = :me, active_ip = :ip, hb = {now}, ttl_ms = :ttl_ms, retired_at = NULL,
    fires = CASE WHEN l.paused THEN l.fires
                 WHEN COALESCE(CAST(l.fires -> CAST(:job AS text) ->> 0 AS bigint), -1) < CAST(:ft AS bigint)
                 THEN l.fires || jsonb_build_object(CAST(:job AS text),
                                                    jsonb_build_array(CAST(:ft AS bigint), CAST(:nonce AS text)))
                 ELSE l.fires END
WHERE l.holder = :me OR l.holder IS NULL OR {l_stale}
RETURNING {cols}, {l_age} AS age""",
    acquire_returns_row=True,
    renew_many="""
UPDATE {t} AS l SET hb = {now}
FROM jsonb_to_recordset(CAST(:leases AS jsonb)) AS v(name text, token bigint)
WHERE l.name = v.name AND l.token = v.token AND l.holder = :me
RETURNING l.name""",
    renew_shape=_renew_json_records,
    renew_returns_names=True,
    # The patch is aggregated per lock first; the UPDATE keeps only its entries newer than the row's,
    # read from the row it updates: a row another session changed meanwhile is re-read (and the
    # WHERE re-checked) before this statement writes it, so a claim is never judged on old fires.
    claim_many="""
WITH c AS (
    SELECT v.name, v.token, jsonb_object_agg(v.job, jsonb_build_array(v.ft, v.nonce)) AS patch
    FROM jsonb_to_recordset(CAST(:claims AS jsonb)) AS v(name text, token bigint, job text, ft bigint, nonce text)
    GROUP BY v.name, v.token
)
UPDATE {t} AS l SET hb = {now},
    fires = CASE WHEN l.paused THEN l.fires ELSE l.fires || COALESCE((
        SELECT jsonb_object_agg(e.key, e.value) FROM jsonb_each(c.patch) AS e
        WHERE COALESCE(CAST(l.fires -> e.key ->> 0 AS bigint), -1) < CAST(e.value ->> 0 AS bigint)), '{{}}'::jsonb) END
FROM c
WHERE l.name = c.name AND l.token = c.token AND l.holder = :me
RETURNING l.name, l.holder, l.token, l.fires, l.paused""",
    claim_shape=_claims_json,
    claim_returns_rows=True,
    hand_off_many="""
UPDATE {t} AS l SET {batch_sets}
FROM jsonb_to_recordset(CAST(:items AS jsonb)) AS v(n text, tok bigint, set_attrs int, new_attrs text, has_run int,
    dur double precision, dur_us bigint, err text, hkind text, hjob text, hpath text, htail text)
WHERE l.name = v.n AND l.token = v.tok AND l.holder = :me
RETURNING l.name""",
)

# MySQL assigns ON DUPLICATE KEY UPDATE columns left to right, and later expressions see the new
# values. So ``token`` and ``fires`` come first (they read the old holder), then ``holder``, and
# only then ``ttl_ms``/``hb``, which ``_MY_FREE`` also reads: once holder is set to :me, ``_MY_FREE``
# stays true for the rest of the list iff it was true at the start.
_MY_FREE = "(holder = :me OR holder IS NULL OR {stale})"
_MYSQL_ACQUIRE = """
INSERT INTO {t} (name, holder, active_ip, token, hb, ttl_ms, attrs, fires)
VALUES (:name, :me, :ip, {floor} + 1, {now}, :ttl_ms, '{{}}',
        IF(:ft >= 0, JSON_OBJECT(:job, JSON_ARRAY(:ft, :nonce)), '{{}}'))
ON DUPLICATE KEY UPDATE
    token = IF({free}, IF(holder <=> :me, token, GREATEST(token, {floor}) + 1), token),
    retired_at = IF({free}, NULL, retired_at),
    fires = IF({free} AND NOT paused AND COALESCE(CAST(JSON_EXTRACT(fires, :jpath0) AS SIGNED), -1) < :ft,
               JSON_MERGE_PATCH(fires, JSON_OBJECT(:job, JSON_ARRAY(:ft, :nonce))), fires),
    holder = IF({free}, :me, holder),
    active_ip = IF({free}, :ip, active_ip),
    ttl_ms = IF({free}, :ttl_ms, ttl_ms),
    hb = IF({free}, {now}, hb)""".replace("{free}", _MY_FREE)

# claim_many on MySQL and MariaDB: the claims grouped per lock (derived table c, from JSON_TABLE);
# each lock's newer claims are picked from the row being written, which InnoDB reads as last
# committed and locks. VARCHAR(255) for names: a longer one is cut to 255 characters and still
# matches no stored name (at most 191).
_MY_CLAIM_COLUMNS = "job TEXT PATH '$.job', p TEXT PATH '$.p', ft BIGINT PATH '$.ft', nonce TEXT PATH '$.nonce'"
_MY_CLAIMS = """(SELECT j.name AS cname, j.token AS ctoken,
               JSON_ARRAYAGG(JSON_OBJECT('job', j.job, 'p', j.p, 'ft', j.ft, 'nonce', j.nonce)) AS claims
        FROM JSON_TABLE(:claims, '$[*]' COLUMNS (name VARCHAR(255) PATH '$.name', token BIGINT PATH '$.token', {cc})) AS j
        GROUP BY j.name, j.token) AS c"""
#: ``{f}`` (the row's fires) merged with those of the lock's claims ``{c}`` that are newer than its own.
_MY_NEWER = """JSON_MERGE_PATCH({f}, COALESCE((
        SELECT JSON_OBJECTAGG(e.job, JSON_ARRAY(e.ft, e.nonce)) FROM JSON_TABLE({c}, '$[*]' COLUMNS ({cc})) AS e
        WHERE COALESCE(CAST(JSON_EXTRACT({f}, e.p) AS SIGNED), -1) < e.ft), '{{}}'))"""
# MySQL 8 (no RETURNING at all): a joined UPDATE (STRAIGHT_JOIN: c first, whatever the table's
# size, so only the claimed rows are read and locked), then claim_read in the same transaction.
_MYSQL_CLAIM_MANY = """
UPDATE {claims}
STRAIGHT_JOIN {t} AS l ON l.name = c.cname AND l.token = c.ctoken
SET l.hb = {now}, l.fires = IF(l.paused, l.fires, {newer})
WHERE l.holder = :me"""
# MariaDB has RETURNING on INSERT only: the same claims as an INSERT ... SELECT of the claimed rows
# (read FOR UPDATE, in name order, so none can vanish before its turn and no two calls lock in
# opposite orders), each a duplicate key: ON DUPLICATE KEY UPDATE renews and claims if the row
# names this node with the token inserted (VALUE(token)), taking the claims from the fires
# inserted (VALUE(fires): never stored, as no row is new), and RETURNING gives every row as left.
# One statement. Columns are qualified: the table is also in the SELECT.
_MARIADB_CLAIM_MANY = """
INSERT INTO {t} (name, holder, token, hb, ttl_ms, attrs, fires)
SELECT c.cname, NULL, c.ctoken, NULL, 0, '{{}}', c.claims FROM {claims}
STRAIGHT_JOIN {t} AS x ON x.name = c.cname
FOR UPDATE
ON DUPLICATE KEY UPDATE
    fires = IF({t}.holder = :me AND {t}.token = VALUE({t}.token) AND NOT {t}.paused, {newer}, {t}.fires),
    hb = IF({t}.holder = :me AND {t}.token = VALUE({t}.token), {now}, {t}.hb)
RETURNING name, holder, token, fires, paused"""


_MY_ITEM_COLUMNS = """n VARCHAR(255) PATH '$.n', tok BIGINT PATH '$.tok', set_attrs INT PATH '$.set_attrs',
    new_attrs LONGTEXT PATH '$.new_attrs', has_run INT PATH '$.has_run', dur DOUBLE PATH '$.dur',
    dur_us BIGINT PATH '$.dur_us', err LONGTEXT PATH '$.err', hkind VARCHAR(8) PATH '$.hkind',
    hjob LONGTEXT PATH '$.hjob', hpath LONGTEXT PATH '$.hpath', htail LONGTEXT PATH '$.htail'"""


def _my_claim_many(template: str, fires: str, claims: str) -> str:
    """A claim_many template with the claims table and the merge of the newer ones into ``fires`` spelled out."""
    newer = _MY_NEWER.replace("{f}", fires).replace("{c}", claims)
    return template.replace("{claims}", _MY_CLAIMS).replace("{newer}", newer).replace("{cc}", _MY_CLAIM_COLUMNS)


MYSQL = LockStatements(
    dialect="mysql",
    # InnoDB reads a table in an INSERT's subquery with a shared lock: a forget frozen inside its
    # transaction would hold every acquire. The store's copy of the floor, bound, locks nothing.
    floor=":floor",
    floor_cached=True,
    floor_raise="INSERT INTO {f} (id, token) VALUES (1, :token) ON DUPLICATE KEY UPDATE token = GREATEST(token, :token)",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    name              VARCHAR(191) NOT NULL PRIMARY KEY,
    holder            VARCHAR(255) NULL,
    active_ip         VARCHAR(64)  NULL,
    token             BIGINT       NOT NULL DEFAULT 0,
    hb                DATETIME(6)  NULL,
    ttl_ms            BIGINT       NOT NULL DEFAULT 0,
    attrs             LONGTEXT     NOT NULL,
    fires             LONGTEXT     NOT NULL,
    last_run_started  DATETIME(6)  NULL,
    last_run_finished DATETIME(6)  NULL,
    last_error        TEXT         NULL,
    paused            BOOLEAN      NOT NULL DEFAULT FALSE,
    paused_at         DATETIME(6)  NULL,
    paused_by         VARCHAR(255) NULL,
    resume_catch_up   BOOLEAN      NOT NULL DEFAULT FALSE,
    zone              VARCHAR(64)  NULL,
    triggers          LONGTEXT     NULL,
    history           LONGTEXT     NULL,
    runs              LONGTEXT     NULL,
    retired_at        DATETIME(6)  NULL,
    INDEX {t}_holder (holder)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
        "CREATE TABLE IF NOT EXISTS {f} (id SMALLINT NOT NULL PRIMARY KEY, token BIGINT NOT NULL DEFAULT 0) ENGINE=InnoDB",
    ),
    nodes_ddl=(
        """CREATE TABLE IF NOT EXISTS {n} (
    node_id      VARCHAR(255) NOT NULL PRIMARY KEY,
    ip           VARCHAR(64)  NULL,
    version      VARCHAR(64)  NULL,
    seen         DATETIME(6)  NOT NULL,
    clock_offset DOUBLE       NULL,
    locks        LONGTEXT     NOT NULL,
    traits       LONGTEXT     NULL,
    INDEX {n}_seen (seen)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
    ),
    added_columns=(
        ("paused", "BOOLEAN NOT NULL DEFAULT FALSE"),
        ("paused_at", "DATETIME(6) NULL"),
        ("paused_by", "VARCHAR(255) NULL"),
        ("resume_catch_up", "BOOLEAN NOT NULL DEFAULT FALSE"),
        ("history", "LONGTEXT NULL"),
        ("runs", "LONGTEXT NULL"),
        ("zone", "VARCHAR(64) NULL"),
        ("triggers", "LONGTEXT NULL"),
        ("retired_at", "DATETIME(6) NULL"),
    ),
    added_node_columns=(("traits", "LONGTEXT NULL"),),
    history_set=_MY_HISTORY,
    runs_set=_MY_RUNS,
    set_paused=f"""
INSERT INTO {{t}} {_PAUSE_VALUES}
ON DUPLICATE KEY UPDATE paused = :paused, paused_at = {{now}}, paused_by = :by, resume_catch_up = :catch_up,
    retired_at = NULL""",
    # One statement: the node's row joined with the renewed locks (a LEFT JOIN: the node row is
    # updated with no lock held too). It needs the node row: the store inserts it first (once).
    renew_presence="""
UPDATE {n} AS n LEFT JOIN {t} AS l ON l.holder = :me AND (l.name, l.token) IN ({pairs})
SET n.ip = :ip, n.version = :version, n.seen = {now}, n.clock_offset = :offset, n.locks = :locks, n.traits = :traits,
    l.hb = {now}
WHERE n.node_id = :me""",
    presence_upsert=f"""INSERT INTO {{n}} {_PRESENCE_VALUES}
ON DUPLICATE KEY UPDATE ip = :ip, version = :version, seen = {{now}}, clock_offset = :offset, locks = :locks,
    traits = :traits""",
    acquire=_MYSQL_ACQUIRE,
    acquire_returns_row=False,  # MySQL 8 has no RETURNING
    renew_many="UPDATE {t} SET hb = {now} WHERE holder = :me AND (name, token) IN ({pairs})",
    renew_shape=_renew_row_values,
    renew_returns_names=False,
    claim_many=_my_claim_many(_MYSQL_CLAIM_MANY, "l.fires", "c.claims"),
    claim_shape=_claims_json_with_paths,
    claim_returns_rows=False,  # MySQL 8 has no RETURNING
    claim_read="SELECT name, holder, token, fires, paused FROM {t} WHERE holder = :me AND (name, token) IN ({pairs})",
    # One joined UPDATE (STRAIGHT_JOIN: the items first, so only their rows are read and locked);
    # it returns a count only: the store reads which were written when not all were.
    hand_off_many=f"""
UPDATE JSON_TABLE(:items, '$[*]' COLUMNS ({_MY_ITEM_COLUMNS})) AS v
STRAIGHT_JOIN {{t}} AS l ON l.name = v.n AND l.token = v.tok
SET {{batch_sets}}
WHERE l.holder = :me""",  # noqa: S608 - fixed fragments; every value is a bound parameter
    hand_off_many_returns_names=False,
)

#: MariaDB returns the row as updated, even from ON DUPLICATE KEY UPDATE (its UPDATE has no RETURNING).
MARIADB = dataclasses.replace(
    MYSQL,
    dialect="mariadb",
    acquire=_MYSQL_ACQUIRE + "\nRETURNING {cols}, {age}",
    acquire_returns_row=True,
    set_paused=MYSQL.set_paused + "\nRETURNING {cols}, {age}",
    history_set=_MARIADB_HISTORY,
    claim_many=_my_claim_many(_MARIADB_CLAIM_MANY, "{t}.fires", "VALUE({t}.fires)"),
    claim_returns_rows=True,
)

SQLITE = LockStatements(
    dialect="sqlite",
    ddl=(
        """CREATE TABLE IF NOT EXISTS {t} (
    name              TEXT    NOT NULL PRIMARY KEY,
    holder            TEXT,
    active_ip         TEXT,
    token             INTEGER NOT NULL DEFAULT 0,
    hb                TEXT,
    ttl_ms            INTEGER NOT NULL DEFAULT 0,
    attrs             TEXT    NOT NULL DEFAULT '{{}}',
    fires             TEXT    NOT NULL DEFAULT '{{}}',
    last_run_started  TEXT,
    last_run_finished TEXT,
    last_error        TEXT,
    paused            INTEGER NOT NULL DEFAULT 0,
    paused_at         TEXT,
    paused_by         TEXT,
    resume_catch_up   INTEGER NOT NULL DEFAULT 0,
    zone              TEXT,
    triggers          TEXT,
    history           TEXT,
    runs              TEXT,
    retired_at        TEXT
)""",
        "CREATE INDEX IF NOT EXISTS {t}_holder ON {t} (holder)",
        "CREATE TABLE IF NOT EXISTS {f} (id INTEGER NOT NULL PRIMARY KEY, token INTEGER NOT NULL DEFAULT 0)",
    ),
    nodes_ddl=(
        """CREATE TABLE IF NOT EXISTS {n} (
    node_id      TEXT    NOT NULL PRIMARY KEY,
    ip           TEXT,
    version      TEXT,
    seen         TEXT    NOT NULL,
    clock_offset REAL,
    locks        TEXT    NOT NULL DEFAULT '[]',
    traits       TEXT
)""",
        "CREATE INDEX IF NOT EXISTS {n}_seen ON {n} (seen)",
    ),
    added_columns=(
        ("paused", "INTEGER NOT NULL DEFAULT 0"),
        ("paused_at", "TEXT"),
        ("paused_by", "TEXT"),
        ("resume_catch_up", "INTEGER NOT NULL DEFAULT 0"),
        ("history", "TEXT"),
        ("runs", "TEXT"),
        ("zone", "TEXT"),
        ("triggers", "TEXT"),
        ("retired_at", "TEXT"),
    ),
    added_node_columns=(("traits", "TEXT"),),
    history_set=_SQLITE_HISTORY,
    runs_set=_SQLITE_RUNS,
    set_paused=f"""
INSERT INTO {{t}} {_PAUSE_VALUES}
ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, paused_at = excluded.paused_at,
    paused_by = excluded.paused_by, resume_catch_up = excluded.resume_catch_up, retired_at = NULL
RETURNING {{cols}}, {{age}}""",
    # No statement writes two tables: renew_many and presence_upsert run in one BEGIN IMMEDIATE
    # transaction (in-process, no network round trip).
    renew_presence="",
    # The write lock is the transaction's (BEGIN IMMEDIATE): no row locks, no FOR UPDATE.
    forget_lock_row="SELECT token, CASE WHEN holder IS NULL OR {stale} THEN 1 ELSE 0 END FROM {t} WHERE name = :name",
    floor_raise=(
        "INSERT INTO {f} (id, token) VALUES (1, :token) ON CONFLICT (id) DO UPDATE SET token = max(token, excluded.token)"
    ),
    begin="BEGIN IMMEDIATE",
    acquire="""
INSERT INTO {t} (name, holder, active_ip, token, hb, ttl_ms, attrs, fires)
VALUES (:name, :me, :ip, {floor} + 1, {now}, :ttl_ms, '{{}}',
        CASE WHEN :ft >= 0 THEN json_object(:job, json_array(:ft, :nonce)) ELSE '{{}}' END)
ON CONFLICT (name) DO UPDATE SET
    token = CASE WHEN holder IS :me THEN token ELSE max(token, {floor}) + 1 END,
    holder = :me, active_ip = :ip, hb = {now}, ttl_ms = :ttl_ms, retired_at = NULL,
    fires = CASE WHEN paused THEN fires
                 WHEN COALESCE((SELECT json_extract(value, '$[0]') FROM json_each(fires) WHERE key = :job), -1) < :ft
                 THEN json_patch(fires, json_object(:job, json_array(:ft, :nonce))) ELSE fires END
WHERE holder = :me OR holder IS NULL
   OR {stale}
RETURNING {cols}, {age}""",
    acquire_returns_row=True,
    renew_many="""
UPDATE {t} SET hb = {now}
WHERE holder = :me AND (name || char(31) || token) IN (SELECT value FROM json_each(:keys))
RETURNING name""",
    renew_shape=_renew_joined_keys,
    renew_returns_names=True,
    # SQLite >= 3.35 (UPDATE ... FROM: 3.33, RETURNING: 3.35). One writer at a time: the statement
    # reads the rows it writes under the database's write lock.
    claim_many="""
WITH c AS (
    SELECT json_extract(value, '$.name') AS name, json_extract(value, '$.token') AS token,
           json_group_object(json_extract(value, '$.job'),
                             json_array(json_extract(value, '$.ft'), json_extract(value, '$.nonce'))) AS patch
    FROM json_each(:claims) GROUP BY 1, 2
)
UPDATE {t} AS l SET hb = {now},
    fires = CASE WHEN l.paused THEN l.fires ELSE json_patch(l.fires, COALESCE((
        SELECT json_group_object(e.key, json(e.value)) FROM json_each(c.patch) AS e
        WHERE COALESCE((SELECT json_extract(f.value, '$[0]') FROM json_each(l.fires) AS f WHERE f.key = e.key), -1)
              < json_extract(e.value, '$[0]')), '{{}}')) END
FROM c
WHERE l.name = c.name AND l.token = c.token AND l.holder = :me
RETURNING name, holder, token, fires, paused""",
    claim_shape=_claims_json,
    claim_returns_rows=True,
    hand_off_many="""
UPDATE {t} AS l SET {batch_sets}
FROM (SELECT json_extract(value, '$.n') AS n, json_extract(value, '$.tok') AS tok,
             json_extract(value, '$.set_attrs') AS set_attrs, json_extract(value, '$.new_attrs') AS new_attrs,
             json_extract(value, '$.has_run') AS has_run, json_extract(value, '$.dur') AS dur,
             json_extract(value, '$.err') AS err, json_extract(value, '$.hkind') AS hkind,
             json_extract(value, '$.hjob') AS hjob, json_extract(value, '$.htail') AS htail
      FROM json_each(:items)) AS v
WHERE l.name = v.n AND l.token = v.tok AND l.holder = :me
RETURNING name""",
)

#: The statements for each backend dialect; MariaDB's row replaces MySQL's once the server says it is MariaDB.
STATEMENTS: dict[str, LockStatements] = {"postgresql": POSTGRESQL, "mysql": MYSQL, "sqlite": SQLITE}
