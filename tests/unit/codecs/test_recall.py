"""Where a lossy codec's recall falls (kvtier.codecs.recall), and who warns about it: the connector's
status warnings and kvtier doctor. Figures are real files in a real cache directory."""
from __future__ import annotations

import json

import pytest

from kvtier.codecs.recall import falls_at, load_figures, recall_warning, save_figures

FIGURES = {"per_codec": {
    "none": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.975,
             "model_needle_acc_32k": 0.5},
    "fp8": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.975,
            "model_needle_acc_32k": 0.2},  # past the model's reach: not the codec's fault
    "int4": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 0.9, "model_needle_acc_16k": 0.6},
    "int4-lc": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.97},
}}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_falls_at_the_first_length_more_than_a_point_below_the_baseline():
    assert falls_at("int4", FIGURES) == 4096
    assert falls_at("int4+zstd", FIGURES) == 4096  # zstd is lossless on top of int4
    assert falls_at("int4-lc", FIGURES) is None  # 0.97 vs 0.975: within one point
    assert falls_at("fp8", FIGURES) is None  # 0.2 vs 0.5 at 32k, where the model itself fails
    assert falls_at("int8", FIGURES) is None  # not measured: no claim


def test_warns_only_when_the_server_accepts_the_falling_length(cache):
    save_figures(FIGURES)
    text = recall_warning("int4", 32768, "cold")
    assert text and "int4" in text and "4,096" in text and "0.90" in text and "int4-lc" in text
    assert recall_warning("int4", 2048, "cold") is None  # contexts stop before recall falls
    assert recall_warning("int4-lc", 131072) is None
    assert recall_warning("none", 131072) is None
    assert recall_warning("int4", None) is None


def test_damaged_figures_fall_back_to_the_shipped_ones(cache):
    path = save_figures(FIGURES)
    path.write_text("{not json")
    doc = load_figures()
    assert doc is not None and doc["source"].endswith("model_needle.json") and "cache" not in doc["source"]
    assert set(doc["per_codec"]) >= {"none", "fp8", "int4", "int4-lc"}  # the figures shipped with kvtier


def test_doctor_warns_from_the_configured_codecs_without_a_server(cache):
    from kvtier.diagnose.doctor import recall_warnings

    save_figures(FIGURES)
    warnings = recall_warnings(None, {"warm": "none", "cold": "int4"}, 32768)
    assert len(warnings) == 1 and warnings[0].startswith("cold codec int4:")
    assert recall_warnings(None, {"warm": "none", "cold": "int4-lc"}, 32768) == []
    # a running server speaks for itself (its codecs, its vLLM's max_model_len)
    server = {"status": {"warnings": {"cold_codec_recall": "cold codec int4: ...", "nvme": "disk full"}}}
    assert recall_warnings(server, {"cold": "fp8"}, 32768) == ["cold codec int4: ..."]


def test_figures_file_round_trips(cache):
    path = save_figures({**FIGURES, "_lengths": [1024, 4096, 16384]})
    assert json.loads(path.read_text())["_lengths"] == [1024, 4096, 16384]
    assert load_figures()["source"] == str(path)


def test_odd_entries_in_a_figures_file_are_skipped_not_fatal(cache):
    save_figures({"per_codec": {"none": {"model_needle_acc_1k": 1.0, "model_needle_acc_huge": 1.0},
                                "int4": {"model_needle_acc_1k": "bad", "model_needle_acc_x": 0.1},
                                "fp8": ["not", "a", "dict"]}})
    assert recall_warning("int4", 131072) is None and recall_warning("fp8", 131072) is None


def test_the_constructed_models_figures_are_read_like_the_trained_ones():
    figures = {"per_codec": {"none": {"constructed_needle_acc_4k": 1.0, "constructed_needle_acc_128k": 1.0},
                             "int4": {"constructed_needle_acc_4k": 1.0, "constructed_needle_acc_128k": 0.7}}}
    assert falls_at("int4", figures) == 131072
    assert recall_warning("int4", 65536, figures=figures) is None
    assert "131,072" in recall_warning("int4", 131072, figures=figures)


def test_the_shipped_figures_reach_128k_on_the_constructed_model(cache):
    """What kvtier ships is issue 34's run: the constructed model to 128k, every product codec and
    the naive reference through the tier; no product codec falls, the reference does."""
    doc = load_figures()
    assert doc["_model_kind"] == "constructed" and max(doc["_lengths"]) == 131072
    assert doc["per_codec"]["none"]["constructed_needle_acc_128k"] >= 0.95
    for spec in ("fp8", "int8", "int4-lc"):
        assert falls_at(spec, doc) is None, spec
    assert falls_at("int4-naive", doc) is not None
