"""The asynchronous transfer protocol and tensor-parallel shards, without vLLM.

What vLLM's step path calls (store submission, load submission, finished transfers) must never
wait for a copy: a held copy thread proves it (the calls return while it cannot move), and the
mover counts every blocking wait made while ``step.active`` is set. Ranks: results merge only once
every rank reported; each rank's snapshot shard lives in its own file and restores only at the
tensor-parallel size it was taken at.
"""
from __future__ import annotations

import threading

import pytest
import torch
from support.realpath import need

from kvtier.engine import TierEngine
from kvtier.errors import ConfigError, FingerprintMismatchError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult, RankMerger
from kvtier.layout import KVGeometry, ModelFingerprint
from kvtier.plan.index import chain_block_hashes, namespace_of

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=16, dtype="bfloat16")
TOKENS = list(range(1000, 1064))  # four 16-token blocks
KEYS = chain_block_hashes(TOKENS, 16)  # as vLLM hashes them: a restore recomputes these from TOKENS


def kv_layers(seed: int, blocks: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, GEOMETRY.num_kv_heads, GEOMETRY.block_tokens, 2 * GEOMETRY.head_dim,
                        generator=g).to(torch.bfloat16) for _ in range(GEOMETRY.num_layers)]


def engine(tmp_path, name: str, layers, shards: int = 1, rank: int = 0) -> TierEngine:
    fingerprint = ModelFingerprint("tiny", GEOMETRY, shards=shards)
    return TierEngine(fingerprint, 1 << 20, tmp_path / name, 1 << 24, kv_layers=layers, catalog=False, rank=rank)


def held_copy_thread(eng: TierEngine) -> threading.Event:
    """Occupy the copy thread until the returned event is set (a slow link, a busy copy engine)."""
    hold = threading.Event()
    started = threading.Event()
    eng.mover.jobs.copy_pool.submit(lambda: (started.set(), hold.wait()))
    assert started.wait(5)
    return hold


def finish(eng: TierEngine) -> list[JobResult]:
    eng.mover.jobs.copy_pool.submit(lambda: None).result(10)  # everything queued before it is done
    results = eng.mover.jobs.poll()
    for result in results:
        eng.manager.complete(result)
    return results


def test_stores_are_queued_and_the_step_never_waits_for_them(tmp_path):
    layers = kv_layers(1)
    eng = engine(tmp_path, "a", layers)
    ns = namespace_of(eng.fingerprint.digest)
    eng.manager.planner.record_session("s", ns, KEYS, 64)
    job = eng.manager.prepare_store("s", ns, KEYS, [0, 1, 2, 3])
    hold = held_copy_thread(eng)
    eng.mover.stream.step.active = True
    try:
        eng.mover.jobs.submit_stores([job])  # returns although no copy can run
        assert eng.mover.jobs.in_flight([job.job_id]) == [job.job_id]
        assert eng.mover.jobs.poll() == []
    finally:
        eng.mover.stream.step.active = False
        hold.set()
    [result] = finish(eng)
    assert result.ok and eng.mover.stream.syncs == 0
    out = torch.empty((4, *GEOMETRY.block_shape), dtype=torch.bfloat16)
    assert eng.load(ns, KEYS, [4, 5, 6, 7]) == 4
    eng.mover.copies.adapter.gather(layers, [4, 5, 6, 7], out)
    ref = torch.empty_like(out)
    eng.mover.copies.adapter.gather(layers, [0, 1, 2, 3], ref)
    assert torch.equal(out, ref)  # stored then loaded bit for bit
    eng.close(write_back=False)


