"""Tests for kvtier.tiers.nvme.store: block records in segment files on a real disk with real O_DIRECT, no mocks.

Scenarios: round trips from/to aligned and unaligned memory in both IO modes, restart (journal
replay), every kind of corruption, the byte budget, a really full filesystem (a 2 MiB tmpfs),
SIGKILLed writers, and parallel IO through the store's thread pool. Segment-specific cases (torn
tails, a lost index, compaction, the old layout, the lock) are in test_segments.py.
"""
from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvtier.errors import CapacityError, CorruptBlockError, StorageError, StorageFullError
from kvtier.tiers.dram import PAGE, DramArena, round_up
from kvtier.tiers.nvme.store import HEADER_BYTES, BlockRecord, NvmeStore, file_bytes_for

NS = bytes(range(16))
NS2 = b"\xee" * 16
FP = b"F" * 16
FP2 = b"G" * 16
GiB = 1 << 30
SIZES = [2, 4096, 5000, 12346, 70000]
MAX_BLOCK = 512 * 1024


def payload_for(key: bytes, n: int) -> bytes:
    """Deterministic, key-specific bytes (so a swapped or stale block is told apart)."""
    return hashlib.shake_256(key).digest(n)


def read_back(store: NvmeStore, ns: bytes, key: bytes, fp: bytes = FP) -> tuple[bytes, str]:
    dst = torch.empty(MAX_BLOCK, dtype=torch.uint8)
    nbytes, codec = store.read_into(ns, key, dst, fp)
    return bytes(dst[:nbytes].numpy()), codec


def segment_files(root: Path) -> list[Path]:
    return sorted((root / "segments").glob("*.kvseg"))


def stray_files(root: Path) -> list[str]:
    """Files a failed or killed write could leave behind (the old layout's temp files, temp journals)."""
    return sorted(p.name for p in root.rglob("*") if p.name.endswith(".tmp") or p.parent.name == "tmp")


def record_bytes(store: NvmeStore, key: bytes, ns: bytes = NS) -> bytes:
    path, offset, size = store.locate(ns, key)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


@pytest.fixture
def store(tmp_path):
    s = NvmeStore(tmp_path / "nvme", GiB)
    yield s
    s.close()


