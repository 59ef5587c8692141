"""The NVMe tier's segment layout on a real disk: group commit, merged reads, torn tails, a lost or
damaged index, space reclaim (holes, compaction), the previous one-file-per-block layout, the lock.

Each test drives ``NvmeStore`` through its public surface and then looks at the files themselves.
"""
from __future__ import annotations

import hashlib
import os
import struct
import time

import pytest
import torch

from kvtier.errors import CapacityError, StorageError
from kvtier.tiers.dram import PAGE, DramArena, round_up
from kvtier.tiers.nvme.journal import JOURNAL_NAME, Extent
from kvtier.tiers.nvme.parts import _Item
from kvtier.tiers.nvme.space import SegmentSpace
from kvtier.tiers.nvme.store import IO_BYTES, BlockRecord, NvmeStore, scan_shards
from kvtier.tiers.records import HEADER_BYTES, checksum, file_bytes_for

NS = bytes(range(16))
FP = b"F" * 16
GiB = 1 << 30


def payload_for(key: bytes, n: int) -> bytes:
    return hashlib.shake_256(key).digest(n)


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def write_all(store: NvmeStore, names: list[bytes], n: int) -> None:
    outcomes = store.write_batch([(NS, k, bytearray(payload_for(k, n)), "none") for k in names], FP)
    assert all(isinstance(o, int) for o in outcomes), outcomes


def check_all(store: NvmeStore, names: list[bytes], n: int) -> None:
    dst = [torch.empty(round_up(n) + PAGE, dtype=torch.uint8) for _ in names]
    outcomes = store.read_batch([(NS, k, d) for k, d in zip(names, dst)], FP)
    for k, d, outcome in zip(names, dst, outcomes):
        assert outcome == (n, "none"), (k, outcome)
        assert bytes(d[:n].numpy()) == payload_for(k, n), k


def segments(root) -> list:
    return sorted((root / "segments").glob("*.kvseg"))


