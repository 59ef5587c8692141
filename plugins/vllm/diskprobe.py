"""The worker half's view of its disk's speed: probe reads while the disk is slow, and the injected
slow-disk fault.

* **Probes.** Once the scheduler half's cost model plans with a slow disk (``kvtier.plan.diskwatch``)
  it stops loading from NVMe, so loads no longer tell it when the disk is back. While the step
  metadata says so (``wanted``), the worker reads ``PROBE_BYTES`` of a file of its own in the NVMe
  directory once every ``PROBE_S`` (direct IO where the filesystem has it, through
  ``kvtier.tiers.fileio`` like every read of the tier) and reports the time with the next step's
  results. Nothing is read while the disk is healthy.
* **The injected fault** (benchmarks and tests only). With ``KVTIER_FAULT_FILE`` set in the
  server's environment, the worker polls that file (one ``stat``, at most every ``POLL_S``); a line
  ``nvme_slowdown=F`` makes every data IO of the NVMe tier take ``F`` times its own time
  (``fileio.set_slowdown``), ``nvme_slowdown=1`` or a missing file ends it. Each change is logged as
  an injected fault. Without the variable nothing is polled.
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from kvtier.tiers import fileio

__all__ = ["DiskProbe", "FAULT_ENV", "parse_fault"]

log = logging.getLogger("kvtier.connector")

FAULT_ENV = "KVTIER_FAULT_FILE"
POLL_S = 0.5  # the fault file, at most this often
PROBE_S = 1.0  # a probe read, at most this often, while the disk is slow
PROBE_BYTES = 2 << 20  # the NVMe tier's IO unit; the cost model's measurement reads in these too
TICK_S = 0.25


def parse_fault(text: str) -> float:
    """The slowdown a fault file asks for: ``nvme_slowdown=F`` on a line (1 when none)."""
    for line in text.splitlines():
        name, sep, value = line.partition("#")[0].partition("=")
        if sep and name.strip() == "nvme_slowdown":
            try:
                return max(1.0, float(value))
            except ValueError:
                log.warning("kvtier: fault file: bad nvme_slowdown %r", value.strip())
    return 1.0


class DiskProbe:
    """``directory``: where the probe file lives (the first NVMe directory; None: no probes).
    ``report(nbytes, seconds)``: hands a probe's time to the scheduler half. ``stats()``: the
    worker's step-path counters, logged with each fault change."""

    def __init__(self, directory: Path | None, report: Callable[[int, float], None], rank: int = 0,
                 environ: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic,
                 stats: Callable[[], dict] | None = None, drives: int = 1):
        environ = os.environ if environ is None else environ
        self.drives = max(1, drives)  # loads read every drive at once; a probe reads the first only
        self.fault_file = environ.get(FAULT_ENV) or None
        self.directory, self.report, self.clock, self.stats = directory, report, clock, stats
        self.path = directory / f".kvtier-read-probe-{rank}" if directory is not None else None
        self.wanted = False  # the scheduler half's cost model plans with a slow disk
        self.factor = 1.0  # the injected slowdown in force
        self.probes = 0
        self._fault_seen: tuple[int, int] | None = None  # (mtime_ns, size) of the fault file last read
        self._polled = self._probed = -math.inf
        self._buffer: mmap.mmap | None = None
        self._direct: int | None = None  # O_DIRECT where the directory takes it (found at the first probe)

    @classmethod
    def start(cls, store: Any, report: Callable[[int, float], None], stopping: threading.Event, rank: int = 0,
              stats: Callable[[], dict] | None = None) -> "DiskProbe | None":
        """A probe for ``store`` (an ``NvmeStore`` or a ``DriveSet``) on a thread of its own, when
        there is a disk to probe or a fault file to poll."""
        roots = getattr(store, "roots", None)
        directory = Path(roots[0]) if roots else getattr(store, "root", None)
        probe = cls(Path(directory) if directory is not None else None, report, rank, stats=stats,
                    drives=len(roots) if roots else 1)
        if probe.directory is None and probe.fault_file is None:
            return None
        threading.Thread(target=probe.run, args=(stopping,), name="kvtier-disk-probe", daemon=True).start()
        return probe

    def run(self, stopping: threading.Event) -> None:
        while not stopping.wait(TICK_S):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - a probe must never take the worker down
                log.warning("kvtier: disk probe failed: %s", exc)

    def tick(self) -> None:
        now = self.clock()
        if self.fault_file is not None and now - self._polled >= POLL_S:
            self._polled = now
            self.poll_fault()
        if self.wanted and self.path is not None and now - self._probed >= PROBE_S:
            self._probed = now
            try:
                nbytes, seconds = self.probe()
            except OSError as exc:  # a full, read-only or missing disk: the write path reports it
                log.debug("kvtier: disk probe: %s", exc)
                return
            self.probes += 1
            self.report(nbytes * self.drives, seconds)  # as much as a load reads in that time from all drives

    def poll_fault(self) -> None:
        """Apply the fault file's slowdown if the file changed (missing: no fault)."""
        assert self.fault_file is not None
        try:
            st = os.stat(self.fault_file)
            seen: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = None
        if seen == self._fault_seen:
            return
        self._fault_seen = seen
        try:
            factor = parse_fault(Path(self.fault_file).read_text()) if seen is not None else 1.0
        except OSError:
            factor = 1.0
        self.factor = factor
        fileio.set_slowdown(factor)
        stats = self.stats() if self.stats is not None else {}
        log.warning("kvtier: INJECTED FAULT (%s): NVMe tier IO now takes %gx its own time; worker %s",
                    FAULT_ENV, factor, " ".join(f"{k}={v}" for k, v in stats.items()))

    def probe(self) -> tuple[int, float]:
        """Read the probe file once (written first if missing); returns (bytes, seconds)."""
        assert self.path is not None
        from kvtier.tiers.records import probe_direct_io

        if self._buffer is None:
            self._buffer = mmap.mmap(-1, PROBE_BYTES)  # page-aligned: O_DIRECT takes it as it is
            self._buffer.write(os.urandom(PROBE_BYTES))  # not zeros: a compressing filesystem must read it
        if self._direct is None:
            self._direct = os.O_DIRECT if probe_direct_io(self.path.parent) else 0
        direct = self._direct
        if not self.path.exists() or self.path.stat().st_size < PROBE_BYTES:
            fd = fileio.open_file(self.path, os.O_WRONLY | os.O_CREAT | direct)
            try:
                fileio.pwrite(fd, self._buffer, 0)
                fileio.fdatasync(fd)
            finally:
                fileio.close(fd)
        fd = fileio.open_file(self.path, os.O_RDONLY | direct)
        try:
            if not direct:  # no direct IO here: the page cache must not answer for the disk
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            started = time.perf_counter()
            got = fileio.preadv(fd, [self._buffer], 0)
            seconds = time.perf_counter() - started
        finally:
            fileio.close(fd)
        return got, seconds
