"""Power cuts against kvtier's real tiers: a short run of ``python -m benchmarks faults --power`` loses
nothing acknowledged; the same run catches a tier that skips a sync."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from benchmarks.power.run import POWER_KEYS, run_power


def test_a_short_power_run_keeps_everything_acknowledged(tmp_path):
    out = run_power(15, seed=3, directory=tmp_path, progress=lambda _: None, door_cost_mib=0)
    assert out["power_states"] == 8 * 15
    assert (out["power_acked_lost"], out["power_wrong_bytes"], out["power_start_crashes"],
            out["power_catalog_wrong"], out["power_over_budget"]) == (0, 0, 0, 0, 0), out["_power_failures"]
    per = out["_power_per_workload"]
    assert all(per[name]["acked_checked"] > 0 for name in per if name != "snapshot_write")
    assert out["_power_snapshots_checked"] > 0 and per["catalog_commit"]["catalog_sessions"] > 0
    assert out["_power_write_behind_window_losses"] > 0  # the window is real, and counted apart


def test_a_tier_that_skips_the_segment_sync_is_caught(tmp_path, monkeypatch):
    from kvtier.tiers.nvme.ioengine import IoEngine

    monkeypatch.setattr(IoEngine, "sync", lambda self, path: None)  # the bug: records named before durable
    out = run_power(40, seed=3, directory=tmp_path, workloads=["group_commit"], progress=lambda _: None,
                    door_cost_mib=0)
    assert out["power_acked_lost"] > 0
    assert out["power_wrong_bytes"] == 0  # a lost record is detected by its checksums, never served


def test_a_journal_that_skips_its_sync_is_caught(tmp_path, monkeypatch):
    from kvtier.tiers import fileio
    from kvtier.tiers.nvme import journal

    class Door:  # the journal's view of the door, with fdatasync doing nothing
        def __getattr__(self, name):
            return (lambda fd: None) if name == "fdatasync" else getattr(fileio, name)

    monkeypatch.setattr(journal, "fileio", Door())
    out = run_power(40, seed=4, directory=tmp_path, workloads=["group_commit"], progress=lambda _: None,
                    door_cost_mib=0)
    assert out["power_acked_lost"] > 0


def test_the_cli_reports_power_cuts_as_json(tmp_path, monkeypatch):
    from benchmarks.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["faults", "--power", "--quick", "--states", "2", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output[result.output.index("{") :])
    assert set(figures) == set(POWER_KEYS) and figures["power_states"] == 16
    assert figures["power_acked_lost"] == 0 and figures["recorder_off_cpu_bound"] < 0.02

