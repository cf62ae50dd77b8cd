"""LockRecord: what a lock looks like to jobs, ``lock_else`` callbacks and ``status``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

from ..errors import AttrsError
from ..node import NodeTraits
from ..timeutil import MICROSECONDS, MILLISECONDS, as_utc
from ..timeutil import us_from_datetime as us_from_datetime  # re-exported: guard/job.py and guard/firetimes.py use it

#: Keys a LockRecord answers before it looks in the user attrs.
RECORD_KEYS: tuple[str, ...] = (
    "name",
    "holder",
    "active_ip",
    "token",
    "update_time",
    "heartbeat_age",
    "ttl",
    "state",
    "last_fire_time",
    "fire_times",
    "last_run_started",
    "last_run_finished",
    "last_error",
    "paused",
    "paused_at",
    "paused_by",
    "resume_catch_up",
    "zone",
)


@dataclass(frozen=True)
class LockRecord(Mapping[str, Any]):
    """A read-only snapshot of one named lock, as the store saw it.

    It is a dataclass that also reads like a dict: ``rec["active_ip"]``,
    ``rec["update_time"]`` and any user attr by its key. Record fields win over user
    attrs of the same name; ``rec.attrs`` always holds the attrs alone.

    Attributes:
        name: the lock name.
        holder: node id of the holder, or None once released.
        active_ip: IP address of the holder (kept after a release, for information).
        token: fencing token; goes up on every change of holder and survives a release.
        update_time: the last heartbeat, UTC, by the store's clock.
        heartbeat_age: seconds since that heartbeat, by the store's clock.
        ttl: the lease length the holder asked for, in seconds.
        fire_times: last claimed scheduled fire time per job key.
        last_run_started / last_run_finished: the last guarded run, by the store's clock.
        last_error: the last run's error, or None if it succeeded.
        attrs: the user attrs the last run returned.
        paused: an operator paused the lock (``mutexcron pause``): no fire time of it is claimed,
            on any node, until it is resumed. Leases are still taken and renewed.
        paused_at / paused_by: when (store clock) and by whom the flag was last set or cleared.
        resume_catch_up: the last resume asked the nodes to catch up the fire times missed while
            paused (``mutexcron resume --catch-up``); cleared by the next pause.
        zone: the time zone the holder computes the lock's fire times in (cron and date jobs), as
            it wrote it on taking the lock; None if no holder wrote one (interval jobs only, or a
            record from before the zone rule). A node in another zone refuses the lock's jobs.
        triggers: the holder's jobs of the lock and their triggers (job id -> trigger text), written
            with the zone; a node with another jobs file for the lock warns once
            (:mod:`mutexcron.guard.agreement`). None if no holder wrote them. Not one of the
            mapping keys (a user attr named ``triggers`` stays readable as ``rec["triggers"]``).
    """

    name: str
    holder: str | None = None
    active_ip: str | None = None
    token: int = 0
    update_time: datetime | None = None
    heartbeat_age: float | None = None
    ttl: float = 0.0
    fire_times: Mapping[str, datetime] = field(default_factory=dict)
    last_run_started: datetime | None = None
    last_run_finished: datetime | None = None
    last_error: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    paused: bool = False
    paused_at: datetime | None = None
    paused_by: str | None = None
    resume_catch_up: bool = False
    zone: str | None = None
    triggers: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))
        object.__setattr__(self, "fire_times", MappingProxyType(dict(self.fire_times)))

    def aged(self, heartbeat_age: float) -> LockRecord:
        """This record with another ``heartbeat_age`` (the same values otherwise): a copy made
        without re-running ``__init__``, for the views a standby checks at every fire time."""
        copy = object.__new__(LockRecord)
        copy.__dict__.update(self.__dict__)
        copy.__dict__["heartbeat_age"] = heartbeat_age
        return copy

    @property
    def state(self) -> str:
        """``active``, ``stale`` (holder missed its heartbeats) or ``released``."""
        if self.holder is None:
            return "released"
        if self.heartbeat_age is None or self.heartbeat_age > self.ttl:
            return "stale"
        return "active"

    @property
    def last_fire_time(self) -> datetime | None:
        """The latest fire time claimed by any job under this lock."""
        return max(self.fire_times.values(), default=None)

    def __getitem__(self, key: str) -> Any:
        if key in RECORD_KEYS:
            return getattr(self, key)
        return self.attrs[key]

    def __iter__(self) -> Iterator[str]:
        yield from RECORD_KEYS
        yield from (k for k in self.attrs if k not in RECORD_KEYS)

    def __len__(self) -> int:
        return len(RECORD_KEYS) + sum(1 for k in self.attrs if k not in RECORD_KEYS)

    def __hash__(self) -> int:
        return hash((self.name, self.holder, self.token))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (datetimes as ISO-8601 strings), as ``status --json`` prints."""

        def iso(value: datetime | None) -> str | None:
            return value.isoformat() if value else None

        return {
            "name": self.name,
            "holder": self.holder,
            "active_ip": self.active_ip,
            "state": self.state,
            "token": self.token,
            "update_time": iso(self.update_time),
            "heartbeat_age": None if self.heartbeat_age is None else round(self.heartbeat_age, 3),
            "ttl": self.ttl,
            "last_fire_time": iso(self.last_fire_time),
            "fire_times": {k: iso(v) for k, v in self.fire_times.items()},
            "last_run_started": iso(self.last_run_started),
            "last_run_finished": iso(self.last_run_finished),
            "last_error": self.last_error,
            "attrs": dict(self.attrs),
            "paused": self.paused,
            "paused_at": iso(self.paused_at),
            "paused_by": self.paused_by,
            "resume_catch_up": self.resume_catch_up,
            "zone": self.zone,
            "triggers": None if self.triggers is None else dict(self.triggers),
        }


