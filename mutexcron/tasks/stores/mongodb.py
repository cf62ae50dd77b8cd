"""``mongodb://`` and ``mongodb+srv://``: the MongoDB task store.

One document per task in its own collection (``?tasks_collection=``, default ``mutexcron_tasks``),
on the same :class:`~mutexcron.backends.mongodb.MongoDBBackend` (client, database, clock, error
translation) as the lock store::

    {_id, code, key, due, run_at, payload: <JSON text>, state, attempt, token, owner, lease_until,
     last_error, pending_due, pending_payload: <JSON text>, cancel_requested, created, updated, last_add}

Two indexes, created on first use: a unique one on ``(code, key)`` (one document per task) and
``(code, run_at)`` for claims and ``next_due``. ``run_at`` is when a claim may take the task: its
due or a retry's time when queued (a retry keeps ``due``, which names the occurrence), its lease's
end when running, null when failed (never claimed). Times are BSON
dates: kept to the millisecond. Payloads are stored as the JSON text
:func:`~mutexcron.tasks.checks.dump_payload` makes, so every JSON value round-trips exactly
(``$``-prefixed and dotted keys, integers beyond 64 bits).

Every write is one document command judged by the server's clock (``$$NOW`` in the update
pipelines of :mod:`mutexcron.tasks.stores.mongodb_pipelines`):

* ``add`` is one upsert (``find_one_and_update``, ``upsert=True``) whose pipeline applies the rule
  every store shares (:func:`~mutexcron.tasks.checks.decide_add`) in ``$cond``s and records its
  decision in ``last_add``, which the returned document shows. Two upserts of a new task racing on
  the unique index (E11000, where the server does not retry it itself) are retried once.
* ``claim`` reads the server's clock (``hello``'s ``localTime``), then takes one task per
  ``find_one_and_update`` (filter: the codes and ``run_at <= now``, sorted by ``run_at``: one
  ordered range of the ``(code, run_at)`` index per code, merged), up to ``limit``. Concurrent
  claims never take one task twice: each command re-checks its filter on the document it updates.
* Worker writes (renew, complete, release) filter on the fence: running, owned by the caller,
  with the caller's token. ``renew`` is one ``bulk_write`` (one ``update`` command); ``complete``
  and ``release`` are conditional writes that exclude each other (cancelled: delete; otherwise an
  update that applies a pending re-add or the outcome): the first that matches is the only write,
  and if none does, one read says whether the fence failed (False) or the task changed between
  the two commands (again). ``release`` sends each step for all its tasks in one ``bulk_write``.
  ``complete_many`` reads which of its tasks are still the caller's (one ``find``: a bulk write
  reports counts, not which write matched, and a task taken over before the batch must get
  False), then sends both exclusive writes of every one of them in one ``bulk_write`` (whichever
  matches takes the task out of the fence, so the other cannot match too).
* ``cancel`` deletes a task that is not running, or marks a running one (two exclusive writes).

A write whose outcome is unknown (a write-concern error or timeout, a network error after the
command was sent) is never assumed to have happened, nor not to have happened: it raises
StoreUnavailableError (a claim that already took tasks returns those and logs the error). The
store has no change-stream waker (:meth:`~mutexcron.tasks.base.TaskStore.waker` polls): mongomock,
on which the test suite runs, has no change streams, and polling ``next_due`` is one index seek.
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any
from urllib.parse import unquote

import pymongo.errors
from pymongo import ASCENDING, ReturnDocument, UpdateOne

from ...backends.base import UncertainOutcome
from ...backends.mongodb import MongoDBBackend
from ...errors import ConfigurationError, StoreError, StoreUnavailableError
from ...timeutil import as_utc
from ...urls import mask_url
from ..base import (
    PURGE_BATCH,
    AddResult,
    CodeSummary,
    Done,
    Due,
    Fail,
    NewTask,
    Outcome,
    PurgeBatch,
    Retry,
    TaskRecord,
    TaskStore,
)
from ..checks import (
    add_one_by_one,
    check_claim,
    check_codes,
    check_due,
    check_lease,
    check_on_conflict,
    check_outcome,
    check_state,
    check_task,
    check_time,
    decode_claimed,
    dump_payload,
    error_text,
    load_payload,
    reschedule_payload,
)
from .mongodb_pipelines import (
    add_pipeline,
    cancel_pipeline,
    claim_pipeline,
    due_expr,
    fence,
    lease_pipeline,
    outcome_pipeline,
    pending_pipeline,
    release_pipeline,
    retry_pipeline,
    start_pipeline,
    summary_pipeline,
    tombstone_pipeline,
)

__all__ = ["DEFAULT_TASKS_COLLECTION", "MongoDBTaskStore"]

log = logging.getLogger(__name__)

DEFAULT_TASKS_COLLECTION = "mutexcron_tasks"
#: The URL option naming the task collection (mutexcron's, never handed to pymongo).
TASKS_COLLECTION_OPTION = "tasks_collection"
#: Rounds of exclusive writes on a task that keeps changing between two commands before giving up.
_ROUNDS = 5
#: The indexes of the task collection: the task's identity, and the claim's ordered range.
#: The store-wide token floor's document: the tombstone of the ``('', '')`` task (a code and a key
#: no add accepts). The purge raises it; a new document starts its token from it.
FLOOR = {"code": "", "key": ""}
#: Seconds a raised floor holds before the purge deletes under it (:attr:`TaskStore.floor_settle`),
#: and the most an add relies on the floor it read (an add reads it at most once per this many
#: seconds of the node's monotonic clock, and never for more than a sixth of the settle time).
FLOOR_SETTLE = 30.0
FLOOR_FRESH = 5.0
INDEXES: tuple[tuple[list[tuple[str, int]], bool], ...] = (
    ([("code", ASCENDING), ("key", ASCENDING)], True),
    ([("code", ASCENDING), ("run_at", ASCENDING)], False),
)

Fence = tuple[str, str, int]  # (code, key, token)
_ADD_RESULTS = frozenset(result.value for result in AddResult)
Step = Callable[[Fence], Any]  # one write (UpdateOne or DeleteOne) for one fenced task


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def pop_option(url: str, name: str) -> tuple[str, str | None]:
    """``url`` without the query option ``name``, and its (unquoted) value.

    Textual, as the backend drops ``?collection=``: re-encoding the query would change values
    pymongo reads raw.
    """
    base, sep, query = url.partition("?")
    if not sep:
        return url, None
    kept: list[str] = []
    value: str | None = None
    for item in query.split("&"):
        key, _, raw = item.partition("=")
        if key == name:
            value = unquote(raw)
        elif item:
            kept.append(item)
    return (f"{base}?{'&'.join(kept)}" if kept else base), value


def _check_collection(name: str, backend: MongoDBBackend, shown: str) -> str:
    bad = sorted({c for c in name if c in "$\x00"})
    if not name or bad or name.startswith("system."):
        why = f"it must not contain {' '.join(map(repr, bad))}" if bad else "it is empty or reserved by MongoDB"
        raise ConfigurationError(f"bad MongoDB tasks collection {name!r} in {mask_url(shown)!r}: {why}")
    if name == backend.collection_name:
        raise ConfigurationError(
            f"tasks collection {name!r} in {mask_url(shown)!r} is the lock collection: tasks need a collection of their own"
        )
    return name


def _fence(node: str, task: Fence) -> dict[str, Any]:
    return fence(task[0], task[1], node, task[2])


def _check_node(node: object) -> str:
    if not isinstance(node, str) or not node:
        raise ConfigurationError(f"node={node!r}: a worker's node id is a non-empty string")
    return node


def _record(doc: Mapping[str, Any]) -> TaskRecord:
    due = as_utc(doc.get("due"))
    if due is None:
        raise StoreError(f"task {doc.get('code')!r}/{doc.get('key')!r} has no due time in the store: {doc.get('due')!r}")
    state = str(doc.get("state"))
    return TaskRecord(
        code=str(doc["code"]),
        key=str(doc["key"]),
        due=due,
        payload=load_payload(doc.get("payload")),
        state=state,
        attempt=int(doc.get("attempt") or 0),
        token=int(doc.get("token") or 0),
        owner=doc.get("owner"),
        lease_until=as_utc(doc.get("lease_until")) if state == "running" else None,
        run_at=as_utc(doc.get("run_at")) if state != "failed" else None,
        last_error=doc.get("last_error"),
        pending_due=as_utc(doc.get("pending_due")),
        pending_payload=load_payload(doc.get("pending_payload")),
        cancel_requested=bool(doc.get("cancel_requested")),
        created=as_utc(doc.get("created")),
        updated=as_utc(doc.get("updated")),
        occurrence=None if doc.get("occurrence") is None else int(doc["occurrence"]),
    )


class MongoDBTaskStore(TaskStore):
    """Durable tasks in a MongoDB collection (MongoDB >= 4.2; 5.0+ recommended).

    Args:
        url: ``mongodb://`` or ``mongodb+srv://`` (the database from the path, the lock collection
            from ``?collection=``, the task collection from ``?tasks_collection=``), or a ready
            :class:`MongoDBBackend` (shared with a lock store).
        tasks_collection: the task collection, instead of ``?tasks_collection=`` (default
            ``mutexcron_tasks``).
        client: with a URL: a ready client to use instead of building one (tests inject a
            ``mongomock.MongoClient``); the store then does not close it.
        now: with a URL, tests only: a callable returning the date to use as "now" instead of the
            server's ``$$NOW`` (which mongomock does not know). Production code never passes it.
        **options: with a URL: extra ``pymongo.MongoClient`` keyword options.
    """

    keeps_tombstones = True

    def __init__(
        self,
        url: str | MongoDBBackend,
        *,
        tasks_collection: str | None = None,
        client: Any = None,
        now: Callable[[], Any] | None = None,
        **options: Any,
    ) -> None:
        if isinstance(url, MongoDBBackend):
            if client is not None or now is not None or options:
                raise TypeError("connection options belong to the backend: MongoDBBackend(url, client=..., now=...)")
            backend, shown = url, url.url
        else:
            shown = url
            url, given = pop_option(url, TASKS_COLLECTION_OPTION)  # the driver would warn about it
            tasks_collection = tasks_collection or given
            backend = MongoDBBackend(url, client=client, now=now, **options)
        super().__init__(shown)
        self.backend = backend
        #: The task collection's name.
        self.collection_name = _check_collection(tasks_collection or DEFAULT_TASKS_COLLECTION, backend, shown)
        #: The pymongo Collection holding the task documents (primary reads, the client's write concern).
        self.collection = backend.collection(self.collection_name)
        self._indexed = False
        self._index_lock = threading.Lock()
        self.floor_settle = FLOOR_SETTLE
        self._floor_read: tuple[int, float] | None = None  # (floor, monotonic time of the read)

    # -- plumbing ----------------------------------------------------------------------------
    def now_expr(self) -> Any:
        """The expression every operation uses for "now": the backend's (the server's ``$$NOW``)."""
        return self.backend.now_expr()

    def _tasks(self) -> Any:
        """The collection, its indexes created on first use (idempotent on the server)."""
        if not self._indexed and not self.backend.read_only:  # a reader creates no index
            with self._index_lock:
                if not self._indexed:
                    self._create_indexes()
                    self._indexed = True
        return self.collection

    def _create_indexes(self) -> None:
        try:
            with self.backend.errors(f"creating the indexes of {self.collection_name!r}"):
                for keys, unique in INDEXES:
                    self.collection.create_index(keys, **({"unique": True} if unique else {}))
        except StoreUnavailableError:
            raise
        except StoreError as exc:  # e.g. no createIndex privilege: fine if the indexes are there
            with self.backend.errors(f"reading the indexes of {self.collection_name!r}"):
                present = {tuple(info["key"]) for info in self.collection.index_information().values()}
            missing = [keys for keys, _ in INDEXES if tuple(keys) not in present]
            if missing:
                raise StoreError(f"{exc}; create them yourself: {{code: 1, key: 1}} unique, and {{code: 1, run_at: 1}}") from exc

    def _write(self, what: str, operation: Callable[[], Any]) -> Any:
        """One write command; an unknown outcome raises StoreUnavailableError (never a success or a refusal)."""
        try:
            with self.backend.errors(what, write=True):
                return operation()
        except UncertainOutcome as exc:
            raise self.backend.uncertain(exc) from exc

    def _bulk(self, ops: Sequence[Any], what: str) -> int:
        """One ``bulk_write`` (one command per kind of write): how many documents matched or were deleted."""
        if not ops:
            return 0

        def run() -> Any:
            try:
                return self._tasks().bulk_write(list(ops), ordered=False)
            except pymongo.errors.BulkWriteError as exc:
                # A bulk write reports a write concern failure in its details, not as WriteConcernError.
                if exc.details.get("writeConcernErrors") and not exc.details.get("writeErrors"):
                    raise UncertainOutcome(what, "outcome unknown") from exc
                raise

        result = self._write(what, run)
        return int(result.matched_count) + int(result.deleted_count)

    def _settle(self, node: str, tasks: Sequence[Fence], steps: Sequence[Step], what: str) -> int:
        """Run ``steps`` (fenced writes that exclude each other) on ``tasks`` until each is settled or not ours.

        Each step is one bulk write for every task not known to be settled; every write takes the
        task out of the fence (deleted, or no longer running with this token), so a later step
        cannot match a task an earlier one settled. Returns how many tasks were settled.
        """
        settled = 0
        todo = list(tasks)
        for _ in range(_ROUNDS):
            done = 0
            for step in steps:
                done += self._bulk([step(task) for task in todo], what)
                if done == len(todo):
                    return settled + done
            settled += done
            # Which are still ours? Those changed between two steps (a cancel, a re-add): again.
            todo = self._still_fenced(node, todo, what)
            if not todo:
                return settled
            log.debug("%s on %s: %d task(s) changed between two writes; again", what, self.masked_url, len(todo))
        raise StoreUnavailableError(
            f"{self._where(todo[0][0], todo[0][1])}: {what} did not settle (the task kept changing between two writes)"
        )

    def _still_fenced(self, node: str, tasks: Sequence[Fence], what: str) -> list[Fence]:
        tokens = {(code, key): token for code, key, token in tasks}
        query = {"$or": [{"code": code, "key": key} for code, key, _ in tasks], "state": "running", "owner": node}
        with self.backend.errors(f"{what} (read)"):
            docs = list(self._tasks().find(query, {"code": True, "key": True, "token": True}))
        return [(d["code"], d["key"], d["token"]) for d in docs if tokens.get((d["code"], d["key"])) == d.get("token")]

    def _server_now(self) -> datetime:
        """The server's clock, read in one round trip (``hello``'s ``localTime``), or the test seam's date."""
        expr = self.now_expr()
        if isinstance(expr, datetime):
            return as_utc(expr) or expr
        with self.backend.errors("now"):
            try:
                reply = self.backend.client.admin.command("hello")
            except pymongo.errors.OperationFailure:  # a server before 4.2.10 / 4.4.2 has no "hello"
                reply = self.backend.client.admin.command("isMaster")
        now = as_utc(reply.get("localTime"))
        if now is None:
            raise self.backend.failed(None, "now", f"the server's hello reply has no localTime: {sorted(reply)!r}")
        return now

    def _where(self, code: str, key: str) -> str:
        return f"task {code!r}/{key!r} in {self.collection_name} on {self.masked_url}"

    # -- producers ---------------------------------------------------------------------------
    def add_many(self, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace") -> builtins.list[AddResult]:
        """One :meth:`add` at a time, every task checked first (see :meth:`TaskStore.add_many`)."""
        return add_one_by_one(self, tasks, on_conflict)

    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        code, key = check_task(code, key)
        at, delay = check_due(due)
        mode = check_on_conflict(on_conflict)
        text = dump_payload(payload, code, key)
        now = self.now_expr()
        pipeline = add_pipeline(now, due_expr(now, at, delay), text, mode, self._floor())
        for attempt in range(2):
            try:
                doc = self._write(
                    "add",
                    lambda: self._tasks().find_one_and_update(
                        {"code": code, "key": key},
                        pipeline,
                        projection={"last_add": True},
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    ),
                )
            except pymongo.errors.DuplicateKeyError:
                # Two upserts of a new task raced on the unique index: the document exists now.
                log.debug("add of %s: a concurrent add inserted it first; again", self._where(code, key))
                if attempt:
                    raise StoreUnavailableError(f"{self._where(code, key)}: add did not settle (duplicate key twice)") from None
                continue
            if doc is None or doc.get("last_add") not in _ADD_RESULTS:
                raise self.backend.failed(None, "add", f"the upsert returned {doc!r}")
            return AddResult(doc["last_add"])
        raise AssertionError("unreachable")  # pragma: no cover

    def cancel(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        task = {"code": code, "key": key}
        pipeline = cancel_pipeline(self.now_expr())
        tombstone = tombstone_pipeline(self.now_expr(), cancelled=True)
        for _ in range(_ROUNDS):
            dropped = self._write(
                "cancel", lambda: self._tasks().update_one({**task, "state": {"$in": ["queued", "failed"]}}, tombstone)
            )
            if dropped.matched_count:
                return True
            marked = self._write("cancel", lambda: self._tasks().update_one({**task, "state": "running"}, pipeline))
            if marked.matched_count:
                return True  # running: dropped when its attempt ends
            if self.get(code, key) is None:
                return False
        raise StoreUnavailableError(f"{self._where(code, key)}: cancel did not settle (the task kept changing state)")

    def get(self, code: str, key: str) -> TaskRecord | None:
        code, key = check_task(code, key)
        with self.backend.errors("get"):
            doc = self._tasks().find_one({"code": code, "key": key, "state": {"$ne": "done"}})
        return None if doc is None else _record(doc)

    def list(
        self,
        *,
        code: str | None = None,
        key_contains: str | None = None,
        due_before: datetime | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> list[TaskRecord]:
        query: dict[str, Any] = {}
        if code is not None:
            query["code"] = check_codes([code])[0]
        if key_contains is not None:
            if not isinstance(key_contains, str):
                raise ConfigurationError(f"key_contains={key_contains!r}: give a string")
            query["key"] = {"$regex": re.escape(key_contains)}  # a plain, case-sensitive substring
        if due_before is not None:
            query["due"] = {"$lt": check_time(due_before, "due_before")}
        query["state"] = {"$ne": "done"} if state is None else check_state(state)
        limit = int(limit)
        if limit <= 0:  # pymongo reads limit=0 as "no limit"
            return []
        with self.backend.errors("list"):
            docs = list(
                self._tasks().find(query, sort=[("due", ASCENDING), ("code", ASCENDING), ("key", ASCENDING)], limit=limit)
            )
        return [_record(doc) for doc in docs]

    def retry(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        now = self.now_expr()
        result = self._write(
            "retry", lambda: self._tasks().update_one({"code": code, "key": key, "state": "failed"}, retry_pipeline(now))
        )
        return bool(result.matched_count == 1)

    # -- workers -----------------------------------------------------------------------------
    def claim(self, node: str, codes: Iterable[str], limit: int, lease: float) -> builtins.list[TaskRecord]:
        """Up to ``limit`` ``find_one_and_update`` commands, each taking the earliest claimable task.

        ``now`` for the filter is read from the server first (one round trip), so the filter is a
        plain range of the ``(code, run_at)`` index; the lease ends at the server's ``$$NOW`` of
        each command plus ``lease``.
        """
        node = _check_node(node)
        wanted = check_codes(codes)
        limit, lease = check_claim(limit, lease)
        if not wanted:
            return []
        collection = self._tasks()
        query = {"code": {"$in": wanted}, "run_at": {"$lte": self._server_now()}}
        pipeline = claim_pipeline(self.now_expr(), node, _ms(lease))
        claimed: builtins.list[TaskRecord] = []
        while len(claimed) < limit:
            try:
                doc = self._write(
                    "claim",
                    lambda: collection.find_one_and_update(
                        query, pipeline, sort=[("run_at", ASCENDING)], return_document=ReturnDocument.AFTER
                    ),
                )
            except StoreUnavailableError:
                if not claimed:
                    raise
                log.warning("claim on %s: stopped after %d task(s): the store became unavailable", self.masked_url, len(claimed))
                break
            if doc is None:
                break
            [*decoded] = decode_claimed(self, node, [doc], _record, lambda d: (str(d["code"]), str(d["key"]), int(d["token"])))
            if not decoded:  # unreadable: failed alone
                continue
            task = decoded[0]
            if task.cancel_requested:  # cancelled, then its worker died: drop it, never run it
                drop = fence(task.code, task.key, node, task.token)
                self._write("claim (drop cancelled)", partial(collection.update_one, drop, tombstone_pipeline(self.now_expr())))
                continue
            claimed.append(task)
        return claimed

    def renew(self, node: str, tokens: Mapping[tuple[str, str], int], lease: float) -> set[tuple[str, str]]:
        """One ``bulk_write`` of fenced lease updates; if not all matched, one read says which did."""
        node = _check_node(node)
        lease = check_lease(lease)
        items = [(*check_task(code, key), int(token)) for (code, key), token in tokens.items()]
        if not items:
            return set()
        pipeline = lease_pipeline(self.now_expr(), _ms(lease))
        matched = self._bulk([UpdateOne(fence(code, key, node, token), pipeline) for code, key, token in items], "renew")
        if matched == len(items):
            return {(code, key) for code, key, _ in items}
        # Renewed: still running with our token (a token never comes back, and completing one's own
        # task meanwhile only makes it look lost).
        return {(code, key) for code, key, _ in self._still_fenced(node, items, "renew")}

    def start(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        """One ``bulk_write`` of fenced marks."""
        node = _check_node(node)
        items = [(*check_task(code, key), int(token)) for code, key, token in tasks]
        if not items:
            return 0
        return self._bulk([UpdateOne(fence(code, key, node, token), start_pipeline()) for code, key, token in items], "start")

    def complete(self, node: str, code: str, key: str, token: int, outcome: Outcome) -> bool:
        check_outcome(outcome)
        node = _check_node(node)
        code, key = check_task(code, key)
        steps = self._outcome_steps(node, outcome, reschedule_payload(outcome, code, key))
        return self._settle(node, [(code, key, int(token))], steps, "complete") == 1

    def complete_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> builtins.list[bool]:
        """One ``find`` (which tasks are still ``node``'s) and one ``bulk_write`` (both exclusive
        writes of each of them); a task named twice has its later completions in a later round,
        as one call after the other would see them. One completion is :meth:`complete`."""
        node = _check_node(node)
        items = [(*check_task(code, key), int(token), check_outcome(outcome)) for code, key, token, outcome in completions]
        payloads = [reschedule_payload(outcome, code, key) for code, key, _, outcome in items]  # checked before any write
        if len(items) <= 1:
            return [self.complete(node, *item) for item in items]
        results = [False] * len(items)
        rounds: builtins.list[builtins.list[int]] = []
        seen: dict[tuple[str, str], int] = {}
        for i, (code, key, _, _) in enumerate(items):
            n = seen[code, key] = seen.get((code, key), -1) + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(i)
        for indexes in rounds:
            tasks = {i: (items[i][0], items[i][1], items[i][2]) for i in indexes}
            fenced = set(self._still_fenced(node, builtins.list(tasks.values()), "complete"))
            todo = [i for i in indexes if tasks[i] in fenced]  # the others were taken over or are gone: False
            for _ in range(_ROUNDS):
                if not todo:
                    break
                steps = {i: self._outcome_steps(node, items[i][3], payloads[i]) for i in todo}
                matched = self._bulk([step(tasks[i]) for i in todo for step in steps[i]], "complete")
                if matched == len(todo):  # one write matched per task: each was settled
                    for i in todo:
                        results[i] = True
                    break
                todo = self._resolve(node, todo, tasks, matched, results)
            else:
                code, key, _ = tasks[todo[0]]
                raise StoreUnavailableError(
                    f"{self._where(code, key)}: complete did not settle (the task kept changing between two writes)"
                )
        return results

    def _resolve(
        self, node: str, todo: Sequence[int], tasks: Mapping[int, Fence], matched: int, results: builtins.list[bool]
    ) -> builtins.list[int]:
        """After a batch whose writes did not all match: the tasks still fenced (to write again), the
        others' results set.

        A task still fenced matched none of its writes (a cancel or a re-add landed between the
        update and the delete command): again. One no longer fenced was settled by the batch,
        unless its lease ran out and another claim took it between the batch's read and its write:
        then it runs (or ran) under a newer token, which is the evidence read here (a bulk write
        does not say which write matched).
        """
        query = {"$or": [{"code": tasks[i][0], "key": tasks[i][1]} for i in todo]}
        with self.backend.errors("complete (read)"):
            docs = {
                (d["code"], d["key"]): d
                for d in self._tasks().find(query, {"code": True, "key": True, "state": True, "owner": True, "token": True})
            }
        again = []
        for i in todo:
            code, key, token = tasks[i]
            doc = docs.get((code, key))
            if doc is not None and (doc.get("state"), doc.get("owner"), doc.get("token")) == ("running", node, token):
                again.append(i)
            else:
                results[i] = doc is None or doc.get("token") == token  # deleted, or left queued/failed under our token
        settled = sum(results[i] for i in todo if i not in again)
        if settled != matched:
            log.debug("complete on %s: %d write(s) matched, %d task(s) look settled by them", self.masked_url, matched, settled)
        return again

    def _outcome_steps(self, node: str, outcome: Outcome, payload: str | None = None) -> builtins.list[Step]:
        """The two writes recording ``outcome`` on a fenced task: they exclude each other, and each
        takes the task out of the fence (``payload``: a Reschedule's new one, as JSON text)."""
        now = self.now_expr()
        steps: builtins.list[Step]
        if isinstance(outcome, Done):
            # Cancelled, or no pending re-add: the task is dropped; else the re-add becomes the task.
            done = {"$or": [{"cancel_requested": True}, {"pending_due": None}]}
            readd = {"cancel_requested": {"$ne": True}, "pending_due": {"$ne": None}}
            steps = [
                lambda t: UpdateOne({**_fence(node, t), **done}, tombstone_pipeline(now)),
                lambda t: UpdateOne({**_fence(node, t), **readd}, pending_pipeline(now)),
            ]
        else:
            error = error_text(outcome.error) if isinstance(outcome, (Retry, Fail)) else None
            due = None if isinstance(outcome, Fail) else due_expr(now, *check_due(outcome.due))
            pipeline = outcome_pipeline(now, outcome, due, error, payload)
            steps = [
                lambda t: UpdateOne({**_fence(node, t), "cancel_requested": {"$ne": True}}, pipeline),
                lambda t: UpdateOne({**_fence(node, t), "cancel_requested": True}, tombstone_pipeline(now)),
            ]
        return steps

    def release(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        node = _check_node(node)
        items = builtins.list(dict.fromkeys((*check_task(code, key), int(token)) for code, key, token in tasks))
        if not items:
            return 0
        pipeline = release_pipeline(self.now_expr())
        steps: builtins.list[Step] = [
            lambda t: UpdateOne({**_fence(node, t), "cancel_requested": {"$ne": True}}, pipeline),
            lambda t: UpdateOne({**_fence(node, t), "cancel_requested": True}, tombstone_pipeline(self.now_expr())),
        ]
        return self._settle(node, items, steps, "release")

    def next_due(self, codes: Iterable[str]) -> float | None:
        """One aggregate: the earliest ``run_at`` of the codes (the index's first entry per code), minus now."""
        wanted = check_codes(codes)
        if not wanted:
            return None
        pipeline = [
            {"$match": {"code": {"$in": wanted}, "run_at": {"$ne": None}}},
            {"$sort": {"run_at": 1}},
            {"$limit": 1},
            {"$project": {"_id": False, "wait_ms": {"$subtract": ["$run_at", self.now_expr()]}}},
        ]
        with self.backend.errors("next_due"):
            docs = list(self._tasks().aggregate(pipeline))
        if not docs or docs[0].get("wait_ms") is None:
            return None
        return max(0.0, float(docs[0]["wait_ms"]) / 1000)

    def summary(self, codes: Iterable[str] | None = None) -> builtins.list[CodeSummary]:
        """One aggregate: a ``$group`` per code (the codes' documents are read: not for a hot path)."""
        wanted = None if codes is None else check_codes(codes)
        if wanted == []:
            return []
        with self.backend.errors("summary"):
            docs = list(self._tasks().aggregate(summary_pipeline(self.now_expr(), wanted)))
        found = {
            str(doc["_id"]): CodeSummary(
                str(doc["_id"]),
                queued=int(doc.get("queued") or 0),
                due_now=int(doc.get("due_now") or 0),
                running=int(doc.get("running") or 0),
                failed=int(doc.get("failed") or 0),
                oldest_overdue=None if doc.get("overdue_ms") is None else max(0.0, float(doc["overdue_ms"]) / 1000),
            )
            for doc in docs
        }
        for code in wanted or ():
            found.setdefault(code, CodeSummary(code))
        return [found[code] for code in sorted(found)]

    # -- retention ---------------------------------------------------------------------------
    def _floor(self) -> int:
        """The token floor a new document starts from, read at most once per :data:`FLOOR_FRESH` seconds."""
        cached = self._floor_read
        fresh = min(FLOOR_FRESH, self.floor_settle / 6)  # never relied on near the settle time
        if cached is not None and time.monotonic() - cached[1] < fresh:
            return cached[0]
        read_at = time.monotonic()  # before the read: the value is at least this fresh
        with self.backend.errors("add (token floor)"):
            doc = self._tasks().find_one(FLOOR, {"token": True})
        floor = int(doc.get("token") or 0) if doc else 0
        self._floor_read = (floor, read_at)
        return floor

    def purge_batch(self, older_than: float, *, code: str | None = None, limit: int = PURGE_BATCH) -> PurgeBatch:
        """Delete up to ``limit`` old tombstones under the settled token floor (one ``find`` of their
        ids, one ``delete_many`` that checks each again); once none is left under it, raise the floor
        over the rest (see :meth:`TaskStore.purge_batch`)."""
        now = self._server_now()
        old = self._old_tombstones(now, older_than, code)
        with self.backend.errors("purge"):
            doc = self._tasks().find_one(FLOOR, {"token": True, "updated": True})
        floor = int(doc.get("token") or 0) if doc else 0
        since = as_utc(doc.get("updated")) if doc else None
        age = (now - since).total_seconds() if since is not None else self.floor_settle
        if age < self.floor_settle:
            return PurgeBatch(0, self.floor_settle - age)
        removed = self._delete_under(old, floor, max(1, int(limit)))
        if removed >= limit:
            return PurgeBatch(removed, 0.0)
        with self.backend.errors("purge"):
            top = self._tasks().find_one({**old, "token": {"$gt": floor}}, {"token": True}, sort=[("token", -1)])
        if top is None:
            return PurgeBatch(removed, None)
        self._raise_floor(int(top["token"]), now)
        return PurgeBatch(removed, self.floor_settle)

    def _raise_floor(self, top: int, now: datetime) -> None:
        """The floor to ``top`` (never lowered), its document created if missing."""
        floor = {"state": "done", "token": top, "updated": now}
        tasks = self._tasks()
        self._write("purge (token floor)", lambda: tasks.update_one({**FLOOR, "token": {"$lt": top}}, {"$set": floor}))
        self._write("purge (token floor)", lambda: tasks.update_one(FLOOR, {"$setOnInsert": floor}, upsert=True))

    def _old_tombstones(self, now: datetime, older_than: float, code: str | None) -> dict[str, Any]:
        codes: Any = {"$ne": ""} if code is None else check_codes([code])[0]
        return {"state": "done", "code": codes, "updated": {"$lt": now - timedelta(seconds=float(older_than))}}

    def _delete_under(self, old: Mapping[str, Any], floor: int, limit: int) -> int:
        query = {**old, "token": {"$lte": floor}}
        with self.backend.errors("purge"):
            ids = [doc["_id"] for doc in self._tasks().find(query, {"_id": True}, limit=limit)]
        if not ids:
            return 0
        result = self._write("purge", lambda: self._tasks().delete_many({**query, "_id": {"$in": ids}}))
        return int(result.deleted_count)

    def count_stored(self) -> dict[str, int]:
        with self.backend.errors("count documents"):
            tasks, real = self._tasks(), {"code": {"$ne": ""}}  # the floor's document aside
            return {"rows": int(tasks.count_documents(real)), "tombstones": int(tasks.count_documents({**real, "state": "done"}))}

    def count_purgeable(self, older_than: float, *, code: str | None = None) -> int:
        with self.backend.errors("purge count"):
            return int(self._tasks().count_documents(self._old_tombstones(self._server_now(), older_than, code)))

    def now(self) -> datetime:
        return self._server_now()

    def ping(self) -> None:
        self.backend.ping()

    def close(self) -> None:
        self.backend.close()
