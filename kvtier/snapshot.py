"""Portable session snapshots: one self-describing, checksummed file per session.

Format version 1 (integers little-endian)::

    0               preamble, 64 bytes: magic b"KVTSNAP\\0" (8s), version (u16), flags (u16, 0),
                    header_len (u64), header_xxh3 (u64, of the header_len header bytes),
                    payload_offset (u64, page aligned), file_len (u64, exact file size), zeros
    64              UTF-8 JSON header, space-padded to header_len bytes:
                    {"fingerprint": ModelFingerprint.to_dict(), "session_id", "namespace": hex,
                     "codec", "num_tokens", "token_ids": [int], "created": unix time, "meta": {},
                     "blocks": [{"key": hex, "offset": int, "nbytes": int, "xxh3": int}, ...]}
    payload_offset  block payloads in block order at page-aligned absolute offsets, each zero-padded
                    to a page; file_len = end of the last padded payload (payload_offset if none)

Writing: the header area is reserved up front at its final size (sizes and keys are known; the
header is rendered with 20-digit checksums). Blocks are copied into two page-aligned 32 MiB staging
buffers and hashed while cache-hot; an IO thread writes one (O_DIRECT where the filesystem allows)
while the other fills. The preamble and real header go in last, all into ``.<name>.tmp-<random>``
beside the target, which is fdatasync-ed, renamed into place and its directory fsync-ed: the final
path only ever holds a complete snapshot, and any failure removes the temp file.

Reading validates the preamble and header completely (magic, version, checksum, JSON types, every
offset and size inside the file, blocks ordered and disjoint, bounded counts, exact length) before
touching payloads; an IO thread reads the next large aligned chunk while the caller verifies the
current one, and a block is yielded only after its checksum matched. Every fault is a one-line
:class:`SnapshotError` (or :class:`FingerprintMismatchError`) naming the file, with a hint.
torch is imported only when a torch tensor is passed in.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import xxhash

from kvtier.errors import FingerprintMismatchError, KvtierError, SnapshotError
from kvtier.layout import ModelFingerprint
from kvtier.tiers.dram import PAGE, round_up
from kvtier.tiers.records import checksum, fsync_dir, probe_direct_io

__all__ = ["MAGIC", "FORMAT_VERSION", "BlockEntry", "SnapshotInfo", "SnapshotWriter", "write_snapshot",
           "header_cap", "open_snapshot", "overwrite_refusal", "read_blocks", "verify_snapshot",
           "remove_stale_temp_files", "shard_path"]

MAGIC = b"KVTSNAP\0"
FORMAT_VERSION = 1
PREAMBLE_BYTES = 64
_PREAMBLE = struct.Struct("<8sHHQQQQ")  # magic version flags header_len header_xxh3 payload_offset file_len
MAX_HEADER_BYTES = 64 << 20
MAX_BLOCKS = 10_000_000
IO_CHUNK = 32 << 20  # bytes per write/read syscall
IO_DEPTH = 4  # IOs in flight per writer or reader (+1 buffer being filled or verified): SSDs need depth
_PIECE = 512 << 10  # copy+hash granularity on write (stays in the CPU cache)
_U64 = 1 << 64
_WIDEST_XXH3 = 10**20 - 1
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DIRECT_DIRS: dict[str, bool] = {}
_IDLE_BUFFERS: list[mmap.mmap] = []
_IDLE_LOCK = threading.Lock()
_CORRUPT = "the file is damaged; copy it again from a good source or take a new snapshot"
_TRUNCATED = "the file is incomplete (interrupted write or copy); copy it again or take a new snapshot"


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block: key, absolute file offset, payload size and xxh3-64 of the payload."""

    key: bytes
    offset: int
    nbytes: int
    xxh3: int


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot's validated preamble and header (no payload bytes)."""

    path: str
    fingerprint: ModelFingerprint
    session_id: str
    namespace: bytes
    codec: str
    num_tokens: int
    token_ids: tuple[int, ...]
    blocks: tuple[BlockEntry, ...]
    created: float
    meta: dict = field(hash=False)
    file_len: int
    payload_offset: int
    version: int = FORMAT_VERSION
    # kvtier.trust: True signed by a trusted key, False unsigned or signed by another, None not checked
    signed: bool | None = None

    @property
    def payload_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (bytes as hex)."""
        blocks = [{"key": b.key.hex(), "offset": b.offset, "nbytes": b.nbytes, "xxh3": b.xxh3}
                  for b in self.blocks]
        return {"path": self.path, "version": self.version, "fingerprint": self.fingerprint.to_dict(),
                "session_id": self.session_id, "namespace": self.namespace.hex(), "codec": self.codec,
                "num_tokens": self.num_tokens, "token_ids": list(self.token_ids), "created": self.created,
                "meta": self.meta, "file_len": self.file_len, "payload_offset": self.payload_offset,
                "num_blocks": len(self.blocks), "payload_bytes": self.payload_bytes, "blocks": blocks}


def _fail(path: str | os.PathLike[str], fault: str, hint: str | None = None,
          cls: type[SnapshotError] = SnapshotError) -> SnapshotError:
    path = os.fspath(path)
    return cls(f"snapshot {path}: {fault}".replace("\n", " "), hint=hint, path=path)


def _bytes_view(obj: Any, writable: bool = False) -> memoryview:
    """A flat byte view (no copy) of a bytes-like object, numpy array or contiguous torch tensor."""
    if hasattr(obj, "untyped_storage"):
        import torch

        t = obj.detach()
        if t.device.type != "cpu" and writable:
            raise TypeError("snapshot: a destination tensor must live in host memory")
        t = t.cpu()
        if not t.is_contiguous():
            raise TypeError("snapshot: tensors must be contiguous")
        obj = t.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"snapshot: expected bytes, an array or a tensor, got {type(obj).__name__}") from None
    if not view.c_contiguous or (writable and view.readonly):
        raise TypeError("snapshot: buffers must be C-contiguous" + (" and writable" if writable else ""))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _direct_ok(directory: Path) -> bool:
    """Whether O_DIRECT works in ``directory`` (probed once per existing directory)."""
    key = os.fspath(directory.resolve())
    if key not in _DIRECT_DIRS:
        ok = probe_direct_io(directory)
        if not directory.is_dir():
            return ok
        _DIRECT_DIRS[key] = ok
    return _DIRECT_DIRS[key]


def _take_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned IO buffer of at least ``nbytes``; idle ones are reused (no page faults)."""
    with _IDLE_LOCK:
        for i, buf in enumerate(_IDLE_BUFFERS):
            if len(buf) >= nbytes:
                return _IDLE_BUFFERS.pop(i)
    return mmap.mmap(-1, nbytes)


