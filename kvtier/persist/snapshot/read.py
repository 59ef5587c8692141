"""Reading a snapshot: the header validated whole before any payload, blocks yielded once verified."""
from __future__ import annotations

import errno
import json
import math
import os
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from kvtier.errors import FingerprintMismatchError, KvtierError, SnapshotError
from kvtier.layout import ModelFingerprint
from kvtier.persist.snapshot.format import (
    _CORRUPT,
    _PREAMBLE,
    _TRUNCATED,
    _U64,
    FORMAT_VERSION,
    IO_CHUNK,
    IO_DEPTH,
    MAGIC,
    MAX_BLOCKS,
    MAX_HEADER_BYTES,
    PREAMBLE_BYTES,
    BlockEntry,
    SnapshotInfo,
    _bytes_view,
    _fail,
    _give_buffers,
    _take_buffer,
)
from kvtier.tiers import fileio
from kvtier.tiers.dram import PAGE, round_up
from kvtier.tiers.records import checksum


def _open_file(path: str, direct: bool = False) -> tuple[int, int]:
    try:
        # O_NONBLOCK: a FIFO or device named *.kvsnap must not block the open (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (os.O_DIRECT if direct else 0))
    except FileNotFoundError:
        raise _fail(path, "no such file", "check the path") from None
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            return _open_file(path)
        raise _fail(path, f"cannot open: {exc.strerror}", "check the path and its permissions") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise _fail(path, f"is {kind}, not a snapshot file", "give the path of a snapshot file")
    os.set_blocking(fd, True)
    return fd, st.st_size


