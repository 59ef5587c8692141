"""Segment space: the segment files of one shard and the bytes they hold.

Owns the segments (id -> ``Segment``), the open one, the next id, the live-bytes total (records
the index names) and the bytes in-flight writes reserved. The tier's capacity check is a query on
these two (``used_bytes``): there is no second, hand-kept budget. A write reserves its records'
bytes before it places them; a commit turns the reservation into live bytes, a failure gives it
back, a drop subtracts the live bytes and gives the disk space back (a punched hole, or the file
deleted once nothing in it is live or pending)."""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from kvtier.errors import CapacityError
from kvtier.tiers import fileio
from kvtier.tiers.nvme.journal import Extent
from kvtier.tiers.nvme.parts import _coalesced, _Item, log
from kvtier.tiers.records import file_bytes_for

__all__ = ["Segment", "SegmentSpace"]


@dataclass(slots=True)
class Segment:
    id: int
    path: Path
    end: int = 0  # where the next record goes (the file's size once sealed)
    live: int = 0  # bytes of records the index names
    sealed: bool = True
    legacy: bool = False  # an old-layout block file: one record at offset 0, never appended to
    pending: int = 0  # records placed here and not yet committed or failed

    @property
    def idle_and_empty(self) -> bool:
        return self.live <= 0 and self.pending == 0 and (self.sealed or self.legacy)


