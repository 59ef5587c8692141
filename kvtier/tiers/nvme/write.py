"""Writing and dropping records, for ``NvmeStore``: a batch's records placed back to back in the open
segment (ranges fallocate-d), written with one pwritev of header and payload iovecs per ~8 MiB
(O_DIRECT, no bounce copy), one fdatasync per segment and one journal append for the batch (group
commit); dropped records punched out, empty sealed segments unlinked. A mixin of ``NvmeStore``."""
from __future__ import annotations

import contextlib
import errno
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from kvtier.errors import CapacityError
from kvtier.tiers.dram import PAGE, round_up
from kvtier.tiers.nvme.journal import Extent
from kvtier.tiers.records import (
    HEADER_BYTES,
    StorageViews,
    allocate,
    checksum,
    file_bytes_for,
    fsync_dir,
    pack_header,
    punch_hole,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.tiers.nvme.store import NvmeStore

from kvtier.tiers.nvme.parts import (
    Name,
    _captured,
    _chunks,
    _coalesced,
    _Item,
    _nbytes,
    _runs,
    _Segment,
    log,
)

__all__ = ["SegmentWrites"]


class SegmentWrites:
    # ---- write ------------------------------------------------------------------------------
    def write(self: "NvmeStore", namespace: bytes, key: bytes, payload: "torch.Tensor", fingerprint: bytes,
              codec: str = "none") -> int:
        """Store one block durably; returns its record's size. Raises StorageFullError on ENOSPC."""
        (outcome,) = self.write_batch([(namespace, key, payload, codec)], fingerprint)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_write(self: "NvmeStore", *args, **kwargs) -> Future:
        """``write`` on an IO thread (one block: its IO runs on that thread, nothing nested)."""
        return self._pool.submit(self.write, *args, **kwargs)

    def write_batch(self: "NvmeStore", blocks: Sequence[tuple[bytes, bytes, Any, str]],
                    fingerprint: bytes) -> list[int | BaseException]:
        """Store ``(namespace, key, payload, codec)`` blocks durably, as one group commit. Returns,
        per block, its record's size on disk or the exception that kept it out (the budget, a full,
        read-only or missing disk). Durable when this returns. Not for the store's own IO threads."""
        if len(fingerprint) != 16:
            raise ValueError("NVMe tier: the fingerprint is 16 bytes")
        if any(len(key) > 64 or len(namespace) != 16 for namespace, key, _p, _c in blocks):
            raise ValueError("NVMe tier: namespace and fingerprint are 16 bytes, keys at most 64")
        outcomes: list[int | BaseException] = [0] * len(blocks)
        views = StorageViews()
        items = [_Item(i, namespace, key, payload, Extent(0, 0, _nbytes(payload), codec))
                 for i, (namespace, key, payload, codec) in enumerate(blocks)]
        try:
            self._reserve(sum(file_bytes_for(item.extent.nbytes) for item in items))
        except CapacityError:  # not all of it fits: block by block, in order
            items = self._reserve_each(items, outcomes)
        if items:
            self._write_items(items, fingerprint, outcomes, views)
        return outcomes

    def _reserve_each(self: "NvmeStore", items: list[_Item], outcomes: list) -> list[_Item]:
        kept = []
        for item in items:
            try:
                self._reserve(file_bytes_for(item.extent.nbytes))
            except CapacityError as exc:
                outcomes[item.index] = exc
                continue
            kept.append(item)
        return kept

    def _write_items(self: "NvmeStore", items: list[_Item], fingerprint: bytes, outcomes: list, views: StorageViews,
                     retry: bool = True) -> None:
        """Place, write, sync, commit. Streamed: each IO's worth of records is placed and handed to
        the IO threads as soon as it is ready, so the disk works while the rest is prepared."""
        launched: list[tuple[list[_Item], Future | BaseException]] = []
        for chunk in _chunks(items):
            for item in chunk:  # written from where it lies when it is page-aligned (O_DIRECT)
                item.data = views.data(item.buffer)
                item.window = views.window(item.buffer, round_up(item.extent.nbytes)) if self.direct else None
            try:
                self._place(chunk)
            except OSError as exc:
                launched.append((chunk, exc))
                continue
            for run in _runs(chunk):
                launched.append((run, self._submit(_captured, self._write_io, run, fingerprint)))
        failed: list[_Item] = []
        good: dict[int, list[_Item]] = {}
        error: BaseException | None = None
        for run, future in launched:
            result = future if isinstance(future, BaseException) else future.result()
            if isinstance(result, BaseException):
                failed += run
                error = result
            else:
                good.setdefault(run[0].extent.segment, []).extend(run)
        for seg_id, done in list(good.items()):  # group commit: one fdatasync per segment
            try:
                self._sync_segment(seg_id)
            except OSError as exc:
                failed += good.pop(seg_id)
                error = exc
        committed = [item for done in good.values() for item in done]
        try:
            self._commit(committed)
        except OSError as exc:
            failed += committed
            error, committed = exc, []
        for item in committed:
            outcomes[item.index] = file_bytes_for(item.extent.nbytes)
        if failed:
            self._unplace(failed)
            if isinstance(error, FileNotFoundError) and retry and self._recreate_if_vanished():
                return self._write_items(failed, fingerprint, outcomes, views, retry=False)
            self._fail(failed, error or OSError(errno.EIO, "write failed"), outcomes)

    def _fail(self: "NvmeStore", items: list[_Item], exc: BaseException, outcomes: list) -> None:
        """Items that did not make it (unplaced again): their budget back, the error reported."""
        error = self._error(exc, "writing a block")
        for item in items:
            self._release(file_bytes_for(item.extent.nbytes))
            outcomes[item.index] = error

    def _unplace(self: "NvmeStore", items: list[_Item]) -> None:
        """Placed items that will not be committed: settled, their ranges punched, unplaced."""
        placed = [item for item in items if item.extent.segment]
        self._settle(placed)
        self._reclaim([item.extent for item in placed])
        for item in placed:
            item.extent = Extent(0, 0, item.extent.nbytes, item.extent.codec)

    def _place(self: "NvmeStore", items: list[_Item]) -> None:
        """Give each item consecutive offsets in the open segment (opening the next one when full)
        and allocate the ranges on disk. On failure the items are left unplaced."""
        ranges: list[tuple[_Segment, int, int]] = []
        try:
            self._assign(items, ranges)
            for segment, start, end in ranges:
                fd = os.open(segment.path, os.O_WRONLY)
                try:
                    allocate(fd, start, end - start)
                finally:
                    os.close(fd)
        except OSError:
            self._unplace(items)
            raise

    def _assign(self: "NvmeStore", items: list[_Item], ranges: list) -> None:
        with self._lock:
            for item in items:
                size = file_bytes_for(item.extent.nbytes)
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

    def _open_segment(self: "NvmeStore") -> _Segment:
        """A new, empty segment (under ``_lock``); its directory entry is made durable first."""
        if self._active is not None:
            self._active.sealed = True
            if self._active.idle_and_empty and self._active.end:
                self._unlink_segment(self._active, locked=True)
        seg_id = self._next_id
        self._next_id += 1
        path = self._seg_dir / f"{seg_id:08d}.kvseg"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        fsync_dir(self._seg_dir)
        segment = self._segments[seg_id] = _Segment(seg_id, path, sealed=False)
        self._active = segment
        return segment

    def _write_io(self: "NvmeStore", io: list[_Item], fingerprint: bytes) -> None:
        """One ``pwritev`` of adjacent records: headers rendered here (checksums on this thread)."""
        buffers = self._buffers
        headers = memoryview(buffers.headers)
        bounce_need = sum(round_up(len(item.data)) for item in io if item.window is None)
        bounce = memoryview(buffers.bounce_of(max(bounce_need, PAGE)))
        vectors, used = [], 0
        for k, item in enumerate(io):
            data, padded = item.data, round_up(len(item.data))
            header = headers[k * HEADER_BYTES : (k + 1) * HEADER_BYTES]
            pack_header(header, len(data), checksum(data), fingerprint, item.namespace, item.extent.codec, item.key,
                        self.rank)
            if item.window is not None:
                body = item.window
            else:
                body = bounce[used : used + padded]
                body[: len(data)] = data
                body[len(data) :] = bytes(padded - len(data))
                used += padded
            vectors += [header, body]
        segment = self._segments[io[0].extent.segment]
        size = sum(file_bytes_for(len(item.data)) for item in io)
        fd = os.open(segment.path, os.O_WRONLY | (os.O_DIRECT if self.direct else 0))
        try:
            written = os.pwritev(fd, vectors, io[0].extent.offset)
        finally:
            os.close(fd)
        self._counted("write_ios")
        if written != size:
            raise OSError(errno.ENOSPC, f"short write ({written} of {size} bytes)")

    def _counted(self: "NvmeStore", what: str) -> None:
        with self._lock:
            self.io_counts[what] += 1

    def _sync_segment(self: "NvmeStore", seg_id: int) -> None:
        self._counted("syncs")
        fd = os.open(self._segments[seg_id].path, os.O_WRONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _commit(self: "NvmeStore", items: list[_Item], expected: dict[Name, Extent] | None = None) -> list[_Item]:
        """Name durable records in the journal, then in the map; punch what they replace. With
        ``expected`` (compaction's moves), a block whose extent changed meanwhile is left as it is;
        returns the items committed."""
        if not items:
            return []
        replaced: list[Extent] = []
        self._counted("commits")
        with self._commit_lock:
            if expected is not None:
                with self._lock:
                    items = [item for item in items
                             if self._loc.get((item.namespace, item.key)) == expected[(item.namespace, item.key)]]
            self._journal.append([(item.namespace, item.key, item.extent) for item in items])
            with self._lock:
                for item in items:
                    old = self._loc.get((item.namespace, item.key))
                    self._loc[(item.namespace, item.key)] = item.extent
                    self._segments[item.extent.segment].live += file_bytes_for(item.extent.nbytes)
                    if old is not None:
                        replaced.append(old)
        self._settle(items)
        self._forget_extents(replaced)
        return items

    def _settle(self: "NvmeStore", items: list[_Item]) -> None:
        """Placed items are committed or failed: their segments may be deleted once empty."""
        with self._lock:
            for item in items:
                segment = self._segments.get(item.extent.segment)
                if segment is not None:
                    segment.pending -= 1

    # ---- drop -------------------------------------------------------------------------------
    def delete(self: "NvmeStore", namespace: bytes, key: bytes) -> int:
        """Remove a block; returns the bytes freed (0 when it was not stored)."""
        return self.delete_many([(namespace, key)])

    def delete_many(self: "NvmeStore", names: Iterable[Name]) -> int:
        """Remove blocks (one journal append for all); returns the bytes freed."""
        with self._commit_lock:
            with self._lock:
                gone = [(name, self._loc[name]) for name in dict.fromkeys(names) if name in self._loc]
            if not gone:
                return 0
            try:
                self._journal.append([], [name for name, ext in gone if ext.segment > 0])
            except OSError as exc:  # a full disk must still free its own space: the start-up check
                # drops entries that name punched-out ranges
                log.warning("NVMe tier: dropping %d blocks was not journaled (%s)", len(gone), exc)
            with self._lock:
                for name, _ext in gone:
                    self._loc.pop(name, None)
        return self._forget_extents([ext for _name, ext in gone])

    def _forget_extents(self: "NvmeStore", extents: list[Extent]) -> int:
        """Account for records nothing names any more; punch them out (or unlink a block file)."""
        freed = 0
        with self._lock:
            for ext in extents:
                size = file_bytes_for(ext.nbytes)
                freed += size
                self._used -= size
                segment = self._segments.get(ext.segment)
                if segment is not None:
                    segment.live -= size
        self._reclaim(extents)
        return freed

    def _reclaim(self: "NvmeStore", extents: Iterable[Extent]) -> None:
        """Give back the disk space of records nothing names: a segment left idle and empty is
        deleted (an old-layout block file too), otherwise the ranges are punched out."""
        by_segment: dict[int, list[tuple[int, int]]] = {}
        for ext in extents:
            by_segment.setdefault(ext.segment, []).append((ext.offset, file_bytes_for(ext.nbytes)))
        for seg_id, ranges in by_segment.items():
            segment = self._segments.get(seg_id)
            if segment is None:
                continue
            if segment.idle_and_empty:
                self._unlink_segment(segment)
            else:
                with contextlib.suppress(OSError):
                    self._punch(segment, ranges)

    def _punch(self: "NvmeStore", segment: _Segment, ranges: list[tuple[int, int]]) -> None:
        if not self.can_punch:
            return
        try:
            fd = os.open(segment.path, os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            for offset, length in _coalesced(ranges):
                if not punch_hole(fd, offset, length):
                    self.can_punch = False
                    log.info("NVMe tier: %s cannot punch holes; dropped blocks are reclaimed by compaction",
                             self.root)
                    return
        finally:
            os.close(fd)

    def _unlink_segment(self: "NvmeStore", segment: _Segment, locked: bool = False) -> None:
        with contextlib.nullcontext() if locked else self._lock:
            if self._segments.get(segment.id) is not segment or segment.live > 0 or segment.pending:
                return
            del self._segments[segment.id]
            if self._active is segment:
                self._active = None
        with contextlib.suppress(OSError):
            segment.path.unlink()

