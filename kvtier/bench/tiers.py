"""``kvtier bench tiers``: the tier engine against same-process references.

Every speed figure is a ratio, measured throughput / reference throughput, from interleaved
repetitions in one process (these machines are shared and noisy; absolute numbers are printed for
context only):

* DRAM put / get of 2 MiB blocks vs a torch copy of the same bytes between plain tensors;
* NVMe tier write (group commits) / verified read (one batch) of 64 KiB and of 2 MiB blocks vs raw
  sequential O_DIRECT IO of the same bytes in 8 MiB requests on the same filesystem (page cache
  excluded on both sides), and the files it takes per GiB of 64 KiB blocks;
* snapshot write / verified read of one session vs raw direct IO in the snapshot's own 32 MiB IOs
  (the read: median of 5 or more rounds);
* a 1024-block prefix lookup (ms), and index memory per block at 1M blocks (``BlockIndex.memory_bytes``,
  checked against tracemalloc by the tests).
"""
from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

# the raw direct IO reference lives with the tiers (the cost model measures disks with it too)
from kvtier.bench.checks import require
from kvtier.tiers.nvme.rawio import RawDirectIO, drop_page_cache  # noqa: F401 - the benchmarks import them from here

__all__ = ["run_tiers_bench", "TIERS_KEYS"]

TIERS_KEYS = (
    "dram_put_vs_memcpy",
    "dram_get_vs_memcpy",
    "nvme_write_vs_raw_64k",
    "nvme_read_vs_raw_64k",
    "nvme_write_vs_raw_2m",
    "nvme_read_vs_raw_2m",
    "files_per_gib_64k",
    "snapshot_write_vs_raw",
    "snapshot_read_vs_raw",
    "lookup_1024_blocks_ms",
    "index_bytes_per_block",
)
BLOCK = 2 << 20


def _paired_ratio(reference: Callable[[], float], measured: Callable[[], float], reps: int,
                  second: Callable[[], float] | None = None) -> tuple[float, dict]:
    """Median over interleaved repetitions (alternating order) of reference_seconds / measured_seconds.

    ``second`` is an optional second reference, run in the same rounds; its ratio is returned as
    ``detail["second_ratio"]``.
    """
    ratios, ref_s, got_s, second_ratios = [], [], [], []
    for rep in range(reps):
        # Alternate which side runs first (ABBA): caches below the filesystem (a VM host's page
        # cache, an SSD's DRAM) favour whatever was written last, and neither side may always win.
        if rep % 2 == 0:
            r = reference()
            m = measured()
        else:
            m = measured()
            r = reference()
        ref_s.append(r)
        got_s.append(m)
        ratios.append(r / m)
        if second is not None:
            second_ratios.append(second() / m)
    detail = {"reference_s": statistics.median(ref_s), "measured_s": statistics.median(got_s)}
    if second_ratios:
        detail["second_ratio"] = statistics.median(second_ratios)
    return statistics.median(ratios), detail


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- DRAM ---------------------------------------------------------------------------------------
def bench_dram(blocks: int, reps: int) -> dict:
    import torch

    from kvtier.tiers.dram import DramArena

    arena = DramArena(blocks, BLOCK)
    src = torch.randint(0, 255, (blocks, BLOCK), dtype=torch.uint8)
    plain = torch.empty_like(src)
    out = torch.empty_like(src)

    def memcpy_in():
        return _timed(lambda: [plain[i].copy_(src[i]) for i in range(blocks)])

    def put():
        return _timed(lambda: [arena.put(i, src[i]) for i in range(blocks)])

    def memcpy_out():
        return _timed(lambda: [out[i].copy_(plain[i]) for i in range(blocks)])

    def get():
        return _timed(lambda: [arena.get(i, out[i]) for i in range(blocks)])

    put_ratio, put_detail = _paired_ratio(memcpy_in, put, reps)
    get_ratio, get_detail = _paired_ratio(memcpy_out, get, reps)
    require(torch.equal(out, src), "the DRAM tier returned different bytes")
    gib = blocks * BLOCK / 2**30
    return {
        "dram_put_vs_memcpy": put_ratio,
        "dram_get_vs_memcpy": get_ratio,
        "_dram_put_gib_s": gib / put_detail["measured_s"],
        "_memcpy_gib_s": gib / put_detail["reference_s"],
        "_dram_get_gib_s": gib / get_detail["measured_s"],
    }


