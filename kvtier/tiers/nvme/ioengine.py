"""The NVMe tier's IO engine: the IO threads, their direct-IO buffers, and the IO counters.

Owns the thread pool, the per-thread aligned header pages and bounce buffers, whether IO is
O_DIRECT, and ``io_counts`` (write_ios, read_ios, syncs, commits: what batching saved). It does
one IO at a time for a run of adjacent records given their file: ``write_run`` (one ``pwritev``,
headers rendered and checksummed on the IO thread), ``read_run`` (one ``preadv``, every record
verified before its bytes count), ``copy_run`` and ``sync``. It knows nothing of segments or keys'
places: callers hand it the file and the records' extents."""
from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from kvtier.errors import CorruptBlockError
from kvtier.tiers import fileio
from kvtier.tiers.dram import PAGE, round_up
from kvtier.tiers.nvme.parts import MAX_RECORDS_PER_IO, _Item
from kvtier.tiers.records import HEADER_BYTES, checksum, file_bytes_for, pack_header, unpack_header
from kvtier.tiers.threads import off_forward_cores

__all__ = ["IoEngine", "captured"]

THREAD_PREFIX = "kvtier-nvme"


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


def captured(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the exception it raised (reported per IO to the batch's caller)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported per IO to the batch's caller
        return exc


class IoEngine:
    """``io_threads`` IO threads doing record IO, O_DIRECT when ``direct``, for shard ``rank``."""

    def __init__(self, direct: bool, io_threads: int, rank: int):
        self.direct = direct
        self.rank = rank
        self.io_counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._buffers = _ThreadBuffers()
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix=THREAD_PREFIX,
                                        initializer=off_forward_cores)  # off the forward pass's cores

    # ---- threads --------------------------------------------------------------------------
    def run(self, fn: Callable[[Any], Any], ios: list) -> list:
        """``fn`` over ``ios``, several in flight (the first on this thread); exceptions returned."""
        futures = [self.submit(captured, fn, io) for io in ios[1:]]
        first = [captured(fn, ios[0])] if ios else []
        return first + [future.result() for future in futures]

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """On the IO threads; inline when already on one (``submit_write`` / ``submit_read`` run
        a whole call there: waiting on a sibling could leave every thread waiting)."""
        if threading.current_thread().name.startswith(THREAD_PREFIX):
            done: Future = Future()
            done.set_result(fn(*args))
            return done
        return self._pool.submit(fn, *args)

    def spawn(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """A whole call on an IO thread (its own IO then runs inline there)."""
        return self._pool.submit(fn, *args, **kwargs)

    def count(self, what: str) -> None:
        with self._counts_lock:
            self.io_counts[what] += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- record IO ------------------------------------------------------------------------
    def write_run(self, path: Path, io: list[_Item], fingerprint: bytes) -> None:
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
        size = sum(file_bytes_for(len(item.data)) for item in io)
        fd = fileio.open_file(path, os.O_WRONLY | (os.O_DIRECT if self.direct else 0))
        try:
            fileio.allocate(fd, io[0].extent.offset, size)  # ENOSPC here fails the run, as a short write would
            written = fileio.pwritev(fd, vectors, io[0].extent.offset)
        finally:
            fileio.close(fd)
        self.count("write_ios")
        if written != size:
            raise OSError(errno.ENOSPC, f"short write ({written} of {size} bytes)")

    def copy_run(self, path: Path, io: list[_Item]) -> None:
        """One ``pwrite`` of whole records as they are (their headers do not name their place)."""
        fd = fileio.open_file(path, os.O_WRONLY)
        try:
            data = b"".join(item.buffer for item in io)
            if fileio.pwrite(fd, data, io[0].extent.offset) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        finally:
            fileio.close(fd)

    def sync(self, path: Path) -> None:
        self.count("syncs")
        fd = fileio.open_file(path, os.O_WRONLY)
        try:
            fileio.fdatasync(fd)
        finally:
            fileio.close(fd)

    def read_run(self, where: Path, io: list[_Item], fingerprint: bytes) -> list:
        """One ``preadv`` of adjacent records from ``where``; verifies each (on this thread)."""
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
        try:
            fd = os.open(where, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except (FileNotFoundError, IsADirectoryError):
            return [CorruptBlockError(f"NVMe tier: the file holding block {item.key.hex()[:16]} vanished",
                                      path=str(where)) for item in io]
        try:
            got = fileio.preadv(fd, vectors, io[0].extent.offset)
        finally:
            os.close(fd)
        self.count("read_ios")
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
