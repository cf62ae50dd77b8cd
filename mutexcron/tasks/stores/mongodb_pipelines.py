"""The MongoDB task store's filters and update pipelines: each write is one document command.

Every function takes ``now``, the expression for the store's clock: the server's ``$$NOW``
(:meth:`~mutexcron.backends.mongodb.MongoDBBackend.now_expr`; only tests replace it with a date,
because mongomock does not know ``$$NOW``). Every string a caller gives (a payload's JSON text, an
error, a node id) is sent inside ``$literal``, so it is never read as a field path or an operator;
codes and keys appear only as values in query filters, never in expressions.

A date plus a number of milliseconds is written ``{$subtract: [date, -ms]}``: the same on every
server version and on mongomock (whose ``$add`` takes numbers only).

The pipelines follow the rules of :mod:`mutexcron.tasks.stores.memory` (the reference), field by field:
``run_at`` is when a claim may take the task (its due or a retry's time when queued, its lease's
end when running, null when failed), kept in step with ``state`` by every write. ``due`` names the
occurrence: a retry (an attempt's :class:`~mutexcron.tasks.base.Retry`, a retry by hand, a
hand-back) keeps it and sets only ``run_at``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..base import AddResult, Fail, Outcome, Reschedule, Retry

__all__ = [
    "FIELDS",
    "add_pipeline",
    "cancel_pipeline",
    "claim_pipeline",
    "due_expr",
    "fence",
    "lease_pipeline",
    "outcome_pipeline",
    "pending_pipeline",
    "release_pipeline",
    "retry_pipeline",
    "summary_pipeline",
    "tombstone_pipeline",
]

#: The fields of a task document, besides ``_id``, ``code`` and ``key``.
FIELDS = (
    "due",
    "run_at",
    "payload",
    "state",
    "attempt",
    "token",
    "owner",
    "lease_until",
    "last_error",
    "pending_due",
    "pending_payload",
    "cancel_requested",
    "created",
    "updated",
    "last_add",
    "occurrence",
)

Expr = Any
Pipeline = list[dict[str, Any]]


def plus_ms(now: Expr, ms: int) -> Expr:
    """``now`` plus ``ms`` milliseconds (a date expression)."""
    return {"$subtract": [now, -ms]}


def due_expr(now: Expr, at: datetime | None, delay: float | None) -> Expr:
    """A due time as an expression: the absolute ``at``, or ``now`` plus ``delay`` seconds."""
    if at is not None:
        return at
    return plus_ms(now, round((delay or 0.0) * 1000))


def _is_null(field: str) -> Expr:
    """True if ``field`` is null or missing (``$eq`` alone tells a missing field from null)."""
    return {"$eq": [{"$ifNull": [field, None]}, None]}


def _not_null(field: str) -> Expr:
    """True if ``field`` holds a value (not null, not missing)."""
    return {"$ne": [{"$ifNull": [field, None]}, None]}


def _cond(test: Expr, then: Expr, otherwise: Expr) -> Expr:
    return {"$cond": [test, then, otherwise]}


def fence(code: str, key: str, node: str, token: int) -> dict[str, Any]:
    """The filter of a worker's write: the task runs, owned by ``node``, with ``token``."""
    return {"code": code, "key": key, "state": "running", "owner": node, "token": token}


# -- producers ------------------------------------------------------------------------------------
def _wins(mode: str, new_due: Expr, old_due: str) -> Expr:
    """The new due wins over ``old_due`` under ``on_conflict=mode`` (earliest/latest)."""
    return {"$lt" if mode == "earliest" else "$gt": [new_due, old_due]}


