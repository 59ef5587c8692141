"""The on-disk block record and the direct-IO helpers the cold tier is built from.

A record is one KV block as the NVMe tier stores it, in a segment file (or, in the layout before
segments, alone in its own file)::

    [4 KiB header: magic, version, fingerprint, namespace, key, rank, codec, sizes, xxh3 checksums]
    [payload, zero-padded to 4 KiB]

The header carries everything needed to verify the block alone: its own xxh3, the payload's xxh3
and length, the model fingerprint, the namespace and key, and (version 3) the tensor-parallel rank
whose shard it is. Versions 1 and 2 (one file per block) are still read.

Direct IO: every record starts and ends on a page, so records are written and read with O_DIRECT
from page-aligned memory; helpers here give a tensor's bytes as an aligned window when it allows
one. The file operations themselves (punching holes, allocating, syncing) are ``fileio``'s.
"""
from __future__ import annotations

import functools
import mmap
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvtier.errors import StorageError
from kvtier.tiers import fileio
from kvtier.tiers.dram import PAGE

__all__ = ["HEADER_BYTES", "MAGIC", "VERSION", "Header", "checksum", "file_bytes_for", "pack_header",
           "unpack_header", "probe_direct_io", "bytes_view", "is_aligned_tensor", "tensor_window",
           "StorageViews"]

MAGIC = b"KVTB"
VERSION = 3
HEADER_BYTES = PAGE
# magic, version, flags, payload_nbytes, payload_xxh3, created_ns, fingerprint, namespace, codec
# spec (32 bytes; 16 in version 1), key_len, key, [version 3: rank, reserved]; then the xxh3 of
# everything before it.
_HEADER_V1 = struct.Struct("<4sHHQQQ16s16s16sH64s")
_HEADER_V2 = struct.Struct("<4sHHQQQ16s16s32sH64s")
_HEADER = struct.Struct("<4sHHQQQ16s16s32sH64sHI")
_LAYOUTS = {1: _HEADER_V1, 2: _HEADER_V2, 3: _HEADER}


@functools.lru_cache(maxsize=4096)
def file_bytes_for(payload_nbytes: int) -> int:
    """Bytes a record occupies on disk: the header page plus the payload padded to a page (called
    several times for every block at start-up: a few sizes recur, so they are remembered)."""
    return HEADER_BYTES + (payload_nbytes + PAGE - 1) // PAGE * PAGE


def checksum(data) -> int:
    """xxh3-64 of a buffer (bytes, memoryview or uint8 numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class Header:
    nbytes: int
    digest: int  # the payload's xxh3
    fingerprint: bytes
    namespace: bytes
    codec: str
    key: bytes
    rank: int | None  # None in versions 1 and 2
    created_ns: int


def pack_header(buf, nbytes: int, digest: int, fingerprint: bytes, namespace: bytes, codec: str, key: bytes,
                rank: int = 0) -> None:
    """Render a version-3 header into the first bytes of ``buf`` (a page)."""
    spec = codec.encode()
    if len(spec) > 32:
        raise StorageError(f"NVMe tier: codec name {codec!r} is longer than 32 bytes")
    body = _HEADER.pack(MAGIC, VERSION, 0, nbytes, digest, time.time_ns(), fingerprint, namespace, spec,
                        len(key), key, rank, 0)
    buf[: len(body)] = body
    buf[len(body) : len(body) + 8] = struct.pack("<Q", checksum(body))


def unpack_header(buf) -> Header | None:
    """The header at the start of ``buf``, or None when it is not an intact record header."""
    if bytes(buf[:4]) != MAGIC:
        return None
    layout = _LAYOUTS.get(struct.unpack_from("<H", buf, 4)[0])
    if layout is None:
        return None
    body = bytes(buf[: layout.size])
    (stored,) = struct.unpack_from("<Q", buf, layout.size)
    if checksum(body) != stored:
        return None
    fields = layout.unpack(body)
    _magic, version, _flags, nbytes, digest, created, fp, ns, codec, key_len, key = fields[:11]
    if key_len > 64:
        return None
    rank = fields[11] if version >= 3 else None
    return Header(nbytes, digest, fp, ns, codec.rstrip(b"\0").decode(errors="replace"), key[:key_len], rank, created)


# ---- direct IO ----------------------------------------------------------------------------------
def probe_direct_io(directory: Path) -> bool:
    """True when files in ``directory`` can be opened with O_DIRECT and written aligned."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".odirect-probe-{uuid.uuid4().hex}"
    try:
        fd = fileio.open_file(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        fileio.pwrite(fd, mmap.mmap(-1, PAGE), 0)
        return True
    except OSError:
        return False
    finally:
        fileio.close(fd)
        fileio.unlink(probe)


def bytes_view(t) -> memoryview:
    """A flat byte memoryview of a torch tensor, numpy array or buffer (no copy)."""
    if hasattr(t, "numpy"):
        import torch

        t = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(t).cast("B")


def is_aligned_tensor(t, padded: int) -> bool:
    """A torch tensor whose memory is page-aligned and has ``padded`` bytes behind its start."""
    if not hasattr(t, "data_ptr") or t.data_ptr() % PAGE or not t.is_contiguous():
        return False  # a strided view's storage window is not its logical bytes
    storage = t.untyped_storage()
    return storage.data_ptr() + storage.nbytes() - t.data_ptr() >= padded


def tensor_window(t, padded: int) -> memoryview:
    """``padded`` bytes starting at the tensor's first byte (may run into its padding)."""
    import torch

    storage = t.untyped_storage()
    offset = t.data_ptr() - storage.data_ptr()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    return memoryview(whole[offset : offset + padded].numpy()).cast("B")


class StorageViews:
    """Byte views of tensors' memory, built once per underlying storage: a view costs tens of
    microseconds to make, and a batch of thousands of blocks from one DRAM arena pays it once. Keep
    one only as long as the tensors it has seen are alive (one batch)."""

    def __init__(self) -> None:
        self._whole: dict[int, tuple] = {}

    def _storage(self, t) -> tuple[int, memoryview]:
        root = t._base if t._base is not None else t  # views of one arena share one root tensor
        found = self._whole.get(id(root))
        if found is None:
            import torch

            storage = root.untyped_storage()
            whole = memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()).cast("B")
            found = self._whole[id(root)] = (storage.data_ptr(), whole, root)  # the root kept alive: ids stay unique
        return found[0], found[1]

    def both(self, t, padded: int | None) -> tuple[memoryview, memoryview | None]:
        """The logical bytes of a tensor (without a copy when it is contiguous) or of a buffer, and,
        when ``padded`` is given, ``padded`` bytes from a contiguous tensor's page-aligned start (into
        its storage's bytes after it; None when it is not such a tensor or its storage ends before).
        One look at the tensor: a batch of thousands of small blocks pays each attribute once."""
        if not hasattr(t, "untyped_storage") or not t.is_contiguous():
            return bytes_view(t), None
        base, whole = self._storage(t)
        ptr = t.data_ptr()
        offset = ptr - base
        data = whole[offset : offset + t.nbytes]
        if padded is None or ptr % PAGE or offset + padded > len(whole):
            return data, None
        return data, whole[offset : offset + padded]
