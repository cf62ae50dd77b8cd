"""Functions run in child processes by the tests (importable by a spawned interpreter)."""

from __future__ import annotations

import secrets

from mutexcron.locks import Node, lock_store_from_url


def race_rounds(url: str, prefix: str, rounds: int, index: int) -> list[int]:
    """Try to acquire ``prefix-0`` .. ``prefix-(rounds-1)``; return the rounds this process won."""
    store = lock_store_from_url(url)
    node = Node(f"proc-{index}:{secrets.token_hex(3)}", "127.0.0.1")
    won = []
    try:
        for r in range(rounds):
            if store.acquire_or_renew(f"{prefix}-{r}", node, ttl=60).acquired:
                won.append(r)
    finally:
        store.close()
    return won