def test_a_read_of_a_slot_waits_for_its_store_on_a_mover_thread(tmp_path):
    layers = kv_layers(2)
    eng = engine(tmp_path, "a", layers)
    ns = namespace_of(eng.fingerprint.digest)
    eng.manager.planner.record_session("s", ns, KEYS[:1], 16)
    store = eng.manager.prepare_store("s", ns, KEYS[:1], [0])
    slot = store.moves[0].dram_slot
    hold = held_copy_thread(eng)
    eng.mover.stream.step.active = True
    eng.mover.jobs.submit_stores([store])
    # a load reading the same slot, submitted right after (the manager never plans one while the
    # store is pending; the fence makes the mover safe even if something did)
    load = Job(job_id=10_000, kind=JobKind.LOAD, moves=[BlockMove(row=-1, namespace=ns, key=KEYS[0], dram_slot=slot,
                                                                  nbytes=GEOMETRY.block_bytes, device_block=5)])
    loaded = eng.mover.jobs.submit(load)
    eng.mover.stream.step.active = False
    assert not loaded.done()  # waiting for the store's fence, on a mover thread
    hold.set()
    loaded.result(10)
    assert torch.equal(layers[0][5], layers[0][0]) and torch.equal(layers[1][5], layers[1][0])
    assert eng.mover.stream.syncs == 0
    eng.close(write_back=False)


def test_a_wait_on_the_step_path_is_counted(tmp_path):
    eng = engine(tmp_path, "a", kv_layers(3))
    ns = namespace_of(eng.fingerprint.digest)
    eng.manager.planner.record_session("s", ns, KEYS[:2], 32)
    job = eng.manager.prepare_store("s", ns, KEYS[:2], [0, 1])
    eng.mover.stream.step.active = True
    eng.manager.complete(eng.mover.jobs.run(job))  # synchronous mode: the step waits for the copy
    assert eng.mover.stream.syncs == 1
    job = eng.manager.prepare_store("s", ns, KEYS[2:4], [2, 3])
    hold = held_copy_thread(eng)
    eng.mover.jobs.submit_stores([job])
    threading.Timer(0.2, hold.set).start()
    assert eng.mover.jobs.wait_jobs([job.job_id]) == 1  # a preemption fence on a running store
    assert eng.mover.stream.syncs == 2
    eng.mover.stream.step.active = False
    finish(eng)
    eng.close(write_back=False)


def test_rank_results_merge_once_every_rank_reported():
    merger = RankMerger(2)
    first = JobResult(job_id=7, kind=JobKind.STORE, ok=True, rank=1, encoded={0: (100, "fp8"), 1: (90, "fp8")},
                      bytes_moved=190)
    assert merger.job(first) is None and merger.waiting == 1
    second = JobResult(job_id=7, kind=JobKind.STORE, ok=False, rank=0, failed=[1], error="disk",
                       encoded={0: (120, "fp8")}, bytes_moved=120)
    merged = merger.job(second)
    assert merged is not None and merger.waiting == 0
    assert (merged.ok, merged.failed, merged.error) == (False, [1], "disk")
    assert merged.encoded == {0: (120, "fp8"), 1: (90, "fp8")} and merged.bytes_moved == 310
    a, b = (b"n" * 16, b"k1"), (b"n" * 16, b"k2")
    wb0 = JobResult(job_id=-1, kind=JobKind.FLUSH, ok=True, rank=0, written_behind=[(*a, 10, "none"), (*b, 10, "none")])
    wb1 = JobResult(job_id=-1, kind=JobKind.FLUSH, ok=True, rank=1, written_behind=[(*a, 12, "none")])
    assert merger.written(wb0) == []  # durable only once every rank has its shard on disk
    assert merger.written(wb1) == [(*a, 12, "none")]
    assert RankMerger(1).job(first) is first


