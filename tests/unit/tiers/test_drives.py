"""Several drives behind one cold tier (``kvtier.tiers.nvme.drives``): placement, parallel reads,
a lost or full drive, the recorded drive list, and the settings that carry it."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.nvme.drives import MANIFEST, DriveSet, check_drive_list, open_nvme, split_budget
from kvtier.tiers.nvme.store import NvmeStore

NS, FP = b"n" * 16, b"f" * 16
BLOCK = 16 << 10


def blocks(n: int, seed: int = 0) -> list[tuple[bytes, bytes, np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    return [(NS, hashlib.sha256(f"{seed}-{i}".encode()).digest(), rng.integers(0, 256, BLOCK, dtype=np.uint8), "none")
            for i in range(n)]


def read_all(store, written) -> list:
    dst = [np.zeros(BLOCK, np.uint8) for _ in written]
    outcomes = store.read_batch([(ns, key, dst[i]) for i, (ns, key, _p, _c) in enumerate(written)], FP)
    return [o if isinstance(o, BaseException) else bool((dst[i] == written[i][2]).all())
            for i, o in enumerate(outcomes)]


def test_blocks_spread_over_the_drives_by_their_share_and_come_back_exact(tmp_path):
    drives = DriveSet([tmp_path / "a", tmp_path / "b"], 64 << 20, io_threads=2, budgets=[48 << 20, 16 << 20])
    written = blocks(400)
    assert not any(isinstance(o, BaseException) for o in drives.write_batch(written, FP))
    held = [d.num_blocks for d in drives.drives]
    assert sum(held) == 400 and 0.65 < held[0] / 400 < 0.85  # 3:1 budgets, about 3:1 blocks
    assert read_all(drives, written) == [True] * 400
    assert all(d.io_counts["read_ios"] > 0 for d in drives.drives)  # a restore reads from every drive
    drives.close()
    again = open_nvme(f"{tmp_path / 'a'}:{tmp_path / 'b'}", 64 << 20, io_threads=2)
    assert isinstance(again, DriveSet) and again.num_blocks == 400  # each drive's own journal replayed
    again.close()


def test_a_lost_drive_loses_only_its_blocks_and_names_itself(tmp_path):
    drives = DriveSet([tmp_path / "a", tmp_path / "b"], 64 << 20, io_threads=2)
    written = blocks(120)
    drives.write_batch(written, FP)
    on_b = {key for _ns, key, _p, _c in written if drives.drives[1].contains(NS, key)}
    shutil.rmtree(tmp_path / "b")
    outcomes = read_all(drives, written)
    for (_ns, key, _p, _c), outcome in zip(written, outcomes):
        if key in on_b:
            assert isinstance(outcome, BaseException) and str(tmp_path / "b") in str(outcome)
        else:
            assert outcome is True
    assert drives.check_present()  # the lost drive's directory is made again; the set keeps writing
    fresh = blocks(40, seed=1)
    assert not any(isinstance(o, BaseException) for o in drives.write_batch(fresh, FP))
    assert read_all(drives, fresh) == [True] * 40
    drives.close()


def test_a_full_drive_sends_its_blocks_to_the_next_one(tmp_path):
    drives = DriveSet([tmp_path / "a", tmp_path / "b"], 64 << 20, io_threads=2, budgets=[64 << 10, 64 << 20])
    written = blocks(60)
    outcomes = drives.write_batch(written, FP)
    assert not any(isinstance(o, BaseException) for o in outcomes)
    assert drives.drives[0].num_blocks < 10 and drives.num_blocks == 60
    assert read_all(drives, written) == [True] * 60
    drives.close()


def test_a_block_rewritten_on_its_own_drive_leaves_no_copy_behind(tmp_path, monkeypatch):
    from kvtier.errors import StorageError

    drives = DriveSet([tmp_path / "a", tmp_path / "b"], 64 << 20, io_threads=2)
    written = blocks(40)
    working = drives.drives[0].write_batch
    monkeypatch.setattr(drives.drives[0], "write_batch",  # drive 0 fails for a while (a full disk, say)
                        lambda batch, fp: [StorageError("NVMe tier: drive 0 is failing")] * len(batch))
    assert not any(isinstance(o, BaseException) for o in drives.write_batch(written, FP))
    spilled = [b for b in written if drives.order(b[1])[0] == 0]
    assert spilled and all(drives.drives[1].contains(NS, b[1]) for b in spilled)  # they went to drive 1
    monkeypatch.setattr(drives.drives[0], "write_batch", working)  # drive 0 works again
    again = spilled[0]
    assert not isinstance(drives.write_batch([again], FP)[0], BaseException)
    assert drives.drives[0].contains(NS, again[1]) and not drives.drives[1].contains(NS, again[1])
    drives.delete_many([(NS, again[1])])
    assert not drives.contains(NS, again[1])  # gone from every drive: nothing older to read back
    assert read_all(drives, spilled[1:]) == [True] * (len(spilled) - 1)
    drives.close()


def test_a_block_rewritten_while_its_own_drive_refuses_writes_keeps_the_new_copy(tmp_path, monkeypatch):
    """Drive 0 still lists a block's older copy but refuses writes (EIO): the rewrite goes to drive 1 and
    is acknowledged; the copy kept must be that one, never the older one on the failing drive."""
    import errno

    drives = DriveSet([tmp_path / "a", tmp_path / "b"], 64 << 20, io_threads=2)
    mine = [b for b in blocks(40) if drives.order(b[1])[0] == 0][:5]
    assert mine and not any(isinstance(o, BaseException) for o in drives.write_batch(mine, FP))
    assert all(drives.drives[0].contains(NS, b[1]) for b in mine)  # on their own drive
    rng = np.random.default_rng(7)
    newer = [(ns, key, rng.integers(0, 256, BLOCK, dtype=np.uint8), codec) for ns, key, _p, codec in mine]
    monkeypatch.setattr(drives.drives[0], "write_batch",
                        lambda batch, fp: [OSError(errno.EIO, "Input/output error")] * len(batch))
    assert not any(isinstance(o, BaseException) for o in drives.write_batch(newer, FP))  # acknowledged
    assert all(drives.drives[1].contains(NS, b[1]) for b in newer)  # the acknowledged copies stay
    assert not any(drives.drives[0].contains(NS, b[1]) for b in newer)  # the older ones go
    assert read_all(drives, newer) == [True] * len(newer)  # reads find the new bytes
    drives.close()


def files_of(root: Path) -> dict[str, bytes]:
    found = {p.name: p.read_bytes() for p in (root / "segments").iterdir()}
    return found | {"index.kvj": (root / "index.kvj").read_bytes()}


def test_a_single_directory_becomes_drive_0_with_nothing_rewritten(tmp_path):
    a = tmp_path / "a"
    one = NvmeStore(a, 64 << 20, io_threads=2)
    written = blocks(50)
    one.write_batch(written, FP)
    one.close()
    before = files_of(a)
    check_drive_list([str(a), str(tmp_path / "b")], write=True)
    both = open_nvme(f"{a}:{tmp_path / 'b'}", 64 << 20, io_threads=2)
    assert read_all(both, written) == [True] * 50
    assert files_of(a) == before
    both.close()


def test_the_drive_list_is_checked(tmp_path):
    a, b, c = (str(tmp_path / x) for x in "abc")
    with pytest.raises(ConfigError, match="named twice"):
        check_drive_list([a, str(Path(a) / ".")])
    warnings = check_drive_list([a, b], write=True)
    assert any("one filesystem" in w for w in warnings)  # both under tmp_path: one disk
    assert (Path(a) / MANIFEST).is_file()
    with pytest.raises(ConfigError, match="was written with the drives") as refused:
        check_drive_list([a, c])
    assert b in refused.value.hint
    with pytest.raises(ConfigError, match="was written with the drives"):
        check_drive_list([a])  # a drive left out: its blocks would be lost
    with pytest.raises(ConfigError, match="drive 0 of another"):
        check_drive_list([c, a])


def test_the_budget_is_split_by_drive_size_and_evenly_on_one_filesystem(tmp_path):
    assert split_budget([tmp_path / "a", tmp_path / "b"], 1001) == [501, 500]
    assert split_budget([tmp_path / "a"], 7) == [7]


def test_settings_carry_a_list_of_drives(tmp_path):
    from kvtier.config import load_settings

    toml = tmp_path / "kvtier.toml"
    toml.write_text(f'nvme_dir = ["{tmp_path}/a", "~/b"]\n')
    settings, _ = load_settings(env={}, toml_path=toml)
    assert settings.nvme_dir == f"{tmp_path}/a{os.pathsep}{os.path.expanduser('~/b')}"
    toml.write_text("nvme_dir = []\n")
    with pytest.raises(ConfigError, match="one per drive"):
        load_settings(env={}, toml_path=toml)
