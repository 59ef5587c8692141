"""``kvtier pin S --for 30m`` and the time limits in ``kvtier sessions`` / ``inspect``: typer's CliRunner
against an in-process engine behind a real admin socket (``LocalAdmin``), its wall clock a FakeClock."""
from __future__ import annotations

import json

import pytest
from support.clock import FakeClock
from support.engine import make_engine
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of

runner = CliRunner()


@pytest.fixture
def served(fingerprint, hbm, tmp_path):
    from kvtier.control.local import LocalAdmin

    clock = FakeClock(1_700_000_000.0)
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=16, wall_clock=clock)
    engine.store("agent", namespace_of(fingerprint.digest), chain_block_hashes(list(range(64)), 16), [0, 1, 2, 3],
                 num_tokens=64)
    admin = LocalAdmin(engine, tmp_path / "a.sock").start()
    try:
        yield str(tmp_path / "a.sock"), admin, clock
    finally:
        admin.stop()
        engine.close(write_back=False)


@pytest.mark.parametrize("given, why", [("abc", "invalid --for 'abc'"), ("0", "must be more than 0"),
                                        ("-5m", "invalid --for"), ("10x", "invalid --for '10x'")])
def test_a_bad_duration_is_one_error_line_with_a_hint(tmp_path, given, why):
    result = runner.invoke(app, ["pin", "agent", "--for", given, "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 2, result.output  # a usage error, found before any server is asked
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and why in lines[0], lines
    assert lines[1] == "hint: a duration like 90s, 30m, 2h, 1d or 1h30m (a bare number is seconds)"


@pytest.mark.parametrize("given, seconds, said", [("90s", 90, "1m30s"), ("30m", 1800, "30m"), ("2h", 7200, "2h"),
                                                  ("1d", 86400, "1d"), ("1h30m", 5400, "1h30m")])
def test_pin_for_a_while(served, given, seconds, said):
    sock, admin, clock = served
    result = runner.invoke(app, ["pin", "agent", "--tier", "nvme", "--for", given, "--socket", sock])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"pin agent for {said}: done")
    assert admin.engine.manager.table.session("agent").pinned == Tier.NVME
    listed = json.loads(runner.invoke(app, ["sessions", "--json", "--socket", sock]).stdout)["sessions"][0]
    assert (listed["pin_expires_at"], listed["pin_left_s"]) == (clock.now + seconds, seconds)


def test_inspect_shows_the_time_left(served):
    sock, admin, clock = served
    assert runner.invoke(app, ["pin", "agent", "--for", "30m", "--socket", sock]).exit_code == 0
    with admin.lock:
        admin.engine.manager.planner.retain("agent", 600, 2)
    clock.advance(60)
    shown = runner.invoke(app, ["inspect", "agent", "--socket", sock], env={"COLUMNS": "200"}).stdout
    assert "dram (29m left)" in shown and "9m left, priority 2" in shown
    table = runner.invoke(app, ["sessions", "--socket", sock], env={"COLUMNS": "200"}).stdout
    assert "dram (29m left)" in table and "9m left, priority 2" in table