def test_each_rank_snapshots_its_own_shard_and_restores_only_at_its_tp_size(tmp_path):
    from kvtier.persist.snapshot import open_snapshot, shard_path

    ranks = [engine(tmp_path, f"r{r}", kv_layers(10 + r), shards=2, rank=r) for r in range(2)]
    ns = namespace_of(ranks[0].fingerprint.digest)
    path = tmp_path / "s.kvsnap"
    for eng in ranks:
        eng.store("s", ns, KEYS, [0, 1, 2, 3], num_tokens=64, token_ids=TOKENS)
        result = eng.snapshot("s", path)
        assert result.ok, result.error
    assert shard_path(path, 1, 2) == f"{path}.rank1"
    infos = [open_snapshot(shard_path(path, r, 2)) for r in range(2)]
    assert [i.fingerprint.rank for i in infos] == [0, 1] and infos[0].fingerprint.engine == infos[1].fingerprint.engine
    restored = [engine(tmp_path, f"q{r}", kv_layers(20 + r), shards=2, rank=r) for r in range(2)]
    for r, eng in enumerate(restored):
        result = eng.execute(eng.manager.planner.prepare_restore(open_snapshot(path)))
        assert result.ok, result.error
        assert eng.load(ns, KEYS, [4, 5, 6, 7]) == 4
        got, want = (torch.empty((4, *GEOMETRY.block_shape), dtype=torch.bfloat16) for _ in range(2))
        eng.mover.copies.adapter.gather(eng.mover.copies.kv_layers, [4, 5, 6, 7], got)
        ranks[r].mover.copies.adapter.gather(ranks[r].mover.copies.kv_layers, [0, 1, 2, 3], want)
        assert torch.equal(got, want)  # each rank got its own shard back
    single = engine(tmp_path, "one", kv_layers(30))
    with pytest.raises(FingerprintMismatchError, match="tensor-parallel"):
        single.manager.planner.prepare_restore(open_snapshot(path))
    for eng in [*ranks, *restored, single]:
        eng.close(write_back=False)


def test_a_sharded_snapshot_missing_a_rank_file_is_refused(tmp_path):
    import os

    from kvtier.persist.snapshot import open_snapshot

    eng = engine(tmp_path, "r0", kv_layers(40), shards=2, rank=0)
    ns = namespace_of(eng.fingerprint.digest)
    eng.store("s", ns, KEYS, [0, 1, 2, 3], num_tokens=64, token_ids=TOKENS)
    assert eng.snapshot("s", tmp_path / "s.kvsnap").ok
    assert not os.path.exists(f"{tmp_path / 's.kvsnap'}.rank1")
    fresh = engine(tmp_path, "f", kv_layers(41), shards=2, rank=0)
    with pytest.raises(FingerprintMismatchError, match="rank-1 shard"):
        fresh.manager.planner.prepare_restore(open_snapshot(tmp_path / "s.kvsnap"))
    eng.close(write_back=False)
    fresh.close(write_back=False)


def test_rank_files_live_apart_and_only_blocks_on_every_rank_count(tmp_path):
    from kvtier.tiers.nvme.store import NvmeStore, scan_shards, shard_dir

    assert shard_dir(tmp_path, 0, 1) == tmp_path
    assert shard_dir(tmp_path, 1, 2) == tmp_path / "tp2-rank1"
    ns, payload = b"n" * 16, torch.zeros(4096, dtype=torch.uint8)
    for rank, keys in ((0, KEYS[:3]), (1, KEYS[1:4])):
        store = NvmeStore(shard_dir(tmp_path, rank, 2), 1 << 24)
        for key in keys:
            store.write(ns, key, payload[: 1000 + rank], b"f" * 16, "none")
        store.close()
    records, removed = scan_shards(tmp_path, 1 << 24, 2)
    assert sorted(r.key for r in records) == KEYS[1:3] and removed == 0  # on both ranks only
    assert {r.nbytes for r in records} == {1001}  # the largest shard counts against the budget


def test_the_host_arena_is_exactly_its_budget_and_page_aligned():
    from kvtier.tiers.dram import PAGE, DramArena, host_buffer

    arena = DramArena(num_slots=3, slot_bytes=5 * PAGE)
    assert arena.buffer.numel() == 15 * PAGE and arena.buffer.data_ptr() % PAGE == 0  # no power-of-two rounding
    buf, pinned = host_buffer(10_000, pin=False)
    assert buf.numel() == 10_000 and not pinned and buf.data_ptr() % PAGE == 0