# ---- NVMe tier ----------------------------------------------------------------------------------
NVME_SIZES = {"64k": 64 << 10, "2m": 2 << 20}  # a 0.5B model's GPU block at TP=4, and Llama-3-8B's
WRITE_BATCH = 64 << 20  # payload bytes per write_batch: one group commit (a demotion job's worth)


def bench_nvme(directory: Path, total_bytes: int, reps: int, io_threads: int = 8, sizes: dict | None = None) -> dict:
    """The segment store against raw sequential O_DIRECT IO of the same bytes in 8 MiB requests,
    per block size: writes as group commits of ``WRITE_BATCH`` (durable when each returns), a
    verified read of everything as one batch (a session's load). Blocks come from DRAM-arena slots
    and land in them, as in serving."""
    import torch

    from kvtier.tiers.dram import DramArena
    from kvtier.tiers.nvme.store import NvmeStore

    fingerprint, namespace = b"f" * 16, b"n" * 16
    raw = RawDirectIO(directory, total_bytes, chunk=8 << 20)
    results: dict = {}
    try:
        for label, block in (sizes or NVME_SIZES).items():
            blocks = total_bytes // block
            arena = DramArena(blocks, block)
            arena.buffer.copy_(torch.randint(0, 255, (arena.buffer.numel(),), dtype=torch.uint8))
            keys = [i.to_bytes(8, "little") for i in range(blocks)]
            per_batch = max(1, WRITE_BATCH // block)
            root = directory / f"tier-{label}"
            store = NvmeStore(root, capacity_bytes=4 * total_bytes + (64 << 20), io_threads=io_threads)

            def write_tier_timed(store=store, keys=keys, arena=arena, per_batch=per_batch, block=block):
                store.delete_many([(namespace, k) for k in keys])
                start = time.perf_counter()
                for first in range(0, len(keys), per_batch):
                    outcomes = store.write_batch([(namespace, k, arena.slot(first + i, block), "none")
                                                  for i, k in enumerate(keys[first : first + per_batch])],
                                                 fingerprint)
                    require(all(isinstance(o, int) for o in outcomes), f"an NVMe write failed: {outcomes[:1]}")
                return time.perf_counter() - start

            def read_tier_timed(store=store, keys=keys, arena=arena):
                drop_page_cache(root)
                start = time.perf_counter()
                outcomes = store.read_batch([(namespace, k, arena.slot(i)) for i, k in enumerate(keys)], fingerprint)
                require(all(isinstance(o, tuple) for o in outcomes), f"an NVMe read failed its checks: {outcomes[:1]}")
                return time.perf_counter() - start

            try:
                write_ratio, write_detail = _paired_ratio(raw.write, write_tier_timed, reps)
                read_ratio, read_detail = _paired_ratio(raw.read, read_tier_timed, reps)
                gib = total_bytes / 2**30
                results.update({
                    f"nvme_write_vs_raw_{label}": write_ratio,
                    f"nvme_read_vs_raw_{label}": read_ratio,
                    f"_nvme_write_gib_s_{label}": gib / write_detail["measured_s"],
                    f"_nvme_read_gib_s_{label}": gib / read_detail["measured_s"],
                    f"_raw_write_gib_s_{label}": gib / write_detail["reference_s"],
                    f"_raw_read_gib_s_{label}": gib / read_detail["reference_s"],
                    f"_io_counts_{label}": dict(store.io_counts),
                })
                if label == "64k":  # files holding blocks, per GiB of blocks (one file per block: 16384)
                    results["files_per_gib_64k"] = store.files() / gib
                    results["_disk_bytes_per_payload_byte_64k"] = store.disk_bytes() / total_bytes
            finally:
                store.close()
                shutil.rmtree(root, ignore_errors=True)
                del arena
        results["_direct_io"] = bool(raw.direct)
    finally:
        raw.close()
    return results


# ---- snapshots ----------------------------------------------------------------------------------
def bench_snapshot(directory: Path, session_bytes: int, reps: int) -> dict:
    from kvtier.layout import KVGeometry, ModelFingerprint
    from kvtier.persist.snapshot import IO_CHUNK, verify_snapshot, write_snapshot

    blocks = session_bytes // BLOCK
    geometry = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)  # 2 MiB blocks
    fingerprint = ModelFingerprint("bench", geometry)
    payload = mmap.mmap(-1, BLOCK)
    payload.write(os.urandom(BLOCK))
    keys = [i.to_bytes(32, "little") for i in range(blocks)]
    raw = RawDirectIO(directory, blocks * BLOCK, chunk=IO_CHUNK)  # the snapshot's own IO size
    path = directory / "session.kvsnap"

    def write():
        path.unlink(missing_ok=True)
        return _timed(lambda: write_snapshot(path, fingerprint, "bench", b"n" * 16, codec="none",
                                             num_tokens=blocks * 16, keys=keys, payloads=(payload for _ in keys),
                                             block_nbytes=[BLOCK] * blocks))

    def read():
        drop_page_cache(path)
        return _timed(lambda: verify_snapshot(path, fingerprint))

    # Each round writes both files, then reads both back in the same order (alternating between
    # rounds), so each read sits at the same distance from its own write: caches below the
    # filesystem then favour neither side.
    write_ratios, read_ratios, write_s, read_s = [], [], [], []
    try:
        for rep in range(reps):
            sides = [(raw.write, raw.read), (write, read)]
            if rep % 2:
                sides.reverse()
            written = [w() for w, _ in sides]
            got = [r() for _, r in sides]
            if rep % 2:
                written.reverse()
                got.reverse()
            write_ratios.append(written[0] / written[1])
            read_ratios.append(got[0] / got[1])
            write_s.append(written[1])
            read_s.append(got[1])
    finally:
        path.unlink(missing_ok=True)
        raw.close()
    gib = blocks * BLOCK / 2**30
    return {
        "snapshot_write_vs_raw": statistics.median(write_ratios),
        "snapshot_read_vs_raw": statistics.median(read_ratios),
        "_snapshot_gib": gib,
        "_snapshot_write_gib_s": gib / statistics.median(write_s),
        "_snapshot_read_gib_s": gib / statistics.median(read_s),
    }


