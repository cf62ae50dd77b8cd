"""Functions run in child processes by the tests (importable by a spawned interpreter)."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from typing import Any

from mutexcron.errors import StoreUnavailableError
from mutexcron.locks import FireClaim, HeldClaim, LockStore, Node, lock_store_from_url
from mutexcron.locks.sql import SQLLockStore


class MySQL8LockStore(SQLLockStore):
    """MySQL 8's code path on MariaDB (no RETURNING: statements read back in one transaction)."""

    _use_mariadb_returning = False


def open_store(url: str, variant: str = "") -> LockStore:
    """The store for ``url``; ``variant="mysql8"``: :class:`MySQL8LockStore`."""
    return MySQL8LockStore(url) if variant == "mysql8" else lock_store_from_url(url)


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


# -- claim_many racing acquire_or_renew (tests/test_batch_claims.py) ---------------------------------
RACE_LOCKS = ("race-a", "race-b", "race-c")
RACE_JOBS = ("j0", 'jobs.tick "v2"', "j$2")
#: Fire time of round r: RACE_BASE_US + r * 1000 (any fixed origin works: only the order counts).
RACE_BASE_US = 1_700_000_000_000_000


def claim_race(
    store: Any,
    node: Node,
    prefix: str,
    rounds: int,
    ttl: float,
    barrier: Any,
    stall: Callable[[float], None],
    seed: int,
    jitter: float,
) -> dict[str, Any]:
    """One racer: each round claims every job of every lock at the round's fire time.

    Per round, after ``barrier``: the whole node may stall (the same decision in every racer of the
    node, so its leases go stale and other nodes take over), the racer waits a random fraction
    of ``jitter`` seconds, tries ``acquire_or_renew`` with a claim of a random job on every lock it does not
    hold (a lock another racer of the same node holds is renewed: same holder), then claims every
    job of every lock it holds with one ``claim_many`` (tokens from earlier rounds may be stale).

    Returns:
        ``won``: ``[lock, job, round, nonce]`` of every claim this racer was told it won;
        ``lost``: locks claim_many reported not renewed, and ``lost_rounds``: ``[lock, round]`` of each;
        ``errors``: uncertain outcomes (contention), ``claim_errors`` of them from claim_many.
    """
    rng = random.Random(seed)
    node_rng = random.Random(node.node_id)  # the same stalls in every racer of this node
    names = [f"{prefix}-{lock}" for lock in RACE_LOCKS]
    held: dict[str, int] = {}
    won: list[list[Any]] = []
    lost_rounds: list[list[Any]] = []
    lost = errors = claim_errors = 0
    for r in range(rounds):
        barrier.wait(timeout=120)
        fire = RACE_BASE_US + r * 1000
        if node_rng.random() < 0.03:
            stall(ttl * node_rng.uniform(0.7, 1.6))
        else:
            node_rng.random()  # keep the node's racers on the same sequence
        time.sleep(rng.uniform(0, jitter))
        for name in rng.sample(names, len(names)):
            if name in held:
                continue
            claim = FireClaim.new(rng.choice(RACE_JOBS), fire)
            result = store.acquire_or_renew(name, node, ttl, claim)
            errors += result.uncertain
            if result.acquired:
                held[name] = result.token
                if result.claimed:
                    won.append([name, claim.job_id, r, claim.nonce])
        batch = [HeldClaim(name, token, FireClaim.new(job, fire)) for name, token in held.items() for job in RACE_JOBS]
        if not batch:
            continue
        rng.shuffle(batch)
        try:
            claimed = store.claim_many(node, batch)
        except StoreUnavailableError:
            errors += 1
            claim_errors += 1
            continue
        won += [[h.lock, h.claim.job_id, r, h.claim.nonce] for h in batch if h.claim.nonce in claimed.won]
        lost += len(held.keys() - claimed.renewed)
        lost_rounds += [[name, r] for name in held.keys() - claimed.renewed]
        held = {name: token for name, token in held.items() if name in claimed.renewed}
    return {"won": won, "lost": lost, "lost_rounds": lost_rounds, "errors": errors, "claim_errors": claim_errors}


def claim_race_process(
    url: str, variant: str, node_id: str, prefix: str, rounds: int, ttl: float, barrier: Any, results: Any, index: int
) -> None:
    """:func:`claim_race` in a child process, on its own store; puts ``(index, outcome)`` on ``results``."""
    store = open_store(url, variant)
    try:
        outcome = claim_race(store, Node(node_id, "127.0.0.1"), prefix, rounds, ttl, barrier, time.sleep, index, ttl / 8)
    except BaseException as exc:
        barrier.abort()
        outcome = {"error": repr(exc)}
    finally:
        store.close()
    results.put((index, outcome))
