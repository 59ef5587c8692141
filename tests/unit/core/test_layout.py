"""Tests for kvtier.layout: geometry, model fingerprints, and the vLLM layout adapters.

The adapters are checked against real torch tensors in every backend layout: whole blocks are
gathered into canonical buffers ``[n, layers, heads, 2, tokens, head_dim]`` and scattered back, and
the canonical K/V positions are checked against the backend's documented semantics computed
independently (flat offsets / plain indexing), not through the adapter's own views.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvtier.errors import UsageError
from kvtier.layout import (
    DTYPE_ITEMSIZE,
    BlockFirstLayout,
    CpuLayout,
    KVFirstLayout,
    KVGeometry,
    ModelFingerprint,
    adapter_for,
    k_view,
    v_view,
)

LAYOUTS = ["cpu", "kv_first", "block_first"]
# block_tokens != num_kv_heads != head_dim, so any transposition mix-up changes shapes or values.
GEOMETRY = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=4)
NUM_BLOCKS = 11


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def random_kv(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values in ``dtype``; float8 is drawn in float32 and rounded."""
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so float8 (no torch.equal on CPU) and NaNs compare exactly."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def make_layers(layout: str, geometry: KVGeometry, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    adapter = adapter_for(layout, geometry)
    shape = adapter.layer_shape(NUM_BLOCKS)
    return adapter, [random_kv(shape, dtype, gen) for _ in range(geometry.num_layers)]


def expected_kv(layout: str, kv: torch.Tensor, g: KVGeometry, b: int, t: int, h: int):
    """(K, V) vectors of token ``t``, head ``h`` in block ``b``, from the backend's own definition."""
    B, H, D = g.block_tokens, g.num_kv_heads, g.head_dim
    if layout == "cpu":
        # [nb, H, B, 2D] memory; each (block, head) slab is [2B, D]: rows 0..B-1 are K, B..2B-1 V.
        flat = kv.reshape(-1)
        slab = (b * H + h) * (2 * B * D)
        return flat[slab + t * D : slab + (t + 1) * D], flat[slab + (B + t) * D : slab + (B + t + 1) * D]
    if layout == "kv_first":
        return kv[0, b, t, h], kv[1, b, t, h]
    assert layout == "block_first"
    return kv[b, 0, t, h], kv[b, 1, t, h]


# ---- adapters: gather / scatter -----------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_scatter_round_trip(layout, dtype_name, seed):
    geometry = KVGeometry(**GEOMETRY, dtype=dtype_name)
    dtype = torch_dtype(dtype_name)
    adapter, layers = make_layers(layout, geometry, dtype, seed)
    rng = random.Random(seed)
    # A random, unordered subset of block ids (scatter targets must be distinct).
    ids = rng.sample(range(NUM_BLOCKS), rng.randint(1, NUM_BLOCKS - 2))

    # Gather them into a canonical buffer.
    out = torch.full((len(ids), *geometry.block_shape), 7.0).to(dtype)
    adapter.gather(layers, ids, out)
    assert out.shape == (len(ids), geometry.num_layers, geometry.num_kv_heads, 2,
                         geometry.block_tokens, geometry.head_dim)

    # Every canonical K/V vector is the one the backend layout defines.
    for i, b in enumerate(ids):
        for layer in range(geometry.num_layers):
            for t in range(geometry.block_tokens):
                for h in range(geometry.num_kv_heads):
                    k, v = expected_kv(layout, layers[layer], geometry, b, t, h)
                    assert same(out[i, layer, h, 0, t], k), (b, layer, t, h)
                    assert same(out[i, layer, h, 1, t], v), (b, layer, t, h)
                    # k_view / v_view pick the same vectors, for a batch and for one block.
                    assert same(k_view(out)[i, layer, h, t], k)
                    assert same(v_view(out)[i, layer, h, t], v)
                    assert same(k_view(out[i])[layer, h, t], k)
                    assert same(v_view(out[i])[layer, h, t], v)

    # Scatter back into zeroed tensors: the chosen blocks come back bit-identical ...
    zeroed = [torch.zeros_like(kv) for kv in layers]
    adapter.scatter(out, zeroed, ids)
    block_dim = 1 if layout == "kv_first" else 0
    for kv, back in zip(layers, zeroed):
        for b in range(NUM_BLOCKS):
            got, want = back.select(block_dim, b), kv.select(block_dim, b)
            if b in ids:
                assert same(got, want), b
            else:  # ... and every other block is untouched (still zero).
                assert not bits(got).any(), b


