"""`mutexcron tasks` (list, add, cancel, retry), and the task parts of `status` and `ddl`.

Most tests run the CLI in-process (CliRunner) on a SQLite file; one test per server store runs
add/list/cancel on its own table or namespace. Bad input exits 2 and stores nothing; a store
that cannot be reached exits 1 with one line that never shows the password.
"""

from __future__ import annotations

import json
import secrets
import textwrap
from collections.abc import Iterator
from dataclasses import fields
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from mutexcron.cli.main import main
from mutexcron.cli.tasks import parse_due
from mutexcron.locks import lock_store_from_url
from mutexcron.tasks import Done, Fail, TaskRecord, TaskStore, task_store_from_url
from tests.backends import cleanup_redis, require_server

NODE = "node-a:1:aaaa"


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/tasks.db"


def used(url: str) -> None:
    """A node has run on ``url``: its lock table exists (status reads a store, it creates nothing)."""
    locks = lock_store_from_url(url)
    locks.list()
    locks.close()


@pytest.fixture
def store(url: str) -> Iterator[TaskStore]:
    opened = task_store_from_url(url)
    yield opened
    opened.close()


def _close(a: datetime | None, b: datetime, within: float = 5.0) -> bool:
    return a is not None and abs((a - b).total_seconds()) <= within


# -- --due ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now", timedelta(0)),
        ("+90s", timedelta(seconds=90)),
        ("+2h30m", timedelta(hours=2, minutes=30)),
        ("+3d", timedelta(days=3)),
        ("+1w2d", timedelta(weeks=1, days=2)),
        ("+1.5h", timedelta(hours=1.5)),
        ("2026-12-01T08:00Z", datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)),
        ("2026-12-01T08:00:00+01:00", datetime(2026, 12, 1, 7, 0, tzinfo=timezone.utc)),
        ("2026-12-01 08:00:00.5-05:00", datetime(2026, 12, 1, 13, 0, 0, 500000, tzinfo=timezone.utc)),
    ],
)
def test_parse_due(text: str, expected: datetime | timedelta) -> None:
    assert parse_due(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("2026-12-01T08:00", "no time zone: add Z for UTC"),
        ("2026-12-01 08:00:00", "local time is never assumed"),
        ("+", "not a relative due"),
        ("+3x", "not a relative due"),
        ("+d", "not a relative due"),
        ("-5m", "not a due time"),
        ("tomorrow", "not a due time"),
        ("+99999999999d", "too far ahead"),
    ],
)
def test_parse_due_refuses(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_due(text)


# -- add -----------------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_add_prints_what_happened_and_the_due(url: str, store: TaskStore) -> None:
    result = cli("tasks", "add", "promo", "sku-1", "--due", "2026-12-01T08:00Z", "--payload", '{"pct": 20}', "--lock-url", url)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("inserted: promo/sku-1 due 2026-12-01T08:00:00Z (")
    task = store.get("promo", "sku-1")
    assert task is not None and task.payload == {"pct": 20}
    assert task.due == datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)

    later = ["--due", "2026-12-02T08:00:00+01:00", "--lock-url", url]
    assert cli("tasks", "add", "promo", "sku-1", *later, "--on-conflict", "earliest").output.startswith("kept: promo/sku-1 ")
    result = cli("tasks", "add", "promo", "sku-1", *later, "--on-conflict", "latest")
    assert result.output.startswith("replaced: promo/sku-1 due 2026-12-02T07:00:00Z"), result.output
    task = store.get("promo", "sku-1")
    assert task is not None and task.payload is None and task.due == datetime(2026, 12, 2, 7, 0, tzinfo=timezone.utc)

    store.add("promo", "sku-1", timedelta(0))
    [claimed] = store.claim(NODE, ["promo"], 10, 60)
    result = cli("tasks", "add", "promo", "sku-1", "--due", "+1h", "--lock-url", url)
    assert result.exit_code == 0 and result.output.startswith("pending: promo/sku-1 is running"), result.output
    assert "when its running attempt ends" in result.output
    assert store.complete(NODE, "promo", "sku-1", claimed.token, Done())
    queued = store.get("promo", "sku-1")
    assert queued is not None and queued.state == "queued" and _close(queued.due, store.now() + timedelta(hours=1))


