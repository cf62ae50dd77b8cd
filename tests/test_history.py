"""Run history, the pause flag and node presence beyond the contract suite.

``tests/test_contract.py`` checks them on every backend; here: MySQL 8's code path (no RETURNING)
run on the MariaDB server, the ``?history=N`` option, SQL tables created before these columns
existed, and the record types' parsing.
"""

from __future__ import annotations

import contextvars
import json
import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy

from mutexcron.errors import ConfigurationError
from mutexcron.guard.handoff import AttrsHandOff
from mutexcron.locks import LockStore, Node, Presence, RunInfo, RunRecord, lock_store_from_url
from mutexcron.locks.base import DEFAULT_HISTORY, history_option
from mutexcron.locks.record import NodePresence, newest_first
from mutexcron.locks.sql import SQLLockStore
from mutexcron.node import NodeTraits
from tests import test_contract as contract
from tests.backends import ALL_BACKENDS, StoreCtx, backend_params, cleanup_sql, require_server
from tests.mongomock_support import open_mongomock

A = Node("node-a:1:aaaa", "10.0.0.1")
MYSQL8 = pytest.mark.parametrize("kind", [pytest.param("mysql8", marks=pytest.mark.mysql, id="mysql8")])


# -- MySQL 8's path: the contract tests of tests/test_contract.py ---------------------------------------
@MYSQL8
def test_mysql8_history(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    contract.test_history_keeps_the_last_20_runs_per_job_newest_first(ctx)
    contract.test_history_length_caps_each_job_on_every_write(ctx)
    contract.test_hand_off_with_history_is_one_round_trip(ctx, monkeypatch)
    contract.test_history_of_a_locks_only_job(ctx, monkeypatch)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
        pytest.param("mysql8", marks=pytest.mark.mysql, id="mysql8"),
        pytest.param("postgresql", marks=pytest.mark.postgresql, id="postgresql"),
    ],
)
def test_sql_history_is_lines_and_an_earlier_json_array_is_carried_over(ctx: StoreCtx) -> None:
    """A job's runs are one entry per line in the lock row's ``history`` object; a job's value in
    the earlier form (a JSON array of entries) is read as it is, and the job's next run turns it
    into lines, cut to ``?history=N`` (PostgreSQL, SQLite) or replaces it (MySQL, MariaDB)."""
    store = ctx.make()
    assert isinstance(store, SQLLockStore)
    store.history_length = 3
    token = store.acquire_or_renew("old", A, ttl=60).token
    earlier = [{"node": "n0", "ip": None, "token": 1, "fire_us": i * 60_000_000, "outcome": "success",
                "error": None, "started": f"2020-01-01T00:0{i}:00+00:00", "ended": f"2020-01-01T00:0{i}:01+00:00"}
               for i in range(3)]  # fmt: skip
    cast = "CAST(:h AS jsonb)" if ctx.kind == "postgresql" else ":h"
    with store.engine.begin() as conn:
        conn.execute(sqlalchemy.text(f"UPDATE {store.table} SET history = {cast} WHERE name = 'old'"),
                     {"h": json.dumps({"j": earlier, "k": earlier[:1]})})  # fmt: skip
    assert [r.node for r in store.history("old", job="j")] == ["n0"] * 3
    assert store.hand_off("old", A, token, None, RunInfo(0.1, "boom\nline two", job="j"))
    runs = store.history("old", job="j")
    carried = ctx.kind in ("sqlite", "postgresql")
    assert [(r.node, r.error) for r in runs] == [(A.node_id, "boom\nline two")] + [("n0", None)] * (2 * carried)
    assert [r.fire_time for r in runs[1:]] == [datetime(1970, 1, 1, 0, m, tzinfo=timezone.utc) for m in (2, 1)][: 2 * carried]
    assert [r.node for r in store.history("old", job="k")] == ["n0"], "a job with no new run keeps its earlier form"
    with store.engine.connect() as conn:
        stored = conn.execute(sqlalchemy.text(f"SELECT history FROM {store.table} WHERE name = 'old'")).scalar()
    jobs = stored if isinstance(stored, dict) else json.loads(stored)
    assert isinstance(jobs["j"], str) and len(jobs["j"].split("\n")) == (3 if carried else 1), "lines now"
    assert isinstance(jobs["k"], list)