def _vllm_config(cache_dtype="auto", pp=1, mla=False, spec=None, groups=None):
    from types import SimpleNamespace

    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=1, rank=0),
        model_config=SimpleNamespace(use_mla=mla, model="m", hf_config=SimpleNamespace(model_type="gemma2")),
        speculative_config=spec,
    ), (SimpleNamespace(kv_cache_groups=groups) if groups is not None else None)


@pytest.mark.parametrize("case, match", [
    ({"cache_dtype": "fp8_inc"}, "cannot store the 'fp8_inc'"),
    ({"pp": 2}, "pipeline parallelism"),
    ({"mla": True}, "MLA"),
    ({"spec": object()}, "drafter"),
])
def test_unsupported_setups_are_refused_with_one_clear_error(case, match):
    from kvtier.plugins.vllm.geometry import check_supported

    with pytest.raises(ConfigError, match=match):
        check_supported(*_vllm_config(**case))
    check_supported(*_vllm_config(cache_dtype="fp8_e5m2"))  # supported


def test_hybrid_and_sliding_window_models_are_refused_by_name():
    need("vllm")
    from types import SimpleNamespace

    import torch as _torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtier.plugins.vllm.geometry import check_supported

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=_torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=_torch.bfloat16, sliding_window=128)
    check_supported(*_vllm_config(groups=[SimpleNamespace(kv_cache_spec=full)]))
    with pytest.raises(ConfigError, match="gemma2 has SlidingWindowSpec"):
        check_supported(*_vllm_config(groups=[SimpleNamespace(kv_cache_spec=full),
                                              SimpleNamespace(kv_cache_spec=window)]))
    with pytest.raises(ConfigError, match="hybrid"):
        check_supported(*_vllm_config(groups=[SimpleNamespace(kv_cache_spec=full)] * 2))


def test_cpu_tensor_parallel_ranks_get_their_own_cores():
    from kvtier.launch.serve import tensor_parallel_size, vllm_cpu_env

    assert tensor_parallel_size(["-tp", "2"]) == 2 and tensor_parallel_size(["--tensor-parallel-size=4"]) == 4
    env = vllm_cpu_env({}, ["-tp", "2"])
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    mine = vllm_cpu_env({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "VLLM_CPU_KVCACHE_SPACE": "8"}, ["-tp", "2"])
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3" and mine["VLLM_CPU_KVCACHE_SPACE"] == "8"  # the user's win


@pytest.mark.parametrize("args", [["--kv-cache-memory-bytes", "2147483648"], ["--kv-cache-memory-bytes=2G"],
                                  ["-tp", "2", "--kv-cache-memory-bytes", "1G"]])
def test_a_kv_cache_size_passed_to_vllm_is_not_overridden_by_kvtier_defaults(args):
    """vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE beat --kv-cache-memory-bytes: kvtier must not
    set the variable when the user sized the cache with the flag."""
    from kvtier.launch.serve import vllm_cpu_env

    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_cpu_env({}, args)
    assert vllm_cpu_env({}, [])["VLLM_CPU_KVCACHE_SPACE"] == "4"  # the default when nothing sizes it


