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

``NvmeStore`` is the facade over parts that own their state: ``SegmentSpace`` (``space.py``: the
segments, placing and punching, live and reserved bytes: the capacity check), ``Locator``
(``locator.py``: the key -> extent map and its journal), ``IoEngine`` (``ioengine.py``: threads,
direct-IO buffers, counters), ``SegmentWriter`` / ``SegmentReader`` (``write.py`` / ``read.py``),
``Compactor`` (``compact.py``) and ``ShardRecovery`` (``recovery.py``, start-up).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvtier.errors import StorageError
from kvtier.tiers import fileio
from kvtier.tiers.nvme.compact import Compactor
from kvtier.tiers.nvme.ioengine import IoEngine
from kvtier.tiers.nvme.journal import Journal
from kvtier.tiers.nvme.locator import Locator
from kvtier.tiers.nvme.parts import (
    IO_BYTES,
    MAX_RECORDS_PER_IO,  # noqa: F401 - tests size batches by it
    SEGMENT_BYTES,
    BlockRecord,
    Name,
    log,
)
from kvtier.tiers.nvme.read import SegmentReader
from kvtier.tiers.nvme.recovery import ShardRecovery, find_holes
from kvtier.tiers.nvme.space import SegmentSpace
from kvtier.tiers.nvme.write import SegmentWriter
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


