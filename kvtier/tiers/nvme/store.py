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
import fcntl
import os
import threading
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from kvtier.errors import CapacityError, StorageError, StorageFullError
from kvtier.tiers.dram import PAGE
from kvtier.tiers.nvme.journal import Extent, Journal
from kvtier.tiers.nvme.parts import (
    _NO_SPACE,
    _SEGMENT_NAME,
    IO_BYTES,
    MAX_RECORDS_PER_IO,  # noqa: F401 - tests size batches by it
    SEGMENT_BYTES,
    BlockRecord,
    Name,
    _captured,
    _Segment,
    _ThreadBuffers,
    log,
)
from kvtier.tiers.nvme.read import SegmentReads
from kvtier.tiers.nvme.recovery import find_holes, in_hole, legacy_block_files, rebuild_index
from kvtier.tiers.nvme.write import SegmentWrites
from kvtier.tiers.records import (  # noqa: F401 - the tier's record helpers, imported from here by its users
    HEADER_BYTES,
    checksum,
    file_bytes_for,
    probe_direct_io,
)

__all__ = ["BlockRecord", "NvmeStore", "checksum", "file_bytes_for", "probe_direct_io", "scan_shards", "shard_dir",
           "SEGMENT_BYTES", "IO_BYTES"]

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


class NvmeStore(SegmentWrites, SegmentReads):
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
