"""`python -m benchmarks memory`: the excess and target arithmetic, the process-tree reading, the CLI, and
(slow) one real run at --dram 0.25GiB against plain vLLM. No memory target is asserted: the
benchmark measures, the tests check that what it reports is what it says."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from benchmarks.memory import (
    ALLOWANCE_MIB,
    MEMORY_COLUMNS,
    SLACK,
    expected_prompts,
    kv_bytes_per_token,
    memory_rows,
    parse_sizes,
    random_prompts,
    size_figures,
    summarize,
    tree_memory,
)
from kvtier.errors import UsageError

MiB = 1 << 20
GiB = 1 << 30


def test_excess_is_rss_over_plain_less_the_budget():
    plain = 3000 * MiB
    figures = size_figures(1.0, plain + 1200 * MiB, plain)
    assert figures["rss_over_plain_mib"] == 1200.0
    assert figures["rss_excess_mib"] == pytest.approx(1200 - SLACK * 1024, abs=0.05)  # 124.8
    assert figures["target_mib"] == pytest.approx(SLACK * 1024 + ALLOWANCE_MIB, abs=0.05)
    assert figures["rss_over_budget_mib"] == 1200 - 1024
    assert figures["met"] is True


@pytest.mark.parametrize("gib", [0.25, 1.0, 4.0, 8.0])
def test_the_target_is_met_exactly_at_its_bound(gib):
    plain = 2800 * MiB
    bound = plain + int(SLACK * gib * GiB) + ALLOWANCE_MIB * MiB
    assert size_figures(gib, bound, plain)["met"] is True
    over = size_figures(gib, bound + MiB, plain)
    assert over["met"] is False
    assert over["rss_excess_mib"] == pytest.approx(ALLOWANCE_MIB + 1, abs=0.1)
    # less than plain vLLM: a negative excess, met
    under = size_figures(gib, plain - 10 * MiB, plain)
    assert under["met"] is True and under["rss_excess_mib"] < 0


def test_summary_takes_the_worst_excess_and_counts_a_skipped_size_as_not_met():
    sizes = {"1": {"rss_mib": 4000.0, "rss_excess_mib": 80.0, "met": True, "dram_filled": 1.0},
             "4": {"rss_mib": 7000.0, "rss_excess_mib": 150.5, "met": True, "dram_filled": 0.97},
             "8": {"rss_mib": 11000.0, "rss_excess_mib": 120.0, "met": True, "dram_filled": 1.0}}
    assert summarize(sizes) == {"rss_excess_mib_max": 150.5, "target_met": True, "filled": True}
    sizes["4"]["dram_filled"] = 0.90  # not filled: the run does not prove the budget
    assert summarize(sizes)["filled"] is False
    sizes["8"] = {"dram_gib": 8.0, "skipped": "not enough RAM"}
    out = summarize(sizes)
    assert out["rss_excess_mib_max"] == 150.5 and out["target_met"] is False
    sizes["1"]["met"] = False
    assert summarize({"1": sizes["1"]})["target_met"] is False
    assert summarize({}) == {"rss_excess_mib_max": None, "target_met": False, "filled": False}


def test_rows_show_every_size_and_why_one_was_skipped():
    figures = size_figures(1.0, 4000 * MiB, 2900 * MiB)
    results = {"sizes": {"1": {"rss_mib": 4000.0, "plain_rss_mib": 2900.0, "dram_filled": 1.0, **figures},
                         "8": {"skipped": "only 5.0 GiB of RAM available"}}}
    rows = memory_rows(results)
    assert [len(r) for r in rows] == [len(MEMORY_COLUMNS)] * 2
    assert rows[0][0] == "1" and rows[0][-1] == "yes" and rows[0][-2] == "100.0%"
    assert "only 5.0 GiB" in rows[1][-1]


def test_sizes_parse_and_bad_ones_are_refused():
    assert parse_sizes("8,1,4") == (1.0, 4.0, 8.0)
    assert parse_sizes("0.25GiB, 1g") == (0.25, 1.0)
    assert parse_sizes("") == ()
    for bad in ("x", "0", "-1", "2000", "nan"):
        with pytest.raises(UsageError):
            parse_sizes(bad)


def test_fill_arithmetic():
    assert kv_bytes_per_token() == 128 << 10  # 32 layers x 2 x 8 heads x 128 dims x 2 bytes
    slot = 128 * kv_bytes_per_token()  # one 128-token block: 16 MiB
    assert expected_prompts(1 * GiB, slot, 128, 1025) == 8  # 64 slots, 8 full blocks a prompt
    assert expected_prompts(8 * GiB, slot, 128, 1025) == 64
    assert expected_prompts(GiB // 4, slot, 128, 1025) == 2
    a = list(random_prompts(3, 1025))
    assert len({tuple(p[:128]) for p in a}) == 3 and all(len(p) == 1025 for p in a)
    assert list(random_prompts(2, 1025, first=1)) == a[1:]  # one sequence: the same prompts for both sides


def test_tree_memory_sums_the_children():
    """A child that touches 64 MiB is counted in its parent's tree, RSS, PSS and USS alike."""
    code = ("import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
            "print('ready', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        mem = tree_memory(os.getpid())
        pids = {p["pid"] for p in mem["processes"]}
        assert {os.getpid(), child.pid} <= pids
        mine = next(p for p in mem["processes"] if p["pid"] == child.pid)
        assert mine["rss_mib"] >= 64 and mine["uss_mib"] >= 60
        assert mem["rss"] >= sum(p["rss_mib"] for p in mem["processes"]) * MiB - MiB * len(pids)
        assert mem["uss"] <= mem["pss"] <= mem["rss"]
    finally:
        child.kill()
        child.wait()


def test_cli_lists_memory_and_refuses_bad_sizes():
    from benchmarks.cli import app

    listed = CliRunner().invoke(app, ["--help"])
    assert "memory" in listed.output
    refused = CliRunner().invoke(app, ["memory", "--sizes", "1,lots"])  # refused before any server or model
    assert refused.exit_code != 0 and "--sizes" in refused.output


@pytest.mark.slow
def test_a_real_quick_run_fills_the_tier_and_reports_both_sides():
    """kvtier serve --dram 0.25GiB filled through real requests, then plain vLLM (~2 min here)."""
    import tempfile
    from pathlib import Path

    from benchmarks.memory import ensure_fatkv_model
    from benchmarks.memory_served import run_memory_bench

    cache = os.environ.get("KVTIER_TEST_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvtier-test", "models")
    model = str(ensure_fatkv_model(cache))
    said: list[str] = []
    # a short path: vLLM's ZMQ sockets live under the servers' TMPDIR (at most 107 characters)
    with tempfile.TemporaryDirectory(prefix="kvm-", dir="/tmp") as tmp:
        out = run_memory_bench(sizes=(0.25,), progress=said.append, directory=tmp, model=model)
        assert list(Path(tmp).iterdir()) == []  # the NVMe tiers and logs are gone
    json.dumps(out)  # what --json prints
    entry = out["sizes"]["0.25"]
    assert entry["dram_used_bytes"] >= 0.95 * GiB / 4 and entry["dram_filled"] >= 0.95 and out["filled"]
    assert entry["dirty_blocks"] == 0  # measured once the write-behind was done
    assert entry["tokens_sent"] == entry["prompts"] * 1025 > 0
    roles = {p["role"] for p in entry["processes"]["kvtier"]}
    assert "kvtier serve (supervisor)" in roles and "vLLM API server" in roles
    assert len(entry["processes"]["kvtier"]) >= 3  # supervisor, API server, engine core (and workers)
    # the tier's pages are resident and counted: kvtier's tree holds at least the filled bytes more
    assert entry["rss_over_plain_mib"] >= 0.9 * 256
    assert math.isfinite(out["rss_excess_mib_max"]) and out["rss_excess_mib_max"] == entry["rss_excess_mib"]
    assert entry["met"] == (entry["rss_over_plain_mib"] <= entry["target_mib"])
    from kvtier.launch.serve import is_cpu_only

    if is_cpu_only():
        assert out["pinned"] is False  # a CPU box: no pinned memory
    assert any("filled" in m for m in said) and any("plain vLLM" in m for m in said)
