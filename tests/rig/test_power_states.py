"""The recorder and the crash-state builder: what a power cut keeps, on small hand-made traces
written through kvtier's file door, and on a real NVMe tier's trace."""
from __future__ import annotations

import os

from benchmarks.power.states import SECTOR, CrashState, build, materialize, sample_states
from benchmarks.power.trace import Recorder
from kvtier.tiers import fileio


def _write(path, data: bytes, offset: int = 0, sync: bool = False) -> None:
    fd = fileio.open_file(path, os.O_WRONLY | os.O_CREAT)
    try:
        fileio.pwrite(fd, data, offset)
        if sync:
            fileio.fdatasync(fd)
    finally:
        fileio.close(fd)


def test_the_door_is_bare_unless_a_recorder_is_attached(tmp_path):
    assert fileio.recorder() is None
    with Recorder(tmp_path) as recorder:
        assert fileio.recorder() is recorder
    assert fileio.recorder() is None


def test_a_synced_write_survives_and_an_unsynced_one_may_not(tmp_path):
    with Recorder(tmp_path) as rec:
        _write(tmp_path / "a", b"A" * SECTOR, sync=True)
        fileio.fsync_dir(tmp_path)
        _write(tmp_path / "a", b"B" * SECTOR, offset=SECTOR)
    end = len(rec.ops)
    synced = build(rec, CrashState(end, "synced", 0))
    assert bytes(synced.files["a"].data) == b"A" * SECTOR
    everything = build(rec, CrashState(end, "all", 0))
    assert bytes(everything.files["a"].data) == b"A" * SECTOR + b"B" * SECTOR


def test_a_new_name_needs_its_directory_synced(tmp_path):
    with Recorder(tmp_path) as rec:
        _write(tmp_path / "kept", b"k", sync=True)
        fileio.fsync_dir(tmp_path)
        _write(tmp_path / "unnamed", b"u", sync=True)  # data synced, the directory entry not
    state = build(rec, CrashState(len(rec.ops), "synced", 0))
    assert set(state.files) == {"kept"}


def test_a_rename_is_kept_whole_or_not_at_all(tmp_path):
    (tmp_path / "index").write_bytes(b"old")
    with Recorder(tmp_path) as rec:
        _write(tmp_path / "index.tmp", b"new", sync=True)
        fileio.replace(tmp_path / "index.tmp", tmp_path / "index")
    seen = set()
    for seed in range(40):
        files = build(rec, CrashState(len(rec.ops), "subset", seed)).files
        seen.add((bytes(files["index"].data), "index.tmp" in files))
    assert seen <= {(b"old", True), (b"old", False), (b"new", False)}
    assert (b"new", False) in seen and (b"old", False) in seen


def test_a_torn_write_keeps_whole_sectors_of_either_version(tmp_path):
    with Recorder(tmp_path) as rec:
        _write(tmp_path / "f", b"\0" * 4 * SECTOR, sync=True)
        fileio.fsync_dir(tmp_path)
        _write(tmp_path / "f", b"\1" * 4 * SECTOR)
    mixes = set()
    for seed in range(30):
        data = bytes(build(rec, CrashState(len(rec.ops), "torn", seed)).files["f"].data)
        sectors = {data[i : i + SECTOR] for i in range(0, len(data), SECTOR)}
        assert sectors <= {b"\0" * SECTOR, b"\1" * SECTOR}
        mixes.add(data)
    assert len(mixes) > 2  # neither all-or-nothing: torn


def test_a_punched_range_is_a_hole_on_disk(tmp_path):
    with Recorder(tmp_path) as rec:
        fd = fileio.open_file(tmp_path / "seg", os.O_WRONLY | os.O_CREAT)
        fileio.pwrite(fd, b"x" * 64 * SECTOR, 0)
        fileio.punch_hole(fd, 0, 48 * SECTOR)
        fileio.fdatasync(fd)
        fileio.close(fd)
        fileio.fsync_dir(tmp_path)
    out = tmp_path.parent / (tmp_path.name + "-state")
    out.mkdir()
    materialize(build(rec, CrashState(len(rec.ops), "synced", 0)), out)
    assert (out / "seg").stat().st_size == 64 * SECTOR
    assert (out / "seg").stat().st_blocks * 512 <= 20 * SECTOR


def test_a_real_tier_trace_has_every_kind_of_operation(tmp_path):
    from benchmarks.power.workloads import record

    kinds = {op.kind for name in ("journal_compaction", "segment_compaction", "wiped_directory")
             for op in record(name, tmp_path / name, 1).trace.ops}
    assert {"create", "write", "alloc", "punch", "trunc", "fsync", "dsync", "rename", "unlink", "mkdir",
            "ack"} <= kinds


def test_states_cover_the_whole_run_in_every_mode(tmp_path):
    from benchmarks.power.workloads import record

    trace = record("group_commit", tmp_path / "run", 2).trace
    states = sample_states(trace, 60, 2)
    assert {s.mode for s in states} == {"all", "synced", "subset", "torn", "reorder"}
    assert min(s.upto for s in states) < len(trace.ops) // 4 and max(s.upto for s in states) == len(trace.ops)


def test_a_sync_covers_what_was_written_before_it_began(tmp_path):
    """A write another thread finishes while a sync of its file runs is not known to be covered."""
    rec = Recorder(tmp_path)
    fd = 99
    rec.opened(fd, tmp_path / "f", True, False)
    rec.wrote(fd, 0, b"a" * SECTOR)
    began = rec.sync_begins()
    rec.wrote(fd, SECTOR, b"b" * SECTOR)  # lands while the sync runs
    rec.synced(fd, began)
    rec.synced_dir(tmp_path, rec.sync_begins())
    state = build(rec, CrashState(len(rec.ops), "synced", 0))
    assert bytes(state.files["f"].data) == b"a" * SECTOR


def test_the_door_gives_the_mode_to_the_last_directory_only(tmp_path):
    fileio.mkdir(tmp_path / "a" / "b" / "keys", mode=0o700)
    assert (tmp_path / "a" / "b" / "keys").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o777 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
