"""Reading records, for ``NvmeStore``: extents sorted, adjacent records merged into preadv calls of up
to 8 MiB, each record verified before its bytes count; and compaction, which moves the live records
of sparse segments, verified, into the open one. A mixin of ``NvmeStore``."""
from __future__ import annotations

import errno
import os
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kvtier.errors import CapacityError, CorruptBlockError, StorageError
from kvtier.tiers.dram import PAGE, round_up
from kvtier.tiers.nvme.journal import Extent
from kvtier.tiers.nvme.recovery import read_record
from kvtier.tiers.records import (
    HEADER_BYTES,
    StorageViews,
    checksum,
    file_bytes_for,
    unpack_header,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.tiers.nvme.store import NvmeStore

from kvtier.tiers.nvme.parts import (
    MAX_RECORDS_PER_IO,
    Name,
    _Item,
    _runs,
)

__all__ = ["SegmentReads"]


class SegmentReads:
    # ---- read -------------------------------------------------------------------------------
    def read_into(self: "NvmeStore", namespace: bytes, key: bytes, dst: "torch.Tensor",
                  fingerprint: bytes) -> tuple[int, str]:
        """Read and verify one block into ``dst`` (uint8, contiguous); returns (nbytes, codec)."""
        (outcome,) = self.read_batch([(namespace, key, dst)], fingerprint)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_read(self: "NvmeStore", *args, **kwargs) -> Future:
        return self._pool.submit(self.read_into, *args, **kwargs)

    def read_batch(self: "NvmeStore", reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes,
                   retry: bool = True) -> list[tuple[int, str] | BaseException]:
        """Read and verify ``(namespace, key, destination)`` blocks: adjacent records merged into large
        reads, several in flight. Returns, per block, (nbytes, codec) or the exception (a block that
        is not stored, a damaged one: dropped). Not for the store's own IO threads."""
        outcomes: list[tuple[int, str] | BaseException] = [(0, "")] * len(reads)
        items = []
        with self._lock:
            for i, (namespace, key, dst) in enumerate(reads):
                ext = self._loc.get((namespace, key))
                if ext is None:
                    outcomes[i] = StorageError(f"NVMe tier: block {key.hex()[:16]} is not stored")
                else:
                    items.append(_Item(i, namespace, key, dst, ext))
        views = StorageViews()
        for item in items:
            item.data = views.data(item.buffer)
            # read in place only into a page-aligned destination that owns the padded length itself,
            # so the padding never spills into a neighbour's bytes
            padded = round_up(item.extent.nbytes)
            if self.direct and len(item.data) >= padded:
                item.window = views.window(item.buffer, padded)
        items.sort(key=lambda item: (item.extent.segment, item.extent.offset))
        ios = list(_runs(items))
        for io, result in zip(ios, self._run(lambda io: self._read_io(io, fingerprint), ios)):
            for item, outcome in zip(io, result if isinstance(result, list) else [result] * len(io)):
                outcomes[item.index] = self._error(outcome, "reading a block") \
                    if isinstance(outcome, OSError) else outcome
        bad = [item for item in items if isinstance(outcomes[item.index], CorruptBlockError)]
        moved = [item for item in bad if self._loc.get((item.namespace, item.key)) not in (None, item.extent)]
        if moved and retry:  # rewritten or compacted while we read: read the new copy
            again = self.read_batch([reads[item.index] for item in moved], fingerprint, retry=False)
            for item, outcome in zip(moved, again):
                outcomes[item.index] = outcome
        stale = [(item.namespace, item.key) for item in bad
                 if self._loc.get((item.namespace, item.key)) == item.extent]
        if stale:
            self.delete_many(stale)
        return outcomes

    def _read_io(self: "NvmeStore", io: list[_Item], fingerprint: bytes) -> list:
        """One ``preadv`` of adjacent records; verifies each (on this thread)."""
        buffers = self._buffers
        headers = memoryview(buffers.headers)
        sizes = [file_bytes_for(item.extent.nbytes) for item in io]
        in_place = [item.window is not None for item in io]
        bounce = memoryview(buffers.bounce_of(max(PAGE, sum(s - HEADER_BYTES for s, d in zip(sizes, in_place)
                                                             if not d))))
        vectors, bodies, used = [], [], 0
        for k, (item, size, direct) in enumerate(zip(io, sizes, in_place)):
            body_len = size - HEADER_BYTES
            if direct:
                body = item.window
            else:
                body, used = bounce[used : used + body_len], used + body_len
            vectors += [headers[k * HEADER_BYTES : (k + 1) * HEADER_BYTES], body]
            bodies.append(body)
        segment = self._segments.get(io[0].extent.segment)
        where = segment.path if segment is not None else self._seg_dir
        try:
            fd = os.open(where, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except (FileNotFoundError, IsADirectoryError):
            return [CorruptBlockError(f"NVMe tier: the file holding block {item.key.hex()[:16]} vanished",
                                      path=str(where)) for item in io]
        try:
            got = os.preadv(fd, vectors, io[0].extent.offset)
        finally:
            os.close(fd)
        self._counted("read_ios")
        out, start = [], 0
        for k, (item, size, direct, body) in enumerate(zip(io, sizes, in_place, bodies)):
            header = headers[k * HEADER_BYTES : (k + 1) * HEADER_BYTES]
            out.append(self._verified(item, header, body, got - start >= size, fingerprint, where, direct))
            start += size
        return out

    def _verified(self: "NvmeStore", item: _Item, header, body, complete: bool, fingerprint: bytes, path: Path,
                  direct: bool) -> tuple[int, str] | BaseException:
        place = f"{path.name}@{item.extent.offset}"
        fields = unpack_header(header) if complete else None
        if fields is None:
            return CorruptBlockError(f"NVMe tier: {place} has a damaged header or is truncated", path=str(path))
        if fields.namespace != item.namespace or fields.key != item.key:
            return CorruptBlockError(f"NVMe tier: {place} holds another block's data", path=str(path))
        if fields.fingerprint != fingerprint:
            return CorruptBlockError(f"NVMe tier: {place} was written for another model", path=str(path))
        if fields.rank is not None and fields.rank != self.rank:
            return CorruptBlockError(f"NVMe tier: {place} holds rank {fields.rank}'s shard", path=str(path))
        if fields.nbytes != item.extent.nbytes or checksum(body[: fields.nbytes]) != fields.digest:
            return CorruptBlockError(f"NVMe tier: checksum mismatch in {place}", path=str(path))
        dst = item.data
        if len(dst) < fields.nbytes:
            return CorruptBlockError(f"NVMe tier: {place} is larger than a block", path=str(path))
        if not direct:
            dst[: fields.nbytes] = body[: fields.nbytes]
        return fields.nbytes, fields.codec

    # ---- compaction -----------------------------------------------------------------------
    def compact(self: "NvmeStore", max_bytes: int = 64 << 20, sparse: float = 0.5) -> int:
        """Move the live records of old-layout block files and of sealed segments less than
        ``sparse`` full into the open segment (verified on the way), at most ``max_bytes``; a
        source left with nothing live is deleted. Returns the bytes moved. For idle time."""
        with self._lock:
            sources = [s for s in self._segments.values() if s.legacy]
            sources += sorted((s for s in self._segments.values() if not s.legacy and s.sealed and s.end
                               and s.live < sparse * s.end), key=lambda s: s.live / s.end)
            if not sources:
                return 0
            chosen = {s.id for s in sources[:8]}
            picked, budget = [], max_bytes
            for name, ext in self._loc.items():
                if budget <= 0:
                    break
                if ext.segment in chosen:
                    picked.append((name, ext))
                    budget -= file_bytes_for(ext.nbytes)
        moved = 0
        for start in range(0, len(picked), MAX_RECORDS_PER_IO):
            moved += self._move(picked[start : start + MAX_RECORDS_PER_IO])
        return moved

    def _move(self: "NvmeStore", picked: list[tuple[Name, Extent]]) -> int:
        """Copy verified records as they are (their headers do not name their place) and re-point
        the index at the copies, unless a block changed meanwhile."""
        items = []
        for (namespace, key), ext in picked:
            segment = self._segments.get(ext.segment)
            if segment is None:
                continue
            try:
                raw = read_record(segment.path, ext.offset, ext.nbytes, self.rank)
            except CorruptBlockError:
                self.delete_many([(namespace, key)])
                continue
            try:
                self._reserve(len(raw))  # the copy and its original, until the original is dropped
            except CapacityError:
                break
            items.append((_Item(0, namespace, key, raw, Extent(0, 0, ext.nbytes, ext.codec)), ext))
        if not items:
            return 0
        copies = [item for item, _ in items]
        self._place(copies)
        failed = False
        for io in _runs(copies):
            failed |= isinstance(self._run(self._copy_io, [io])[0], BaseException)
        for seg_id in {c.extent.segment for c in copies}:
            self._sync_segment(seg_id)
        if failed:
            self._unplace(copies)
            self._fail(copies, OSError(errno.EIO, "compaction write failed"), [0] * len(copies))
            return 0
        committed = self._commit(copies, expected={(c.namespace, c.key): old for c, old in items})
        done = {id(c) for c in committed}
        stale = [c for c in copies if id(c) not in done]  # changed meanwhile: the copy is not needed
        self._settle(stale)
        for c in stale:  # never named, never counted live: only its reservation and its bytes go back
            self._release(file_bytes_for(c.extent.nbytes))
        self._reclaim([c.extent for c in stale])
        return sum(file_bytes_for(c.extent.nbytes) for c in committed)

    def _copy_io(self: "NvmeStore", io: list[_Item]) -> None:
        segment = self._segments[io[0].extent.segment]
        fd = os.open(segment.path, os.O_WRONLY)
        try:
            data = b"".join(item.buffer for item in io)
            if os.pwrite(fd, data, io[0].extent.offset) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        finally:
            os.close(fd)

