"""``kvtier bench codecs``: codec throughput vs memcpy, and NVMe restore with each cold codec.

* ``<codec>_decode_vs_memcpy``: bytes of KV delivered per second by decode, over a memcpy of the
  same (decoded, bf16) bytes; ``<codec>_encode_vs_memcpy``: bf16 bytes consumed per second by
  encode over the same memcpy (stricter than a memcpy of the smaller encoded output).
* ``<codec>_restore_vs_raw_read``: uncompressed KV bytes per second restored from the NVMe tier
  (page cache dropped, reads on the store's IO threads overlapping the decode) over the raw
  sequential direct-IO read bandwidth of the same disk with 8 MiB requests (the disk's best);
  the same ratio against raw 2 MiB reads (the tier's IO size) is reported beside it.

Blocks have the mid demo model's geometry (16 layers, 4 KV heads, head_dim 64, 128 tokens: 2 MiB
in bf16); the data is Gaussian with outlier key channels, as real keys have. Each ratio is the
median of interleaved repetitions, measured against its reference in the same process. Every timed
decode and every restore is checked, outside its timer: the blocks it gave back must be exactly the
codec's own decode of what was written (every record read back at its size and codec), or the
figures are refused.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from kvtier.bench.checks import require
from kvtier.bench.tiers import RawDirectIO, _paired_ratio, drop_page_cache

__all__ = ["run_codecs_bench", "BENCH_CODECS", "codec_keys"]

BENCH_CODECS = ("none", "fp8", "fp8:e5m2", "fp8:head", "int8", "int4", "int4-lc", "fp8+zstd", "int4-lc+zstd")


def codec_keys(codecs=BENCH_CODECS) -> tuple[str, ...]:
    return tuple(f"{c}_{kind}" for c in codecs for kind in ("decode_vs_memcpy", "encode_vs_memcpy",
                                                             "restore_vs_raw_read"))


def synthetic_blocks(geometry, count: int, seed: int = 0):
    """``count`` canonical blocks of Gaussian KV, keys with a few outlier channels (x10..x20)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((count, *geometry.block_shape), generator=gen)
    channels = torch.randperm(geometry.head_dim, generator=gen)[: max(1, geometry.head_dim // 16)]
    x[:, :, :, 0, :, channels] *= torch.linspace(10, 20, len(channels))
    return x.to(getattr(torch, geometry.dtype))


def _throughput(spec: str, blocks, reps: int) -> dict:
    import torch

    from kvtier.codecs import get_codec

    codec = get_codec(spec)
    geometry = _geometry()
    n = blocks.shape[0]
    payloads = torch.empty((n, codec.max_bytes(geometry)), dtype=torch.uint8)
    sizes = [codec.encode(blocks[i], payloads[i], first=i == 0) for i in range(n)]  # also warms up numba
    expected = torch.empty_like(blocks)  # each block as the codec gives it back: what every decode must give
    for i in range(n):
        codec.decode(payloads[i, : sizes[i]], expected[i])
    out = torch.empty_like(blocks)
    plain = torch.empty_like(blocks)

    def memcpy():
        return _timed(lambda: plain.copy_(blocks))

    def encode():
        return _timed(lambda: [codec.encode(blocks[i], payloads[i], first=i == 0) for i in range(n)])

    def decode():
        out.zero_()  # outside the timer: a decode that wrote nothing is caught below
        elapsed = _timed(lambda: [codec.decode(payloads[i, : sizes[i]], out[i]) for i in range(n)])
        require(torch.equal(out, expected), f"{spec}: a timed decode gave other bytes than the codec's own decode")
        return elapsed

    enc, enc_detail = _paired_ratio(memcpy, encode, reps)
    require(torch.equal(plain, blocks), "the memcpy reference copied other bytes")
    dec, dec_detail = _paired_ratio(memcpy, decode, reps)
    gib = blocks.numel() * blocks.element_size() / 2**30
    return {
        f"{spec}_encode_vs_memcpy": enc,
        f"{spec}_decode_vs_memcpy": dec,
        f"_{spec}_size_ratio": sum(sizes) / (gib * 2**30),
        f"_{spec}_decode_gib_s": gib / dec_detail["measured_s"],
        f"_{spec}_encode_gib_s": gib / enc_detail["measured_s"],
        "_memcpy_gib_s": gib / dec_detail["reference_s"],
    }, payloads, sizes, expected


def _restore(spec: str, payloads, sizes, expected, directory: Path, raw: RawDirectIO, reps: int,
             raw_small: RawDirectIO | None = None) -> dict:
    import torch

    from kvtier.codecs import get_codec
    from kvtier.tiers.nvme.store import NvmeStore

    geometry = _geometry()
    n = len(sizes)
    root = directory / f"tier-{spec.replace(':', '_').replace('+', '_')}"
    store = NvmeStore(root, capacity_bytes=n * (payloads.shape[1] + 2 * 4096) * 2, io_threads=8)
    fingerprint, namespace = b"f" * 16, b"n" * 16
    keys = [i.to_bytes(8, "little") for i in range(n)]
    outcomes = store.write_batch([(namespace, k, payloads[i, : sizes[i]], spec) for i, k in enumerate(keys)],
                                 fingerprint)
    require(all(isinstance(o, int) for o in outcomes), f"an NVMe write failed: {outcomes[:1]}")
    from kvtier.tiers.dram import aligned_empty

    per = (payloads.shape[1] + 8191) // 4096 * 4096
    buffers = aligned_empty(n * per).view(n, per)  # page-aligned: O_DIRECT reads land in place
    out = torch.empty((n, *geometry.block_shape), dtype=torch.bfloat16)

    def restore():
        drop_page_cache(root)
        out.zero_()  # outside the timer: every block must come back through this round's reads
        start = time.perf_counter()
        futures = [store.submit_read(namespace, k, buffers[i], fingerprint) for i, k in enumerate(keys)]
        read = []
        for i, future in enumerate(futures):  # decode block i while the IO threads read the next ones
            nbytes, stored = future.result()
            get_codec(stored).decode(buffers[i, :nbytes], out[i])
            read.append((nbytes, stored))
        elapsed = time.perf_counter() - start
        require(read == [(size, spec) for size in sizes] and torch.equal(out, expected),
                f"{spec}: a restore from the NVMe tier gave other blocks than were written")
        return elapsed

    try:
        ratio, detail = _paired_ratio(raw.read, restore, reps, second=raw_small.read if raw_small else None)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    gib = out.numel() * out.element_size() / 2**30  # = raw.nbytes: both sides deliver the same bytes
    out = {f"{spec}_restore_vs_raw_read": ratio, f"_{spec}_restore_gib_s": gib / detail["measured_s"],
           "_raw_read_gib_s": raw.nbytes / 2**30 / detail["reference_s"]}
    if "second_ratio" in detail:  # against raw reads of the tier's own IO size (2 MiB)
        out[f"_{spec}_restore_vs_raw_read_2mib_io"] = detail["second_ratio"]
    return out


def _geometry():
    from kvtier.layout import KVGeometry

    return KVGeometry(num_layers=16, num_kv_heads=4, head_dim=64, block_tokens=128, dtype="bfloat16")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_codecs_bench(quick: bool = False, directory: str | None = None,
                     progress: Callable[[str], None] = print, codecs=BENCH_CODECS) -> dict:
    from kvtier.codecs import fast

    blocks_n = 8 if quick else 32
    reps = 3 if quick else 5
    blocks = synthetic_blocks(_geometry(), blocks_n)
    results: dict = {"_blocks": blocks_n, "_block_mib": 2, "_numba": fast.available()}
    base = Path(directory) if directory else Path.cwd()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-codecs-", dir=base) as tmp:
        raw = RawDirectIO(Path(tmp), blocks_n * (2 << 20), chunk=8 << 20)
        raw.write()
        raw_small = RawDirectIO(Path(tmp), blocks_n * (2 << 20), chunk=2 << 20)
        raw_small.write()
        try:
            for spec in codecs:
                progress(f"codec {spec}: encode / decode vs memcpy")
                figures, payloads, sizes, expected = _throughput(spec, blocks, reps)
                results.update(figures)
                progress(f"codec {spec}: restore from the NVMe tier vs raw direct-IO read")
                results.update(_restore(spec, payloads, sizes, expected, Path(tmp), raw, reps, raw_small))
        finally:
            raw.close()
            raw_small.close()
    return results