def add_pipeline(now: Expr, new_due: Expr, payload: str, mode: str, floor: int = 0) -> Pipeline:
    """The upsert of :meth:`~mutexcron.tasks.base.TaskStore.add`: :func:`~mutexcron.tasks.checks.decide_add` in ``$cond``s.

    The first stage writes the decision to ``last_add`` (``inserted``, ``replaced``, ``kept`` or
    ``pending``), reading the document as it was (no ``state``: the upsert is inserting it); the
    second applies it. The document returned after the write says what this add did. A new
    document starts its token from ``floor``, the store-wide token floor of purged tombstones.
    """
    # No task, or the tombstone of a finished one (its token kept: tokens only go up).
    missing = {"$or": [_is_null("$state"), {"$eq": ["$state", "done"]}]}
    if mode == "keep":
        decision: Expr = _cond(missing, AddResult.INSERTED.value, AddResult.KEPT.value)
    else:
        if mode == "replace":
            pending_wins: Expr = True
            queued_wins: Expr = True
        else:
            pending_wins = {"$or": [_is_null("$pending_due"), _wins(mode, new_due, "$pending_due")]}
            queued_wins = {"$or": [{"$eq": ["$state", "failed"]}, _wins(mode, new_due, "$due")]}
        decision = _cond(
            missing,
            AddResult.INSERTED.value,
            _cond(
                {"$eq": ["$state", "running"]},
                _cond(pending_wins, AddResult.PENDING.value, AddResult.KEPT.value),
                _cond(queued_wins, AddResult.REPLACED.value, AddResult.KEPT.value),
            ),
        )
    text = {"$literal": payload}
    fresh = {"$in": ["$last_add", [AddResult.INSERTED.value, AddResult.REPLACED.value]]}
    inserted = {"$eq": ["$last_add", AddResult.INSERTED.value]}
    pending = {"$eq": ["$last_add", AddResult.PENDING.value]}
    kept = {"$eq": ["$last_add", AddResult.KEPT.value]}
    return [
        {"$set": {"last_add": decision}},
        {
            "$set": {
                # Inserted or replaced: queued with the new due and payload, attempts reset.
                "state": _cond(fresh, "queued", "$state"),
                "due": _cond(fresh, new_due, "$due"),
                "run_at": _cond(fresh, new_due, "$run_at"),
                "payload": _cond(fresh, text, "$payload"),
                "attempt": _cond(fresh, 0, "$attempt"),
                "lease_until": _cond(fresh, None, "$lease_until"),
                "last_error": _cond(fresh, None, "$last_error"),
                "token": {"$ifNull": ["$token", floor]},
                "occurrence": _cond(fresh, {"$ifNull": ["$token", floor]}, "$occurrence"),
                "owner": _cond(inserted, None, "$owner"),
                # Running: the new values wait for the attempt's end; the later word (this add) wins over a cancel.
                "pending_due": _cond(pending, new_due, _cond(inserted, None, "$pending_due")),
                "pending_payload": _cond(pending, text, _cond(inserted, None, "$pending_payload")),
                "cancel_requested": _cond({"$or": [inserted, pending]}, False, "$cancel_requested"),
                "created": _cond(inserted, now, "$created"),
                "updated": _cond(kept, "$updated", now),
            }
        },
    ]


def cancel_pipeline(now: Expr) -> Pipeline:
    """Mark a running task cancelled: dropped when its attempt ends; a pending re-add is dropped too."""
    return [{"$set": {"cancel_requested": True, "pending_due": None, "pending_payload": None, "updated": now}}]


def retry_pipeline(now: Expr) -> Pipeline:
    """Queue a failed task again, claimable now (its due kept: the same occurrence), attempts reset
    (its last error is kept)."""
    return [{"$set": {**_wait(now, now), "attempt": 0}}]


# -- workers --------------------------------------------------------------------------------------
def claim_pipeline(now: Expr, node: str, lease_ms: int) -> Pipeline:
    """Take a claimable task: running, owned by ``node``, token + 1, attempt + 1 unless it rescues a
    claim that never started (:func:`start_pipeline`), leased until now + lease."""
    until = plus_ms(now, lease_ms)
    unstarted = {"$and": [{"$eq": ["$state", "running"]}, {"$ne": ["$started", True]}]}
    return [
        {
            "$set": {
                "state": "running",
                "owner": {"$literal": node},
                "token": {"$add": ["$token", 1]},
                "attempt": {"$add": ["$attempt", {"$cond": [unstarted, 0, 1]}]},
                "started": False,
                "lease_until": until,
                "run_at": until,
                "updated": now,
            }
        }
    ]


def start_pipeline() -> Pipeline:
    """Mark a claim whose handler started: a rescue of it counts a new attempt."""
    return [{"$set": {"started": True}}]


def lease_pipeline(now: Expr, lease_ms: int) -> Pipeline:
    """Extend a lease to now + lease (a claim may take the task again from then on)."""
    until = plus_ms(now, lease_ms)
    return [{"$set": {"lease_until": until, "run_at": until}}]


def _wait(now: Expr, run_at: Expr) -> dict[str, Expr]:
    """Queued, claimable from ``run_at``: the same occurrence (its due is kept)."""
    return {"state": "queued", "run_at": run_at, "lease_until": None, "updated": now}


def _queue(now: Expr, due: Expr) -> dict[str, Expr]:
    """Queued as a new occurrence, due at ``due``, named by the token it begins at."""
    return {**_wait(now, due), "due": due, "occurrence": "$token"}


