"""Figures from per-request records, the summary ratios, the picture, and the sizes of a run."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtier.bench.agents.arms import parse_arms
from kvtier.bench.agents.regimes import Sizes, check_box, kv_bytes_per_token, regime_trace
from kvtier.bench.agents.report import (
    AGENT_KEYS,
    COLOURS,
    combine_seeds,
    hinted_ratio,
    plot_cdfs,
    summarize,
    summary_keys,
    tables,
    verdict,
)
from kvtier.bench.agents.trace import AgentMix, unique_tokens
from kvtier.errors import UsageError

MiB = 1 << 20


def _record(session, turn, ttft, long_pause=False, hinted=False, error=None):
    return {"session": session, "turn": turn, "ttft_s": ttft, "itl_s": [0.01, 0.02], "e2e_s": (ttft or 0) + 0.03,
            "chunks": 3, "long_pause": long_pause, "hinted": hinted, "ready_s": 0.0, "sent_s": 0.1,
            "error": error, "text": "x"}


def test_percentiles_split_first_later_and_resumed_turns():
    records = [_record("a", 1, 1.0), _record("a", 2, 0.1), _record("a", 3, 0.3, long_pause=True),
               _record("b", 1, 2.0), _record("b", 2, None, error="HTTP 500")]
    counters = {"recomputed_tokens": 300.0, "engine_hit_tokens": 600.0, "loaded_tokens": 100.0}
    f = summarize(records, counters, wall_s=2.0, nominal_s=4.0, rss_peak=5, disk_bytes=7)
    assert f["errors"] == 1 and f["requests"] == 5
    assert f["ttft_first_p50"] == pytest.approx(1.5) and f["ttft_first_n"] == 2
    assert f["ttft_later_p50"] == pytest.approx(0.2) and f["ttft_resumed_p50"] == pytest.approx(0.3)
    assert f["ttft_all_p99"] == pytest.approx(np.percentile([1.0, 0.1, 0.3, 2.0], 99))
    assert f["itl_p50"] == pytest.approx(0.015)
    assert f["requests_per_s"] == 2.0 and f["target_requests_per_s"] == 1.25
    assert f["engine_hit_rate"] == pytest.approx(0.6) and f["loaded_hit_rate"] == pytest.approx(0.1)


def test_seeds_combine_to_a_median_and_a_range():
    combined = combine_seeds([{"x": 1.0, "y": None}, {"x": 3.0, "y": None}, {"x": 2.0, "y": None}])
    assert combined == {"x": 2.0, "x_min": 1.0, "x_max": 3.0, "y": None}


def test_summary_keys_are_kvtier_over_vllm_and_the_floor():
    def regimes(later, first, itl, recomputed, resumed):
        return {str(r): {"ttft_all_p50": later, "ttft_all_p99": 2 * later, "ttft_later_p50": later,
                         "ttft_later_p99": 2 * later, "ttft_first_p50": first * r, "ttft_resumed_p50": resumed,
                         "itl_p50": itl, "itl_p99": 2 * itl, "recomputed_tokens": recomputed, "errors": 0}
                for r in (1, 2, 3)}

    results = {"arms": {"vllm": {"regimes": regimes(1.0, 1.0, 0.01, 1000, 2.0)},
                        "floor": {"regimes": regimes(0.05, 1.0, 0.01, 50, 0.05)},
                        "kvtier": {"regimes": regimes(0.06, 1.02, 0.0101, 80, 0.1)}},
               "determinism": {"outputs_equal": 1.0}, "hints": {"ratio": 0.4}}
    keys = summary_keys(results, [1, 2, 3])
    assert set(AGENT_KEYS) <= set(keys)
    assert keys["r2_reprefill_vs_vllm"] == pytest.approx(30 / 950)  # beyond what the floor recomputes
    assert keys["bounds"]["r2_ttft_p50_vs_vllm"] == pytest.approx(0.05)  # the floor: the best a tier could do
    assert keys["r2_ttft_p50_vs_vllm"] == pytest.approx(0.06)
    assert keys["r2_ttft_p50_vs_floor"] == pytest.approx(1.2)
    assert keys["r2_recomputed_vs_vllm"] == pytest.approx(0.08)
    assert keys["r3_resumed_p50_vs_vllm"] == pytest.approx(0.05)
    assert keys["first_turn_ttft_p50_vs_vllm_max"] == pytest.approx(1.02)
    assert keys["itl_p99_vs_vllm_max"] == pytest.approx(1.01)
    assert keys["errors"] == 0 and keys["outputs_equal"] == 1.0 and keys["hinted_resumed_p50_vs_unhinted"] == 0.4
    assert verdict("r2_ttft_p50_vs_floor", 1.2) == "met" and verdict("r2_ttft_p50_vs_vllm", 0.2).startswith("MISSED")
    results["sizes"], results["skipped"] = {"KV per token": "2 KiB"}, {"native": "not on CPU"}
    titles = [title for title, _, _ in tables(results)]
    assert titles[1:4] == ["regime 1", "regime 2", "regime 3"] and "arms skipped" in titles


def test_hinted_sessions_resumed_turns_against_the_others():
    records = [_record("h", 1, 1.0, hinted=True), _record("h", 2, 0.1, long_pause=True),
               _record("u", 2, 0.4, long_pause=True), _record("u", 3, 0.6, long_pause=True)]
    ratio, detail = hinted_ratio(records)
    assert ratio == pytest.approx(0.2) and detail["hinted_n"] == 1 and detail["unhinted_n"] == 2


def test_the_picture_draws_one_line_per_arm(tmp_path):
    from PIL import Image

    curves = {2: {"vllm": [0.2, 0.3, 0.5, 1.0], "kvtier": [0.02, 0.03, 0.05]}, 3: {"vllm": [0.4, 0.9]}}
    image = Image.open(plot_cdfs(curves, tmp_path / "cdf.png", "t"))
    assert image.size[0] > image.size[1]
    colours = {pixel for _, pixel in image.getcolors(1 << 20)}
    assert COLOURS["vllm"] in colours and COLOURS["kvtier"] in colours and COLOURS["floor"] not in colours


def test_the_regimes_are_sized_from_the_engine_and_dram():
    sizes = Sizes(2048, 40 * MiB, 160 * MiB, 0, 4, 6400)
    assert [sizes.working_set(r) for r in (1, 2, 3)] == [20 * MiB, 80 * MiB, 320 * MiB]
    mix = AgentMix()
    for regime in (1, 2, 3):
        tokens = unique_tokens(regime_trace(mix, sizes, regime, seed=0))
        assert sizes.working_set(regime) <= tokens * 2048 < sizes.working_set(regime) * 1.3
    fixed = regime_trace(mix, sizes, 2, seed=0, sessions=10)
    assert len({s.session for s in fixed if s.turn == 1 and not s.parent}) == 10
    assert 0.6 < unique_tokens(fixed) * 2048 / sizes.working_set(2) < 1.6


def test_kv_bytes_per_token_comes_from_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 256}))
    assert kv_bytes_per_token(str(tmp_path)) == 4 * 2 * 64 * 2 * 2  # the tiny demo model: 2 KiB
    assert kv_bytes_per_token(str(tmp_path), "fp8") == 1024
    with pytest.raises(UsageError, match="config.json"):
        kv_bytes_per_token(str(tmp_path / "nope"))


@pytest.mark.parametrize("sizes, message", [
    (Sizes(2048, 4 * MiB, 160 * MiB, 0, 4, 6400), "cannot hold one request"),
    (Sizes(2048, 40 * MiB, 60 * MiB, 0, 4, 6400), "does not fit the DRAM tier"),
    (Sizes(2048, 40 * MiB, 1 << 50, 0, 4, 6400), "of memory"),
    (Sizes(2048, 40 * MiB, 160 * MiB, 1 << 60, 4, 6400), "does not fit"),
    (Sizes(2048, 40 * MiB, 160 * MiB, 0, 0, 6400), "--concurrency"),
])
def test_sizes_the_box_cannot_hold_are_refused(tmp_path, sizes, message):
    with pytest.raises(UsageError, match=message) as caught:
        check_box(sizes, tmp_path, ["vllm", "floor", "kvtier"])
    assert caught.value.hint


def test_arms_are_checked_and_plain_vllm_always_runs():
    assert parse_arms(None, quick=True) == ["vllm", "floor", "kvtier"]
    assert parse_arms("kvtier,floor", quick=False) == ["vllm", "kvtier", "floor"]
    with pytest.raises(UsageError, match="unknown arm 'sglang'") as caught:
        parse_arms("kvtier,sglang", quick=False)
    assert "native" in caught.value.hint


runner = CliRunner()


@pytest.mark.parametrize("argv, message", [
    (["--arms", "kvtier,bogus"], "unknown arm 'bogus'"),
    (["--regime", "4"], "is not a regime"),
    (["--engine-kv", "lots"], "is not a size"),
    (["--plot", "cdf.svg"], "is not a .png file"),
    (["--concurrency", "0"], "out of range"),
])
def test_the_command_refuses_bad_input_with_one_line_and_a_hint(argv, message):
    result = runner.invoke(__import__("kvtier.cli.main", fromlist=["app"]).app, ["bench", "agents", *argv])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and message in lines[0]
    assert lines[1].startswith("hint: ")


def test_the_command_refuses_a_malformed_trace_before_any_server(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"session": "a", "turn": 1}\n')
    result = runner.invoke(__import__("kvtier.cli.main", fromlist=["app"]).app,
                           ["bench", "agents", "--trace", str(bad), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "line 1: missing input_tokens" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing half-written


def test_an_arm_that_dies_at_start_is_skipped_with_its_root_cause(tmp_path):
    from kvtier.bench.agents.arms import _root_cause

    log = tmp_path / "native.log"
    log.write_text("\n".join([
        "(APIServer pid=1) WARNING 12-06 [x.py:1] failed with error: ulimit is low",
        "(Worker pid=2) ERROR 12-06 [m.py:9] Exception: CPU Offloading is currently only supported on CUDA-alike",
        "(EngineCore pid=3) ERROR 12-06 [c.py:1] RuntimeError: Worker failed with error 'CPU Offloading ...'",
        "RuntimeError: Engine core initialization failed. See root cause above."]))
    assert _root_cause(log) == "CPU Offloading is currently only supported on CUDA-alike"


def test_plain_vllm_brackets_the_other_arms_whose_order_turns_each_round():
    from kvtier.bench.agents.run import _passes

    assert _passes(["vllm", "floor", "kvtier"], 0) == [("vllm", "vllm"), ("floor", "floor"), ("kvtier", "kvtier"),
                                                       ("vllm", "vllm-again")]
    assert [label for _, label in _passes(["vllm", "floor", "kvtier"], 1)] == ["vllm", "kvtier", "floor", "vllm-again"]
    assert _passes(["vllm"], 0) == [("vllm", "vllm")]


def _three_arms(kvtier_entry: dict | None = None) -> dict:
    def regimes(later, loaded):
        return {str(r): {"ttft_all_p50": later, "ttft_all_p99": 2 * later, "ttft_later_p50": later,
                         "ttft_later_p99": 2 * later, "ttft_first_p50": 1.0, "ttft_resumed_p50": later,
                         "itl_p50": 0.01, "itl_p99": 0.02, "recomputed_tokens": 1000 * later, "errors": 0,
                         "loaded_tokens": loaded} for r in (1, 2, 3)}

    kvtier = {"regimes": regimes(0.06, 0.0), **(kvtier_entry or {})}
    return {"arms": {"vllm": {"regimes": regimes(1.0, 0.0)}, "floor": {"regimes": regimes(0.05, 0.0)},
                     "kvtier": kvtier},
            "determinism": {"outputs_equal": 1.0}, "hints": {"ratio": 0.4}, "failed": {"kvtier regime 3 seed 1": "x"},
            "sizes": {"KV per token": "2 KiB"}, "skipped": {}}


def test_a_degraded_kvtier_arm_makes_no_summary_figure_and_no_verdict():
    from kvtier.bench.agents.report import EXTRA_KEYS, KVTIER_KEYS

    results = _three_arms({"degraded": "loaded nothing in regime 2, 3"})
    keys = summary_keys(results, [1, 2, 3])
    assert set(AGENT_KEYS + EXTRA_KEYS) <= set(keys)  # the JSON keys keep their names
    assert all(keys[k] is None for k in KVTIER_KEYS)  # not one ratio from an arm that loaded nothing
    assert keys["withheld"]["r2_ttft_p50_vs_vllm"] == "kvtier's arm is degraded (loaded nothing in regime 2, 3)"
    assert keys["errors"] == 1 and keys["hinted_resumed_p50_vs_unhinted"] == 0.4  # not from that arm
    assert keys["bounds"]["r2_ttft_p50_vs_vllm"] == pytest.approx(0.05)  # the floor's, still a figure
    summary = dict((row[0], row) for row in tables({**results, **keys})[-1][2])
    assert summary["r2_ttft_p50_vs_vllm"][1] == "-"
    assert summary["r2_ttft_p50_vs_vllm"][3].startswith("NOT A RESULT: kvtier's arm is degraded")
    assert summary["outputs_equal"][3].startswith("NOT A RESULT")


def test_a_sound_kvtier_arm_keeps_its_figures():
    keys = summary_keys(_three_arms(), [1, 2, 3])
    assert keys["r2_ttft_p50_vs_vllm"] == pytest.approx(0.06) and keys["withheld"] == {}
    assert keys["outputs_equal"] == 1.0


def test_a_degraded_hints_pass_and_a_kvtier_determinism_that_does_not_count_make_no_figure():
    results = _three_arms()
    results["hints"] = {"ratio": 0.3, "degraded": "kvtier on tight tiers loaded nothing in the hints pass"}
    results["determinism"] = {"outputs_equal": None, "invalid": {"kvtier": "its determinism pass failed: no KV"}}
    keys = summary_keys(results, [1, 2, 3])
    assert keys["hinted_resumed_p50_vs_unhinted"] is None and "hints pass" in keys["withheld"][
        "hinted_resumed_p50_vs_unhinted"]
    assert keys["outputs_equal"] is None and "no KV" in keys["withheld"]["outputs_equal"]
    assert keys["r2_ttft_p50_vs_vllm"] == pytest.approx(0.06)  # the regimes' figures stand


def test_unsettled_blocks_are_in_the_printed_regime_tables():
    results = _three_arms()
    for name, arm in results["arms"].items():
        for figures in arm["regimes"].values():
            figures.update({"unsettled_blocks": 0, "unsettled_blocks_min": 0, "unsettled_blocks_max": 0})
    results["arms"]["kvtier"]["regimes"]["3"].update({"unsettled_blocks": 2, "unsettled_blocks_max": 17})
    by_title = {title: (columns, rows) for title, columns, rows in tables({**results, **summary_keys(results, [3])})}
    columns, rows = by_title["regime 3"]
    row = next(r for r in rows if "unsettled" in r[0])
    assert row[columns.index("kvtier")] == "17"  # the worst seed: the one whose write-behind ran into the next arm
    assert row[columns.index("vllm")] == "0"


def test_kv_bytes_per_token_takes_head_dim_and_a_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": {
        "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64}}))
    assert kv_bytes_per_token(str(tmp_path)) == 2 * 2 * 64 * 2 * 2
