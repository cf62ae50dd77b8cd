"""``redis://`` (and the other Redis URL forms): the Redis task store.

Every task is one hash, ``mutexcron:{<namespace>}:task:<code>:<key>``; each code has a due ZSET,
``mutexcron:{<namespace>}:due:<code>`` (member: the key; score: when a claim may take the task,
the hash's ``run_at``, in epoch microseconds: its due or a retry's time when queued, its lease's
end when running, ``+inf`` when failed), and the namespace has a codes set,
``mutexcron:{<namespace>}:task_codes``. A write that queues a task (an add, a retry, a hand-back,
an attempt's end) and makes it the first of its code to be claimable publishes the code on
``mutexcron:{<namespace>}:task_wake`` (the workers' wake-up: :mod:`mutexcron.tasks.wakeups.redis`).
``complete_many`` records many completions in one script call (one round trip). All keys share the
``{<namespace>}`` hash tag (one slot: Redis Cluster safe). Each operation is one Lua script
(:mod:`mutexcron.tasks.stores.redis_scripts`) judged by the server's ``TIME``; the client, the namespace
and the error translation are the :class:`~mutexcron.backends.redis.RedisBackend`'s.

What Redis can lose: the tasks live in the server's memory. An unpersisted Redis loses every
queued task on a restart; run it with ``appendonly yes`` and ``appendfsync everysec`` (at most
about one second of writes is lost on a crash).
"""

from __future__ import annotations

import builtins
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from ...backends.redis import RedisBackend
from ...errors import StoreError
from ..base import AddResult, CodeSummary, Done, Due, Fail, NewTask, Outcome, Reschedule, Retry, TaskRecord, TaskStore
from ..checks import (
    check_batch,
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
from ..wakeups.base import Waker
from .redis_scripts import (
    ADD_LUA,
    ADD_MANY_LUA,
    CANCEL_LUA,
    CLAIM_LUA,
    COMPLETE_LUA,
    FINISHED_LUA,
    INDEX_DUES_LUA,
    LIST_LUA,
    NEXT_DUE_LUA,
    NOW_LUA,
    RELEASE_LUA,
    RENEW_LUA,
    RETRY_LUA,
    START_LUA,
    SUMMARY_LUA,
)

__all__ = ["LIST_PAGE", "RedisTaskStore"]

log = logging.getLogger(__name__)

#: The most index members one ``list`` script reads (a script blocks the server while it runs).
LIST_PAGE = 500

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


#: Tasks one ``add_many`` script call adds (it holds the server for about a millisecond per 100).
ADD_MANY_CHUNK = 1000

def _to_us(at: datetime) -> int:
    delta = at - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _from_us(value: Any) -> datetime | None:
    if value is None or value == "":
        return None
    return _EPOCH + timedelta(microseconds=int(value))


def _escape(code: str) -> str:
    """The code as it is in a task's hash key (see :mod:`mutexcron.tasks.stores.redis_scripts`)."""
    return code.replace("%", "%25").replace(":", "%3A")


def _due_args(due: Due) -> tuple[str, str]:
    """``(absolute us, '')`` or ``('', delay us)`` for a script's due arguments."""
    at, delay = check_due(due)
    if at is not None:
        return str(_to_us(at)), ""
    assert delay is not None
    return "", str(round(delay * 1_000_000))


def _completion_args(code: str, key: str, token: int, outcome: Outcome) -> tuple[Any, ...]:
    """One completion's arguments of the complete script: code, key, token, kind, due_us, delay_us, error,
    and a Reschedule's new payload ('' keeps the task's)."""
    check_outcome(outcome)
    payload = reschedule_payload(outcome, code, key)
    at, delay, error = "", "", ""
    if isinstance(outcome, Done):
        kind = "done"
    elif isinstance(outcome, Fail):
        kind, error = "fail", error_text(outcome.error)
    else:
        at, delay = _due_args(outcome.due)
        kind = "reschedule" if isinstance(outcome, Reschedule) else "retry"
        if isinstance(outcome, Retry):
            error = error_text(outcome.error)
    return code, key, int(token), kind, at, delay, error, "" if payload is None else payload


def _ident(fields: Mapping[str, str]) -> tuple[str, str, int]:
    return fields["code"], fields["key"], int(fields.get("token") or 0)


def _decoded(fields: Mapping[str, str]) -> TaskRecord:
    """A task hash as a record; one holding a value no record can hold is a StoreError naming the task."""
    try:
        return _record(fields)
    except (ValueError, OverflowError, KeyError) as exc:
        raise StoreError(
            f"task {fields.get('code')!r}/{fields.get('key')!r} cannot be read: {type(exc).__name__}: {exc}"
        ) from exc


def _fields(flat: Sequence[Any]) -> dict[str, str]:
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}


