"""Reading an NVMe shard directory back without trusting an index: the tools of start-up.

* ``rebuild_index``: every verified record of every segment (the journal lost or unreadable);
* ``find_holes`` / ``in_hole``: the punched-out ranges of a segment (an entry naming one is stale);
* ``legacy_block_files``: the block files of the layout before segments;
* ``read_record``: one whole record, verified (compaction copies records as they are);
* ``ShardRecovery``: a shard's start-up with these: the journal replayed (or rebuilt), checked
  against the segments, the segment space loaded, and (for a writer) what no entry names cleaned.
"""
from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvtier.errors import CorruptBlockError
from kvtier.tiers import fileio
from kvtier.tiers.dram import PAGE
from kvtier.tiers.nvme.journal import Extent, Journal
from kvtier.tiers.nvme.parts import _SEGMENT_NAME, Name
from kvtier.tiers.nvme.parts import log as store_log
from kvtier.tiers.nvme.space import Segment, SegmentSpace
from kvtier.tiers.records import HEADER_BYTES, checksum, file_bytes_for, unpack_header

__all__ = ["rebuild_index", "find_holes", "in_hole", "legacy_block_files", "read_record", "ShardRecovery",
           "Recovered"]

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



@dataclass
class Recovered:
    """What a shard's start-up found."""

    extents: dict[Name, Extent] = field(default_factory=dict)  # the index: every block to serve
    removed: int = 0  # damaged or lost records dropped (a crash cannot leave one; a disk can)
    rebuilt: bool = False  # the journal was missing or unreadable: rebuilt from the segments


class ShardRecovery:
    """Start-up of the shard under ``root``: replay ``journal`` (or rebuild it from the segments),
    drop entries the segments no longer hold, adopt the old layout's block files, and load
    ``space``. Unless ``readonly``, also clean up: the journal made to match, the ranges no entry
    names punched, segments nothing names deleted."""

    def __init__(self, root: Path, journal: Journal, space: SegmentSpace, rank: int, readonly: bool):
        self._root = root
        self._journal = journal
        self._space = space
        self._rank = rank
        self._readonly = readonly

    def run(self) -> Recovered:
        found = Recovered()
        files = self._segment_files()
        live = self._replay(files, found)
        sizes = {}
        for seg_id, path in files.items():
            with contextlib.suppress(OSError):
                sizes[seg_id] = path.stat().st_size
        dropped = self._lost(live, files, sizes)
        found.removed += len(dropped)
        segments = {seg_id: Segment(seg_id, path, end=sizes.get(seg_id, 0)) for seg_id, path in files.items()}
        for ext in live.values():
            segments[ext.segment].live += file_bytes_for(ext.nbytes)
        next_id = max([*files, *(e.segment for e in live.values()), 0]) + 1
        self._adopt_legacy(live, segments, found)
        self._space.load(segments.values(), next_id)
        found.extents = live
        if not self._readonly:
            self._clean(live, dropped)
        return found

    def _segment_files(self) -> dict[int, Path]:
        found = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self._space.seg_dir):
                match = _SEGMENT_NAME.match(entry.name)
                if match:
                    found[int(match.group(1))] = Path(entry.path)
                elif entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        fileio.unlink(entry.path)
        return found

    def _replay(self, files: dict[int, Path], found: Recovered) -> dict[Name, Extent]:
        """The journal's entries, or the segments' records when it is missing or unreadable."""
        live = self._journal.replay(repair=not self._readonly)
        if live is None and files:
            why = "unreadable" if self._journal.exists() else "missing"
            store_log.warning("NVMe tier: the index of %s is %s; rebuilding it from %d segment files", self._root,
                              why, len(files))
            if not self._readonly:
                self._journal.move_aside(why)
            live, damaged = rebuild_index(files, self._rank)
            found.removed += damaged
            found.rebuilt = True
            if not self._readonly:
                self._journal.rewrite(live)
        if self._journal.damaged:  # a block whose entry is damaged is not trusted: as if dropped
            store_log.warning("NVMe tier: %d damaged index entries skipped in %s", self._journal.damaged,
                              self._journal.path)
            found.removed += self._journal.damaged
        return live or {}

    def _lost(self, live: dict[Name, Extent], files: dict[int, Path], sizes: dict[int, int]) -> list[Name]:
        """Entries pointing past their segment's end or into a hole (the disk lost them): removed
        from ``live`` and returned."""
        holes = {seg_id: find_holes(path, sizes[seg_id]) for seg_id, path in files.items() if seg_id in sizes}
        dropped = []
        for name, ext in live.items():  # every block: one pass, each size computed once
            size = sizes.get(ext.segment)
            end = ext.offset + file_bytes_for(ext.nbytes)
            if size is None or ext.offset % PAGE or end > size:
                dropped.append(name)
                continue
            found = holes[ext.segment]
            if found and in_hole(found, ext.offset, end - ext.offset):
                dropped.append(name)
        for name in dropped:
            del live[name]
        if dropped:
            store_log.warning("NVMe tier: %d indexed blocks in %s are missing from their segments; dropped",
                              len(dropped), self._root)
        return dropped

    def _adopt_legacy(self, live: dict[Name, Extent], segments: dict[int, Segment], found: Recovered) -> None:
        """Serve the old layout's block files as they are: each is a one-record segment with a
        negative id. Truncated ones, and ones a segment record supersedes, are removed."""
        legacy_dir = self._root / "blocks"
        legacy_id = 0
        for namespace, key, nbytes, path, size in legacy_block_files(legacy_dir):
            if size != file_bytes_for(nbytes) or (namespace, key) in live:
                if not self._readonly:
                    fileio.unlink(path)
                found.removed += size != file_bytes_for(nbytes)
                continue
            legacy_id -= 1
            segments[legacy_id] = Segment(legacy_id, path, end=size, live=size, legacy=True)
            live[(namespace, key)] = Extent(legacy_id, 0, nbytes, "")
        if legacy_id:
            store_log.info("NVMe tier: serving %d block files of the previous layout from %s", -legacy_id,
                           legacy_dir)

    def _clean(self, live: dict[Name, Extent], dropped: list[Name]) -> None:
        """A writer's start: the journal made to match, what no entry names given back."""
        self._remove_old_temp_files()
        if dropped:
            self._journal.append([], dropped)
        if self._journal.wants_rewrite(len(live)):
            self._journal.rewrite({n: e for n, e in live.items() if e.segment > 0})
        named: dict[int, list[tuple[int, int]]] = {}  # segment -> (offset, end) of its records, one pass
        for ext in live.values():
            named.setdefault(ext.segment, []).append((ext.offset, ext.offset + file_bytes_for(ext.nbytes)))
        for segment in list(self._space.segments.values()):
            if not segment.legacy:
                self._space.clean(segment, sorted(named.get(segment.id, ())))

    def _remove_old_temp_files(self) -> None:
        """The previous layout wrote blocks under ``tmp/`` first: a crash could leave some."""
        old = self._root / "tmp"
        if old.is_dir():
            for leftover in old.iterdir():
                fileio.unlink(leftover)
            with contextlib.suppress(OSError):
                fileio.rmdir(old)