# ---- index --------------------------------------------------------------------------------------
def bench_index(num_blocks: int) -> dict:
    import hashlib

    from kvtier.layout import KVGeometry, ModelFingerprint
    from kvtier.plan.index import IN_DRAM, BlockIndex
    from kvtier.plan.manager import TierManager

    index = BlockIndex()
    namespace = b"n" * 16
    keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(num_blocks)]  # vLLM: 32 bytes
    for key in keys:
        index.add(namespace, key, IN_DRAM)
    per_block = index.memory_bytes() / num_blocks  # keys included: the index keeps them alive

    # Lookup through the manager (recency and policy updates included), on that big index.
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16)
    manager = TierManager(ModelFingerprint("bench", geometry), dram_bytes=1 << 20)
    manager.table.index = index
    prefix = keys[num_blocks // 2 : num_blocks // 2 + 1024]
    samples = []
    for _ in range(50):
        start = time.perf_counter()
        rows = manager.table.lookup(namespace, prefix)
        samples.append(time.perf_counter() - start)
    require(len(rows) == len(prefix), f"the lookup found {len(rows)} of {len(prefix)} blocks")
    return {"lookup_1024_blocks_ms": statistics.median(samples) * 1e3, "index_bytes_per_block": per_block}


def run_tiers_bench(quick: bool = False, directory: str | None = None, progress: Callable[[str], None] = print) -> dict:
    """Run every part; ``quick`` shrinks sizes to finish in well under a minute."""
    reps = 3 if quick else 6
    dram_blocks = 64 if quick else 256
    nvme_bytes = (256 << 20) if quick else (1 << 30)
    session_bytes = (256 << 20) if quick else (1 << 30)
    base = Path(directory) if directory else Path.cwd()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=base) as tmp:
        progress(f"DRAM tier: {dram_blocks} x 2 MiB blocks")
        results.update(bench_dram(dram_blocks, reps))
        progress(f"NVMe tier: {nvme_bytes >> 20} MiB of 64 KiB and of 2 MiB blocks in {tmp}")
        results.update(bench_nvme(Path(tmp), nvme_bytes, reps))
        progress(f"snapshots: {session_bytes >> 20} MiB session")
        results.update(bench_snapshot(Path(tmp), session_bytes, 5 if quick else max(5, reps)))
    progress("index: 1M blocks")
    results.update(bench_index(1_000_000))
    results["_quick"] = quick
    return results
