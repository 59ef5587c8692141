"""Compaction: the write path that reclaims space where holes cannot be punched.

It moves the live records of old-layout block files and of mostly-empty sealed segments, verified,
into the open segment, and re-points the index at the copies unless a block changed meanwhile; a
source left with nothing live is deleted. ``Compactor`` owns no state: it works through the segment
space, the locator, the IO engine and the writer's commit, which it is given."""
from __future__ import annotations

import errno

from kvtier.errors import CapacityError, CorruptBlockError
from kvtier.tiers.nvme.ioengine import IoEngine
from kvtier.tiers.nvme.journal import Extent
from kvtier.tiers.nvme.locator import Locator
from kvtier.tiers.nvme.parts import MAX_RECORDS_PER_IO, Name, _Item, _runs
from kvtier.tiers.nvme.recovery import read_record
from kvtier.tiers.nvme.space import SegmentSpace
from kvtier.tiers.nvme.write import SegmentWriter
from kvtier.tiers.records import file_bytes_for

__all__ = ["Compactor"]


class Compactor:
    """Moves live records of sparse files of ``space`` (shard ``rank``) into its open segment."""

    def __init__(self, space: SegmentSpace, locator: Locator, engine: IoEngine, writer: SegmentWriter, rank: int):
        self._space = space
        self._locator = locator
        self._engine = engine
        self._writer = writer
        self._rank = rank

    def compact(self, max_bytes: int = 64 << 20, sparse: float = 0.5) -> int:
        """Move the live records of old-layout block files and of sealed segments less than
        ``sparse`` full into the open segment (verified on the way), at most ``max_bytes``; a
        source left with nothing live is deleted. Returns the bytes moved. For idle time."""
        chosen = self._space.compaction_sources(sparse)
        if not chosen:
            return 0
        picked = self._locator.pick(chosen, max_bytes)
        moved = 0
        for start in range(0, len(picked), MAX_RECORDS_PER_IO):
            moved += self.move(picked[start : start + MAX_RECORDS_PER_IO])
        return moved

    def move(self, picked: list[tuple[Name, Extent]]) -> int:
        """Copy verified records as they are (their headers do not name their place) and re-point
        the index at the copies, unless a block changed meanwhile. Returns the bytes moved."""
        items = self._read_sources(picked)
        if not items:
            return 0
        copies = [item for item, _ in items]
        self._space.place(copies)
        failed = False
        for io in _runs(copies):
            failed |= isinstance(self._engine.run(self._copy_run, [io])[0], BaseException)
        for seg_id in {c.extent.segment for c in copies}:
            self._engine.sync(self._space.path(seg_id))
        if failed:
            self._space.unplace(copies)
            self._writer.fail(copies, OSError(errno.EIO, "compaction write failed"), [0] * len(copies))
            return 0
        committed = self._writer.commit(copies, expected={c.name: old for c, old in items})
        done = {id(c) for c in committed}
        stale = [c for c in copies if id(c) not in done]  # changed meanwhile: the copy is not needed
        self._space.settle(stale)
        for c in stale:  # never named, never counted live: only its reservation and its bytes go back
            self._space.release(c.record_bytes)
        self._space.reclaim([c.extent for c in stale])
        return sum(c.record_bytes for c in committed)

    def _read_sources(self, picked: list[tuple[Name, Extent]]) -> list[tuple[_Item, Extent]]:
        """The picked records read and verified, each with room reserved for its copy (the copy and
        its original both count until the original is dropped); a damaged one is dropped."""
        items = []
        for (namespace, key), ext in picked:
            path = self._space.path_or_none(ext.segment)
            if path is None:
                continue
            try:
                raw = read_record(path, ext.offset, ext.nbytes, self._rank)
            except CorruptBlockError:
                self._writer.delete_many([(namespace, key)])
                continue
            try:
                self._space.reserve(file_bytes_for(ext.nbytes))
            except CapacityError:
                break
            items.append((_Item(0, namespace, key, raw, Extent(0, 0, ext.nbytes, ext.codec)), ext))
        return items

    def _copy_run(self, io: list[_Item]) -> None:
        self._engine.copy_run(self._space.path(io[0].extent.segment), io)
