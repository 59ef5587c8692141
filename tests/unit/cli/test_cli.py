"""The kvtier CLI through typer's CliRunner, on real snapshot files written by a real engine."""
from __future__ import annotations

import json

import pytest
from support.engine import make_engine
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.plan.index import chain_block_hashes, namespace_of

runner = CliRunner()


@pytest.fixture
def snapshot_file(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path)
    ns = namespace_of(fingerprint.digest)
    keys = chain_block_hashes(list(range(64)), 16)
    engine.store("agent-1", ns, keys, [0, 1, 2, 3], num_tokens=64)
    path = tmp_path / "agent-1.kvsnap"
    engine.snapshot("agent-1", path)
    engine.close()
    return path


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("bench", "snapshot", "config"):
        assert command in result.stdout


def test_snapshot_inspect_json(snapshot_file, fingerprint):
    result = runner.invoke(app, ["snapshot", "inspect", str(snapshot_file), "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["session_id"] == "agent-1"
    assert data["num_tokens"] == 64
    assert len(data["blocks"]) == 4
    assert data["fingerprint"]["digest"] == fingerprint.hex


def test_snapshot_verify_ok_then_detects_corruption(snapshot_file):
    result = runner.invoke(app, ["snapshot", "verify", str(snapshot_file), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True
    data = bytearray(snapshot_file.read_bytes())
    data[-100] ^= 0xFF  # inside the last block's payload
    snapshot_file.write_bytes(bytes(data))
    result = runner.invoke(app, ["snapshot", "verify", str(snapshot_file)])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ")
    assert "hint: " in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("make_bad", [
    lambda p: p / "missing.kvsnap",
    lambda p: p,  # a directory
    lambda p: (p / "text.kvsnap").write_text("hello, not a snapshot") and p / "text.kvsnap",
])
def test_snapshot_bad_files_give_one_line_errors(tmp_path, make_bad):
    path = make_bad(tmp_path)
    result = runner.invoke(app, ["snapshot", "inspect", str(path)])
    assert result.exit_code in (1, 4)
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and str(path) in lines[0]
    assert lines[1].startswith("hint: ")


def test_bench_tiers_refuses_a_missing_directory(tmp_path):
    result = runner.invoke(app, ["bench", "tiers", "--dir", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "error:" in result.stderr


def test_bench_costmodel_refuses_an_unknown_model_size():
    """Refused before any model is built or vLLM loaded: one error line, one hint line."""
    result = runner.invoke(app, ["bench", "costmodel", "--size", "huge"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "huge" in lines[0]
    assert lines[1].startswith("hint: ") and "tiny or mid" in lines[1]


def test_config_show_reports_sources(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvtier.toml").write_text('policy = "arc"\n')
    monkeypatch.setenv("KVTIER_DRAM", "2GiB")
    result = runner.invoke(app, ["config", "show", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["policy"] == {"value": "arc", "source": f"file {tmp_path / 'kvtier.toml'}"} or \
        data["policy"]["value"] == "arc"
    assert data["dram_bytes"]["value"] == 2 << 30
    assert data["dram_bytes"]["source"].startswith("env KVTIER_DRAM")
    assert data["low_watermark"]["source"] == "default"


def test_config_show_bad_env_is_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVTIER_POLICY", "fifo")
    result = runner.invoke(app, ["config", "show"])
    assert result.exit_code == 2
    assert "policy" in result.stderr and "hint:" in result.stderr


def test_bench_parts_produce_every_figure(tmp_path):
    from kvtier.bench import tiers

    results = {}
    results.update(tiers.bench_dram(blocks=4, reps=1))
    results.update(tiers.bench_nvme(tmp_path, total_bytes=4 << 20, reps=1, sizes={"64k": 64 << 10, "2m": 2 << 20}))
    results.update(tiers.bench_snapshot(tmp_path, session_bytes=8 << 20, reps=1))
    results.update(tiers.bench_index(num_blocks=20_000))
    for key in tiers.TIERS_KEYS:
        assert results[key] > 0, key
    assert 50 < results["index_bytes_per_block"] < 2000
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself


@pytest.mark.parametrize("argv", [["-h"], ["sessions", "-h"], ["bench", "tiers", "-h"], ["serve", "-h"],
                                  ["config", "show", "-h"]])
def test_dash_h_is_help_everywhere(argv):
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "Usage: kvtier" in result.stdout


def test_root_help_lists_the_exit_codes_and_shell_completion():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "Exit codes: 0 ok, 1 failure, 2 bad usage or input, 3 no kvtier server reachable, 4 not found" in text
    assert "--install-completion" in text and "--show-completion" in text
