"""Where a lossy codec's recall falls (kvtier.codecs.recall), and who warns about it: the connector's
status warnings and kvtier doctor. Figures are real files in a real cache directory; a run on this box
replaces the shipped figures only as a full run whose codecs' loads are recorded (issue 45)."""
from __future__ import annotations

import json

import pytest

from kvtier.codecs.recall import (
    FULL_LENGTHS,
    FULL_TRIALS,
    SHIPPED,
    falls_at,
    keep_figures,
    load_figures,
    loaded_problems,
    recall_warning,
    run_problems,
    save_figures,
)


def full_run(per_codec: dict, lengths=(1024, 4096, 16384, 32768), loaded: int = 640) -> dict:
    """A full run's figures as the bench keeps them: every shipped length measured, 40 trials each,
    every codec's blocks loaded (``direct``: none, it runs without the tier)."""
    return {"per_codec": {spec: entry if spec == "direct" else {**entry, "_loaded_blocks": loaded,
                                                                 "_expected_blocks": 640}
                          for spec, entry in per_codec.items()},
            "_lengths": sorted(set(lengths) | set(FULL_LENGTHS)), "_trials_per_length": FULL_TRIALS,
            "_haystacks_per_length": 8, "_quick": False, "_full_run": True}


FIGURES = full_run({
    "none": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.975,
             "model_needle_acc_32k": 0.5},
    "fp8": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.975,
            "model_needle_acc_32k": 0.2},  # past the model's reach: not the codec's fault
    "int4": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 0.9, "model_needle_acc_16k": 0.6},
    "int4-lc": {"model_needle_acc_1k": 1.0, "model_needle_acc_4k": 1.0, "model_needle_acc_16k": 0.97},
})


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
    path = save_figures({**FIGURES, "_seed": 7})
    assert json.loads(path.read_text())["_seed"] == 7
    doc = load_figures()
    assert doc["source"] == str(path) and "ignored" not in doc


def test_odd_entries_in_a_figures_file_are_skipped_not_fatal(cache):
    path = save_figures(full_run({"none": {"model_needle_acc_1k": 1.0, "model_needle_acc_huge": 1.0},
                                  "int4": {"model_needle_acc_1k": "bad", "model_needle_acc_x": 0.1}}))
    assert load_figures()["source"] == str(path)
    assert recall_warning("int4", 131072) is None
    doc = json.loads(path.read_text())
    doc["per_codec"]["fp8"] = ["not", "a", "dict"]  # no record of its loads: the whole file is not read
    path.write_text(json.dumps(doc))
    assert load_figures()["source"] == str(SHIPPED)
    assert recall_warning("fp8", 131072) is None


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


# issue 45: figures a silent failure would leave looking good are never read

FALLING_INT4_LC = {"none": {"model_needle_acc_4k": 1.0, "model_needle_acc_32k": 1.0},
                   "int4-lc": {"model_needle_acc_4k": 0.5, "model_needle_acc_32k": 0.4}}


def test_a_quick_run_saved_on_this_box_never_replaces_the_shipped_figures(cache):
    """What ``kvtier bench quality --quick`` saved before: 10 trials at 4k and 32k. It showed int4-lc
    falling at 4k; the shipped run (40 trials to 128k) says it does not, and is what is read."""
    quick = {**full_run(FALLING_INT4_LC, lengths=(4096, 32768)), "_lengths": [4096, 32768], "_trials_per_length": 10,
             "_haystacks_per_length": 2, "_quick": True, "_full_run": False}
    path = save_figures(quick)
    doc = load_figures()
    assert doc["source"] == str(SHIPPED)
    assert recall_warning("int4-lc", 131072) is None
    why = " ".join(doc["ignored"][str(path)])
    assert "not a full run" in why and "10 trials" in why and "64k, 128k" in why


def test_a_saved_run_whose_codec_loaded_nothing_is_not_read(cache):
    """A full-sized run in which int4's loads silently did not happen: its accuracy is the full-precision
    model's, so it would hide a fall. The file is not read; so is one without any record of loads."""
    silent = full_run({"none": {"model_needle_acc_4k": 1.0}, "int4": {"model_needle_acc_4k": 1.0},
                       "int4-lc": {"model_needle_acc_4k": 0.5}})
    silent["per_codec"]["int4"]["_loaded_blocks"] = 0
    path = save_figures(silent)
    doc = load_figures()
    assert doc["source"] == str(SHIPPED) and "int4: 0 of 640 blocks loaded" in doc["ignored"][str(path)][0]
    unrecorded = {**silent, "per_codec": {"none": {"model_needle_acc_4k": 1.0},
                                          "int4-lc": {"model_needle_acc_4k": 0.5}}}
    save_figures(unrecorded)  # an old file, or one hand-written: no _loaded_blocks at all
    assert load_figures()["source"] == str(SHIPPED)
    assert recall_warning("int4-lc", 131072) is None


def test_loaded_problems_read_the_recorded_counts():
    assert loaded_problems(full_run({"direct": {"model_needle_acc_4k": 1.0}, "none": {}, "int4": {}})) == []
    assert loaded_problems(full_run({"none": {}, "int4": {}}, loaded=639)) == [
        "none: 639 of 640 blocks loaded through its decoder", "int4: 639 of 640 blocks loaded through its decoder"]
    assert loaded_problems({"per_codec": {"none": {"_loaded_blocks": 0, "_expected_blocks": 0}}}) != []
    assert loaded_problems({"per_codec": {"int4": {}}}) != []  # no baseline


def test_only_a_full_run_is_kept_and_a_quick_one_leaves_it_in_place(cache):
    full = full_run(FALLING_INT4_LC)
    kept, problems = keep_figures(full, quick=False)
    assert problems == [] and kept is not None and full["_full_run"] is True and full["_quick"] is False
    assert load_figures()["source"] == str(kept) and "int4-lc" in recall_warning("int4-lc", 131072)
    quick = {**full_run(FALLING_INT4_LC), "_lengths": [4096, 32768], "_trials_per_length": 10}
    assert keep_figures(quick, quick=True)[0] is None and quick["_full_run"] is False
    small = full_run(FALLING_INT4_LC)  # not --quick, but 2 haystacks: not as strong as what is kept
    small["_trials_per_length"] = 10
    kept_small, problems = keep_figures(small, quick=False)
    assert kept_small is None and small["_full_run"] is False and "10 trials" in problems[0]
    assert load_figures()["per_codec"] == full["per_codec"]  # the full run's figures stay


def test_the_full_run_rule_is_the_shipped_runs_size():
    """The shipped run is a full run (its marker aside: it predates the marker), and its codecs'
    loads are recorded; a full run of the bench (default lengths and haystacks) meets the rule."""
    from kvtier.bench.vllm.needle import DEPTHS, NEEDLE_LENGTHS

    shipped = json.loads(SHIPPED.read_text())
    assert loaded_problems(shipped) == []
    assert run_problems({**shipped, "_quick": False, "_full_run": True}) == []
    assert tuple(shipped["_lengths"]) == FULL_LENGTHS == NEEDLE_LENGTHS["constructed"][0]
    assert shipped["_trials_per_length"] == FULL_TRIALS == 8 * len(DEPTHS)  # bench quality's default haystacks
    assert run_problems({**shipped, "_quick": True, "_full_run": False})  # the marker is required of a saved run