@pytest.mark.sqlite
def test_a_relative_due_is_a_timedelta_measured_by_the_store(url: str, store: TaskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from mutexcron.tasks.stores.sql import SQLTaskStore

    sent: list[Any] = []
    original = SQLTaskStore.add

    def spy(self: SQLTaskStore, code: str, key: str, due: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(due)
        return original(self, code, key, due, *args, **kwargs)

    monkeypatch.setattr(SQLTaskStore, "add", spy)
    result = cli("tasks", "add", "promo", "sku-1", "--due", "+3d", "--lock-url", url)
    assert result.exit_code == 0, result.output
    assert sent == [timedelta(days=3)]  # the store adds it to its own clock: this host's plays no part
    task = store.get("promo", "sku-1")
    assert task is not None and _close(task.due, store.now() + timedelta(days=3))
    assert "(in 3d 0h)" in result.output


@pytest.mark.sqlite
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--due", "2026-12-01T08:00"], "has no time zone: add Z for UTC"),
        (["--due", "now", "--payload", "{bad"], "--payload is not valid JSON"),
        (["--due", "now", "--payload", '{"x": NaN}'], "--payload is not valid JSON (NaN is not a JSON number)"),
        (["--due", "now", "--on-conflict", "newest"], "'newest' is not one of 'replace', 'keep', 'earliest', 'latest'"),
        (["--due", "+3x"], "not a relative due"),
        (["--due", "now", "--payload", "[" * 100_000], "--payload is nested too deeply"),
        (["--payload", "{}"], "Missing option '--due'"),
    ],
    ids=["naive-time", "bad-json", "nan", "on-conflict", "bad-relative", "deep-json", "no-due"],
)
def test_bad_input_exits_2_and_stores_nothing(url: str, store: TaskStore, args: list[str], problem: str) -> None:
    result = cli("tasks", "add", "promo", "sku-1", *args, "--lock-url", url)
    assert result.exit_code == 2, result.output
    assert problem in result.output
    assert "Traceback" not in result.output
    assert store.list() == []


@pytest.mark.sqlite
@pytest.mark.parametrize("key", ["", "a\nb", "x" * 192])
def test_a_bad_key_exits_2_and_stores_nothing(url: str, store: TaskStore, key: str) -> None:
    for command in (["add", "promo", key, "--due", "now"], ["cancel", "promo", key], ["retry", "promo", key]):
        result = cli("tasks", *command, "--lock-url", url)
        assert result.exit_code == 2, result.output
        assert "bad task key" in result.stderr
    assert store.list() == []


