"""``python -m kvtier.diagnose.gpucheck``: kvtier's tier engine on one GPU, without vLLM (check a).

Drives both halves in one process (``TierEngine``: the manager plans, the mover moves) against KV
tensors laid out exactly as vLLM 0.32 lays them out on CUDA: one allocation for all layers in a
``KVCacheLayout`` stride order (LBHNC, the layout the connector asks for, and LBNHC / BLHNC, which
other backends pick), each layer a logical ``[blocks, heads, tokens, K|V]`` view of it. Checks:

* ``layouts``: stores bit-exact in DRAM, demotion to NVMe, loads back bit-exact, snapshot, drop,
  restore and load again bit-exact, for each layout (bf16 and fp8 KV);
* ``pinned``: the DRAM arena is pinned by ``cudaHostRegister`` at exactly its size (no
  power-of-two rounding), NVMe read staging buffers are pinned;
* ``overlap``: stores submitted from the step path return at once while a matmul runs, never
  synchronise the host (``step_syncs`` 0), and their copies overlap the next matmul;
* ``links``: pinned host->device and device->host GB/s against the link's NVML maximum;
* ``codecs``: GPU decode GB/s of the fp8 / int8 / int4 codecs.

``--dry`` runs every check that does not need the device on the CPU (what this box's tests run);
the device-only figures are reported as skipped. Output: one JSON object (``--out`` writes it to a
file as well). Bring-along: ``scripts/gpu-check.sh`` installs the few wheels the check box lacks.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["main", "report_out", "run_checks", "say", "vllm_layer_views", "LAYOUTS"]

# vLLM 0.32 KVCacheLayout: the physical order of the logical axes [L, B, H, N, C]
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4)}
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def vllm_layer_views(layout: str, num_layers: int, num_blocks: int, heads: int, tokens: int, width: int,
                     dtype, device) -> list:
    """Per-layer KV tensors as vLLM 0.32 hands them to a connector: one allocation in the layout's
    physical order, each layer the logical ``[blocks, heads, tokens, width]`` view of it."""
    import torch

    order = LAYOUTS[layout]
    logical = (num_layers, num_blocks, heads, tokens, width)
    physical = torch.empty([logical[i] for i in order], dtype=dtype, device=device)
    inverse = [order.index(i) for i in range(5)]
    view = physical.permute(*inverse)  # logical [L, B, H, N, C] over the physical memory
    return [view[layer] for layer in range(num_layers)]


def _fill(layers, seed: int) -> None:
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    for layer in layers:
        data = torch.randn(layer.shape, generator=g) * 3
        layer.copy_(data.to(layer.dtype))


def _blocks(adapter, layers, ids) -> Any:
    import torch

    out = torch.empty((len(ids), *adapter.geometry.block_shape), dtype=layers[0].dtype, device=layers[0].device)
    adapter.gather(layers, ids, out)
    return out.cpu().view(torch.uint8)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_layout(layout: str, dtype_name: str, device, tmp: Path) -> dict:
    """Store, demote, load, snapshot, drop, restore, load: every load bit-exact."""
    import torch

    from kvtier.engine import TierEngine
    from kvtier.layout import KVGeometry, ModelFingerprint
    from kvtier.plan.index import Tier, chain_block_hashes, namespace_of

    geometry = KVGeometry(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=16, dtype=dtype_name)
    dtype = getattr(torch, dtype_name)
    n = 16
    layers = vllm_layer_views(layout, 4, 4 * n, 4, 16, 128, dtype, device)
    _fill(layers, seed=len(layout) + len(dtype_name))
    fingerprint = ModelFingerprint("gpucheck", geometry)
    engine = TierEngine(fingerprint, 2 * n * geometry.block_bytes, tmp / f"{layout}-{dtype_name}",
                        8 * n * geometry.block_bytes,
                        kv_layers=layers, layout="head_split", catalog=False)
    ns = namespace_of(fingerprint.digest)
    keys = chain_block_hashes(list(range(n * 16)), 16)
    src, dst = list(range(n)), list(range(2 * n, 3 * n))
    want = _blocks(engine.mover.copies.adapter, layers, src)
    out: dict[str, Any] = {"pinned_arena": engine.arena.pinned}
    out["stored"] = engine.store("s", ns, keys, src, num_tokens=n * 16, token_ids=list(range(n * 16))) == n
    _sync(device)
    slots = [int(engine.manager.table.index.col["dram_slot"][r]) for r in engine.manager.table.lookup(ns, keys)]
    in_dram = torch.stack([engine.arena.slot(s, geometry.block_bytes) for s in slots])
    out["dram_bit_exact"] = bool(torch.equal(in_dram.view(len(slots), -1), want.view(n, -1)))
    engine.evict("s", Tier.NVME)
    out["demoted"] = engine.manager.views.stats()["nvme"]["blocks"] >= n
    out["nvme_load_blocks"] = engine.load(ns, keys, dst)
    _sync(device)
    out["nvme_load_bit_exact"] = bool(torch.equal(_blocks(engine.mover.copies.adapter, layers, dst), want))
    snap = tmp / f"{layout}-{dtype_name}.kvsnap"
    out["snapshot_ok"] = bool(engine.snapshot("s", snap).ok)
    engine.evict("s", None)
    for layer in layers:  # forget the loaded copies (byte view: fp8 has no fill kernels everywhere)
        layer[dst[0]: dst[-1] + 1].view(torch.uint8).zero_()
    from kvtier.persist.snapshot import open_snapshot

    restored = engine.execute(engine.manager.planner.prepare_restore(open_snapshot(snap)))
    out["restore_ok"] = bool(restored is not None and restored.ok)
    out["restore_load_blocks"] = engine.load(ns, keys, dst)
    _sync(device)
    out["restore_bit_exact"] = bool(torch.equal(_blocks(engine.mover.copies.adapter, layers, dst), want))
    out["step_syncs"] = engine.mover.stream.syncs
    engine.close(write_back=False)
    out["ok"] = all(out[k] for k in ("stored", "dram_bit_exact", "demoted", "nvme_load_bit_exact", "snapshot_ok",
                                     "restore_ok", "restore_bit_exact")) \
        and out["nvme_load_blocks"] == n and out["restore_load_blocks"] == n \
        and (device.type != "cuda" or out["pinned_arena"])
    return out


def check_pinned(device) -> dict:
    """The arena is registered at exactly its size; NVMe staging buffers are pinned too."""
    from kvtier.tiers.dram import PAGE, DramArena, aligned_empty

    size_slots, slot = 3000, 3 * PAGE + 512  # ~37 MiB, not a power of two
    arena = DramArena(size_slots, slot, pin=device.type == "cuda")
    staging = aligned_empty(5 * PAGE + 1, pin=device.type == "cuda")
    out = {"arena_bytes": arena.buffer.numel(), "expected_bytes": size_slots * arena.slot_bytes,
           "arena_pinned": arena.pinned, "staging_pinned": bool(staging.is_pinned()) if device.type == "cuda" else None}
    pinned = device.type != "cuda" or (arena.pinned and out["staging_pinned"])
    out["ok"] = out["arena_bytes"] == out["expected_bytes"] and pinned
    del arena, staging
    out.update(pinned_rss(device))
    out["ok"] = out["ok"] and out["rss_ok"]
    return out


def pinned_rss(device, size_bytes: int = (1 << 30) + 7 * 4096) -> dict:
    """Pinning the DRAM tier must not round it up (the design in ``tiers/dram.py``: one
    ``cudaHostRegister`` of an exact-size arena, never PyTorch's caching host allocator, which rounds
    a request up to a power of two): the process RSS grows by the arena's size, at most 5% + 64 MiB
    more, and drops back once it is freed. ``python -m benchmarks memory`` measures the whole server on CPU,
    where nothing is pinned; this is its GPU half."""
    import gc

    import psutil
    import torch

    from kvtier.tiers.dram import PAGE, DramArena

    cuda = device.type == "cuda"
    process = psutil.Process()
    host_stats = getattr(torch.cuda, "host_memory_stats", None) if cuda else None
    allocated = (lambda: host_stats().get("allocated_bytes.current", 0)) if host_stats else (lambda: 0)
    before, host_before = process.memory_info().rss, allocated()
    slots = size_bytes // PAGE
    arena = DramArena(slots, PAGE, pin=cuda)
    if not cuda:
        arena.buffer.fill_(1)  # on a CPU the pages count once written; pinned pages are resident at once
    grown = process.memory_info().rss - before
    expected = slots * PAGE
    host_grown = allocated() - host_before
    del arena
    gc.collect()
    released = process.memory_info().rss - before
    ok = expected <= grown + (64 << 20) and grown <= 1.05 * expected + (64 << 20) and host_grown == 0 and \
        released < 0.5 * expected
    return {"rss_arena_bytes": expected, "rss_grown_bytes": grown, "rss_after_free_bytes": released,
            "caching_host_allocator_bytes": host_grown, "rss_pinned": cuda, "rss_ok": ok}


def check_overlap(device, tmp: Path) -> dict:
    """Stores submitted from the step path never wait; their copies run beside the next forward."""
    import torch

    from kvtier.engine import TierEngine
    from kvtier.layout import KVGeometry, ModelFingerprint
    from kvtier.plan.index import chain_block_hashes, namespace_of

    cuda = device.type == "cuda"
    n = 512 if cuda else 32
    geometry = KVGeometry(num_layers=8, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
    layers = vllm_layer_views("LBHNC", 8, n, 8, 16, 256, torch.bfloat16, device)
    _fill(layers, seed=7)
    fingerprint = ModelFingerprint("gpucheck-overlap", geometry)
    engine = TierEngine(fingerprint, (n + 8) * geometry.block_bytes, kv_layers=layers, layout="head_split",
                        catalog=False)
    ns = namespace_of(fingerprint.digest)
    size = 8192 if cuda else 512
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def forward(times: int = 20):
        for _ in range(times):
            a @ a

    def timed(fn: Callable[[], Any]) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    forward(2)
    t_forward = timed(forward)
    keys = chain_block_hashes(list(range(n * 16)), 16)
    engine.manager.planner.record_session("s", ns, keys, n * 16)

    def stores(batch):
        job = engine.manager.prepare_store("s", ns, batch, list(range(len(batch))))
        engine.mover.stream.step.active = True
        started = time.perf_counter()
        engine.mover.jobs.submit_stores([job])
        returned = time.perf_counter() - started
        engine.mover.stream.step.active = False
        return job, returned

    def finish(job) -> bool:
        engine.mover.jobs.wait_jobs([job.job_id])
        results = engine.mover.jobs.poll()
        for result in results:
            engine.manager.complete(result)
        return all(r.ok for r in results)

    half = n // 2
    job, _ = stores(keys[:half])
    t_copy = timed(lambda: finish(job))  # the copy alone (D2H of half the blocks)
    forward(1)  # a forward is queued when the step's stores are submitted
    job, returned = stores(keys[half: 2 * half])
    pending_on_return = cuda and not torch.cuda.current_stream(device).query()
    t_both = timed(lambda: (forward(), finish(job)))
    overlap = max(0.0, (t_forward + t_copy - t_both) / max(min(t_forward, t_copy), 1e-9))
    out = {"submit_returned_ms": round(returned * 1e3, 3), "forward_still_running_at_return": pending_on_return,
           "step_syncs": engine.mover.stream.syncs, "t_forward_s": t_forward, "t_copy_s": t_copy, "t_both_s": t_both,
           "overlap": round(min(overlap, 1.0), 3), "stored_blocks": engine.manager.telemetry.counters["stored_blocks"]}
    out["ok"] = out["step_syncs"] == 0 and out["stored_blocks"] == 2 * half and returned < 0.05
    engine.close(write_back=False)
    return out


def check_links(device) -> dict:
    """Pinned H2D / D2H GB/s and the link's NVML maximum."""
    import torch

    from kvtier.control.gpu import gpu_link
    from kvtier.tiers.dram import host_buffer

    if device.type != "cuda":
        return {"skipped": "no device (dry run)", "ok": True}
    size = 1 << 30
    host, pinned = host_buffer(size, pin=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    rates = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)  # warm
            stream.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
        rates[name] = 4 * size / (start.elapsed_time(end) / 1e3) / 1e9
    link = gpu_link()
    max_gbps = None
    if link.get("present") and link.get("max_gen") and link.get("max_width"):
        max_gbps = PCIE_LANE_GBPS.get(int(link["max_gen"]), 0) * int(link["max_width"])
    out = {"pinned": pinned, "h2d_gbps": round(rates["h2d"], 2), "d2h_gbps": round(rates["d2h"], 2), "link": link,
           "link_max_gbps": max_gbps}
    if max_gbps:
        out["h2d_vs_link_max"] = round(rates["h2d"] / max_gbps, 3)
        out["d2h_vs_link_max"] = round(rates["d2h"] / max_gbps, 3)
    out["ok"] = pinned
    return out


