"""Who this process is: a node id unique per process, this host's outbound IP, and its placement traits
(weight and tags)."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError


def default_node_id() -> str:
    """``hostname:pid:random``: two processes on one host are two different holders."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def outbound_ip() -> str:
    """The IP this host would use to reach the network, found without sending a packet.

    Connecting a UDP socket only asks the kernel for a route; nothing is sent. The target is in
    TEST-NET-1 (192.0.2.0/24, reserved for documentation), so it is never a real host.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.1", 9))
            ip = str(sock.getsockname()[0])
            if ip and not ip.startswith("0."):
                return ip
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


#: A tag: a letter or digit, then letters, digits, ``_``, ``.`` or ``-`` (no glob characters, no
#: ``:``), so that ``mutex(nodes="tag:eu")`` and ``--tag eu`` always mean the same word.
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: The weights a node may have: a node of weight 2 is placed for about twice the locks of weight 1.
MIN_WEIGHT, MAX_WEIGHT = 0.01, 1000.0
#: At most this many tags per node (each a word of 64 characters or fewer).
MAX_TAGS = 32


@dataclass(frozen=True)
class NodeTraits:
    """What placement reads of a node besides its id: its weight and its tags.

    Published in the node's presence record with its renewals, so every node places the locks
    from the same weights and tags (``mutexcron run --weight 2 --tag reports --tag eu``).
    """

    weight: float = 1.0
    tags: tuple[str, ...] = ()

    @classmethod
    def checked(cls, weight: float | str | None = None, tags: Iterable[str] | str | None = None) -> NodeTraits:
        """Traits from user input (``tags``: words, or one comma-separated text as in ``$MUTEXCRON_TAGS``).

        Raises:
            ConfigurationError: a weight that is not a number from MIN_WEIGHT to MAX_WEIGHT, or a bad tag.
        """
        return cls(check_weight(weight), check_tags(tags))

    @classmethod
    def from_json(cls, value: Any) -> NodeTraits:
        """Traits as a store keeps them (a JSON object or its text); defaults for anything unreadable
        (a presence written by an earlier mutexcron has none)."""
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value) if value else None
            except ValueError:
                return cls()
        if not isinstance(value, Mapping):
            return cls()
        weight = value.get("weight", 1.0)
        tags = value.get("tags", ())
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            weight = 1.0
        tags = tuple(str(t) for t in tags if isinstance(t, str) and _TAG.fullmatch(t)) if isinstance(tags, list) else ()
        return cls(float(weight), tags)

    def to_json(self) -> dict[str, Any]:
        return {"weight": self.weight, "tags": list(self.tags)}

    def json_text(self) -> str:
        """As the SQL stores keep it: JSON text."""
        return json.dumps(self.to_json(), separators=(",", ":"))


def check_weight(weight: float | str | None) -> float:
    """``weight`` as a float (None: 1).

    Raises:
        ConfigurationError: not a number from :data:`MIN_WEIGHT` to :data:`MAX_WEIGHT`.
    """
    if weight is None or weight == "":
        return 1.0
    try:
        value = float(weight)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(weight, bool) or not MIN_WEIGHT <= value <= MAX_WEIGHT:
        raise ConfigurationError(
            f"bad node weight {weight!r}: use a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g} (--weight / MUTEXCRON_WEIGHT; "
            "default 1: a node of weight 2 is placed for about twice the locks)"
        )
    return value


def check_tags(tags: Iterable[str] | str | None) -> tuple[str, ...]:
    """``tags`` as a sorted tuple without duplicates (a text: comma-separated).

    Raises:
        ConfigurationError: a tag that is not a word of letters, digits, ``_``, ``.`` and ``-``, or too many.
    """
    if tags is None:
        return ()
    words = tags.split(",") if isinstance(tags, str) else list(tags)
    words = [w.strip() if isinstance(w, str) else w for w in words if not isinstance(w, str) or w.strip()]
    for word in words:
        if not isinstance(word, str) or not _TAG.fullmatch(word):
            raise ConfigurationError(
                f"bad node tag {word!r}: a tag is a letter or digit, then up to 63 letters, digits, '_', '.' or '-' "
                "(no spaces, commas, ':' or glob characters), e.g. --tag reports --tag eu (MUTEXCRON_TAGS=reports,eu)"
            )
    if len(set(words)) > MAX_TAGS:
        raise ConfigurationError(f"{len(set(words))} node tags: at most {MAX_TAGS} (--tag / MUTEXCRON_TAGS)")
    return tuple(sorted(set(words)))