#: What a run's ``outcome`` is in its history entry.
OUTCOMES: tuple[str, ...] = ("success", "error")


#: A run's history line in the SQL and Redis stores: a JSON array, by position (shorter than an
#: object: every run rewrites its job's kept lines, so each byte counts N times). The store writes
#: ``[`` and the end time, epoch milliseconds by its own clock; the run's node sends the rest
#: (:meth:`mutexcron.locks.RunInfo.history_tail`): ``node, ip, token, fire_us`` (null: no fire
#: time), ``duration_us``, then ``error`` if the run failed (null if it did not but a job follows),
#: then ``job`` if the line's job is not the lock's own name (only in the SQL ``runs`` column).
HISTORY_LINE = ("ended_ms", "node", "ip", "token", "fire_us", "duration_us", "error", "job")
_LINE_INDEX = {name: i for i, name in enumerate(HISTORY_LINE)}
#: Every history line has the fields up to ``duration_us``; ``error`` and ``job`` only when needed.
_LINE_REQUIRED = _LINE_INDEX["duration_us"] + 1


def _line_field(line: Sequence[Any], name: str) -> Any:
    """A history line's field by its :data:`HISTORY_LINE` name; None if the line stops before it."""
    index = _LINE_INDEX[name]
    return line[index] if len(line) > index else None


def is_history_entry(entry: Any) -> bool:
    """A stored run: an object, or a history line (:data:`HISTORY_LINE`) with every required field."""
    return isinstance(entry, Mapping) or (isinstance(entry, list) and len(entry) >= _LINE_REQUIRED)


def entry_job(entry: Any, lock: str) -> str:
    """The job a stored run names (a line's ``job``, an object's ``job``), else the lock's own name."""
    if isinstance(entry, list):
        job = _line_field(entry, "job")
        return lock if job is None else str(job)
    return str(entry.get("job") or lock) if isinstance(entry, Mapping) else lock


def entry_ended(entry: Any) -> datetime:
    """When a stored run ended (the earliest time if it does not say): for ordering runs."""
    if isinstance(entry, list):
        ended = _stored_time(_line_field(entry, "ended_ms"))
    else:
        ended = _stored_time(entry.get("ended")) if isinstance(entry, Mapping) else None
    return ended or datetime.min.replace(tzinfo=timezone.utc)