def test_cpu_layout_token_slice_is_not_kv():
    """The NOTES warning: in the CPU layout, ``kv[b, :, t]`` is not token t's K and V."""
    geometry = KVGeometry(**GEOMETRY, dtype="bfloat16")
    adapter, layers = make_layers("cpu", geometry, torch.bfloat16, 5)
    out = torch.empty((1, *geometry.block_shape), dtype=torch.bfloat16)
    adapter.gather(layers, [3], out)
    B, H, D = geometry.block_tokens, geometry.num_kv_heads, geometry.head_dim
    kv = layers[1]
    # The brief's formulation: K = view(nb, H, 2B, D)[b, h, t], V = [b, h, B + t].
    slabs = kv.view(NUM_BLOCKS, H, 2 * B, D)
    for t in range(B):
        for h in range(H):
            assert torch.equal(out[0, 1, h, 0, t], slabs[3, h, t])
            assert torch.equal(out[0, 1, h, 1, t], slabs[3, h, B + t])
    # Token 1's naive slice [K|V halves of row 1] holds K of tokens 2 and 3 instead.
    naive_k = kv[3, 0, 1, :D]
    assert not torch.equal(out[0, 1, 0, 0, 1], naive_k)
    assert torch.equal(naive_k, out[0, 1, 0, 0, 2])


def test_layouts_share_one_canonical_order():
    """A block written from one backend loads into another: same canonical bytes everywhere."""
    geometry = KVGeometry(**GEOMETRY, dtype="bfloat16")
    gen = torch.Generator().manual_seed(9)
    canonical = torch.randn((4, *geometry.block_shape), generator=gen).to(torch.bfloat16)
    ids = [8, 0, 5, 2]
    for name in LAYOUTS:
        adapter = adapter_for(name, geometry)
        # Scatter the canonical blocks into this backend's tensors and gather them back.
        layers = [torch.zeros(adapter.layer_shape(NUM_BLOCKS), dtype=torch.bfloat16)
                  for _ in range(geometry.num_layers)]
        adapter.scatter(canonical, layers, ids)
        back = torch.empty_like(canonical)
        adapter.gather(layers, ids, back)
        assert torch.equal(back, canonical), name
        # Spot-check the native position of one K and one V value.
        k, v = expected_kv(name, layers[2], geometry, 5, 3, 1)
        assert torch.equal(k, canonical[2, 2, 1, 0, 3]) and torch.equal(v, canonical[2, 2, 1, 1, 3])


def test_fp8_cache_allocated_as_uint8_copies_bits():
    """vLLM allocates fp8 KV caches as uint8 tensors: a float8 block buffer must get the raw bits.

    A value-converting copy (uint8 127 -> float8 "127.0") would silently corrupt every fp8 block.
    """
    geometry = KVGeometry(**GEOMETRY, dtype="float8_e4m3fn")
    for name in LAYOUTS:
        adapter, fp8_layers = make_layers(name, geometry, torch.float8_e4m3fn, 3)
        raw_layers = [kv.view(torch.uint8) for kv in fp8_layers]
        ids = [6, 1, 9]
        # Gather from the uint8 tensors into a float8 buffer: bit-identical to the float8 gather.
        want = torch.empty((3, *geometry.block_shape), dtype=torch.float8_e4m3fn)
        adapter.gather(fp8_layers, ids, want)
        got = torch.empty_like(want)
        adapter.gather(raw_layers, ids, got)
        assert same(got, want), name
        # Scatter the float8 buffer into zeroed uint8 tensors: the original bits come back.
        zeroed = [torch.zeros_like(kv) for kv in raw_layers]
        adapter.scatter(got, zeroed, ids)
        dim = 1 if name == "kv_first" else 0
        for kv, back in zip(raw_layers, zeroed):
            for b in ids:
                assert torch.equal(back.select(dim, b), kv.select(dim, b)), (name, b)


def test_adapter_for_names_and_layer_shapes():
    g = KVGeometry(**GEOMETRY)
    assert isinstance(adapter_for("cpu", g), CpuLayout)
    assert isinstance(adapter_for("kv_first", g), KVFirstLayout)
    assert isinstance(adapter_for("block_first", g), BlockFirstLayout)
    assert adapter_for("cpu", g).layer_shape(5) == (5, 2, 4, 16)
    assert adapter_for("kv_first", g).layer_shape(5) == (2, 5, 4, 2, 8)
    assert adapter_for("block_first", g).layer_shape(5) == (5, 2, 4, 2, 8)
    with pytest.raises(UsageError) as info:
        adapter_for("flash_mla", g)
    assert info.value.hint and "cpu" in info.value.hint


