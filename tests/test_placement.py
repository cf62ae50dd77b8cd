"""Issue 33, part 1: placement. Every live node asks for its fair share of the guarded locks,
computed alike on every node from the presence records; acquiring still goes through the store.

The lease managers here share one memory store and one injected clock: each "round" is one
heartbeat round of every node, in turn.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mutexcron import MutexScheduler
from mutexcron.errors import ConfigurationError
from mutexcron.heartbeat import OFFER_WITHIN, LeaseManager
from mutexcron.locks import Node
from mutexcron.locks.memory import MemoryLockStore
from mutexcron.node import NodeTraits
from mutexcron.placement import (
    DEFAULT_HAND_OVER_WAIT,
    BalancedPlacement,
    FirstPlacement,
    assign,
    new_placement,
    node_allowed,
    placement_mode,
)
from mutexcron.placement.balanced import FREE_GRACE, REASON_KEPT
from tests.backends import FakeClock

pytestmark = pytest.mark.memory

LOCKS = [f"lock-{i:03d}" for i in range(300)]


def counts(owners: dict[str, str | None]) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for owner in owners.values():
        out[owner] = out.get(owner, 0) + 1
    return out


# -- the rendezvous rule --------------------------------------------------------------------------
def test_every_node_gets_its_fair_share_and_the_answer_does_not_depend_on_order() -> None:
    owners = assign(LOCKS, ["a", "b", "c"])
    assert counts(owners) == {"a": 100, "b": 100, "c": 100}
    assert assign(list(reversed(LOCKS)), ["c", "a", "b"]) == owners
    assert max(counts(assign(LOCKS, ["a", "b", "c", "d", "e", "f", "g"])).values()) <= math.ceil(300 / 7)


def test_a_join_or_a_leave_moves_only_what_it_must() -> None:
    three = assign(LOCKS, ["a", "b", "c"])
    four = assign(LOCKS, ["a", "b", "c", "d"])
    moved = [lock for lock in LOCKS if three[lock] != four[lock]]
    # d's share is 75; a bounded load may shift a few more, never a reshuffle.
    assert 75 <= len(moved) <= 100, len(moved)
    assert all(four[lock] == "d" for lock in moved[:0])
    two = assign(LOCKS, ["a", "b"])
    kept = [lock for lock in LOCKS if three[lock] in ("a", "b") and two[lock] == three[lock]]
    assert len(kept) >= 180, len(kept)


def test_nodes_patterns_keep_a_lock_on_the_matching_nodes() -> None:
    def allowed(lock: str, node: str) -> bool:
        return not lock.startswith("lock-0") or node.startswith("reports-")

    owners = assign(LOCKS, ["reports-1", "web-1", "web-2"], allowed)
    assert all(owners[lock] == "reports-1" for lock in LOCKS if lock.startswith("lock-0"))
    assert assign(["x"], ["web-1"], lambda _lock, _node: False) == {"x": None}


def test_placement_mode_names_the_fix() -> None:
    assert placement_mode(None) == "balanced" and placement_mode("First") == "first"
    with pytest.raises(ConfigurationError, match="first, balanced"):
        placement_mode("random")
    with pytest.raises(ConfigurationError, match="reports-"):
        MutexScheduler(lock_url="memory://").mutex(lock="x", nodes=[])
    assert isinstance(new_placement("first", "a"), FirstPlacement)
    assert MutexScheduler(lock_url="memory://").placement == "balanced"  # the default
    assert MutexScheduler(lock_url="memory://", placement="first").placement == "first"  # earlier releases' behaviour


def test_the_hand_over_wait_comes_from_the_argument_the_environment_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MUTEXCRON_HAND_OVER_WAIT", raising=False)
    assert MutexScheduler(lock_url="memory://").hand_over_wait == DEFAULT_HAND_OVER_WAIT == 20.0
    monkeypatch.setenv("MUTEXCRON_HAND_OVER_WAIT", "7.5")
    assert MutexScheduler(lock_url="memory://").hand_over_wait == 7.5
    assert MutexScheduler(lock_url="memory://", hand_over_wait=0).hand_over_wait == 0.0  # the argument wins
    sched = MutexScheduler(lock_url="memory://")
    sched.configure_mutex(hand_over_wait=3)
    assert sched.hand_over_wait == 3.0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("MUTEXCRON_HAND_OVER_WAIT", bad)
        with pytest.raises(ConfigurationError, match="MUTEXCRON_HAND_OVER_WAIT"):
            MutexScheduler(lock_url="memory://")


def test_a_stopping_node_waits_for_a_successor_at_most_the_hand_over_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MUTEXCRON_HAND_OVER_WAIT", raising=False)
    waits: list[float] = []
    for given, timeout, expected in ((None, 30.0, 20.0), (4.0, 30.0, 4.0), (4.0, 2.0, 2.0)):
        sched = MutexScheduler(lock_url=f"memory://wait-{len(waits)}", shutdown_timeout=timeout, hand_over_wait=given)
        sched.add_job(print, "interval", hours=1, id="j", mutex=True)
        sched.start()
        assert sched._leases is not None
        monkeypatch.setattr(sched._leases, "hand_over_all", lambda seconds, fires: waits.append(seconds))
        sched.shutdown()
        assert waits[-1] == expected, (given, timeout)


# -- lease managers on one store --------------------------------------------------------------------
class Cluster:
    def __init__(self, locks: list[str], ttl: float = 3.0) -> None:
        self.clock = FakeClock()
        self.store = MemoryLockStore(clock=self.clock)
        self.locks = {lock: ttl for lock in locks}
        self.nodes: dict[str, LeaseManager] = {}

    def join(self, node_id: str, locks: dict[str, float] | None = None, traits: NodeTraits | None = None) -> LeaseManager:
        placement = BalancedPlacement(node_id, traits)
        manager = LeaseManager(self.store, Node(node_id, "ip"), locks or self.locks, clock=self.clock, placement=placement)
        self.nodes[node_id] = manager
        return manager

    def rounds(self, count: int, every: float = 1.0) -> None:
        for _ in range(count):
            for manager in list(self.nodes.values()):
                manager.run_once()
            self.clock.advance(every)

    def held(self) -> dict[str, int]:
        return {node_id: len(manager.held()) for node_id, manager in self.nodes.items()}

    def holders(self) -> dict[str, str | None]:
        records = {lock: self.store.read(lock) for lock in self.locks}
        return {lock: (r.holder if r is not None and r.state == "active" else None) for lock, r in records.items()}


def test_three_nodes_share_the_locks_and_a_leaver_s_locks_move_at_once() -> None:
    cluster = Cluster(LOCKS[:30])
    cluster.join("n1")
    cluster.rounds(2)
    assert cluster.held() == {"n1": 30}
    cluster.join("n2")
    cluster.join("n3")
    cluster.rounds(4)
    assert cluster.held() == {"n1": 10, "n2": 10, "n3": 10}
    leavers = {lock for lock, holder in cluster.holders().items() if holder == "n1"}
    cluster.nodes.pop("n1").stop(timeout=0)  # SIGTERM: presence deleted, leases released
    cluster.rounds(1)  # the next round of each survivor: it reads the locks placed on it again
    assert all(cluster.holders()[lock] in ("n2", "n3") for lock in leavers), "every lock of the leaver is held again"
    cluster.rounds(1)  # and a lock the bounded load moved between the survivors is handed over
    assert cluster.held() == {"n2": 15, "n3": 15}
    cluster.join("n1")
    cluster.rounds(4)
    assert cluster.held() == {"n1": 10, "n2": 10, "n3": 10}


def test_a_killed_node_s_locks_go_to_the_survivors_placement_when_its_lease_runs_out() -> None:
    cluster = Cluster(LOCKS[:30], ttl=3.0)
    for node_id in ("n1", "n2", "n3"):
        cluster.join(node_id)
    cluster.rounds(4)
    assert cluster.held() == {"n1": 10, "n2": 10, "n3": 10}
    cluster.nodes.pop("n3")  # kill -9: no release, no more renewals
    cluster.rounds(3, every=0.5)  # 1.5 s (and at most 1 s since its last renewal): lease 3 s not over yet
    assert sum(1 for holder in cluster.holders().values() if holder == "n3") == 10
    cluster.rounds(4, every=0.5)  # the lease runs out: each of its locks goes to its new place at once
    assert cluster.held() == {"n1": 15, "n2": 15}
    assert set(cluster.holders().values()) == {"n1", "n2"}


def test_a_node_not_placed_for_a_free_lock_does_not_ask_for_it_at_a_tick() -> None:
    cluster = Cluster(LOCKS[:6])
    a, b = cluster.join("a"), cluster.join("b")
    cluster.rounds(3)
    mine = set(a.held())
    theirs = next(lock for lock in LOCKS[:6] if lock not in mine)
    b.stop(timeout=0)  # released, but `a` has not refreshed its nodes yet
    cluster.nodes.pop("b")
    result = a.tick(theirs, None)
    assert result is not None and not result.acquired and set(a.held()) == mine
    cluster.rounds(2)
    assert len(a.held()) == 6, "after the next read of the nodes, `a` is placed for all"


def test_a_lock_its_placed_node_does_not_guard_is_taken_after_the_grace() -> None:
    cluster = Cluster(LOCKS[:20])
    a = cluster.join("a")
    cluster.join("b", locks={lock: 3.0 for lock in LOCKS[:20] if lock != "lock-000"})
    owner = assign(LOCKS[:20], ["a", "b"])["lock-000"]
    if owner != "b":
        pytest.skip("lock-000 is placed on a: nothing to show")
    # a offers it to b (b never takes it): once the offer lapsed and the grace passed, a takes it again
    cluster.rounds(int(OFFER_WITHIN + FREE_GRACE) + 2)
    assert "lock-000" in a.held(), "nobody else asks for it: a takes it after the grace"
    cluster.rounds(10)
    assert "lock-000" in a.held(), "and keeps it (no back and forth)"


def test_first_placement_keeps_today_s_behaviour() -> None:
    clock = FakeClock()
    store = MemoryLockStore(clock=clock)
    first = LeaseManager(store, Node("a", "ip"), {lock: 3.0 for lock in LOCKS[:10]}, clock=clock)
    second = LeaseManager(store, Node("b", "ip"), {lock: 3.0 for lock in LOCKS[:10]}, clock=clock)
    for _ in range(3):
        first.run_once()
        second.run_once()
        clock.advance(1.0)
    assert len(first.held()) == 10 and not second.held()


def test_a_node_kept_off_a_lock_by_its_patterns_never_asks_for_it() -> None:
    cluster = Cluster(["reports", "other"])
    web = cluster.join("web-1")
    web.placement.restrict("reports", ["reports-*"])
    cluster.rounds(5)
    assert set(web.held()) == {"other"}
    result = web.tick("reports", None)
    assert result is not None and not result.acquired
    reports = cluster.join("reports-1")
    reports.placement.restrict("reports", ["reports-*"])
    cluster.rounds(2)
    assert "reports" in reports.held()


# -- weights, tags and the reasons of moves (issue 33, part 4) ----------------------------------------
def test_a_node_of_weight_2_is_placed_for_about_twice_the_locks() -> None:
    owners = assign(LOCKS, ["a", "b", "c"], weights={"a": 2.0})
    assert counts(owners) == {"a": 150, "b": 75, "c": 75}
    assert assign(LOCKS, ["a", "b", "c"], weights={"a": 1.0, "b": 1.0}) == assign(LOCKS, ["a", "b", "c"]), "1 is the default"
    light = counts(assign(LOCKS, ["a", "b", "c"], weights={"c": 0.5}))
    assert light["c"] == math.ceil(300 * 0.5 / 2.5) and light["a"] + light["b"] == 300 - light["c"]
    # Only the locks whose place a new weight changes move.
    before, after = assign(LOCKS, ["a", "b", "c"]), assign(LOCKS, ["a", "b", "c"], weights={"a": 2.0})
    moved = [lock for lock in LOCKS if before[lock] != after[lock]]
    assert 50 <= len(moved) <= 75, len(moved)  # 50 to a, and a few between b and c as their room shrinks


def test_the_locks_kept_on_some_nodes_are_placed_first_so_the_shares_stay_fair() -> None:
    locks = [*LOCKS[:60], "zz-eu-0", "zz-eu-1", "zz-eu-2"]  # named to sort last: placed first anyway

    def allowed(lock: str, node: str) -> bool:
        return not lock.startswith("zz-eu") or node == "big"

    owners = assign(locks, ["big", "small"], allowed, {"big": 2.0})
    assert counts(owners) == {"big": 42, "small": 21}, "ceil(63 * 2/3) and ceil(63 / 3), the 3 kept locks included"
    assert all(owners[f"zz-eu-{i}"] == "big" for i in range(3))


def test_the_weighted_rank_is_finite_at_the_ends_of_the_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    from mutexcron.placement import rendezvous

    for extreme in (0, 2**64 - 1):
        monkeypatch.setattr(rendezvous, "_hash", lambda _lock, _node, value=extreme: value)
        assert 0 < rendezvous._score("x", "a", 2.0) < math.inf  # never ln(0) or ln(1)


def test_patterns_match_node_ids_or_tags_and_tag_patterns_tags_only() -> None:
    assert node_allowed("reports-1", ["reports-*"]) and node_allowed("web-1", ["reports-*"], ["reports-eu"])
    assert not node_allowed("web-1", ["reports-*"], ["eu"])
    assert node_allowed("web-1", ["tag:eu"], ["eu", "big"]) and node_allowed("web-1", ["tag:e*"], ["eu"])
    assert not node_allowed("eu", ["tag:eu"]), "tag: never matches the node id"
    assert node_allowed("x", None) and not node_allowed("x", [])


def test_weights_and_tags_come_from_the_nodes_presences() -> None:
    cluster = Cluster([*LOCKS[:30], "eu-only"])
    big = cluster.join("big", traits=NodeTraits(2.0))
    cluster.join("small-1")
    eu = cluster.join("small-2", traits=NodeTraits(1.0, ("eu",)))
    for manager in cluster.nodes.values():
        manager.placement.restrict("eu-only", ["tag:eu"])
    cluster.rounds(5)
    assert cluster.holders()["eu-only"] == "small-2", "only the node tagged eu is placed for it"
    assert cluster.held() == {"big": 15, "small-1": 8, "small-2": 8}
    assert big.placement.nodes_traits() == {"big": NodeTraits(2.0), "small-1": NodeTraits(), "small-2": NodeTraits(1.0, ("eu",))}
    assert eu.placement.shares() == {"big": 15, "small-1": 8, "small-2": 8}, "every node computes the same shares"


def test_a_tag_pattern_nobody_matches_keeps_its_lock_unheld(caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster(["eu-only", "other"])
    for node_id in ("a", "b"):
        cluster.join(node_id).placement.restrict("eu-only", ["tag:eu"])
    cluster.rounds(int(FREE_GRACE) + 2)
    assert cluster.holders()["eu-only"] is None and cluster.holders()["other"] in ("a", "b")


def test_every_move_is_logged_once_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="mutexcron")
    cluster = Cluster(LOCKS[:12])
    cluster.join("n1")
    cluster.rounds(2)
    caplog.clear()
    cluster.join("n2")
    cluster.rounds(4)
    joined = [r.getMessage() for r in caplog.records if "n2 joined" in r.getMessage()]
    moved = sum(1 for lock, holder in cluster.holders().items() if holder == "n2")
    assert moved == 6
    # Once per move: by the node that hands the lock over (the joiner's own start is one line).
    assert len(joined) == moved and all("to n2 (placement rebalanced: n2 joined)" in m for m in joined), joined
    caplog.clear()
    cluster.nodes.pop("n2").stop(timeout=0)
    cluster.rounds(2)
    left = [r.getMessage() for r in caplog.records if "placement moved it here: n2 left" in r.getMessage()]
    assert len(left) == moved, [r.getMessage() for r in caplog.records]
    caplog.clear()
    cluster.join("n3")
    cluster.rounds(4)
    cluster.nodes.pop("n3")  # kill -9
    cluster.rounds(8, every=0.5)
    taken = [r for r in caplog.records if r.getMessage().startswith("took over lock")]
    assert len(taken) == 6 and all("from n3 (ip), whose heartbeat was 3.0s old" in r.getMessage() for r in taken)


def test_a_move_reason_is_said_once_and_not_long_after_its_change() -> None:
    cluster = Cluster(LOCKS[:4])
    a = cluster.join("a")
    cluster.join("b")
    cluster.rounds(4)
    placement = a.placement
    assert isinstance(placement, BalancedPlacement)
    cluster.nodes.pop("b").stop(timeout=0)
    placement.refresh(cluster.store, cluster.locks, cluster.clock(), force=True)  # b left: its locks are placed on a
    moved = [lock for lock in LOCKS[:4] if lock not in a.held()]
    assert placement.move_reason(moved[0]) == "b left" and placement.move_reason(moved[0]) is None, "said once"
    cluster.clock.advance(REASON_KEPT + 1)
    placement.refresh(cluster.store, cluster.locks, cluster.clock(), force=True)  # no change: the reasons are old
    assert placement.move_reason(moved[1]) is None


def test_a_change_of_weight_rebalances_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="mutexcron")
    cluster = Cluster(LOCKS[:12])
    a = cluster.join("a")
    cluster.join("b")
    cluster.rounds(4)
    assert cluster.held() == {"a": 6, "b": 6}
    caplog.clear()
    a.placement.traits = NodeTraits(2.0)  # as a restart with --weight 2 would publish
    cluster.rounds(4)
    assert cluster.held() == {"a": 8, "b": 4}
    assert any("weights or tags changed: rebalanced" in r.getMessage() for r in caplog.records)
    assert sum("to a (placement rebalanced)" in r.getMessage() for r in caplog.records) == 2


def test_first_placement_honours_this_nodes_own_tags() -> None:
    tagged, plain = FirstPlacement("web-1", NodeTraits(tags=("eu",))), FirstPlacement("web-2")
    for placement in (tagged, plain):
        placement.restrict("eu-only", ["tag:eu"])
    assert tagged.asks("eu-only", 0.0) and not plain.asks("eu-only", 0.0)
    assert tagged.to_take(MemoryLockStore(), {"eu-only": None}, 0.0) == ["eu-only"]
    assert plain.to_take(MemoryLockStore(), {"eu-only": None}, 0.0) == []


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--weight", "0"], {}, "bad node weight '0': use a number from 0.01 to 1000"),
        (["--weight", "heavy"], {}, "bad node weight 'heavy'"),
        ([], {"MUTEXCRON_WEIGHT": "-2"}, "bad node weight '-2'"),
        (["--tag", "eu west"], {}, "bad node tag 'eu west': a tag is a letter or digit"),
        (["--tag", "tag:eu"], {}, "bad node tag 'tag:eu'"),
        ([], {"MUTEXCRON_TAGS": "eu,*"}, "bad node tag '*'"),
    ],
    ids=["zero", "not-a-number", "env-negative", "space", "prefix", "env-glob"],
)
def test_a_bad_weight_or_tag_stops_run_with_the_fix_and_creates_nothing(
    args: list[str], env: dict[str, str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from mutexcron.cli.main import main

    jobs = tmp_path / "jobs.py"
    jobs.write_text("from mutexcron import MutexScheduler\nsched = MutexScheduler()\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(main, ["run", str(jobs), "--lock-url", f"sqlite:///{tmp_path}/locks.db", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "locks.db").exists(), "bad input changes nothing"


def test_the_scheduler_takes_weight_and_tags_and_says_what_is_wrong() -> None:
    sched = MutexScheduler(lock_url="memory://", weight=2, tags=["reports", "eu", "eu"])
    assert sched.traits == NodeTraits(2.0, ("eu", "reports"))
    sched.configure_mutex(tags=["batch"])
    assert sched.traits == NodeTraits(2.0, ("batch",)), "the weight stays"
    with pytest.raises(ConfigurationError, match="MUTEXCRON_WEIGHT"):
        MutexScheduler(lock_url="memory://", weight=5000)
    with pytest.raises(ConfigurationError, match="tag:eu"):
        MutexScheduler(lock_url="memory://").mutex(lock="x", nodes="tag:")