def _record(fields: Mapping[str, str]) -> TaskRecord:
    due = _from_us(fields["due"])
    assert due is not None
    pending = fields.get("pending_payload") or None
    state = fields["state"]
    lease_until = _from_us(fields.get("lease_until")) if state == "running" else None
    if "run_at" in fields:
        run_at = _from_us(fields["run_at"]) if state != "failed" else None
    else:  # a hash written before run_at was kept in it
        run_at = {"queued": due, "running": lease_until}.get(state)
    return TaskRecord(
        code=fields["code"],
        key=fields["key"],
        due=due,
        payload=load_payload(fields.get("payload") or "null"),
        state=state,
        attempt=int(fields.get("attempt") or 0),
        token=int(fields.get("token") or 0),
        owner=fields.get("owner") or None,
        lease_until=lease_until,
        run_at=run_at,
        last_error=fields.get("last_error") or None,
        pending_due=_from_us(fields.get("pending_due")),
        pending_payload=load_payload(pending),
        cancel_requested=fields.get("cancel_requested") == "1",
        created=_from_us(fields.get("created")),
        updated=_from_us(fields.get("updated")),
        occurrence=int(fields["occurrence"]) if fields.get("occurrence") else None,
    )


class RedisTaskStore(TaskStore):
    """Durable tasks in Redis: one Lua script per operation, judged by the server's clock.

    Args:
        url: any Redis URL form of :data:`mutexcron.backends.redis.URL_FORMS`, or a ready
            :class:`RedisBackend`.
        **options: with a URL, the backend's (``namespace``, ``socket_timeout``...).
    """

    def __init__(self, url: str | RedisBackend, **options: Any) -> None:
        if isinstance(url, RedisBackend):
            if options:
                raise TypeError("connection options belong to the backend: RedisBackend(url, ...)")
            backend = url
        else:
            backend = RedisBackend(url, **options)
        super().__init__(backend.url)
        self.backend = backend
        self._codes_key = backend.key("task_codes")
        self._eviction_warned = False
        self._prefix = backend.key("")
        self._scripts = {
            name: backend.script(lua)
            for name, lua in (
                ("add", ADD_LUA),
                ("add_many", ADD_MANY_LUA),
                ("cancel", CANCEL_LUA),
                ("retry", RETRY_LUA),
                ("list", LIST_LUA),
                ("index_dues", INDEX_DUES_LUA),
                ("claim", CLAIM_LUA),
                ("renew", RENEW_LUA),
                ("start", START_LUA),
                ("complete", COMPLETE_LUA),
                ("release", RELEASE_LUA),
                ("next_due", NEXT_DUE_LUA),
                ("now", NOW_LUA),
                ("summary", SUMMARY_LUA),
                ("finished", FINISHED_LUA),
            )
        }

    def _run(self, name: str, *args: Any) -> Any:
        """Run the script ``name`` with ``ARGV = prefix, *args``, errors translated."""
        with self.backend.errors(name):
            return self._scripts[name](keys=[self._codes_key], args=[self._prefix, *args], client=self.backend.client)

    def destroy_namespace(self) -> int:
        """Delete every key of this namespace (tasks and locks alike). For tests only."""
        return self.backend.destroy_namespace()

    # -- producers ---------------------------------------------------------------------------
    def add(self, code: str, key: str, due: Due, payload: Any = None, *, on_conflict: str = "replace") -> AddResult:
        code, key = check_task(code, key)
        at, delay = _due_args(due)
        mode = check_on_conflict(on_conflict)
        text = dump_payload(payload, code, key)
        return AddResult(str(self._run("add", code, key, at, delay, text, mode)))

    def add_many(self, tasks: Iterable[NewTask | tuple[Any, ...]], *, on_conflict: str = "replace") -> builtins.list[AddResult]:
        """The tasks' adds, in order, by one script call per :data:`ADD_MANY_CHUNK` tasks (each call
        atomic; the batch as a whole is not: a connection lost midway may leave a prefix added, and
        adding the batch again is safe with the same ``on_conflict``)."""
        batch, mode = check_batch(tasks), check_on_conflict(on_conflict)
        results: builtins.list[AddResult] = []
        for start in range(0, len(batch), ADD_MANY_CHUNK):
            args: builtins.list[str] = []
            for task in batch[start : start + ADD_MANY_CHUNK]:
                at, delay = _due_args(task.due)
                args += [task.code, task.key, at, delay, dump_payload(task.payload, task.code, task.key)]
            replies = self._run("add_many", mode, *args)
            results += [AddResult(str(reply)) for reply in replies]
        return results

    def cancel(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        return bool(self._run("cancel", code, key))

    def get(self, code: str, key: str) -> TaskRecord | None:
        code, key = check_task(code, key)
        with self.backend.errors("get"):
            flat = self.backend.client.hgetall(self.backend.key(f"task:{_escape(code)}:{key}"))
        return _decoded({str(k): str(v) for k, v in flat.items()}) if flat else None

    def list(
        self,
        *,
        code: str | None = None,
        key_contains: str | None = None,
        due_before: datetime | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> list[TaskRecord]:
        before = str(_to_us(check_time(due_before, "due_before"))) if due_before is not None else ""
        if state is not None:
            check_state(state)
        limit = max(0, int(limit))
        if limit == 0:
            return []
        if code is not None:
            codes = check_codes([code])
        else:
            with self.backend.errors("list"):
                codes = sorted(str(c) for c in self.backend.client.smembers(self._codes_key))
        records: list[TaskRecord] = []
        for one in codes:  # each code's first `limit` by due, then the first `limit` of them all
            records.extend(self._list_code(one, key_contains or "", before, state or "", limit))
        records.sort(key=lambda r: (r.due, r.code, r.key))
        return records[:limit]

    def _list_code(self, code: str, contains: str, before: str, state: str, limit: int) -> builtins.list[TaskRecord]:
        """One code's first ``limit`` matching tasks by due, in pages of at most :data:`LIST_PAGE` members per script."""
        self._index_dues(code)
        found: builtins.list[TaskRecord] = []
        cursor, seen = "", 0
        while len(found) < limit:
            rows, cursor, seen = json.loads(
                self._run("list", code, contains, before, state, limit - len(found), LIST_PAGE, cursor, seen)
            )
            found.extend(_decoded(_fields(flat)) for flat in rows)
            if cursor == "":
                break
        return found

    def _index_dues(self, code: str) -> None:
        """Fill the code's dues index if tasks written by an earlier mutexcron are missing from it (bounded pages).
        A reader that must not write leaves it to the nodes (its list may miss such tasks until then)."""
        if self.backend.read_only:
            return
        with self.backend.errors("list"):
            pipe = self.backend.client.pipeline(transaction=False)
            pipe.zcard(self.backend.key(f"due:{code}"))
            pipe.zcard(self.backend.key(f"dues:{code}"))
            tasks, indexed = pipe.execute()
        if int(tasks) == int(indexed):
            return
        offset = 0
        while True:
            read = int(self._run("index_dues", code, offset, LIST_PAGE))
            offset += read
            if read < LIST_PAGE:
                return

    def retry(self, code: str, key: str) -> bool:
        code, key = check_task(code, key)
        return bool(self._run("retry", code, key))

    # -- workers -----------------------------------------------------------------------------
    def claim(self, node: str, codes: Iterable[str], limit: int, lease: float) -> builtins.list[TaskRecord]:
        wanted = check_codes(codes)
        limit, lease = check_claim(limit, lease)
        if not wanted:
            return []
        _, rows = json.loads(self._run("claim", node, limit, round(lease * 1_000_000), *wanted))
        return decode_claimed(self, node, [_fields(flat) for flat in rows], _record, _ident)

    def renew(self, node: str, tokens: Mapping[tuple[str, str], int], lease: float) -> set[tuple[str, str]]:
        lease = check_lease(lease)
        items = builtins.list(tokens.items())
        if not items:
            return set()
        args = [part for (code, key), token in items for part in (code, key, int(token))]
        renewed = self._run("renew", node, round(lease * 1_000_000), *args)
        return {items[int(i) - 1][0] for i in renewed}

    def start(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        """One script call marks every claim of ``tasks`` started (each fenced)."""
        args = [part for code, key, token in tasks for part in (code, key, int(token))]
        return int(self._run("start", node, *args)) if args else 0

    def complete(self, node: str, code: str, key: str, token: int, outcome: Outcome) -> bool:
        return self.complete_many(node, [(code, key, token, outcome)])[0]

    def complete_many(self, node: str, completions: Sequence[tuple[str, str, int, Outcome]]) -> builtins.list[bool]:
        """Every completion in one script call (one round trip; one slot on a cluster), each fenced on its own."""
        args = [part for code, key, token, outcome in completions for part in _completion_args(code, key, token, outcome)]
        if not args:
            return []
        return [bool(int(ok)) for ok in self._run("complete", node, *args)]

    def release(self, node: str, tasks: Iterable[tuple[str, str, int]]) -> int:
        args = [part for code, key, token in tasks for part in (code, key, int(token))]
        if not args:
            return 0
        return int(self._run("release", node, *args))

    def next_due(self, codes: Iterable[str]) -> float | None:
        wanted = check_codes(codes)
        if not wanted:
            return None
        now, best = json.loads(self._run("next_due", *wanted))
        if best == "":
            return None
        return max(0.0, (int(best) - int(now)) / 1_000_000)

    def summary(self, codes: Iterable[str] | None = None) -> builtins.list[CodeSummary]:
        """Counts per code in one script (:data:`~mutexcron.tasks.stores.redis_scripts.SUMMARY_LUA`).

        The due and failed counts are ZCOUNTs on the code's due ZSET; queued and running need
        each unfailed task's state from its hash: one HMGET per task, O(tasks of the codes)
        inside the script, which blocks the Redis server meanwhile (about a millisecond per
        thousand tasks). For ``status`` and metrics, not for a hot path.
        """
        wanted: builtins.list[str] = []
        if codes is not None:
            wanted = check_codes(codes)
            if not wanted:
                return []
        now_text, rows = json.loads(self._run("summary", *wanted))
        now = int(now_text)
        found = [
            CodeSummary(
                str(code),
                queued=int(queued),
                due_now=int(due_now),
                running=int(running),
                failed=int(failed),
                oldest_overdue=None if oldest == "" else max(0.0, (now - int(oldest)) / 1_000_000),
            )
            for code, queued, due_now, running, failed, oldest in rows
        ]
        return sorted(found, key=lambda summary: summary.code)

    def waker(self, codes: Iterable[str], poll: float | None = None) -> Waker:
        """A subscription to the namespace's wake channel (:class:`~mutexcron.tasks.wakeups.redis.RedisWaker`):
        woken when an add, a retry, a hand-back or an attempt's end makes a task of ``codes`` the
        first of its code to be claimable (``poll`` does not apply: it waits for notices)."""
        from ..wakeups.redis import RedisWaker

        self.warn_if_evicting()
        return RedisWaker(self.backend, check_codes(codes))

    def warn_if_evicting(self) -> str | None:
        """Warn (once per store, at a worker's start) if the server's ``maxmemory-policy`` may evict
        keys without a TTL (``allkeys-*``): it would drop queued tasks and the token floor
        silently. Returns the policy, or None if the server does not say (CONFIG disabled)."""
        try:
            with self.backend.errors("config"):
                found = self.backend.client.config_get("maxmemory-policy")
        except StoreError as exc:
            log.info("%s: could not read maxmemory-policy (%s): check it is noeviction or volatile-*", self.masked_url, exc)
            return None
        policies = found.values() if isinstance(found, dict) else []
        policy = next((str(p) for p in policies if isinstance(p, (str, bytes))), None)
        if policy is not None and policy.startswith("allkeys-") and not self._eviction_warned:
            self._eviction_warned = True
            log.warning(
                "%s: maxmemory-policy is %s: when the server fills up it evicts any key, queued tasks and the "
                "task token floor included, silently. Set maxmemory-policy noeviction (writes then fail loudly) "
                "or give the task pool a server of its own",
                self.masked_url,
                policy,
            )
        return policy

    def finished_per_minute(self, since: datetime) -> builtins.list[tuple[str, bool, datetime, int]]:
        """``(code, cancelled, minute, count)``: the occurrences that ended (finished, or ended by a
        cancel) in each minute of the server's clock from the one holding ``since``, as the scripts
        that end them counted them (kept :data:`~mutexcron.tasks.stores.FINISHED_TTL` seconds). A read."""
        rows = json.loads(self._run("finished", _to_us(check_time(since, "since")) // 60_000_000))
        counts = []
        for minute, field, count in rows:
            ended, _, code = str(field).partition(":")
            counts.append((code, ended == "cancelled", _EPOCH + timedelta(minutes=int(minute)), int(count)))
        return counts

    def now(self) -> datetime:
        at = _from_us(self._run("now"))
        assert at is not None
        return at

    def ping(self) -> None:
        self.backend.ping()

    def close(self) -> None:
        self.backend.close()
