"""`kvtier bench restore` at tiny sizes: every block comes back byte for byte, every restore the bench
times is verified (a record that brings back other bytes, in any round of any arm, refuses the figures),
every figure is there and finite, and a disk without room is refused before anything is written. No
timing asserts."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.bench import restore as bench
from kvtier.bench.checks import FigureRefused
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
from kvtier.tiers.records import HEADER_BYTES, checksum, pack_header, unpack_header

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
    blocks, tmpfs_blocks = 16 * MiB // geometry.block_bytes, 4 * MiB // geometry.block_bytes
    assert results["_blocks"] == blocks
    # two rounds of four verified restores: the main tier, one directory, two directories (all blocks), RAM
    assert results["_blocks_checked"] == 2 * (3 * blocks + tmpfs_blocks) and results["_blocks_mismatched"] == 0
    assert results["_tmpfs_gib"] == 4 * MiB / (1 << 30)
    assert "drives" in results["_moonshot"] and results["_moonshot_drives"] >= 1
    assert list(disk.iterdir()) == [] and list(ram.iterdir()) == []  # every arm's files removed


def test_several_drives(tmp_path, geometry):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    results = run_restore_bench(total_bytes=4 * MiB, geometry=geometry, tmpfs_bytes=1 * MiB, dirs=dirs,
                                ram_dir=tmp_path, rounds=1, batch_bytes=1 * MiB, io_threads=2, progress=lambda _m: None)
    assert results["_drives"] == 2
    blocks, tmpfs_blocks = 4 * MiB // geometry.block_bytes, 1 * MiB // geometry.block_bytes
    assert results["_blocks_checked"] == 3 * blocks + tmpfs_blocks  # one round: main, one dir, two dirs, RAM
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


# ---- every restore verified -----------------------------------------------------------------------------
def test_clobbered_slots_fail_the_comparison_until_restored(tmp_path, geometry):
    """A restore that leaves a destination alone cannot pass: before it, every slot holds bytes no block has."""
    clobber, compare_blocks = bench.clobber, bench.compare_blocks
    session = make_session(geometry, 1 * MiB)
    blocks = range(len(session.keys))
    assert compare_blocks(session, blocks) == (len(blocks), [])
    store = open_tier([tmp_path / "d"], 16 * MiB, io_threads=2)
    try:
        write_session(store, session, batch_bytes=256 << 10)
        clobber(session, range(10, 20))
        assert compare_blocks(session, blocks) == (len(blocks), list(range(10, 20)))
        clobber(session)
        assert compare_blocks(session, blocks) == (len(blocks), list(blocks))
        restore_session(store, session, range(5), batch_bytes=128 << 10)  # a restore of some blocks only
        assert compare_blocks(session, blocks) == (len(blocks), list(range(5, len(blocks))))
    finally:
        store.close()


def forge_a_record(root: Path) -> str:
    """Rewrite the first record of a segment file under ``root`` with other payload bytes and a header
    restamped to vouch for them (payload length and xxh3, the header's own xxh3): a record the tier's
    own verification accepts, holding bytes its block was never written with. Its key, as hex."""
    path = sorted(root.rglob("*.kvseg"))[0]
    with open(path, "r+b") as f:
        header = bytearray(f.read(HEADER_BYTES))
        fields = unpack_header(header)
        assert fields is not None, path
        payload = bytearray(f.read(fields.nbytes))
        payload[fields.nbytes // 2] ^= 0xFF
        pack_header(header, fields.nbytes, checksum(payload), fields.fingerprint, fields.namespace, fields.codec,
                    fields.key, fields.rank or 0)
        f.seek(0)
        f.write(header + payload)
        f.flush()
        os.fsync(f.fileno())
    assert unpack_header(Path(path).read_bytes()[:HEADER_BYTES]).digest == checksum(payload)
    return fields.key.hex()


class ForgeAt:
    """A ``progress`` for ``run_restore_bench`` that forges a record under the tier directories
    ``pattern`` (a glob under ``base``) names, once, when told the restore ``step`` is about to run."""

    def __init__(self, base: Path, pattern: str, step: str):
        self.base, self.pattern, self.step = base, pattern, step
        self.steps: list[str] = []
        self.forged: str | None = None

    def __call__(self, message: str) -> None:
        self.steps.append(message)
        if self.forged is None and message == self.step:
            roots = sorted(self.base.glob(self.pattern))
            assert roots, (self.pattern, list(self.base.rglob("*")))
            self.forged = forge_a_record(roots[0])


MAIN, TWO, RAM = "kvtier-bench-restore-*/main", "kvtier-bench-restore-*/two-*", "kvtier-bench-restore-*"


@pytest.mark.parametrize("arm, pattern, forge_at, refused_at", [
    # forged when an arm starts (a step the bench has always announced): its first restore refuses
    ("disk", MAIN, "restore vs raw direct reads of the same files: 3 rounds",
     "restoring from the NVMe tier, round 1 of 3"),
    ("disk", TWO, "restore from two directories vs one: 3 rounds", "restoring from two directories, round 1 of 3"),
    # forged just before a later round: that round's restore refuses
    ("disk", MAIN, "restoring from the NVMe tier, round 3 of 3", None),
    ("disk", MAIN, "restoring from one directory, round 2 of 3", None),  # one drive: the main tier's files
    ("disk", TWO, "restoring from two directories, round 2 of 3", None),
    ("ram", RAM, "restoring from RAM ({ram}), round 3 of 3", None),
], ids=["main-first-round", "two-dirs-first-round", "main-last-round", "one-dir-later-round", "two-dirs-later-round",
        "ram-last-round"])
def test_a_restore_that_brings_back_other_bytes_refuses_the_figures(tmp_path, geometry, arm, pattern, forge_at,
                                                                     refused_at):
    """Whichever restore reads a forged record, in whichever round, the bench fails: no figure."""
    disk, ram = tmp_path / "disk", tmp_path / "ram"
    disk.mkdir()
    ram.mkdir()
    forge_at, refused_at = forge_at.format(ram=ram), (refused_at or forge_at).format(ram=ram)
    progress = ForgeAt(disk if arm == "disk" else ram, pattern, forge_at)
    with pytest.raises(FigureRefused) as err:
        run_restore_bench(total_bytes=1 * MiB, geometry=geometry, tmpfs_bytes=512 << 10, dirs=[disk], ram_dir=ram,
                          rounds=3, batch_bytes=256 << 10, io_threads=2, progress=progress)
    assert progress.forged is not None, progress.steps  # the record was forged before that restore ...
    assert progress.steps[-1] == refused_at  # ... and the first restore to read it refused
    assert "1 of the" in str(err.value) and "differ from what was written" in str(err.value)
    assert list(disk.iterdir()) == [] and list(ram.iterdir()) == []  # removed all the same


@pytest.mark.parametrize("with_ram", [True, False])
def test_every_restore_is_counted(tmp_path, geometry, with_ram):
    """``_blocks_checked``: the blocks restored times the restores verified, every round of every arm."""
    disk, ram = tmp_path / "disk", tmp_path / "ram"
    disk.mkdir()
    if with_ram:
        ram.mkdir()
    steps: list[str] = []
    results = run_restore_bench(total_bytes=1 * MiB, geometry=geometry, tmpfs_bytes=256 << 10, dirs=[disk],
                                ram_dir=ram, rounds=3, batch_bytes=256 << 10, io_threads=2, progress=steps.append)
    blocks, tmpfs_blocks = 1 * MiB // geometry.block_bytes, (256 << 10) // geometry.block_bytes
    assert results["_blocks_checked"] == 3 * (3 * blocks + (tmpfs_blocks if with_ram else 0))
    assert results["_blocks_mismatched"] == 0
    assert len([s for s in steps if s.startswith("restoring from ")]) == 3 * (4 if with_ram else 3)
    assert (results["tmpfs_vs_memcpy"] is None) is not with_ram