class NvmeStore:
    """Block records in segment files under ``root`` within ``capacity_bytes``; see the module
    docstring. ``readonly``: only read what is there (the scheduler half's start-up scan).
    A ``kvtier.tiers.base.DiskStore``."""

    name = "nvme"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, io_threads: int = 8, direct: str = "auto",
                 rank: int = 0, readonly: bool = False, segment_bytes: int = SEGMENT_BYTES):
        self.root = Path(root)
        self.rank = rank
        self.readonly = readonly
        self._seg_dir = self.root / "segments"
        self._lock_fd: int | None = None
        if not readonly:
            try:
                fileio.mkdir(self._seg_dir)
            except OSError as exc:
                raise StorageError(f"NVMe tier: cannot use directory {self.root}: {exc.strerror}",
                                   hint="pass --nvme-dir pointing at a writable directory on a local SSD") from exc
            self._take_lock()
        self.recreated = 0  # times the directory vanished under us and was made again
        self.space = SegmentSpace(self._seg_dir, capacity_bytes, max(int(segment_bytes), 1 << 20))
        self.engine = IoEngine(self._choose_io_mode(direct), io_threads, rank)
        journal = Journal(self.root)
        found = ShardRecovery(self.root, journal, self.space, rank, readonly).run()
        self.removed_at_scan = found.removed  # damaged records found and dropped at start
        self.rebuilt_index = found.rebuilt  # the journal was missing or unreadable: rebuilt from the segments
        self.locator = Locator(journal, found.extents)
        self.writer = SegmentWriter(self.root, self.space, self.locator, self.engine, self._recreate_if_vanished)
        self.reader = SegmentReader(self.root, self.space, self.locator, self.engine, self.writer.delete_many)
        self.compactor = Compactor(self.space, self.locator, self.engine, self.writer, rank)

    # ---- start-up -------------------------------------------------------------------------
    def _take_lock(self) -> None:
        """Refuse a second writer. The lock file is held read-only (flock needs no write access; a
        file held open for writing would stop the disk being remounted read-only)."""
        path = self.root / ".lock"
        if not path.exists():
            fileio.close(fileio.open_file(path, os.O_WRONLY | os.O_CREAT, 0o600))
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
            fileio.write_small_file(path, f"{os.getpid()}\n".encode(), durable=False)
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

    # ---- what the parts say -----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.space.capacity_bytes

    @property
    def segment_bytes(self) -> int:
        return self.space.segment_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of records held plus those reserved by writes in flight (the capacity check's measure)."""
        return self.space.used_bytes

    @property
    def can_punch(self) -> bool:
        """False once the filesystem refused a hole: compaction reclaims instead."""
        return self.space.can_punch

    @can_punch.setter
    def can_punch(self, value: bool) -> None:
        self.space.can_punch = value

    @property
    def direct(self) -> bool:
        return self.engine.direct

    @property
    def io_counts(self) -> Counter[str]:
        """write_ios, read_ios, syncs, commits: what batching saved."""
        return self.engine.io_counts

    @property
    def num_blocks(self) -> int:
        return len(self.locator)

    def scan(self) -> list[BlockRecord]:
        """The blocks the tier holds (what the start-up recovery found, plus writes since)."""
        return [BlockRecord(ns, key, ext.nbytes) for (ns, key), ext in self.locator.snapshot().items()]

    def contains(self, namespace: bytes, key: bytes) -> bool:
        return (namespace, key) in self.locator

    has = contains

    def size_of(self, namespace: bytes, key: bytes) -> int | None:
        """Payload bytes of a stored block (None when it is not stored)."""
        ext = self.locator.get((namespace, key))
        return ext.nbytes if ext is not None else None

    def locate(self, namespace: bytes, key: bytes) -> tuple[Path, int, int]:
        """(file, offset, record bytes) of a stored block: for tools and fault tests."""
        ext = self.locator[(namespace, key)]
        return self.space.path(ext.segment), ext.offset, file_bytes_for(ext.nbytes)

    def files(self) -> int:
        """Files holding blocks (segments and old-layout block files)."""
        return len(self.space)

    def unnamed_tail_bytes(self) -> int:
        """Bytes at the ends of segments that no index entry names (what a batch cut short by a
        crash leaves; the next writer's start punches them)."""
        ends = self.locator.ends()
        total = 0
        for seg_id, path, end in self.space.tails():
            start = ends.get(seg_id, 0)
            if end > start:
                punched = sum(min(b, end) - max(a, start) for a, b in find_holes(path, end) if b > start and a < end)
                total += end - start - punched
        return total

    def disk_bytes(self) -> int:
        """Bytes the tier's files really occupy on disk (punched holes excluded)."""
        return self.space.disk_bytes()

    # ---- blocks in and out ------------------------------------------------------------------
    def write(self, namespace: bytes, key: bytes, payload: Any, fingerprint: bytes, codec: str = "none") -> int:
        """Store one block durably; returns its record's size. Raises StorageFullError on ENOSPC."""
        return self.writer.write(namespace, key, payload, fingerprint, codec)

    def submit_write(self, *args: Any, **kwargs: Any) -> Future:
        return self.writer.submit_write(*args, **kwargs)

    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]], fingerprint: bytes) -> list:
        return self.writer.write_batch(blocks, fingerprint)

    def delete(self, namespace: bytes, key: bytes) -> int:
        return self.writer.delete(namespace, key)

    def delete_many(self, names: Iterable[Name]) -> int:
        return self.writer.delete_many(names)

    def read_into(self, namespace: bytes, key: bytes, dst: Any, fingerprint: bytes) -> tuple[int, str]:
        return self.reader.read_into(namespace, key, dst, fingerprint)

    def submit_read(self, *args: Any, **kwargs: Any) -> Future:
        return self.reader.submit_read(*args, **kwargs)

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes) -> list:
        return self.reader.read_batch(reads, fingerprint)

    def compact(self, max_bytes: int = 64 << 20, sparse: float = 0.5) -> int:
        return self.compactor.compact(max_bytes, sparse)

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
            self.locator.rewrite_if_lost()
            return False
        return self._recreate_if_vanished()

    def _recreate_if_vanished(self) -> bool:
        with self.locator.exclusive():
            if self._seg_dir.is_dir() and not self.space.active_vanished():
                return False
            try:
                fileio.mkdir(self._seg_dir)
            except OSError:  # a read-only or missing disk: the next write says so
                return False
            log.warning("NVMe tier: %s vanished; recreated it", self.root)
            with contextlib.suppress(OSError, StorageError):
                self._take_lock()  # the old lock file went with the directory
            self.locator.clear()
            self.space.reset()
            self.recreated += 1
            return True

    def probe(self) -> str | None:
        """Whether the disk takes a durable write now (after a failure, when nothing else needs
        writing): None if it does, else why not."""
        probe = self._seg_dir / f".probe-{uuid.uuid4().hex[:8]}"
        journal = self.locator.journal.path
        try:
            fileio.mkdir(self._seg_dir)
            fd = fileio.open_file(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                fileio.pwrite(fd, b"kvtier", 0)
                fileio.fdatasync(fd)
            finally:
                fileio.close(fd)
            fileio.unlink(probe, missing_ok=False)
            if os.path.lexists(journal):  # a commit must be able to append to the index too
                os.close(os.open(journal, os.O_WRONLY | os.O_APPEND))
            return None
        except OSError as exc:
            with contextlib.suppress(OSError):
                fileio.unlink(probe)
            return f"NVMe tier: {self.root} does not take writes: {exc.strerror or exc}"

    def close(self) -> None:
        self.engine.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
