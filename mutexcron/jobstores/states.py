"""A job's stored state (APScheduler's ``Job.__getstate__()``, pickled): what is written, and how
two writers' changes are combined.

The state written is exactly APScheduler's: the user's function reference and the user's trigger
(a guarded trigger's deterministic jitter is put back as the trigger's own ``jitter``), so a plain
APScheduler process reads the same jobs.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

from ..guard.firetimes import SlotTrigger

#: Fields are compared by their pickles with this protocol (any fixed one works).
_COMPARE_PROTOCOL = 4
#: The lock a shared job was first added under, stored with it (APScheduler ignores the extra key):
#: a node whose code names another lock refuses the job, so a deploy cannot split it over two locks.
LOCK_FIELD = "mutexcron_lock"


def stored_trigger(trigger: Any) -> Any:
    """The trigger as it is stored: the user's, never mutexcron's slot wrapper."""
    if not isinstance(trigger, SlotTrigger):
        return trigger
    inner = copy.copy(trigger.inner)
    if trigger.jitter:
        inner.jitter = trigger.jitter
    return inner


def dump(fields: dict[str, Any], protocol: int) -> bytes:
    return pickle.dumps(fields, protocol)


def load(state: bytes) -> dict[str, Any]:
    """The fields of a stored state. Unpickling imports the classes of the trigger and of the
    arguments, not the job's function (that is a ``module:function`` text)."""
    fields = pickle.loads(state)  # noqa: S301 - APScheduler's own format: the store's writers are trusted
    if not isinstance(fields, dict):
        raise TypeError(f"a job state must be a dict, not {type(fields).__name__}")
    return fields


def _same(a: Any, b: Any) -> bool:
    try:
        return pickle.dumps(a, _COMPARE_PROTOCOL) == pickle.dumps(b, _COMPARE_PROTOCOL)
    except Exception:  # noqa: BLE001 - not comparable by pickle: take it as changed
        return False


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The fields that differ, ``next_run_time`` included."""
    return {key for key in before.keys() | after.keys() if not _same(before.get(key), after.get(key))}


def merged_state(base: dict[str, Any], new: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """``current`` with the fields this writer changed from ``base`` to ``new``: two writers who
    changed different fields both keep their change; of one field, the later write wins."""
    merged = dict(current)
    for key in changed_fields(base, new):
        merged[key] = new[key]
    return merged


def replacement_state(new: dict[str, Any], current: dict[str, Any], explicit_next_run_time: bool) -> dict[str, Any]:
    """What ``add_job(replace_existing=True)`` writes over a stored job.

    With the same trigger, the stored ``next_run_time`` is kept (None too: a paused job stays
    paused), unless the caller gave ``next_run_time`` itself: every node adding its jobs at start-up
    then changes nothing, and a rolling restart neither skips nor doubles a fire time.
    """
    if current.get(LOCK_FIELD) is not None:
        new = {**new, LOCK_FIELD: current[LOCK_FIELD]}  # the lock stays the one the job was first added under
    if explicit_next_run_time or not _same(new.get("trigger"), current.get("trigger")):
        return new
    return {**new, "next_run_time": current.get("next_run_time")}


def kind_of_change(before: bytes, after: bytes) -> str:
    """How a job changed between two states another writer left: ``"modified"`` (anything but the
    next run time, or a pause or resume), or ``"advanced"`` (the holder's loop moved its next run time)."""
    try:
        old, new = load(before), load(after)
    except Exception:  # noqa: BLE001 - unreadable here: report it as a change
        return "modified"
    diff = changed_fields(old, new)
    if diff - {"next_run_time"}:
        return "modified"
    if (old.get("next_run_time") is None) != (new.get("next_run_time") is None):
        return "modified"  # paused or resumed
    return "advanced"
