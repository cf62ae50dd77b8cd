"""The one converter of stored times to aware UTC datetimes, and its inverse for fire times.

Stores keep times in whatever their server has: SQLite ISO-8601 text, naive MySQL ``DATETIME``,
PostgreSQL ``timestamptz``, MongoDB dates, Redis epoch milliseconds as text, fire times as epoch
microseconds. Every one of them becomes a record's datetime through :func:`as_utc`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

#: The Unix epoch, UTC.
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: ``epoch_unit`` values for :func:`as_utc`.
MILLISECONDS = 1_000
MICROSECONDS = 1_000_000


def as_utc(value: Any, *, epoch_unit: int | None = None) -> datetime | None:
    """A stored time as an aware UTC datetime, or None for no (or an unreadable) time.

    Args:
        value: a datetime (a naive one is taken as UTC) or ISO-8601 text; with ``epoch_unit``, a
            number of those units since the epoch, as a number or as text (Redis answers text).
        epoch_unit: units per second of an epoch number: :data:`MILLISECONDS` or :data:`MICROSECONDS`.
    """
    if value is None or value == "":
        return None
    if epoch_unit is not None:
        return datetime.fromtimestamp(int(value) / epoch_unit, tz=timezone.utc)
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    return None


def us_from_datetime(value: datetime) -> int:
    """Epoch microseconds from an aware datetime (naive ones are taken as UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    delta = value - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