def unaligned_uint8(n: int) -> torch.Tensor:
    """An ordinary tensor of n bytes that does not start on a page (nor on 8 bytes)."""
    t = torch.zeros(n + 8, dtype=torch.uint8)[3 : 3 + n]
    assert t.data_ptr() % PAGE and t.is_contiguous()
    return t


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("dst_kind", ["arena", "tensor"])
@pytest.mark.parametrize("src_kind", ["arena", "tensor", "bytearray"])
@pytest.mark.parametrize("direct", ["auto", "off"])
def test_round_trip(tmp_path, direct, src_kind, dst_kind):
    store = NvmeStore(tmp_path / "nvme", GiB, direct=direct)
    try:
        # The test disk supports O_DIRECT: "auto" must pick it, "off" must not.
        assert store.direct is (direct == "auto")
        arena = DramArena(2, MAX_BLOCK, pin=False)
        for n in SIZES:
            key = f"{src_kind}-{n}".encode()
            data = payload_for(key, n)
            # Build the payload in the requested kind of memory.
            if src_kind == "arena":
                arena.slot(0).fill_(0xCC)  # junk behind the payload must not matter
                arena.slot(0, n).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                payload = arena.slot(0, n)
                assert payload.data_ptr() % PAGE == 0
            elif src_kind == "tensor":  # bf16, 2 bytes past an allocation start: not page aligned
                base = torch.empty(n // 2 + 4, dtype=torch.bfloat16)
                payload = base[1 : 1 + n // 2]
                payload.view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                assert payload.data_ptr() % PAGE
            else:
                payload = bytearray(data)
            # Write: the record is the header page plus the page-padded payload, in a segment.
            size = store.write(NS, key, payload, FP, codec="fp8-e4m3")
            assert size == file_bytes_for(n) == HEADER_BYTES + round_up(n)
            path, offset, length = store.locate(NS, key)
            assert length == size and offset % PAGE == 0 and path.parent.name == "segments"
            assert record_bytes(store, key)[HEADER_BYTES : HEADER_BYTES + n] == data
            assert store.contains(NS, key)
            # Read into an aligned arena slot or an unaligned tensor (neighbours untouched).
            if dst_kind == "arena":
                arena.slot(1).fill_(0x55)
                nbytes, codec = store.read_into(NS, key, arena.slot(1), FP)
                got = bytes(arena.slot(1, nbytes).numpy())
            else:
                outer = torch.zeros(n + 16, dtype=torch.uint8)
                dst = outer[5 : 5 + n]
                nbytes, codec = store.read_into(NS, key, dst, FP)
                got = bytes(dst.numpy())
                assert not outer[:5].any() and not outer[5 + n :].any()
            assert (nbytes, codec) == (n, "fp8-e4m3")
            assert got == data
        assert store.num_blocks == len(SIZES)
        assert store.used_bytes == sum(file_bytes_for(n) for n in SIZES)
        assert len(segment_files(store.root)) == 1 and stray_files(store.root) == []
    finally:
        store.close()


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_noncontiguous_tensor_payload(tmp_path, direct):
    """A transposed view of a page-aligned slot must be stored in logical order, in both modes."""
    store = NvmeStore(tmp_path / "nvme", GiB, direct=direct)
    try:
        arena = DramArena(1, 8192, pin=False)
        square = arena.slot(0, 64 * 32).view(64, 32)
        gen = torch.Generator().manual_seed(1)
        square.copy_(torch.randint(0, 256, (64, 32), dtype=torch.uint8, generator=gen))
        transposed = square.t()
        assert not transposed.is_contiguous() and transposed.data_ptr() % PAGE == 0
        store.write(NS, b"t", transposed, FP)
        got, _ = read_back(store, NS, b"t")
        assert got == bytes(transposed.contiguous().view(-1).numpy())
    finally:
        store.close()


def test_overwrite_with_other_size_replaces_the_record(store):
    # Write a key, then the same key with another payload size: the new bytes, the old record punched out.
    store.write(NS, b"k", bytearray(payload_for(b"a", 5000)), FP)
    first = store.locate(NS, b"k")
    store.write(NS, b"k", bytearray(payload_for(b"b", 9000)), FP)
    assert read_back(store, NS, b"k")[0] == payload_for(b"b", 9000)
    assert store.used_bytes == file_bytes_for(9000) and store.num_blocks == 1
    with open(first[0], "rb") as f:  # the old record's pages are a hole now: zeros
        assert os.pread(f.fileno(), first[2], first[1]) == bytes(first[2])
    # Same size again: replaced.
    store.write(NS, b"k", bytearray(payload_for(b"c", 9000)), FP)
    assert read_back(store, NS, b"k")[0] == payload_for(b"c", 9000)
    assert store.used_bytes == file_bytes_for(9000)
    assert store.disk_bytes() <= 2 * file_bytes_for(9000)  # punched: the disk holds the live record
    # Delete frees its bytes.
    assert store.delete(NS, b"k") == file_bytes_for(9000)
    assert store.delete(NS, b"k") == 0
    assert store.used_bytes == 0 and store.disk_bytes() <= PAGE
    with pytest.raises(StorageError):
        read_back(store, NS, b"k")


def test_bad_ids_are_refused(store):
    with pytest.raises(ValueError):
        store.write(NS[:8], b"k", bytearray(10), FP)
    with pytest.raises(ValueError):
        store.write(NS, b"k" * 65, bytearray(10), FP)
    with pytest.raises(ValueError):
        store.write(NS, b"k", bytearray(10), FP[:4])
    assert store.used_bytes == 0 and store.num_blocks == 0


# ---- restart ----------------------------------------------------------------------------------
def test_restart_replays_the_index(tmp_path):
    root = tmp_path / "nvme"
    # First life: blocks in two namespaces, one of them overwritten with another size.
    first = NvmeStore(root, GiB)
    expected = set()
    for i, n in enumerate(SIZES):
        for ns in (NS, NS2):
            key = hashlib.sha256(f"{i}".encode()).digest()[: 8 + i]
            first.write(ns, key, bytearray(payload_for(ns + key, n)), FP)
            expected.add(BlockRecord(ns, key, n))
    first.write(NS, b"again", bytearray(payload_for(NS + b"again", 100)), FP)
    first.write(NS, b"again", bytearray(payload_for(NS + b"again", 7000)), FP)
    expected.add(BlockRecord(NS, b"again", 7000))
    first.write(NS, b"gone", bytearray(payload_for(NS + b"gone", 3000)), FP)
    first.delete(NS, b"gone")
    first.close()

    # The old layout's temp directory (a crash in an earlier version) is cleaned away.
    (root / "tmp").mkdir()
    (root / "tmp" / "abcd.5000.12345678").write_bytes(b"x" * 5000)
    stray = root / "segments" / "not-a-segment.txt"
    stray.write_bytes(b"?")
    second = NvmeStore(root, GiB)
    try:
        assert not (root / "tmp").exists() and stray.exists()
        assert not second.rebuilt_index and second.removed_at_scan == 0
        records = second.scan()
        assert len(records) == len(expected) and set(records) == expected
        assert second.num_blocks == len(expected)
        assert second.used_bytes == sum(file_bytes_for(r.nbytes) for r in expected)
        # Every block reads back and verifies.
        for r in expected:
            assert read_back(second, r.namespace, r.key)[0] == payload_for(r.namespace + r.key, r.nbytes)
        victim = BlockRecord(NS, b"again", 7000)
        path, offset, size = second.locate(NS, b"again")
    finally:
        second.close()

    # The disk loses the end of the segment, in the middle of the last record: that block is
    # dropped at start, the rest is intact.
    os.truncate(path, offset + size - 100)
    third = NvmeStore(root, GiB)
    try:
        records = third.scan()
        assert set(records) == expected - {victim}
        assert third.removed_at_scan == 1
        assert third.used_bytes == sum(file_bytes_for(r.nbytes) for r in records)
        for r in records:
            assert read_back(third, r.namespace, r.key)[0] == payload_for(r.namespace + r.key, r.nbytes)
        third.write(NS, b"after", bytearray(payload_for(b"after", 5000)), FP)  # a new segment takes it
        assert read_back(third, NS, b"after")[0] == payload_for(b"after", 5000)
    finally:
        third.close()


# ---- corruption -------------------------------------------------------------------------------
def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
        f.flush()
        os.fsync(f.fileno())


CORRUPTIONS = ["payload_first_bit", "payload_last_byte", "header_magic", "header_nbytes",
               "header_fingerprint", "header_key", "header_checksum", "swapped", "wrong_fingerprint",
               "truncated_after_scan", "truncated_page_after_scan", "zeroed", "segment_vanished"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("direct", ["auto", "off"])
def test_corruption_is_detected_and_block_removed(tmp_path, kind, direct):
    root = tmp_path / "nvme"
    n = 5000
    store = NvmeStore(root, GiB, direct=direct)
    # Three blocks of the same size (so a swapped record has the right length); A is the last record.
    for key in (b"B", b"C", b"A"):
        store.write(NS, key, bytearray(payload_for(key, n)), FP)
    if kind.endswith("after_scan"):  # restart first, so the index comes from the journal
        store.close()
        store = NvmeStore(root, GiB, direct=direct)
        assert len(store.scan()) == 3
    path, at, size = store.locate(NS, b"A")
    _path, at_b, _size = store.locate(NS, b"B")
    fp = FP
    # Damage block A.
    if kind == "payload_first_bit":
        flip_bit(path, at + HEADER_BYTES, 0)
    elif kind == "payload_last_byte":
        flip_bit(path, at + HEADER_BYTES + n - 1, 7)
    elif kind == "header_magic":
        flip_bit(path, at, 3)
    elif kind == "header_nbytes":
        flip_bit(path, at + 8, 1)
    elif kind == "header_fingerprint":
        flip_bit(path, at + 40, 5)
    elif kind == "header_key":
        flip_bit(path, at + 100, 0)
    elif kind == "header_checksum":
        flip_bit(path, at + 150, 2)
    elif kind == "swapped":  # B's record copied over A's: right size, wrong block
        with open(path, "r+b") as f:
            os.pwrite(f.fileno(), os.pread(f.fileno(), size, at_b), at)
    elif kind == "wrong_fingerprint":  # an engine running another model asks for A
        fp = FP2
    elif kind == "truncated_after_scan":
        os.truncate(path, at + size - 100)
    elif kind == "truncated_page_after_scan":
        os.truncate(path, at + size - PAGE)
    elif kind == "zeroed":
        with open(path, "r+b") as f:
            os.pwrite(f.fileno(), bytes(size), at)
    elif kind == "segment_vanished":
        path.unlink()
    used = store.used_bytes
    try:
        # The read detects it ...
        with pytest.raises(CorruptBlockError) as info:
            read_back(store, NS, b"A", fp)
        assert info.value.path and Path(info.value.path).name == path.name
        # ... and the block is gone: from the index, the budget and the disk.
        assert not store.contains(NS, b"A")
        assert store.used_bytes == used - file_bytes_for(n)
        if path.exists() and path.stat().st_size >= at + size:
            assert os.pread(os.open(path, os.O_RDONLY), size, at) == bytes(size)  # punched out
        with pytest.raises(StorageError):
            read_back(store, NS, b"A")
        if kind == "segment_vanished":  # its neighbours went with it, each found on its read
            for key in (b"B", b"C"):
                with pytest.raises(CorruptBlockError):
                    read_back(store, NS, key)
            return
        # B and C are unharmed.
        assert read_back(store, NS, b"C")[0] == payload_for(b"C", n)
        assert read_back(store, NS, b"B")[0] == payload_for(b"B", n)
    finally:
        store.close()
    # A restarted store does not bring A back.
    again = NvmeStore(root, GiB)
    try:
        keys = {r.key for r in again.scan()}
        assert b"A" not in keys and {b"B", b"C"} <= keys
    finally:
        again.close()


# ---- capacity budget --------------------------------------------------------------------------
def test_capacity_budget(tmp_path):
    n = 5000
    capacity = 3 * file_bytes_for(n) + PAGE - 1
    store = NvmeStore(tmp_path / "nvme", capacity)
    try:
        # Three blocks fit; the budget is never exceeded along the way.
        for i in range(3):
            store.write(NS, bytes([i]), bytearray(payload_for(bytes([i]), n)), FP)
            assert store.used_bytes <= capacity
        # The fourth does not: CapacityError with a hint, nothing left behind.
        with pytest.raises(CapacityError) as info:
            store.write(NS, b"\x03", bytearray(payload_for(b"\x03", n)), FP)
        assert info.value.hint
        assert store.used_bytes == 3 * file_bytes_for(n) <= capacity
        assert not store.contains(NS, b"\x03") and store.num_blocks == 3
        # A small payload still needs a whole header page plus a payload page: refused too.
        with pytest.raises(CapacityError):
            store.write(NS, b"tiny", bytearray(1), FP)
        # A block larger than the whole budget is refused, also via the thread pool.
        with pytest.raises(CapacityError):
            store.submit_write(NS, b"big", bytearray(capacity), FP).result()
        assert store.used_bytes <= capacity
        # Deleting one makes room for exactly one more.
        store.delete(NS, b"\x00")
        store.write(NS, b"\x03", bytearray(payload_for(b"\x03", n)), FP)
        assert store.used_bytes <= capacity
        with pytest.raises(CapacityError):
            store.write(NS, b"\x04", bytearray(payload_for(b"\x04", n)), FP)
        for i in (1, 2, 3):
            assert read_back(store, NS, bytes([i]))[0] == payload_for(bytes([i]), n)
    finally:
        store.close()


# ---- a full filesystem (ENOSPC) -----------------------------------------------------------------
def enospc_scenario(mnt: str) -> None:
    """Fill a 2 MiB filesystem with blocks until ENOSPC; runs in-process or in a child process."""
    root = Path(mnt) / "nvme"
    store = NvmeStore(root, GiB)  # the budget is far bigger than the filesystem
    written: dict[bytes, int] = {}
    try:
        # Write ~100 KB blocks until the device is full.
        for i in range(200):
            key = hashlib.sha256(b"%d" % i).digest()[:12]
            n = 90_000 + 1_111 * i
            try:
                store.write(NS, key, bytearray(payload_for(key, n)), FP)
            except StorageFullError as exc:
                assert exc.hint and "intact" in exc.hint, exc.hint
                break
            written[key] = n
        else:
            raise AssertionError("a 2 MiB filesystem never filled up")
        assert len(written) >= 5, len(written)
        # The failed write left nothing named; the budget counts only real blocks.
        assert store.num_blocks == len(written)
        assert store.used_bytes == sum(file_bytes_for(n) for n in written.values())
        # Another write still fails cleanly.
        with pytest.raises(StorageFullError):
            store.write(NS, b"one-more", bytearray(payload_for(b"one-more", 200_000)), FP)
        assert store.num_blocks == len(written)
        # Every earlier block still reads back intact.
        for key, n in written.items():
            assert read_back(store, NS, key)[0] == payload_for(key, n)
    finally:
        store.close()
    # After a restart, scan() sees exactly the successful writes.
    store = NvmeStore(root, GiB)
    try:
        assert set(store.scan()) == {BlockRecord(NS, k, n) for k, n in written.items()}
        for key, n in written.items():
            assert read_back(store, NS, key)[0] == payload_for(key, n)
        # Freeing space makes writes work again.
        for key in list(written)[:3]:
            store.delete(NS, key)
            del written[key]
        store.write(NS, b"after", bytearray(payload_for(b"after", 150_000)), FP)
        assert read_back(store, NS, b"after")[0] == payload_for(b"after", 150_000)
    finally:
        store.close()


def test_storage_full(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    forced = os.environ.get("KVTIER_TEST_FORCE_UNSHARE") == "1"
    mounted = not forced and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
    ).returncode == 0
    if mounted:
        try:
            enospc_scenario(str(mnt))
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        return
    # No mount permission here: run the scenario in a private user + mount namespace instead.
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import test_nvme; test_nvme.enospc_scenario({str(mnt)!r}); print('ENOSPC-OK')"
    )
    script = 'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$1" -c "$2"'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mnt), sys.executable, code],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ENOSPC-OK" in proc.stdout, proc.stdout + proc.stderr


