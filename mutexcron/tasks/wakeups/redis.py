"""Redis task notices: the scripts publish the code when a task became the head of its due ZSET.

The store's scripts that queue a task (``add``, ``retry``, ``release``, and ``complete`` when an
attempt's end queues it again: a Retry, a Reschedule, a pending re-add) ``PUBLISH`` the code on
the namespace's channel, ``mutexcron:{<namespace>}:task_wake``, when the task they queue is
claimable before every other task of its code was (the head of the code's due ZSET, by score),
at most once per code and call, and only then: a task queued behind others, or a re-add while it
runs, changes nothing a sleeping worker waits for (it already sleeps until the head's time). The
notice is part of the script, so it leaves only if the write was made.

:class:`RedisWaker` subscribes on a connection of its own (a redis-py ``PubSub`` of the store's
client: the same server, options and credentials) and sleeps on its socket and on the local
notices at once. Redis Cluster: a ``PUBLISH`` reaches every node of the cluster, and the waker
subscribes through redis-py's cluster pub/sub on the node that owns the channel's slot (the
namespace's primary); after a failover it subscribes again. Pub/sub is fire and forget: a notice
sent while the subscription is down is lost, which costs latency only (the waker polls until it is
back, and the worker's backstop poll remains).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import redis

from .listen import ListeningWaker

__all__ = ["WAKE_CHANNEL", "RedisWaker"]

#: The channel's name in the namespace (``backend.key(WAKE_CHANNEL)``); the scripts spell it too.
WAKE_CHANNEL = "task_wake"


class Subscribable(Protocol):
    """What the waker needs of a store: a redis-py client, its timeout and log wording, and its
    channel names (a :class:`~mutexcron.backends.redis.RedisBackend`, or a shared job store's side)."""

    socket_timeout: float

    @property
    def client(self) -> Any: ...

    @property
    def masked_url(self) -> str: ...

    def detail(self, exc: BaseException) -> str: ...

    def key(self, suffix: str) -> str: ...


class RedisWaker(ListeningWaker):
    """Woken by a message on the namespace's wake channel (or ``channel``: a lock hand-over's) whose data is one of ``codes``."""

    what = "the Redis subscription"

    def __init__(self, backend: Subscribable, codes: Iterable[str], *, channel: str = WAKE_CHANNEL) -> None:
        super().__init__(codes, backend.masked_url, (redis.exceptions.RedisError, redis.exceptions.RedisClusterException))
        self.backend = backend
        self.channel = backend.key(channel)
        self._pubsub: Any = None  # redis.client.PubSub or redis.cluster.ClusterPubSub
        with self._mutex:
            self._ensure_listening()  # from now on no notice is missed, even before the first wait

    def _open(self) -> None:
        pubsub = self.backend.client.pubsub()
        self._pubsub = pubsub
        pubsub.subscribe(self.channel)
        # The subscription is confirmed by the server's first reply: wait for it, so that a notice
        # published once this returns is never missed.
        reply = pubsub.get_message(timeout=self.backend.socket_timeout)
        if not reply or reply.get("type") != "subscribe":
            raise redis.exceptions.ConnectionError(f"no confirmation of SUBSCRIBE {self.channel} from the server")

    def _socket(self) -> Any:
        # redis-py reconnects (and subscribes again) by itself once after a dropped connection:
        # the socket is then a new one, which the waker watches instead.
        sock = getattr(self._pubsub.connection, "_sock", None)
        if sock is None:
            raise redis.exceptions.ConnectionError("the subscription's connection has no socket")
        return sock

    def _read(self) -> bool:
        pubsub = self._pubsub
        connection = pubsub.connection
        if connection is None:
            raise redis.exceptions.ConnectionError("the subscription's connection was closed")
        woken = False
        while connection.can_read(timeout=0):  # what the parser buffered, or the socket has
            message = pubsub.get_message(timeout=0)
            if message and message.get("type") == "message" and message.get("data") in self.codes:
                woken = True
        return woken

    def _shut(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except (redis.exceptions.RedisError, OSError):
                pass

    def _detail(self, exc: BaseException) -> str:
        return self.backend.detail(exc)