def _stored_time(value: Any) -> datetime | None:
    """A history time as a store keeps it: a datetime, ISO-8601 text, or epoch ms (history lines, earlier Redis objects)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return as_utc(int(value), epoch_unit=MILLISECONDS)
    try:
        return as_utc(value)
    except ValueError:  # text that is not a time: show none rather than fail the whole read
        return None


def _optional_int(value: Any) -> int | None:
    return None if value is None or isinstance(value, bool) else int(value)


@dataclass(frozen=True)
class RunRecord:
    """One finished run of a guarded job, from the run history the store keeps per job.

    Written by the run's fenced hand-off (:meth:`mutexcron.locks.LockStore.hand_off` with a
    :class:`~mutexcron.locks.RunInfo`), in the same store operation; ``started`` and ``ended`` are
    the store's clock (``ended`` the hand-off, ``started`` that minus the run's duration).

    Attributes:
        lock / job: where the run belongs.
        node / ip: the node that ran it, and its IP.
        token: the fencing token it ran under.
        fire_time: the scheduled fire time it ran for (None if the run did not say).
        started / ended: by the store's clock.
        outcome: ``success`` or ``error``.
        error: the error, cut to :data:`mutexcron.locks.base.HISTORY_ERROR_LIMIT` characters.
    """

    lock: str
    job: str
    node: str | None = None
    ip: str | None = None
    token: int = 0
    fire_time: datetime | None = None
    started: datetime | None = None
    ended: datetime | None = None
    outcome: str = "success"
    error: str | None = None

    @property
    def duration(self) -> float | None:
        """Seconds from start to end, or None if either is unknown."""
        if self.started is None or self.ended is None:
            return None
        return max(0.0, (self.ended - self.started).total_seconds())

    @classmethod
    def from_stored(cls, lock: str, job: str, entry: Mapping[str, Any] | Sequence[Any]) -> RunRecord:
        """A run from one stored history entry: a history line (:data:`HISTORY_LINE`, the SQL and
        Redis stores) or an object (MongoDB, the in-memory store, and earlier SQL and Redis lines)."""
        if not isinstance(entry, Mapping):
            return cls._from_line(lock, job, entry)
        fire_us = _optional_int(entry.get("fire_us"))
        error = entry.get("error")
        return cls(
            lock=lock,
            job=job,
            node=entry.get("node"),
            ip=entry.get("ip"),
            token=_optional_int(entry.get("token")) or 0,
            fire_time=None if fire_us is None else as_utc(fire_us, epoch_unit=MICROSECONDS),
            started=_stored_time(entry.get("started")),
            ended=_stored_time(entry.get("ended")),
            outcome=str(entry.get("outcome") or ("error" if error is not None else "success")),
            error=None if error is None else str(error),
        )

    @classmethod
    def _from_line(cls, lock: str, job: str, line: Sequence[Any]) -> RunRecord:
        ended = _stored_time(_line_field(line, "ended_ms"))
        duration_us = _optional_int(_line_field(line, "duration_us"))
        fire_us = _optional_int(_line_field(line, "fire_us"))
        node, ip, error = (_line_field(line, name) for name in ("node", "ip", "error"))
        return cls(
            lock=lock,
            job=job,
            node=None if node is None else str(node),
            ip=None if ip is None else str(ip),
            token=_optional_int(_line_field(line, "token")) or 0,
            fire_time=None if fire_us is None else as_utc(fire_us, epoch_unit=MICROSECONDS),
            started=None if ended is None or duration_us is None else ended - timedelta(microseconds=duration_us),
            ended=ended,
            outcome="success" if error is None else "error",
            error=None if error is None else str(error),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (datetimes as ISO-8601 strings), as ``history --json`` prints."""
        duration = self.duration
        return {
            "lock": self.lock,
            "job": self.job,
            "node": self.node,
            "ip": self.ip,
            "token": self.token,
            "fire_time": _iso(self.fire_time),
            "started": _iso(self.started),
            "ended": _iso(self.ended),
            "duration": None if duration is None else round(duration, 6),
            "outcome": self.outcome,
            "error": self.error,
        }


def newest_first(lock: str, runs_by_job: Mapping[str, Any], job: str | None = None, limit: int | None = None) -> list[RunRecord]:
    """Stored history ``{job: [entry, ...]}`` (each list oldest first) -> runs, newest first.

    Args:
        lock: the lock the history belongs to.
        runs_by_job: the stored lists; entries that are neither objects nor history lines are skipped.
        job: only this job's runs.
        limit: at most this many runs.
    """
    runs: list[RunRecord] = []
    for name, entries in runs_by_job.items():
        if (job is None or name == job) and isinstance(entries, list):
            runs += [RunRecord.from_stored(lock, name, e) for e in entries if is_history_entry(e)]
    floor = datetime.min.replace(tzinfo=timezone.utc)
    # Newest first by end time; a job's own order (oldest first) settles equal or missing times.
    ranked = sorted(enumerate(runs), key=lambda pair: (pair[1].ended or floor, pair[0]), reverse=True)
    runs = [run for _, run in ranked]
    return runs if limit is None else runs[: max(0, limit)]