def test_every_rank_checks_its_own_shard_is_signed(tmp_path):
    """The admin API checks the signature of rank 0's file; each rank's worker checks its own shard
    before reading it, so a swapped `.rank1` file is refused too."""
    import json
    import struct

    import xxhash

    from kvtier.persist.snapshot import open_snapshot, shard_path

    ranks = [engine(tmp_path, f"r{r}", kv_layers(50 + r), shards=2, rank=r) for r in range(2)]
    ns = namespace_of(ranks[0].fingerprint.digest)
    path = tmp_path / "s.kvsnap"
    for eng in ranks:
        eng.store("s", ns, KEYS, [0, 1, 2, 3], num_tokens=64, token_ids=TOKENS)
        assert eng.snapshot("s", path).ok
    rank1 = shard_path(path, 1, 2)  # tampered: a header field changed, its checksum redone, no key to sign
    data = bytearray(open(rank1, "rb").read())
    pre = struct.Struct("<8sHHQQQQ")
    magic, version, flags, header_len, _sum, offset, file_len = pre.unpack_from(data)
    doc = json.loads(bytes(data[64:64 + header_len]))
    doc["created"] = 1.0
    header = json.dumps(doc).encode().ljust(header_len, b" ")
    data[64:64 + header_len] = header
    data[0:64] = pre.pack(magic, version, flags, header_len, xxhash.xxh3_64_intdigest(header), offset,
                          file_len).ljust(64, b"\0")
    open(rank1, "wb").write(bytes(data))
    restored = [engine(tmp_path, f"q{r}", kv_layers(60 + r), shards=2, rank=r) for r in range(2)]
    results = [eng.execute(eng.manager.planner.prepare_restore(open_snapshot(path), require_signed=True))
               for eng in restored]
    assert results[0].ok and not results[1].ok
    assert "rank 1" in results[1].error and "not signed" in results[1].error
    refused = restored[1].manager  # its failed job gave back every slot and row it had planned
    assert refused.table.slots.free_slots == refused.table.slots.num_slots and refused.table.lookup(ns, KEYS) == []
    again = engine(tmp_path, "u1", kv_layers(70), shards=2, rank=1)  # the operator vouches: it restores
    assert again.execute(again.manager.planner.prepare_restore(open_snapshot(path), require_signed=False)).ok
    for eng in [*ranks, *restored, again]:
        eng.close(write_back=False)


class FlakyDisk:
    """A ``DiskStore`` in memory whose writes fail while ``broken`` is set."""

    name = "nvme"
    recreated = 0

    def __init__(self):
        self.blocks: dict[tuple[bytes, bytes], bytes] = {}
        self.broken = False

    def write_batch(self, blocks, fingerprint):
        if self.broken:
            return [OSError("read-only file system") for _ in blocks]
        for namespace, key, payload, _codec in blocks:
            self.blocks[(namespace, key)] = bytes(payload.numpy())
        return [None] * len(blocks)

    def has(self, namespace, key):
        return (namespace, key) in self.blocks

    def free_bytes(self):
        return 1 << 30

    def delete_many(self, names):
        return sum(self.blocks.pop(name, None) is not None for name in names)


def test_write_behind_skips_reused_slots_and_keeps_the_disks_health():
    from support.clock import FakeClock

    from kvtier.move.mover import Mover
    from kvtier.tiers.dram import DramArena

    clock, disk = FakeClock(), FlakyDisk()
    fingerprint = ModelFingerprint("tiny", GEOMETRY)
    mover = Mover(fingerprint, DramArena(4, GEOMETRY.block_bytes), disk, clock=clock)
    try:
        old, new = (BlockMove(row=i, namespace=b"ns", key=k, dram_slot=i, nbytes=64) for i, k in enumerate(KEYS[:2]))
        mover.ledger.own(old)
        mover.ledger.own(new)
        assert mover.ledger.due_count(5) == 0
        clock.advance(5)
        assert mover.ledger.due_count(5) == 2
        mover.ledger.forget([0])  # the manager freed slot 0: its block is never written behind
        disk.broken = True
        written, error = mover.behind.write_behind(5)
        assert written == [] and "read-only" in error
        assert mover.disk.failing and mover.disk.failed_within(1) and mover.ledger.due_count(5) == 1
        disk.broken = False
        clock.advance(60)
        written, error = mover.behind.write_behind(5)
        assert error is None and written == [(b"ns", KEYS[1], 64, "none")]
        assert not mover.disk.failing and not mover.disk.failed_within(35)
        assert list(disk.blocks) == [(b"ns", KEYS[1])] and mover.ledger.dirty == {}
        assert mover.links.counts["dram->nvme"] == 64
    finally:
        mover.close()