def tombstone_pipeline(now: Expr, *, cancelled: bool = False) -> Pipeline:
    """A finished or cancelled task: a *tombstone* (state ``done``) that keeps only its token, so a
    task added again goes on from it. Every read skips it; ``run_at`` null keeps it out of claims.

    Its ``cancel_requested`` says whether a cancel ended the occurrence (the dashboard counts it as
    cancelled, not finished): set by a cancel of a queued or failed task (``cancelled``), kept from
    the running task otherwise (a cancel asked during its attempt)."""
    cleared = ("run_at", "owner", "lease_until", "last_error", "pending_due", "pending_payload")
    marked = {"cancel_requested": True} if cancelled else {}
    return [{"$set": {"state": "done", "payload": "null", **marked, "updated": now, **dict.fromkeys(cleared)}}]


def _apply_pending(now: Expr) -> dict[str, Expr]:
    """The re-add made while the attempt ran becomes the task: a new definition, attempts reset."""
    return {
        **_queue(now, "$pending_due"),
        "payload": "$pending_payload",
        "attempt": 0,
        "last_error": None,
        "pending_due": None,
        "pending_payload": None,
    }


def _pending_or(now: Expr, otherwise: dict[str, Expr]) -> dict[str, Expr]:
    """One ``$set``: the pending re-add if there is one, else ``otherwise`` (each field read before the write)."""
    if_pending = _apply_pending(now)
    has_pending = _not_null("$pending_due")
    return {
        field: _cond(has_pending, if_pending.get(field, f"${field}"), otherwise.get(field, f"${field}"))
        for field in sorted(set(if_pending) | set(otherwise))
    }


def pending_pipeline(now: Expr) -> Pipeline:
    """A run that ended (Done) with a pending re-add: the re-add becomes the task."""
    return [{"$set": _apply_pending(now)}]


def outcome_pipeline(now: Expr, outcome: Outcome, due: Expr, error: str | None, payload: str | None = None) -> Pipeline:
    """Record a Reschedule, Retry or Fail (``due``: the Reschedule's new due or the Retry's time;
    ``error``: the stored error; ``payload``: a Reschedule's new payload as JSON text, None to keep
    it), unless a pending re-add waits: it wins over any outcome."""
    fields: dict[str, Expr]
    if isinstance(outcome, Fail):
        fields = {"state": "failed", "run_at": None, "lease_until": None, "last_error": {"$literal": error}, "updated": now}
    elif isinstance(outcome, Reschedule):
        fields = {**_queue(now, due), "attempt": 0, "last_error": None}
        if payload is not None:
            fields["payload"] = {"$literal": payload}
    elif isinstance(outcome, Retry):
        fields = {**_wait(now, due), "last_error": {"$literal": error}}  # the same occurrence: due kept
    else:  # pragma: no cover - Done deletes the task (or applies the pending re-add)
        raise TypeError(f"no pipeline for {outcome!r}")
    return [{"$set": _pending_or(now, fields)}]


def release_pipeline(now: Expr) -> Pipeline:
    """Hand back a claimed, unstarted task: token + 1, claimable at once (its due kept), the claim's
    attempt not counted (or its pending re-add queued, attempts reset)."""
    fields = _pending_or(now, {**_wait(now, now), "attempt": {"$subtract": ["$attempt", 1]}})
    fields["token"] = {"$add": ["$token", 1]}  # a claim made with the old token can no longer write
    fields["occurrence"] = _cond(_not_null("$pending_due"), {"$add": ["$token", 1]}, "$occurrence")
    return [{"$set": fields}]


# -- reads ----------------------------------------------------------------------------------------
def summary_pipeline(now: Expr, codes: list[str] | None) -> Pipeline:
    """Counts per code (one group per code), and the milliseconds since the oldest due of the claimable ones."""
    claimable = {"$and": [_not_null("$run_at"), {"$lte": ["$run_at", now]}]}

    def count(test: Expr) -> Expr:
        return {"$sum": _cond(test, 1, 0)}

    live = {"state": {"$ne": "done"}}
    stages: Pipeline = [{"$match": {**live, "code": {"$in": codes}}} if codes is not None else {"$match": live}]
    stages += [
        {
            "$group": {
                "_id": "$code",
                "queued": count({"$eq": ["$state", "queued"]}),
                "running": count({"$eq": ["$state", "running"]}),
                "failed": count({"$eq": ["$state", "failed"]}),
                "due_now": count(claimable),
                "oldest": {"$min": _cond(claimable, "$due", None)},
            }
        },
        {"$set": {"overdue_ms": _cond(_is_null("$oldest"), None, {"$subtract": [now, "$oldest"]})}},
        {"$sort": {"_id": 1}},
    ]
    return stages
