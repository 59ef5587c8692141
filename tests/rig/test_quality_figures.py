"""Which model-needle figures may be shipped (benchmarks.quality.figures): a full run whose codecs'
loads are recorded; a quick, small or silently unloaded run never replaces what kvtier ships."""
from __future__ import annotations

import json

from benchmarks.quality.figures import FULL_LENGTHS, FULL_TRIALS, loaded_problems, run_problems, ship_figures
from kvtier.codecs.recall import SHIPPED, load_figures, recall_warning


def full_run(per_codec: dict, lengths=(1024, 4096, 16384, 32768), loaded: int = 640) -> dict:
    """A full run's figures as the bench makes them: every shipped length measured, 40 trials each,
    every codec's blocks loaded (``direct``: none, it runs without the tier)."""
    return {"per_codec": {spec: entry if spec == "direct" else {**entry, "_loaded_blocks": loaded,
                                                                 "_expected_blocks": 640}
                          for spec, entry in per_codec.items()},
            "_lengths": sorted(set(lengths) | set(FULL_LENGTHS)), "_trials_per_length": FULL_TRIALS,
            "_haystacks_per_length": 8}


FALLING_INT4_LC = {"none": {"model_needle_acc_4k": 1.0, "model_needle_acc_32k": 1.0},
                   "int4-lc": {"model_needle_acc_4k": 0.5, "model_needle_acc_32k": 0.4}}


def test_a_full_checked_run_is_shipped_and_read(tmp_path):
    target = tmp_path / "model_needle.json"
    shipped, problems = ship_figures(full_run(FALLING_INT4_LC), quick=False, path=target)
    assert problems == [] and shipped == target and json.loads(target.read_text())["_quick"] is False
    assert "int4-lc" in recall_warning("int4-lc", 131072, figures=load_figures(target))


def test_a_quick_run_is_never_shipped(tmp_path):
    """What ``python -m benchmarks quality --quick`` makes: 10 trials at 4k and 32k."""
    target = tmp_path / "model_needle.json"
    quick = {**full_run(FALLING_INT4_LC), "_lengths": [4096, 32768], "_trials_per_length": 10}
    shipped, problems = ship_figures(quick, quick=True, path=target)
    why = " ".join(problems)
    assert shipped is None and not target.exists()
    assert "a --quick run" in why and "10 trials" in why and "64k, 128k" in why
    small = full_run(FALLING_INT4_LC)  # not --quick, but 2 haystacks: weaker than what is shipped
    small["_trials_per_length"] = 10
    assert ship_figures(small, quick=False, path=target)[0] is None and not target.exists()


def test_a_run_whose_codec_loaded_nothing_is_never_shipped(tmp_path):
    """int4's loads silently did not happen: its accuracy is the full-precision model's and would hide
    a fall. So is a run with no record of loads at all."""
    target = tmp_path / "model_needle.json"
    silent = full_run({"none": {"model_needle_acc_4k": 1.0}, "int4": {"model_needle_acc_4k": 1.0}})
    silent["per_codec"]["int4"]["_loaded_blocks"] = 0
    shipped, problems = ship_figures(silent, quick=False, path=target)
    assert shipped is None and problems == ["int4: 0 of 640 blocks loaded through its decoder"]
    unrecorded = {**silent, "per_codec": {"none": {"model_needle_acc_4k": 1.0}, "int4": {"model_needle_acc_4k": 1.0}}}
    assert ship_figures(unrecorded, quick=False, path=target)[0] is None and not target.exists()


def test_loaded_problems_read_the_recorded_counts():
    assert loaded_problems(full_run({"direct": {"model_needle_acc_4k": 1.0}, "none": {}, "int4": {}})) == []
    assert loaded_problems(full_run({"none": {}, "int4": {}}, loaded=639)) == [
        "none: 639 of 640 blocks loaded through its decoder", "int4: 639 of 640 blocks loaded through its decoder"]
    assert loaded_problems({"per_codec": {"none": {"_loaded_blocks": 0, "_expected_blocks": 0}}}) != []
    assert loaded_problems({"per_codec": {"int4": {}}}) != []  # no baseline


def test_what_kvtier_ships_passes_the_rule_a_full_bench_run_meets():
    from benchmarks.quality.needle import DEPTHS, NEEDLE_LENGTHS

    shipped = json.loads(SHIPPED.read_text())
    assert run_problems(shipped) == []
    assert tuple(shipped["_lengths"]) == FULL_LENGTHS == NEEDLE_LENGTHS["constructed"][0]
    assert shipped["_trials_per_length"] == FULL_TRIALS == 8 * len(DEPTHS)  # the bench's default haystacks
    assert run_problems({**shipped, "_quick": True}) == ["a --quick run"]
