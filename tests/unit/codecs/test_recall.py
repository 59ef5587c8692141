"""Where a lossy codec's recall falls (kvtier.codecs.recall), and who warns about it: the connector's
status warnings and kvtier doctor. Figures are real files: the ones kvtier ships, or a test's own
(``path``). Which runs may be shipped is the rig's rule (tests/rig/test_quality_figures.py)."""
from __future__ import annotations

import json

import pytest

from kvtier.codecs.recall import SHIPPED, falls_at, load_figures, recall_warning

FIGURES = {"per_codec": {
    "none": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.975,
             "model_needle_acc_32k": 0.5},
    "fp8": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.975,
            "model_needle_acc_32k": 0.2},  # past the model's reach: not the codec's fault
    "int4": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 0.9, "model_needle_acc_16k": 0.6},
    "int4-lc": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.97},
}}


@pytest.fixture
def figures_file(tmp_path):
    path = tmp_path / "model_needle.json"
    path.write_text(json.dumps(FIGURES))
    return path


def test_falls_at_the_first_length_more_than_a_point_below_the_baseline():
    assert falls_at("int4", FIGURES) == 4096
    assert falls_at("int4+zstd", FIGURES) == 4096  # zstd is lossless on top of int4
    assert falls_at("int4-lc", FIGURES) is None  # 0.97 vs 0.975: within one point
    assert falls_at("fp8", FIGURES) is None  # 0.2 vs 0.5 at 32k, where the model itself fails
    assert falls_at("int8", FIGURES) is None  # not measured: no claim


def test_warns_only_when_the_server_accepts_the_falling_length(figures_file):
    figures = load_figures(figures_file)
    text = recall_warning("int4", 32768, "cold", figures)
    assert text and "int4" in text and "4,096" in text and "0.90" in text and "int4-lc" in text
    assert str(figures_file) in text  # it names the figures it read
    assert recall_warning("int4", 2048, "cold", figures) is None  # contexts stop before recall falls
    assert recall_warning("int4-lc", 131072, figures=figures) is None
    assert recall_warning("none", 131072, figures=figures) is None
    assert recall_warning("int4", None, figures=figures) is None


def test_damaged_or_odd_figures_give_no_warning_and_never_fail(tmp_path, figures_file):
    figures_file.write_text("{not json")
    assert load_figures(figures_file) is None
    assert load_figures(tmp_path / "missing.json") is None
    figures_file.write_text(json.dumps({"per_codec": {"int4": {}}}))  # no baseline
    assert load_figures(figures_file) is None
    odd = {"per_codec": {"none": {"model_needle_acc_1k": 1.0, "model_needle_acc_huge": 1.0},
                         "int4": {"model_needle_acc_1k": "bad", "model_needle_acc_x": 0.1},
                         "fp8": ["not", "a", "dict"]}}
    figures_file.write_text(json.dumps(odd))
    doc = load_figures(figures_file)
    assert doc["source"] == str(figures_file)
    assert recall_warning("int4", 131072, figures=doc) is None and recall_warning("fp8", 131072, figures=doc) is None


def test_doctor_warns_from_the_configured_codecs_without_a_server(figures_file, monkeypatch):
    from kvtier.codecs import recall
    from kvtier.diagnose.doctor import recall_warnings

    monkeypatch.setattr(recall, "SHIPPED", figures_file)  # figures that show int4 falling
    warnings = recall_warnings(None, {"warm": "none", "cold": "int4"}, 32768)
    assert len(warnings) == 1 and warnings[0].startswith("cold codec int4:")
    assert recall_warnings(None, {"warm": "none", "cold": "int4-lc"}, 32768) == []
    # a running server speaks for itself (its codecs, its vLLM's max_model_len)
    server = {"status": {"warnings": {"cold_codec_recall": "cold codec int4: ...", "nvme": "disk full"}}}
    assert recall_warnings(server, {"cold": "fp8"}, 32768) == ["cold codec int4: ..."]


def test_the_constructed_models_figures_are_read_like_the_trained_ones():
    figures = {"per_codec": {"none": {"constructed_needle_acc_4k": 1.0, "constructed_needle_acc_128k": 1.0},
                             "int4": {"constructed_needle_acc_4k": 1.0, "constructed_needle_acc_128k": 0.7}}}
    assert falls_at("int4", figures) == 131072
    assert recall_warning("int4", 65536, figures=figures) is None
    assert "131,072" in recall_warning("int4", 131072, figures=figures)


def test_the_shipped_figures_reach_128k_on_the_constructed_model():
    """What kvtier ships is a full run on the constructed model to 128k, every product codec and the
    naive reference through the tier; no product codec falls, the reference does."""
    doc = load_figures()
    assert doc["source"] == str(SHIPPED)
    assert doc["_model_kind"] == "constructed" and max(doc["_lengths"]) == 131072
    assert doc["per_codec"]["none"]["constructed_needle_acc_128k"] >= 0.95
    for spec in ("fp8", "int8", "int4-lc"):
        assert falls_at(spec, doc) is None, spec
    assert falls_at("int4-naive", doc) is not None
