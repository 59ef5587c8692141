"""vLLM's CPU attention packs each (block, head)'s K and V for its ISA; kvtier measures the order with
vLLM's own ``cpu_attn_reshape_and_cache`` and copies through it (kvtier.move.slaborder, the CPU layout
adapter). Checked against the real op: KV written by vLLM for a known key/value gathers into the
canonical [layers, heads, 2, tokens, head_dim] block, and scatters back to the same bytes."""
from __future__ import annotations

import pytest
import torch
from support.realpath import need

from kvtier.layout import KVGeometry, ModelFingerprint, adapter_for
from kvtier.move.slaborder import SlabOrder, probe_map

ops = need("vllm._custom_ops")


def _amx_cpu() -> bool:
    try:
        return " amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


# vLLM's amx kernels exist only on CPUs with AMX: elsewhere the op refuses that ISA
AMX = pytest.mark.skipif(not _amx_cpu(), reason="this CPU has no AMX: vLLM's amx kernels refuse to run here")
# (isa, block tokens, head_dim): amx and vec need blocks of 32k tokens; vec16 is any 16k head_dim
CASES = [pytest.param("amx", 128, 128, marks=AMX), pytest.param("amx", 32, 64, marks=AMX),
         ("vec", 128, 128), ("vec", 32, 64), ("vec16", 16, 64),
         ("vec16", 16, 128)]


def _write(isa: str, spec: str = "auto"):
    def write(key, value, key_cache, value_cache, slots):
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, spec)
    return write


def _orders(isa: str, geometry: KVGeometry):
    maps = probe_map(_write(isa), geometry.block_tokens, geometry.head_dim, torch.bfloat16, torch.bfloat16)
    return tuple(SlabOrder.find(m, geometry.block_tokens, geometry.head_dim) for m in maps)


def _vllm_cache(isa: str, geometry: KVGeometry, blocks: int, seed: int):
    """Per layer, a CPU-backend KV tensor [blocks, H, B, 2D] filled by vLLM's own op, and the
    canonical [blocks, L, H, 2, B, D] that the same keys and values are."""
    gen = torch.Generator().manual_seed(seed)
    L, H, B, D = geometry.num_layers, geometry.num_kv_heads, geometry.block_tokens, geometry.head_dim
    layers, canonical = [], torch.empty(blocks, L, H, 2, B, D, dtype=torch.bfloat16)
    for layer in range(L):
        key, value = (torch.randn(blocks * B, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
        cache = torch.zeros(blocks, H, B, 2 * D, dtype=torch.bfloat16)
        key_cache, value_cache = cache.view(blocks, H, 2 * B, D).chunk(2, dim=2)
        _write(isa)(key, value, key_cache, value_cache, torch.arange(blocks * B))
        layers.append(cache)
        canonical[:, layer, :, 0] = key.view(blocks, B, H, D).transpose(1, 2)
        canonical[:, layer, :, 1] = value.view(blocks, B, H, D).transpose(1, 2)
    return layers, canonical


@pytest.mark.parametrize("isa,tokens,dim", CASES)
def test_blocks_vllm_wrote_gather_canonical_and_scatter_back(isa, tokens, dim):
    geometry = KVGeometry(2, 2, dim, tokens, "bfloat16")
    orders = _orders(isa, geometry)
    assert None not in orders, orders
    layers, canonical = _vllm_cache(isa, geometry, blocks=5, seed=7)
    ids = [3, 1, 2, 0]  # out of order and in runs: the adapter copies run by run
    out = torch.empty(len(ids), *geometry.block_shape, dtype=torch.bfloat16)
    adapter = adapter_for("cpu", geometry, orders)
    adapter.gather(layers, ids, out)
    assert torch.equal(out, canonical[ids])
    fresh = [torch.zeros_like(kv) for kv in layers]
    adapter.scatter(out, fresh, ids)
    for kv, back in zip(layers, fresh):
        assert torch.equal(back[ids], kv[ids]) and not back[4].any()


@pytest.mark.parametrize("isa", [pytest.param("amx", marks=AMX), "vec"])
def test_without_the_orders_a_cpu_block_is_not_canonical(isa):
    """What kvtier did before it knew: the stored order taken as canonical (a codec's 'channel'
    was then a mix of tokens and channels)."""
    geometry = KVGeometry(1, 2, 128, 128, "bfloat16")
    layers, canonical = _vllm_cache(isa, geometry, blocks=2, seed=3)
    out = torch.empty(2, *geometry.block_shape, dtype=torch.bfloat16)
    adapter_for("cpu", geometry).gather(layers, [0, 1], out)
    assert not torch.equal(out[:, :, :, 0], canonical[:, :, :, 0])  # K is packed for both ISAs


@pytest.mark.parametrize("spec,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_caches_have_the_same_orders(spec, dtype):
    """vLLM stores fp8 KV as uint8 bits; the probe's digits 0..3 are exact in both fp8 formats."""
    isa = "amx" if _amx_cpu() else "vec"  # the ISA this CPU runs
    maps = probe_map(_write(isa, spec), 128, 128, torch.uint8, dtype, torch.bfloat16)
    assert [SlabOrder.find(m, 128, 128) for m in maps] == list(_orders(isa, KVGeometry(1, 1, 128, 128)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_models_are_probed_in_their_own_dtype(dtype):
    """The kernel dispatches on the key's dtype: bf16 digits in an fp16 cache would read back wrong."""
    maps = probe_map(_write("vec"), 32, 64, dtype, dtype)
    assert [SlabOrder.find(m, 32, 64) for m in maps] == list(_orders("vec", KVGeometry(1, 1, 64, 32)))


def _config(dtype=torch.bfloat16, block=128, head=128, cache="auto"):
    from types import SimpleNamespace

    model = SimpleNamespace(dtype=dtype, get_head_size=lambda: head)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=block, cache_dtype=cache))


def test_the_connector_measures_the_order_and_says_so_in_the_fingerprint(monkeypatch):
    from kvtier.plugins.vllm import compat
    from kvtier.plugins.vllm.kvorder import cpu_kv_order

    geometry = KVGeometry(2, 2, 128, 128, "bfloat16")
    label, orders = cpu_kv_order(_config(), geometry)
    assert label == "canonical" and orders == _orders(compat._get_attn_isa(torch.bfloat16, 128, 128, "auto"),
                                                     geometry)
    # an ISA whose packing cannot be measured: copies as stored, and a fingerprint that says so
    monkeypatch.setattr("vllm.v1.attention.backends.cpu_attn._get_attn_isa", lambda *a: "no-such-isa")
    assert cpu_kv_order(_config(), KVGeometry(2, 2, 128, 128, "bfloat16")) == ("packed:no-such-isa", None)


def test_an_unknown_order_is_not_guessed():
    scrambled = torch.randperm(16 * 8, generator=torch.Generator().manual_seed(0))
    assert SlabOrder.find(scrambled, 16, 8) is None
    assert SlabOrder.find(torch.arange(16 * 8), 16, 8).identity


def test_blocks_stored_before_the_orders_never_load_into_a_cpu_engine():
    """CPU engines' fingerprints say their blocks are canonical: blocks kvtier stored in the packed
    order (the fingerprint without it) have another digest, so they are never served."""
    geometry = KVGeometry(2, 2, 64, 16, "bfloat16")
    before = ModelFingerprint("m@cpu", geometry, "w")
    now = ModelFingerprint("m@cpu", geometry, "w", kv_order="canonical")
    assert before.digest != now.digest
    assert ModelFingerprint.from_dict(now.to_dict()) == now
    assert "another order" in now.mismatch(before) and "older kvtier" in now.mismatch(before)
