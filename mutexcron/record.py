"""LockRecord: what a lock looks like to jobs, ``lock_else`` callbacks and ``status``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from .errors import AttrsError
from .timeutil import us_from_datetime as us_from_datetime  # re-exported: guard.py and firetimes.py use it

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
)


@dataclass(frozen=True)
class LockRecord(Mapping[str, Any]):
    """A read-only snapshot of one named lock, as the store saw it.

    It is a dataclass that also reads like the seed's dict: ``rec["active_ip"]``,
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))
        object.__setattr__(self, "fire_times", MappingProxyType(dict(self.fire_times)))

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
        }


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