class SegmentSpace:
    """The segments under ``seg_dir``, appended to up to ``segment_bytes`` each, within
    ``capacity_bytes`` of records (live plus reserved)."""

    def __init__(self, seg_dir: Path, capacity_bytes: int, segment_bytes: int):
        self.seg_dir = seg_dir
        self.capacity_bytes = int(capacity_bytes)
        self.segment_bytes = segment_bytes
        self.can_punch = True  # False once the filesystem refused a hole: compaction reclaims instead
        self.segments: dict[int, Segment] = {}
        self._active: Segment | None = None
        self._next_id = 1
        self._dir_unsynced = False  # a segment was created since the directory was last made durable
        self._live = 0  # sum of the segments' live bytes
        self._reserved = 0  # bytes reserved by writes not yet committed or failed
        self._lock = threading.Lock()

    def load(self, segments: Iterable[Segment], next_id: int) -> None:
        """Take the segments found at start-up (their ``live`` already counted)."""
        with self._lock:
            self.segments = {s.id: s for s in segments}
            self._live = sum(s.live for s in self.segments.values())
            self._next_id = next_id

    # ---- what it holds --------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """What the segments hold plus what in-flight writes reserved: the capacity check's measure."""
        return self._live + self._reserved

    def __len__(self) -> int:
        return len(self.segments)

    def path(self, seg_id: int) -> Path:
        """The file of a segment (KeyError when there is none)."""
        return self.segments[seg_id].path

    def path_or_none(self, seg_id: int) -> Path | None:
        segment = self.segments.get(seg_id)
        return segment.path if segment is not None else None

    def tails(self) -> list[tuple[int, Path, int]]:
        """(id, file, end) of every appendable segment."""
        with self._lock:
            return [(s.id, s.path, s.end) for s in self.segments.values() if not s.legacy]

    def disk_bytes(self) -> int:
        """Bytes the files really occupy on disk (punched holes excluded)."""
        total = 0
        for segment in list(self.segments.values()):
            with contextlib.suppress(OSError):
                total += segment.path.stat().st_blocks * 512
        return total

    def compaction_sources(self, sparse: float, most: int = 8) -> set[int]:
        """Old-layout block files, then sealed segments less than ``sparse`` full, sparsest first."""
        with self._lock:
            sources = [s for s in self.segments.values() if s.legacy]
            sources += sorted((s for s in self.segments.values() if not s.legacy and s.sealed and s.end
                               and s.live < sparse * s.end), key=lambda s: s.live / s.end)
            return {s.id for s in sources[:most]}

    def active_vanished(self) -> bool:
        """Whether the open segment's file is gone (the directory was wiped under us)."""
        active = self._active
        return active is not None and not active.path.exists()

    # ---- the budget -----------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` for records about to be written; CapacityError when they do not fit."""
        with self._lock:
            if self._live + self._reserved + nbytes > self.capacity_bytes:
                raise CapacityError(f"NVMe tier: budget of {self.capacity_bytes} bytes is full",
                                    hint="raise --nvme or let kvtier drop cold blocks")
            self._reserved += nbytes

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose records will not be named."""
        with self._lock:
            self._reserved -= nbytes

    def committed(self, extents: Iterable[Extent]) -> None:
        """Records now named by the index: their reservation becomes live bytes, and they no longer
        keep their segment pending (in one step, so a segment is never seen empty and idle)."""
        with self._lock:
            for ext in extents:
                size = file_bytes_for(ext.nbytes)
                self._reserved -= size
                segment = self.segments.get(ext.segment)
                if segment is not None:
                    segment.live += size
                    segment.pending -= 1
                    self._live += size

    def forget(self, extents: list[Extent]) -> int:
        """Records nothing names any more: no longer live, their space given back. Returns their bytes."""
        freed = 0
        with self._lock:
            for ext in extents:
                size = file_bytes_for(ext.nbytes)
                freed += size
                segment = self.segments.get(ext.segment)
                if segment is not None:
                    segment.live -= size
                    self._live -= size
        self.reclaim(extents)
        return freed

    def reset(self) -> None:
        """The directory vanished: what it held is gone. Segments whose files are still there hold
        nothing the index names; in-flight reservations stay (their writes settle them)."""
        with self._lock:
            self.segments = {k: s for k, s in self.segments.items() if s.path.exists()}
            for segment in self.segments.values():
                segment.live = 0
            self._live = 0
            self._active = None

    # ---- placing records ------------------------------------------------------------------
    def place(self, items: list[_Item], allocate_now: bool = True) -> None:
        """Give each item consecutive offsets in the open segment (opening the next one when full)
        and allocate the ranges on disk (unless ``allocate_now`` is False: the writer's IO threads
        then allocate each run's range just before writing it, in parallel, so that many small
        records' worth of ``fallocate`` calls never hold up the thread that hands out the IOs).
        On failure the items are left unplaced."""
        ranges: list[tuple[Segment, int, int]] = []
        try:
            with self._lock:
                self._assign(items, ranges)
            for segment, start, end in ranges if allocate_now else ():
                fd = fileio.open_file(segment.path, os.O_WRONLY)
                try:
                    fileio.allocate(fd, start, end - start)
                finally:
                    fileio.close(fd)
        except OSError:
            self.unplace(items)
            raise

    def _assign(self, items: list[_Item], ranges: list) -> None:
        for item in items:
            size = item.record_bytes
            segment = self._active
            if segment is None or (segment.end and segment.end + size > self.segment_bytes):
                segment = self._open_segment()
            item.extent = Extent(segment.id, segment.end, item.extent.nbytes, item.extent.codec)
            segment.pending += 1
            if ranges and ranges[-1][0] is segment:
                ranges[-1] = (segment, ranges[-1][1], segment.end + size)
            else:
                ranges.append((segment, segment.end, segment.end + size))
            segment.end += size

    def _open_segment(self) -> Segment:
        """A new, empty segment (under ``_lock``); its directory entry is made durable first."""
        if self._active is not None:
            self._active.sealed = True
            if self._active.idle_and_empty and self._active.end:
                self.unlink(self._active, locked=True)
        seg_id = self._next_id
        self._next_id += 1
        path = self.seg_dir / f"{seg_id:08d}.kvseg"
        fileio.close(fileio.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self._dir_unsynced = True  # made durable before the journal first names it (sync_dir)
        segment = self.segments[seg_id] = Segment(seg_id, path, sealed=False)
        self._active = segment
        return segment

    def sync_dir(self) -> None:
        """Make new segments' directory entries durable, once per commit that needs it: never under
        the placing lock, where a directory fsync (which waits for the filesystem's journal, behind
        every write in flight) would hold up the next IO's placing."""
        with self._lock:
            needed, self._dir_unsynced = self._dir_unsynced, False
        if needed:
            try:
                fileio.fsync_dir(self.seg_dir)
            except OSError:
                self._dir_unsynced = True
                raise

    def settle(self, items: list[_Item]) -> None:
        """Placed items failed or were not needed: their segments may be deleted once empty."""
        with self._lock:
            for item in items:
                segment = self.segments.get(item.extent.segment)
                if segment is not None:
                    segment.pending -= 1

    def unplace(self, items: list[_Item]) -> None:
        """Placed items that will not be committed: settled, their ranges punched, unplaced."""
        placed = [item for item in items if item.extent.segment]
        self.settle(placed)
        self.reclaim([item.extent for item in placed])
        for item in placed:
            item.extent = Extent(0, 0, item.extent.nbytes, item.extent.codec)

    # ---- giving space back ----------------------------------------------------------------
    def reclaim(self, extents: Iterable[Extent]) -> None:
        """Give back the disk space of records nothing names: a segment left idle and empty is
        deleted (an old-layout block file too), otherwise the ranges are punched out."""
        by_segment: dict[int, list[tuple[int, int]]] = {}
        for ext in extents:
            by_segment.setdefault(ext.segment, []).append((ext.offset, file_bytes_for(ext.nbytes)))
        for seg_id, ranges in by_segment.items():
            segment = self.segments.get(seg_id)
            if segment is None:
                continue
            if segment.idle_and_empty:
                self.unlink(segment)
            else:
                with contextlib.suppress(OSError):
                    self.punch(segment, ranges)

    def clean(self, segment: Segment, records: list[tuple[int, int]]) -> None:
        """Delete a segment nothing names; punch the ranges of one that no entry names (a torn
        tail, drops whose punch a crash interrupted). ``records``: its named (offset, end), sorted."""
        if segment.live == 0:
            self.unlink(segment)
            return
        gaps, pos = [], 0
        for offset, end in records:
            if offset > pos:
                gaps.append((pos, offset - pos))
            pos = max(pos, end)
        if segment.end > pos:
            gaps.append((pos, segment.end - pos))
        if gaps:
            self.punch(segment, gaps)

    def punch(self, segment: Segment, ranges: list[tuple[int, int]]) -> None:
        if not self.can_punch:
            return
        try:
            fd = fileio.open_file(segment.path, os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            for offset, length in _coalesced(ranges):
                if not fileio.punch_hole(fd, offset, length):
                    self.can_punch = False
                    log.info("NVMe tier: %s cannot punch holes; dropped blocks are reclaimed by compaction",
                             self.seg_dir.parent)
                    return
        finally:
            fileio.close(fd)

    def unlink(self, segment: Segment, locked: bool = False) -> None:
        with contextlib.nullcontext() if locked else self._lock:
            if self.segments.get(segment.id) is not segment or segment.live > 0 or segment.pending:
                return
            del self.segments[segment.id]
            if self._active is segment:
                self._active = None
        with contextlib.suppress(OSError):
            fileio.unlink(segment.path)