@dataclass(frozen=True)
class NodePresence:
    """A node as it last announced itself with its lease renewals (``mutexcron status``).

    Attributes:
        node_id / ip / version: the node, its IP and its mutexcron version.
        last_seen: its last renewal, by the store's clock.
        age: seconds since then, by the store's clock.
        clock_offset: the node's wall clock minus the store's, in seconds, as the node measured it
            (None until it knows).
        locks: the locks it held then, sorted.
        traits: its placement weight and tags (``mutexcron run --weight/--tag``; defaults for a
            node of an earlier mutexcron).
    """

    node_id: str
    ip: str | None = None
    version: str | None = None
    last_seen: datetime | None = None
    age: float | None = None
    clock_offset: float | None = None
    locks: tuple[str, ...] = ()
    traits: NodeTraits = field(default_factory=NodeTraits)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, as ``status --json`` prints."""
        return {
            "node_id": self.node_id,
            "ip": self.ip,
            "version": self.version,
            "last_seen": _iso(self.last_seen),
            "age": None if self.age is None else round(self.age, 3),
            "clock_offset": self.clock_offset,
            "locks": list(self.locks),
            **self.traits.to_json(),
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def load_locks(value: Any) -> tuple[str, ...]:
    """A presence's stored lock list (JSON text or a list) as a sorted tuple of names."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value or "[]")
        except ValueError:
            return ()
    return tuple(sorted(str(v) for v in value)) if isinstance(value, (list, tuple)) else ()


def optional_float(value: Any) -> float | None:
    """A stored number (or numeric text) as a float; None for none, '' or text that is not a number."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


DEFAULT_MAX_ATTRS_BYTES = 1_000_000


def dump_attrs(attrs: Mapping[str, Any], *, job: str = "job", limit: int | None = None) -> str:
    """Serialise user attrs to JSON text, or raise AttrsError naming the job and the bad key.

    Only plain JSON is stored (never pickle): dicts with string keys, lists, strings,
    finite numbers, booleans and None. With ``limit``, JSON of more than ``limit`` bytes (UTF-8)
    raises AttrsError too, before anything reaches the store.
    """
    if not isinstance(attrs, Mapping):
        raise AttrsError(
            f"job {job!r} returned {type(attrs).__name__}, not a dict: return a dict of JSON values "
            "(or None to keep the previous attrs)"
        )
    _check_json(attrs, job=job, path="")
    text = json.dumps(dict(attrs), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a surrogate-escaped file name
        raise AttrsError(
            f"job {job!r} returned attrs with text that is not valid Unicode ({exc.reason} at character "
            f"{exc.start}); decode bytes properly before returning them. The previous attrs are kept."
        ) from None
    if limit is not None and size > limit:
        raise AttrsError(
            f"job {job!r} returned attrs of {size:,} bytes of JSON, over the limit of {limit:,} "
            "bytes (MutexScheduler(max_attrs_bytes=...)): keep large data elsewhere and store a reference; "
            "the previous attrs are kept"
        )
    return text


def _check_json(value: Any, *, job: str, path: str) -> None:
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise AttrsError(f"job {job!r} returned attrs with a non-finite number at key {path or '.'!r}")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                raise AttrsError(
                    f"job {job!r} returned attrs with a non-string key {key!r} at {where!r}: JSON keys must be strings"
                )
            _check_json(item, job=job, path=where)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json(item, job=job, path=f"{path}[{index}]")
        return
    raise AttrsError(
        f"job {job!r} returned attrs that are not JSON at key {path!r}: {type(value).__name__} is not "
        "JSON-serialisable; convert it (e.g. str() or .isoformat()) before returning it. The previous attrs are kept."
    )


def load_attrs(text: str | bytes | None) -> dict[str, Any]:
    """Parse stored attrs JSON (empty for None)."""
    if not text:
        return {}
    value = json.loads(text)
    return dict(value) if isinstance(value, dict) else {}


def load_triggers(value: Any) -> dict[str, str] | None:
    """A stored ``triggers`` value (JSON text, or a parsed object) as ``{job: trigger}``; None if absent or unreadable."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value) if value else None
        except ValueError:
            return None
    if not isinstance(value, Mapping):
        return None
    return {str(job): str(text) for job, text in value.items()}


def dump_triggers(triggers: Mapping[str, str] | None) -> str | None:
    """``{job: trigger}`` as the JSON text the stores keep (None: none)."""
    return None if triggers is None else json.dumps(dict(sorted(triggers.items())), ensure_ascii=False, separators=(",", ":"))
