"""Time limits at the planner: timed pins (``kvtier pin S --for 30m``) and a request's retention hint
(``kv_transfer_params: {"kvtier": {"retain_s": N, "priority": P}}``).

A real ``TierManager`` plans; a fake mover answers its jobs (no bytes move); the wall clock is a
``FakeClock`` the test moves. What is checked is which blocks pressure picks: demoted from DRAM,
dropped from NVMe.
"""
from __future__ import annotations

import pytest
from support.clock import FakeClock
from support.fakes import FakeMover

from kvtier.errors import UsageError
from kvtier.plan.index import IN_DRAM, IN_NVME, Tier, chain_block_hashes, namespace_of
from kvtier.plan.manager import TierManager
from kvtier.tiers.nvme.store import file_bytes_for

BT = 16  # tokens per block (the conftest geometry)


@pytest.fixture
def clock():
    return FakeClock(1_000_000.0)


def make(fingerprint, clock, dram_blocks=8, nvme_blocks=64, **kwargs):
    block = fingerprint.geometry.block_bytes
    manager = TierManager(fingerprint, dram_bytes=dram_blocks * block, nvme_bytes=nvme_blocks * file_bytes_for(block),
                          wall_clock=clock, **kwargs)
    return manager, FakeMover(manager), namespace_of(fingerprint.digest)


def store(manager, mover, session_id, ns, seed, blocks):
    """A turn of ``session_id``: its prompt recorded, then its blocks stored (into DRAM)."""
    keys = chain_block_hashes(list(range(seed * 10_000, seed * 10_000 + blocks * BT)), BT)
    manager.planner.record_session(session_id, ns, keys, blocks * BT)
    mover.run(manager.prepare_store(session_id, ns, keys, list(range(blocks))))
    return keys


def where(manager, ns, keys) -> str:
    """One letter a block: D in DRAM only, N on NVMe only, B both, - gone."""
    out = ""
    for key in keys:
        row = manager.table.index.row_of(ns, key)
        flags = 0 if row is None else int(manager.table.index.col["flags"][row])
        out += {IN_DRAM: "D", IN_NVME: "N", IN_DRAM | IN_NVME: "B"}.get(flags & (IN_DRAM | IN_NVME), "-")
    return out


def pressure(manager, mover) -> None:
    for job in manager.maintenance(force=True):
        mover.run(job)


# ---- a retention hint: DRAM demotion ---------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("hinted", [False, True])
def test_unhinted_blocks_are_demoted_before_hinted_ones(fingerprint, clock, policy, hinted):
    manager, mover, ns = make(fingerprint, clock, policy=policy)
    old = store(manager, mover, "agent", ns, 1, 4)  # the least recently used: the policy's first victims
    new = store(manager, mover, "chat", ns, 2, 4)
    if hinted:
        manager.planner.retain("agent", 600, 1)
    pressure(manager, mover)  # 8 of 8 slots used: down to the low watermark, 6, two blocks go
    if hinted:  # the hint moves the agent's blocks behind every unhinted one
        assert (where(manager, ns, old), where(manager, ns, new)) == ("DDDD", "NNDD")
    else:
        assert (where(manager, ns, old), where(manager, ns, new)) == ("NNDD", "DDDD")


def test_an_expired_hint_no_longer_protects(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock)
    old = store(manager, mover, "agent", ns, 1, 4)
    new = store(manager, mover, "chat", ns, 2, 4)
    manager.planner.retain("agent", 600, 3)
    assert manager.views.session_info("agent")["retain_left_s"] == 600
    assert manager.views.session_info("agent")["retain_priority"] == 3
    clock.advance(600)  # its time is up: it counts no more, the policy's order is back
    assert manager.views.session_info("agent")["retain_left_s"] is None
    pressure(manager, mover)
    assert (where(manager, ns, old), where(manager, ns, new)) == ("NNDD", "DDDD")
    assert manager.table.session("agent").retain_until is None


def test_retain_zero_ends_a_sessions_retention(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock)
    old = store(manager, mover, "agent", ns, 1, 4)
    store(manager, mover, "chat", ns, 2, 4)
    manager.planner.retain("agent", 600, 1)
    manager.planner.retain("agent", 0, 1)  # a later request's hint replaces it: 0 releases the session
    pressure(manager, mover)
    assert where(manager, ns, old) == "NNDD"


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_priority_orders_the_hinted_sessions(fingerprint, clock, policy):
    manager, mover, ns = make(fingerprint, clock, low_watermark=0.25, policy=policy)  # 8 -> 2 slots: six go
    high = store(manager, mover, "high", ns, 1, 3)  # oldest: the policy alone would take it first
    low = store(manager, mover, "low", ns, 2, 3)
    plain = store(manager, mover, "plain", ns, 3, 2)
    manager.planner.retain("high", 600, 5)
    manager.planner.retain("low", 600, 1)
    pressure(manager, mover)
    # unhinted first, then the lower priority, then (policy order within it) the higher one
    assert (where(manager, ns, plain), where(manager, ns, low), where(manager, ns, high)) == ("NN", "NNN", "NDD")


# ---- a retention hint: NVMe drops ------------------------------------------------------------------
@pytest.mark.parametrize("hinted", [False, True])
def test_unhinted_blocks_are_dropped_from_nvme_before_hinted_ones(fingerprint, clock, hinted):
    manager, mover, ns = make(fingerprint, clock, dram_blocks=16, nvme_blocks=8)
    old = store(manager, mover, "agent", ns, 1, 4)
    new = store(manager, mover, "chat", ns, 2, 3)
    for session in ("agent", "chat"):  # 7 of 8 NVMe blocks used
        mover.run(manager.planner.evict(session, Tier.NVME))
    if hinted:
        manager.planner.retain("agent", 600, 1)
    late = store(manager, mover, "late", ns, 3, 1)
    mover.run(manager.planner.evict("late", Tier.NVME))  # past NVMe's high watermark: down to its low one
    assert where(manager, ns, late) == "N"
    if hinted:
        assert (where(manager, ns, old), where(manager, ns, new)) == ("NNNN", "--N")
    else:
        assert (where(manager, ns, old), where(manager, ns, new)) == ("--NN", "NNN")


