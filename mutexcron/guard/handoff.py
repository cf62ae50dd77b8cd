"""The attrs a node hands from run to run, merged and written one at a time per lock.

Only the token holder can write a lock's attrs (every write is fenced by holder and token), so a
node that serialises its own writes per lock serialises all of them. The node keeps the attrs as
stored under its current token: the record at the acquire that gave it the token, then its own
writes. A run's returned dict replaces the keys the run was given (``seen``): keys it was given
and did not return are deleted, and keys it never saw (a lock-group mate's) are kept.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

from ..locks import LockStore, Node, RunInfo
from ..locks.record import LockRecord, dump_attrs


class AttrsHandOff:
    """Per-lock attrs under this node's current token, and their fenced writes."""

    def __init__(self, store: LockStore, node: Node, max_attrs_bytes: int | None) -> None:
        self.store = store
        self.node = node
        self.max_attrs_bytes = max_attrs_bytes
        self._attrs: dict[str, tuple[int, dict[str, Any]]] = {}
        self._writing: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def remember(self, lock: str, token: int, record: LockRecord) -> None:
        """Start the cache for a token this node just got (later writes are its own)."""
        with self._lock:
            cached = self._attrs.get(lock)
            if cached is None or cached[0] != token:
                self._attrs[lock] = (token, dict(record.attrs))

    def forget(self, lock: str) -> None:
        """Drop what is kept of a lock this node no longer guards."""
        with self._lock:
            self._attrs.pop(lock, None)
            self._writing.pop(lock, None)

    def attrs(self, lock: str, token: int) -> dict[str, Any]:
        """The attrs stored under ``token`` as this node knows them (a copy; {} if unknown)."""
        with self._lock:
            cached = self._attrs.get(lock)
            return dict(cached[1]) if cached is not None and cached[0] == token else {}

    def check(self, attrs: Mapping[str, Any], job: str) -> None:
        """Raise AttrsError for attrs that are not JSON or too large, before any write."""
        dump_attrs(attrs, job=job, limit=self.max_attrs_bytes)

    def write(
        self, lock: str, token: int, seen: set[str], attrs: Mapping[str, Any] | None, run: RunInfo | None, job: str
    ) -> bool:
        """One fenced write of the merged attrs and the run info; False if the lock moved on.

        The run (if any) goes to ``job``'s run history in the same write (``run.job`` defaults to
        ``job``). Raises StoreUnavailableError/StoreError from the store, AttrsError for bad attrs.
        """
        if run is not None and run.job is None:
            run = dataclasses.replace(run, job=job)
        with self._lock:
            writing = self._writing.setdefault(lock, threading.Lock())
        with writing:
            merged = None
            if attrs is not None:
                merged = {k: v for k, v in self.attrs(lock, token).items() if k not in seen}
                merged.update(attrs)
                self.check(merged, job)
            if not self.store.hand_off(lock, self.node, token, merged, run):
                return False
            if merged is not None:
                with self._lock:
                    self._attrs[lock] = (token, merged)
            return True