# ---- crash (SIGKILL) while writing ----------------------------------------------------------------
CRASH_HELPERS = '''
import hashlib

def crash_payload(key: bytes) -> bytes:
    n = 1000 + int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") % 300_000
    return hashlib.shake_256(key).digest(n)
'''
_helpers: dict = {}
exec(CRASH_HELPERS, _helpers)  # the parent checks with the very source the child writes with
crash_payload = _helpers["crash_payload"]

CRASH_WRITER = CRASH_HELPERS + '''
import sys
from kvtier.tiers.nvme.store import NvmeStore

root, run = sys.argv[1], sys.argv[2]
store = NvmeStore(root, 1 << 40)
i = 0
while True:
    key = f"r{run}-{i}".encode()
    store.write(bytes(range(16)), key, bytearray(crash_payload(key)), b"F" * 16)
    print(key.decode(), flush=True)  # acknowledged: write() returned, so the block is durable
    i += 1
'''


def test_sigkill_during_writes_keeps_acknowledged_blocks(tmp_path):
    root = tmp_path / "nvme"
    rng = random.Random(1234)
    acked: set[bytes] = set()
    interrupted = 0
    for run in range(10):
        # A writer process stores blocks in a loop and acknowledges each one on stdout.
        proc = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(root), str(run)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Wait for a random number of acknowledgements, then a random moment more, then SIGKILL.
            want = rng.randint(1, 8)
            seen = 0
            while seen < want:
                line = proc.stdout.readline()
                assert line, f"writer died: {proc.stderr.read()}"
                acked.add(line.strip().encode())
                seen += 1
            # Random jitter, not a wait for a state: the kill landing at an arbitrary point of a
            # batch (mid-pwritev, mid-sync, mid-journal append) is what this test exercises.
            time.sleep(rng.uniform(0, 0.02))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL
        # Acknowledgements still in the pipe count too (complete lines only).
        rest = proc.stdout.read().split("\n")
        acked.update(k.encode() for k in rest[:-1] if k)
        proc.stdout.close()
        proc.stderr.close()
        segments = segment_files(root)
        unnamed = segments[-1].stat().st_size if segments else 0  # bytes a killed batch may have left

        # A fresh store: only complete blocks visible, every ack present and intact, torn tails punched.
        store = NvmeStore(root, 1 << 40)
        try:
            interrupted += unnamed > store.used_bytes
            records = store.scan()
            visible = {r.key: r.nbytes for r in records}
            assert all(r.namespace == NS for r in records)
            missing = acked - set(visible)
            assert not missing, f"acknowledged blocks lost: {sorted(missing)[:5]}"
            for key, nbytes in visible.items():
                expected = crash_payload(key)
                assert nbytes == len(expected), key
                assert read_back(store, NS, key)[0] == expected, key
            assert store.num_blocks == len(visible)  # no read found a bad block
        finally:
            store.close()
    assert len(acked) >= 10
    print(f"{len(acked)} acknowledged blocks, {interrupted} kills left unnamed bytes behind")


