"""Lock stores, chosen by URL scheme. Drivers are imported only when a store is built."""

from __future__ import annotations

from typing import Any

from ..backends import FAMILIES, build, family_of
from ..errors import ConfigurationError
from ..record import NodePresence, RunRecord
from .base import AcquireResult, BatchClaimResult, FireClaim, HeldClaim, LockStore, Node, Presence, RunInfo

__all__ = [
    "DEFAULT_LOCK_URL",
    "SCHEMES",
    "AcquireResult",
    "BatchClaimResult",
    "FireClaim",
    "HeldClaim",
    "LockStore",
    "Node",
    "NodePresence",
    "Presence",
    "RunInfo",
    "RunRecord",
    "lock_store_from_url",
]

DEFAULT_LOCK_URL = "sqlite:///mutexcron.db"

#: URL scheme -> ("module:Class", extra to install for its driver, or None), from the one
#: registry of store families (:data:`mutexcron.backends.FAMILIES`).
SCHEMES: dict[str, tuple[str, str | None]] = {
    scheme: (row.lock_store, row.extra) for row in FAMILIES for scheme in row.schemes
}


def lock_store_from_url(url: str, **options: Any) -> LockStore:
    """Build the lock store for ``url``.

    Args:
        url: the lock URL; its scheme selects the store (:data:`SCHEMES`).
        **options: passed to the store class (and from there to its backend).

    Raises:
        ConfigurationError: the URL has no known scheme, or its driver is not installed.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"empty lock URL; use one of the schemes {', '.join(SCHEMES)} (default {DEFAULT_LOCK_URL})")
    url = url.strip()
    row = family_of(url, "lock")
    store: LockStore = build(row, row.lock_store, url, **options)
    return store
