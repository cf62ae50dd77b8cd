"""The feed in one SQL table beside the lock table, ``<table>_feed``: one row per event, stamped
with the database's clock; each append drops the rows past :data:`~.MAX_EVENTS` and
:data:`~.RETENTION`."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy.engine import Connection

from ...backends.sql import SQLBackend
from . import RETENTION, FeedEvent, FeedStore

__all__ = ["SQLFeedStore"]

log = logging.getLogger(__name__)

#: The table, per dialect ({t}: its name).
_DDL = {
    "sqlite": "CREATE TABLE IF NOT EXISTS {t} (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, "
              "kind VARCHAR(32) NOT NULL, node VARCHAR(255), subject VARCHAR(255), body TEXT NOT NULL)",
    "mysql": "CREATE TABLE IF NOT EXISTS {t} (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, at DATETIME(6) NOT NULL, "
             "kind VARCHAR(32) NOT NULL, node VARCHAR(255), subject VARCHAR(255), body MEDIUMTEXT NOT NULL) "
             "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
    "postgresql": "CREATE TABLE IF NOT EXISTS {t} (id BIGSERIAL PRIMARY KEY, at TIMESTAMPTZ NOT NULL, "
                  "kind VARCHAR(32) NOT NULL, node VARCHAR(255), subject VARCHAR(255), body TEXT NOT NULL)",
}  # fmt: skip


class SQLFeedStore(FeedStore):
    """The feed of the lock table of ``backend`` (its pool, its clock)."""

    def __init__(self, backend: SQLBackend) -> None:
        self.backend = backend
        self.table = f"{backend.table}_feed"
        clock = backend.dialect.clock
        t = self.table  # checked by the backend (TABLE_RE); every value is a bound parameter
        # -- append: one row per event, stamped by the database's clock
        self._insert = f"INSERT INTO {t} (at, kind, node, subject, body) VALUES ({clock.now}, :kind, :node, :subject, :body)"  # noqa: S608
        # -- bound: the rows past the newest MAX_EVENTS, and those older than RETENTION
        self._newest = f"SELECT MAX(id) FROM {t}"  # noqa: S608
        self._prune = f"DELETE FROM {t} WHERE id <= :floor OR at < {clock.minus_seconds}"  # noqa: S608
        # -- read: the newest first, with each row's age by the database's clock
        self._select = f"SELECT kind, node, subject, body, {clock.age_of('at')} FROM {t}"  # noqa: S608

    def _ensure_table(self) -> None:
        ddl = _DDL[self.backend.dialect.name].format(t=self.table)
        self.backend.setup_once(self.table, lambda conn: self.backend.create(conn, ddl), f"creating table {self.table!r}",
                                f"create it yourself: {ddl}")  # fmt: skip

    def append(self, events: list[FeedEvent]) -> None:
        if not events:
            return
        self._ensure_table()
        rows = [{"kind": e.kind, "node": e.node, "subject": e.subject, "body": e.body()} for e in events]

        def write(conn: Connection) -> None:
            conn.execute(self.backend.text(self._insert), rows)
            newest = conn.execute(self.backend.text(self._newest)).scalar() or 0
            conn.execute(self.backend.text(self._prune),
                         {"floor": newest - self.max_events, "dur": RETENTION, "dur_us": int(RETENTION * 1e6)})  # fmt: skip

        begin = "BEGIN IMMEDIATE" if self.backend.dialect.one_writer else "START TRANSACTION"
        self.backend.run_in_transaction(write, begin, "appending to the event feed")

    def recent(self, limit: int, *, kinds: tuple[str, ...] = (), node: str | None = None,
               subject: str | None = None) -> list[FeedEvent]:  # fmt: skip
        self._ensure_table()  # read-only: looks for the table, creates nothing
        where: list[str] = []
        params: dict[str, Any] = {"limit": limit}
        if kinds:
            where.append("kind IN (" + ", ".join(f":k{i}" for i in range(len(kinds))) + ")")
            params.update({f"k{i}": kind for i, kind in enumerate(kinds)})
        for column, value in (("node", node), ("subject", subject)):
            if value:
                where.append(f"{column} = :{column}")
                params[column] = value
        sql = self._select + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT :limit"
        rows, _ = self.backend.execute(sql, params, "reading the event feed")
        now = datetime.now(timezone.utc)
        return [_event(row, now) for row in rows]


def _event(row: Any, now: datetime) -> FeedEvent:
    kind, node, subject, body, age = row
    at = now - timedelta(seconds=float(age)) if age is not None else None  # the caller re-bases it on the store's clock
    return FeedEvent.from_stored(kind, node, subject, body, at)