# ---- the per-block value ---------------------------------------------------------------------------
def test_a_shared_block_takes_the_strongest_live_retention(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock)
    keys = store(manager, mover, "a", ns, 1, 3)
    manager.planner.record_session("b", ns, keys[:2], 2 * BT)  # b's prompt is a's first two blocks
    retain = manager.table.index.col["retain"]
    rows = [manager.table.index.row_of(ns, key) for key in keys]
    manager.planner.retain("a", 100, 1)
    manager.planner.retain("b", 50, 5)
    assert retain[rows].tolist() == [6, 6, 2]  # priority + 1, the strongest among the holders
    clock.advance(60)  # b's hint is over: its blocks take a's
    manager.planner.expire()
    assert retain[rows].tolist() == [2, 2, 2]
    clock.advance(60)
    manager.planner.expire()
    assert retain[rows].tolist() == [0, 0, 0]


def test_a_retained_sessions_new_blocks_are_retained_too(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock, dram_blocks=16)
    keys = store(manager, mover, "agent", ns, 1, 2)
    manager.planner.retain("agent", 600, 2)
    longer = chain_block_hashes(list(range(10_000, 10_000 + 5 * BT)), BT)  # its next turn, three blocks more
    assert longer[:2] == keys
    manager.planner.record_session("agent", ns, longer, 5 * BT)
    mover.run(manager.prepare_store("agent", ns, longer, list(range(5))))
    assert [int(manager.table.index.col["retain"][manager.table.index.row_of(ns, k)]) for k in longer] == [3] * 5


def test_an_evicted_session_leaves_no_retention_behind(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock)
    keys = store(manager, mover, "a", ns, 1, 2)
    manager.planner.record_session("b", ns, keys, 2 * BT)  # shares both blocks: they stay when a goes
    manager.planner.retain("a", 600, 4)
    mover.run(manager.planner.evict("a", None))
    assert "a" not in manager.table.sessions
    assert [int(manager.table.index.col["retain"][manager.table.index.row_of(ns, k)]) for k in keys] == [0, 0]


# ---- timed pins ------------------------------------------------------------------------------------
def test_a_timed_pin_protects_until_it_ends_then_is_an_unpin(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock)
    pinned = store(manager, mover, "agent", ns, 1, 4)
    other = store(manager, mover, "chat", ns, 2, 4)
    mover.run(manager.planner.pin("agent", Tier.DRAM, for_s=1800))
    info = manager.views.session_info("agent")
    assert (info["pinned"], info["pin_expires_at"], info["pin_left_s"]) == ("dram", clock.now + 1800, 1800)
    clock.advance(1799)
    pressure(manager, mover)  # still pinned: only the other session's blocks may go
    assert (where(manager, ns, pinned), where(manager, ns, other)) == ("BBBB", "NNDD")
    assert manager.table.session("agent").pinned == Tier.DRAM
    assert not {manager.table.index.row_of(ns, k) for k in pinned} & set(manager.table.victims(Tier.DRAM).tolist())
    assert manager.views.session_info("agent")["pin_left_s"] == 1
    clock.advance(1)
    pressure(manager, mover)  # the pin ran out in this maintenance: unpinned, as `kvtier unpin` does
    agent = manager.table.session("agent")
    assert (agent.pinned, agent.pin_expires) == (None, None)
    assert manager.table.index.col["pin"][[manager.table.index.row_of(ns, k) for k in pinned]].tolist() == [0] * 4
    assert manager.telemetry.counters["pins_expired"] == 1 and "agent" in manager.catalog_log.dirty
    assert manager.views.session_info("agent")["pin_left_s"] is None
    victims = set(manager.table.victims(Tier.DRAM).tolist())  # its blocks may leave DRAM like any other
    assert {manager.table.index.row_of(ns, k) for k in pinned} <= victims


def test_pinning_again_without_a_time_limit_keeps_the_pin(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock)
    store(manager, mover, "agent", ns, 1, 2)
    mover.run(manager.planner.pin("agent", Tier.NVME, for_s=60))
    mover.run(manager.planner.pin("agent", Tier.NVME))
    clock.advance(3600)
    assert manager.planner.expire() == []
    assert manager.table.session("agent").pinned == Tier.NVME
    assert manager.views.session_info("agent")["pin_left_s"] is None


def test_an_unpinned_session_is_not_unpinned_again_when_its_old_time_comes(fingerprint, clock):
    manager, mover, ns = make(fingerprint, clock)
    store(manager, mover, "agent", ns, 1, 2)
    mover.run(manager.planner.pin("agent", Tier.NVME, for_s=60))
    manager.planner.unpin("agent")
    clock.advance(61)
    manager.planner.expire()
    assert manager.telemetry.counters["pins_expired"] == 0


@pytest.mark.parametrize("for_s", [0, -5, float("nan"), float("inf"), "30m"])
def test_a_pin_for_no_time_is_refused(fingerprint, clock, for_s):
    manager, mover, ns = make(fingerprint, clock)
    store(manager, mover, "agent", ns, 1, 2)
    with pytest.raises(UsageError, match="cannot pin for"):
        manager.planner.pin("agent", Tier.DRAM, for_s=for_s)
    assert manager.table.session("agent").pinned is None