# ---- adapters: bad input ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_wrong_layer_count_raises(layout):
    geometry = KVGeometry(**GEOMETRY)
    adapter, layers = make_layers(layout, geometry, torch.bfloat16, 0)
    out = torch.empty((1, *geometry.block_shape), dtype=torch.bfloat16)
    # One layer too few, and one too many.
    for bad in (layers[:-1], layers + [layers[0]]):
        with pytest.raises(UsageError):
            adapter.gather(bad, [0], out)
        with pytest.raises(UsageError):
            adapter.scatter(out, bad, [0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", [0, -1])
def test_wrong_tensor_shape_raises(layout, which):
    geometry = KVGeometry(**GEOMETRY)
    adapter, layers = make_layers(layout, geometry, torch.bfloat16, 0)
    out = torch.empty((1, *geometry.block_shape), dtype=torch.bfloat16)
    shape = list(adapter.layer_shape(NUM_BLOCKS))
    # Same number of elements but heads and tokens swapped (a plausible mis-wired backend), and
    # a wrong head_dim; in the first layer and in the last one.
    swapped = list(shape)
    if layout == "cpu":
        swapped[1], swapped[2] = swapped[2], swapped[1]
    else:
        swapped[-3], swapped[-2] = swapped[-2], swapped[-3]
    wider = shape[:-1] + [shape[-1] + 1]
    for bad_shape in (swapped, wider):
        bad_layers = list(layers)
        bad_layers[which] = torch.zeros(bad_shape, dtype=torch.bfloat16)
        before = [kv.clone() for kv in bad_layers]
        with pytest.raises(UsageError):
            adapter.gather(bad_layers, [0], out)
        with pytest.raises(UsageError):
            adapter.scatter(out, bad_layers, [0])
        # A refused scatter wrote nothing, not even into the layers before the bad one.
        assert all(torch.equal(a, b) for a, b in zip(before, bad_layers))


# ---- geometry ---------------------------------------------------------------------------------
def test_geometry_sizes():
    g = KVGeometry(num_layers=28, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
    assert g.block_shape == (28, 8, 2, 16, 128)
    assert g.itemsize == 2
    assert g.bytes_per_token == 28 * 2 * 8 * 128 * 2
    assert g.block_bytes == g.bytes_per_token * 16
    assert g.layer_block_bytes * 28 == g.block_bytes
    assert KVGeometry(1, 1, 1, 1, "float8_e4m3fn").block_bytes == 2
    assert DTYPE_ITEMSIZE["float32"] == 4


@pytest.mark.parametrize(
    "field,value",
    [("num_layers", 0), ("num_layers", -1), ("num_kv_heads", 0), ("head_dim", -128),
     ("block_tokens", 0), ("block_tokens", 16.0), ("head_dim", "128")],
)
def test_bad_geometry_raises_usage_error_with_hint(field, value):
    with pytest.raises(UsageError) as info:
        KVGeometry(**{**GEOMETRY, field: value})
    assert field in info.value.message
    assert info.value.hint


@pytest.mark.parametrize("dtype", ["bf16", "float64", "", "fp8"])
def test_unknown_dtype_raises_usage_error_with_hint(dtype):
    with pytest.raises(UsageError) as info:
        KVGeometry(**GEOMETRY, dtype=dtype)
    assert info.value.hint and "bfloat16" in info.value.hint


# ---- fingerprint ------------------------------------------------------------------------------
def test_fingerprint_changes_with_every_field():
    base = ModelFingerprint("Qwen/Qwen3-0.6B", KVGeometry(28, 8, 128, 16, "bfloat16"))
    assert len(base.digest) == 16 and base.hex == base.digest.hex()
    # Stable across calls and across equal objects.
    assert base.digest == base.digest
    assert base.digest == ModelFingerprint("Qwen/Qwen3-0.6B", KVGeometry(28, 8, 128, 16, "bfloat16")).digest
    variants = [
        ModelFingerprint("Qwen/Qwen3-1.7B", base.geometry),
        ModelFingerprint("qwen/qwen3-0.6b", base.geometry),
        ModelFingerprint(base.model_id, KVGeometry(27, 8, 128, 16, "bfloat16")),
        ModelFingerprint(base.model_id, KVGeometry(28, 4, 128, 16, "bfloat16")),
        ModelFingerprint(base.model_id, KVGeometry(28, 8, 64, 16, "bfloat16")),
        ModelFingerprint(base.model_id, KVGeometry(28, 8, 128, 32, "bfloat16")),
        ModelFingerprint(base.model_id, KVGeometry(28, 8, 128, 16, "float16")),
        ModelFingerprint(base.model_id, KVGeometry(28, 8, 128, 16, "float8_e4m3fn")),
        ModelFingerprint(base.model_id, KVGeometry(28, 8, 128, 16, "float8_e5m2")),
    ]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == len(variants) + 1


def test_fingerprint_dict_round_trip():
    fp = ModelFingerprint("m/x", KVGeometry(2, 1, 64, 16, "float8_e5m2"))
    data = fp.to_dict()
    assert data["digest"] == fp.hex
    assert data["geometry"] == {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64,
                                "block_tokens": 16, "dtype": "float8_e5m2"}
    back = ModelFingerprint.from_dict(data)
    assert back == fp and back.digest == fp.digest
    assert KVGeometry.from_dict(fp.geometry.to_dict()) == fp.geometry
    # from_dict validates what it reads.
    with pytest.raises(UsageError):
        ModelFingerprint.from_dict({**data, "geometry": {**data["geometry"], "head_dim": 0}})
