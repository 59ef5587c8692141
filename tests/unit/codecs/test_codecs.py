"""Codecs: round trips with error bounds per codec, dtype and layout; the numba path against the
torch reference; metadata versioning; and the codecs wired through the tiers (warm slots, demote
to another cold codec, mixed-codec snapshots, restores) on a real TierEngine with NVMe files."""
from __future__ import annotations

import os

import pytest
import torch
from support.engine import make_engine

from kvtier.codecs import get_codec, parse_spec, resolve_codec, transcode
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.layout import KVGeometry, ModelFingerprint, adapter_for
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of

LOSSY = ["fp8", "fp8:e5m2", "fp8:head", "int8", "int4", "int4:g32", "int4-lc", "int4-lc:g32"]
ALL = ["none", "none+zstd"] + LOSSY + ["fp8+zstd", "int4-lc+zstd"]
# relative MSE bounds on Gaussian KV with one outlier key channel (measured values are ~3-10x lower)
REL_MSE_BOUND = {"fp8": 3e-3, "fp8:e5m2": 1e-2, "fp8:head": 5e-2, "int8": 1e-3, "int4": 3e-2,
                 "int4:g32": 3e-2, "int4-lc": 1e-2, "int4-lc:g32": 1e-2}


def kv_block(geometry: KVGeometry, seed: int = 0, outlier: float = 20.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(geometry.block_shape, generator=gen)
    x[:, :, 0, :, 3] *= outlier  # keys carry outlier channels
    return x.to(getattr(torch, geometry.dtype))


def roundtrip(spec: str, block: torch.Tensor, first: bool = False) -> tuple[torch.Tensor, int]:
    codec = get_codec(spec)
    layers, heads, _, tokens, dim = block.shape
    geometry = KVGeometry(layers, heads, dim, tokens, str(block.dtype).removeprefix("torch."))
    buf = torch.empty(codec.max_bytes(geometry), dtype=torch.uint8)
    n = codec.encode(block, buf, first=first)
    out = torch.empty_like(block)
    codec.decode(buf[:n].clone(), out)
    return out, n


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()) ** 2).mean() / (b.float() ** 2).mean())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("spec", ALL)
def test_roundtrip_error_bounds(spec, dtype):
    geometry = KVGeometry(2, 2, 64, 128, dtype)
    block = kv_block(geometry)
    out, n = roundtrip(spec, block)
    if not get_codec(spec).lossy:
        assert torch.equal(out, block)
        return
    assert rel_mse(out, block) < REL_MSE_BOUND[spec.partition("+")[0]]
    assert n <= get_codec(spec).max_bytes(geometry)


