"""Session snapshot files: round trips, validation of hostile files, crash safety."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import select
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xxhash

import kvtier.persist.snapshot as snap
from kvtier.errors import FingerprintMismatchError, SnapshotError
from kvtier.layout import KVGeometry, ModelFingerprint
from kvtier.persist.snapshot import (
    BlockEntry,
    SnapshotInfo,
    SnapshotWriter,
    open_snapshot,
    read_blocks,
    verify_snapshot,
    write_snapshot,
)

REPO = Path(__file__).resolve().parents[3]
PAGE = 4096
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16)
FP = ModelFingerprint("org/model-a", GEOMETRY)
OTHER_FP = ModelFingerprint("org/model-b", GEOMETRY)
NS = bytes(range(16))
PREAMBLE = struct.Struct("<8sHHQQQQ")


def _payloads(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]


def _keys(n):
    return [i.to_bytes(4, "big") + b"key" for i in range(n)]


def _write(path, sizes, seed=0, **kwargs):
    payloads = _payloads(sizes, seed)
    n = len(sizes)
    info = write_snapshot(path, FP, "sess-1", NS, "none", 16 * n, _keys(n), payloads, **kwargs)
    return info, payloads


def _snap_error(excinfo, path, *fragments):
    """The error is one line, names the file and every fragment, and carries a hint."""
    err = excinfo.value
    assert isinstance(err, SnapshotError)
    assert "\n" not in err.message and str(path) in err.message and err.hint
    for fragment in fragments:
        assert fragment in err.message, err.message
    return err


def _no_temp_files(directory):
    return [p.name for p in Path(directory).iterdir() if ".tmp-" in p.name] == []


# ---- round trips --------------------------------------------------------------------------------
SIZES = [0, 1, 4095, 4096, 4097, 3 * PAGE + 5, 0, 100_000, 2 << 20]


def test_round_trip_mixed_sizes_and_types(tmp_path):
    import torch

    path = tmp_path / "s.kvsnap"
    raw = _payloads(SIZES)
    mixed = [raw[0], bytearray(raw[1]), np.frombuffer(raw[2], dtype=np.uint8), memoryview(raw[3]),
             torch.frombuffer(bytearray(raw[4]), dtype=torch.uint8), raw[5], raw[6],
             np.frombuffer(raw[7], dtype=np.uint8).copy().view(np.uint16), raw[8]]
    seen = []
    info = write_snapshot(path, FP, "sess-1", NS, "fp8", 12345, _keys(len(SIZES)), mixed,
                          token_ids=[1, 2, 3], meta={"note": "hi", "n": [1, 2]},
                          progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (sum(SIZES), sum(SIZES)) and len(seen) == len(SIZES)
    assert os.path.getsize(path) == info.file_len and info.file_len % PAGE == 0
    opened = open_snapshot(path)
    assert opened == info
    assert opened.fingerprint == FP and opened.session_id == "sess-1" and opened.namespace == NS
    assert opened.codec == "fp8" and opened.num_tokens == 12345 and opened.token_ids == (1, 2, 3)
    assert opened.meta == {"note": "hi", "n": [1, 2]} and opened.payload_bytes == sum(SIZES)
    assert [b.key for b in opened.blocks] == _keys(len(SIZES))
    assert all(b.offset % PAGE == 0 for b in opened.blocks)
    got = {i: bytes(view) for i, view in read_blocks(path, expected_fingerprint=FP)}
    assert got == dict(enumerate(raw))
    json.dumps(opened.to_dict())
    assert verify_snapshot(path, FP.digest) == opened


def test_round_trip_into_destinations(tmp_path):
    import torch

    path = tmp_path / "s.kvsnap"
    _info, payloads = _write(path, [PAGE, 5000, 0])
    dests = [bytearray(PAGE), np.zeros(6000, dtype=np.uint8), torch.zeros(1, dtype=torch.uint8)]
    for index, view in read_blocks(path, into=lambda i: dests[i]):
        assert bytes(view) == payloads[index]
    assert bytes(dests[0]) == payloads[0] and dests[1][:5000].tobytes() == payloads[1]


def test_empty_snapshot(tmp_path):
    path = tmp_path / "empty.kvsnap"
    info = write_snapshot(path, FP, "s", NS, "none", 0, [], [])
    assert info.blocks == () and info.file_len == info.payload_offset == os.path.getsize(path)
    assert list(read_blocks(path, FP)) == []
    assert verify_snapshot(path).session_id == "s"


def test_only_zero_byte_blocks(tmp_path):
    path = tmp_path / "z.kvsnap"
    info, _ = _write(path, [0, 0, 0])
    assert info.file_len == info.payload_offset
    assert [(i, bytes(v)) for i, v in read_blocks(path)] == [(0, b""), (1, b""), (2, b"")]


def test_meta_must_be_json(tmp_path):
    with pytest.raises(SnapshotError, match="JSON"):
        _write(tmp_path / "m.kvsnap", [PAGE], meta={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_small_io_chunks_split_blocks_across_buffers(tmp_path, monkeypatch):
    for part in (snap.format, snap.read, snap.write):  # each module's own name for it
        monkeypatch.setattr(part, "IO_CHUNK", 3 * PAGE)
    path = tmp_path / "s.kvsnap"
    sizes = [10 * PAGE + 7, 1, 0, PAGE, 2 * PAGE, 7 * PAGE]
    _info, payloads = _write(path, sizes, token_ids=list(range(3000)))
    assert [bytes(v) for _i, v in read_blocks(path)] == payloads


def test_generator_payloads_with_declared_sizes(tmp_path):
    path = tmp_path / "s.kvsnap"
    payloads = _payloads([100, 200, 300])
    info = write_snapshot(path, FP, "s", NS, "none", 48, _keys(3), iter(payloads),
                          block_nbytes=[100, 200, 300])
    assert [b.nbytes for b in info.blocks] == [100, 200, 300]


def test_writer_context_manager_and_bad_usage(tmp_path):
    path = tmp_path / "s.kvsnap"
    with SnapshotWriter(path, FP, "s", NS, "none", 32, block_nbytes=[4, 5], keys=_keys(2)) as writer:
        writer.write_block(0, b"abcd")
        writer.write_block(1, b"efghi")
    assert [bytes(v) for _i, v in read_blocks(path)] == [b"abcd", b"efghi"]

    other = tmp_path / "t.kvsnap"
    with pytest.raises(SnapshotError, match="out of order"):
        with SnapshotWriter(other, FP, "s", NS, "none", 32, block_nbytes=[4, 5], keys=_keys(2)) as writer:
            writer.write_block(1, b"efghi")
    with pytest.raises(SnapshotError, match="declared"):
        with SnapshotWriter(other, FP, "s", NS, "none", 32, block_nbytes=[4], keys=_keys(1)) as writer:
            writer.write_block(0, b"abc")
    with pytest.raises(SnapshotError, match="only 1 of 2 blocks"):
        with SnapshotWriter(other, FP, "s", NS, "none", 32, block_nbytes=[4, 5], keys=_keys(2)) as writer:
            writer.write_block(0, b"abcd")
    with pytest.raises(SnapshotError, match="only 1 payloads"):
        write_snapshot(other, FP, "s", NS, "none", 1, _keys(2), iter([b"a"]), block_nbytes=[1, 1])
    with pytest.raises(SnapshotError, match="more payloads"):
        write_snapshot(other, FP, "s", NS, "none", 1, _keys(1), iter([b"a", b"b"]), block_nbytes=[1])
    assert not other.exists() and _no_temp_files(tmp_path)


def test_torch_not_imported():
    code = "import sys, kvtier.persist.snapshot; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---- faults -------------------------------------------------------------------------------------
def test_fingerprint_mismatch_before_any_block(tmp_path):
    path = tmp_path / "s.kvsnap"
    _write(path, [PAGE, PAGE])
    with pytest.raises(FingerprintMismatchError) as excinfo:
        read_blocks(path, expected_fingerprint=OTHER_FP)  # raised at call time, before iterating
    _snap_error(excinfo, path, "org/model-a", "org/model-b")
    with pytest.raises(FingerprintMismatchError):
        read_blocks(path, expected_fingerprint=OTHER_FP.digest)
    with pytest.raises(FingerprintMismatchError):
        verify_snapshot(path, OTHER_FP)


def test_a_snapshot_of_the_packed_cpu_order_is_refused_in_words(tmp_path):
    """Taken by a kvtier that stored vLLM CPU's packed order (no kv_order): a server whose blocks are
    canonical refuses it and says why, rather than "another model"."""
    path = tmp_path / "s.kvsnap"
    _write(path, [PAGE, PAGE])
    now = dataclasses.replace(FP, kv_order="canonical")
    with pytest.raises(FingerprintMismatchError) as excinfo:
        read_blocks(path, expected_fingerprint=now)
    assert "another order" in str(excinfo.value) and "older kvtier" in str(excinfo.value)
    assert "take the snapshot again" in (excinfo.value.hint or "")


@pytest.mark.parametrize("keep", [0, 5, 40, 100, -PAGE, -1])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "s.kvsnap"
    info, _ = _write(path, [PAGE, 3 * PAGE])
    size = keep if keep >= 0 else info.file_len + keep
    os.truncate(path, size)
    with pytest.raises(SnapshotError) as excinfo:
        verify_snapshot(path)
    _snap_error(excinfo, path, "bad magic" if size < 8 else "truncated")


def test_truncated_after_open_and_abandoned_reads(tmp_path, monkeypatch):
    for part in (snap.format, snap.read, snap.write):
        monkeypatch.setattr(part, "IO_CHUNK", 2 * PAGE)
    path = tmp_path / "s.kvsnap"
    info, payloads = _write(path, [PAGE] * 6)
    blocks = read_blocks(info)
    assert next(blocks) == (0, memoryview(payloads[0]))
    blocks.close()  # stopping early joins the IO thread and closes the file
    os.truncate(path, info.file_len - PAGE)
    with pytest.raises(SnapshotError) as excinfo:
        list(read_blocks(info))
    _snap_error(excinfo, path, "truncated")


def test_trailing_data(tmp_path):
    path = tmp_path / "s.kvsnap"
    _write(path, [PAGE])
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(SnapshotError) as excinfo:
        open_snapshot(path)
    _snap_error(excinfo, path, "trailing")


def test_flipped_bit_in_block_names_index(tmp_path):
    path = tmp_path / "s.kvsnap"
    info, payloads = _write(path, [PAGE, 5000, PAGE, PAGE])
    with open(path, "r+b") as f:
        f.seek(info.blocks[2].offset + 17)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    yielded = []
    with pytest.raises(SnapshotError) as excinfo:
        for index, view in read_blocks(path):
            yielded.append((index, bytes(view)))
    _snap_error(excinfo, path, "block 2", "checksum")
    assert yielded == [(0, payloads[0]), (1, payloads[1])]
    with pytest.raises(SnapshotError, match="block 2"):
        verify_snapshot(path)


def test_flipped_bit_in_header(tmp_path):
    path = tmp_path / "s.kvsnap"
    _write(path, [PAGE])
    with open(path, "r+b") as f:
        f.seek(64 + 20)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(SnapshotError) as excinfo:
        open_snapshot(path)
    _snap_error(excinfo, path, "header checksum")


def _patch_preamble(path, **fields):
    with open(path, "r+b") as f:
        values = dict(zip(["magic", "version", "flags", "header_len", "xxh3", "payload_offset", "file_len"],
                          PREAMBLE.unpack(f.read(PREAMBLE.size))))
        values.update(fields)
        f.seek(0)
        f.write(PREAMBLE.pack(*values.values()))


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"magic": b"KVTSNAQ\0"}, "bad magic"),
        ({"version": 2}, "unsupported format version 2"),
        ({"flags": 1}, "flags"),
        ({"header_len": 1 << 62}, "header length"),
        ({"header_len": 0}, "header length"),
        ({"file_len": 1 << 63}, "file length"),
        ({"payload_offset": 64}, "payload offset"),
    ],
)
def test_bad_preamble(tmp_path, fields, fragment):
    path = tmp_path / "s.kvsnap"
    _write(path, [PAGE])
    _patch_preamble(path, **fields)
    with pytest.raises(SnapshotError) as excinfo:
        verify_snapshot(path)
    _snap_error(excinfo, path, fragment)


def test_not_a_snapshot_missing_and_directory(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello world, this is not a snapshot at all\n" * 10)
    cases = [(text, "bad magic"), (tmp_path / "missing", "no such file"), (tmp_path, "directory")]
    for path, fragment in cases:
        with pytest.raises(SnapshotError) as excinfo:
            verify_snapshot(path)
        _snap_error(excinfo, path, fragment)


def _craft(path, doc=None, header=None, payload_offset=None, file_len=None, blocks_body=0):
    """A file with a valid preamble and header checksum around an arbitrary header."""
    if header is None:
        header = json.dumps(doc).encode()
    if payload_offset is None:
        payload_offset = (64 + len(header) + PAGE - 1) // PAGE * PAGE
    size = payload_offset + blocks_body
    file_len = size if file_len is None else file_len
    digest = xxhash.xxh3_64_intdigest(header)
    pre = PREAMBLE.pack(snap.MAGIC, 1, 0, len(header), digest, payload_offset, file_len)
    data = pre.ljust(64, b"\0") + header
    path.write_bytes(data.ljust(size, b"\0"))
    return path


def _doc(blocks, **overrides):
    doc = {"fingerprint": FP.to_dict(), "session_id": "s", "namespace": NS.hex(), "codec": "none",
           "num_tokens": 16, "token_ids": [], "created": 1.0, "blocks": blocks, "meta": {}}
    doc.update(overrides)
    return doc


def _blk(offset, nbytes, xxh3=0, key="aa"):
    return {"key": key, "offset": offset, "nbytes": nbytes, "xxh3": xxh3}


@pytest.mark.parametrize(
    "blocks, body, fragment",
    [
        ([_blk(PAGE, PAGE), _blk(100 * PAGE, PAGE)], 2 * PAGE, "block 1"),  # beyond the file
        ([_blk(PAGE, 2 * PAGE), _blk(2 * PAGE, PAGE)], 3 * PAGE, "block 1"),  # overlapping
        ([_blk(PAGE, PAGE), _blk(0, PAGE)], 2 * PAGE, "block 1"),  # backwards, into the header
        ([_blk(PAGE + 512, PAGE)], 2 * PAGE, "block 0"),  # misaligned
        ([_blk(PAGE, 1 << 63)], PAGE, "block 0"),  # huge size
        ([_blk(PAGE, 1 << 64)], PAGE, "nbytes"),  # not a u64
        ([_blk(PAGE, -1)], PAGE, "nbytes"),
        ([_blk(1 << 80, PAGE)], PAGE, "offset"),
        ([_blk(PAGE, PAGE, key="zz")], PAGE, "hex"),
        ([_blk(PAGE, PAGE, xxh3="1")], PAGE, "xxh3"),
        (["nope"], PAGE, "block 0"),
        ({"not": "a list"}, PAGE, "blocks"),
    ],
)
def test_crafted_block_tables(tmp_path, blocks, body, fragment):
    path = _craft(tmp_path / "c.kvsnap", _doc(blocks), payload_offset=PAGE, blocks_body=body)
    with pytest.raises(SnapshotError) as excinfo:
        verify_snapshot(path)
    _snap_error(excinfo, path, fragment)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"fingerprint": {"model_id": "m"}}, "fingerprint"),
        ({"fingerprint": {**FP.to_dict(), "digest": "00" * 16}}, "digest"),
        ({"fingerprint": {"model_id": 3, "geometry": FP.geometry.to_dict()}}, "fingerprint"),
        ({"fingerprint": "x"}, "fingerprint"),
        ({"session_id": None}, "session_id"),
        ({"num_tokens": True}, "num_tokens"),
        ({"num_tokens": 10**30}, "num_tokens"),
        ({"token_ids": [1, "2"]}, "token_ids"),
        ({"created": "yesterday"}, "created"),
        ({"created": 10**400}, "created"),
        ({"namespace": "xyz"}, "hex"),
        ({"meta": []}, "meta"),
    ],
)
def test_crafted_header_fields(tmp_path, overrides, fragment):
    path = _craft(tmp_path / "c.kvsnap", _doc([], **overrides))
    with pytest.raises(SnapshotError) as excinfo:
        open_snapshot(path)
    _snap_error(excinfo, path, fragment)


@pytest.mark.parametrize(
    "header, fragment",
    [
        (b"[" * 200_000 + b"]" * 200_000, "JSON"),  # nesting deep enough to hit the recursion limit
        (b"\xff\xfe not utf-8", "JSON"),
        (b"{\"blocks\": [", "JSON"),
        (b"[1, 2, 3]", "JSON object"),
        (b"1" + b"0" * 5000, "JSON"),  # an integer too long to parse
    ],
)
def test_crafted_header_not_json(tmp_path, header, fragment):
    path = _craft(tmp_path / "c.kvsnap", header=header)
    with pytest.raises(SnapshotError) as excinfo:
        open_snapshot(path)
    _snap_error(excinfo, path, fragment)


def test_crafted_huge_block_count(tmp_path, monkeypatch):
    monkeypatch.setattr(snap.read, "MAX_BLOCKS", 4)
    blocks = [_blk(PAGE, 0) for _ in range(5)]
    path = _craft(tmp_path / "c.kvsnap", _doc(blocks), payload_offset=PAGE)
    with pytest.raises(SnapshotError) as excinfo:
        open_snapshot(path)
    _snap_error(excinfo, path, "5 blocks")


def test_crafted_header_longer_than_file(tmp_path):
    path = _craft(tmp_path / "c.kvsnap", _doc([]))
    _patch_preamble(path, header_len=50 << 20)
    with pytest.raises(SnapshotError) as excinfo:
        open_snapshot(path)
    _snap_error(excinfo, path, "truncated")


# ---- crash safety -------------------------------------------------------------------------------
def test_failing_payload_iterator_leaves_nothing(tmp_path):
    path = tmp_path / "s.kvsnap"

    def payloads():
        yield b"a" * PAGE
        yield b"b" * PAGE
        raise RuntimeError("engine went away")

    with pytest.raises(RuntimeError, match="engine went away"):
        write_snapshot(path, FP, "s", NS, "none", 48, _keys(3), payloads(), block_nbytes=[PAGE] * 3)
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_enospc_is_a_snapshot_error(tmp_path, monkeypatch):
    path = tmp_path / "s.kvsnap"

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snap.write.os, "pwrite", full)
    with pytest.raises(SnapshotError) as excinfo:
        _write(path, [PAGE, PAGE])
    _snap_error(excinfo, path, "no space")
    assert list(tmp_path.iterdir()) == []


def test_existing_snapshot_survives_failed_overwrite(tmp_path):
    path = tmp_path / "s.kvsnap"
    info, _ = _write(path, [PAGE])

    def payloads():
        yield b"x" * 10
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_snapshot(path, FP, "s", NS, "none", 32, _keys(2), payloads(), block_nbytes=[10, 10])
    assert open_snapshot(path) == info and _no_temp_files(tmp_path)


def test_write_errors(tmp_path):
    with pytest.raises(SnapshotError) as excinfo:
        _write(tmp_path / "nodir" / "s.kvsnap", [PAGE])
    _snap_error(excinfo, tmp_path / "nodir" / "s.kvsnap", "cannot create")
    with pytest.raises(SnapshotError) as excinfo:
        _write(tmp_path, [PAGE])
    _snap_error(excinfo, tmp_path, "directory")


CHILD = textwrap.dedent(
    """
    import pathlib, sys
    from kvtier.layout import KVGeometry, ModelFingerprint
    from kvtier.persist.snapshot import write_snapshot

    fp = ModelFingerprint("org/model-a", KVGeometry(2, 2, 8, 16))
    n, size = 400, 1 << 20
    directory = pathlib.Path(sys.argv[1]).parent

    def on_disk() -> bool:
        return any(p.stat().st_size > 0 for p in directory.iterdir() if ".tmp-" in p.name)

    def payloads():
        # 400 MiB is more than the writer's staged buffers: it must wait for a write to land before
        # taking them all, so one payload sees the first staging buffer on disk; there the writer
        # says so and stops (blocked on stdin) until it is killed
        for i in range(n):
            if on_disk():
                print("mid-write", flush=True)
                sys.stdin.read()
            yield bytes([i % 251]) * size

    write_snapshot(sys.argv[1], fp, "s", bytes(16), "none", 16 * n, [b"%d" % i for i in range(n)],
                   payloads(), block_nbytes=[size] * n)
    """
)


def test_sigkill_mid_write_leaves_no_snapshot(tmp_path):
    path = tmp_path / "big.kvsnap"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], env=env, cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready, "the writer never started writing"
        assert child.stdout.readline() == "mid-write\n", "writer exited early"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert not path.exists()
    leftovers = list(tmp_path.iterdir())
    assert leftovers and all(p.name.startswith(".big.kvsnap.tmp-") for p in leftovers)
    for leftover in leftovers:  # a partial file never passes for a snapshot
        with pytest.raises(SnapshotError):
            verify_snapshot(leftover)


def test_public_api():
    assert set(snap.__all__) >= {"SnapshotWriter", "write_snapshot", "open_snapshot", "read_blocks",
                                 "verify_snapshot", "SnapshotInfo", "BlockEntry"}
    assert BlockEntry(b"k", 0, 0, 0).key == b"k"
    assert SnapshotInfo.__dataclass_params__.frozen


def test_stale_temp_files_of_a_killed_writer_are_removed(tmp_path):
    import os
    import time as _time

    from kvtier.persist.snapshot import remove_stale_temp_files

    stale = tmp_path / ".agent.kvsnap.tmp-1a2b3c4d"
    fresh = tmp_path / ".other.kvsnap.tmp-5e6f7a8b"
    keep = [tmp_path / "agent.kvsnap", tmp_path / ".hidden", tmp_path / "notes.tmp-1"]
    for path in [stale, fresh, *keep]:
        path.write_bytes(b"x")
    old = _time.time() - 3600
    os.utime(stale, (old, old))
    assert remove_stale_temp_files(tmp_path) == 1  # the fresh one may be a writer still running
    assert not stale.exists() and fresh.exists() and all(p.exists() for p in keep)
    assert remove_stale_temp_files(tmp_path / "missing") == 0
