"""The scheduler half alone: ``TierManager`` plans jobs and applies their results, here against a
fake mover that moves no bytes and reports exactly what a real one would (success, a failed
position, a bad NVMe read). What is under test is the manager's bookkeeping: which rows exist, in
which tier, which slots and NVMe bytes are taken, after every kind of job and failure. (The real
mover runs the same jobs against real tensors and files in test_manager.py and test_nvme.py.)"""
from __future__ import annotations

import numpy as np
import pytest
from support.fakes import FakeMover

from kvtier.jobs import JobKind
from kvtier.plan.index import IN_DRAM, IN_NVME, PENDING, Tier, chain_block_hashes, namespace_of
from kvtier.plan.manager import TierManager
from kvtier.tiers.nvme.store import file_bytes_for


@pytest.fixture
def planned(fingerprint):
    block = fingerprint.geometry.block_bytes
    manager = TierManager(fingerprint, dram_bytes=8 * block, nvme_bytes=16 * file_bytes_for(block))
    return manager, FakeMover(manager), namespace_of(fingerprint.digest)


def state(manager: TierManager, namespace: bytes, keys) -> list[str]:
    """Per key: the tiers holding it ("dram", "nvme", "dram+nvme"), "pending" or "-"."""
    out = []
    for key in keys:
        row = manager.table.index.row_of(namespace, key)
        if row is None:
            out.append("-")
            continue
        flags = int(manager.table.index.col["flags"][row])
        tiers = "+".join(name for bit, name in ((IN_DRAM, "dram"), (IN_NVME, "nvme")) if flags & bit)
        out.append("pending" if flags & PENDING else tiers)
    return out


def test_a_store_is_pending_until_its_result_then_in_dram(planned):
    manager, mover, ns = planned
    keys = chain_block_hashes(list(range(64)), 16)
    job = manager.prepare_store("s", ns, keys, [0, 1, 2, 3])
    assert state(manager, ns, keys) == ["pending"] * 4 and manager.table.lookup(ns, keys) == []
    assert manager.table.slots.used_slots == 4
    mover.run(job)
    assert state(manager, ns, keys) == ["dram"] * 4 and len(manager.table.lookup(ns, keys)) == 4
    assert manager.table.index.dirty_rows().size == 4  # no NVMe copy yet


def test_a_failed_store_leaves_nothing_behind(planned):
    manager, mover, ns = planned
    keys = chain_block_hashes(list(range(64)), 16)
    mover.fail = {2}
    mover.run(manager.prepare_store("s", ns, keys, [0, 1, 2, 3]))
    assert state(manager, ns, keys) == ["dram", "dram", "-", "dram"]
    assert manager.table.slots.used_slots == 3  # the failed block's slot is free again


def test_demotion_then_a_bad_nvme_read_forgets_the_block_and_frees_its_bytes(planned):
    manager, mover, ns = planned
    keys = chain_block_hashes(list(range(64)), 16)
    mover.run(manager.prepare_store("s", ns, keys, [0, 1, 2, 3]))
    manager.planner.record_session("s", ns, keys, 64)
    mover.run(manager.planner.evict("s", Tier.NVME))
    assert state(manager, ns, keys) == ["nvme"] * 4 and manager.table.slots.used_slots == 0
    used = manager.table.nvme.used
    assert used == 4 * file_bytes_for(manager.geometry.block_bytes)
    rows = manager.table.lookup(ns, keys)
    mover.bad_reads = {1}
    mover.run(manager.prepare_load(rows, [10, 11, 12, 13]))
    assert state(manager, ns, keys)[1] == "-"  # the damaged block is forgotten, not served again
    assert manager.table.nvme.used == used - file_bytes_for(manager.geometry.block_bytes)
    assert manager.telemetry.counters["nvme_failed_reads"] == 1 and "nvme_reads" in manager.telemetry.warnings
    assert int(manager.table.index.col["refs"][rows[0]]) == 0  # the load's references are given back


def test_a_fetch_is_planned_like_a_restore_and_a_miss_leaves_no_row(planned):
    manager, mover, ns = planned
    keys = chain_block_hashes(list(range(64)), 16)
    size = manager.geometry.block_bytes
    job = manager.planner.prepare_fetch(ns, keys, [size] * 4, start=0, session_id="s")
    assert job.kind == JobKind.FETCH and all(m.from_shared for m in job.moves)
    assert state(manager, ns, keys) == ["pending"] * 4
    mover.fail = {3}  # evicted from the store between the lookup and the fetch
    mover.run(job)
    assert state(manager, ns, keys) == ["dram", "dram", "dram", "-"]
    assert manager.telemetry.counters["fetched_blocks"] == 3 and manager.table.slots.used_slots == 3


def test_pressure_demotes_down_to_the_low_watermark(planned):
    manager, mover, ns = planned
    keys = chain_block_hashes(list(range(8 * 16)), 16)
    mover.run(manager.prepare_store("s", ns, keys, list(range(8))))
    assert manager.table.slots.used_slots == 8  # past the high watermark (0.9 of 8 slots)
    for job in manager.maintenance():
        mover.run(job)
    assert manager.table.slots.used_slots == int(manager.pressure.low * manager.table.slots.num_slots)
    tiers = state(manager, ns, keys)
    assert tiers.count("nvme") == 8 - manager.table.slots.used_slots and "-" not in tiers


def test_named_transitions_keep_flags_and_columns_together(planned):
    manager, _mover, ns = planned
    index = manager.table.index
    row = index.add(ns, b"k" * 32, PENDING | IN_DRAM, dram_slot=5, reach=128)
    assert (int(index.col["dram_slot"][row]), int(index.col["reach"][row])) == (5, 128)
    index.settled(row)
    index.now_in_dram(row, 5, 100, "fp8", dirty=True)
    index.now_in_nvme(row, 90, "int4")
    assert int(index.col["flags"][row]) == IN_DRAM | IN_NVME
    assert index.codecs[index.col["dram_codec"][row]] == "fp8" and index.codecs[index.col["nvme_codec"][row]] == "int4"
    assert index.left_dram(row) == 5 and int(index.col["dram_slot"][row]) == -1
    assert index.left_nvme(row) == 90 and int(index.col["flags"][row]) == 0
    index.pin_at_least(row, Tier.NVME)
    index.pin_at_least(row, Tier.DRAM)
    index.pin_at_least(row, Tier.NVME)
    assert int(index.col["pin"][row]) == Tier.DRAM  # the hottest pin wins
    index.abandon(row)
    assert index.row_of(ns, b"k" * 32) is None and np.all(index.col["flags"][row] == 0)