def _give_buffers(bufs: Iterable[mmap.mmap]) -> None:
    with _IDLE_LOCK:
        for buf in bufs:
            if len(_IDLE_BUFFERS) < IO_DEPTH + 1 and len(buf) == IO_CHUNK:
                _IDLE_BUFFERS.append(buf)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    written = os.pwrite(fd, view, offset)
    if written != len(view):
        raise OSError(errno.ENOSPC, f"short write ({written} of {len(view)} bytes)")


class SnapshotWriter:
    """Writes one snapshot; blocks go in order through :meth:`write_block`, then :meth:`commit`.

    As a context manager a clean exit commits and an exception aborts. An error raised by
    ``write_block`` or ``commit`` aborts too: the temp file is removed, the final path untouched.
    """

    def __init__(self, path: str | os.PathLike[str], fingerprint: ModelFingerprint, session_id: str,
                 namespace: bytes, codec: str, num_tokens: int, token_ids: Sequence[int] = (), *,
                 block_nbytes: Sequence[int], keys: Sequence[bytes], meta: dict | None = None,
                 sign_key: bytes | None = None, in_place: bool = False) -> None:
        self.path = Path(path)
        self._sign_key = sign_key
        # in_place: ``path`` is a file the caller made and handed over (``/proc/<pid>/fd/<n>``): written
        # as it is, no temp file and no rename (the caller renames it into place when the job is done)
        self._in_place = in_place
        self._nbytes, self._keys = [int(n) for n in block_nbytes], [bytes(k) for k in keys]
        if len(self._nbytes) != len(self._keys) or len(self._keys) > MAX_BLOCKS:
            raise _fail(path, f"{len(self._keys)} keys, {len(self._nbytes)} block sizes (max {MAX_BLOCKS})")
        token_ids = [int(t) for t in token_ids]
        if min([*self._nbytes, *token_ids, num_tokens, 0]) < 0 or max([*token_ids, num_tokens, 0]) >= _U64:
            raise _fail(path, "block sizes, num_tokens and token ids must be non-negative 64-bit integers")
        self._doc = {"fingerprint": fingerprint.to_dict(), "session_id": str(session_id),
                     "namespace": bytes(namespace).hex(), "codec": str(codec), "num_tokens": int(num_tokens),
                     "token_ids": token_ids, "created": time.time(), "meta": dict(meta or {})}
        self._payload_offset = PAGE
        while (need := round_up(PREAMBLE_BYTES + len(self._render([_WIDEST_XXH3] * len(self._keys))))) \
                > self._payload_offset:  # grow the header area until the widest header fits
            self._payload_offset = need
        self._header_len = self._payload_offset - PREAMBLE_BYTES
        if self._header_len > MAX_HEADER_BYTES:
            raise _fail(path, f"header would be {self._header_len} bytes (max {MAX_HEADER_BYTES})")
        self._digests: list[int] = []
        self._pending: list[Future] = []
        self._closed = False
        self._open()

    def _render(self, digests: Sequence[int]) -> bytes:
        offsets, pos = [], self._payload_offset
        for n in self._nbytes:
            offsets.append(pos)
            pos += round_up(n)
        self._file_len = pos
        blocks = [{"key": k.hex(), "offset": o, "nbytes": n, "xxh3": d}
                  for k, o, n, d in zip(self._keys, offsets, self._nbytes, digests)]
        try:
            text = json.dumps({**self._doc, "blocks": blocks}, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise _fail(self.path, f"header is not JSON-serialisable: {exc}",
                        "pass only JSON values (str, int, float, list, dict) in meta") from None
        return text.encode()

    def _open(self) -> None:
        directory = self.path.parent
        if self._in_place:
            self._tmp = self.path
            try:
                self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                    os.close(self._fd)
                    raise _fail(self.path, "the file handed over is not a regular file")
                os.set_blocking(self._fd, True)
                os.ftruncate(self._fd, 0)
            except OSError as exc:
                raise _fail(self.path, f"cannot write the file handed over: {exc.strerror}") from None
            self._start_buffers()
            return
        if self.path.is_dir():
            raise _fail(self.path, "is a directory", "give a file name for the snapshot")
        self._tmp = directory / f".{self.path.name}.tmp-{secrets.token_hex(4)}"
        try:
            direct = os.O_DIRECT if _direct_ok(directory) else 0
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, 0o600)
        except OSError as exc:
            raise _fail(self.path, f"cannot create a file in {directory}: {exc.strerror}",
                        "check that the directory exists and is writable") from None
        self._start_buffers()

    def _start_buffers(self) -> None:
        self._bufs = [_take_buffer(IO_CHUNK) for _ in range(IO_DEPTH + 1)]
        self._views = [memoryview(buf)[:IO_CHUNK] for buf in self._bufs]
        self._cur, self._fill, self._stage_start = 0, 0, 0
        self._pool = ThreadPoolExecutor(max_workers=IO_DEPTH, thread_name_prefix="kvtier-snapshot")
        self._put(None, self._payload_offset)  # header area: zeros until commit

    def __enter__(self) -> "SnapshotWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.commit()

    def _put(self, data: memoryview | None, nbytes: int, hasher: Any = None) -> None:
        """Append ``data`` (or ``nbytes`` zeros) to the staged stream, hashing the staged copy."""
        pos = 0
        while pos < nbytes:
            buf = self._views[self._cur]
            n = min(nbytes - pos, len(buf) - self._fill, _PIECE)
            piece = buf[self._fill : self._fill + n]
            piece[:] = bytes(n) if data is None else data[pos : pos + n]
            if hasher is not None:
                hasher.update(piece)
            self._fill += n
            pos += n
            if self._fill == len(buf):
                self._flush()

    def _flush(self) -> None:
        if self._fill:
            if len(self._pending) >= IO_DEPTH:  # the next buffer's earlier write must be done
                self._pending.pop(0).result()
            view = self._views[self._cur][: self._fill]
            self._pending.append(self._pool.submit(_pwrite_all, self._fd, view, self._stage_start))
            self._stage_start, self._fill = self._stage_start + self._fill, 0
            self._cur = (self._cur + 1) % len(self._views)

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _guarded(self, action: Callable[[], Any]) -> Any:
        if self._closed:
            raise _fail(self.path, "the writer is already closed")
        try:
            return action()
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                raise _fail(self.path, "no space left on the device",
                            "free disk space and take the snapshot again; nothing was written") from exc
            if isinstance(exc, OSError):
                raise _fail(self.path, f"write failed: {exc.strerror or exc}") from exc
            raise

    def write_block(self, index: int, payload: Any) -> None:
        """Append block ``index`` (bytes-like, numpy array or torch tensor); blocks go in order."""
        self._guarded(lambda: self._write_block(index, payload))

    def _write_block(self, index: int, payload: Any) -> None:
        if index != len(self._digests) or index >= len(self._keys):
            raise _fail(self.path, f"block {index} written out of order (expected {len(self._digests)})")
        data, nbytes = _bytes_view(payload), self._nbytes[index]
        if len(data) != nbytes:
            raise _fail(self.path, f"block {index} has {len(data)} bytes, declared {nbytes}")
        hasher = xxhash.xxh3_64()
        self._put(data, nbytes, hasher)
        self._put(None, round_up(nbytes) - nbytes)
        self._digests.append(hasher.intdigest())

    def commit(self) -> SnapshotInfo:
        """Write the header, make the file durable and move it to its final name."""
        return self._guarded(self._commit)

    def _commit(self) -> SnapshotInfo:
        if len(self._digests) != len(self._keys):
            raise _fail(self.path, f"only {len(self._digests)} of {len(self._keys)} blocks were written")
        self._flush()
        self._wait()
        header = self._render(self._digests).ljust(self._header_len, b" ")
        area = mmap.mmap(-1, self._payload_offset)
        area[: _PREAMBLE.size] = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, self._header_len, checksum(header),
                                                self._payload_offset, self._file_len)
        if self._sign_key:  # in the preamble's spare bytes: readers that do not know it ignore them
            from kvtier.trust import SIGNATURE_BYTES, sign

            area[_PREAMBLE.size:_PREAMBLE.size + SIGNATURE_BYTES] = sign(self._sign_key, header)
        area[PREAMBLE_BYTES:] = header
        _pwrite_all(self._fd, memoryview(area), 0)
        os.fdatasync(self._fd)
        os.close(self._fd)
        self._fd = None
        self._release()
        if not self._in_place:
            os.replace(self._tmp, self.path)
            fsync_dir(self.path.parent)
        return _info_from(os.fspath(self.path), json.loads(header), self._header_len, self._payload_offset,
                          self._file_len)

    def abort(self) -> None:
        """Drop the snapshot: remove the temp file; the final path is left untouched."""
        if self._closed:
            return
        with contextlib.suppress(BaseException):
            self._wait()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._in_place:  # a handed-over file is its owner's to remove
            self._tmp.unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        self._views = []
        _give_buffers(self._bufs)


