"""A raw sequential O_DIRECT write and read of a scratch file: the disk's own speed, which the NVMe
tier's benchmarks compare it with and the cost model measures the cold tier's link by."""
from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from kvtier.tiers.records import probe_direct_io

__all__ = ["RawDirectIO", "drop_page_cache"]


class RawDirectIO:
    """Sequential O_DIRECT write / read of ``nbytes`` in ``chunk`` pieces: the disk's reference.

    The chunk defaults to the tier's IO unit (one 2 MiB block), so the ratio isolates what the
    tier adds (files, headers, checksums, fsyncs, threads) at the same IO size; an 8 MiB run is
    reported beside it for context.
    """

    def __init__(self, directory: Path, nbytes: int, chunk: int = 2 << 20):
        self.path = directory / f"raw-reference-{chunk}.bin"
        self.nbytes = nbytes
        self.chunk = chunk
        self.buffer = mmap.mmap(-1, chunk)
        self.buffer.write(os.urandom(min(chunk, 1 << 20)) * (chunk // min(chunk, 1 << 20)))
        self.direct = _direct_flag(directory)

    def write(self) -> float:
        self.path.unlink(missing_ok=True)
        start = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | self.direct, 0o600)
        try:
            for offset in range(0, self.nbytes, self.chunk):
                os.pwrite(fd, self.buffer, offset)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def read(self) -> float:
        drop_page_cache(self.path)
        start = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY | self.direct)
        try:
            for offset in range(0, self.nbytes, self.chunk):
                os.preadv(fd, [self.buffer], offset)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _direct_flag(directory: Path) -> int:
    return os.O_DIRECT if probe_direct_io(directory) else 0


def drop_page_cache(*paths: Path) -> None:
    """Evict files from the page cache (matters only when O_DIRECT is unavailable)."""
    for path in paths:
        for file in ([path] if path.is_file() else path.rglob("*")):
            if file.is_file():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