# ---- parallel IO through the thread pool ---------------------------------------------------------
@pytest.mark.parametrize("direct", ["auto", "off"])
def test_submit_write_and_read_in_parallel(tmp_path, direct):
    store = NvmeStore(tmp_path / "nvme", GiB, io_threads=4, direct=direct)
    arena = DramArena(16, 64 * 1024, pin=False)
    jobs = {}  # key -> payload bytes
    try:
        def submitter(worker: int):
            # Each submitter queues 8 writes: half from arena slots, half from unaligned tensors.
            futures = []
            for j in range(8):
                key = f"w{worker}-{j}".encode()
                n = 3000 + 7919 * (worker * 8 + j) % 60000
                data = payload_for(key, n)
                if j % 2 == 0:
                    src = arena.slot(worker * 4 + j // 2, n)
                else:
                    src = unaligned_uint8(n)
                src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                futures.append((key, data, store.submit_write(NS, key, src, FP)))
            return futures

        with ThreadPoolExecutor(4) as pool:
            batches = list(pool.map(submitter, range(4)))
        for batch in batches:
            for key, data, future in batch:
                assert future.result(timeout=60) == file_bytes_for(len(data))
                jobs[key] = data
        assert store.num_blocks == 32 and stray_files(store.root) == []

        # Read all 32 back at once: half into arena slots, half into unaligned tensors.
        arena.buffer.zero_()
        targets, futures = {}, {}
        for i, key in enumerate(sorted(jobs)):
            n = len(jobs[key])
            targets[key] = arena.slot(i) if i < 16 else unaligned_uint8(n)
            futures[key] = store.submit_read(NS, key, targets[key], FP)
        for key, future in futures.items():
            nbytes, codec = future.result(timeout=60)
            assert (nbytes, codec) == (len(jobs[key]), "none")
            assert bytes(targets[key][:nbytes].numpy()) == jobs[key], key

        # Mixed: rewrite some blocks while reading others, from several threads.
        def mixed(i: int):
            key = sorted(jobs)[i]
            if i % 2:  # odd: rewrite with a new, one byte longer payload
                new = payload_for(key + b"v2", len(jobs[key]) + 1)
                store.submit_write(NS, key, bytearray(new), FP).result(timeout=60)
                return key, new
            assert read_back(store, NS, key)[0] == jobs[key], key  # even: read, untouched
            return key, jobs[key]

        with ThreadPoolExecutor(4) as pool:
            jobs.update(dict(pool.map(mixed, range(32))))
        for key, data in jobs.items():
            assert read_back(store, NS, key)[0] == data
    finally:
        store.close()
    # Everything survives a restart.
    again = NvmeStore(tmp_path / "nvme", GiB)
    try:
        assert {r.key: r.nbytes for r in again.scan()} == {k: len(v) for k, v in jobs.items()}
    finally:
        again.close()


def test_direct_read_never_spills_into_neighbouring_bytes(store):
    # A destination that starts page-aligned but is shorter than the padded payload sits inside a
    # bigger arena: the page padding of an O_DIRECT read must not overwrite the bytes after it.
    arena = DramArena(2, 2 * PAGE)
    arena.buffer.fill_(0xAB)
    store.write(NS, b"odd", bytearray(payload_for(b"odd", 5000)), FP)
    dst = arena.slot(0, 5000)
    nbytes, _ = store.read_into(NS, b"odd", dst, FP)
    assert nbytes == 5000 and bytes(dst.numpy()) == payload_for(b"odd", 5000)
    assert bool((arena.buffer[5000:] == 0xAB).all())
