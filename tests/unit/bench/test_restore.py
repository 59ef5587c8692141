"""`kvtier bench restore` at tiny sizes: every block comes back byte for byte, every figure is there
and finite, and a disk without room is refused before anything is written. No timing asserts."""
from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvtier.bench import restore as bench
from kvtier.bench.restore import (
    RESTORE_KEYS,
    make_session,
    mismatched_blocks,
    open_tier,
    restore_session,
    run_restore_bench,
    write_session,
)
from kvtier.errors import StorageError

MiB = 1 << 20


@pytest.mark.parametrize("drives", [1, 2])
def test_every_block_comes_back_byte_exact(tmp_path, geometry, drives):
    session = make_session(geometry, 2 * MiB)  # 256 blocks of 8 KiB
    assert len(session.keys) == 2 * MiB // geometry.block_bytes
    assert mismatched_blocks(session) == []
    store = open_tier([tmp_path / f"d{k}" for k in range(drives)], 16 * MiB, io_threads=2)
    try:
        write_session(store, session, batch_bytes=256 << 10)
        session.arena.buffer.zero_()
        assert len(mismatched_blocks(session)) == len(session.keys)  # the check sees a lost block
        restore_session(store, session, batch_bytes=128 << 10, in_flight=2)
        assert mismatched_blocks(session) == []
        if drives == 2:
            assert all(d.num_blocks for d in store.drives)  # both directories hold some of the session
    finally:
        store.close()


def test_every_figure_is_reported_and_finite(tmp_path, geometry):
    disk, ram = tmp_path / "disk", tmp_path / "ram"
    disk.mkdir()
    ram.mkdir()
    results = run_restore_bench(total_bytes=16 * MiB, geometry=geometry, tmpfs_bytes=4 * MiB, dirs=[disk],
                                ram_dir=ram, rounds=2, batch_bytes=1 * MiB, io_threads=2, progress=lambda _m: None)
    for key in RESTORE_KEYS:
        assert isinstance(results[key], float) and math.isfinite(results[key]), (key, results[key])
        assert results[key] >= 0, key
    assert results["_blocks_checked"] == results["_blocks"] == 16 * MiB // geometry.block_bytes
    assert results["_blocks_mismatched"] == 0
    assert results["_tmpfs_gib"] == 4 * MiB / (1 << 30)
    assert "drives" in results["_moonshot"] and results["_moonshot_drives"] >= 1
    assert list(disk.iterdir()) == [] and list(ram.iterdir()) == []  # every arm's files removed


def test_several_drives(tmp_path, geometry):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    results = run_restore_bench(total_bytes=4 * MiB, geometry=geometry, tmpfs_bytes=1 * MiB, dirs=dirs,
                                ram_dir=tmp_path, rounds=1, batch_bytes=1 * MiB, io_threads=2, progress=lambda _m: None)
    assert results["_drives"] == 2 and results["_blocks_mismatched"] == 0
    assert all(math.isfinite(results[key]) for key in RESTORE_KEYS)


def test_a_disk_without_room_is_refused_before_writing(tmp_path, geometry, monkeypatch):
    monkeypatch.setattr(bench, "_free", lambda _path: 1 * MiB)
    with pytest.raises(StorageError) as err:
        run_restore_bench(total_bytes=16 * MiB, geometry=geometry, dirs=[tmp_path], progress=lambda _m: None)
    assert "free" in str(err.value) and err.value.hint
    assert list(tmp_path.iterdir()) == []


def test_cli_json_has_exactly_the_keys(tmp_path):
    from kvtier.cli.main import app

    # 0.02 GiB of 70B-shaped blocks: four 5 MiB blocks
    result = CliRunner().invoke(app, ["bench", "restore", "--json", "--gib", "0.02", "--nvme-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == set(RESTORE_KEYS)
    assert list(tmp_path.iterdir()) == []
