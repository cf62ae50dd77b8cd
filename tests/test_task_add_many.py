"""``TaskPool.add_many`` / ``TaskStore.add_many``: many tasks in one call, on every task store.

Every task is checked before anything is written; the SQL stores write the batch in one
transaction (all or nothing), Redis in one pipelined round trip; ``transaction=`` commits the
batch with the caller's writes (SQL stores).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from mutexcron import NewTask, TaskPool
from mutexcron.errors import AttrsError, ConfigurationError
from mutexcron.tasks import AddResult
from tests import test_task_store, test_task_transactions
from tests.backends import backend_params
from tests.test_task_store import TASK_BACKENDS, TaskCtx
from tests.test_task_transactions import SQL_KINDS, App, Rollback

tasks_ctx = test_task_store.tasks_ctx  # the contract suite's fixture: a store of its own per test
app = test_task_transactions.app  # an application database with a TaskPool on it

every_backend = pytest.mark.parametrize("kind", backend_params(*TASK_BACKENDS))
every_sql_store = pytest.mark.parametrize("kind", backend_params(*SQL_KINDS))
NODE = "node-a:1:aaaa"
LATER = timedelta(hours=1)
SOON = timedelta(seconds=-1)


@every_backend
def test_add_many_adds_each_task_and_says_what_it_did_in_order(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("mail", "kept", LATER, {"v": 0})
    store.add("mail", "busy", SOON)
    [running] = store.claim(NODE, ["mail"], 1, 30)
    assert running.key == "busy"
    batch = [
        NewTask("mail", "new-1", LATER, {"to": "a"}),
        ("mail", "kept", LATER, {"v": 1}),
        ("mail", "busy", LATER),
        ("report", "new-2", SOON),
    ]
    results = store.add_many(batch, on_conflict="keep")
    assert results == [AddResult.INSERTED, AddResult.KEPT, AddResult.KEPT, AddResult.INSERTED]
    kept = store.get("mail", "kept")
    assert kept is not None and kept.payload == {"v": 0}
    again = store.add_many([("mail", "kept", LATER, {"v": 2}), ("mail", "busy", LATER, {"v": 3})])
    assert again == [AddResult.REPLACED, AddResult.PENDING]  # replace: the running one's values wait
    new = store.get("mail", "new-1")
    assert new is not None and new.payload == {"to": "a"} and new.state == "queued"
    assert [t.key for t in store.claim(NODE, ["report"], 5, 30)] == ["new-2"]  # due now: claimable
    assert store.add_many([]) == []


@every_backend
@pytest.mark.parametrize(
    ("bad", "error", "says"),
    [
        (("mail", "", LATER), ConfigurationError, "task 2 of add_many"),
        (("mail", "x", "tomorrow"), ConfigurationError, "task 2 of add_many"),
        (("mail", "x", LATER, {"f": object()}), AttrsError, "task 2 of add_many"),
        (("mail", "ok-0", LATER), ConfigurationError, "task 2 of add_many: .* is task 1 too"),
        (["mail", "x", LATER], ConfigurationError, "give NewTask"),
    ],
)
def test_a_bad_task_anywhere_in_the_batch_adds_nothing(tasks_ctx: TaskCtx, bad: object, error: type, says: str) -> None:
    store = tasks_ctx.make()
    with pytest.raises(error, match=says):
        store.add_many([("mail", "ok-0", LATER), bad, ("mail", "ok-2", LATER)])
    assert store.list(code="mail") == []


@pytest.mark.parametrize("kind", backend_params("sqlite"))
def test_a_pool_refuses_a_string_or_a_dict_for_the_batch(tasks_ctx: TaskCtx) -> None:
    pool = TaskPool(tasks_ctx.make())
    for wrong in ("mail", {"code": "mail"}):
        with pytest.raises(ConfigurationError, match="list of tasks"):
            pool.add_many(wrong)  # type: ignore[arg-type]


@every_backend
def test_a_generator_of_tasks_is_taken_once(tasks_ctx: TaskCtx) -> None:
    pool = TaskPool(tasks_ctx.make())
    results = pool.add_many(("feed", f"k{i}", LATER, {"i": i}) for i in range(250))
    assert results == [AddResult.INSERTED] * 250
    assert len(pool.list(code="feed", limit=1000)) == 250


@every_backend
def test_tokens_keep_going_up_for_a_task_added_again_in_a_batch(tasks_ctx: TaskCtx) -> None:
    store = tasks_ctx.make()
    store.add("once", "k", SOON)
    [first] = store.claim(NODE, ["once"], 1, 30)
    from mutexcron.tasks import Done

    assert store.complete(NODE, "once", "k", first.token, Done())
    assert store.add_many([("once", "k", SOON)]) == [AddResult.INSERTED]
    [second] = store.claim(NODE, ["once"], 1, 30)
    assert second.token > first.token


@every_sql_store
def test_a_sql_batch_is_all_or_nothing(app: App) -> None:
    """A statement failing midway (here: a key too long for the column on MySQL/PostgreSQL, a
    forced error on SQLite) rolls back the tasks added before it in the batch."""
    store = app.pool.store
    calls = {"n": 0}
    real = store._update_existing  # type: ignore[attr-defined]

    def fail_on_the_second_existing(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the database failed midway")
        return real(*args, **kwargs)

    app.pool.add("close", "old-1", LATER)
    app.pool.add("close", "old-2", LATER)
    store._update_existing = fail_on_the_second_existing  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="failed midway"):
        app.pool.add_many([("close", "new-a", LATER), ("close", "old-1", SOON), ("close", "old-2", SOON)])
    del store._update_existing  # type: ignore[attr-defined]
    assert app.pool.get("close", "new-a") is None
    old = app.pool.get("close", "old-1")
    assert old is not None and old.due - store.now() > timedelta(minutes=50)  # not replaced


@every_sql_store
@pytest.mark.parametrize("form", ("connection", "dbapi"))
def test_a_batch_in_the_callers_transaction_commits_with_it_or_not_at_all(app: App, form: str) -> None:
    batch = [("close", f"o{i}", LATER, {"i": i}) for i in range(3)]
    with app.transaction(form) as (tx, write):
        write(1)
        assert app.pool.add_many(batch, transaction=tx) == [AddResult.INSERTED] * 3
        raise Rollback
    assert app.rows() == [] and app.pool.list(code="close") == []
    with app.transaction(form) as (tx, write):
        write(2)
        app.pool.add_many(batch, transaction=tx)
    assert app.rows() == [2] and [t.key for t in app.pool.list(code="close")] == ["o0", "o1", "o2"]
    with app.transaction("connection") as (tx, _write), pytest.raises(ConfigurationError, match="task 2 of add_many"):
        app.pool.add_many([("close", "fine", LATER), ("close", "", LATER)], transaction=tx)
    assert app.pool.get("close", "fine") is None
