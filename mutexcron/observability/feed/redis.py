"""The feed of a Redis store: the capped list ``mutexcron:{<namespace>}:feed``, newest first, each
entry stamped with the server's ``TIME`` by the script that pushes it."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from . import FeedEvent, FeedStore

__all__ = ["RedisFeedStore"]

# Push each event stamped with the server's clock, newest first, and keep the newest ARGV[1].
# KEYS[1]: the feed list; ARGV[1]: events kept at most; ARGV[2..]: the events' JSON texts.
_APPEND = """
local t = redis.call('TIME')
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 2, #ARGV do
  redis.call('LPUSH', KEYS[1], string.format('%.0f', us) .. ' ' .. ARGV[i])
end
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[1]) - 1)
return 1
"""


class RedisFeedStore(FeedStore):
    """The feed in the namespace of a Redis ``backend`` (:class:`mutexcron.backends.redis.RedisBackend`)."""

    ages_on_host = False  # stamped with the server's TIME

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.key = backend.key("feed")
        self._append = backend.script(_APPEND)

    def append(self, events: list[FeedEvent]) -> None:
        if not events:
            return
        texts = [json.dumps({"kind": e.kind, "node": e.node, "subject": e.subject, "body": e.body()}) for e in events]
        with self.backend.errors("appending to the event feed"):
            self._append(keys=[self.key], args=[self.max_events, *texts], client=self.backend.client)

    def recent(self, limit: int, *, kinds: tuple[str, ...] = (), node: str | None = None,
               subject: str | None = None) -> list[FeedEvent]:  # fmt: skip
        filtered = bool(kinds or node or subject)
        with self.backend.errors("reading the event feed"):  # filtered: the newest 2,000 are searched
            raw = self.backend.client.lrange(self.key, 0, (min(self.max_events, 2_000) if filtered else limit) - 1)
        found = []
        for line in raw:
            us, _, text = (line.decode() if isinstance(line, bytes) else line).partition(" ")
            data = json.loads(text)
            if not _matches(data, kinds, node, subject):
                continue
            at = datetime.fromtimestamp(int(us) / 1e6, timezone.utc)
            found.append(FeedEvent.from_stored(data["kind"], data["node"], data["subject"], data["body"], at))
            if len(found) >= limit:
                break
        return found


def _matches(data: dict[str, Any], kinds: tuple[str, ...], node: str | None, subject: str | None) -> bool:
    return (not kinds or data["kind"] in kinds) and node in (None, "", data["node"]) and subject in (None, "", data["subject"])