@pytest.mark.parametrize("spec", LOSSY)
def test_elementwise_bounds(spec):
    """Per element: fp8 within half a float8 step of its row's scale, int8/int4 within half a step."""
    geometry = KVGeometry(2, 2, 64, 128, "float32")
    block = kv_block(geometry, seed=3)
    out, _ = roundtrip(spec, block)
    err = (out - block).abs()
    if spec.startswith("fp8"):
        mantissa = 2 if "e5m2" in spec else 3
        assert bool((err <= block.abs() * 2.0 ** -(mantissa + 1) + 1e-3 * block.abs().max()).all())
    elif spec == "int8":
        amax = block.abs().amax(-1, keepdim=True)
        assert bool((err <= amax / 254 * 1.001 + 1e-7).all())
    else:  # int4: half a step of the key channel group / value token group (+ fp16 rounding of the step)
        k, v = block[:, :, 0], block[:, :, 1]
        g = 32 if "g32" in spec else 64
        kr = k.reshape(2, 2, 128 // g, g, 64)
        k_step = (kr.amax(3) - kr.amin(3)) / 15
        k_bound = (k_step / 2 * 1.01 + 1e-3 * k_step).repeat_interleave(g, dim=2)
        assert bool((err[:, :, 0] <= k_bound + 1e-4).all())
        vr = v.reshape(2, 2, 128, 64 // g, g)
        v_step = ((vr.amax(4) - vr.amin(4)) / 15).repeat_interleave(g, dim=3)
        assert bool((err[:, :, 1] <= v_step / 2 * 1.01 + 1e-4).all())


@pytest.mark.parametrize("layout", ["cpu", "kv_first", "block_first", "head_split"])
@pytest.mark.parametrize("spec", ["fp8", "int4-lc"])
def test_roundtrip_through_each_layout(layout, spec):
    """HBM (in each vLLM layout) -> gather -> encode -> decode -> scatter gives the codec's block."""
    geometry = KVGeometry(2, 2, 64, 16, "bfloat16")
    adapter = adapter_for(layout, geometry)
    torch.manual_seed(1)
    layers = [torch.randn(adapter.layer_shape(8)).to(torch.bfloat16) for _ in range(2)]
    staged = torch.empty((1, *geometry.block_shape), dtype=torch.bfloat16)
    adapter.gather(layers, [3], staged)
    expected, _ = roundtrip(spec, staged[0])
    restored, _ = roundtrip(spec, staged[0])
    adapter.scatter(restored[None], layers, [5])
    back = torch.empty_like(staged)
    adapter.gather(layers, [5], back)
    assert torch.equal(back[0], expected)
    assert rel_mse(back[0], staged[0]) < REL_MSE_BOUND[spec]


NUMBA_CHECK = """
import json, os, sys
import torch
from kvtier.codecs import fast, get_codec
from kvtier.layout import KVGeometry
assert fast.available(), "numba kernels did not load"
gen = torch.Generator().manual_seed(5)
geometry = KVGeometry(3, 2, 64, 128, "bfloat16")
block = torch.randn(geometry.block_shape, generator=gen)
block[:, :, 0, :, 3] *= 20
block = block.to(torch.bfloat16)
same = {}
for spec in sys.argv[1:]:
    codec = get_codec(spec)
    buf = torch.empty(codec.max_bytes(geometry), dtype=torch.uint8)
    payload = buf[: codec.encode(block, buf, first=True)]
    fast.use_kernels(True)
    with_numba = torch.empty_like(block)
    codec.decode(payload, with_numba)
    fast.use_kernels(False)  # the torch reference path
    reference = torch.empty_like(block)
    codec.decode(payload, reference)
    same[spec] = torch.equal(with_numba.view(torch.int16), reference.view(torch.int16))
print(json.dumps(same))
"""


def test_numba_kernels_match_torch_reference_bit_for_bit():
    """In a subprocess: this test process keeps numba out (see conftest.py)."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("numba") is None:  # find, not import: numba stays out of this process
        pytest.skip("numba is not installed: only the torch path exists")
    specs = ["fp8", "fp8:e5m2", "fp8:head", "int8", "int4", "int4-lc"]
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_NO_NUMBA"}
    out = subprocess.run([sys.executable, "-c", NUMBA_CHECK, *specs], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {spec: True for spec in specs}


def test_int4_lc_keeps_sinks_and_outlier_channels_exact():
    geometry = KVGeometry(2, 2, 64, 128, "bfloat16")
    block = kv_block(geometry, outlier=50.0)
    first, n_first = roundtrip("int4-lc", block, first=True)
    later, n_later = roundtrip("int4-lc", block, first=False)
    assert n_first > n_later  # only the first block of a sequence carries the sinks
    assert torch.equal(first[:, :, :, :4], block[:, :, :, :4])
    assert not torch.equal(later[:, :, :, :4], block[:, :, :, :4])
    assert torch.equal(later[:, :, 0, :, 3], block[:, :, 0, :, 3])  # the outlier key channel
    plain, _ = roundtrip("int4", block)
    assert rel_mse(later, block) < rel_mse(plain, block) / 2


def test_sizes_against_bf16():
    geometry = KVGeometry(16, 4, 64, 128, "bfloat16")
    size = {spec: get_codec(spec).nbytes_for(geometry) / geometry.block_bytes for spec in LOSSY}
    assert size["fp8"] <= 0.52 and size["int4"] <= 0.30
    assert get_codec("int4-lc").nbytes_for(geometry, first=True) > get_codec("int4-lc").nbytes_for(geometry)


# ---- metadata versioning ---------------------------------------------------------------------
def _payload(spec: str, geometry: KVGeometry, first: bool = False) -> torch.Tensor:
    codec = get_codec(spec)
    buf = torch.empty(codec.max_bytes(geometry), dtype=torch.uint8)
    return buf[: codec.encode(kv_block(geometry), buf, first=first)].clone()


@pytest.mark.parametrize("written, read", [("fp8", "fp8:e5m2"), ("fp8:e5m2", "fp8"), ("int4", "int4-lc"),
                                           ("int4-lc", "int4"), ("int4:g32", "int4"), ("int8", "fp8"),
                                           ("fp8:head", "fp8"), ("int4", "int8")])
def test_a_block_is_never_decoded_by_another_codec(written, read):
    geometry = KVGeometry(2, 2, 64, 128, "bfloat16")
    payload = _payload(written, geometry)
    with pytest.raises(CorruptBlockError):
        get_codec(read).decode(payload, torch.empty(geometry.block_shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("spec", ["fp8", "int8", "int4-lc", "fp8+zstd"])
@pytest.mark.parametrize("fault", ["version", "truncate", "extend"])
def test_damaged_payloads_are_refused(spec, fault):
    geometry = KVGeometry(2, 2, 64, 128, "bfloat16")
    payload = _payload(spec, geometry)
    if fault == "version":
        if spec.endswith("zstd"):
            payload[len(payload) // 2] ^= 0xFF  # inside the compressed frame
        else:
            payload[2] = 99
    elif fault == "truncate":
        payload = payload[:-8]
    else:
        payload = torch.cat([payload, torch.zeros(8, dtype=torch.uint8)])
    with pytest.raises(CorruptBlockError):
        get_codec(spec).decode(payload, torch.empty(geometry.block_shape, dtype=torch.bfloat16))


def test_specs_parse_and_bad_specs_have_a_hint():
    assert parse_spec("FP8:E4M3") == "fp8"
    assert parse_spec("int4:g64") == "int4"
    assert parse_spec("int4-lc:g32+zstd") == "int4-lc:g32+zstd"
    for bad in ("int3", "fp8:e3m4", "int4:g7", "zstd", "int4+lz5", ""):
        with pytest.raises(ConfigError) as err:
            parse_spec(bad)
        assert "fp8" in err.value.hint


def test_fp8_kv_cache_is_stored_as_is():
    geometry = KVGeometry(2, 2, 64, 16, "uint8")
    assert resolve_codec("fp8", geometry) == "none"
    assert resolve_codec("fp8+zstd", geometry) == "none+zstd"
    with pytest.raises(ConfigError) as err:
        resolve_codec("int4", geometry, "cold")
    assert "--cold-codec" in err.value.hint


def test_transcode_equals_decode_then_encode():
    geometry = KVGeometry(2, 2, 64, 128, "bfloat16")
    block = kv_block(geometry)
    fp8 = _payload("fp8", geometry)
    out = torch.empty(get_codec("int4-lc").max_bytes(geometry), dtype=torch.uint8)
    n = transcode(fp8, "fp8", "int4-lc", geometry, out, first=True)
    via, _ = roundtrip("fp8", block)
    expected = torch.empty(get_codec("int4-lc").max_bytes(geometry), dtype=torch.uint8)
    m = get_codec("int4-lc").encode(via, expected, first=True)
    assert n == m and torch.equal(out[:n], expected[:m])
    assert get_codec("int4-lc").is_first(out[:n])


# ---- through the tiers -----------------------------------------------------------------------
def keys_of(seed: int, blocks: int) -> list[bytes]:
    return chain_block_hashes(list(range(seed * 10_000, seed * 10_000 + blocks * 16)), 16)


def expected_blocks(engine, hbm, block_ids, *specs, first_id=None):
    """What HBM blocks ``block_ids`` look like after passing through ``specs`` in turn."""
    geometry = engine.fingerprint.geometry
    adapter = adapter_for("cpu", geometry)
    staged = torch.empty((len(block_ids), *geometry.block_shape), dtype=torch.bfloat16)
    adapter.gather(hbm, block_ids, staged)
    out = []
    for i, block in enumerate(staged):
        for spec in specs:
            block, _ = roundtrip(spec, block, first=block_ids[i] == first_id)
        out.append(block)
    return out


def loaded_blocks(engine, hbm, block_ids):
    geometry = engine.fingerprint.geometry
    staged = torch.empty((len(block_ids), *geometry.block_shape), dtype=torch.bfloat16)
    adapter_for("cpu", geometry).gather(hbm, block_ids, staged)
    return list(staged)


def test_warm_codec_multiplies_dram_capacity_and_loads_decoded(fingerprint, hbm, tmp_path):
    plain = make_engine(fingerprint, hbm, tmp_path / "a", dram_blocks=8)
    fp8 = make_engine(fingerprint, hbm, tmp_path / "b", dram_blocks=8, warm_codec="fp8")
    assert fp8.manager.table.slots.num_slots >= 1.8 * plain.manager.table.slots.num_slots
    ns = namespace_of(fingerprint.digest)
    keys = keys_of(1, 4)
    expected = expected_blocks(fp8, hbm, [0, 1, 2, 3], "fp8")
    assert fp8.store("s", ns, keys, [0, 1, 2, 3]) == 4
    assert fp8.load(ns, keys, [20, 21, 22, 23]) == 4
    for got, want in zip(loaded_blocks(fp8, hbm, [20, 21, 22, 23]), expected):
        assert torch.equal(got, want)
    info = fp8.manager.views.session_info("s")
    assert info["bytes_dram"] == 4 * get_codec("fp8").nbytes_for(fingerprint.geometry)


def test_demote_to_another_cold_codec_and_restart(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, warm_codec="fp8", cold_codec="int4-lc+zstd")
    ns = namespace_of(fingerprint.digest)
    keys = keys_of(2, 4)
    engine.store("s", ns, keys, [0, 1, 2, 3])
    expected = expected_blocks(engine, hbm, [0, 1, 2, 3], "fp8", "int4-lc", first_id=0)
    engine.evict("s", Tier.NVME)
    engine.close()
    restarted = make_engine(fingerprint, hbm, tmp_path, warm_codec="fp8", cold_codec="int4-lc+zstd")
    assert restarted.load(ns, keys, [30, 31, 32, 33]) == 4
    for got, want in zip(loaded_blocks(restarted, hbm, [30, 31, 32, 33]), expected):
        assert torch.equal(got, want)
    # the files say which codec wrote them
    nbytes, codec = restarted.nvme.read_into(ns, keys[1], torch.empty(1 << 20, dtype=torch.uint8),
                                             fingerprint.digest)
    assert codec == "int4-lc+zstd" and nbytes < 0.45 * fingerprint.geometry.block_bytes  # 16-token blocks


def test_snapshot_with_mixed_codecs_restores_bit_identical(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path / "one", dram_blocks=8, warm_codec="fp8", cold_codec="int8")
    ns = namespace_of(fingerprint.digest)
    keys = keys_of(3, 4)
    engine.manager.planner.record_session("s", ns, keys, 64, token_ids=list(range(30_000, 30_064)))  # keys_of(3, 4)'s
    engine.store("s", ns, keys[:2], [0, 1])
    engine.evict("s", Tier.NVME)  # blocks 0-1 now int8 on NVMe only
    engine.store("s", ns, keys, [0, 1, 2, 3])  # blocks 2-3 fp8 in DRAM
    result = engine.snapshot("s", tmp_path / "s.kvts")
    assert result.ok, result.error
    from kvtier.persist.snapshot import open_snapshot

    assert open_snapshot(tmp_path / "s.kvts").codec == "int8"
    # blocks 0-1 went fp8 -> int8 when demoted, blocks 2-3 fp8 -> int8 when snapshotted
    expected = expected_blocks(engine, hbm, [0, 1, 2, 3], "fp8", "int8")
    # int8 blocks do not fit this engine's int4 warm slots: they are restored to NVMe as they are
    fresh = make_engine(fingerprint, hbm, tmp_path / "two", dram_blocks=8, warm_codec="int4")
    assert fresh.restore(tmp_path / "s.kvts").ok
    assert fresh.manager.views.session_info("s")["blocks_nvme"] == 4
    assert fresh.load(ns, keys, [40, 41, 42, 43]) == 4
    for got, want in zip(loaded_blocks(fresh, hbm, [40, 41, 42, 43]), expected):
        assert torch.equal(got, want)


def test_promote_transcodes_blocks_too_big_for_a_warm_slot(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, warm_codec="int4", cold_codec="none")
    ns = namespace_of(fingerprint.digest)
    keys = keys_of(4, 3)
    engine.store("s", ns, keys, [0, 1, 2])
    engine.evict("s", Tier.NVME)  # int4 slots -> decoded to raw bf16 on NVMe
    expected = expected_blocks(engine, hbm, [0, 1, 2], "int4", "int4")
    engine.pin("s", Tier.DRAM)  # promote: a raw block does not fit an int4 slot, so it is re-encoded
    info = engine.manager.views.session_info("s")
    assert info["blocks_dram"] == 3
    assert info["bytes_dram"] == 3 * get_codec("int4").nbytes_for(fingerprint.geometry)
    assert engine.load(ns, keys, [50, 51, 52]) == 3
    for got, want in zip(loaded_blocks(engine, hbm, [50, 51, 52]), expected):
        assert torch.equal(got, want)


def test_unknown_codec_in_settings_is_refused(fingerprint, hbm, tmp_path):
    with pytest.raises(ConfigError):
        make_engine(fingerprint, hbm, tmp_path, warm_codec="int2")
    assert os.listdir(tmp_path) in ([], ["nvme"])


def test_stats_report_tokens_per_gib_per_tier():
    from kvtier.plan.manager import TierManager

    mid = ModelFingerprint("mid", KVGeometry(16, 4, 64, 128, "bfloat16"))  # 2 MiB blocks
    plain = TierManager(mid, 1 << 30, 1 << 34).views.stats()
    packed = TierManager(mid, 1 << 30, 1 << 34, warm_codec="fp8", cold_codec="int4").views.stats()
    assert plain["dram"]["tokens_per_gib"] == plain["hbm"]["tokens_per_gib"] == 65536  # 16 KiB per token
    assert packed["dram"]["codec"] == "fp8" and packed["nvme"]["codec"] == "int4"
    assert packed["dram"]["tokens_per_gib"] >= 1.9 * plain["dram"]["tokens_per_gib"]
    assert packed["nvme"]["tokens_per_gib"] >= 3.3 * plain["nvme"]["tokens_per_gib"]
    fp8_cache = TierManager(ModelFingerprint("mid", KVGeometry(16, 4, 64, 128, "uint8")), 1 << 30).views.stats()
    assert fp8_cache["hbm"]["tokens_per_gib"] == 2 * plain["hbm"]["tokens_per_gib"]  # vLLM's fp8 KV


def test_needle_harness_detects_a_broken_codec():
    from benchmarks.quality.synthetic import needle_accuracy, quantizer_for

    exact = needle_accuracy(lambda keys, first=False: keys, 1024, 30)
    good = needle_accuracy(quantizer_for("int4-lc"), 1024, 30)
    naive = needle_accuracy(quantizer_for("int4-naive"), 1024, 30)

    def broken(keys, first=False):  # a codec that loses the low byte of every value
        return (keys.view(torch.int16) & ~0xFF).view(torch.bfloat16)

    assert exact == 1.0 and good >= 0.95
    assert naive < 0.8 and needle_accuracy(broken, 1024, 30) < 0.8


def test_reconstruction_figures_order_codecs_sensibly():
    from benchmarks.quality.synthetic import reconstruction
    from kvtier.bench.codecs import synthetic_blocks

    blocks = synthetic_blocks(KVGeometry(2, 2, 64, 128), 2, seed=4)
    fp8, int8, int4 = (reconstruction(spec, blocks) for spec in ("fp8", "int8", "int4"))
    assert int8["rel_mse_k"] < fp8["rel_mse_k"] < int4["rel_mse_k"]
    assert 0.5 < fp8["size_ratio"] < 0.52 and int4["size_ratio"] < 0.3
    assert reconstruction("int4-lc", blocks)["rel_mse_k"] < int4["rel_mse_k"] / 3
