"""Reading an NVMe shard directory back without trusting an index: the tools of start-up.

* ``rebuild_index``: every verified record of every segment (the journal lost or unreadable);
* ``find_holes`` / ``in_hole``: the punched-out ranges of a segment (an entry naming one is stale);
* ``legacy_block_files``: the block files of the layout before segments;
* ``read_record``: one whole record, verified (compaction copies records as they are).
"""
from __future__ import annotations

import bisect
import errno
import logging
import os
from pathlib import Path
from typing import Iterator

from kvtier.errors import CorruptBlockError
from kvtier.tiers.dram import PAGE
from kvtier.tiers.nvme.journal import Extent
from kvtier.tiers.records import HEADER_BYTES, checksum, file_bytes_for, unpack_header

__all__ = ["rebuild_index", "find_holes", "in_hole", "legacy_block_files", "read_record"]

log = logging.getLogger(__name__)


def rebuild_index(files: dict[int, Path], rank: int) -> tuple[dict[tuple[bytes, bytes], Extent], int]:
    """Every verified record of every segment, the newest copy (highest segment, then offset) of
    each key winning; and how many torn or damaged records were skipped."""
    live: dict[tuple[bytes, bytes], Extent] = {}
    damaged = 0
    header = bytearray(HEADER_BYTES)
    for seg_id in sorted(files):
        try:
            fd = os.open(files[seg_id], os.O_RDONLY)
        except OSError:
            continue
        try:
            size, offset = os.fstat(fd).st_size, 0
            while offset + HEADER_BYTES <= size:
                got = os.preadv(fd, [header], offset)
                fields = unpack_header(header) if got == HEADER_BYTES else None
                if fields is None:  # a hole, zeros or torn bytes: on to the next data
                    offset = next_data(fd, offset + PAGE, size)
                    continue
                length = file_bytes_for(fields.nbytes)
                payload = os.pread(fd, fields.nbytes, offset + HEADER_BYTES) if offset + length <= size else b""
                if len(payload) != fields.nbytes or checksum(payload) != fields.digest \
                        or (fields.rank is not None and fields.rank != rank):
                    damaged += 1
                    offset += PAGE
                    continue
                live[(fields.namespace, fields.key)] = Extent(seg_id, offset, fields.nbytes, fields.codec)
                offset += length
        finally:
            os.close(fd)
    return live, damaged


def legacy_block_files(directory: Path) -> Iterator[tuple[bytes, bytes, int, Path, int]]:
    """(namespace, key, payload bytes, path, file size) of each ``<ns>/<hh>/<key>.<nbytes>.kvb``
    under ``directory``; files that do not parse are logged and skipped."""
    if not directory.is_dir():
        return
    for path in directory.glob("*/*/*.kvb"):
        try:
            namespace = bytes.fromhex(path.parent.parent.name)
            hexkey, nbytes_text = path.name[: -len(".kvb")].split(".")
            key, nbytes = bytes.fromhex(hexkey), int(nbytes_text)
            size = path.stat().st_size
        except (ValueError, OSError):
            log.warning("NVMe tier: ignoring unexpected file %s", path)
            continue
        if len(namespace) != 16:
            log.warning("NVMe tier: ignoring unexpected file %s", path)
            continue
        yield namespace, key, nbytes, path, size


def read_record(path: Path, offset: int, nbytes: int, rank: int) -> bytes:
    """One whole record (header and padded payload), verified."""
    length = file_bytes_for(nbytes)
    try:
        with open(path, "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), length, offset)
    except OSError as exc:
        raise CorruptBlockError(f"NVMe tier: cannot read {path}: {exc}", path=str(path)) from None
    fields = unpack_header(raw) if len(raw) == length else None
    if fields is None or fields.nbytes != nbytes or checksum(raw[HEADER_BYTES : HEADER_BYTES + nbytes]) \
            != fields.digest or (fields.rank is not None and fields.rank != rank):
        raise CorruptBlockError(f"NVMe tier: {path}@{offset} is damaged", path=str(path))
    return raw


def find_holes(path: Path, size: int) -> list[tuple[int, int]]:
    """The punched-out (or never written) ranges of a file, as (start, end), in order."""
    holes: list[tuple[int, int]] = []
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return holes
    try:
        offset = 0
        while offset < size:
            try:
                hole = os.lseek(fd, offset, os.SEEK_HOLE)
            except OSError:
                break  # the filesystem cannot say: no holes known
            if hole >= size:
                break
            data = next_data(fd, hole, size)
            if data <= hole:
                break
            holes.append((hole, data))
            offset = data
    finally:
        os.close(fd)
    return holes


def in_hole(holes: list[tuple[int, int]], offset: int, length: int) -> bool:
    """Whether any page of [offset, offset + length) lies in one of ``holes`` (sorted, disjoint)."""
    k = bisect.bisect_left(holes, (offset + length, -1)) - 1  # the last hole starting inside or before
    return k >= 0 and holes[k][1] > offset


def next_data(fd: int, offset: int, size: int) -> int:
    """The next offset at or after ``offset`` that holds data (skipping punched holes), page aligned."""
    if offset >= size:
        return size
    try:
        found = os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:  # ENXIO: no data after it; otherwise the filesystem cannot say
        return size if exc.errno == errno.ENXIO else offset
    return max(offset, found - found % PAGE)