def check_codecs(device) -> dict:
    """Decode GB/s (decoded bytes) of the quantizing codecs on the device; round trips within bounds."""
    import torch

    from kvtier.codecs import get_codec
    from kvtier.layout import KVGeometry

    geometry = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
    block = (torch.randn(geometry.block_shape) * 2).to(torch.bfloat16).to(device)
    out: dict[str, Any] = {}
    ok = True
    for spec in ("fp8", "int8", "int4"):
        codec = get_codec(spec)
        payload = torch.empty(codec.max_bytes(geometry), dtype=torch.uint8, device=device)
        nbytes = codec.encode(block, payload)
        back = torch.empty_like(block)
        codec.decode(payload[:nbytes], back)
        error = float((back.float() - block.float()).abs().max())
        reps = 50 if device.type == "cuda" else 3
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            codec.decode(payload[:nbytes], back)
        _sync(device)
        seconds = time.perf_counter() - start
        out[spec] = {"decode_gbps": round(reps * geometry.block_bytes / seconds / 1e9, 2), "max_abs_error": round(error,
                                                                                                                  4),
                     "ratio": round(geometry.block_bytes / nbytes, 2)}
        ok = ok and error < 4.0
    out["ok"] = ok
    return out


def run_checks(dry: bool = False, progress: Callable[[str], None] = lambda m: None) -> dict:
    import torch

    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry to check everything but the device")
    device = torch.device("cpu" if dry else "cuda")
    started = time.perf_counter()
    report: dict[str, Any] = {"dry": dry, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name(0) if not dry else "cpu", "checks": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-gpucheck-") as tmp:
        for layout in LAYOUTS:
            for dtype_name in ("bfloat16", "float8_e4m3fn"):
                progress(f"layout {layout} {dtype_name}")
                report["checks"][f"layout_{layout}_{dtype_name}"] = check_layout(layout, dtype_name, device, Path(tmp))
        progress("pinned memory")
        report["checks"]["pinned"] = check_pinned(device)
        progress("copies beside a running matmul")
        report["checks"]["overlap"] = check_overlap(device, Path(tmp))
    progress("link bandwidth")
    report["checks"]["links"] = check_links(device)
    progress("codec decode")
    report["checks"]["codecs"] = check_codecs(device)
    report["ok"] = all(check.get("ok") for check in report["checks"].values())
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.diagnose.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="everything but the device, on the CPU")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    return report_out(run_checks(args.dry, progress=say("gpucheck")), args.out)


def say(name: str) -> Callable[[str], None]:
    """Progress lines on stderr (stdout is the JSON report)."""
    return lambda message: print(f"kvtier {name}: {message}", file=sys.stderr, flush=True)


def report_out(report: dict, out: str | None) -> int:
    """Print the JSON report (and write it to ``out``); exit status 0 when every check passed."""
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if out:
        Path(out).write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
