"""Cold tier: KV block records appended to large segment files with aligned direct IO.

One shard directory (the NVMe directory itself with one rank; ``tp<N>-rank<r>/`` per rank)::

    segments/<id>.kvseg   records (``records.py``: header page + padded payload) back to back;
                          a segment takes appends up to ``segment_bytes`` (256 MiB), then the next
    index.kvj             the journal of key -> (segment, offset, length) (``journal.py``)
    .lock                 held (flock) by the one process that writes here
    blocks/               the layout before segments, one file per block: read, dropped, migrated

Writes (``write_batch``): a batch's records get consecutive offsets in the open segment, the range
is allocated at once (``fallocate``), and the records go out as a few large ``pwritev`` calls of up
to 8 MiB, several in flight on the IO threads. Group commit: one ``fdatasync`` per segment touched,
then one journal append (+ ``fdatasync``) names them all; only then does the batch return. A crash
before the journal append leaves records no entry names (a torn tail), which the next start
punches out: every block the index shows is complete.

Reads (``read_batch``): a batch's extents are sorted and merged where they are adjacent (a session
written together lies together) into ``preadv`` calls of up to 8 MiB, several in flight; every
record is verified (header checksum, namespace, key, model fingerprint, rank, payload checksum)
before its bytes count. A bad record raises ``CorruptBlockError`` for that block and is dropped.

Space: a dropped record's bytes are punched out (``fallocate(PUNCH_HOLE)``), so the budget counts
what the disk really holds; a segment with nothing live is deleted; where the filesystem cannot
punch, ``compact`` (run by the worker when the disk is idle) moves the live records of mostly-empty
segments and of old-layout block files into the open segment.

Start: the journal is replayed; entries pointing past a segment's end are dropped (the disk lost
them); unnamed ranges are punched. A journal that is missing or unreadable while segments exist is
rebuilt from the segments themselves (every record read and verified; the newest copy of a key
wins), never silently emptied. The old layout's block files are served as they are.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import threading
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from kvtier.errors import CapacityError, CorruptBlockError, StorageError, StorageFullError
from kvtier.tiers.dram import PAGE, round_up
from kvtier.tiers.journal import Extent, Journal
from kvtier.tiers.records import (
    HEADER_BYTES,
    StorageViews,
    allocate,
    checksum,
    file_bytes_for,
    fsync_dir,
    pack_header,
    probe_direct_io,
    punch_hole,
    unpack_header,
)
from kvtier.tiers.recovery import find_holes, in_hole, legacy_block_files, read_record, rebuild_index

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["BlockRecord", "NvmeStore", "checksum", "file_bytes_for", "probe_direct_io", "scan_shards", "shard_dir",
           "SEGMENT_BYTES", "IO_BYTES"]

log = logging.getLogger(__name__)

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
class _Segment:
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


def shard_dir(root: str | os.PathLike, rank: int, shards: int) -> Path:
    """Where one tensor-parallel rank keeps its blocks: the root itself with one rank (as always),
    ``<root>/tp<N>-rank<r>`` with N ranks (each rank's records hold its own KV heads)."""
    return Path(root) if shards <= 1 else Path(root) / f"tp{shards}-rank{rank}"


def scan_shards(root: str | os.PathLike, capacity_bytes: int, shards: int, direct: str = "auto") -> tuple[list, int]:
    """The blocks every rank holds (a block is usable only when all its shards are on disk; the
    largest shard's size counts) and the damaged records dropped on the way. Reads only: the
    workers own the directories."""
    merged: dict[Name, BlockRecord] = {}
    removed = 0
    for rank in range(shards):
        store = NvmeStore(shard_dir(root, rank, shards), capacity_bytes, io_threads=1, direct="off", rank=rank,
                          readonly=True)
        records = store.scan()
        removed += store.removed_at_scan
        store.close()
        if rank == 0:
            merged = {(r.namespace, r.key): r for r in records}
            continue
        seen = {(r.namespace, r.key): r for r in records}
        merged = {k: BlockRecord(k[0], k[1], max(r.nbytes, seen[k].nbytes)) for k, r in merged.items() if k in seen}
    return list(merged.values()), removed


class _ThreadBuffers(threading.local):
    """Per IO thread: aligned header pages and a growable aligned bounce buffer (reused: a fresh
    mmap per IO would cost its page faults every time)."""

    def __init__(self) -> None:
        self.headers = mmap.mmap(-1, MAX_RECORDS_PER_IO * HEADER_BYTES)
        self.bounce = mmap.mmap(-1, PAGE)

    def bounce_of(self, size: int) -> mmap.mmap:
        if len(self.bounce) < size:
            self.bounce = mmap.mmap(-1, round_up(size))
        return self.bounce


class NvmeStore:
    """Block records in segment files under ``root`` within ``capacity_bytes``; see the module
    docstring. ``readonly``: only read what is there (the scheduler half's start-up scan).
    A ``kvtier.tiers.base.BlockStore``."""

    name = "nvme"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, io_threads: int = 8, direct: str = "auto",
                 rank: int = 0, readonly: bool = False, segment_bytes: int = SEGMENT_BYTES):
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self.rank = rank
        self.readonly = readonly
        self.segment_bytes = max(int(segment_bytes), 1 << 20)
        self._seg_dir = self.root / "segments"
        self._legacy_dir = self.root / "blocks"
        self._lock_fd: int | None = None
        if not readonly:
            try:
                self._seg_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"NVMe tier: cannot use directory {self.root}: {exc.strerror}",
                                   hint="pass --nvme-dir pointing at a writable directory on a local SSD") from exc
            self._take_lock()
        self.direct = self._choose_io_mode(direct)
        self._lock = threading.Lock()  # the maps below and the budget
        self._commit_lock = threading.Lock()  # journal appends, applied to the maps in the same order
        self._journal = Journal(self.root)
        self._loc: dict[Name, Extent] = {}
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._next_id = 1
        self._used = 0
        self.can_punch = True  # False once the filesystem refused a hole: compaction reclaims instead
        self.removed_at_scan = 0  # damaged records found and dropped at start (a crash cannot leave one; a disk can)
        self.rebuilt_index = False  # the journal was missing or unreadable: rebuilt from the segments
        self.recreated = 0  # times the directory vanished under us and was made again
        self.io_counts: Counter[str] = Counter()  # write_ios, read_ios, syncs, commits: what batching saved
        self._buffers = _ThreadBuffers()
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="kvtier-nvme")
        self._recover()

    # ---- start-up -------------------------------------------------------------------------
    def _take_lock(self) -> None:
        """Refuse a second writer. The lock file is held read-only (flock needs no write access; a
        file held open for writing would stop the disk being remounted read-only)."""
        path = self.root / ".lock"
        if not path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = path.read_text().strip() or "?"
            except OSError:
                holder = "?"
            raise StorageError(f"NVMe tier: {self.root} is in use by another kvtier process (pid {holder})",
                               hint="give each kvtier instance its own --nvme-dir") from None
        with contextlib.suppress(OSError):
            path.write_text(f"{os.getpid()}\n")
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = fd

    def _choose_io_mode(self, direct: str) -> bool:
        if direct == "off" or self.readonly:
            return False
        ok = probe_direct_io(self.root)
        if not ok:
            if direct == "on":
                raise StorageError(f"NVMe tier: {self.root} does not support O_DIRECT",
                                   hint="use a directory on a local ext4/xfs SSD, or set direct_io = \"auto\"")
            log.warning("NVMe tier: %s does not support O_DIRECT; using buffered IO + fdatasync", self.root)
        return ok

    def _segment_files(self) -> dict[int, Path]:
        found = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self._seg_dir):
                match = _SEGMENT_NAME.match(entry.name)
                if match:
                    found[int(match.group(1))] = Path(entry.path)
                elif entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        return found

    def _recover(self) -> None:
        """Replay the journal (or rebuild it), check it against the segments, clean what no entry names."""
        files = self._segment_files()
        live = self._journal.replay(repair=not self.readonly)
        if live is None and files:
            why = "unreadable" if self._journal.exists() else "missing"
            log.warning("NVMe tier: the index of %s is %s; rebuilding it from %d segment files", self.root, why,
                        len(files))
            if not self.readonly:
                self._journal.move_aside(why)
            live, damaged = rebuild_index(files, self.rank)
            self.removed_at_scan += damaged
            self.rebuilt_index = True
            if not self.readonly:
                self._journal.rewrite(live)
        live = live or {}
        if self._journal.damaged:  # a block whose entry is damaged is not trusted: as if dropped
            log.warning("NVMe tier: %d damaged index entries skipped in %s", self._journal.damaged, self._journal.path)
            self.removed_at_scan += self._journal.damaged
        sizes = {}
        for seg_id, path in files.items():
            with contextlib.suppress(OSError):
                sizes[seg_id] = path.stat().st_size
        holes = {seg_id: find_holes(path, sizes[seg_id]) for seg_id, path in files.items() if seg_id in sizes}
        dropped = [name for name, ext in live.items()
                   if ext.segment not in sizes or ext.offset % PAGE
                   or ext.offset + file_bytes_for(ext.nbytes) > sizes[ext.segment]
                   or in_hole(holes[ext.segment], ext.offset, file_bytes_for(ext.nbytes))]
        for name in dropped:  # the disk lost these (a truncated or deleted segment)
            del live[name]
        if dropped:
            log.warning("NVMe tier: %d indexed blocks in %s are missing from their segments; dropped", len(dropped),
                        self.root)
        self.removed_at_scan += len(dropped)
        for seg_id, path in files.items():
            self._segments[seg_id] = _Segment(seg_id, path, end=sizes.get(seg_id, 0))
        for name, ext in live.items():
            self._segments[ext.segment].live += file_bytes_for(ext.nbytes)
        self._loc = live
        self._used = sum(s.live for s in self._segments.values())
        self._next_id = max([*files, *(e.segment for e in live.values()), 0]) + 1
        self._adopt_legacy()
        if self.readonly:
            return
        self._remove_old_temp_files()
        if dropped:
            self._journal.append([], dropped)
        if self._journal.wants_rewrite(len(self._loc)):
            self._journal.rewrite({n: e for n, e in self._loc.items() if e.segment > 0})
        named: dict[int, list[tuple[int, int]]] = {}  # segment -> (offset, end) of its records, one pass
        for ext in self._loc.values():
            named.setdefault(ext.segment, []).append((ext.offset, ext.offset + file_bytes_for(ext.nbytes)))
        for segment in list(self._segments.values()):
            if not segment.legacy:
                self._clean_segment(segment, sorted(named.get(segment.id, ())))

    def _clean_segment(self, segment: _Segment, records: list[tuple[int, int]]) -> None:
        """Delete a segment nothing names; punch the ranges of one that no entry names (a torn
        tail, drops whose punch a crash interrupted). ``records``: its named (offset, end), sorted."""
        if segment.live == 0:
            self._unlink_segment(segment)
            return
        gaps, pos = [], 0
        for offset, end in records:
            if offset > pos:
                gaps.append((pos, offset - pos))
            pos = max(pos, end)
        if segment.end > pos:
            gaps.append((pos, segment.end - pos))
        if gaps:
            self._punch(segment, gaps)

    def _remove_old_temp_files(self) -> None:
        """The previous layout wrote blocks under ``tmp/`` first: a crash could leave some."""
        old = self.root / "tmp"
        if old.is_dir():
            for leftover in old.iterdir():
                leftover.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                old.rmdir()

    def _adopt_legacy(self) -> None:
        """Serve the old layout's block files as they are: each is a one-record segment with a
        negative id. Truncated ones, and ones a segment record supersedes, are removed."""
        legacy_id = 0
        for namespace, key, nbytes, path, size in legacy_block_files(self._legacy_dir):
            if size != file_bytes_for(nbytes) or (namespace, key) in self._loc:
                if not self.readonly:
                    path.unlink(missing_ok=True)
                self.removed_at_scan += size != file_bytes_for(nbytes)
                continue
            legacy_id -= 1
            self._segments[legacy_id] = _Segment(legacy_id, path, end=size, live=size, legacy=True)
            self._loc[(namespace, key)] = Extent(legacy_id, 0, nbytes, "")
            self._used += size
        if legacy_id:
            log.info("NVMe tier: serving %d block files of the previous layout from %s", -legacy_id, self._legacy_dir)

    # ---- bookkeeping ----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def scan(self) -> list[BlockRecord]:
        """The blocks the tier holds (what the start-up recovery found, plus writes since)."""
        with self._lock:
            return [BlockRecord(ns, key, ext.nbytes) for (ns, key), ext in self._loc.items()]

    def contains(self, namespace: bytes, key: bytes) -> bool:
        return (namespace, key) in self._loc

    has = contains

    def size_of(self, namespace: bytes, key: bytes) -> int | None:
        """Payload bytes of a stored block (None when it is not stored)."""
        ext = self._loc.get((namespace, key))
        return ext.nbytes if ext is not None else None

    def locate(self, namespace: bytes, key: bytes) -> tuple[Path, int, int]:
        """(file, offset, record bytes) of a stored block: for tools and fault tests."""
        ext = self._loc[(namespace, key)]
        return self._segments[ext.segment].path, ext.offset, file_bytes_for(ext.nbytes)

    @property
    def num_blocks(self) -> int:
        return len(self._loc)

    def files(self) -> int:
        """Files holding blocks (segments and old-layout block files)."""
        return len(self._segments)

    def unnamed_tail_bytes(self) -> int:
        """Bytes at the ends of segments that no index entry names (what a batch cut short by a
        crash leaves; the next writer's start punches them)."""
        ends: dict[int, int] = {}
        with self._lock:
            for ext in self._loc.values():
                ends[ext.segment] = max(ends.get(ext.segment, 0), ext.offset + file_bytes_for(ext.nbytes))
            tails = [(s.path, ends.get(s.id, 0), s.end) for s in self._segments.values() if not s.legacy]
        total = 0
        for path, start, end in tails:
            if end > start:
                punched = sum(min(b, end) - max(a, start) for a, b in find_holes(path, end) if b > start and a < end)
                total += end - start - punched
        return total

    def disk_bytes(self) -> int:
        """Bytes the tier's files really occupy on disk (punched holes excluded)."""
        total = 0
        for segment in list(self._segments.values()):
            with contextlib.suppress(OSError):
                total += segment.path.stat().st_blocks * 512
        return total

    def _reserve(self, nbytes: int) -> None:
        with self._lock:
            if self._used + nbytes > self.capacity_bytes:
                raise CapacityError(f"NVMe tier: budget of {self.capacity_bytes} bytes is full",
                                    hint="raise --nvme or let kvtier drop cold blocks")
            self._used += nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def _error(self, exc: BaseException, what: str) -> BaseException:
        """The exception a failed IO is reported as (a full disk is its own kind)."""
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            full = StorageFullError(f"NVMe tier: no space left on the device holding {self.root}",
                                    hint="free disk space or lower --nvme; earlier blocks are intact")
            full.__cause__ = exc
            return full
        if isinstance(exc, OSError):
            return StorageError(f"NVMe tier: {what} failed: {exc.strerror or exc}")
        return exc

    # ---- write ------------------------------------------------------------------------------
    def write(self, namespace: bytes, key: bytes, payload: "torch.Tensor", fingerprint: bytes,
              codec: str = "none") -> int:
        """Store one block durably; returns its record's size. Raises StorageFullError on ENOSPC."""
        (outcome,) = self.write_batch([(namespace, key, payload, codec)], fingerprint)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_write(self, *args, **kwargs) -> Future:
        """``write`` on an IO thread (one block: its IO runs on that thread, nothing nested)."""
        return self._pool.submit(self.write, *args, **kwargs)

    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]],
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

    def _reserve_each(self, items: list[_Item], outcomes: list) -> list[_Item]:
        kept = []
        for item in items:
            try:
                self._reserve(file_bytes_for(item.extent.nbytes))
            except CapacityError as exc:
                outcomes[item.index] = exc
                continue
            kept.append(item)
        return kept

    def _write_items(self, items: list[_Item], fingerprint: bytes, outcomes: list, views: StorageViews,
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

    def _fail(self, items: list[_Item], exc: BaseException, outcomes: list) -> None:
        """Items that did not make it (unplaced again): their budget back, the error reported."""
        error = self._error(exc, "writing a block")
        for item in items:
            self._release(file_bytes_for(item.extent.nbytes))
            outcomes[item.index] = error

    def _unplace(self, items: list[_Item]) -> None:
        """Placed items that will not be committed: settled, their ranges punched, unplaced."""
        placed = [item for item in items if item.extent.segment]
        self._settle(placed)
        self._reclaim([item.extent for item in placed])
        for item in placed:
            item.extent = Extent(0, 0, item.extent.nbytes, item.extent.codec)

    def _place(self, items: list[_Item]) -> None:
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

    def _assign(self, items: list[_Item], ranges: list) -> None:
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

    def _open_segment(self) -> _Segment:
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

    def _write_io(self, io: list[_Item], fingerprint: bytes) -> None:
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

    def _counted(self, what: str) -> None:
        with self._lock:
            self.io_counts[what] += 1

    def _sync_segment(self, seg_id: int) -> None:
        self._counted("syncs")
        fd = os.open(self._segments[seg_id].path, os.O_WRONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _commit(self, items: list[_Item], expected: dict[Name, Extent] | None = None) -> list[_Item]:
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

    def _settle(self, items: list[_Item]) -> None:
        """Placed items are committed or failed: their segments may be deleted once empty."""
        with self._lock:
            for item in items:
                segment = self._segments.get(item.extent.segment)
                if segment is not None:
                    segment.pending -= 1

    # ---- drop -------------------------------------------------------------------------------
    def delete(self, namespace: bytes, key: bytes) -> int:
        """Remove a block; returns the bytes freed (0 when it was not stored)."""
        return self.delete_many([(namespace, key)])

    def delete_many(self, names: Iterable[Name]) -> int:
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

    def _forget_extents(self, extents: list[Extent]) -> int:
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

    def _reclaim(self, extents: Iterable[Extent]) -> None:
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

    def _punch(self, segment: _Segment, ranges: list[tuple[int, int]]) -> None:
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

    def _unlink_segment(self, segment: _Segment, locked: bool = False) -> None:
        with contextlib.nullcontext() if locked else self._lock:
            if self._segments.get(segment.id) is not segment or segment.live > 0 or segment.pending:
                return
            del self._segments[segment.id]
            if self._active is segment:
                self._active = None
        with contextlib.suppress(OSError):
            segment.path.unlink()

    # ---- read -------------------------------------------------------------------------------
    def read_into(self, namespace: bytes, key: bytes, dst: "torch.Tensor", fingerprint: bytes) -> tuple[int, str]:
        """Read and verify one block into ``dst`` (uint8, contiguous); returns (nbytes, codec)."""
        (outcome,) = self.read_batch([(namespace, key, dst)], fingerprint)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_read(self, *args, **kwargs) -> Future:
        return self._pool.submit(self.read_into, *args, **kwargs)

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes,
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

    def _read_io(self, io: list[_Item], fingerprint: bytes) -> list:
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

    def _verified(self, item: _Item, header, body, complete: bool, fingerprint: bytes, path: Path,
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
    def compact(self, max_bytes: int = 64 << 20, sparse: float = 0.5) -> int:
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

    def _move(self, picked: list[tuple[Name, Extent]]) -> int:
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

    def _copy_io(self, io: list[_Item]) -> None:
        segment = self._segments[io[0].extent.segment]
        fd = os.open(segment.path, os.O_WRONLY)
        try:
            data = b"".join(item.buffer for item in io)
            if os.pwrite(fd, data, io[0].extent.offset) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        finally:
            os.close(fd)

    # ---- health -----------------------------------------------------------------------------
    def free_bytes(self) -> int | None:
        """Bytes the filesystem under the tier has free (None if it cannot say)."""
        try:
            stat = os.statvfs(self.root)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    def check_present(self) -> bool:
        """Make the tier's directory again if it vanished (wiped under the server): True if it had
        (``recreated`` counts it; what it held is forgotten). A lost index of a present tier is
        written again from memory. A few stats when all is well."""
        if self._seg_dir.is_dir():
            if self._loc and not self._journal.exists():
                with contextlib.suppress(OSError), self._commit_lock:
                    self._journal.rewrite({n: e for n, e in self._loc.items() if e.segment > 0})
            return False
        return self._recreate_if_vanished()

    def _recreate_if_vanished(self) -> bool:
        with self._commit_lock, self._lock:
            if self._seg_dir.is_dir() and (self._active is None or self._active.path.exists()):
                return False
            try:
                self._seg_dir.mkdir(parents=True, exist_ok=True)
            except OSError:  # a read-only or missing disk: the next write says so
                return False
            log.warning("NVMe tier: %s vanished; recreated it", self.root)
            with contextlib.suppress(OSError, StorageError):
                self._take_lock()  # the old lock file went with the directory
            self._loc.clear()
            self._segments = {k: s for k, s in self._segments.items() if s.path.exists()}
            self._active = None
            self._used = 0
            self.recreated += 1
            with contextlib.suppress(OSError):
                self._journal.rewrite({})
            return True

    def probe(self) -> str | None:
        """Whether the disk takes a durable write now (after a failure, when nothing else needs
        writing): None if it does, else why not."""
        probe = self._seg_dir / f".probe-{uuid.uuid4().hex[:8]}"
        try:
            self._seg_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"kvtier")
                os.fdatasync(fd)
            finally:
                os.close(fd)
            probe.unlink()
            if os.path.lexists(self._journal.path):  # a commit must be able to append to the index too
                os.close(os.open(self._journal.path, os.O_WRONLY | os.O_APPEND))
            return None
        except OSError as exc:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
            return f"NVMe tier: {self.root} does not take writes: {exc.strerror or exc}"

    # ---- threads ----------------------------------------------------------------------------
    def _run(self, fn: Callable[[Any], Any], ios: list) -> list:
        """``fn`` over ``ios``, several in flight (the first on this thread); exceptions returned."""
        futures = [self._submit(_captured, fn, io) for io in ios[1:]]
        first = [_captured(fn, ios[0])] if ios else []
        return first + [future.result() for future in futures]

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """On the IO threads; inline when already on one (``submit_write`` / ``submit_read`` run
        a whole call there: waiting on a sibling could leave every thread waiting)."""
        if threading.current_thread().name.startswith("kvtier-nvme"):
            done: Future = Future()
            done.set_result(fn(*args))
            return done
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _captured(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported per IO to the batch's caller
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