# -- list ----------------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_list_table_filters_and_json(url: str, store: TaskStore) -> None:
    nothing = cli("tasks", "list", "--lock-url", url)
    assert nothing.exit_code == 1 and "no such file" in nothing.output and "creates nothing" in nothing.output
    used(url)
    empty = cli("tasks", "list", "--lock-url", url)
    assert empty.exit_code == 0 and "(0 tasks; table mutexcron_tasks not created yet)" in empty.output
    store.add("mail", "m-1", timedelta(seconds=-5), {"to": "a@example.com"})
    store.add("mail", "m-2", timedelta(seconds=-4))
    store.add("promo", "sku-1", timedelta(hours=2), {"pct": 20})
    store.add("promo", "sku-2", timedelta(days=1))
    [running] = store.claim(NODE, ["mail"], 1, 600)
    assert running.key == "m-1"
    store.add("mail", "m-1", timedelta(minutes=5))  # pending re-add
    [failing] = store.claim(NODE, ["mail"], 1, 600)
    assert store.complete(NODE, "mail", failing.key, failing.token, Fail("ValueError: " + "bad row " * 20))

    result = cli("tasks", "list", "--lock-url", url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("task store: sqlite:///") and "(4 tasks)" in lines[0]
    assert [cell.strip() for cell in lines[1].split("  ") if cell.strip()][:4] == ["CODE", "KEY", "STATE", "DUE (UTC)"]
    assert lines[1].split()[-5:] == ["OWNER", "LEASE", "LEFT", "LAST", "ERROR"]
    rows = {line.split()[1]: line for line in lines[2:]}
    assert list(rows) == ["m-1", "m-2", "sku-1", "sku-2"]  # by due
    assert "running (re-added)" in rows["m-1"] and NODE in rows["m-1"]
    assert any(left in rows["m-1"] for left in ("9m", "10m")), rows["m-1"]
    assert " failed " in rows["m-2"] and "ValueError: bad row" in rows["m-2"] and "…" in rows["m-2"]
    assert " queued " in rows["sku-1"] and "Z " in rows["sku-1"]

    def keys(*args: str) -> list[str]:
        out = cli("tasks", "list", "--json", "--lock-url", url, *args)
        assert out.exit_code == 0, out.output
        return [task["key"] for task in json.loads(out.output)]

    assert keys("--code", "promo") == ["sku-1", "sku-2"]
    assert keys("--state", "failed") == ["m-2"]
    assert keys("--state", "running") == ["m-1"]
    assert keys("--key-contains", "sku") == ["sku-1", "sku-2"]
    assert keys("--key-contains", "SKU") == []
    assert keys("--limit", "1") == ["m-1"]
    assert "(4 tasks; the first 1 shown: --limit shows more)" in cli("tasks", "list", "--limit", "1", "--lock-url", url).output
    assert "(2 tasks; the first 1 shown" in cli("tasks", "list", "--limit", "1", "--code", "mail", "--lock-url", url).output
    by_key = cli("tasks", "list", "--limit", "1", "--key-contains", "sku", "--lock-url", url)
    assert "(2 tasks; the first 1 shown" in by_key.output
    assert "(1 task; the first 1" not in cli("tasks", "list", "--limit", "1", "--state", "failed", "--lock-url", url).output
    bad = cli("tasks", "list", "--state", "done", "--lock-url", url)
    assert bad.exit_code == 2 and "'done' is not one of" in bad.output

    data = json.loads(cli("tasks", "list", "--json", "--lock-url", url).output)
    assert set(data[0]) == {f.name for f in fields(TaskRecord)}
    first = {task["key"]: task for task in data}["m-1"]
    assert first["state"] == "running" and first["owner"] == NODE and first["payload"] == {"to": "a@example.com"}
    assert first["pending_due"] is not None and first["cancel_requested"] is False
    for name in ("due", "lease_until", "pending_due", "created", "updated"):
        when = datetime.fromisoformat(first[name])
        assert when.utcoffset() == timedelta(0), name
    assert {task["key"]: task for task in data}["sku-1"]["payload"] == {"pct": 20}


# -- cancel, retry -------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_cancel(url: str, store: TaskStore) -> None:
    missing = cli("tasks", "cancel", "promo", "nope", "--lock-url", url)
    assert missing.exit_code == 1 and "no task promo/nope" in missing.stderr
    store.add("promo", "sku-1", timedelta(hours=1))
    done = cli("tasks", "cancel", "promo", "sku-1", "--lock-url", url)
    assert done.exit_code == 0 and done.output == "cancelled: promo/sku-1\n"
    assert store.get("promo", "sku-1") is None
    store.add("promo", "sku-2", timedelta(0))
    [task] = store.claim(NODE, ["promo"], 1, 60)
    running = cli("tasks", "cancel", "promo", "sku-2", "--lock-url", url)
    assert running.exit_code == 0 and "is running; it is dropped when its attempt ends" in running.output
    assert store.complete(NODE, "promo", "sku-2", task.token, Done()) and store.get("promo", "sku-2") is None


@pytest.mark.sqlite
def test_retry(url: str, store: TaskStore) -> None:
    missing = cli("tasks", "retry", "promo", "nope", "--lock-url", url)
    assert missing.exit_code == 1 and "cannot retry promo/nope: there is no such task" in missing.stderr
    store.add("promo", "sku-1", timedelta(0))
    queued = cli("tasks", "retry", "promo", "sku-1", "--lock-url", url)
    assert queued.exit_code == 1 and "it is queued, not failed" in queued.stderr
    [task] = store.claim(NODE, ["promo"], 1, 60)
    assert store.complete(NODE, "promo", "sku-1", task.token, Fail("boom"))
    result = cli("tasks", "retry", "promo", "sku-1", "--lock-url", url)
    assert result.exit_code == 0 and result.output == "retried: promo/sku-1 is queued, due now\n"
    again = store.get("promo", "sku-1")
    assert again is not None and (again.state, again.attempt) == ("queued", 0)


@pytest.mark.sqlite
def test_the_url_comes_from_the_environment(url: str, store: TaskStore) -> None:
    env = {"MUTEXCRON_LOCK_URL": url}
    assert cli("tasks", "add", "promo", "sku-1", "--due", "+1h", env=env).exit_code == 0
    assert "promo  sku-1" in cli("tasks", "list", env=env).output
    assert store.get("promo", "sku-1") is not None


# -- status --------------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_status_before_the_task_table_exists_says_no_tasks(url: str) -> None:
    used(url)
    result = cli("status", "--lock-url", url)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "no tasks (table mutexcron_tasks not created yet)"
    data = json.loads(cli("status", "--json", "--lock-url", url).output)
    assert data["tasks"] == [] and data["locks"] == []
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    try:
        assert not sqlalchemy.inspect(engine).has_table("mutexcron_tasks"), "status created nothing"
    finally:
        engine.dispose()


@pytest.mark.sqlite
def test_status_summarises_each_code_and_warns_of_unserved_due_tasks(url: str, store: TaskStore, tmp_path: Path) -> None:
    store.add("mail", "m-1", timedelta(seconds=-30))
    store.add("mail", "m-2", timedelta(hours=1))
    store.add("promo", "sku-1", timedelta(seconds=-60))
    store.add("promo", "sku-2", timedelta(seconds=-1))
    [task] = store.claim(NODE, ["promo"], 1, 60)
    assert store.complete(NODE, "promo", task.key, task.token, Fail("boom"))
    result = cli("status", "--lock-url", url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "tasks: 2 codes" in lines
    mail = next(line for line in lines if line.strip().startswith("mail"))
    promo = next(line for line in lines if line.strip().startswith("promo"))
    assert "queued 2, due now 1, running 0, failed 0, oldest overdue 3" in mail, mail
    assert "queued 1, due now 1, running 0, failed 1, oldest overdue" in promo, promo
    assert "warning" not in result.output  # no jobs file: handlers unknown
    data = json.loads(cli("status", "--json", "--lock-url", url).output)
    assert [(s["code"], s["queued"], s["due_now"], s["failed"], s["handled"]) for s in data["tasks"]] == [
        ("mail", 2, 1, 0, None),
        ("promo", 1, 1, 1, None),
    ]

    jobs = tmp_path / "jobs.py"
    jobs.write_text(
        textwrap.dedent(f"""
            from mutexcron import MutexScheduler
            sched = MutexScheduler(lock_url={url!r})

            @sched.tasks.handler("mail")
            def send(task):
                pass
        """)
    )
    result = cli("status", str(jobs))
    assert result.exit_code == 0, result.output
    assert "warning: 1 due task of code 'promo': no handler in this jobs file serves that code" in result.output
    assert "'mail'" not in result.output
    data = json.loads(cli("status", str(jobs), "--json").output)
    assert {s["code"]: s["handled"] for s in data["tasks"]} == {"mail": True, "promo": False}


@pytest.mark.sqlite
def test_status_of_a_store_without_task_pool(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family with no task store (MongoDB, before it had one): status says so; tasks commands exit 2."""
    import dataclasses

    import mutexcron.backends
    import mutexcron.tasks

    real = mutexcron.backends.family_of

    def without_tasks(url: str, what: str = "store") -> Any:
        return dataclasses.replace(real(url, what), task_store=None)

    monkeypatch.setattr(mutexcron.backends, "family_of", without_tasks)
    monkeypatch.setattr(mutexcron.tasks, "family_of", without_tasks)
    used(url)
    result = cli("status", "--lock-url", url)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "no tasks (the sqlite store has no task pool)"
    assert json.loads(cli("status", "--json", "--lock-url", url).output)["tasks"] is None
    listed = cli("tasks", "list", "--lock-url", url)
    assert listed.exit_code == 2 and "the sqlite store has no task pool yet" in listed.output
    assert "task pool" not in cli("ddl", "--lock-url", url).output


# -- ddl -----------------------------------------------------------------------------------------
@pytest.mark.sqlite
def test_ddl_prints_the_task_table_after_the_lock_table(tmp_path: Path) -> None:
    result = cli("ddl", "--lock-url", f"sqlite:///{tmp_path}/x.db?table=my_locks&tasks_table=my_tasks")
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("CREATE TABLE IF NOT EXISTS my_locks") < out.index("CREATE TABLE IF NOT EXISTS my_tasks (")
    assert "CREATE INDEX IF NOT EXISTS my_tasks_run_at ON my_tasks (code, run_at);" in out
    assert "-- the durable task pool: table my_tasks" in out
    assert not (tmp_path / "x.db").exists() or (tmp_path / "x.db").stat().st_size == 0


@pytest.mark.redis
def test_ddl_on_redis_names_the_keys() -> None:
    result = cli("ddl", "--lock-url", "redis://:hunter2@127.0.0.1:1/0?namespace=shop")  # nothing is contacted
    assert result.exit_code == 2
    assert "mutexcron:{shop}:task:<code>:<key>" in result.output and "mutexcron:{shop}:due:<code>" in result.output
    assert "mutexcron:{shop}:lock:<name>" in result.output and "hunter2" not in result.output


@pytest.mark.mongodb
def test_ddl_on_mongodb_names_the_collection() -> None:
    pytest.importorskip("pymongo")
    result = cli("ddl", "--lock-url", "mongodb://ops:hunter2@127.0.0.1:1/jobs?collection=locks")  # nothing is contacted
    assert result.exit_code == 2
    assert "lock collection jobs.locks" in result.output and "hunter2" not in result.output


# -- an unreachable store ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [
        ["tasks", "list"],
        ["tasks", "list", "--json"],
        ["tasks", "add", "promo", "sku-1", "--due", "+1h", "--payload", '{"a": 1}'],
        ["tasks", "cancel", "promo", "sku-1"],
        ["tasks", "retry", "promo", "sku-1"],
        ["status"],
    ],
    ids=lambda c: "-".join(c[:2]),
)
@pytest.mark.parametrize(
    "unreachable",
    [
        pytest.param("postgresql://bob:hunter2@127.0.0.1:1/x?tasks_table=t", id="postgresql", marks=pytest.mark.postgresql),
        pytest.param("redis://bob:hunter2@127.0.0.1:1/0", id="redis", marks=pytest.mark.redis),
    ],
)
def test_an_unreachable_store_exits_1_with_one_line_and_no_password(command: list[str], unreachable: str) -> None:
    for env, extra in (({}, ["--lock-url", unreachable]), ({"MUTEXCRON_LOCK_URL": unreachable}, [])):
        result = cli(*command, *extra, env=env)
        assert result.exit_code == 1, result.output
        assert "hunter2" not in result.output
        assert "bob:***@" in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("mutexcron: error: ") and "Traceback" not in result.output


# -- server stores -------------------------------------------------------------------------------
def _drop_table(url: str) -> None:
    import sqlalchemy

    from mutexcron.tasks.stores.sql import SQLTaskStore

    opened = SQLTaskStore(url)
    try:
        with opened.backend.engine.connect() as conn:
            conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {opened.table}"))
            conn.commit()
    finally:
        opened.close()


@pytest.fixture
def server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    kind: str = request.param
    base = require_server(kind)
    tag = secrets.token_hex(4)
    sep = "&" if "?" in base else "?"
    if kind == "redis":
        url = f"{base}{sep}namespace=cli-tasks-{tag}"
        yield url
        cleanup_redis(url)
    else:
        url = f"{base}{sep}tasks_table=mc_cli_tasks_{tag}"
        yield url
        _drop_table(url)


@pytest.mark.parametrize(
    "server_url",
    [pytest.param(kind, marks=getattr(pytest.mark, kind), id=kind) for kind in ("postgresql", "mysql", "redis")],
    indirect=True,
)
def test_add_list_cancel_on_a_server_store(server_url: str) -> None:
    add = cli("tasks", "add", "promo", "sku-1", "--due", "+3d", "--payload", '{"pct": 20}', "--lock-url", server_url)
    assert add.exit_code == 0 and add.output.startswith("inserted: promo/sku-1 due "), add.output
    assert cli("tasks", "add", "mail", "m-1", "--due", "2001-02-03T04:05:06Z", "--lock-url", server_url).exit_code == 0
    data = json.loads(cli("tasks", "list", "--json", "--lock-url", server_url).output)
    assert [(t["code"], t["key"], t["state"]) for t in data] == [("mail", "m-1", "queued"), ("promo", "sku-1", "queued")]
    assert data[0]["due"] == "2001-02-03T04:05:06+00:00" and data[1]["payload"] == {"pct": 20}
    opened = task_store_from_url(server_url)
    try:
        task = opened.get("promo", "sku-1")
        assert task is not None and _close(task.due, opened.now() + timedelta(days=3))
    finally:
        opened.close()
    table = cli("tasks", "list", "--code", "promo", "--lock-url", server_url)
    assert "(1 task)" in table.output and "promo  sku-1  queued" in table.output
    assert cli("tasks", "cancel", "promo", "sku-1", "--lock-url", server_url).output == "cancelled: promo/sku-1\n"
    again = cli("tasks", "cancel", "promo", "sku-1", "--lock-url", server_url)
    assert again.exit_code == 1 and "no task promo/sku-1" in again.stderr
    data = json.loads(cli("tasks", "list", "--json", "--lock-url", server_url).output)
    assert [t["key"] for t in data] == ["m-1"]


# -- bulk retry and cancel (issue 25, item 13) --------------------------------------------------------
def _failed(store: TaskStore, code: str, *keys: str) -> None:
    for key in keys:
        store.add(code, key, timedelta(0))
        [task] = store.claim(NODE, [code], 1, 60)
        assert store.complete(NODE, code, task.key, task.token, Fail("boom"))


@pytest.mark.sqlite
def test_retry_all_failed_shows_the_count_asks_and_retries_only_what_matched(url: str, store: TaskStore) -> None:
    _failed(store, "mail", "m-1", "m-2", "m-3")
    _failed(store, "sms", "s-1")
    store.add("mail", "m-queued", timedelta(hours=1))
    runner = CliRunner()
    no = runner.invoke(main, ["tasks", "retry", "--all-failed", "--code", "mail", "--lock-url", url], input="n\n")
    assert no.exit_code == 1 and "3 tasks match" in no.output and "Retry these 3 tasks?" in no.stderr
    assert {t.key for t in store.list(state="failed")} == {"m-1", "m-2", "m-3", "s-1"}, "nothing changed on 'no'"
    yes = runner.invoke(main, ["tasks", "retry", "--all-failed", "--code", "mail", "--lock-url", url], input="y\n")
    assert yes.exit_code == 0 and "retried 3 of 3 tasks" in yes.output, yes.output
    assert [t.key for t in store.list(state="failed")] == ["s-1"]
    every = cli("tasks", "retry", "--all-failed", "--yes", "--lock-url", url)
    assert every.exit_code == 0 and "retried 1 of 1 task" in every.output and store.list(state="failed") == []
    none = cli("tasks", "retry", "--all-failed", "--yes", "--lock-url", url)
    assert none.exit_code == 0 and "nothing to retry" in none.output
    both = cli("tasks", "retry", "mail", "m-1", "--all-failed", "--lock-url", url)
    assert both.exit_code == 2


@pytest.mark.sqlite
def test_cancel_by_code_and_key_contains_with_a_confirmation(url: str, store: TaskStore) -> None:
    for key in ("order-1:eu", "order-2:eu", "order-3:us"):
        store.add("promo", key, timedelta(hours=1))
    store.add("other", "order-9:eu", timedelta(hours=1))
    store.add("promo", "order-4:eu", timedelta(0))
    store.claim(NODE, ["promo"], 1, 60)  # order-4:eu runs: dropped when its attempt ends
    args = ["tasks", "cancel", "--code", "promo", "--key-contains", ":eu", "--lock-url", url]
    asked = CliRunner().invoke(main, args, input="y\n")
    assert asked.exit_code == 0, asked.output
    assert "3 tasks match code='promo', key_contains=':eu'" in asked.output
    assert "cancelled 3 of 3 tasks; 1 running: dropped when their attempt ends" in asked.output
    left = {(t.code, t.key): t for t in store.list()}
    assert set(left) == {("promo", "order-3:us"), ("other", "order-9:eu"), ("promo", "order-4:eu")}
    assert left["promo", "order-4:eu"].cancel_requested
    assert cli("tasks", "cancel", "promo", "--lock-url", url).exit_code == 2  # CODE without KEY, no --code


@pytest.mark.sqlite
def test_task_pool_bulk_operations(url: str, store: TaskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from mutexcron.tasks import pool as pool_module
    from mutexcron.tasks.pool import TaskPool

    monkeypatch.setattr(pool_module, "BULK_PAGE", 2)  # several pages
    _failed(store, "mail", "m-1", "m-2", "m-3")
    _failed(store, "sms", "s-1")
    for i in range(5):
        store.add("promo", f"k-{i}", timedelta(hours=1))
    with TaskPool(url) as pool:
        assert pool.retry_failed(code="mail") == 3 and pool.retry_failed() == 1 and pool.retry_failed() == 0
        assert pool.cancel_many(code="promo", key_contains="k-") == 5 and pool.list(code="promo") == []


@pytest.mark.sqlite
def test_cancel_many_reaches_tasks_past_a_page_of_running_ones(
    url: str, store: TaskStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Running tasks being cancelled stay in the filter: the next page must still be reached."""
    from mutexcron.tasks import pool as pool_module
    from mutexcron.tasks.pool import TaskPool

    monkeypatch.setattr(pool_module, "BULK_PAGE", 2)
    for i in range(3):
        store.add("promo", f"run-{i}", timedelta(0))
    assert len(store.claim(NODE, ["promo"], 3, 60)) == 3  # running: a cancel marks them, they stay listed
    for i in range(3):
        store.add("promo", f"later-{i}", timedelta(hours=1))
    with TaskPool(url) as pool:
        assert pool.cancel_many(code="promo") == 6
        assert [t.key for t in pool.list(code="promo") if t.state == "queued"] == []


# -- tasks add-many --------------------------------------------------------------------------------
def test_add_many_reads_json_lines_and_counts_what_it_did(url: str, store: TaskStore, tmp_path: Path) -> None:
    store.add("mail", "u2", timedelta(hours=1), {"old": True})
    lines = [
        {"code": "mail", "key": "u1", "due": "+5m", "payload": {"to": "a"}},
        {"code": "mail", "key": "u2", "due": "2026-12-01T08:00Z"},
        {"code": "report", "key": "daily", "due": "now"},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    result = cli("tasks", "add-many", str(path), "--lock-url", url)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"3 task(s) from {path}: 2 inserted, 1 replaced"
    task = store.get("mail", "u1")
    assert task is not None and task.payload == {"to": "a"}
    assert _close(task.due, store.now() + timedelta(minutes=5))
    replaced = store.get("mail", "u2")
    assert replaced is not None and replaced.due == datetime(2026, 12, 1, 8, tzinfo=timezone.utc) and replaced.payload is None
    args = ["tasks", "add-many", "-", "--on-conflict", "keep", "--lock-url", url]
    kept = CliRunner().invoke(main, args, input=path.read_text())
    assert kept.output.strip() == "3 task(s) from <stdin>: 3 kept", kept.output


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 2: not a JSON object"),
        ('["mail", "x", "now"]', 'line 2: give an object with "code", "key", "due"'),
        ('{"code": "mail", "key": "x"}', 'line 2: give an object with "code", "key", "due"'),
        ('{"code": "mail", "key": "x", "due": "now", "prio": 1}', "nothing else"),
        ('{"code": "mail", "key": "x", "due": "tomorrow"}', "line 2: 'tomorrow' is not a due time"),
        ('{"code": "mail", "key": "", "due": "now"}', ", line 2: "),
        ('{"code": "mail", "key": "ok", "due": "now"}', ", line 2: ('mail', 'ok') is line 1 too"),
    ],
)
def test_add_many_stops_at_a_bad_line_before_storing_anything(
    url: str, store: TaskStore, tmp_path: Path, line: str, says: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"code": "mail", "key": "ok", "due": "now"}\n' + line + "\n")
    result = cli("tasks", "add-many", str(path), "--lock-url", url)
    assert result.exit_code == 2, result.output
    assert says in result.output and str(path) in result.output
    assert store.list(code="mail") == []
