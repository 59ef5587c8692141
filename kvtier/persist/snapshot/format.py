"""The snapshot file format: its constants, the header's entries, and helpers both sides share."""
from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kvtier.errors import SnapshotError
from kvtier.layout import ModelFingerprint
from kvtier.tiers.records import probe_direct_io

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
    # kvtier.persist.trust: True signed by a trusted key, False unsigned or signed by another, None not checked
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


def shard_path(path: str | os.PathLike[str], rank: int, shards: int) -> str:
    """The file one tensor-parallel rank's shard of a snapshot lives in: ``path`` itself for rank 0
    (its header is the snapshot's, for listing and planning), ``<path>.rank<r>`` beside it for the
    others. A snapshot taken at TP=N is these N files, and restores at TP=N."""
    return str(path) if rank == 0 or shards <= 1 else f"{path}.rank{rank}"
