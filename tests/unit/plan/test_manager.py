"""Scripted scenarios for the index, sessions, pins, policies and watermarks (no vLLM).

Each scenario drives a real TierEngine (manager + mover + DRAM arena + NVMe files on disk) over
vLLM-layout CPU tensors standing in for HBM, parametrized over the eviction policies.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from support.engine import make_engine

from kvtier.errors import CapacityError, NotFoundError, UsageError
from kvtier.layout import KVGeometry, ModelFingerprint
from kvtier.plan.index import IN_DRAM, IN_NVME, Tier, chain_block_hashes, namespace_of

POLICIES = ["lru", "arc"]


def session_keys(seed: int, blocks: int, block_tokens: int = 16) -> list[bytes]:
    return chain_block_hashes(list(range(seed * 10_000, seed * 10_000 + blocks * block_tokens)), block_tokens)


def where(engine, ns, keys):
    """Tier flags of each key: 'D' DRAM, 'N' NVMe, 'DN' both, '-' absent."""
    out = []
    for key in keys:
        row = engine.manager.table.index.row_of(ns, key)
        flags = 0 if row is None else engine.manager.table.index.col["flags"][row]
        out.append(("D" if flags & IN_DRAM else "") + ("N" if flags & IN_NVME else "") or "-")
    return out


def blocks_equal(hbm, dst_ids, src_snapshot, src_ids) -> bool:
    return all(torch.equal(layer[dst_ids], ref[src_ids]) for layer, ref in zip(hbm, src_snapshot))


@pytest.fixture(params=POLICIES)
def policy(request):
    return request.param


def test_store_lookup_load_roundtrip(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, policy=policy)
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(1, 4)
    # 1. store four blocks of HBM blocks 0..3
    assert engine.store("s1", ns, keys, [0, 1, 2, 3]) == 4
    # 2. a lookup finds the whole prefix; a longer prompt finds only the stored part
    assert len(engine.manager.table.lookup(ns, keys)) == 4
    assert len(engine.manager.table.lookup(ns, keys + session_keys(9, 2))) == 4
    # 3. loading into other HBM blocks reproduces the data bit for bit
    reference = [layer.clone() for layer in hbm]
    assert engine.load(ns, keys, [10, 11, 12, 13]) == 4
    assert blocks_equal(hbm, [10, 11, 12, 13], reference, [0, 1, 2, 3])
    # 4. storing the same prefix again moves nothing
    assert engine.store("s1", ns, keys, [0, 1, 2, 3]) == 0


def test_namespaces_isolate_models_and_tenants(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, policy=policy)
    keys = session_keys(1, 3)
    engine.store("s1", namespace_of(fingerprint.digest, "tenant-a"), keys, [0, 1, 2])
    # the same block hashes under another tenant's salt or another model never match
    assert engine.manager.table.lookup(namespace_of(fingerprint.digest, "tenant-b"), keys) == []
    other = ModelFingerprint("other-model", fingerprint.geometry)
    assert engine.manager.table.lookup(namespace_of(other.digest, "tenant-a"), keys) == []
    assert len(engine.manager.table.lookup(namespace_of(fingerprint.digest, "tenant-a"), keys)) == 3


def test_watermarks_demote_least_recent_first(fingerprint, hbm, tmp_path, policy):
    # DRAM of 8 blocks, high 0.9 (7.2 blocks), low 0.75 (6 blocks)
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, policy=policy)
    ns = namespace_of(fingerprint.digest)
    old, new = session_keys(1, 4), session_keys(2, 4)
    engine.store("old", ns, old, [0, 1, 2, 3])
    assert where(engine, ns, old) == ["D"] * 4  # 4/8 used: below the high watermark
    engine.store("new", ns, new, [4, 5, 6, 7])
    # 8/8 > high: demoted down to 6, the two least recent blocks went to NVMe
    assert engine.manager.table.slots.used_slots == 6
    assert where(engine, ns, old) == ["N", "N", "D", "D"]
    assert where(engine, ns, new) == ["D"] * 4
    # demoted blocks still load, bit-identical
    reference = [layer.clone() for layer in hbm]
    assert engine.load(ns, old, [20, 21, 22, 23]) == 4
    assert blocks_equal(hbm, [20, 21, 22, 23], reference, [0, 1, 2, 3])


def test_dram_never_exceeds_budget_under_churn(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=6, nvme_blocks=20, policy=policy)
    ns = namespace_of(fingerprint.digest)
    rng = np.random.default_rng(0)
    for turn in range(40):
        keys = session_keys(int(rng.integers(0, 12)), int(rng.integers(1, 6)))
        engine.store(f"s{turn % 12}", ns, keys, list(range(len(keys))))
        if rng.random() < 0.3:
            engine.load(ns, keys, list(range(32, 32 + len(keys))))
        assert engine.manager.table.slots.used_bytes <= engine.manager.table.slots.capacity_bytes
        assert engine.nvme.used_bytes <= engine.nvme.capacity_bytes
        assert engine.manager.views.stats()["nvme"]["used_bytes"] == engine.nvme.used_bytes
    assert engine.manager.telemetry.counters["nvme_dropped_blocks"] > 0  # NVMe pressure really happened


def test_pinned_session_stays_in_dram_and_is_never_dropped(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, nvme_blocks=8, policy=policy)
    ns = namespace_of(fingerprint.digest)
    pinned = session_keys(1, 3)
    engine.store("agent", ns, pinned, [0, 1, 2])
    engine.pin("agent", Tier.DRAM)
    # heavy traffic from other sessions
    for s in range(2, 10):
        engine.store(f"s{s}", ns, session_keys(s, 3), [3, 4, 5])
    # still in DRAM, and durable: a pinned session is written through to NVMe too
    assert where(engine, ns, pinned) == ["DN"] * 3
    assert engine.manager.views.session_info("agent")["state"] == "pinned"
    # unpinned, it can be demoted like any other
    engine.unpin("agent")
    engine.evict("agent", Tier.NVME)
    assert where(engine, ns, pinned) == ["N"] * 3


def test_pin_to_nvme_survives_nvme_pressure(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=4, nvme_blocks=6, policy=policy)
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(1, 2)
    engine.store("keep", ns, keys, [0, 1])
    engine.pin("keep", Tier.NVME)
    # pinned sessions refuse eviction
    with pytest.raises(UsageError, match="pinned"):
        engine.evict("keep", Tier.NVME)
    for s in range(2, 14):
        engine.store(f"s{s}", ns, session_keys(s, 2), [2, 3])
    assert all(w != "-" for w in where(engine, ns, keys))
    assert engine.manager.telemetry.counters["nvme_dropped_blocks"] > 0


def test_pin_to_dram_promotes_cold_blocks(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, policy=policy)
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(1, 3)
    engine.store("s1", ns, keys, [0, 1, 2])
    engine.evict("s1", Tier.NVME)
    assert where(engine, ns, keys) == ["N"] * 3
    engine.pin("s1", Tier.DRAM)
    assert where(engine, ns, keys) == ["DN"] * 3
    # a pin larger than DRAM can ever hold is refused up front
    big = session_keys(2, 12)
    engine.store("big", ns, big[:6], list(range(6)))
    engine.manager.planner.record_session("big", ns, big, 12 * 16)
    for i in range(6, 12):
        engine.store("big", ns, big[: i + 1], list(range(i + 1)))
    with pytest.raises(CapacityError):
        engine.pin("big", Tier.DRAM)


def test_evict_drop_forgets_session_but_keeps_shared_prefix(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, policy=policy)
    ns = namespace_of(fingerprint.digest)
    shared = session_keys(1, 4)
    engine.store("a", ns, shared[:2], [0, 1])  # b extends a's prefix
    engine.store("b", ns, shared, [0, 1, 2, 3])
    engine.evict("b", None)
    assert where(engine, ns, shared) == ["D", "D", "-", "-"]
    with pytest.raises(NotFoundError):
        engine.manager.views.session_info("b")


def test_blocks_in_flight_are_never_victims(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, policy=policy)
    manager = engine.manager
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(1, 8)
    engine.store("s", ns, keys[:6], list(range(6)))
    # prepare a load but do not complete it: its blocks hold a reference
    rows = manager.table.lookup(ns, keys[:6])
    load = manager.prepare_load(rows, list(range(40, 46)))
    assert set(manager.table.index.candidates(Tier.DRAM).tolist()).isdisjoint(rows)
    assert manager.maintenance(force=True) == []  # nothing may move
    # once the load completes they become candidates again
    engine.execute(load)
    assert set(rows) <= set(manager.table.index.candidates(Tier.DRAM).tolist())


def test_pending_store_is_invisible_and_failed_store_rolls_back(fingerprint, hbm, tmp_path, policy):
    from kvtier.jobs import JobResult

    engine = make_engine(fingerprint, hbm, tmp_path, policy=policy)
    manager = engine.manager
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(1, 3)
    job = manager.prepare_store("s", ns, keys, [0, 1, 2])
    assert manager.table.lookup(ns, keys) == []  # not yet stored
    free_before = manager.table.slots.free_slots
    manager.complete(JobResult(job.job_id, job.kind, ok=False, failed=[1, 2], error="boom"))
    assert len(manager.table.lookup(ns, keys)) == 1  # block 0 landed, 1 and 2 rolled back
    assert manager.table.slots.free_slots == free_before + 2


def test_cold_tier_survives_restart(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, policy=policy)
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(1, 4)
    engine.store("s", ns, keys, [0, 1, 2, 3])
    engine.evict("s", Tier.NVME)
    reference = [layer.clone() for layer in hbm]
    engine.close()
    # a new process: the index is rebuilt from the NVMe directory
    restarted = make_engine(fingerprint, hbm, tmp_path, policy=policy)
    assert len(restarted.manager.table.lookup(ns, keys)) == 4
    assert restarted.load(ns, keys, [30, 31, 32, 33]) == 4
    assert blocks_equal(hbm, [30, 31, 32, 33], reference, [0, 1, 2, 3])
    restarted.close()
    # another model on the same directory sees none of it
    other = ModelFingerprint("other", fingerprint.geometry)
    stranger = make_engine(other, hbm, tmp_path, policy=policy)
    assert stranger.manager.table.lookup(namespace_of(other.digest), keys) == []
    stranger.close()


def test_corrupt_nvme_block_loads_prefix_only(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, policy=policy)
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(1, 4)
    engine.store("s", ns, keys, [0, 1, 2, 3])
    engine.evict("s", Tier.NVME)
    # flip one payload bit of the third block on disk
    path, offset, size = engine.nvme.locate(ns, keys[2])
    with open(path, "r+b") as f:
        byte = os.pread(f.fileno(), 1, offset + 5000)
        os.pwrite(f.fileno(), bytes([byte[0] ^ 0x10]), offset + 5000)
    # the load stops before the bad block; it is counted, dropped, and never served
    assert engine.load(ns, keys, [40, 41, 42, 43]) == 2
    assert engine.manager.telemetry.counters["nvme_failed_reads"] == 1
    assert where(engine, ns, keys)[2] == "-"
    with open(path, "rb") as f:  # its record is punched out of the segment
        assert os.pread(f.fileno(), size, offset) == bytes(size)


def test_a_load_read_in_parts_copies_each_part_and_stops_at_a_bad_block(fingerprint, hbm, tmp_path, monkeypatch):
    """A long load is read and copied part by part (on a GPU the copy of one part overlaps the read of
    the next); the KV is exact, and a bad block in a later part stops the load there."""
    import kvtier.move.device as device

    block_bytes = fingerprint.geometry.block_bytes
    monkeypatch.setattr(device, "PIPELINE_BYTES", 2 * block_bytes)  # two blocks per part
    engine = make_engine(fingerprint, hbm, tmp_path)
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(3, 7)
    engine.store("s", ns, keys, list(range(7)))
    before = [layer.clone() for layer in hbm]
    engine.evict("s", Tier.NVME)
    assert engine.load(ns, keys, list(range(40, 47))) == 7
    assert blocks_equal(hbm, list(range(40, 47)), before, list(range(7)))
    engine.evict("s", Tier.NVME)
    path, offset, _size = engine.nvme.locate(ns, keys[5])  # in the third part
    with open(path, "r+b") as f:
        byte = os.pread(f.fileno(), 1, offset + 5000)
        os.pwrite(f.fileno(), bytes([byte[0] ^ 0x10]), offset + 5000)
    assert engine.load(ns, keys, list(range(50, 57))) == 5
    assert blocks_equal(hbm, list(range(50, 55)), before, list(range(5)))
    engine.close()


def test_arc_ghost_hit_grows_recency_target():
    from kvtier.plan.index import BlockIndex
    from kvtier.plan.policy import ARCPolicy

    index = BlockIndex()
    arc = ARCPolicy(capacity_blocks=4)
    ns = b"n" * 16
    row = index.add(ns, b"k1", IN_DRAM)
    arc.on_insert(row, (ns, b"k1"))
    arc.on_remove(row, (ns, b"k1"), evicted=True)  # k1 goes to ghost list B1
    assert arc.p == 0
    row = index.add(ns, b"k1x", IN_DRAM)
    arc.on_insert(row, (ns, b"k1"))  # k1 comes back: T1 should have been bigger
    assert arc.p > 0


def test_arc_prefers_evicting_blocks_seen_once(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, policy="arc")
    ns = namespace_of(fingerprint.digest)
    hot, scan = session_keys(1, 3), session_keys(2, 4)
    engine.store("hot", ns, hot, [0, 1, 2])
    engine.manager.table.lookup(ns, hot)  # seen twice: T2
    engine.store("scan", ns, scan, [3, 4, 5, 6])
    engine.store("scan2", ns, session_keys(3, 1), [7])
    # LRU would evict the hot session's blocks first (least recent); ARC evicts the scan
    assert where(engine, ns, hot) == ["D"] * 3


def test_bad_session_ids_are_refused(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path)
    ns = namespace_of(fingerprint.digest)
    for bad in ["../etc/passwd", "", "a/b", "x" * 200, "-rf", "nul\0"]:
        with pytest.raises(UsageError) as info:
            engine.store(bad, ns, session_keys(1, 1), [0])
        assert info.value.hint


def test_geometry_mismatch_is_refused(tmp_path):
    with pytest.raises(UsageError):
        KVGeometry(num_layers=0, num_kv_heads=1, head_dim=1, block_tokens=1)


def test_index_memory_accounting_matches_tracemalloc():
    import gc
    import hashlib
    import tracemalloc

    from kvtier.plan.index import BlockIndex

    n = 20_000
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    for i in range(n):
        index.add(b"n" * 16, hashlib.sha256(i.to_bytes(8, "little")).digest(), IN_DRAM)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert abs(index.memory_bytes() - traced) / traced < 0.15
    assert index.memory_bytes() / n < 256


def test_clean_shutdown_writes_dram_only_blocks_back(fingerprint, hbm, tmp_path, policy):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, policy=policy)
    ns = namespace_of(fingerprint.digest)
    kept, dropped = session_keys(1, 4), session_keys(2, 2)
    engine.store("kept", ns, kept, [0, 1, 2, 3])
    engine.store("dropped", ns, dropped, [4, 5])
    engine.evict("dropped", None)  # the operator dropped it: it must stay dropped
    assert where(engine, ns, kept) == ["D"] * 4  # DRAM only, nothing on disk yet
    reference = [layer.clone() for layer in hbm]
    engine.close()
    restarted = make_engine(fingerprint, hbm, tmp_path, policy=policy)
    assert where(restarted, ns, kept) == ["N"] * 4
    assert restarted.manager.table.lookup(ns, dropped) == []
    assert restarted.load(ns, kept, [30, 31, 32, 33]) == 4
    assert blocks_equal(hbm, [30, 31, 32, 33], reference, [0, 1, 2, 3])


def test_write_back_stops_quietly_when_nvme_is_full(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, nvme_blocks=2)
    ns = namespace_of(fingerprint.digest)
    keys = session_keys(3, 5)
    engine.store("s", ns, keys, [0, 1, 2, 3, 4])
    engine.close()  # room for 2 of the 5 blocks: those are written, no error
    restarted = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, nvme_blocks=2)
    assert sum(flag == "N" for flag in where(restarted, ns, keys)) == 2


def test_cached_session_rows_and_state_counts_follow_churn(fingerprint, hbm, tmp_path, policy):
    """session_row_array is cached across calls; through stores, demotions, drops, pins and re-stores
    it must always equal a fresh key -> row walk, and session_state_counts the per-row states."""
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=12, nvme_blocks=20, policy=policy)
    manager = engine.manager
    ns = namespace_of(fingerprint.digest)
    rng = np.random.default_rng(7)
    keys = {f"s{n}": session_keys(n, 6) for n in range(8)}

    def check():
        for session in manager.table.sessions.values():
            fresh = [r for r in (manager.table.index.row_of(ns, k) for k in session.keys) if r is not None]
            assert manager.table.session_row_array(session).tolist() == fresh, session.session_id
        states = [row["state"] for row in manager.views.sessions_overview()]
        counts = manager.views.session_state_counts()
        assert counts == {s: states.count(s) for s in counts} and sum(counts.values()) == len(states)

    for step in range(120):
        name = f"s{rng.integers(8)}"
        action = rng.integers(6)
        if action <= 2:  # (re)store a prefix of the session, sometimes longer than before
            n = int(rng.integers(1, 7))
            engine.store(name, ns, keys[name][:n], list(range(n)))
        elif name in manager.table.sessions and action == 3 and manager.table.sessions[name].pinned is None:
            engine.evict(name, [None, Tier.NVME][int(rng.integers(2))])
        elif name in manager.table.sessions and action == 4:
            job = manager.planner.pin(name, Tier.NVME) if rng.integers(2) else manager.planner.unpin(name)
            if job is not None:
                engine.execute(job)
        elif name in manager.table.sessions:
            manager.table.sessions[name].hot = bool(rng.integers(2))
        check()
    assert manager.table.index.removed > 0 and len(manager.table.sessions) > 0  # the churn did remove rows