def overwrite_refusal(path: str | os.PathLike[str]) -> str | None:
    """Why a snapshot must not be written at ``path`` (None: it may be): kvtier replaces only its own
    snapshot files, never a symlink, a special file or anything else that is there."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return None
    if path.is_symlink() or not path.is_file():
        return f"{path} exists and is not a regular file"
    try:
        open_snapshot(path)
    except SnapshotError:
        return f"{path} exists and is not a kvtier snapshot"
    return None


def header_cap(max_blocks: int, block_tokens: int) -> int:
    """The largest header a snapshot of at most ``max_blocks`` blocks of ``block_tokens`` tokens can
    need (each block's entry with 20-digit numbers, each token id up to 11 characters), plus room
    for the fingerprint, names and meta: what a server lets a file make it parse."""
    return min(MAX_HEADER_BYTES, (64 << 10) + max_blocks * (200 + 12 * block_tokens))


def open_snapshot(path: str | os.PathLike[str], max_header_bytes: int = MAX_HEADER_BYTES,
                  trusted_keys: list[bytes] | None = None) -> SnapshotInfo:
    """Read and fully validate a snapshot's preamble and header (payloads are not read).
    ``max_header_bytes``: refuse longer headers before reading them (a server passes ``header_cap``
    of what one session can hold on it, so no file makes it build a huge JSON object).
    ``trusted_keys``: check the signature (``SnapshotInfo.signed``; see ``kvtier.persist.trust``)."""
    path = os.fspath(path)
    fd, size = _open_file(path)
    try:
        pre = os.pread(fd, PREAMBLE_BYTES, 0)
        if pre[: len(MAGIC)] != MAGIC:
            raise _fail(path, "not a kvtier snapshot (bad magic)", "give the path of a kvtier snapshot file")
        if len(pre) < PREAMBLE_BYTES:
            raise _fail(path, f"truncated ({size} bytes, the preamble alone is {PREAMBLE_BYTES})", _TRUNCATED)
        _magic, version, flags, header_len, header_xxh3, payload_offset, file_len = _PREAMBLE.unpack_from(pre)
        if version != FORMAT_VERSION:
            raise _fail(path, f"unsupported format version {version} (this kvtier reads {FORMAT_VERSION})",
                        "upgrade kvtier to read snapshots written by newer versions")
        if flags:
            raise _fail(path, f"unsupported format flags {flags:#x}", "upgrade kvtier")
        if not 0 < header_len <= MAX_HEADER_BYTES:
            raise _fail(path, f"header length {header_len} out of range (1..{MAX_HEADER_BYTES})", _CORRUPT)
        if header_len > max_header_bytes:
            raise _fail(path, f"header of {header_len:,} bytes is larger than any session this server can hold "
                              f"needs ({max_header_bytes:,})", "restore it on a server with larger tiers")
        header = os.pread(fd, header_len, PREAMBLE_BYTES) if PREAMBLE_BYTES + header_len <= size else b""
    finally:
        os.close(fd)
    if len(header) != header_len:
        raise _fail(path, f"truncated inside the header ({size} bytes)", _TRUNCATED)
    if checksum(header) != header_xxh3:
        raise _fail(path, "header checksum mismatch", _CORRUPT)
    try:
        doc = json.loads(header.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise _fail(path, f"header is not valid JSON ({type(exc).__name__})", _CORRUPT) from None
    info = _info_from(path, doc, header_len, payload_offset, file_len)
    if trusted_keys is not None:
        from dataclasses import replace

        from kvtier.persist.trust import SIGNATURE_BYTES, verify

        signature = pre[_PREAMBLE.size:_PREAMBLE.size + SIGNATURE_BYTES]
        info = replace(info, signed=verify(trusted_keys, header, signature))
    if size < file_len:
        raise _fail(path, f"truncated ({size} of {file_len} bytes)", _TRUNCATED)
    if size > file_len:
        raise _fail(path, f"{size - file_len} bytes of trailing data after the last block", _CORRUPT)
    return info


def _get(doc: Any, name: str, kind: type, path: str) -> Any:
    value = doc.get(name) if isinstance(doc, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and not 0 <= value < _U64):
        raise _fail(path, f"header field {name!r} is missing or not a valid {kind.__name__}", _CORRUPT)
    return value


def _info_from(path: str, doc: Any, header_len: int, payload_offset: int, file_len: int) -> SnapshotInfo:
    """Build a SnapshotInfo from a parsed header, checking every type, count, offset and size."""
    if not isinstance(doc, dict):
        raise _fail(path, "header is not a JSON object", _CORRUPT)
    fingerprint = _fingerprint_from(_get(doc, "fingerprint", dict, path), path)
    raw_blocks, token_ids = _get(doc, "blocks", list, path), _get(doc, "token_ids", list, path)
    if len(raw_blocks) > MAX_BLOCKS:
        raise _fail(path, f"header lists {len(raw_blocks)} blocks (max {MAX_BLOCKS})", _CORRUPT)
    if not all(type(t) is int and 0 <= t < _U64 for t in token_ids):
        raise _fail(path, "header field 'token_ids' holds a non-integer", _CORRUPT)
    created = doc.get("created")
    if type(created) not in (int, float) or not (abs(created) < _U64 and math.isfinite(created)):
        raise _fail(path, "header field 'created' is missing or not a number", _CORRUPT)
    blocks = []
    try:
        namespace = bytes.fromhex(_get(doc, "namespace", str, path))
        for index, raw in enumerate(raw_blocks):
            if not isinstance(raw, dict):
                raise _fail(path, f"block {index} entry is not a JSON object", _CORRUPT)
            blocks.append(BlockEntry(bytes.fromhex(_get(raw, "key", str, path)), *(
                _get(raw, name, int, path) for name in ("offset", "nbytes", "xxh3"))))
    except ValueError:
        raise _fail(path, "header holds a malformed hex key or namespace", _CORRUPT) from None
    _check_layout(path, blocks, header_len, payload_offset, file_len)
    return SnapshotInfo(path=path, fingerprint=fingerprint, session_id=_get(doc, "session_id", str, path),
                        namespace=namespace, codec=_get(doc, "codec", str, path),
                        num_tokens=_get(doc, "num_tokens", int, path), token_ids=tuple(token_ids),
                        blocks=tuple(blocks), created=float(created), meta=_get(doc, "meta", dict, path),
                        file_len=file_len, payload_offset=payload_offset)


def _fingerprint_from(data: dict, path: str) -> ModelFingerprint:
    try:
        fingerprint = ModelFingerprint.from_dict(data)
        if not isinstance(fingerprint.model_id, str):
            raise TypeError("model_id")
        digest_ok = data.get("digest", fingerprint.hex) == fingerprint.hex
    except (KeyError, TypeError, ValueError, AttributeError, KvtierError):
        raise _fail(path, "header holds a malformed model fingerprint", _CORRUPT) from None
    if not digest_ok:
        raise _fail(path, "fingerprint digest does not match its fields", _CORRUPT)
    return fingerprint


def _check_layout(path: str, blocks: Sequence[BlockEntry], header_len: int, payload_offset: int,
                  file_len: int) -> None:
    if payload_offset % PAGE or payload_offset < PREAMBLE_BYTES + header_len:
        raise _fail(path, f"payload offset {payload_offset} is misaligned or inside the header", _CORRUPT)
    end = payload_offset
    for index, block in enumerate(blocks):
        if block.offset % PAGE or block.offset < end:
            raise _fail(path, f"block {index} at offset {block.offset} is misaligned or overlaps "
                        "the header or the previous block", _CORRUPT)
        end = block.offset + round_up(block.nbytes)
        if end > file_len:
            raise _fail(path, f"block {index} (offset {block.offset}, {block.nbytes} bytes) ends past "
                        f"the file length {file_len}", _CORRUPT)
    if end != file_len:
        raise _fail(path, f"file length {file_len} in the preamble does not match the block table "
                    f"(ends at {end})", _CORRUPT)


def _check_fingerprint(info: SnapshotInfo, expected: ModelFingerprint | bytes | None) -> None:
    digest = expected.digest if isinstance(expected, ModelFingerprint) else expected
    if digest is not None and bytes(digest) != info.fingerprint.digest:
        if isinstance(expected, ModelFingerprint) and info.fingerprint.shards != expected.shards:
            raise _fail(info.path, expected.mismatch(info.fingerprint), "snapshots restore at the "
                        "tensor-parallel size they were taken at", FingerprintMismatchError)
        if isinstance(expected, ModelFingerprint) and info.fingerprint.kv_order != expected.kv_order:
            raise _fail(info.path, expected.mismatch(info.fingerprint), "its KV cannot be reordered safely: "
                        "take the snapshot again (or recompute the session)", FingerprintMismatchError)
        want = expected.model_id if isinstance(expected, ModelFingerprint) else bytes(digest).hex()
        raise _fail(info.path, f"taken with model {info.fingerprint.model_id!r} ({info.fingerprint.hex}), "
                    f"not the expected {want!r}", "restore it into the model, KV dtype and block size "
                    "it was taken with", FingerprintMismatchError)


def _plan(blocks: Sequence[BlockEntry]) -> list[tuple[int, int, list[int]]]:
    """Group consecutive blocks into reads of at most IO_CHUNK bytes: (start, end, indices)."""
    chunks: list[tuple[int, int, list[int]]] = []
    for index, block in enumerate(blocks):
        end = block.offset + round_up(block.nbytes)
        if chunks and end - chunks[-1][0] <= IO_CHUNK:
            chunks[-1] = (chunks[-1][0], end, chunks[-1][2] + [index])
        else:
            chunks.append((block.offset, end, [index]))
    return chunks


def _read_chunk(fd: int, view: memoryview, offset: int) -> memoryview:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(f"truncated while reading (at byte {offset + done})")
        done += got
    return view


def _stream(info: SnapshotInfo, into: Callable[[int], Any] | None) -> Iterator[tuple[int, memoryview]]:
    """Verify and yield blocks while IO threads read the next chunks into the other buffers.

    ``IO_DEPTH`` reads stay in flight (an SSD needs queue depth, a single QD1 stream leaves
    bandwidth unused); one more buffer holds the chunk being verified and handed out.
    """
    chunks = _plan(info.blocks)
    fd, _size = _open_file(info.path, direct=True)
    size = max([end - start for start, end, _ in chunks] + [IO_CHUNK])
    buffers = [_take_buffer(size) for _ in range(IO_DEPTH + 1)]
    bufs = [memoryview(buf) for buf in buffers]
    pool = ThreadPoolExecutor(max_workers=IO_DEPTH, thread_name_prefix="kvtier-snapshot-read")

    def submit(k: int) -> Future | None:
        if k >= len(chunks):
            return None
        start, end, _ = chunks[k]
        return pool.submit(_read_chunk, fd, bufs[k % len(bufs)][: end - start], start)

    pending = [submit(k) for k in range(IO_DEPTH)]
    try:
        for k, (start, _end, indices) in enumerate(chunks):
            try:
                data = pending.pop(0).result()
            except (OSError, EOFError) as exc:
                fault = getattr(exc, "strerror", None) or exc
                raise _fail(info.path, f"read failed: {fault}", _TRUNCATED) from None
            pending.append(submit(k + IO_DEPTH))
            for index in indices:
                block = info.blocks[index]
                view = data[block.offset - start : block.offset - start + block.nbytes]
                if checksum(view) != block.xxh3:
                    raise _fail(info.path, f"block {index} (key {block.key.hex()[:16]}) failed its checksum",
                                _CORRUPT)
                if into is not None:
                    view = _copy_into(into(index), view, index)
                yield index, view
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        os.close(fd)
        _give_buffers(buffers)


def _copy_into(dest: Any, view: memoryview, index: int) -> memoryview:
    dst = _bytes_view(dest, writable=True)
    if len(dst) < len(view):
        raise ValueError(f"snapshot: destination of block {index} has {len(dst)} bytes, needs {len(view)}")
    dst[: len(view)] = view
    return dst[: len(view)]


def read_blocks(source: str | os.PathLike[str] | SnapshotInfo,
                expected_fingerprint: ModelFingerprint | bytes | None = None,
                into: Callable[[int], Any] | None = None) -> Iterator[tuple[int, memoryview]]:
    """Stream ``(index, payload)`` for every block, each only after its checksum matched.

    The header is validated and the fingerprint checked before this returns. A yielded view is
    valid only until the iterator advances; with ``into(index)`` (a writable buffer, array or host
    tensor of at least the block's size) the block is copied there and a view of it is yielded.
    """
    info = source if isinstance(source, SnapshotInfo) else open_snapshot(source)
    _check_fingerprint(info, expected_fingerprint)
    return _stream(info, into)


def verify_snapshot(path: str | os.PathLike[str] | SnapshotInfo,
                    expected_fingerprint: ModelFingerprint | bytes | None = None,
                    progress: Callable[[int, int], None] | None = None) -> SnapshotInfo:
    """Validate the header and every block checksum; calls ``progress(done_bytes, total_bytes)``."""
    info = path if isinstance(path, SnapshotInfo) else open_snapshot(path)
    total, done = info.payload_bytes, 0
    for index, _view in read_blocks(info, expected_fingerprint):
        done += info.blocks[index].nbytes
        if progress is not None:
            progress(done, total)
    return info


def remove_stale_temp_files(directory: str | os.PathLike[str], older_than_s: float = 60.0) -> int:
    """Delete the ``.<name>.tmp-<hex>`` files a killed writer left in ``directory`` (they are never
    read: a snapshot becomes visible only by its rename). Files younger than ``older_than_s`` may
    belong to a writer still running and are kept. Returns how many were deleted."""
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        if not (name.startswith(".") and ".tmp-" in name):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime >= older_than_s:
                fileio.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    return removed