def shard_path(path: str | os.PathLike[str], rank: int, shards: int) -> str:
    """The file one tensor-parallel rank's shard of a snapshot lives in: ``path`` itself for rank 0
    (its header is the snapshot's, for listing and planning), ``<path>.rank<r>`` beside it for the
    others. A snapshot taken at TP=N is these N files, and restores at TP=N."""
    return str(path) if rank == 0 or shards <= 1 else f"{path}.rank{rank}"


def write_snapshot(path: str | os.PathLike[str], fingerprint: ModelFingerprint, session_id: str,
                   namespace: bytes, codec: str, num_tokens: int, keys: Sequence[bytes],
                   payloads: Iterable[Any], token_ids: Sequence[int] = (), meta: dict | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   block_nbytes: Sequence[int] | None = None, sign_key: bytes | None = None,
                   in_place: bool = False) -> SnapshotInfo:
    """Write a snapshot of ``payloads`` (in key order); calls ``progress(done_bytes, total_bytes)``.

    Without ``block_nbytes`` the payloads are listed first to learn their sizes; pass it to stream.
    """
    if block_nbytes is None:
        payloads = list(payloads)
        block_nbytes = [len(_bytes_view(p)) for p in payloads]
    total, done, end = sum(block_nbytes), 0, object()
    with SnapshotWriter(path, fingerprint, session_id, namespace, codec, num_tokens, token_ids,
                        block_nbytes=block_nbytes, keys=keys, meta=meta, sign_key=sign_key,
                        in_place=in_place) as writer:
        source = iter(payloads)
        for index in range(len(keys)):
            payload = next(source, end)
            if payload is end:
                raise _fail(path, f"only {index} payloads for {len(keys)} keys")
            writer.write_block(index, payload)
            done += block_nbytes[index]
            if progress is not None:
                progress(done, total)
        if next(source, end) is not end:
            raise _fail(path, f"more payloads than the {len(keys)} keys")
        return writer.commit()


# ---- reading ------------------------------------------------------------------------------------
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
    ``trusted_keys``: check the signature (``SnapshotInfo.signed``; see ``kvtier.trust``)."""
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

        from kvtier.trust import SIGNATURE_BYTES, verify

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
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    return removed