@MYSQL8
def test_mysql8_refused_hand_off(ctx: StoreCtx) -> None:
    contract.test_refused_hand_off_writes_no_history(ctx)


@MYSQL8
def test_mysql8_pause(ctx: StoreCtx) -> None:
    contract.test_pause_is_an_operators_write_that_every_write_and_read_keeps(ctx)


@MYSQL8
def test_mysql8_pause_before_any_node(ctx: StoreCtx) -> None:
    contract.test_a_lock_can_be_paused_before_any_node_ran_it_and_stays_paused_across_takeovers(ctx)


@MYSQL8
def test_mysql8_presence(ctx: StoreCtx) -> None:
    contract.test_presence_is_published_with_the_renewals(ctx)


@MYSQL8
def test_mysql8_presence_round_trip(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    contract.test_renewal_with_a_presence_is_one_round_trip(ctx, monkeypatch)


@MYSQL8
def test_mysql8_presence_pruned(ctx: StoreCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    contract.test_presence_older_than_its_ttl_is_pruned(ctx, monkeypatch)


@pytest.mark.sqlite
def test_a_locks_only_job_keeps_its_runs_in_the_runs_column(tmp_path: Path) -> None:
    """A job alone on its lock is marked so (its runs go to the lock row's ``runs`` column, no
    JSON parsed); jobs sharing a lock are not, also once a second job joins a lone one."""
    from mutexcron import MutexScheduler
    from mutexcron.guard.job import _FIRE_TIME

    sched = MutexScheduler(lock_url=f"sqlite:///{tmp_path}/s.db", node_id="n1")
    for job_id, lock in (("solo", "solo"), ("a", "grp"), ("b", "grp"), ("later", "late")):
        sched.add_job(lambda: None, "interval", hours=1, id=job_id, mutex=lock)
    per_lock = sched._guard_context.jobs_per_lock
    assert {lock: per_lock[lock] for lock in ("solo", "grp", "late")} == {"solo": 1, "grp": 2, "late": 1}
    sched.add_job(lambda: None, "interval", hours=1, id="mate", mutex="late")
    assert per_lock["late"] == 2, "a second job on a lone job's lock: both are group jobs now"
    sched.start(paused=True)
    try:
        deadline = time.monotonic() + 10
        while "solo" not in sched._leases.held() and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        job = sched.get_job("solo")

        def run() -> None:
            _FIRE_TIME.set(datetime(2030, 1, 1, tzinfo=timezone.utc))
            job.func()

        contextvars.copy_context().run(run)
        store = sched.lock_store
        assert isinstance(store, SQLLockStore)
        with store.engine.connect() as conn:
            history, runs = conn.execute(sqlalchemy.text(f"SELECT history, runs FROM {store.table} WHERE name = 'solo'")).one()
        line = json.loads(runs)  # a history line: [ended_ms, node, ip, token, fire_us, duration_us], no job (the lock's name)
        assert not json.loads(history or "{}"), "the run went to the runs column"
        assert len(line) == 6 and line[1] == "n1" and line[4] == 1_893_456_000_000_000 and line[5] >= 0
        assert abs(line[0] / 1000 - time.time()) < 60, "the end time is epoch ms by the store's clock"
        assert [(r.job, r.outcome) for r in store.history("solo")] == [("solo", "success")]
    finally:
        sched.shutdown()


@pytest.mark.memory
def test_sql_history_merges_a_jobs_runs_from_the_object_and_the_column_by_end_time() -> None:
    """A job that ran in a lock group and then alone has runs in both places: read in end-time
    order, then cut to the last N; a job in one place keeps its own order. Lines and the earlier
    objects mix (the end times compare as times, not as text)."""
    from mutexcron.locks.sql import _history_lists

    base_ms = 1_893_456_000_000  # 2030-01-01

    def line(i: int, job: str | None = None) -> str:  # a history line; its token says which it is
        return json.dumps([base_ms + i * 1000, "n", None, i, None, 0] + ([None, job] if job else []))

    def earlier(i: int, job: str | None = None) -> str:  # an object written by an earlier version
        return json.dumps({"ended": f"2030-01-01 00:00:0{i}", "token": i} | ({"job": job} if job else {}))

    obj = json.dumps({"a": "\n".join([earlier(1), line(5)]), "g": line(6)})
    column = "\n".join([line(3, "a"), earlier(7, "a"), line(2, "c"), line(8), earlier(4, "c")])
    jobs = _history_lists("l", obj, column, 3)
    runs = {job: [r.token for r in newest_first("l", {job: entries})][::-1] for job, entries in jobs.items()}
    assert runs == {"a": [3, 5, 7], "c": [2, 4], "g": [6], "l": [8]}  # a line without its job is the lock's own


# -- ?history=N ---------------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_history_option_is_read_from_the_url_and_kept_from_the_driver(tmp_path: Path) -> None:
    store = lock_store_from_url(f"sqlite:///{tmp_path}/h.db?history=3")
    try:
        assert store.history_length == 3 and "history=" not in store.url
        token = store.acquire_or_renew("l", A, ttl=60).token
        for minute in range(5):
            run = RunInfo(0.1, None, fire_time=datetime(2030, 1, 1, 0, minute, tzinfo=timezone.utc))
            store.hand_off("l", A, token, None, run)
        assert [r.fire_time.minute for r in store.history("l") if r.fire_time] == [4, 3, 2]
        assert {r.job for r in store.history("l")} == {"l"}, "a run without a job is the lock's"
    finally:
        store.close()
    keyword = lock_store_from_url(f"sqlite:///{tmp_path}/h.db?history=3", history=50)
    assert keyword.history_length == 50, "the keyword wins over the URL"
    keyword.close()


@pytest.mark.memory
def test_history_option_on_memory_and_mongomock() -> None:
    assert lock_store_from_url("memory://hist-opt?history=7").history_length == 7
    assert lock_store_from_url("memory://hist-opt?history=0").history_length == 0  # no history written
    assert lock_store_from_url("memory://").history_length == DEFAULT_HISTORY
    factory, _ = open_mongomock(secrets.token_hex(3))
    assert factory().history_length == DEFAULT_HISTORY
    import mongomock

    from mutexcron.locks.mongodb import MongoDBLockStore

    store = MongoDBLockStore("mongodb://mongomock.invalid/db?collection=c&history=9", client=mongomock.MongoClient())
    assert store.history_length == 9 and "history=" not in store.url


@pytest.mark.redis
def test_history_option_on_redis() -> None:
    url = require_server("redis")
    store = lock_store_from_url(f"{url}{'&' if '?' in url else '?'}namespace=h-{secrets.token_hex(3)}&history=1000")
    try:
        assert store.history_length == 1000 and "history=" not in store.url
    finally:
        store.close()


@pytest.mark.memory
@pytest.mark.parametrize("bad", ["1001", "-1", "x", "2.5", ""])
def test_bad_history_lengths_are_configuration_errors(bad: str) -> None:
    with pytest.raises(ConfigurationError, match=r"history.*from 0 to 1000 \(runs kept per job, 0 for none"):
        history_option(f"sqlite:///x.db?history={bad}")
    with pytest.raises(ConfigurationError):
        lock_store_from_url(f"memory://bad?history={bad}")


@pytest.mark.memory
def test_history_option_leaves_other_options() -> None:
    assert history_option("postgresql://u:p@h/db?table=t&history=5&sslmode=require") == (
        "postgresql://u:p@h/db?table=t&sslmode=require",
        5,
    )
    assert history_option("redis://h:6379/0") == ("redis://h:6379/0", DEFAULT_HISTORY)


# -- SQL tables created before these columns ----------------------------------------------------------
#: The lock table as mutexcron created it before the run history and the pause flag.
OLD_TABLES = {
    "sqlite": """CREATE TABLE {t} (
    name TEXT NOT NULL PRIMARY KEY, holder TEXT, active_ip TEXT, token INTEGER NOT NULL DEFAULT 0, hb TEXT,
    ttl_ms INTEGER NOT NULL DEFAULT 0, attrs TEXT NOT NULL DEFAULT '{{}}', fires TEXT NOT NULL DEFAULT '{{}}',
    last_run_started TEXT, last_run_finished TEXT, last_error TEXT)""",
    "mysql": """CREATE TABLE {t} (
    name VARCHAR(191) NOT NULL PRIMARY KEY, holder VARCHAR(255) NULL, active_ip VARCHAR(64) NULL,
    token BIGINT NOT NULL DEFAULT 0, hb DATETIME(6) NULL, ttl_ms BIGINT NOT NULL DEFAULT 0, attrs LONGTEXT NOT NULL,
    fires LONGTEXT NOT NULL, last_run_started DATETIME(6) NULL, last_run_finished DATETIME(6) NULL, last_error TEXT NULL,
    INDEX {t}_holder (holder)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
    "postgresql": """CREATE TABLE {t} (
    name varchar(191) PRIMARY KEY, holder varchar(255), active_ip varchar(64), token bigint NOT NULL DEFAULT 0,
    hb timestamptz, ttl_ms bigint NOT NULL DEFAULT 0, attrs text NOT NULL DEFAULT '{{}}', fires jsonb NOT NULL DEFAULT '{{}}',
    last_run_started timestamptz, last_run_finished timestamptz, last_error text)""",
}


#: The presence table as mutexcron created it before the nodes' weight and tags (issue 33).
OLD_NODE_TABLES = {
    "sqlite": "CREATE TABLE {t}_nodes (node_id TEXT NOT NULL PRIMARY KEY, ip TEXT, version TEXT, seen TEXT NOT NULL, "
    "clock_offset REAL, locks TEXT NOT NULL DEFAULT '[]')",
    "mysql": "CREATE TABLE {t}_nodes (node_id VARCHAR(255) NOT NULL PRIMARY KEY, ip VARCHAR(64) NULL, version VARCHAR(64) NULL, "
    "seen DATETIME(6) NOT NULL, clock_offset DOUBLE NULL, locks LONGTEXT NOT NULL) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 "
    "COLLATE=utf8mb4_bin",
    "postgresql": "CREATE TABLE {t}_nodes (node_id varchar(255) PRIMARY KEY, ip varchar(64), version varchar(64), "
    "seen timestamptz NOT NULL, clock_offset double precision, locks text NOT NULL DEFAULT '[]')",
}


@pytest.fixture
def old_table_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(kind, URL) of a lock table (and its presence table) created by an earlier mutexcron, holding one released lock."""
    kind: str = request.param
    table = f"mc_old_{secrets.token_hex(4)}"
    base = f"sqlite:///{tmp_path}/old.db" if kind == "sqlite" else require_server(kind)
    url = f"{base}{'&' if '?' in base else '?'}table={table}"
    engine = sqlalchemy.create_engine(SQLLockStore(url).backend.engine.url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(OLD_TABLES[kind].format(t=table)))
        conn.execute(sqlalchemy.text(OLD_NODE_TABLES[kind].format(t=table)))
        insert = f"INSERT INTO {table} (name, token, ttl_ms, attrs, fires) VALUES ('old', 3, 1000, :attrs, '{{}}')"
        conn.execute(sqlalchemy.text(insert), {"attrs": '{"k": 1}'})
    engine.dispose()
    try:
        yield kind, url
    finally:
        if kind != "sqlite":
            cleanup_sql(url)


@pytest.mark.parametrize(
    "old_table_url",
    [
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
        pytest.param("postgresql", marks=pytest.mark.postgresql, id="postgresql"),
    ],
    indirect=True,
)
def test_an_older_table_gets_the_new_columns_and_keeps_its_rows(old_table_url: tuple[str, str]) -> None:
    _, url = old_table_url
    stores: list[LockStore] = [lock_store_from_url(url), lock_store_from_url(url)]
    try:
        first, second = stores
        old = first.read("old")  # the first operation adds the columns (and creates the presence table)
        assert old is not None and old.token == 3 and dict(old.attrs) == {"k": 1} and not old.paused
        assert second.history("old") == [], "the other store object finds the columns there"
        got = second.acquire_or_renew("old", A, ttl=60)
        assert got.acquired and got.token == 4
        assert second.hand_off("old", A, 4, None, RunInfo(0.1, "boom", job="j"))
        assert [r.error for r in first.history("old")] == ["boom"]
        assert first.set_paused("old", True, "ops").paused
        assert second.renew_many(A, {"old": 4}, presence=Presence("x", traits=NodeTraits(2.0, ("eu",)))) == {"old"}
        assert [(n.locks, n.traits) for n in first.nodes()] == [(("old",), NodeTraits(2.0, ("eu",)))]
        assert second.renew_many(A, {"old": 4}, presence=Presence("x")) == {"old"}, "the second write: one statement"
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize(
    "old_table_url",
    [
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("postgresql", marks=pytest.mark.postgresql, id="postgresql"),
    ],
    indirect=True,
)
def test_a_reader_reads_an_older_presence_table_without_altering_it(old_table_url: tuple[str, str]) -> None:
    """A reader upgraded before the nodes (the dashboard's read-only store) reads their presences
    (weight 1, no tags) from a presence table without the traits column, and adds no column."""
    from mutexcron.backends.base import reading_only

    _, url = old_table_url
    table = url.split("table=")[1]
    engine = sqlalchemy.create_engine(SQLLockStore(url).backend.engine.url)
    reader = reading_only(lock_store_from_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(
                sqlalchemy.text(f"INSERT INTO {table}_nodes (node_id, ip, version, seen, clock_offset, locks) "
                                "VALUES ('old-node', '10.0.0.1', '0.1.0', :seen, NULL, '[]')"),
                {"seen": datetime.now(timezone.utc).replace(tzinfo=None)},
            )  # fmt: skip
        (node,) = reader.nodes(prune=False)
        assert (node.node_id, node.traits) == ("old-node", NodeTraits())
        with engine.connect() as conn:
            columns = {c["name"] for c in sqlalchemy.inspect(conn).get_columns(f"{table}_nodes")}
        assert "traits" not in columns, "a reader alters nothing"
    finally:
        reader.close()
        engine.dispose()


@pytest.mark.sqlite
def test_ddl_has_the_presence_table_and_the_upgrade(tmp_path: Path) -> None:
    store = lock_store_from_url(f"sqlite:///{tmp_path}/d.db?table=my_locks")
    assert isinstance(store, SQLLockStore)
    ddl = store.ddl()
    assert "paused            INTEGER NOT NULL DEFAULT 0" in ddl[0] and "history           TEXT" in ddl[0]
    assert any("CREATE TABLE IF NOT EXISTS my_locks_nodes" in s for s in ddl)
    assert ddl[-1].startswith("--") and "--   ALTER TABLE my_locks ADD COLUMN history TEXT;" in ddl[-1].splitlines()
    assert all(line.startswith("--") for line in ddl[-1].splitlines())
    store.close()


# -- the record types -----------------------------------------------------------------------------------
@pytest.mark.memory
def test_run_records_from_every_stored_form() -> None:
    when = datetime(2030, 1, 1, tzinfo=timezone.utc)
    stored = {
        "j": [
            {
                "node": "n",
                "token": 2,
                "fire_us": 1_893_456_000_000_000,
                "outcome": "success",
                "error": None,
                "started": "2030-01-01 00:00:00.250",
                "ended": "2030-01-01 00:00:01.000",
            },  # SQLite text
            {"node": "n", "token": 2, "error": "boom", "started": 1_893_456_001_000, "ended": 1_893_456_002_000},  # Redis ms
            "not a run",
            [1_893_456_000_000],  # too short for a history line
        ],
        "m": [  # history lines: [ended_ms, node, ip, token, fire_us, duration_us, error, job]
            [1_893_456_010_000, "p", "10.0.0.1", 7, 1_893_456_009_000_000, 1_500_000],
            [1_893_456_020_000, "p", None, 8, None, 250, "KeyError: 'x'", "m"],
        ],
        "k": [{"node": "m", "started": when, "ended": datetime(2030, 1, 1, 0, 0, 3, tzinfo=timezone.utc)}],  # MongoDB dates
    }
    lines = newest_first("l", stored, job="m")
    assert [(r.token, r.outcome, r.error, r.node, r.ip) for r in lines] == [
        (8, "error", "KeyError: 'x'", "p", None), (7, "success", None, "p", "10.0.0.1")
    ]
    assert lines[1].ended == datetime(2030, 1, 1, 0, 0, 10, tzinfo=timezone.utc) and lines[1].duration == 1.5
    assert lines[1].fire_time == datetime(2030, 1, 1, 0, 0, 9, tzinfo=timezone.utc) and lines[0].fire_time is None
    assert lines[0].duration == pytest.approx(0.00025)
    runs = newest_first("l", {job: entries for job, entries in stored.items() if job != "m"})
    assert [(r.job, r.outcome) for r in runs] == [("k", "success"), ("j", "error"), ("j", "success")]
    assert runs[1].error == "boom" and runs[1].duration == 1.0 and runs[1].fire_time is None
    assert runs[2].fire_time == when and runs[2].duration == pytest.approx(0.75)
    assert newest_first("l", stored, job="j", limit=1) == [runs[1]]
    assert RunRecord.from_stored("l", "j", {"ended": "not a time"}).ended is None
    presence = NodePresence("n", locks=("a",))
    assert presence.to_json()["locks"] == ["a"]


@pytest.mark.memory
def test_the_hand_off_names_the_job_of_a_run() -> None:
    store = lock_store_from_url("memory://")
    handoff = AttrsHandOff(store, A, None)
    token = store.acquire_or_renew("group", A, ttl=60).token
    assert handoff.write("group", token, set(), {"x": 1}, RunInfo(0.1, None), "jobs.a")
    assert handoff.write("group", token, set(), None, RunInfo(0.1, None, job="explicit"), "jobs.b")
    assert handoff.write("group", token, set(), {"x": 2}, None, "jobs.c"), "a checkpoint writes no history"
    assert [r.job for r in store.history("group")] == ["explicit", "jobs.a"]


@pytest.mark.memory
def test_a_history_line_is_the_json_array_of_the_run() -> None:
    """The tail a run sends, after the store's ``[ended_ms``, is valid JSON in every case: quotes,
    backslashes, line breaks and non-ASCII in the error, the job and the node; no fire time; the
    error cut to 500 characters."""
    node = Node('host "1"\\:π', "10.0.0.1")
    fire = datetime(2030, 1, 1, tzinfo=timezone.utc)
    cases = [
        (RunInfo(0.25, None, fire_time=fire), None, [node.node_id, "10.0.0.1", 3, 1_893_456_000_000_000, 250_000]),
        (RunInfo(0.0, 'KeyError: "a"\nline \\ two é' + "x" * 600), None, [node.node_id, "10.0.0.1", 3, None, 0,
                                                                         ('KeyError: "a"\nline \\ two é' + "x" * 600)[:500]]),
        (RunInfo(1e-6, None), 'job "b"\t', [node.node_id, "10.0.0.1", 3, None, 1, None, 'job "b"\t']),
    ]  # fmt: skip
    for run, job, fields in cases:
        assert json.loads("[123" + run.history_tail(node, 3, job)) == [123, *fields]


# -- text the stores refuse --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", backend_params(*ALL_BACKENDS))
def test_an_error_with_a_nul_byte_or_a_lone_surrogate_is_stored_sanitised(ctx: StoreCtx) -> None:
    """PostgreSQL refuses NUL in text and in jsonb, and no driver can encode a lone surrogate: the
    hand-off of a run whose error holds one must still record the run, its error and its times."""
    store = ctx.make()
    token = store.acquire_or_renew("nul", A, ttl=60).token
    error = "ValueError: bad row b'\x00\x01' in \udcff.csv"
    fire = datetime(2024, 1, 1, tzinfo=timezone.utc)
    assert store.hand_off("nul", A, token, {"n": 1}, RunInfo(0.1, error, job="j", fire_time=fire))
    rec = store.read("nul")
    assert rec is not None and rec.last_run_finished is not None and dict(rec.attrs) == {"n": 1}
    shown = "ValueError: bad row b'\ufffd\x01' in \ufffd.csv"
    assert rec.last_error == shown
    (run,) = store.history("nul", job="j")
    assert (run.outcome, run.error, run.fire_time) == ("error", shown, fire)
