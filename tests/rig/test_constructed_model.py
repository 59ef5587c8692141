"""The constructed retrieval model (benchmarks.quality.constructed): its codes and previous-token
amplitudes, a build into a temp cache, retrieval by transformers' own forward from the saved bf16
checkpoint and in float32, the key statistics it was given; and that breaking a weight the circuit
depends on breaks retrieval while removing the key-statistics decorations does not."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.quality.constructed import (
    BUILD_LENGTH,
    HEAD_DIM,
    K_DIMS,
    OUTLIER_DIMS,
    PARAMS,
    V_DIMS,
    _free_dims,
    _load,
    constructed_info,
    constructed_model_dir,
    ensure_constructed_model,
    gold_codes,
    prev_token_amplitudes,
)
from benchmarks.quality.retrieval import accuracy, model_info

LENGTHS = (512, 1024)
TRIALS = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model: on a busy box two torch threads only contend (a forward 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("constructed-cache")
    path = ensure_constructed_model(cache_dir=cache, progress=None)
    assert path == constructed_model_dir(cache) and (path / ".complete").is_file()
    return path


@pytest.fixture
def model32(built):
    return _load(built, "float32")


def _accuracies(model) -> list[float]:
    return [accuracy(model, length, TRIALS, seed=31) for length in LENGTHS]


def test_gold_codes_are_distinct_with_coherence_one_quarter():
    words = gold_codes()
    gram = words @ words.T
    assert words.shape == (1024, 32) and set(np.unique(words)) == {-1.0, 1.0}
    off = gram[~np.eye(len(words), dtype=bool)]
    assert set(np.unique(off)) == {-8.0, 0.0, 8.0}  # never equal, never antipodal


def test_previous_token_amplitudes_keep_one_peak_over_all_distances():
    """Over a short range the max-min LP has a margin no worse than over 135k positions; check
    the returned gap is the true worst gap (recomputed independently) and that it is positive."""
    amps, gap = prev_token_amplitudes(PARAMS["rope_theta"], int(PARAMS["positional_pairs"]), positions=4096,
                                      rounds=3, steps=200)
    omega = PARAMS["rope_theta"] ** (-np.arange(len(amps)) / (HEAD_DIM // 2))
    d = np.array([0] + list(range(2, 4096)))
    scores = np.cos(np.outer(d - 1, omega)) @ amps
    assert abs(amps.sum() - 1) < 1e-9 and (amps >= 0).all()
    assert gap == pytest.approx(1 - scores.max(), abs=1e-9) and gap > 0.2


@pytest.mark.slow
def test_the_built_checkpoint_retrieves_in_bf16_and_float32(built, model32):
    info = constructed_info(built)
    assert info is not None and info["params"] == PARAMS
    assert info["hf_accuracy"]["float32"][str(BUILD_LENGTH)] >= 0.95
    assert info["hf_accuracy"]["bfloat16"][str(BUILD_LENGTH)] >= 0.95
    assert info["prev_token"]["worst_gap_fraction"] > 0.2
    assert model_info(built)["geometry"]["head_dim"] == HEAD_DIM  # what the needle benchmark reads
    bf16 = _load(built, "bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert min(_accuracies(bf16)) >= 0.95
    assert min(_accuracies(model32)) >= 0.95


@pytest.mark.slow
def test_the_keys_carry_outlier_channels_and_a_sink(built):
    stats = constructed_info(built)["key_statistics"]
    for layer in ("layer0", "layer1"):
        s = stats[layer]
        assert 10 <= s["outlier_to_median_channel"] <= 20, s
        assert 30 <= s["sink_to_median_norm"] <= 50, s
        assert s["outlier_sign_constancy"] == 1.0, s


@pytest.mark.slow
def test_breaking_the_previous_token_head_breaks_retrieval(model32):
    model32.model.layers[0].self_attn.o_proj.weight.data.zero_()
    assert max(_accuracies(model32)) <= 0.2


@pytest.mark.slow
def test_scrambling_the_induction_query_breaks_retrieval(model32):
    q = model32.model.layers[1].self_attn.q_proj.weight.data
    slow = K_DIMS + V_DIMS
    q[slow] = q[list(np.random.default_rng(0).permutation(slow))].clone()
    assert max(_accuracies(model32)) <= 0.2


@pytest.mark.slow
def test_outliers_sink_and_noise_do_not_carry_the_circuit(model32):
    """Zeroing every key dim where the query is zero (noise, outlier channels, the sink) keeps
    retrieval exact: they are there for the quantizers, not for the model."""
    for layer, block in enumerate(model32.model.layers):
        k = block.self_attn.k_proj.weight.data
        for head in range(2):
            dims = _free_dims(layer, head, PARAMS)
            assert set(OUTLIER_DIMS) <= set(dims)
            k[[head * HEAD_DIM + d for d in dims]] = 0.0
    assert min(_accuracies(model32)) >= 0.95