# ---- batching -----------------------------------------------------------------------------------
def test_a_batch_is_one_group_commit_and_comes_back_in_merged_reads(tmp_path):
    store = NvmeStore(tmp_path / "nvme", GiB)
    n = 60_000  # 64 KiB records: 16 per MiB
    names = keys(256)
    try:
        write_all(store, names, n)
        # One batch: one journal append and one fdatasync; 16 MiB of records in 8 MiB writes.
        total = 256 * file_bytes_for(n)
        assert store.io_counts["commits"] == 1 and store.io_counts["syncs"] == 1
        assert store.io_counts["write_ios"] == -(-total // IO_BYTES)
        check_all(store, names, n)
        assert store.io_counts["read_ios"] == -(-total // IO_BYTES)  # adjacent records merged
        # Reading every other block cannot merge: one read each, still all correct.
        before = store.io_counts["read_ios"]
        check_all(store, names[::2], n)
        assert store.io_counts["read_ios"] - before == 128
        # Everything lies in one segment file: no file per block.
        assert len(segments(store.root)) == 1
    finally:
        store.close()


def test_a_batch_reports_each_block_on_its_own(tmp_path):
    """The budget keeps one block out; the others of the same batch are stored."""
    n = 5000
    store = NvmeStore(tmp_path / "nvme", 3 * file_bytes_for(n))
    try:
        outcomes = store.write_batch([(NS, k, bytearray(payload_for(k, n)), "none") for k in keys(4)], FP)
        assert [isinstance(o, int) for o in outcomes] == [True, True, True, False]
        assert type(outcomes[3]).__name__ == "CapacityError"
        check_all(store, keys(3), n)
        # Missing and present blocks in one read batch.
        dst = torch.empty(2 * PAGE, dtype=torch.uint8)
        got = store.read_batch([(NS, b"k0", dst), (NS, b"nope", dst)], FP)
        assert got[0] == (n, "none") and isinstance(got[1], StorageError)
    finally:
        store.close()


def test_segments_roll_over_and_an_emptied_one_is_deleted(tmp_path):
    n = 250_000
    store = NvmeStore(tmp_path / "nvme", GiB, segment_bytes=1 << 20)  # 4 records per segment
    try:
        for i in range(4):
            write_all(store, keys(4, f"s{i}-"), n)
        assert len(segments(store.root)) == 4
        store.delete_many([(NS, k) for k in keys(4, "s0-")])  # a sealed segment with nothing live
        assert len(segments(store.root)) == 3
        for i in range(1, 4):
            check_all(store, keys(4, f"s{i}-"), n)
    finally:
        store.close()


# ---- crashes --------------------------------------------------------------------------------------
def test_a_torn_segment_tail_is_dropped_and_punched_at_start(tmp_path):
    """A crash between a batch's writes and its journal append leaves records no entry names: the
    next start ignores them and gives their space back; a torn journal entry is cut off."""
    root = tmp_path / "nvme"
    store = NvmeStore(root, GiB)
    write_all(store, keys(8), 30_000)
    path, offset, size = store.locate(NS, b"k7")
    store.close()
    # What a killed batch leaves: a complete-looking record (valid header, valid payload) and half of
    # another, after the last committed record; and half a journal entry.
    record = open(path, "rb").read()[offset : offset + size]
    with open(path, "r+b") as f:
        os.pwrite(f.fileno(), record, offset + size)
        os.pwrite(f.fileno(), record[: size // 2], offset + 2 * size)
    with open(root / JOURNAL_NAME, "ab") as f:
        f.write(b"\x01" * 70)
    journal_size = (root / JOURNAL_NAME).stat().st_size
    again = NvmeStore(root, GiB)
    try:
        assert (root / JOURNAL_NAME).stat().st_size == journal_size - 70  # the torn entry is cut
        assert {r.key for r in again.scan()} == set(keys(8))
        check_all(again, keys(8), 30_000)
        with open(path, "rb") as f:  # the unnamed tail reads as zeros: punched
            tail = os.pread(f.fileno(), 2 * size, offset + size)
            assert len(tail) == size + size // 2 and tail == bytes(len(tail))
        assert again.used_bytes == 8 * file_bytes_for(30_000)
    finally:
        again.close()


@pytest.mark.parametrize("how", ["missing", "garbage"])
def test_a_lost_index_is_rebuilt_from_the_segments(tmp_path, how):
    root = tmp_path / "nvme"
    store = NvmeStore(root, GiB, segment_bytes=1 << 20)
    write_all(store, keys(20), 100_000)  # several segments
    store.write(NS, b"k3", bytearray(payload_for(b"k3-new", 50_000)), FP)  # a newer copy of k3
    store.delete(NS, b"k5")
    path, offset, size = store.locate(NS, b"k3")
    store.close()
    # A torn record after the newest one (valid header, payload cut short by the crash).
    with open(path, "r+b") as f:
        record = os.pread(f.fileno(), size, offset)
        os.pwrite(f.fileno(), record.replace(b"k3", b"kX", 1)[: HEADER_BYTES + 1000], offset + size)
    if how == "missing":
        (root / JOURNAL_NAME).unlink()
    else:
        (root / JOURNAL_NAME).write_bytes(b"not a journal" * 10)
    again = NvmeStore(root, GiB)
    try:
        assert again.rebuilt_index
        found = {r.key: r.nbytes for r in again.scan()}
        assert found[b"k3"] == 50_000  # the newest copy wins
        assert b"kX" not in found  # the torn record is not trusted
        assert b"k5" not in found  # a punched-out record does not come back
        assert set(found) == set(keys(20)) - {b"k5"}
        dst = torch.empty(round_up(50_000), dtype=torch.uint8)
        assert again.read_into(NS, b"k3", dst, FP) == (50_000, "none")
        assert bytes(dst[:50_000].numpy()) == payload_for(b"k3-new", 50_000)
        check_all(again, [k for k in keys(20) if k not in (b"k3", b"k5")], 100_000)
        if how == "garbage":  # kept for a post-mortem, out of the way
            assert list(root.glob(JOURNAL_NAME + ".bad-unreadable-*"))
    finally:
        again.close()
    third = NvmeStore(root, GiB)  # the rebuilt index is the journal now
    try:
        assert not third.rebuilt_index and len(third.scan()) == 19
    finally:
        third.close()


def test_an_entry_naming_a_punched_record_is_dropped_at_start(tmp_path):
    """A drop whose journal append failed (a full disk) still frees its space; at the next start the
    entry that still names the hole is dropped, not served."""
    root = tmp_path / "nvme"
    store = NvmeStore(root, GiB)
    write_all(store, keys(4), 20_000)
    path, offset, size = store.locate(NS, b"k1")
    store.close()
    from kvtier.tiers.fileio import punch_hole

    fd = os.open(path, os.O_WRONLY)
    assert punch_hole(fd, offset, size)
    os.close(fd)
    again = NvmeStore(root, GiB)
    try:
        assert {r.key for r in again.scan()} == {b"k0", b"k2", b"k3"} and again.removed_at_scan == 1
    finally:
        again.close()


# ---- space ---------------------------------------------------------------------------------------
def test_compaction_reclaims_space_where_holes_cannot_be_punched(tmp_path):
    root = tmp_path / "nvme"
    store = NvmeStore(root, GiB, segment_bytes=1 << 20)
    store.can_punch = False  # as on a filesystem without PUNCH_HOLE
    n = 100_000
    write_all(store, keys(9, "a"), n)  # 9 records: the first segment is full, the second takes the rest
    write_all(store, keys(9, "b"), n)
    first = segments(root)[0]
    store.delete_many([(NS, k) for k in keys(9, "a")[1:]])  # the first segment is mostly dead
    assert first.exists() and first.stat().st_blocks * 512 >= 8 * file_bytes_for(n)
    moved = store.compact()
    assert moved == file_bytes_for(n)  # only the live record moved
    assert not first.exists()
    check_all(store, [b"a0"], n)
    check_all(store, keys(9, "b"), n)
    store.close()
    again = NvmeStore(root, GiB)
    try:
        assert {r.key for r in again.scan()} == {b"a0", *keys(9, "b")}
        check_all(again, [b"a0"], n)
    finally:
        again.close()


def test_the_budget_counts_bytes_on_disk(tmp_path):
    store = NvmeStore(tmp_path / "nvme", GiB)
    try:
        write_all(store, keys(64), 60_000)
        full = store.disk_bytes()
        assert abs(full - store.used_bytes) <= PAGE * 16
        store.delete_many([(NS, k) for k in keys(64)[::2]])
        assert abs(store.disk_bytes() - store.used_bytes) <= PAGE * 16 and store.disk_bytes() < 0.6 * full
    finally:
        store.close()


# ---- the previous layout -------------------------------------------------------------------------
def _old_block_file(root, namespace: bytes, key: bytes, payload: bytes) -> None:
    """A block file exactly as kvtier wrote them before segments (header version 2)."""
    header_v2 = struct.Struct("<4sHHQQQ16s16s32sH64s")
    body = header_v2.pack(b"KVTB", 2, 0, len(payload), checksum(payload), time.time_ns(), FP, namespace,
                          b"none", len(key), key)
    page = body + struct.pack("<Q", checksum(body))
    path = root / "blocks" / namespace.hex() / key.hex()[:2] / f"{key.hex()}.{len(payload)}.kvb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(page.ljust(HEADER_BYTES, b"\0") + payload.ljust(round_up(len(payload)), b"\0"))


def test_the_previous_layout_is_served_then_migrated(tmp_path):
    root = tmp_path / "nvme"
    old = keys(6, "old")
    for k in old:
        _old_block_file(root, NS, k, payload_for(k, 30_000))
    store = NvmeStore(root, GiB)
    try:
        assert {r.key for r in store.scan()} == set(old)  # served as they are
        check_all(store, old, 30_000)
        write_all(store, keys(3, "new"), 30_000)
        assert store.compact() == 6 * file_bytes_for(30_000)  # moved into the open segment
        assert list((root / "blocks").rglob("*.kvb")) == []
        check_all(store, old, 30_000)
    finally:
        store.close()
    again = NvmeStore(root, GiB)
    try:
        assert {r.key for r in again.scan()} == set(old) | set(keys(3, "new"))
        check_all(again, old, 30_000)
    finally:
        again.close()


# ---- ownership ---------------------------------------------------------------------------------------
def test_one_writer_per_directory_and_readers_see_its_commits(tmp_path):
    root = tmp_path / "nvme"
    store = NvmeStore(root, GiB)
    try:
        write_all(store, keys(5), 10_000)
        with pytest.raises(StorageError) as info:
            NvmeStore(root, GiB)
        assert str(os.getpid()) in str(info.value) and "--nvme-dir" in info.value.hint
        records, removed = scan_shards(root, GiB, 1)  # the scheduler half's read-only scan
        assert {r.key for r in records} == set(keys(5)) and removed == 0
    finally:
        store.close()
    NvmeStore(root, GiB).close()  # free again once closed


def test_a_wiped_directory_is_recreated_and_forgets_its_blocks(tmp_path):
    import shutil

    root = tmp_path / "nvme"
    store = NvmeStore(root, GiB)
    try:
        write_all(store, keys(3), 10_000)
        shutil.rmtree(root)
        assert store.check_present() and store.recreated == 1
        assert store.num_blocks == 0
        write_all(store, [b"fresh"], 10_000)
        check_all(store, [b"fresh"], 10_000)
        # a wipe found by a write instead of the check
        shutil.rmtree(root)
        write_all(store, [b"fresher"], 10_000)
        assert store.recreated == 2
        check_all(store, [b"fresher"], 10_000)
    finally:
        store.close()
    again = NvmeStore(root, GiB)
    try:
        assert [r.key for r in again.scan()] == [b"fresher"]
    finally:
        again.close()


def test_reads_land_in_arena_slots_in_place(tmp_path):
    """Page-aligned destinations with room for the padding are read into directly (no bounce)."""
    store = NvmeStore(tmp_path / "nvme", GiB)
    arena = DramArena(8, 64 * 1024, pin=False)
    try:
        write_all(store, keys(8), 50_000)
        arena.buffer.zero_()
        got = store.read_batch([(NS, k, arena.slot(i)) for i, k in enumerate(keys(8))], FP)
        assert got == [(50_000, "none")] * 8
        for i, k in enumerate(keys(8)):
            assert bytes(arena.slot(i, 50_000).numpy()) == payload_for(k, 50_000)
        assert BlockRecord(NS, b"k0", 50_000) in store.scan()
    finally:
        store.close()


def test_a_block_dropped_while_compaction_copies_it_stays_dropped(tmp_path):
    """Compaction commits a copy only if its block still has the extent it copied: a block dropped
    in between is not brought back, and the copy's space and budget are given back."""
    root = tmp_path / "nvme"
    store = NvmeStore(root, GiB, segment_bytes=1 << 20)
    store.can_punch = False
    n = 100_000
    try:
        write_all(store, keys(9, "a"), n)
        write_all(store, keys(9, "b"), n)
        store.delete_many([(NS, k) for k in keys(9, "a")[2:]])
        picked = [((NS, k), store.locator[(NS, k)]) for k in (b"a0", b"a1")]
        store.delete(NS, b"a1")  # dropped after compaction chose it, before its copy is committed
        assert store.compactor.move(picked) == file_bytes_for(n)  # only a0 moved
        assert not store.contains(NS, b"a1") and store.contains(NS, b"a0")
        assert store.used_bytes == sum(s.live for s in store.space.segments.values()) == 10 * file_bytes_for(n)
        check_all(store, [b"a0"], n)
    finally:
        store.close()
    again = NvmeStore(root, GiB)
    try:
        assert b"a1" not in {r.key for r in again.scan()}
    finally:
        again.close()


def test_the_budget_is_what_segments_hold_plus_what_writes_reserved(tmp_path):
    """One budget: a reservation counts until its records are named (then live) or failed (then
    given back); a drop takes the live bytes off. Nothing else keeps a count."""
    seg_dir = tmp_path / "segments"
    seg_dir.mkdir()
    size = file_bytes_for(10_000)
    space = SegmentSpace(seg_dir, 3 * size, 1 << 20)
    space.reserve(2 * size)
    assert space.used_bytes == 2 * size
    with pytest.raises(CapacityError):
        space.reserve(2 * size)
    items = [_Item(i, NS, b"k%d" % i, b"", Extent(0, 0, 10_000, "none")) for i in range(2)]
    space.place(items)
    space.committed([items[0].extent])  # named: live now
    space.settle([items[1]])  # failed: its reservation goes back
    space.release(size)
    assert space.used_bytes == size == sum(s.live for s in space.segments.values())
    assert space.forget([items[0].extent]) == size and space.used_bytes == 0
