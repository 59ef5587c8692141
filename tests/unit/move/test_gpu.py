"""CUDA paths: batched layout gather/scatter on the device, pinned DRAM arena, the mover's stream.

Skipped on CPU-only machines (marked ``gpu``); run where a GPU is present.
"""
from __future__ import annotations

import pytest
import torch

from kvtier.engine import TierEngine
from kvtier.layout import KVGeometry, ModelFingerprint, adapter_for
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")


@pytest.mark.parametrize("layout", ["kv_first", "block_first"])
def test_cuda_layout_round_trip_matches_cpu_reference(layout):
    adapter = adapter_for(layout, GEOMETRY)
    layers = [torch.randn(adapter.layer_shape(32), device="cuda").to(torch.bfloat16) for _ in range(4)]
    ids = [5, 1, 30, 7]
    on_gpu = torch.empty((len(ids), *GEOMETRY.block_shape), dtype=torch.bfloat16, device="cuda")
    adapter.gather(layers, ids, on_gpu)
    on_cpu = torch.empty((len(ids), *GEOMETRY.block_shape), dtype=torch.bfloat16)
    adapter.gather([layer.cpu() for layer in layers], ids, on_cpu)  # the CPU path as reference
    assert torch.equal(on_gpu.cpu(), on_cpu)
    zeroed = [torch.zeros_like(layer) for layer in layers]
    adapter.scatter(on_gpu, zeroed, ids)
    for layer, back in zip(layers, zeroed):
        dim = 1 if layout == "kv_first" else 0
        assert torch.equal(layer.index_select(dim, torch.tensor(ids, device="cuda")),
                           back.index_select(dim, torch.tensor(ids, device="cuda")))


@pytest.mark.parametrize("layout", ["kv_first", "block_first"])
def test_engine_on_cuda_stores_demotes_and_loads(layout, tmp_path):
    fingerprint = ModelFingerprint("gpu-test", GEOMETRY)
    adapter = adapter_for(layout, GEOMETRY)
    hbm = [torch.randn(adapter.layer_shape(64), device="cuda").to(torch.bfloat16) for _ in range(4)]
    engine = TierEngine(fingerprint, 16 * GEOMETRY.block_bytes, tmp_path / "nvme", 64 * GEOMETRY.block_bytes * 2,
                        kv_layers=hbm, layout=layout)
    assert engine.arena.pinned  # host<->device copies need pinned memory to be asynchronous
    ns = namespace_of(fingerprint.digest)
    keys = chain_block_hashes(list(range(8 * 16)), 16)
    reference = [layer.clone() for layer in hbm]
    assert engine.store("s", ns, keys, list(range(8))) == 8
    engine.evict("s", Tier.NVME)
    assert engine.load(ns, keys, list(range(32, 40))) == 8
    torch.cuda.synchronize()
    dim = 1 if layout == "kv_first" else 0
    src = torch.arange(0, 8, device="cuda")
    dst = torch.arange(32, 40, device="cuda")
    for layer, ref in zip(hbm, reference):
        assert torch.equal(layer.index_select(dim, dst), ref.index_select(dim, src))
    assert engine.mover.links.counts["hbm->dram"] == 8 * GEOMETRY.block_bytes


@pytest.mark.parametrize("spec", ["fp8", "int8", "int4", "int4-lc", "fp8+zstd"])
def test_codecs_on_the_gpu_match_the_cpu_reference(spec):
    """Encode and decode on the device; the payload decodes on the CPU to (nearly) the same block."""
    from kvtier.codecs import get_codec

    codec = get_codec(spec)
    block = torch.randn(GEOMETRY.block_shape, device="cuda").to(torch.bfloat16)
    payload = torch.empty(codec.max_bytes(GEOMETRY), dtype=torch.uint8, device="cuda")
    n = codec.encode(block, payload, first=True)
    on_gpu = torch.empty_like(block)
    codec.decode(payload[:n], on_gpu)
    on_cpu = torch.empty(GEOMETRY.block_shape, dtype=torch.bfloat16)
    codec.decode(payload[:n].cpu(), on_cpu)
    if spec.startswith("fp8"):
        assert torch.equal(on_gpu.cpu(), on_cpu)  # exact: power-of-two scales
    else:
        assert torch.allclose(on_gpu.cpu().float(), on_cpu.float(), rtol=1e-2, atol=1e-2)
    err = ((on_gpu.float() - block.float()) ** 2).mean() / (block.float() ** 2).mean()
    assert float(err) < 3e-2


def test_engine_with_codecs_on_the_gpu(tmp_path):
    fingerprint = ModelFingerprint("gpu-model", GEOMETRY)
    adapter = adapter_for("kv_first", GEOMETRY)
    layers = [torch.randn(adapter.layer_shape(32), device="cuda").to(torch.bfloat16) for _ in range(4)]
    engine = TierEngine(fingerprint, 64 * GEOMETRY.block_bytes, tmp_path / "nvme", 1 << 30, kv_layers=layers,
                        layout="kv_first", warm_codec="fp8", cold_codec="int4-lc")
    ns = namespace_of(fingerprint.digest)
    keys = chain_block_hashes(list(range(4 * 16)), 16)
    engine.store("s", ns, keys, [0, 1, 2, 3])
    assert engine.load(ns, keys, [10, 11, 12, 13]) == 4
    engine.evict("s", Tier.NVME)
    assert engine.load(ns, keys, [20, 21, 22, 23]) == 4
    for layer in layers:
        for a, b in ((0, 10), (3, 13), (0, 20), (3, 23)):
            got, want = layer[:, b].float(), layer[:, a].float()
            assert float(((got - want) ** 2).mean() / (want ** 2).mean()) < 3e-2
    engine.close()
