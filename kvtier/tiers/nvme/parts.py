"""What the NVMe tier's modules share: the on-disk names and sizes, a batch item as the store moves
it, the helpers that group records into large IOs, and the one mapping of a failed IO to the error
the tier reports."""
from __future__ import annotations

import errno
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvtier.errors import StorageError, StorageFullError
from kvtier.tiers.nvme.journal import Extent
from kvtier.tiers.records import file_bytes_for

__all__ = ["BlockRecord", "Name", "SEGMENT_BYTES", "IO_BYTES"]

log = logging.getLogger("kvtier.tiers.nvme.store")

SEGMENT_BYTES = 256 << 20
IO_BYTES = 8 << 20  # bytes per pwritev / preadv
MAX_RECORDS_PER_IO = 256  # two iovecs each; IOV_MAX is 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_SEGMENT_NAME = re.compile(r"^(\d{8,})\.kvseg$")
Name = tuple[bytes, bytes]  # (namespace, key)


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What the index needs to know about one block on disk."""

    namespace: bytes
    key: bytes
    nbytes: int  # payload bytes; the record takes file_bytes_for(nbytes)


@dataclass(slots=True)
class _Item:
    """One block of a batch on its way to or from disk."""

    index: int
    namespace: bytes
    key: bytes
    buffer: Any  # the payload (write) or the destination (read)
    extent: Extent
    data: memoryview | None = None  # write: the payload's bytes
    window: memoryview | None = None  # its page-aligned, page-padded bytes in place (no bounce copy)

    @property
    def name(self) -> Name:
        return self.namespace, self.key

    @property
    def record_bytes(self) -> int:
        return file_bytes_for(self.extent.nbytes)


def storage_error(exc: BaseException, what: str, root: Path) -> BaseException:
    """The exception a failed IO under ``root`` is reported as (a full disk is its own kind)."""
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
        full = StorageFullError(f"NVMe tier: no space left on the device holding {root}",
                                hint="free disk space or lower --nvme; earlier blocks are intact")
        full.__cause__ = exc
        return full
    if isinstance(exc, OSError):
        return StorageError(f"NVMe tier: {what} failed: {exc.strerror or exc}")
    return exc


def _nbytes(payload: Any) -> int:
    """A payload's size in bytes, without making a view of it."""
    nbytes = getattr(payload, "nbytes", None)
    return int(nbytes) if nbytes is not None else memoryview(payload).nbytes


def _chunks(items: list[_Item]) -> Iterator[list[_Item]]:
    """Consecutive items, about one IO's worth each (IO_BYTES / MAX_RECORDS_PER_IO)."""
    return _runs(items, adjacent_only=False)


def _runs(items: list[_Item], adjacent_only: bool = True) -> Iterator[list[_Item]]:
    """Items cut into IOs of up to IO_BYTES / MAX_RECORDS_PER_IO: adjacent records of one segment
    (``adjacent_only``), or simply consecutive items."""
    run: list[_Item] = []
    size = 0
    for item in items:
        length = file_bytes_for(item.extent.nbytes)
        if run:
            last = run[-1].extent
            apart = adjacent_only and (last.segment != item.extent.segment
                                       or last.offset + file_bytes_for(last.nbytes) != item.extent.offset)
            if apart or size + length > IO_BYTES or len(run) >= MAX_RECORDS_PER_IO:
                yield run
                run, size = [], 0
        run.append(item)
        size += length
    if run:
        yield run


def _coalesced(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges sorted, adjacent ones merged: one punch for records dropped together."""
    merged: list[list[int]] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + length - merged[-1][0])
        else:
            merged.append([offset, length])
    return [(offset, length) for offset, length in merged]
