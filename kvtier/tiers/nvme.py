"""Cold tier: KV blocks as files under one directory, written with aligned direct IO.

One file per block, ``<root>/blocks/<namespace>/<hh>/<hash>.<payload bytes>.kvb`` (the name alone
rebuilds the index at start, without reading a header)::

    [4 KiB header: magic, version, fingerprint, namespace, key, codec, sizes, xxh3 checksums]
    [payload, padded to 4 KiB]

Crash safety: a block is written under ``<root>/tmp/``, made durable (``fdatasync``), then renamed
into place, so a visible block is always a complete one; ``sync_dirs`` makes the renames themselves
durable (the mover calls it once per batch before acknowledging). Leftover temp files from a crash
are deleted on open. The header and the payload carry their own checksums, verified on every read;
a bad block raises ``CorruptBlockError`` and is removed.

IO: O_DIRECT with page-aligned buffers where the filesystem allows it (no page-cache pollution,
real device bandwidth); otherwise buffered IO + fsync, logged once. Several IO threads
(``submit_write`` / ``submit_read``); the syscalls and the checksum release the GIL.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import struct
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import xxhash

from kvtier.errors import CapacityError, CorruptBlockError, StorageError, StorageFullError
from kvtier.tiers.dram import PAGE, round_up

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["BlockRecord", "NvmeStore", "checksum", "file_bytes_for", "probe_direct_io", "scan_shards", "shard_dir"]

log = logging.getLogger(__name__)

MAGIC = b"KVTB"
VERSION = 2
HEADER_BYTES = PAGE
# magic, version, flags, payload_nbytes, payload_xxh3, created_ns, fingerprint, namespace, codec
# spec (32 bytes; 16 in version 1, still read), key_len, key; then the xxh3 of everything before it.
_HEADER = struct.Struct("<4sHHQQQ16s16s32sH64s")
_HEADER_V1 = struct.Struct("<4sHHQQQ16s16s16sH64s")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def file_bytes_for(payload_nbytes: int) -> int:
    """Bytes a block occupies on disk: the header page plus the payload padded to a page."""
    return HEADER_BYTES + round_up(payload_nbytes)


def checksum(data) -> int:
    """xxh3-64 of a buffer (bytes, memoryview or uint8 numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What the index needs to know about one block on disk."""

    namespace: bytes
    key: bytes
    nbytes: int  # payload bytes; the file holds file_bytes_for(nbytes)


def shard_dir(root: str | os.PathLike, rank: int, shards: int) -> Path:
    """Where one tensor-parallel rank keeps its block files: the root itself with one rank (as
    always), ``<root>/tp<N>-rank<r>`` with N ranks (each rank's files hold its own KV heads)."""
    return Path(root) if shards <= 1 else Path(root) / f"tp{shards}-rank{rank}"


def scan_shards(root: str | os.PathLike, capacity_bytes: int, shards: int, direct: str = "auto") -> tuple[list, int]:
    """The blocks every rank holds (a block is usable only when all its shards are on disk; the
    largest shard's size counts) and the damaged files removed on the way."""
    merged: dict[tuple[bytes, bytes], BlockRecord] = {}
    removed = 0
    for rank in range(shards):
        store = NvmeStore(shard_dir(root, rank, shards), capacity_bytes, io_threads=1, direct=direct)
        records = store.scan()
        removed += store.removed_at_scan
        store.close()
        if rank == 0:
            merged = {(r.namespace, r.key): r for r in records}
            continue
        seen = {(r.namespace, r.key): r for r in records}
        merged = {k: BlockRecord(k[0], k[1], max(r.nbytes, seen[k].nbytes)) for k, r in merged.items() if k in seen}
    return list(merged.values()), removed


def probe_direct_io(directory: Path) -> bool:
    """True when files in ``directory`` can be opened with O_DIRECT and written aligned."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".odirect-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, mmap.mmap(-1, PAGE))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


class _ThreadBuffers(threading.local):
    """Per IO thread: one aligned header page and a growable aligned bounce buffer."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, HEADER_BYTES)
        self.bounce = mmap.mmap(-1, PAGE)

    def bounce_of(self, size: int) -> mmap.mmap:
        if len(self.bounce) < size:
            self.bounce = mmap.mmap(-1, round_up(size))
        return self.bounce


class NvmeStore:
    """Block files under ``root`` within ``capacity_bytes``; see the module docstring."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, io_threads: int = 8, direct: str = "auto"):
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self._blocks_dir = self.root / "blocks"
        self._tmp_dir = self.root / "tmp"
        try:
            self._blocks_dir.mkdir(parents=True, exist_ok=True)
            self._tmp_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"NVMe tier: cannot use directory {self.root}: {exc.strerror}",
                hint="pass --nvme-dir pointing at a writable directory on a local SSD",
            ) from exc
        self._clear_temp_files()
        self.direct = self._choose_io_mode(direct)
        self._lock = threading.Lock()
        self._used = 0
        self._sizes: dict[tuple[bytes, bytes], int] = {}
        self.removed_at_scan = 0
        self.recreated = 0  # times the directory vanished under us and was made again
        self._buffers = _ThreadBuffers()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-nvme")
        self._dirty_dirs: set[Path] = set()

    # ---- start-up -------------------------------------------------------------------------
    def _choose_io_mode(self, direct: str) -> bool:
        if direct == "off":
            return False
        ok = probe_direct_io(self._tmp_dir)
        if not ok:
            if direct == "on":
                raise StorageError(
                    f"NVMe tier: {self.root} does not support O_DIRECT",
                    hint="use a directory on a local ext4/xfs SSD, or set direct_io = \"auto\"",
                )
            log.warning("NVMe tier: %s does not support O_DIRECT; using buffered IO + fsync", self.root)
        return ok

    def _clear_temp_files(self) -> None:
        for leftover in self._tmp_dir.iterdir():
            leftover.unlink(missing_ok=True)

    def scan(self) -> list[BlockRecord]:
        """Rebuild the tier's contents from the directory (called once at start)."""
        records = []
        used = 0
        sizes = {}
        self.removed_at_scan = 0  # damaged files found and deleted (a crash cannot leave one; a disk can)
        for path in self._blocks_dir.glob("*/*/*.kvb"):
            try:
                namespace = bytes.fromhex(path.parent.parent.name)
                hexkey, nbytes_text = path.name[: -len(".kvb")].split(".")
                key, nbytes = bytes.fromhex(hexkey), int(nbytes_text)
                size = path.stat().st_size
            except (ValueError, OSError):
                log.warning("NVMe tier: ignoring unexpected file %s", path)
                continue
            if size != file_bytes_for(nbytes) or len(namespace) != 16:
                log.warning("NVMe tier: removing truncated block file %s", path)
                path.unlink(missing_ok=True)
                self.removed_at_scan += 1
                continue
            records.append(BlockRecord(namespace, key, nbytes))
            sizes[(namespace, key)] = nbytes
            used += size
        with self._lock:
            self._sizes = sizes
            self._used = used
        return records

    # ---- bookkeeping ----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def path_of(self, namespace: bytes, key: bytes, nbytes: int | None = None) -> Path:
        """The block's file; ``nbytes`` defaults to the stored block's payload size."""
        if nbytes is None:
            nbytes = self._sizes[(namespace, key)]
        hexkey = key.hex()
        return self._blocks_dir / namespace.hex() / hexkey[:2] / f"{hexkey}.{nbytes}.kvb"

    def contains(self, namespace: bytes, key: bytes) -> bool:
        return (namespace, key) in self._sizes

    def size_of(self, namespace: bytes, key: bytes) -> int | None:
        """Payload bytes of a stored block (None when it is not stored)."""
        return self._sizes.get((namespace, key))

    @property
    def num_blocks(self) -> int:
        return len(self._sizes)

    def keys(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(list(self._sizes))

    def _reserve(self, nbytes: int) -> None:
        with self._lock:
            if self._used + nbytes > self.capacity_bytes:
                raise CapacityError(
                    f"NVMe tier: budget of {self.capacity_bytes} bytes is full",
                    hint="raise --nvme or let kvtier drop cold blocks",
                )
            self._used += nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    # ---- write ------------------------------------------------------------------------------
    def write(
        self,
        namespace: bytes,
        key: bytes,
        payload: "torch.Tensor",
        fingerprint: bytes,
        codec: str = "none",
        sync_dir: bool = True,
    ) -> int:
        """Store one block durably; returns the file's size. Raises StorageFullError on ENOSPC."""
        data = _bytes_view(payload)
        nbytes = len(data)
        size = file_bytes_for(nbytes)
        if len(key) > 64 or len(namespace) != 16 or len(fingerprint) != 16:
            raise ValueError("NVMe tier: namespace and fingerprint are 16 bytes, keys at most 64")
        replaced = self._sizes.get((namespace, key))
        self._reserve(size)
        final = self.path_of(namespace, key, nbytes)
        tmp = self._tmp_dir / f"{final.stem}.{uuid.uuid4().hex[:8]}"
        try:
            header = self._buffers.header
            _pack_header(header, nbytes, checksum(data), fingerprint, namespace, codec, key)
            try:
                self._write_file(tmp, header, payload, data, size)
            except FileNotFoundError:  # the directory was removed while serving: make it again
                log.warning("NVMe tier: %s vanished; recreating it", self._tmp_dir)
                self._tmp_dir.mkdir(parents=True, exist_ok=True)
                self.recreated += 1
                self._write_file(tmp, header, payload, data, size)
            try:
                os.replace(tmp, final)
            except FileNotFoundError:  # its fan-out directory does not exist yet (a mkdir per write is slow)
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, final)
        except BaseException as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # its directory is gone or is not one any more
                pass
            self._release(size)
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                raise StorageFullError(
                    f"NVMe tier: no space left on the device holding {self.root}",
                    hint="free disk space or lower --nvme; earlier blocks are intact",
                ) from exc
            if isinstance(exc, OSError):
                raise StorageError(f"NVMe tier: writing {final.name} failed: {exc.strerror}") from exc
            raise
        if replaced is not None and replaced != nbytes:
            self.path_of(namespace, key, replaced).unlink(missing_ok=True)
        with self._lock:
            self._sizes[(namespace, key)] = nbytes
            if replaced is not None:
                self._used -= file_bytes_for(replaced)
            self._dirty_dirs.add(final.parent)
        if sync_dir:
            self.sync_dirs()
        return size

    def _write_file(self, path: Path, header: mmap.mmap, payload, data: memoryview, size: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            body = self._aligned_body(payload, data, size - HEADER_BYTES)
            written = os.pwritev(fd, [header, body], 0)
            if written != size:
                raise OSError(errno.ENOSPC, f"short write ({written} of {size} bytes)")
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _aligned_body(self, payload, data: memoryview, padded: int):
        """The payload padded to a page, without a copy when it already sits in aligned memory."""
        if self.direct and _is_aligned_tensor(payload, padded):
            return _tensor_window(payload, padded)
        bounce = self._buffers.bounce_of(padded)
        bounce[: len(data)] = data
        return memoryview(bounce)[:padded]

    def sync_dirs(self) -> None:
        """Make completed renames durable (one fsync per touched directory)."""
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        for directory in dirs:
            try:
                fd = os.open(directory, os.O_RDONLY)
            except FileNotFoundError:  # removed meanwhile: its blocks are gone and reads will say so
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # ---- read -------------------------------------------------------------------------------
    def free_bytes(self) -> int | None:
        """Bytes the filesystem under the tier has free (None if it cannot say)."""
        try:
            stat = os.statvfs(self.root)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    def check_present(self) -> bool:
        """Make the tier's directories again if they vanished (wiped under the server): True if they
        had (``recreated`` counts it). Two stats when all is well."""
        if self._blocks_dir.is_dir() and self._tmp_dir.is_dir():
            return False
        try:
            for directory in (self._blocks_dir, self._tmp_dir):
                directory.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only or missing disk: the next write says so
            return False
        log.warning("NVMe tier: %s vanished; recreated it", self.root)
        with self._lock:
            self.recreated += 1
        return True

    def probe(self) -> str | None:
        """Whether the disk takes a durable write now (after a failure, when nothing else needs
        writing): None if it does, else why not."""
        probe = self._tmp_dir / f".probe-{uuid.uuid4().hex[:8]}"
        try:
            self._tmp_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"kvtier")
                os.fdatasync(fd)
            finally:
                os.close(fd)
            probe.unlink()
            return None
        except OSError as exc:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
            return f"NVMe tier: {self.root} does not take writes: {exc.strerror or exc}"

    def has(self, namespace: bytes, key: bytes) -> bool:
        return (namespace, key) in self._sizes

    def read_into(self, namespace: bytes, key: bytes, dst: "torch.Tensor", fingerprint: bytes) -> tuple[int, str]:
        """Read and verify one block into ``dst`` (uint8, contiguous); returns (nbytes, codec)."""
        stored = self._sizes.get((namespace, key))
        if stored is None:
            raise StorageError(f"NVMe tier: block {key.hex()[:16]} is not stored")
        path = self.path_of(namespace, key, stored)
        size = file_bytes_for(stored)
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            self._forget(namespace, key)
            raise CorruptBlockError(f"NVMe tier: block file {path} vanished", path=str(path)) from None
        try:
            body_len = size - HEADER_BYTES
            if body_len > round_up(dst.numel() * dst.element_size()):
                raise CorruptBlockError(f"NVMe tier: {path} is larger than a block", path=str(path))
            # Read in place only into a destination that owns the padded length itself, so the
            # padding never spills into a neighbour's bytes; otherwise bounce.
            direct_dst = self.direct and _is_aligned_tensor(dst, body_len) and dst.nbytes >= body_len
            body = _tensor_window(dst, body_len) if direct_dst else self._buffers.bounce_of(body_len)
            got = os.preadv(fd, [self._buffers.header, memoryview(body)[:body_len]], 0)
        finally:
            os.close(fd)
        try:
            nbytes, codec = self._verify(path, got, size, namespace, key, fingerprint, body)
        except CorruptBlockError:
            self.delete(namespace, key)
            raise
        if not direct_dst:
            _bytes_view(dst)[:nbytes] = memoryview(body)[:nbytes]
        return nbytes, codec

    def _verify(self, path, got, size, namespace, key, fingerprint, body) -> tuple[int, str]:
        fields = _unpack_header(self._buffers.header)
        if got != size or fields is None:
            raise CorruptBlockError(f"NVMe tier: {path} has a damaged header or is truncated", path=str(path))
        nbytes, digest, fp, ns, codec, stored_key = fields
        if ns != namespace or stored_key != key:
            raise CorruptBlockError(f"NVMe tier: {path} holds another block's data", path=str(path))
        if fp != fingerprint:
            raise CorruptBlockError(f"NVMe tier: {path} was written for another model", path=str(path))
        if nbytes > size - HEADER_BYTES or checksum(memoryview(body)[:nbytes]) != digest:
            raise CorruptBlockError(f"NVMe tier: checksum mismatch in {path}", path=str(path))
        return nbytes, codec

    # ---- delete / async / close -----------------------------------------------------------
    def _forget(self, namespace: bytes, key: bytes) -> int | None:
        with self._lock:
            nbytes = self._sizes.pop((namespace, key), None)
            if nbytes is not None:
                self._used -= file_bytes_for(nbytes)
        return nbytes

    def delete(self, namespace: bytes, key: bytes) -> int:
        """Remove a block; returns the bytes freed (0 when it was not stored)."""
        nbytes = self._forget(namespace, key)
        if nbytes is None:
            return 0
        self.path_of(namespace, key, nbytes).unlink(missing_ok=True)
        return file_bytes_for(nbytes)

    def submit_write(self, *args, **kwargs) -> Future:
        return self._pool.submit(self.write, *args, sync_dir=False, **kwargs)

    def submit_read(self, *args, **kwargs) -> Future:
        return self._pool.submit(self.read_into, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.sync_dirs()


def _pack_header(buf: mmap.mmap, nbytes, digest, fingerprint, namespace, codec: str, key: bytes) -> None:
    spec = codec.encode()
    if len(spec) > 32:
        raise StorageError(f"NVMe tier: codec name {codec!r} is longer than 32 bytes")
    body = _HEADER.pack(MAGIC, VERSION, 0, nbytes, digest, time.time_ns(), fingerprint, namespace,
                        spec, len(key), key)
    buf[: len(body)] = body
    buf[len(body) : len(body) + 8] = struct.pack("<Q", checksum(body))


def _unpack_header(buf: mmap.mmap):
    layout = _HEADER_V1 if struct.unpack_from("<H", buf, 4)[0] == 1 else _HEADER
    body = bytes(buf[: layout.size])
    (stored,) = struct.unpack("<Q", buf[layout.size : layout.size + 8])
    if checksum(body) != stored:
        return None
    magic, version, _flags, nbytes, digest, _created, fp, ns, codec, key_len, key = layout.unpack(body)
    if magic != MAGIC or version not in (1, VERSION) or key_len > 64:
        return None
    return nbytes, digest, fp, ns, codec.rstrip(b"\0").decode(errors="replace"), key[:key_len]


def _bytes_view(t) -> memoryview:
    """A flat byte memoryview of a torch tensor, numpy array or buffer (no copy)."""
    if hasattr(t, "numpy"):
        import torch

        t = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(t).cast("B")


def _is_aligned_tensor(t, padded: int) -> bool:
    """A torch tensor whose memory is page-aligned and has ``padded`` bytes behind its start."""
    if not hasattr(t, "data_ptr") or t.data_ptr() % PAGE or not t.is_contiguous():
        return False  # a strided view's storage window is not its logical bytes
    storage = t.untyped_storage()
    return storage.data_ptr() + storage.nbytes() - t.data_ptr() >= padded


def _tensor_window(t, padded: int) -> memoryview:
    """``padded`` bytes starting at the tensor's first byte (may run into its padding)."""
    import torch

    storage = t.untyped_storage()
    offset = t.data_ptr() - storage.data_ptr()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    return memoryview(whole[offset : offset + padded].numpy()).cast("B")
